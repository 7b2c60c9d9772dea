"""Prefix caching: compute a shared prefix's keys and values once and start every request from them.

    python main_prefix_cache.py                             # cpu preset on CPU, gptlite on CUDA
    python main_prefix_cache.py --prefix-len 96 --request-len 16 --json pc.json --plot pc.png
    python main_prefix_cache.py --untrained                 # random weights, a quick smoke run

Blog section: "Prefix caching". Workloads, a group of rows each, every one timed side by side with
plain generate_kvcache on the full prompt and checked token for token against it:
- post: the post's experiment, a shared prefix (validation text, like a system prompt) + one request
  per sequence, at each batch size: `_, prefix_cache = model(prefix)` once, then
  `generate_kvcache(model, request, n, seqlen, kv_cache=prefix_cache)`; a static cache is forked
  per request since requests write it in place.
- system prompt + questions: the PrefixCache store (vLLM-style hashed blocks, LRU) serves a stream of
  questions after one system prompt; the hit rate counts every question, the timing is one more.
- multi-turn, turn k: each prompt is the previous prompt + the answer + a new message; the store holds
  the answers too, so a turn prefills little more than its new message. Hit rate per turn.
- one early token differs: the system prompt with its second token changed misses every block: the
  prefix must match exactly, from the first token.
The timed store requests use `update=False`, so that every repeat meets the same state of the store.
A prompt longer than seqlen cannot reuse blocks (positions are absolute): the script sends one and
checks that the store falls back to plain generation, counted and said.
"""
import argparse

import numpy as np
import torch

import inference_utils as iu
from gptlite_kvcache import GPTlite_KVCache, StaticKVCache, generate_kvcache
from prefix_cache import PrefixCache, compute_prefix_cache, generate_with_prefix_cache


def check_args(args, parser, seqlen):
    for flag, value, low in [("--prefix-len", args.prefix_len, 1), ("--request-len", args.request_len, 1),
                             ("--n-tokens", args.n_tokens, 2), ("--batch-sizes", min(args.batch_sizes), 1),
                             ("--n-requests", args.n_requests, 2), ("--turns", args.turns, 2),
                             ("--block-size", args.block_size, 1), ("--repeats", args.repeats, 1)]:
        if value < low:
            parser.error(f"{flag} must be at least {low}, got {value}")
    if args.prefix_len + args.request_len > seqlen:
        parser.error(f"--prefix-len + --request-len = {args.prefix_len + args.request_len} exceeds the model's "
                     f"seqlen={seqlen}: the prefix could not be reused exactly (positions are absolute)")
    if args.block_size > seqlen:
        parser.error(f"--block-size must be at most seqlen={seqlen}, got {args.block_size}")
    if args.capacity_tokens < args.block_size:
        parser.error(f"--capacity-tokens must hold one block of {args.block_size}, got {args.capacity_tokens}")
    if len(set(args.batch_sizes)) != len(args.batch_sizes):
        parser.error(f"--batch-sizes repeats a value: {args.batch_sizes}")


def make_row(workload, variant, timing, reference, batch_size, prompt_tokens, hit_tokens, same, **figures):
    return iu.make_row(variant, **timing, **figures, workload=workload, batch_size=batch_size,
                       prompt_tokens=prompt_tokens, hit_tokens=hit_tokens,
                       hit_rate=f"{hit_tokens / prompt_tokens:.0%}",
                       ttft_speedup=f"{reference['ttft_ms'] / timing['ttft_ms']:.2f}x",
                       same_tokens="yes" if same else "NO")


def timed_pair(workload, fns, expected, n_tokens, batch_size, prompt_tokens, hit_tokens, kv_bytes, args, ctx):
    """Two rows, 'no prefix cache' then the cached variant(s), timed round-robin in one call."""
    timings = iu.compare_generation(fns, n_tokens, batch_size, ctx["device"], repeats=args.repeats)
    reference = timings["no prefix cache"]
    rows = []
    for name, fn in fns.items():
        cached = name != "no prefix cache"
        rows.append(make_row(workload, name, timings[name], reference, batch_size, prompt_tokens,
                             hit_tokens if cached else 0, torch.equal(fn(n_tokens), expected),
                             peak_mem_mb=iu.peak_memory_mb(lambda: fn(n_tokens), ctx["device"]),
                             kv_cache_mb=kv_bytes[name] / 2**20 if cached else None, val_loss=ctx["val_loss"]))
    return rows


def post_experiment(model, prefix, requests, args, ctx):
    """The post's experiment at one batch size: the shared prefix computed once, dynamic and static."""
    n, seqlen, batch_size = args.n_tokens, ctx["seqlen"], requests.shape[0]
    prefix = prefix.expand(batch_size, -1)  # [B, P] one shared prefix
    full = torch.cat([prefix, requests], dim=1)  # [B, P + R]
    dynamic = compute_prefix_cache(model, prefix)
    static = StaticKVCache.for_model(model, batch_size, seqlen)
    with torch.inference_mode():
        model(prefix, kv_cache=static)
    fns = {"no prefix cache": lambda n: generate_kvcache(model, full, n, seqlen),
           "prefix cache (post)": lambda n: generate_with_prefix_cache(model, prefix, dynamic, requests, n, seqlen)[0],
           "prefix cache, static forked": lambda n: generate_with_prefix_cache(model, prefix, static, requests, n,
                                                                             seqlen)[0]}
    kv_bytes = {"prefix cache (post)": iu.kv_cache_bytes(dynamic), "prefix cache, static forked": static.nbytes}
    expected = fns["no prefix cache"](n)
    return timed_pair(f"post, {args.prefix_len}+{args.request_len}", fns, expected, n, batch_size,
                      full.shape[1], prefix.shape[1], kv_bytes, args, ctx)


def store_pair(workload, store, prompt, args, ctx):
    """'no prefix cache' against the store (update=False: every repeat meets the same store)."""
    n, seqlen = args.n_tokens, ctx["seqlen"]
    fns = {"no prefix cache": lambda n: generate_kvcache(store.model, prompt[None, -seqlen:], n, seqlen),
           "PrefixCache store": lambda n: store.generate(prompt, n, seqlen, update=False).tokens}
    hit = store.generate(prompt, n, seqlen, update=False).hit_tokens
    return timed_pair(workload, fns, fns["no prefix cache"](n), n, 1, min(len(prompt), seqlen), hit,
                      {"PrefixCache store": store.nbytes}, args, ctx)


def served(store, prompt, args, ctx):
    """A request the store serves for real (update=True); its tokens must equal plain generation's."""
    out = store.generate(prompt, args.n_tokens, ctx["seqlen"])
    expected = generate_kvcache(store.model, prompt[None, -ctx["seqlen"]:], args.n_tokens, ctx["seqlen"])
    out.same = torch.equal(out.tokens, expected)
    if not out.same:
        ctx["failures"].append(f"store request of {len(prompt)} tokens")
    return out


def new_store(model, args):
    return PrefixCache(model, block_size=args.block_size, capacity_tokens=args.capacity_tokens)


def system_prompt_workload(model, system, questions, args, ctx):
    store = new_store(model, args)
    for question in questions[:-1]:
        served(store, torch.cat([system, question]), args, ctx)
    stats = store.stats()  # over the stream of questions, the first of which misses
    rows = store_pair("system prompt + question", store, torch.cat([system, questions[-1]]), args, ctx)  # unseen
    wrong = system.clone()
    wrong[1] = (wrong[1] + 1) % model.token_embedding.num_embeddings
    rows += store_pair("one early token differs", store, torch.cat([wrong, questions[-1]]), args, ctx)

    text, n_long = torch.cat([system, questions.flatten()]), ctx["seqlen"] + args.request_len
    long_prompt = text.repeat(n_long // len(text) + 1)[:n_long]
    out = served(store, long_prompt, args, ctx)
    ctx["fallback"] = (f"a prompt of {n_long} tokens > seqlen={ctx['seqlen']}: "
                       f"{'fallback to plain generation (no reuse), counted' if out.fallback else 'NO FALLBACK'} "
                       f"(fallbacks: {store.stats()['fallbacks']}); tokens identical to generate_kvcache on "
                       f"its last {ctx['seqlen']} tokens: {'yes' if out.same else 'NO'}")
    if not out.fallback:
        ctx["failures"].append("the prompt longer than seqlen did not fall back")
    return rows, dict(stats, cache_bytes=store.nbytes)


def multi_turn_workload(model, messages, args, ctx):
    store, rows, prompt = new_store(model, args), [], messages[0]
    for turn, message in enumerate(messages, 1):
        if turn > 1:
            prompt = torch.cat([prompt, answer, message])
        rows += store_pair(f"multi-turn, turn {turn}", store, prompt, args, ctx)
        answer = served(store, prompt, args, ctx).tokens[0]
    return rows, store.stats()


def ttft_sweep(model, prefix, requests, args, ctx):
    """TTFT against the shared prefix length, with and without the post's prefix cache, at each batch
    size. prefix: [1, seqlen - R], cut to each length; requests: [max batch, R]."""
    lengths = sorted(set(range(16, prefix.shape[1] + 1, 16)) | {args.prefix_len, prefix.shape[1]})
    sweep = {}
    for batch_size in args.batch_sizes:
        request, curves = requests[:batch_size], {"no prefix cache": [], "prefix cache (post)": []}
        for p in lengths:
            shared = prefix[:, :p].expand(batch_size, -1)  # [B, p]
            cache, full = compute_prefix_cache(model, shared), torch.cat([shared, request], dim=1)
            fns = {"no prefix cache": lambda n: generate_kvcache(model, full, n, ctx["seqlen"]),
                   "prefix cache (post)": lambda n: generate_kvcache(model, request, n, ctx["seqlen"], kv_cache=cache)}
            timings = iu.compare_generation(fns, 2, batch_size, ctx["device"], repeats=args.repeats)
            for name in curves:
                curves[name].append(timings[name]["ttft_ms"])
        sweep[batch_size] = {"prefix_len": lengths, **curves}
    return sweep


def plot_sweep(sweep, path, args, preset, device):
    fig, axes = iu.new_figure(len(sweep))
    for ax, (batch_size, curves) in zip(np.atleast_1d(axes), sweep.items()):
        for name in ("no prefix cache", "prefix cache (post)"):
            ax.plot(curves["prefix_len"], curves[name], marker="o", label=name)
        ax.set(xlabel="shared prefix length (tokens)", ylabel="TTFT (ms)", ylim=(0, None),
               title=f"prefix + {args.request_len}-token request, batch {batch_size} ({preset.name}, {device})")
        ax.legend()
    iu.save_plot(fig, path)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    iu.add_common_args(parser)
    parser.add_argument("--prefix-len", type=int, default=96, help="tokens of the shared prefix (system prompt)")
    parser.add_argument("--request-len", type=int, default=16,
                        help="tokens of each request after the prefix, and of each multi-turn message")
    parser.add_argument("--n-tokens", type=int, default=16, help="new tokens per request (at least 2)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8],
                        help="batch sizes of the post's experiment, a row group each")
    parser.add_argument("--n-requests", type=int, default=8,
                        help="questions after the shared system prompt served by the store (the last one is timed)")
    parser.add_argument("--turns", type=int, default=4, help="turns of the multi-turn conversation")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per block of the PrefixCache store")
    parser.add_argument("--capacity-tokens", type=int, default=4096,
                        help="tokens the store holds before evicting least recently used blocks")
    parser.add_argument("--repeats", type=int, default=10, help="timed runs per figure, median taken (after one warm-up)")
    args = parser.parse_args(argv)
    preset, device, data = iu.setup(args, parser, lambda preset: check_args(args, parser, preset.seqlen))

    model = iu.load_model(GPTlite_KVCache, preset, device, data, untrained=args.untrained, seed=args.seed)
    ctx = dict(device=device, seqlen=preset.seqlen, val_loss=iu.validation_loss(model, data), failures=[])
    prefix = iu.sample_prompts(data, 1, args.prefix_len, seed=args.seed, device=device)  # [1, P]
    n_texts = max(args.batch_sizes + [args.n_requests, args.turns])
    texts = iu.sample_prompts(data, n_texts, args.request_len, seed=args.seed + 1, device=device)  # [N, R]

    rows = []
    for batch_size in args.batch_sizes:
        rows += post_experiment(model, prefix, texts[:batch_size], args, ctx)
    system_rows, system_stats = system_prompt_workload(model, prefix[0], texts[:args.n_requests], args, ctx)
    turn_rows, turn_stats = multi_turn_workload(model, texts[:args.turns], args, ctx)
    rows += system_rows + turn_rows
    failures = ctx["failures"] + [f"{r['workload']}: {r['variant']} (batch {r['batch_size']})"
                                  for r in rows if r["same_tokens"] != "yes"]

    print(f"\nshared prefix of {args.prefix_len} tokens, requests of {args.request_len}, {args.n_tokens} new tokens, "
          f"blocks of {args.block_size}, window seqlen={preset.seqlen}, median of {args.repeats} runs")
    iu.print_table(rows, untrained=args.untrained)
    print(iu.peak_memory_label(device))
    print("KV MB: keys and values kept for reuse (the shared prefix cache, or the whole store); hit_rate: prompt "
          "tokens of the timed request taken from the cache")
    for name, stats in [("system prompt store", system_stats), ("multi-turn store", turn_stats)]:
        print(f"{name}: {stats['requests']} requests, hit rate {stats['hit_rate']:.0%} "
              f"({stats['hit_tokens']}/{stats['prompt_tokens']} tokens), {stats['blocks']} blocks "
              f"({stats['cache_bytes'] / 2**20:.3f} MB), {stats['evictions']} evictions")
    print(ctx["fallback"])

    sweep = None
    if args.plot:
        longest = iu.sample_prompts(data, 1, preset.seqlen - args.request_len, seed=args.seed, device=device)
        sweep = ttft_sweep(model, longest, texts, args, ctx)
        plot_sweep(sweep, args.plot, args, preset, device)
    if args.json:
        iu.save_json(args.json, "main_prefix_cache.py", preset, device, rows, untrained=args.untrained,
                     prefix_len=args.prefix_len, request_len=args.request_len, n_tokens=args.n_tokens,
                     block_size=args.block_size, system_prompt_stats=system_stats, multi_turn_stats=turn_stats,
                     fallback=ctx["fallback"], ttft_sweep=sweep)
    if failures:
        raise iu.GPTliteError(f"{', '.join(failures)}: tokens differ from generation without prefix caching; "
                              "this is a bug")


if __name__ == "__main__":
    iu.run(main)
