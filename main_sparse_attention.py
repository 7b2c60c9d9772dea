"""KV budgets without retraining: sliding window, attention sinks (StreamingLLM), H2O, SnapKV and Quest.

    python main_sparse_attention.py                 # cpu preset on CPU (the first run trains checkpoints/cpu_rope.pt)
    python main_sparse_attention.py --budgets 8 16 32 64 --stream-chars 16000 --json sparse.json --plot sparse.png
    python main_sparse_attention.py --untrained --n-windows 4 --stream-chars 1200   # a quick smoke run

Blog section: "Sparse attention and KV-cache budgets". Each method keeps or reads at most `budget` cache
entries per layer and head at a decode step (kv_budget.py); a budget of the whole context is dense attention.
1. Checks first: every method at a full budget gives generate_kvcache's tokens; the budgeted dense path
   gives the full forward pass's logits; the rotary GPTlite's cached decode gives its full forward pass's.
2. Quality at each budget: validation loss with the method applied at every position (teacher forcing,
   one token at a time), greedy-token agreement with dense attention, KV bytes kept and read per step.
3. Streaming far past the 128-token window, every next character scored: dense re-encoding of the last W
   tokens (the exact reference), a window-only cache and 4 sinks + window on the rotary GPTlite (keys
   cached before rotation, positions = slots), and the post's clamp-at-seqlen-1 cache on GPTlite.
"""

import torch
import torch.nn.functional as F
from tqdm import tqdm

import inference_utils as iu
from gptlite import GPTlite
from gptlite_kvcache import generate_kvcache
from gptlite_rope import load_rope
from lib import attention_benchmark as ab
from lib import corpus, harness
from lib import kv_budget as kb
from lib import training

METHODS = ["window", "sinks", "H2O", "SnapKV", "Quest"]


# The post's listing: one decode step under a budget (kv_budget.forward_budget, per layer).
#   kv = append(cache[layer], K, V)               # the new token's entry
#   mask = method.select(Q, K_all)                # Quest: the top pages by bound; the others: all kept
#   out, weights = attend(Q, K_all, V_all, mask)  # explicit softmax attention
#   method.observe(kv, Q, weights)                # H2O: accumulate weights; SnapKV: last queries
#   cache[layer] = gather(kv, method.keep(kv))    # evict down to budget - 1 entries


@torch.inference_mode()
def run_checks(base, cached, rope, windows, prompts, n_tokens, methods_full):
    """Exactness before any figure: {name: bool}."""
    ref = generate_kvcache(cached, prompts, n_tokens, base.seqlen)
    checks = {f"{m.name} at budget {m.budget}: dense tokens": torch.equal(kb.generate_budget(base, prompts, n_tokens, m),
                                                                          ref) for m in methods_full}
    x = windows[:4]
    checks["budgeted dense logits = full forward"] = (kb.teacher_forced_logits(base, x, kb.Dense())
                                                      - base(x)).abs().max().item() <= 1e-4
    checks["rotary: cached decode = full forward"] = training.cached_matches_full(rope, x)
    checks["rotary: budgeted dense = full forward"] = (kb.teacher_forced_logits(rope, x, kb.Dense())
                                                       - rope(x)[0]).abs().max().item() <= 1e-4
    return checks


@torch.inference_mode()
def quality_rows(base, windows, prompts, n_tokens, budgets, n_sink, page_size):
    """Loss (teacher forcing at every position), greedy agreement with dense, KV bytes kept and read."""
    cfg = base.config
    dense_tokens = kb.generate_budget(base, prompts, n_tokens, kb.Dense())[:, prompts.shape[1]:]
    variants = [kb.Dense()] + [kb.make_method(name, b, n_sink, page_size) for b in budgets for name in METHODS]
    rows = []
    for method in tqdm(variants, desc="methods x budgets", dynamic_ncols=True):
        logits = kb.teacher_forced_logits(base, windows[:, :-1], method)  # [N, S, vocab]
        loss = F.cross_entropy(logits.flatten(0, 1), windows[:, 1:].flatten()).item()
        tokens = kb.generate_budget(base, prompts, n_tokens, method)[:, prompts.shape[1]:]
        same = tokens == dense_tokens  # [B, n_tokens]
        first_diff = torch.where(same.all(dim=1), n_tokens, (~same).float().argmax(dim=1)).float().mean().item()
        kept, read = kb.kv_bytes(method, base.seqlen, cfg.n_layers, cfg.n_heads, cfg.d_head)
        dense = rows[0]["val_loss"] if rows else loss
        rows.append(harness.make_row(f"{method.name}" + (f" {method.budget}" if method.budget else ""), method=method.name,
                                budget=method.budget or base.seqlen, val_loss=loss,
                                loss_vs_dense=round(loss - dense, 4), agree=round(same.float().mean().item(), 3),
                                first_diff=round(first_diff, 1), kv_kept_kb=kept / 1024, kv_read_kb=read / 1024))
    return rows


@torch.inference_mode()
def reencoding_logits(model, stream, W, batch=64):
    """The reference: the logits of every position, each from a dense pass over its last W tokens. [S, vocab]"""
    first = training.logits_of(model(stream[None, :W]))[0]  # positions 0..W-1: their whole past fits
    windows = stream.unfold(0, W, 1)[1:]  # [S-W, W]: the window ending at each later position
    rest = [training.logits_of(model(w))[:, -1] for w in tqdm(windows.split(batch), desc="re-encoding reference",
                                                         dynamic_ncols=True, leave=False)]
    return torch.cat([first] + rest)


@torch.inference_mode()
def reencoding_stream(model, tokens, W):
    """The reference as a stream really runs it, one token at a time: a dense pass over the last W tokens."""
    return torch.cat([training.logits_of(model(tokens[:, max(t - W + 1, 0):t + 1]))[:, -1:]
                      for t in range(tokens.shape[1])], dim=1)


@torch.inference_mode()
def post_cache_logits(cached, tokens, progress=None):
    """The post's cache, teacher forced: past seqlen it drops the oldest entry, new tokens at position seqlen-1."""
    logits, cache = [], None
    for t in (progress or (lambda r: r))(range(tokens.shape[1])):
        out, cache = cached(tokens[:, t:t + 1], cache)
        logits.append(out)
    return torch.cat(logits, dim=1)


def stream_variants(base, cached, rope, W, n_sink):
    """{name: (score, step)}: score(tokens [1, S]) -> (logits [1, S, vocab], the budget cache or None);
    step(tokens) streams them one at a time as a deployment would (timed; the reference's score is batched)."""
    bar = lambda desc: (lambda r: tqdm(r, desc=desc, dynamic_ncols=True, leave=False))  # noqa: E731
    variants = {}
    for name, model in (("GPTlite", base), ("rotary", rope)):
        variants[f"{name}: re-encode last {W}"] = (lambda x, m=model: (reencoding_logits(m, x[0], W)[None], None),
                                                   lambda x, m=model: reencoding_stream(m, x, W))
    post = lambda x: (post_cache_logits(cached, x, bar("post's cache")), None)  # noqa: E731
    variants["GPTlite: post's cache (clamp)"] = (post, post)
    for method in (kb.SlidingWindow(W), kb.StreamingLLM(W, n_sink)):
        label = f"rotary: {'window' if method.name == 'window' else f'{n_sink} sinks +'} cache {W}"

        def fn(x, method=method, label=label):
            cache = kb.BudgetCache(rope.config.n_layers, n_first=max(n_sink, 1))
            return kb.teacher_forced_logits(rope, x, method, cache, progress=bar(label)), cache
        variants[label] = (fn, fn)
    return variants


def stream_rows(variants, stream, segment, time_tokens, repeats):
    """Loss per segment of every variant over the stream, and tokens/s timed round-robin on its start."""
    x, y = stream[None, :-1], stream[1:]
    rows, losses = [], {}
    for name, (score, _) in variants.items():
        logits, cache = score(x)
        nll = F.cross_entropy(logits[0], y, reduction="none")  # [S]
        losses[name] = [nll[s:s + segment].mean().item() for s in range(0, len(nll) - segment + 1, segment)]
        rows.append(harness.make_row(name, val_loss=nll.mean().item(), first_segment=losses[name][0],
                                worst_segment=max(losses[name]), last_segment=losses[name][-1]))
        if cache is not None:  # attention on the first cache entries: the sinks, or the window's oldest
            rows[-1]["first_mass"] = sum(cache.first_mass) / len(cache.first_mass) / cache.n_steps
            rows[-1]["uniform_mass"] = cache.first_uniform / cache.n_steps  # what equal weights would give
            rows[-1]["mass_by_layer"] = " ".join(f"{m / cache.n_steps:.2f}" for m in cache.first_mass)
    steps = {name: (lambda step=step: step(x[:, :time_tokens])) for name, (_, step) in variants.items()}
    seconds = iu.time_round_robin(steps, warmup=1, repeats=repeats)  # batch 1 on the CPU's clock
    for row in rows:
        row["tokens_per_s"] = time_tokens / iu.median(seconds[row["variant"]])
    return rows, losses


def plot_results(rows, losses, segment, W, preset):
    """Validation loss against the KV budget per method, and the streaming loss per segment: the figure."""
    fig, (ax_q, ax_s) = harness.new_figure(2)
    dense = next(r for r in rows if r["method"] == "dense")
    for name in METHODS:
        pts = [r for r in rows if r["method"] == name]
        ax_q.plot([r["budget"] for r in pts], [r["val_loss"] for r in pts], marker="o", label=name)
    ax_q.axhline(dense["val_loss"], color="gray", linestyle="--", label="dense")
    budgets = sorted({r["budget"] for r in rows if r["method"] != "dense"})
    ax_q.set_xscale("log")
    ax_q.set_xticks(budgets, [str(b) for b in budgets], minor=False)
    ax_q.minorticks_off()
    ax_q.set(xlabel="KV budget (entries per layer and head)", ylabel="validation loss (nats/char)",
             title=f"KV budgets on GPTlite ({preset.name}, window {dense['budget']})")
    ax_q.legend()
    for name, seg in losses.items():
        ax_s.plot([segment * (i + 0.5) for i in range(len(seg))], seg, marker=".", label=name)
    ax_s.axvline(W, color="gray", linestyle=":")
    ax_s.set(xlabel="position in the stream (characters)", ylabel=f"loss per {segment} characters",
             title="streaming past the window (teacher forcing)")
    ax_s.legend(fontsize=7)
    return fig


def headline(rows, srows, segment):
    """The README's row: each method's loss against dense at the middle budget, and the streaming worst segments."""
    budgets = sorted({row["budget"] for row in rows if row["method"] != "dense"})
    budget = budgets[len(budgets) // 2]  # the middle one
    by_name = {row["variant"]: row for row in rows}
    losses = ", ".join(f"{m} {by_name[f'{m} {budget}']['loss_vs_dense']:+.3f}" for m in METHODS)
    worst = lambda key: f"{next(r for r in srows if key in r['variant'])['worst_segment']:.2f}"  # noqa: E731
    return dict(technique=f"KV budgets without retraining (window, sinks, H2O, SnapKV, Quest), budget {budget} of "
                          f"{by_name['dense']['budget']}",
                figure=f"loss against dense: {losses}; streaming {segment}-character worst segment: rotary window "
                       f"cache {worst('window cache')}, sinks {worst('sinks')}, re-encoding {worst('rotary: re-encode')}; "
                       f"the post's clamped cache {worst('clamp')} against re-encoding {worst('GPTlite: re-encode')}")


def summary_lines(checks, srows, losses, seqlen, n_sink, segment):
    """The lines under the tables: the checks, the attention on the first entries, each stream's figures."""
    sinks = next(r for r in srows if "sinks" in r["variant"])
    window = next(r for r in srows if "window cache" in r["variant"])
    summary = [f"checks passed ({len(checks)}): every method at budget {seqlen} gives generate_kvcache's tokens; "
               "the budgeted dense path and the rotary model's cached decode give their full forward pass's logits "
               "(atol 1e-4)",
               f"attention on the first {n_sink} cache entries (mean over layers, heads, steps): "
               f"{sinks['first_mass']:.3f} with sinks, {window['first_mass']:.3f} for the window's oldest "
               f"{n_sink} (equal weights over the entries read would give {sinks['uniform_mass']:.3f}); by layer, "
               f"first to last: {sinks['mass_by_layer']} with sinks, {window['mass_by_layer']} window-only",
               *(f"stream, {r['variant']}: loss {r['val_loss']:.3f}, worst {segment}-character segment "
                 f"{r['worst_segment']:.3f}, {r['tokens_per_s']:.0f} tok/s" for r in srows),
               "streaming loss per segment: " + "; ".join(
                   f"{name}: " + " ".join(f"{v:.2f}" for v in seg) for name, seg in losses.items())]
    return summary


def parse_args(argv):
    """The flags, checked before any work: (args, preset, device, data)."""
    parser = harness.script_parser(__doc__)
    add = parser.add_argument
    add("--budgets", type=harness.int_at_least(1), nargs="+", default=[16, 32, 64],
        help="KV budgets, entries per layer and head (at most the window; at least n_sink + 1 and the page size)")
    add("--n-sink", type=harness.int_at_least(0), default=4, help="StreamingLLM's sink tokens")
    add("--page-size", type=harness.int_at_least(1), default=8, help="Quest's page size in tokens")
    add("--n-windows", type=harness.int_at_least(1), default=64, help="validation windows of seqlen for the loss")
    add("--n-prompts", type=harness.int_at_least(1), default=8, help="prompts for the greedy-token agreement")
    harness.add_generation_flags(parser, prompt_len=1, n_tokens=128, repeats=3)
    add("--stream-chars", type=harness.int_at_least(1000), default=8000, help="validation characters streamed")
    add("--segment", type=harness.int_at_least(1), default=500, help="characters per loss segment of the stream")
    add("--time-tokens", type=harness.int_at_least(2), default=256, help="stream tokens timed per variant for tok/s")
    args = parser.parse_args(argv)

    def check_args(preset):
        if max(args.budgets) > preset.seqlen:
            parser.error(f"--budgets must be at most the window seqlen={preset.seqlen}, got {max(args.budgets)}")
        if args.segment > args.stream_chars:
            parser.error(f"--segment {args.segment} is longer than --stream-chars {args.stream_chars}")
        for budget in args.budgets:
            for name in METHODS:
                try:
                    kb.make_method(name, budget, args.n_sink, args.page_size)
                except ValueError as e:
                    parser.error(f"--budgets {budget} with {name}: {e}")
        fits = lambda flag, nbytes, what: harness.check_fits(parser, flag, nbytes, what)  # noqa: E731
        fits("--n-windows", ab.generation_bytes(preset, args.n_windows, preset.seqlen + 1), "the validation windows")
        fits("--n-prompts", ab.generation_bytes(preset, args.n_prompts, preset.seqlen), "the prompts")
        fits("--n-tokens", ab.generation_bytes(preset, args.n_prompts, args.prompt_len + args.n_tokens),
             "the generated tokens")
        # every variant's logits over the stream, float32, and a batch of 64 re-encoded windows
        fits("--stream-chars", ab.generation_bytes(preset, 64, preset.seqlen)
             + args.stream_chars * (8 + 4 * 2 * preset.vocab_size), "the streamed characters' logits")
    preset, device, data = harness.setup(args, parser, check_args)
    if args.stream_chars >= len(data.val):  # the stream and its last next character
        parser.error(f"--stream-chars {args.stream_chars}: the validation text has {len(data.val)} characters, "
                     f"give at most {len(data.val) - 1}")
    return args, preset, device, data


def main(argv=None):
    args, preset, device, data = parse_args(argv)
    base = iu.load_model(GPTlite, preset, device, data, untrained=args.untrained, seed=args.seed)
    cached = iu.kv_cache_model(base)
    rope = load_rope(preset, device, data, untrained=args.untrained, seed=args.seed)
    windows = corpus.sample_prompts(data, args.n_windows, preset.seqlen + 1, seed=args.seed, device=device)
    prompts = corpus.sample_prompts(data, args.n_prompts, args.prompt_len, seed=args.seed + 1, device=device)
    n_fit = min(args.n_tokens, preset.seqlen - args.prompt_len + 1)  # exact while the context fits the window
    full = [kb.make_method(name, preset.seqlen, args.n_sink, args.page_size) for name in METHODS]
    checks = run_checks(base, cached, rope, windows[:, :-1], prompts, n_fit, full)
    harness.require_checks(checks)

    rows = quality_rows(base, windows, prompts, args.n_tokens, args.budgets, args.n_sink, args.page_size)
    W, stream = preset.seqlen, data.val[:args.stream_chars + 1].to(device)
    variants = stream_variants(base, cached, rope, W, args.n_sink)
    srows, losses = stream_rows(variants, stream, args.segment, args.time_tokens, args.repeats)
    print(f"\nquality: loss over {args.n_windows} validation windows of {preset.seqlen}, each position with the method "
          f"(teacher forcing); agreement: {args.n_prompts} prompts of {args.prompt_len}, {args.n_tokens} greedy tokens; "
          f"KV bytes at a full window, float32")
    stream_table = harness.table(f"streaming {args.stream_chars} validation characters (loss per {args.segment}; "
                                 f"tok/s: the first {args.time_tokens}, median of {args.repeats}, batch 1)", srows)
    summary = summary_lines(checks, srows, losses, preset.seqlen, args.n_sink, args.segment)
    harness.report(args, "main_sparse_attention.py", preset, device, rows, headline(rows, srows, args.segment),
                   summary=summary, tables=[stream_table], plot=lambda: plot_results(rows, losses, args.segment, W, preset),
                   checks=checks, stream_rows=srows, stream_losses=losses, segment=args.segment)


if __name__ == "__main__":
    harness.run(main)
