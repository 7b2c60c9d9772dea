"""KV budgets without retraining: sliding window, attention sinks (StreamingLLM), H2O, SnapKV and Quest.

    python main_sparse_attention.py                 # cpu preset on CPU (the first run trains checkpoints/cpu_rope.pt
                                                    # and, 600 steps, checkpoints/cpu_rope_start.pt)
    python main_sparse_attention.py --budgets 8 16 32 64 --stream-chars 8000 --json sparse.json --plot sparse.png
    python main_sparse_attention.py --untrained --n-windows 4 --stream-chars 400 --segment 100   # a quick smoke run

Blog section: "Sparse attention". Each method keeps or reads at most `budget` cache
entries per layer and head at a decode step (kv_budget.py); a budget of the whole context is dense attention.
Two rotary models: the rotary GPTlite of checkpoints/<preset>_rope.pt, trained on random windows (no position
is special), and the start-token model (lib/variant_checkpoints.load_start_token), trained the way LLMs are: every
sequence begins with a reserved start token followed by a document (a speaker turn) from its start.
1. Checks first: every method at a full budget gives generate_kvcache's tokens; the budgeted dense path
   gives the full forward pass's logits; both rotary models' cached decode and sinks + window cache at a
   full budget give their full forward pass's.
2. Quality at each budget: validation loss with the method applied at every position (teacher forcing,
   one token at a time), greedy-token agreement with dense attention, KV bytes kept and read per step.
3. Attention sinks: the attention mass of queries at positions >= --mass-from on the first n_sink positions
   in a full forward pass, per model, beside the share equal weights would give.
4. Streaming far past the 128-token window, every next character scored: dense re-encoding of the last W
   tokens (the exact reference), a window-only cache and n_sink sinks + window on both rotary models (keys
   cached before rotation, positions = slots; the start-token model's stream starts with the start token),
   and the post's clamp-at-seqlen-1 cache on GPTlite.
"""

import torch
import torch.nn.functional as F
from tqdm import tqdm

import inference_utils as iu
from gptlite import GPTlite
from gptlite_kvcache import generate_kvcache
from lib.variant_checkpoints import START_STEPS, load_rope, load_start_token, start_token_id
from lib import attention_benchmark as ab
from lib import attention_summary
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
def run_checks(base, cached, rope, start, windows, documents, prompts, n_tokens, methods_full, n_sink):
    """Exactness before any figure: {name: bool}. documents: the start-token model's input sequences."""
    ref = generate_kvcache(cached, prompts, n_tokens, base.seqlen)
    checks = {f"{m.name} at budget {m.budget}: dense tokens": torch.equal(kb.generate_budget(base, prompts, n_tokens, m),
                                                                          ref) for m in methods_full}
    x = windows[:4]
    checks["budgeted dense logits = full forward"] = (kb.teacher_forced_logits(base, x, kb.Dense())
                                                      - base(x)).abs().max().item() <= 1e-4
    checks["rotary: cached decode = full forward"] = training.cached_matches_full(rope, x)
    checks["rotary: budgeted dense = full forward"] = (kb.teacher_forced_logits(rope, x, kb.Dense())
                                                       - rope(x)[0]).abs().max().item() <= 1e-4
    checks["start-token: cached decode = full forward"] = training.cached_matches_full(start, documents[:4])
    full_sinks = kb.StreamingLLM(base.seqlen, n_sink)
    for name, model, inputs in (("rotary", rope, x), ("start-token", start, documents[:4])):
        checks[f"{name}: {n_sink} sinks + window at budget {base.seqlen} = full forward"] = (
            kb.teacher_forced_logits(model, inputs, full_sinks) - model(inputs)[0]).abs().max().item() <= 1e-4
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


def mass_rows(models, n_first, from_position):
    """Attention on the first n_first positions of a full forward pass, per (name, model, input [B, S])."""
    rows = []
    for name, model, tokens in models:
        m = kb.attention_on_first(model, tokens, n_first, from_position)
        rows.append(dict(model=name, mass=m["mass"], uniform=m["uniform"], ratio=m["mass"] / m["uniform"],
                         by_layer=" ".join(f"{v:.2f}" for v in m["by_layer"])))
    return rows


MASS_COLUMNS = [("model", "model, input", "{}"), ("mass", "mass on the first positions", "{:.3f}"),
                ("uniform", "equal weights", "{:.3f}"), ("ratio", "mass / equal", "{:.1f}"),
                ("by_layer", "mass by layer, first to last", "{}")]


@torch.inference_mode()
def reencoding_logits(model, stream, W, batch=64, keep_first=False):
    """The reference: the logits of every position, each from a dense pass over its last W tokens (keep_first:
    the stream's first token, then its last W - 1). [S, vocab]"""
    first = training.logits_of(model(stream[None, :W]))[0]  # positions 0..W-1: their whole past fits
    if keep_first:  # [S-W, W]: the first token, then the W - 1 tokens ending at each later position
        windows = stream[1:].unfold(0, W - 1, 1)[1:]
        windows = torch.cat([stream[:1].expand(len(windows), 1), windows], dim=1)
    else:
        windows = stream.unfold(0, W, 1)[1:]  # [S-W, W]: the window ending at each later position
    rest = [training.logits_of(model(w))[:, -1] for w in tqdm(windows.split(batch), desc="re-encoding reference",
                                                         dynamic_ncols=True, leave=False)]
    return torch.cat([first] + rest)


@torch.inference_mode()
def reencoding_stream(model, tokens, W, keep_first=False):
    """The reference as a stream really runs it, one token at a time: a dense pass over the last W tokens
    (keep_first: the first token and the last W - 1)."""
    def context(t):
        if not keep_first or t < W:
            return tokens[:, max(t - W + 1, 0):t + 1]
        return torch.cat([tokens[:, :1], tokens[:, t - W + 2:t + 1]], dim=1)
    return torch.cat([training.logits_of(model(context(t)))[:, -1:] for t in range(tokens.shape[1])], dim=1)


@torch.inference_mode()
def post_cache_logits(cached, tokens, progress=None):
    """The post's cache, teacher forced: past seqlen it drops the oldest entry, new tokens at position seqlen-1."""
    logits, cache = [], None
    for t in (progress or (lambda r: r))(range(tokens.shape[1])):
        out, cache = cached(tokens[:, t:t + 1], cache)
        logits.append(out)
    return torch.cat(logits, dim=1)


def stream_variants(base, cached, rope, start, W, n_sink, stream, start_stream):
    """{name: (score, step, stream)}: score(tokens [1, S]) -> (logits [1, S, vocab], the budget cache or None);
    step(tokens) streams them one at a time as a deployment would (timed; the reference's score is batched);
    stream: the tokens it reads (the start-token model's begins with the start token)."""
    bar = lambda desc: (lambda r: tqdm(r, desc=desc, dynamic_ncols=True, leave=False))  # noqa: E731
    variants = {}
    for name, model in (("GPTlite", base), ("rotary", rope)):
        variants[f"{name}: re-encode last {W}"] = (lambda x, m=model: (reencoding_logits(m, x[0], W)[None], None),
                                                   lambda x, m=model: reencoding_stream(m, x, W), stream)
    variants[f"start-token: re-encode start + last {W - 1}"] = (
        lambda x: (reencoding_logits(start, x[0], W, keep_first=True)[None], None),
        lambda x: reencoding_stream(start, x, W, keep_first=True), start_stream)
    post = lambda x: (post_cache_logits(cached, x, bar("post's cache")), None)  # noqa: E731
    variants["GPTlite: post's cache (clamp)"] = (post, post, stream)
    for name, model, tokens in (("rotary", rope, stream), ("start-token", start, start_stream)):
        for method in (kb.SlidingWindow(W), kb.StreamingLLM(W, n_sink)):
            label = f"{name}: {'window' if method.name == 'window' else f'{n_sink} sinks +'} cache {W}"

            def fn(x, model=model, method=method, label=label):
                cache = kb.BudgetCache(model.config.n_layers, n_first=max(n_sink, 1))
                return kb.teacher_forced_logits(model, x, method, cache, progress=bar(label)), cache
            variants[label] = (fn, fn, tokens)
    return variants


def stream_rows(variants, segment, time_tokens, repeats):
    """Loss per segment of every variant over its stream, and tokens/s timed round-robin on its start."""
    rows, losses, inputs = [], {}, {}
    for name, (score, _, stream) in variants.items():
        x, y = stream[None, :-1], stream[1:]
        inputs[name] = x
        logits, cache = score(x)
        nll = F.cross_entropy(logits[0], y, reduction="none")  # [S]
        losses[name] = [nll[s:s + segment].mean().item() for s in range(0, len(nll) - segment + 1, segment)]
        rows.append(harness.make_row(name, val_loss=nll.mean().item(), first_segment=losses[name][0],
                                worst_segment=max(losses[name]), last_segment=losses[name][-1]))
        if cache is not None:  # attention on the first cache entries: the sinks, or the window's oldest
            rows[-1]["first_mass"] = sum(cache.first_mass) / len(cache.first_mass) / cache.n_steps
            rows[-1]["uniform_mass"] = cache.first_uniform / cache.n_steps  # what equal weights would give
            rows[-1]["mass_by_layer"] = " ".join(f"{m / cache.n_steps:.2f}" for m in cache.first_mass)
    steps = {name: (lambda step=step, x=inputs[name]: step(x[:, :time_tokens]))
             for name, (_, step, _) in variants.items()}
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


def stream_row(srows, key):
    """The stream row of `key`, "<model>: <kind>": model GPTlite, rotary or start-token; kind window or sinks
    (the budget caches), re-encode, post (the post's clamped cache)."""
    model, kind = key.split(": ")
    return next(r for r in srows if r["variant"].startswith(model + ": ") and kind in r["variant"])


def middle_budget(rows):
    """The budget the headline and the summary rows quote: the middle one of the run."""
    budgets = sorted({row["budget"] for row in rows if row["method"] != "dense"})
    return budgets[len(budgets) // 2]


def attention_methods(rows, seqlen):
    """The summary of attention methods' rows (lib/attention_summary.py): each KV-budget method at the middle
    budget, against dense attention over the full window of seqlen."""
    budget, by_name = middle_budget(rows), {row["variant"]: row for row in rows}
    dense = by_name["dense"]
    out = []
    for name in METHODS:
        r = by_name[f"{name} {budget}"]
        out.append(attention_summary.method_row(
            f"{name} (KV budget {budget})", False,
            f"val loss {r['loss_vs_dense']:+.4f} against dense at a budget of {budget} of {seqlen} entries", 0,
            "none", "KV cache kept / read per step",
            f"{dense['kv_kept_kb'] / r['kv_kept_kb']:.1f}x / {dense['kv_read_kb'] / r['kv_read_kb']:.1f}x smaller "
            f"({r['kv_kept_kb']:.0f} / {r['kv_read_kb']:.0f} KB against {dense['kv_kept_kb']:.0f} at {seqlen} tokens)",
            f"contexts past {budget} tokens (the budget; below it nothing is cut)"))
    return out


def headline(rows, srows, segment):
    """The README's row: each method's loss against dense at the middle budget, and the streaming worst segments."""
    budget, by_name = middle_budget(rows), {row["variant"]: row for row in rows}
    losses = ", ".join(f"{m} {by_name[f'{m} {budget}']['loss_vs_dense']:+.3f}" for m in METHODS)
    worst = lambda key: f"{stream_row(srows, key)['worst_segment']:.2f}"  # noqa: E731
    return dict(technique=f"KV budgets without retraining (window, sinks, H2O, SnapKV, Quest), budget {budget} of "
                          f"{by_name['dense']['budget']}",
                figure=f"loss against dense: {losses}; streaming {segment}-character worst segment, window cache / "
                       f"sinks + window: rotary {worst('rotary: window')} / {worst('rotary: sinks')}, start-token "
                       f"{worst('start-token: window')} / {worst('start-token: sinks')}; the post's clamped cache "
                       f"{worst('GPTlite: post')} against re-encoding {worst('GPTlite: re-encode')}")


def segment_table(losses, segment, names):
    """Loss per segment of the stream, one column per variant in `names`: the table of the sinks."""
    n = len(losses[names[0]])
    rows = [dict(chars=f"{i * segment}-{(i + 1) * segment}", **{name: losses[name][i] for name in names})
            for i in range(n)]
    return rows, [("chars", "characters", "{}")] + [(name, name, "{:.3f}") for name in names]


def summary_lines(checks, srows, mrows, seqlen, n_sink, segment, from_position):
    """The lines under the tables: the checks, the attention on the first entries, each stream's figures."""
    summary = [f"checks passed ({len(checks)}): every method at budget {seqlen} gives generate_kvcache's tokens; "
               "the budgeted dense path, both rotary models' cached decode and their sinks + window cache at a full "
               "budget give their full forward pass's logits (atol 1e-4)",
               f"attention sinks, full forward pass: the mean attention weight that queries at positions >= "
               f"{from_position} put on the first {max(n_sink, 1)} positions (over layers, heads, queries): "
               + "; ".join(f"{r['model']} {r['mass']:.3f} ({r['ratio']:.1f}x equal weights' {r['uniform']:.3f})"
                           for r in mrows)]
    for model in ("rotary", "start-token"):
        sinks, window = stream_row(srows, f"{model}: sinks"), stream_row(srows, f"{model}: window")
        summary.append(
            f"{model} stream, attention on the first {max(n_sink, 1)} cache entries (mean over layers, heads, steps): "
            f"{sinks['first_mass']:.3f} with sinks, {window['first_mass']:.3f} for the window's oldest (equal weights "
            f"over the entries read would give {sinks['uniform_mass']:.3f}); by layer, first to last: "
            f"{sinks['mass_by_layer']} with sinks, {window['mass_by_layer']} window-only")
    summary += [f"stream, {r['variant']}: loss {r['val_loss']:.3f}, worst {segment}-character segment "
                f"{r['worst_segment']:.3f}, {r['tokens_per_s']:.0f} tok/s" for r in srows]
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
    add("--stream-chars", type=harness.int_at_least(2), default=4000,
        help="validation characters streamed (more than the window seqlen: the point is to stream past it)")
    add("--segment", type=harness.int_at_least(1), default=250, help="characters per loss segment of the stream")
    add("--time-tokens", type=harness.int_at_least(2), default=256, help="stream tokens timed per variant for tok/s")
    add("--start-steps", type=harness.steps, default=START_STEPS,
        help="training steps of the start-token model (checkpoints/<preset>_rope_start.pt; the preset's other "
             "settings); a checkpoint of other steps is trained again")
    add("--mass-from", type=harness.int_at_least(0), default=16,
        help="the attention-sink table averages over queries at positions from this one to the window's last")
    args = parser.parse_args(argv)

    def check_args(preset):
        if max(args.budgets) > preset.seqlen:
            parser.error(f"--budgets must be at most the window seqlen={preset.seqlen}, got {max(args.budgets)}")
        if args.n_sink >= min(args.budgets):
            parser.error(f"--n-sink {args.n_sink} must be below every budget (the sinks plus the newest token fit "
                         f"in it), got --budgets {min(args.budgets)}")
        if args.mass_from >= preset.seqlen:
            parser.error(f"--mass-from must be below the window seqlen={preset.seqlen}, got {args.mass_from}")
        if args.stream_chars <= preset.seqlen:
            parser.error(f"--stream-chars must be more than the window seqlen={preset.seqlen} (the stream goes past "
                         f"it), got {args.stream_chars}")
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
    first_doc = int(corpus.document_starts(data.val, data.vocab.index("\n"))[0])  # the streams start at a document
    if first_doc + args.stream_chars >= len(data.val):  # the stream and its last next character
        parser.error(f"--stream-chars {args.stream_chars}: the validation text has {len(data.val) - first_doc} "
                     f"characters from its first document on, give at most {len(data.val) - first_doc - 1}")
    return args, preset, device, data


def result_tables(mrows, losses, srows, variants, W, n_first, args):
    """The attention mass on the first positions, the streaming loss per segment, and the streams' rows."""
    mass_table = harness.table(f"attention sinks: mean attention weight on the first {n_first} positions of queries at "
                               f"positions {args.mass_from}-{W - 1}, full forward pass over {args.n_windows} sequences "
                               f"of {W} (mean over layers, heads, queries; equal weights: min({n_first}, p+1)/(p+1))",
                               mrows, MASS_COLUMNS)
    caches = [v for v in variants if "window cache" in v or "sinks +" in v]
    seg_rows, seg_columns = segment_table(losses, args.segment, caches)
    seg_table = harness.table(f"streaming loss per {args.segment} characters (nats/char), window-only against "
                              f"{args.n_sink} sinks + window, cache of {W}: the first tokens leave the window-only "
                              f"cache at character {W}", seg_rows, seg_columns)
    stream_table = harness.table(f"streaming {args.stream_chars} validation characters from the first document "
                                 f"(loss per {args.segment}; tok/s: the first {args.time_tokens}, median of "
                                 f"{args.repeats}, batch 1)", srows)
    return [mass_table, seg_table, stream_table]


def main(argv=None):
    args, preset, device, data = parse_args(argv)
    base = iu.load_model(GPTlite, preset, device, data, untrained=args.untrained, seed=args.seed)
    cached = iu.kv_cache_model(base)
    rope = load_rope(preset, device, data, untrained=args.untrained, seed=args.seed)
    start = load_start_token(preset, device, data, args.start_steps, untrained=args.untrained, seed=args.seed)
    W, S, n_first = preset.seqlen, start_token_id(data), max(args.n_sink, 1)
    windows = corpus.sample_prompts(data, args.n_windows, W + 1, seed=args.seed, device=device)
    prompts = corpus.sample_prompts(data, args.n_prompts, args.prompt_len, seed=args.seed + 1, device=device)
    starts = corpus.document_starts(data.val, data.vocab.index("\n"))
    generator = torch.Generator().manual_seed(args.seed)
    documents = corpus.document_batch(data.val, starts, S, args.n_windows, W, generator, device)[0]  # [N, W]
    n_fit = min(args.n_tokens, W - args.prompt_len + 1)  # exact while the context fits the window
    full = [kb.make_method(name, W, args.n_sink, args.page_size) for name in METHODS]
    checks = run_checks(base, cached, rope, start, windows[:, :-1], documents, prompts, n_fit, full, args.n_sink)
    harness.require_checks(checks)

    rows = quality_rows(base, windows, prompts, args.n_tokens, args.budgets, args.n_sink, args.page_size)
    # the rotary model on its own input (random windows) and on the start-token model's documents, text only
    text_docs = torch.stack([data.val[s:s + W] for s in starts[torch.randint(len(starts) - 8, (args.n_windows,),
                                                                             generator=generator)]]).to(device)
    mrows = mass_rows([("rotary, random windows", rope, windows[:, :-1]),
                       ("rotary, documents from their start (no start token)", rope, text_docs),
                       ("start-token, start token + documents", start, documents)], n_first, args.mass_from)
    first = int(starts[0])  # the streams begin at the first document of the validation text
    stream = data.val[first:first + args.stream_chars + 1].to(device)
    start_stream = torch.cat([torch.tensor([S], device=device), stream[:-1]])  # the start token, then the same text
    variants = stream_variants(base, cached, rope, start, W, args.n_sink, stream, start_stream)
    srows, losses = stream_rows(variants, args.segment, args.time_tokens, args.repeats)
    print(f"\nquality: loss over {args.n_windows} validation windows of {W}, each position with the method "
          f"(teacher forcing); agreement: {args.n_prompts} prompts of {args.prompt_len}, {args.n_tokens} greedy tokens; "
          f"KV bytes at a full window, float32")
    tables = result_tables(mrows, losses, srows, variants, W, n_first, args)
    summary = summary_lines(checks, srows, mrows, W, args.n_sink, args.segment, args.mass_from)
    harness.report(args, "main_sparse_attention.py", preset, device, rows, headline(rows, srows, args.segment),
                   summary=summary, tables=tables,
                   plot=lambda: plot_results(rows, losses, args.segment, W, preset),
                   attention_methods=attention_methods(rows, W), checks=checks, stream_rows=srows,
                   stream_losses=losses, segment=args.segment, mass_rows=mrows, start_steps=args.start_steps)


if __name__ == "__main__":
    harness.run(main)
