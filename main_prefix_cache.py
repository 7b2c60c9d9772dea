"""Prefix caching: compute a shared prefix's keys and values once and start every request from them.

    python main_prefix_cache.py                             # cpu preset on CPU, gptlite on CUDA
    python main_prefix_cache.py --prefix-len 96 --request-len 16 --json pc.json --sweep --plot pc.png
    python main_prefix_cache.py --untrained                 # random weights, a quick smoke run

Blog section: "Prefix caching". Workloads, a group of rows each, every one timed side by side with
plain generate_kvcache on the full prompt and checked token for token against it:
- post: the post's experiment, `prefix_caching` below: a shared prefix (validation text, like a system
  prompt) computed once, `_, prefix_cache = model(prefix)`, then for every request
  `generate_kvcache(model, request[None], n, seqlen, kv_cache=prefix_cache)`, against
  `generate_kvcache(model, torch.cat([prefix, request[None]], dim=1), n, seqlen)`. Timed at each batch
  size (the same calls with a batch of requests); a static cache is forked per request since requests
  write it in place.
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
from dataclasses import dataclass, replace

import numpy as np
import torch

import inference_utils as iu
from gptlite_kvcache import GPTlite_KVCache, StaticKVCache, generate_kvcache
from lib import corpus, harness, serving, training
from lib.prefix_cache import PrefixCache, fork_static_cache

# ----------------------------------------------------------------------------------------------------
# The post's listing: the prefix's keys and values are computed once, every request starts from them.

@torch.inference_mode()
def prefix_caching(model, prefix, requests, n_tokens, seqlen):
    """prefix: [1, P] token ids shared by every request; requests: 1-D token ids each.
    Returns, per request, the request followed by its n_tokens new tokens, [1, R + n_tokens]."""
    _, prefix_cache = model(prefix)  # a list of (keys, values) [1, H, P, D] per layer
    outputs = []
    for request in requests:
        # the dynamic cache grows with torch.cat (new tensors): no request modifies prefix_cache
        outputs.append(generate_kvcache(model, request[None], n_tokens, seqlen, kv_cache=prefix_cache))
    return outputs


@torch.inference_mode()
def no_prefix_caching(model, prefix, requests, n_tokens, seqlen):
    """The baseline: every request prefills prefix + request. Returns [1, P + R + n_tokens] per request."""
    return [generate_kvcache(model, torch.cat([prefix, request[None]], dim=1), n_tokens, seqlen)
            for request in requests]


# ----------------------------------------------------------------------------------------------------
# The measurements around it.

@dataclass(frozen=True)
class Setting:
    """What every timed pair shares (read-only)."""
    device: torch.device
    seqlen: int
    n_tokens: int
    repeats: int
    timed: bool = True  # False: the check pass, every variant's tokens and nothing timed


def check_args(args, parser, preset):
    seqlen = preset.seqlen
    if args.prefix_len + args.request_len > seqlen:
        parser.error(f"--prefix-len + --request-len = {args.prefix_len + args.request_len} exceeds the model's "
                     f"seqlen={seqlen}: the prefix could not be reused exactly (positions are absolute)")
    if args.block_size > seqlen:
        parser.error(f"--block-size must be at most seqlen={seqlen}, got {args.block_size}")
    if args.capacity_tokens < args.block_size:
        parser.error(f"--capacity-tokens must hold one block of {args.block_size}, got {args.capacity_tokens}")
    harness.check_sweep_flags(parser, args, "the TTFT sweep")
    batch = max(args.batch_sizes)  # a forward over the window, and its cache, forked for the static variant
    harness.check_fits(parser, "--batch-sizes", 2 * serving.forward_bytes(preset, batch),
                       f"a batch of {batch} through the model")
    for flag, count in (("--n-requests", args.n_requests), ("--turns", args.turns)):  # texts, prompts, outputs
        harness.check_fits(parser, flag, serving.trace_bytes(preset, count, copies=2),
                           f"{count} requests of up to seqlen={seqlen} tokens")
    length = seqlen + args.n_tokens  # a prompt of up to the window, then its new tokens, 4 sets of them
    harness.check_fits(parser, "--n-tokens", 2 * serving.forward_bytes(preset, batch) + 4 * batch * length * 8,
                       f"{batch} sequences of {length} tokens")


def timed_rows(workload, fns, batch_size, prompt_tokens, hit_tokens, kv_bytes, setting):
    """A row per variant, 'no prefix cache' first, timed round-robin in one call; every variant's
    tokens must equal the first's."""
    n = setting.n_tokens
    expected = fns["no prefix cache"](n)
    same = {name: "yes" if torch.equal(fn(n), expected) else "NO" for name, fn in fns.items()}
    if not setting.timed:  # the check pass
        return [dict(workload=workload, variant=name, batch_size=batch_size, same_tokens=same[name]) for name in fns]
    timings = iu.compare_generation(fns, n, batch_size, setting.device, repeats=setting.repeats)
    rows = []
    for name, fn in fns.items():
        cached = name != "no prefix cache"
        hit = hit_tokens if cached else 0
        rows.append(harness.make_row(name, **timings[name], peak_mem_mb=iu.peak_memory_mb(lambda: fn(n), setting.device),
                                kv_cache_mb=kv_bytes[name] / 2**20 if cached else None,
                                workload=workload, batch_size=batch_size, prompt_tokens=prompt_tokens,
                                hit_tokens=hit, hit_rate=f"{hit / prompt_tokens:.0%}",
                                ttft_speedup=round(timings["no prefix cache"]["ttft_ms"] / timings[name]["ttft_ms"], 2),
                                same_tokens=same[name]))
    return rows


def post_rows(model, prefix, requests, setting):
    """The post's calls on a batch of requests [B, R] at once: the shared prefix [1, P] expanded to B."""
    batch_size, P, seqlen = requests.shape[0], prefix.shape[1], setting.seqlen
    prefix = prefix.expand(batch_size, -1)  # [B, P]
    full = torch.cat([prefix, requests], dim=1)  # [B, P + R]
    static = StaticKVCache.for_model(model, batch_size, seqlen)
    with torch.inference_mode():
        _, dynamic = model(prefix)
        model(prefix, kv_cache=static)
    fns = {"no prefix cache": lambda n: generate_kvcache(model, full, n, seqlen)[:, P:],  # request + new tokens
           "prefix cache (post)": lambda n: generate_kvcache(model, requests, n, seqlen, kv_cache=dynamic),
           "prefix cache, static forked": lambda n: generate_kvcache(model, requests, n, seqlen,
                                                                     kv_cache=fork_static_cache(static))}
    kv_bytes = {"prefix cache (post)": iu.kv_cache_bytes(dynamic), "prefix cache, static forked": static.nbytes}
    return timed_rows(f"post, {P}+{requests.shape[1]}", fns, batch_size, full.shape[1], P, kv_bytes, setting)


def store_rows(workload, store, prompt, setting):
    """'no prefix cache' against the store (update=False: every repeat meets the same store)."""
    seqlen = setting.seqlen
    fns = {"no prefix cache": lambda n: generate_kvcache(store.model, prompt[None, -seqlen:], n, seqlen),
           "PrefixCache store": lambda n: store.generate(prompt, n, seqlen, update=False).tokens}
    hit = store.generate(prompt, setting.n_tokens, seqlen, update=False).hit_tokens
    return timed_rows(workload, fns, 1, min(len(prompt), seqlen), hit, {"PrefixCache store": store.nbytes}, setting)


def serve(store, prompt, setting):
    """A request the store serves for real (update=True), and whether its tokens equal plain generation's."""
    out = store.generate(prompt, setting.n_tokens, setting.seqlen)
    expected = generate_kvcache(store.model, prompt[None, -setting.seqlen:], setting.n_tokens, setting.seqlen)
    return out, torch.equal(out.tokens, expected)


def system_prompt_workload(store, system, questions, setting):
    """A stream of questions after one system prompt, then the rows of an unseen question, of a system
    prompt whose second token differs, and the check that a prompt longer than seqlen falls back.
    Returns rows, the store's stats over the stream, the fallback line and the failures."""
    failures = [f"store request {i}" for i, q in enumerate(questions[:-1])
                if not serve(store, torch.cat([system, q]), setting)[1]]
    stats = dict(store.stats(), cache_bytes=store.nbytes)  # over the stream, the first question misses
    rows = store_rows("system prompt + question", store, torch.cat([system, questions[-1]]), setting)
    wrong = system.clone()
    wrong[1] = (wrong[1] + 1) % store.model.config.vocab_size
    rows += store_rows("one early token differs", store, torch.cat([wrong, questions[-1]]), setting)

    text = torch.cat([system, questions.flatten()])
    n_long = setting.seqlen + questions.shape[1]
    out, same = serve(store, text.repeat(n_long // len(text) + 1)[:n_long], setting)
    failures += [] if same and out.fallback else ["the prompt longer than seqlen"]
    fallback = (f"a prompt of {n_long} tokens > seqlen={setting.seqlen}: "
                f"{'fallback to plain generation (no reuse), counted' if out.fallback else 'NO FALLBACK'} "
                f"(fallbacks: {store.stats()['fallbacks']}); tokens identical to generate_kvcache on "
                f"its last {setting.seqlen} tokens: {'yes' if same else 'NO'}")
    return rows, stats, fallback, failures


def multi_turn_workload(store, messages, setting):
    """Each turn's prompt is the previous prompt, its answer and a new message."""
    rows, failures, sequence = [], [], None  # sequence: the last turn's prompt and answer
    for turn, message in enumerate(messages, 1):
        prompt = message if sequence is None else torch.cat([sequence, message])
        rows += store_rows(f"multi-turn, turn {turn}", store, prompt, setting)
        out, same = serve(store, prompt, setting)
        sequence = out.tokens[0]
        failures += [] if same else [f"multi-turn, turn {turn}"]
    return rows, store.stats(), failures


def ttft_sweep(model, prefix, requests, batch_sizes, prefix_len, setting):
    """TTFT against the shared prefix length, with and without the post's prefix cache, at each batch
    size. prefix: [1, seqlen - R], cut to each length; requests: [max batch, R]."""
    lengths = sorted(set(range(16, prefix.shape[1] + 1, 16)) | {prefix_len, prefix.shape[1]})
    sweep = {}
    for batch_size in batch_sizes:
        request, curves = requests[:batch_size], {"no prefix cache": [], "prefix cache (post)": []}
        for p in lengths:
            shared = prefix[:, :p].expand(batch_size, -1)  # [B, p]
            with torch.inference_mode():
                _, cache = model(shared)
            full = torch.cat([shared, request], dim=1)
            fns = {"no prefix cache": lambda n: generate_kvcache(model, full, n, setting.seqlen),
                   "prefix cache (post)": lambda n: generate_kvcache(model, request, n, setting.seqlen, kv_cache=cache)}
            timings = iu.compare_generation(fns, 2, batch_size, setting.device, repeats=setting.repeats)
            for name in curves:
                curves[name].append(timings[name]["ttft_ms"])
        sweep[batch_size] = {"prefix_len": lengths, **curves}
    return sweep


def plot_sweep(sweep, request_len, preset, device):
    fig, axes = harness.new_figure(len(sweep))
    for ax, (batch_size, curves) in zip(np.atleast_1d(axes), sweep.items()):
        for name in ("no prefix cache", "prefix cache (post)"):
            ax.plot(curves["prefix_len"], curves[name], marker="o", label=name)
        ax.set(xlabel="shared prefix length (tokens)", ylabel="TTFT (ms)", ylim=(0, None),
               title=f"prefix + {request_len}-token request, batch {batch_size} ({preset.name}, {device})")
        ax.legend()
    return fig


def workloads(model, prefix, texts, args, setting):
    """Every workload's rows, the stores' stats and the fallback line (setting.timed False: only the
    tokens, nothing timed), and {check: ok}: every variant's tokens equal generation without the cache."""
    rows = [row for batch_size in args.batch_sizes for row in post_rows(model, prefix, texts[:batch_size], setting)]
    store = PrefixCache(model, block_size=args.block_size, capacity_tokens=args.capacity_tokens)
    system_rows, system_stats, fallback, failures = system_prompt_workload(store, prefix[0], texts[:args.n_requests],
                                                                           setting)
    store = PrefixCache(model, block_size=args.block_size, capacity_tokens=args.capacity_tokens)
    turn_rows, turn_stats, turn_failures = multi_turn_workload(store, texts[:args.turns], setting)
    rows += system_rows + turn_rows
    checks = {f"{name}: tokens equal generation without prefix caching": False for name in failures + turn_failures}
    checks |= {f"{r['workload']}: {r['variant']} (batch {r['batch_size']}): tokens equal generation without prefix "
               "caching": r["same_tokens"] == "yes" for r in rows}
    return rows, dict(system_prompt_stats=system_stats, multi_turn_stats=turn_stats, fallback=fallback), checks


def headline(rows, prefix_len, request_len):
    """The README's one-glance row, from this run's rows: TTFT without / with the cache."""
    post, store = f"post, {prefix_len}+{request_len}", "system prompt + question"
    ttft = {(r["workload"], r["variant"], r["batch_size"]): r["ttft_ms"] for r in rows}

    def gain(variant, workload, batch):
        value = iu.ratio(ttft[workload, "no prefix cache", batch], ttft[workload, variant, batch])
        return "-" if value is None else f"{value:.2f}x"

    batches = sorted({r["batch_size"] for r in rows if r["workload"] == post}, reverse=True)
    return {"technique": f"prefix caching, {prefix_len}-token prefix + {request_len}-token requests",
            "figure": "TTFT without / with the post's cache: " + ", ".join(
                f"{gain('prefix cache (post)', post, b)} at batch {b}" for b in batches)
            + f"; the PrefixCache store {gain('PrefixCache store', store, 1)} at batch 1; identical tokens"}


def parse_args(argv):
    """The flags, checked before any work: (args, preset, device, data)."""
    parser = harness.script_parser(__doc__)
    at_least = harness.int_at_least
    parser.add_argument("--prefix-len", type=at_least(1), default=96, help="tokens of the shared prefix (system prompt)")
    parser.add_argument("--request-len", type=at_least(1), default=16,
                        help="tokens of each request after the prefix, and of each multi-turn message")
    harness.add_generation_flags(parser, n_tokens=16, repeats=10)
    harness.add_sweep_flags(parser, "batch sizes of the post's experiment, a row group each",
                            "also time TTFT against the shared prefix length (16 to seqlen - --request-len), with "
                            "and without the post's cache, at each batch size: the JSON's ttft_sweep, what --plot "
                            "draws")
    parser.add_argument("--n-requests", type=at_least(2), default=8,
                        help="questions after the shared system prompt served by the store (the last one is timed)")
    parser.add_argument("--turns", type=at_least(2), default=4, help="turns of the multi-turn conversation")
    parser.add_argument("--block-size", type=at_least(1), default=16, help="tokens per block of the PrefixCache store")
    parser.add_argument("--capacity-tokens", type=at_least(1, 1 << 24), default=4096,
                        help="tokens the store holds before evicting least recently used blocks")
    args = parser.parse_args(argv)
    return (args, *harness.setup(args, parser, lambda preset: check_args(args, parser, preset)))


def main(argv=None):
    args, preset, device, data = parse_args(argv)
    model = iu.load_model(GPTlite_KVCache, preset, device, data, untrained=args.untrained, seed=args.seed)
    setting = Setting(device, preset.seqlen, args.n_tokens, args.repeats)
    prefix = corpus.sample_prompts(data, 1, args.prefix_len, seed=args.seed, device=device)  # [1, P]
    n_texts = max(args.batch_sizes + [args.n_requests, args.turns])
    texts = corpus.sample_prompts(data, n_texts, args.request_len, seed=args.seed + 1, device=device)  # [N, R]

    # the post's listing as written, one request at a time: the same tokens as without the cache
    P = prefix.shape[1]
    listing_same = all(torch.equal(c, p[:, P:]) for c, p in zip(
        prefix_caching(model, prefix, texts, args.n_tokens, preset.seqlen),
        no_prefix_caching(model, prefix, texts, args.n_tokens, preset.seqlen)))
    checks = {"the post's listing, one request at a time: tokens equal generation without prefix caching":
              listing_same} | workloads(model, prefix, texts, args, replace(setting, timed=False))[2]
    harness.require_checks(checks)  # a check pass first: nothing timed or written if a variant's tokens differ

    val_loss = training.validation_loss(model, data)
    rows, stats, checks = workloads(model, prefix, texts, args, setting)
    harness.require_checks(checks)  # the timed pass's own tokens, checked again
    sweep = None
    if args.sweep:
        longest = corpus.sample_prompts(data, 1, preset.seqlen - args.request_len, seed=args.seed, device=device)
        sweep = ttft_sweep(model, longest, texts, args.batch_sizes, args.prefix_len, setting)
    print(f"\nshared prefix of {args.prefix_len} tokens, requests of {args.request_len}, {args.n_tokens} new tokens, "
          f"blocks of {args.block_size}, window seqlen={preset.seqlen}, median of {args.repeats} runs; "
          f"validation loss {val_loss:.4f} (the same model in every row)")
    harness.report(args, "main_prefix_cache.py", preset, device, rows, headline(rows, args.prefix_len, args.request_len),
                   summary=summary_lines(stats, len(texts), device), plot=lambda: plot_sweep(sweep, args.request_len,
                                                                                             preset, device),
                   val_loss=val_loss, prefix_len=args.prefix_len, request_len=args.request_len,
                   n_tokens=args.n_tokens, block_size=args.block_size, ttft_sweep=sweep, **stats)


def summary_lines(stats, n_texts, device):
    """The lines under the table: what the columns mean, the stores over their streams, the fallback."""
    lines = [iu.peak_memory_label(device),
             "KV MB: keys and values kept for reuse (the shared prefix cache, or the whole store); hit_rate: "
             "prompt tokens of the timed request taken from the cache",
             f"the post's listing, {n_texts} requests one at a time: tokens identical to no prefix cache: yes"]
    for name, key in [("system prompt store", "system_prompt_stats"), ("multi-turn store", "multi_turn_stats")]:
        s = stats[key]
        lines.append(f"{name}: {s['requests']} requests, hit rate {s['hit_rate']:.0%} "
                     f"({s['hit_tokens']}/{s['prompt_tokens']} tokens), {s['blocks']} blocks "
                     f"({s['cache_bytes'] / 2**20:.3f} MB), {s['evictions']} evictions")
    return lines + [stats["fallback"]]


if __name__ == "__main__":
    harness.run(main)
