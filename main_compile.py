"""Compilers and inference engines: GPTlite's static-cache decode eager, under torch.compile and
AOTInductor, against the same weights in Hugging Face transformers and CTranslate2.

    python main_compile.py                                        # cpu and distilled shapes, batch 1 and 8
    python main_compile.py --modes default aoti                   # and the AOTInductor packages (+ minutes)
    python main_compile.py --modes default cpp-wrapper+freezing max-autotune aoti --extra-presets
    python main_compile.py --json compile.json --plot compile.png

Blog: part 2 ("kernel fusion and compilers"). The variants, each a greedy generation of the same prompts:
- eager: GPTlite_KVCache with the StaticKVCache (generate_kvcache), the repository's decode path;
- eager, static step: lib/compiled.StaticStep uncompiled, the static-shape step that the compilers take
  (whole cache buffers and positions as tensors, a mask over every slot: no shape grows);
- torch.compile: default; cpp-wrapper+freezing (Inductor's C++ wrapper, weights frozen into constants);
  max-autotune (mode max-autotune-no-cudagraphs); reduce-overhead (CUDA graphs, CUDA only);
- aoti: torch.export, then torch._inductor.aoti_compile_and_package; the loaded package runs the steps
  without the Python model code;
- fast (C++): lib/fast_decode.py, the repository's fast decode path on a CPU: the whole cached step and
  the greedy loop in one C++ extension (built on first use, about a minute once), no operator dispatch;
- engines: transformers' generate on a GPT2LMHeadModel port (lib/engines.py), CTranslate2 float32 and
  int8 (weights int8, so its tokens may differ: the agreement is a fraction).
Compiled variants must give eager's tokens exactly, checked before anything is timed. Every row is timed
at each --threads count and keeps the fastest (named in the row). Compile times are those of the first
generation (both graphs), with Inductor's on-disk cache as this machine has it (a warm cache is faster).
Defaults: --modes default fast. AOTI adds 40 to 110 s of compile per shape and batch on 2 loaded CPU cores,
cpp-wrapper+freezing about 150 s, max-autotune more: behind --modes, so that the default run stays near
10 minutes there. A shape without a checkpoint (distilled) uses untrained weights, said in its rows.
"""
import os

import numpy as np
import torch
import torch._dynamo

import inference_utils as iu
from gptlite_kvcache import GPTlite_KVCache, StaticKVCache, decode_one_token, generate_kvcache
from lib import compiled, corpus, engines, fast_decode, harness, serving
from lib.files import checkpoint_path
from lib.presets import PRESETS, get_preset

ENGINES = {"hf": "transformers", "ct2": "ctranslate2", "ct2-int8": "ctranslate2"}  # name -> package


def parse_args(argv):
    """The flags, checked before any work: (args, preset, device, data)."""
    parser = harness.script_parser(__doc__)
    harness.add_generation_flags(parser, prompt_len=32, n_tokens=64, repeats=3)
    parser.add_argument("--batch-sizes", type=harness.int_at_least(1), nargs="+", default=[1, 8],
                        help="numbers of prompts generated together, a row group each")
    parser.add_argument("--extra-presets", choices=sorted(PRESETS), nargs="*", default=["distilled"],
                        help="more presets' shapes after --preset's (none: just --preset's)")
    parser.add_argument("--modes", nargs="*", default=["default", "fast"],
                        choices=[*compiled.COMPILE_MODES, "aoti", "fast"],
                        help="compiled variants (none: eager and engines only; fast: the C++ decode path, CPU "
                        "only; aoti, cpp-wrapper+freezing and max-autotune compile for minutes per shape on a CPU)")
    parser.add_argument("--engines", nargs="*", default=list(ENGINES), choices=list(ENGINES),
                        help="inference engines to compare with (none: no engine rows)")
    parser.add_argument("--threads", type=harness.thread_count, nargs="+", default=None,
                        help="thread counts each row is timed at, the fastest kept (default: 1 and all cores)")
    args = parser.parse_args(argv)
    return (args, *harness.setup(args, parser, lambda preset: check_args(args, parser, preset)))


def check_args(args, parser, preset):
    args.threads = sorted(set(args.threads or [1, os.cpu_count() or 1]))
    device = harness.get_device(args.device)
    for mode in args.modes:
        if mode in compiled.COMPILE_MODES and compiled.COMPILE_MODES[mode][2] and device.type != "cuda":
            parser.error(f"--modes {mode} uses CUDA graphs, which need a CUDA device; this run is on {device}")
    if "fast" in args.modes and device.type != "cpu":
        parser.error(f"--modes fast is the C++ decode path of a CPU; this run is on {device}: leave it out")
    if args.modes and device.type == "cpu":  # Inductor and the C++ path both build C++ code on a CPU
        harness.check_compiler(parser)
    for flag in ("batch_sizes", "extra_presets", "modes", "threads"):
        if len(set(getattr(args, flag))) != len(getattr(args, flag)):
            parser.error(f"--{flag.replace('_', '-')} repeats a value: {getattr(args, flag)}")
    if preset.name in args.extra_presets:
        parser.error(f"--extra-presets {preset.name} is --preset's shape already")
    for shape in [preset] + [get_preset(p) for p in args.extra_presets]:
        if args.prompt_len + args.n_tokens > shape.seqlen:  # the static buffer holds the whole sequence
            parser.error(f"--prompt-len + --n-tokens = {args.prompt_len + args.n_tokens} exceeds the {shape.name} "
                         f"preset's seqlen={shape.seqlen}: the static cache holds prompt and new tokens")
        harness.check_fits(parser, "--batch-sizes", 4 * serving.forward_bytes(shape, max(args.batch_sizes)),
                           f"a batch of {max(args.batch_sizes)} through the {shape.name} model")


def load_shape(preset, device, data, untrained, seed):
    """The GPTlite_KVCache of a preset and the note of its weights: its checkpoint when there (the main
    preset's is trained if missing), else untrained weights (an extra shape is not trained here)."""
    model = iu.load_model(GPTlite_KVCache, preset, device, data, untrained=untrained, seed=seed)
    return model, "untrained" if untrained else "trained"


def eager_fns(model, prompt, seqlen):
    cache = StaticKVCache.for_model(model, prompt.shape[0], seqlen)
    keys, values = compiled.new_buffers(model, prompt.shape[0])

    def repo(n):
        cache.reset()
        return generate_kvcache(model, prompt, n, seqlen, kv_cache=cache)
    return {"eager": repo, "eager, static step": lambda n: compiled.generate_static(
        compiled.StaticStep(model), prompt, n, keys, values)}


def build_variants(model, prompt, args, workdir):
    """{name: (generate(n), compile seconds, graphs, recompiles)} of eager and each --modes, compiled on
    this prompt's shape."""
    torch._dynamo.reset()  # the graphs of earlier shapes are done with: stay under dynamo's per-frame cache limit
    variants = {name: (fn, None, None, None) for name, fn in eager_fns(model, prompt, model.seqlen).items()}
    n_shapes = 1 if prompt.shape[1] == 1 else 2  # prefill and decode, one graph each
    for mode in args.modes:
        if mode == "fast":
            with iu.Timer() as building:
                fast_decode.extension()  # built once per machine, then loaded
                native = fast_decode.native_view(model)  # the weights packed once, outside the timed calls
            variants["fast (C++)"] = (lambda n: fast_decode.generate_fast(native, prompt, n, model.seqlen),
                                      building.seconds, None, None)
        elif mode == "aoti":
            runners, seconds = compiled.aoti_package(model, *prompt.shape, f"{workdir}/b{prompt.shape[0]}")
            keys, values = compiled.new_buffers(model, prompt.shape[0])
            variants["aoti"] = (compiled.aoti_generation(runners, prompt, keys, values), seconds, None, None)
        else:
            fn, seconds, graphs = compiled.compiled_generation(model, mode, prompt, args.n_tokens)
            variants[f"compile {mode}"] = (fn, seconds, graphs, graphs - n_shapes)
    return variants


def build_engines(model, names, threads, workdir):
    """{name: {threads: generate(n) on cpu prompts}} of the installed engines; one line per one skipped."""
    hf, out = None, {}
    for name in names:
        if (skip := engines.missing(ENGINES[name])) or (name != "hf" and (skip := engines.missing("transformers"))):
            print(f"{name}: {skip}")
            continue
        hf = hf or engines.to_gpt2(model)
        if name == "hf":
            out[name] = {t: (lambda p, n: engines.hf_generate(hf, p, n)) for t in threads}
        else:
            path = engines.ct2_model(hf, "int8" if name == "ct2-int8" else "float32", f"{workdir}/{name}")
            out[name] = {t: (lambda p, n, g=engines.ct2_generator(path, t): engines.ct2_generate(g, p, n))
                         for t in threads}
    return out


def same_tokens(tokens, reference, prompt_len):
    """'yes', 'no', or for int8 the fraction of new tokens equal to eager's."""
    if torch.equal(tokens, reference):
        return "yes"
    return f"no ({(tokens[:, prompt_len:] == reference[:, prompt_len:]).float().mean().item():.0%} equal)"


def time_best(fns_by_threads, args, device, batch_size):
    """compare_generation at each thread count; per variant the figures of the lowest TPOT and its threads."""
    best, saved = {}, torch.get_num_threads()
    for t, fns in fns_by_threads.items():
        torch.set_num_threads(t)  # torch's ops; CTranslate2 has its own pool
        # dynamo guards on the thread count: each compiled mode compiles again for a new one, in the
        # untimed warm-up round, past the default limit of 8 graphs per function with several modes
        with torch._dynamo.config.patch(recompile_limit=64):
            timings = iu.compare_generation(fns, args.n_tokens, batch_size, device, 1, args.repeats)
        for name, figures in timings.items():
            key = figures["tpot_ms"] if figures["tpot_ms"] is not None else float("inf")
            if name not in best or key < best[name][0]:
                best[name] = (key, dict(figures, threads=t))
    torch.set_num_threads(saved)
    return {name: figures for name, (_, figures) in best.items()}


def measure_shape(shape, model, weights, data, args, device, workdir):
    """The rows of one preset's shape: every batch size, every variant and engine."""
    rows, engine_fns = [], build_engines(model, args.engines, args.threads, workdir)
    for batch_size in args.batch_sizes:
        prompt = corpus.sample_prompts(data, batch_size, args.prompt_len, seed=args.seed, device=device)
        variants = build_variants(model, prompt, args, workdir)
        reference = variants["eager"][0](args.n_tokens)
        checks = {f"{name} ({shape}, batch {batch_size}): tokens equal eager's":
                  torch.equal(fn(args.n_tokens), reference) for name, (fn, *_) in variants.items()}
        harness.require_checks(checks)  # nothing is timed unless the compiled tokens are eager's
        cpu_prompt = prompt.cpu()
        fns = {t: {name: fn for name, (fn, *_) in variants.items()} for t in args.threads}
        for name, by_threads in engine_fns.items():
            for t, gen in by_threads.items():
                fns[t][name] = lambda n, gen=gen: gen(cpu_prompt, n)
        agree = {name: same_tokens(by_threads[args.threads[0]](cpu_prompt, args.n_tokens).to(device), reference,
                                   args.prompt_len) for name, by_threads in engine_fns.items()}
        timings = time_best(fns, args, device, batch_size)
        for name, figures in timings.items():
            _, seconds, graphs, recompiles = variants.get(name, (None, None, None, None))
            rows.append(harness.make_row(name, shape=f"{shape} ({weights})", batch_size=batch_size, **figures,
                                         compile_s=seconds, graphs=graphs, recompiles=recompiles,
                                         same_tokens=agree.get(name, "yes")))
    return rows


def add_ratios(rows):
    """vs_eager and vs_fastest_engine: this row's TPOT over eager's / the fastest engine's, same shape and batch."""
    for row in rows:
        group = [r for r in rows if (r["shape"], r["batch_size"]) == (row["shape"], row["batch_size"])]
        eager = next(r["tpot_ms"] for r in group if r["variant"] == "eager")
        engine_tpots = [r["tpot_ms"] for r in group if r["variant"] in ENGINES and r["tpot_ms"] is not None]
        row["vs_eager"] = iu.ratio(row["tpot_ms"], eager)
        row["vs_fastest_engine"] = iu.ratio(row["tpot_ms"], min(engine_tpots)) if engine_tpots else None
    return rows


@torch.inference_mode()
def profile_decode_step(model, prompt, steps=10, top=8):
    """`steps` eager decode steps (the repository's, static cache) at 1 thread under torch.profiler, after
    a warm-up one: (aten operator calls per step, their self CPU ms per step, the `top` operators by self CPU time
    as rows, per step)."""
    from torch.profiler import ProfilerActivity, profile
    cache = StaticKVCache.for_model(model, prompt.shape[0])
    model(prompt, kv_cache=cache)
    token = prompt[:, -1:]
    decode_one_token(model, token, cache, model.seqlen)  # warm-up
    saved = torch.get_num_threads()
    torch.set_num_threads(1)  # eager's fastest at batch 1; no OpenMP waits in the operators' times
    with iu.stderr_silenced(), profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            cache.truncate(prompt.shape[1])  # the same position every step
            decode_one_token(model, token, cache, model.seqlen)
    torch.set_num_threads(saved)
    ops = [e for e in prof.key_averages() if e.key.startswith("aten::")]
    total_ms = sum(e.self_cpu_time_total for e in ops) / 1e3 / steps
    rows = [dict(operator=e.key, calls=e.count // steps, self_ms=e.self_cpu_time_total / 1e3 / steps,
                 share=f"{e.self_cpu_time_total / 1e3 / steps / total_ms:.0%}")
            for e in sorted(ops, key=lambda e: -e.self_cpu_time_total)[:top]]
    return sum(e.count for e in ops) // steps, total_ms, rows


def goal_figures(rows, preset):
    """Per batch size of --preset: (batch, our fastest row, the fastest engine's row) where both were timed."""
    out = []
    for batch in sorted({r["batch_size"] for r in rows}):
        group = [r for r in rows if r["shape"].startswith(preset.name + " ") and r["batch_size"] == batch
                 and r["tpot_ms"] is not None]
        ours = [r for r in group if r["variant"] not in ENGINES]
        theirs = [r for r in group if r["variant"] in ENGINES]
        if ours and theirs:
            out.append((batch, min(ours, key=lambda r: r["tpot_ms"]), min(theirs, key=lambda r: r["tpot_ms"])))
    return out


def goal_lines(rows, preset, calls, step_ms):
    """The goal: the repository's fastest decode path within 1.5x of the fastest engine (each batch, --preset)."""
    figures = goal_figures(rows, preset)
    if not figures:
        return ["goal (fastest decode within 1.5x of the fastest engine): not measured (no engine row on "
                f"{preset.name})"]
    lines = []
    for batch, best, engine in figures:
        x = best["tpot_ms"] / engine["tpot_ms"]
        lines.append(f"goal, {preset.name} batch {batch}: fastest of ours {best['variant']} {best['tpot_ms']:.3f} ms "
                     f"({best['threads']} threads) against {engine['variant']} {engine['tpot_ms']:.3f} ms "
                     f"({engine['threads']} threads) = {x:.2f}x: {'met' if x <= 1.5 else 'NOT met'} (<= 1.5x)")
    lines.append(f"eager's overhead, one eager decode step profiled (batch 1, 1 thread): {calls} aten operator "
                 f"calls, {step_ms:.3f} ms of self CPU time in them under the profiler (top operators: the table "
                 "above); the fast (C++) row runs the same step as one call")
    eager = next((r["tpot_ms"] for r in rows if r["shape"].startswith(preset.name + " ") and r["batch_size"] == 1
                  and r["variant"] == "eager" and r["tpot_ms"] is not None), None)
    engine = next((e for b, _, e in figures if b == 1), None)
    if eager is not None and engine is not None:  # the whole step's time per operator call, against the engine's
        lines.append(f"eager's TPOT {eager:.3f} ms is {1e3 * eager / calls:.2f} us per operator call; "
                     f"{engine['variant']}'s {engine['tpot_ms']:.3f} ms would leave "
                     f"{1e3 * engine['tpot_ms'] / calls:.2f} us per call")
    return lines


def plot_tpot(rows):
    fig, axes = harness.new_figure(len({r["shape"] for r in rows}))
    for ax, shape in zip(np.atleast_1d(axes), dict.fromkeys(r["shape"] for r in rows)):
        variants = list(dict.fromkeys(r["variant"] for r in rows if r["shape"] == shape))
        batches = sorted({r["batch_size"] for r in rows if r["shape"] == shape})
        for i, b in enumerate(batches):
            tpot = {r["variant"]: r["tpot_ms"] for r in rows if r["shape"] == shape and r["batch_size"] == b}
            ax.bar(np.arange(len(variants)) + i / (len(batches) + 1),
                   [tpot.get(v) or np.nan for v in variants], width=1 / (len(batches) + 1), label=f"batch {b}")
        ax.set_xticks(np.arange(len(variants)), variants, rotation=45, ha="right")
        ax.set(yscale="log", ylabel="TPOT (ms, log)", title=shape)
        ax.legend()
    return fig


def headline(rows, preset):
    """Our fastest decode over the fastest engine's, per batch size of --preset (from the rows)."""
    figures = goal_figures(rows, preset)
    figure = "; ".join(f"batch {b}: {best['variant']} {best['tpot_ms'] / engine['tpot_ms']:.2f}x {engine['variant']}'s "
                       "TPOT" for b, best, engine in figures) or "no engine measured"
    return {"technique": "compilers (torch.compile, AOTInductor, the C++ fast path) and engines (transformers, "
                         "CTranslate2)", "figure": figure}


def main(argv=None):
    args, preset, device, data = parse_args(argv)
    rows = []
    with engines.temp_dir() as workdir:
        for name in [preset.name] + args.extra_presets:
            untrained = args.untrained or (name != preset.name and not checkpoint_path(name).exists())
            shape = preset if name == preset.name else name  # the main preset as setup made it (--train-iters)
            model, weights = load_shape(shape, device, data, untrained, args.seed)
            rows += measure_shape(name, model, weights, data, args, device, f"{workdir}/{name}")
            if name == preset.name:
                prompt = corpus.sample_prompts(data, 1, args.prompt_len, seed=args.seed, device=device)
                calls, step_ms, profile_rows = profile_decode_step(model, prompt)
    add_ratios(rows)
    goal = goal_lines(rows, preset, calls, step_ms)
    summary = [f"prompts of {args.prompt_len} tokens, {args.n_tokens} new tokens, median of {args.repeats} runs "
               f"at threads {args.threads} (each row keeps its fastest); compile_s: the first generation, both graphs",
               "graphs: torch._dynamo's unique graphs (prefill and decode); recompiles: graphs beyond those",
               "same_tokens: greedy tokens equal eager's (compiled variants are required to; int8 may differ)"] + goal
    harness.report(args, "main_compile.py", preset, device, rows, headline(rows, preset), summary=summary,
                   tables=[harness.table("one eager decode step (batch 1), top operators by self CPU time",
                                         profile_rows, [("operator", "operator", "{}"), ("calls", "calls", "{}"),
                                                        ("self_ms", "self ms", "{:.4f}"), ("share", "share", "{}")])],
                   plot=lambda: plot_tpot(rows), prompt_len=args.prompt_len, n_tokens=args.n_tokens,
                   threads=args.threads, decode_step_profile=dict(operator_calls=calls, self_cpu_ms=step_ms))


if __name__ == "__main__":
    harness.run(main)
