"""One command reproduces the results pages: every script's default run, then every table and plot.

    python reproduce.py                         # every script in turn (about 25 minutes on 2 CPU cores)
    python reproduce.py --quick                 # a smoke run in a few minutes, rendered into results/quick/
    python reproduce.py --only main_gqa.py      # rerun some scripts; the other blocks stay as they are
    python reproduce.py --skip-run              # re-render the pages from the results/ JSON of the last run

Each script runs as `python <script> --json PATH --plot PATH` (plus --device), one after the other: the
first one trains checkpoints/<preset>.pt when it is missing. Its JSON, with the machine and date added ("reproduce"),
goes to results/<run>.json; then the blocks between `<!-- reproduce:<run>:<part> -->` and
`<!-- /reproduce:<run>:<part> -->` in README.md and docs/*.md are rewritten from it, and nothing else
is. A script that fails is reported (exit code, last lines of its stderr); its block, plot and results
stay as they were, the other scripts still run, and the command exits with 1 at the end.
"""
import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

import inference_utils as iu
from lib.errors import GPTliteError
from lib import files, harness

ROOT = files.ROOT


class ReproduceError(GPTliteError):
    pass


@dataclass(frozen=True)
class Run:
    name: str          # the blocks' name: <!-- reproduce:NAME:table --> and <!-- reproduce:NAME:plot -->
    script: str
    page: str          # the markdown file, relative to the repository, that holds the blocks
    plot: str = None   # docs/<plot>_<device>.png; None: the run has no plot block
    alt: str = ""      # the plot's alternative text
    args: tuple = ()   # flags beyond the script's defaults
    quick: tuple = ()  # small flags of --quick (added to --untrained)


RUNS = [
    Run("main_kvcache", "main_kvcache.py", "README.md", "kvcache", "TPOT against generated tokens",
        quick=("--n-tokens", "16", "--repeats", "1")),
    Run("main_prefix_cache", "main_prefix_cache.py", "docs/caching.md", "prefix_cache",
        "TTFT against the shared prefix length, with and without the prefix cache",
        quick=("--repeats", "1", "--n-requests", "3", "--turns", "2")),
    Run("main_semantic_cache", "main_semantic_cache.py", "docs/caching.md", "semantic_cache",
        "precision, recall and hit rate against the threshold", quick=("--n-tokens", "8", "--repeats", "1")),
    Run("main_static_batching", "main_static_batching.py", "docs/batching.md", "static_batching",
        "wasted slot-steps of static batching against batch size", quick=("--n-requests", "8", "--repeats", "1")),
    Run("main_continuous_batching", "main_continuous_batching.py", "docs/batching.md", "continuous_batching",
        "throughput and p99 TPOT against batch size",
        quick=("--n-requests", "8", "--repeats", "1", "--plot-batch-sizes", "2", "4")),
    Run("main_continuous_batching_long_prompts", "main_continuous_batching.py", "docs/batching.md",
        args=("--prompt-median", "80", "--repeats", "5"), quick=("--n-requests", "8", "--repeats", "1")),
    Run("main_flash_attention", "main_flash_attention.py", "docs/flash_attention.md", "flash_attention",
        "attention time and peak memory against context length",
        quick=("--n-tokens", "8", "--repeats", "1", "--val-batches", "2", "--contexts", "128", "256", "512",
               "--bench-repeats", "1", "--no-flex")),
    Run("main_gqa", "main_gqa.py", "docs/gqa_mla.md", "gqa", "validation loss and TPOT against KV-cache size",
        quick=("--uptrain-steps", "2", "--batch-size", "4", "--n-tokens", "8", "--repeats", "1")),
    Run("main_mla", "main_mla.py", "docs/gqa_mla.md", "mla", "MLA and GQA: validation loss against cache size",
        quick=("--uptrain-steps", "2", "--batch-size", "4", "--n-tokens", "8", "--repeats", "1")),
    Run("main_distillation", "main_distillation.py", "docs/smaller_models.md", "distillation",
        "validation loss against steps for the three students",
        quick=("--iters", "5", "--n-tokens", "8", "--repeats", "1")),
    Run("main_pruning", "main_pruning.py", "docs/smaller_models.md", "pruning",
        "validation loss against distillation steps, pruned and from random weights",
        quick=("--iters", "5", "--calib-batches", "1", "--random-draws", "2", "--n-tokens", "8", "--repeats", "1")),
    Run("main_structured_decoding", "main_structured_decoding.py", "docs/structured_decoding.md", "structured_decoding",
        "model calls per character and characters per second, by grammar, with and without jump-forward",
        quick=("--n-outputs", "2", "--repeats", "1")),
    Run("main_flash_decoding", "main_flash_decoding.py", "docs/fast_attention.md", "flash_decoding",
        "decode attention time against context length, and against n_splits",
        quick=("--contexts", "256", "1024", "--splits", "1", "4", "--repeats", "1", "--n-tokens", "8",
               "--batch-size", "2")),
    Run("main_sage_attention", "main_sage_attention.py", "docs/fast_attention.md", "sage_attention",
        "relative L1 error of each quantized variant, and its validation loss against float32's",
        quick=("--val-batches", "2", "--n-tokens", "8", "--batch-size", "2", "--bench-len", "256", "--repeats", "1")),
    Run("main_moba", "main_moba.py", "docs/moba.md", "moba",
        "validation loss against keys read per query, and KV bytes read per token against context length",
        quick=("--uptrain-steps", "2", "--val-batches", "2", "--no-flex")),
    Run("main_sparse_attention", "main_sparse_attention.py", "docs/sparse_attention.md", "sparse_attention",
        "validation loss against KV budget per method, and streaming loss per 500 characters",
        quick=("--n-windows", "2", "--n-prompts", "2", "--n-tokens", "16", "--stream-chars", "1000",
               "--time-tokens", "16", "--repeats", "1")),
    Run("main_continuous_batching_prefix_sharing", "main_continuous_batching.py", "docs/batching.md",
        args=("--prefix-sharing",), quick=("--n-requests", "8", "--repeats", "1", "--turns", "2")),
    Run("main_linear_attention", "main_linear_attention.py", "docs/linear_attention.md", "linear_attention",
        "cache per sequence and TPOT against context, recall accuracy against key-value pairs",
        quick=("--contexts", "128", "256", "--n-tokens", "4", "--repeats", "1", "--val-batches", "2",
               "--recall-steps", "2")),
    # 2 gloo processes: the script starts torchrun itself (--ranks 2), as `torchrun --nproc-per-node 2` would
    Run("main_tensor_parallel", "main_tensor_parallel.py", "docs/distributed.md", "tensor_parallel",
        "time of prefill and decoding steps relative to one rank of one thread, the all-reduce hatched",
        args=("--ranks", "2"), quick=("--batch-size", "4", "--n-tokens", "4", "--repeats", "1")),
    Run("main_multi_lora", "main_multi_lora.py", "docs/multi_lora.md", "multi_lora",
        "throughput and weight memory against the number of distinct adapters, and each adapter's loss",
        quick=("--lora-steps", "2", "--adapter-counts", "1", "4", "--n-tokens", "8", "--repeats", "1",
               "--val-batches", "2")),
    Run("main_disaggregation", "main_disaggregation.py", "docs/distributed.md", "disaggregation",
        "TTFT and TPOT per request: the colocated paged engine and the disaggregated pair",
        quick=("--n-requests", "8", "--repeats", "1")),
]
SUMMARY = ("README.md", "summary")  # the one-glance table: <!-- reproduce:summary:table -->


# ----------------------------------------------------------------------------------------------------
# Markdown: tables from a script's JSON, and blocks between markers.

def cell(value, fmt):
    """None -> '-', numbers with the column's format, anything else as it is."""
    if value is None:
        return "-"
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        try:
            return fmt.format(value)
        except (ValueError, IndexError, KeyError) as e:
            raise ReproduceError(f"format {fmt!r} does not fit {value!r} ({e})") from None
    return str(value).replace("|", "\\|")


def markdown_table(columns, rows):
    """`columns` [[key, header, format]] as the script printed them, `rows` [{key: value}]."""
    numeric = [any(isinstance(r.get(k), (int, float)) and not isinstance(r.get(k), bool) for r in rows)
               for k, _, _ in columns]
    lines = ["| " + " | ".join(h for _, h, _ in columns) + " |",
             "| " + " | ".join("---:" if n else "---" for n in numeric) + " |"]
    lines += ["| " + " | ".join(cell(r.get(k), f) for k, _, f in columns) + " |" for r in rows]
    return "\n".join(lines)


def markers(name, part):
    return f"<!-- reproduce:{name}:{part} -->", f"<!-- /reproduce:{name}:{part} -->"


def replace_block(text, name, part, content, where):
    """`text` with the lines between the block's two markers replaced by `content`; nothing else changes."""
    start, end = markers(name, part)
    i, j = text.find(start), text.find(end)
    if i < 0 or j < i or text.count(start) > 1 or text.count(end) > 1:
        raise ReproduceError(f"{where} needs exactly one block {start} ... {end} (a marker line each) "
                             "where these figures go")
    return text[:i + len(start)] + "\n\n" + content.strip("\n") + "\n\n" + text[j:]


def check_markers(pages, runs):
    """Every block the runs will write exists: a missing marker is an error before any script runs."""
    wanted = [(run.page, run.name, part) for run in runs for part in ("table", "plot")[:1 + bool(run.plot)]]
    for page, name, part in wanted + [(SUMMARY[0], SUMMARY[1], "table")]:
        replace_block(read_text(pages / page), name, part, "", pages / page)


def read_text(path):
    try:
        return path.read_text()
    except OSError as e:
        raise ReproduceError(f"cannot read {path} ({e})") from None


# ----------------------------------------------------------------------------------------------------
# Running the scripts.

def machine(device):
    """CPU model and cores, and the GPU's name on CUDA."""
    try:
        cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
                   None)
    except OSError:
        cpu = None
    text = f"{cpu or platform.processor() or platform.machine()}, {os.cpu_count()} cores"
    if device.startswith("cuda"):
        import torch
        text += f", GPU {torch.cuda.get_device_name(torch.device(device))}"
    return text


def command(run, args):
    flags = list(run.args) + (["--untrained", *run.quick] if args.quick else [])
    return [run.script, *flags] + (["--device", args.device] if args.device else [])


def stderr_tail(path, n=12):
    """The last lines of a log; tqdm's carriage returns split lines too."""
    lines = [line for line in read_text(path).replace("\r", "\n").splitlines() if line.strip()]
    return "\n".join(lines[-n:])


def execute(run, args, results):
    """Run one script; on success save its JSON (with the machine, date and command) and plot under
    `results` and return None, else a message with the exit code and the end of its stderr."""
    partial, logs = results / "partial", results / "logs"
    partial.mkdir(parents=True, exist_ok=True)
    logs.mkdir(parents=True, exist_ok=True)
    out_json, out_png = partial / f"{run.name}.json", partial / f"{run.name}.png"
    out_json.unlink(missing_ok=True)
    out_png.unlink(missing_ok=True)
    cmd = command(run, args)
    full = [sys.executable, *cmd, "--json", str(out_json)] + (["--plot", str(out_png)] if run.plot else [])
    load, start = os.getloadavg()[0], time.time()
    with open(logs / f"{run.name}.out", "w") as out, open(logs / f"{run.name}.err", "w") as err:
        rc = subprocess.run(full, cwd=ROOT, stdout=out, stderr=err, stdin=subprocess.DEVNULL).returncode
    err = logs / f"{run.name}.err"
    if rc != 0:
        return (f"{' '.join(cmd)} failed with exit code {rc}; its block stays as it was. Last lines of its stderr "
                f"({err}):\n{stderr_tail(err)}")
    if run.plot and not out_png.is_file():
        return f"{' '.join(cmd)} exited with 0 but saved no plot at {out_png}; its block stays as it was"
    try:
        result = load_result(out_json, keys=("script", "preset", "device", "torch", "columns", "rows"))
    except ReproduceError as e:
        return f"{' '.join(cmd)} exited with 0, but {e}; its block stays as it was"
    result["reproduce"] = {"command": " ".join(["python", *cmd]), "machine": machine(result["device"]),
                     "date": datetime.date.today().isoformat(), "seconds": round(time.time() - start),
                     "load_average": round(load, 1)}
    files.atomic_write_bytes((json.dumps(result, indent=2) + "\n").encode(), results / f"{run.name}.json")
    out_json.unlink()
    if run.plot:
        os.replace(out_png, results / f"{run.name}.png")
    return None


def load_result(path, keys=("script", "preset", "device", "torch", "columns", "rows", "reproduce")):
    try:
        result = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ReproduceError(f"{path} is not a readable results file ({e}); rerun its script") from None
    missing = [k for k in keys if k not in result]
    if missing:
        raise ReproduceError(f"{path} lacks {', '.join(missing)}: an older script or reproduce.py wrote it; rerun it")
    return result


# ----------------------------------------------------------------------------------------------------
# The blocks of one run.

UNTRAINED = " **Untrained weights (a smoke run): the losses mean nothing.**"


def caption(result):
    run = result["reproduce"]
    return (f"*From `{run['command']}`, run by `python reproduce.py` on {run['date']}: {run['machine']}, "
            f"torch {result['torch']}, preset `{result['preset']}`, device `{result['device']}`, load average "
            f"{run['load_average']} at the start, {run['seconds']} s.*"
            + (UNTRAINED if result.get("untrained") else ""))


def long_context_table(result):
    """main_flash_attention's benchmark of the attention functions alone: {name: {context, ms, peak_mb}}."""
    bench = result.get("long_context") or {}
    if "naive" not in bench or "SDPA" not in bench:
        return ""
    names = list(bench)
    columns = ([("context", "context", "{:,}")] + [(f"{n} ms", f"{n} ms", "{:.2f}") for n in names]
               + [(f"{n} MB", f"{n} MB", "{:.2f}") for n in names]
               + [("time", "naive/SDPA time", "{:.1f}x"), ("memory", "naive/SDPA memory", "{:.1f}x")])
    rows = []
    for i, n in enumerate(bench["naive"]["context"]):
        row = {"context": n, **{f"{k} ms": bench[k]["ms"][i] for k in names},
               **{f"{k} MB": bench[k]["peak_mb"][i] for k in names}}
        row.update(time=iu.ratio(row["naive ms"], row["SDPA ms"]), memory=iu.ratio(row["naive MB"], row["SDPA MB"]))
        rows.append(row)
    note = f"FlexAttention: {result['flex_note']}" if result.get("flex_note") else ""
    if result.get("flex_max_diff") is not None:
        note = f"FlexAttention against naive attention with the same mask: max |diff| {result['flex_max_diff']:.1e}"
    return ("The attention functions alone on random inputs (peak MB above the inputs):\n\n"
            + markdown_table(columns, rows) + (f"\n\n{note}" if note else ""))


def gqa_points_table(result):
    """main_mla's GQA and MQA points of its plot, converted and uptrained in the same run."""
    points = result.get("gqa_points") or []
    columns = [("variant", "variant", "{}"), ("cache_per_token", "cache_per_token", "{}"),
               ("kv_cache_mb", "KV MB", "{:.3f}"), ("loss_converted", "loss_converted", "{:.4f}"),
               ("val_loss", "val loss", "{:.4f}")]
    return ("The plot's GQA and MQA points (same run, same uptraining):\n\n" + markdown_table(columns, points)
            if points else "")


def threshold_table(result):
    """main_semantic_cache's threshold sweep on the labelled pairs."""
    columns = [("threshold", "threshold", "{:.2f}"), ("precision", "precision", "{:.3f}"),
               ("recall", "recall", "{:.3f}"), ("hit_rate", "hit rate", "{:.3f}")]
    points = result.get("threshold_table") or []
    return "The threshold sweep on the labelled pairs:\n\n" + markdown_table(columns, points) if points else ""


def linear_tables(r):
    """main_linear_attention's memory-and-time and recall tables."""
    return ("Cache per sequence and TPOT after a prompt of each length:\n\n"
            + markdown_table(r["context_columns"], r["context_rows"])
            + "\n\nAssociative recall (MQAR): accuracy of the answers against the number of key-value pairs:\n\n"
            + markdown_table(r["recall_columns"], r["recall_rows"]))


EXTRA_TABLES = {"main_flash_attention": long_context_table, "main_mla": gqa_points_table,
                "main_semantic_cache": threshold_table, "main_linear_attention": linear_tables}


def table_block(run, result):
    parts = [caption(result), markdown_table(result["columns"], result["rows"])]
    lines = list(result.get("summary") or [])  # the script's printed lines under its table (checks included)
    if lines:
        parts.append("\n".join(f"- {line}" for line in lines))
    if run.name in EXTRA_TABLES:
        parts.append(EXTRA_TABLES[run.name](result))
    return "\n\n".join(p for p in parts if p)


def plot_path(run, result):
    return f"docs/{run.plot}_{result['device'].split(':')[0]}.png"


def plot_block(run, result):
    link = os.path.relpath(plot_path(run, result), Path(run.page).parent)
    run_info = result["reproduce"]
    return (f"![{run.alt}]({link})\n\n*The plot of `{run_info['command']} --plot`, {run_info['date']}: "
            f"{run_info['machine']}, device `{result['device']}`.*" + (UNTRAINED if result.get("untrained") else ""))


# ----------------------------------------------------------------------------------------------------
# The one-glance table of the README: a headline figure per run, looked up by variant name.

def find(result, variant, **fields):
    """The row of `variant` (exact, else the one row whose name starts with it) whose fields match."""
    rows = [r for r in result["rows"] if all(r.get(k) == v for k, v in fields.items())]
    exact = [r for r in rows if r["variant"] == variant]
    found = exact or [r for r in rows if str(r["variant"]).startswith(variant)]
    if len(found) < 1 or not exact and len(found) > 1:
        where = f" with {fields}" if fields else ""
        names = sorted({str(r["variant"]) for r in result["rows"]})
        raise ReproduceError(f"{result['script']}: no single row {variant!r}{where} among {names}; update its "
                             "headline in reproduce.py")
    return found[0]


def x(a, b, fmt="{:.1f}x"):
    """a / b as a ratio, '-' where either could not be measured."""
    return num(iu.ratio(a, b), fmt)


def num(value, fmt):
    return "-" if value is None else fmt.format(value)


def kvcache_headline(r):
    tpot = lambda v, b: find(r, v, batch_size=b)["tpot_ms"]  # noqa: E731
    batches = sorted({row["batch_size"] for row in r["rows"]}, reverse=True)
    return ("KV cache, dynamic and static", "TPOT no cache / dynamic cache: " + ", ".join(
        f"{x(tpot('no cache', b), tpot('dynamic KV cache', b))} at batch {b}" for b in batches) + "; static / dynamic: "
        + ", ".join(x(tpot("static KV cache", b), tpot("dynamic KV cache", b), "{:.2f}") for b in batches)
        + "; the same tokens within the window")


def prefix_headline(r):
    post, store = f"post, {r['prefix_len']}+{r['request_len']}", "system prompt + question"
    gain = lambda v, w, b: x(find(r, "no prefix cache", workload=w, batch_size=b)["ttft_ms"],  # noqa: E731
                             find(r, v, workload=w, batch_size=b)["ttft_ms"], "{:.2f}x")
    batches = sorted({row["batch_size"] for row in r["rows"] if row["workload"] == post}, reverse=True)
    return (f"prefix caching, {r['prefix_len']}-token prefix + {r['request_len']}-token requests",
            "TTFT without / with the post's cache: " + ", ".join(
                f"{gain('prefix cache (post)', post, b)} at batch {b}" for b in batches)
            + f"; the PrefixCache store {gain('PrefixCache store', store, 1)} at batch 1; identical tokens")


def semantic_headline(r):
    pairs = [p for p in r["threshold_table"] if p["threshold"] == r["threshold"]]
    if len(pairs) != 1:
        raise ReproduceError(f"{r['script']}: no single threshold {r['threshold']} in its threshold_table; update its "
                             "headline in reproduce.py")
    hit, model = find(r, "semantic cache hit"), find(r, "GPTlite call (no cache)")
    return (f"semantic caching, threshold {r['threshold']}",
            f"precision {pairs[0]['precision']:.3f}, recall {pairs[0]['recall']:.3f} on {r['n_pairs']} labelled pairs; a semantic "
            f"hit (lookup {num(hit['ttft_ms'], '{:.1f}')} ms) delivers a whole answer "
            f"{x(hit['tokens_per_s'], model['tokens_per_s'])} as fast as GPTlite writes it")


def static_headline(r):
    return (f"static batching, {r['n_requests']} requests at time 0, no KV cache", "; ".join(
        f"{row['variant'].removeprefix('static batching, ')}: {num(row['tokens_per_s'], '{:.0f}')} tok/s, "
        f"{row['wasted_slot_steps']} wasted slot-steps" for row in r["rows"]))


def continuous_headline(r):
    static, cont, paged = (find(r, v) for v in ("static batching", "continuous batching", "paged, whole prompts"))
    return (f"continuous vs static batching, paged KV cache: {r['trace']['n_requests']}-request trace, "
            f"batch {r['batch_size']}",
            f"throughput {x(cont['tokens_per_s'], static['tokens_per_s'], '{:.2f}x')} ({cont['steps']} steps "
            f"against {static['steps']}); the paged cache fills {num(paged['kv_util'], '{:.0%}')} of its reserved "
            f"slots, a contiguous max-length reservation {num(paged['kv_contig'], '{:.0%}')}")


def long_prompts_headline(r):
    whole, chunked = find(r, "paged, whole prompts"), find(r, "paged, chunked prefill")
    median = statistics.median(r["trace"]["prompt_lens"])
    return (f"chunked prefill, trace with long prompts (median {median:.0f} tokens)",
            f"p99 TPOT {num(chunked['tpot_p99_ms'], '{:.1f}')} ms chunked against "
            f"{num(whole['tpot_p99_ms'], '{:.1f}')} ms whole-prompt; p50 TTFT {num(chunked['ttft_arrival_ms'], '{:.0f}')} "
            f"against {num(whole['ttft_arrival_ms'], '{:.0f}')} ms")


def flash_headline(r):
    naive, sdpa = r["long_context"]["naive"], r["long_context"]["SDPA"]
    on_model = [num(find(r, v)["ttft_ms"], "{:.1f}") for v in ("SDPA (default dispatch)", "naive")]
    return (f"SDPA vs naive attention, {naive['context'][-1]:,} tokens",
            f"{x(naive['peak_mb'][-1], sdpa['peak_mb'][-1], '{:.0f}x')} less peak attention memory, "
            f"{x(naive['ms'][-1], sdpa['ms'][-1])} faster; on the model TTFT {on_model[0]} against {on_model[1]} ms, "
            "the same tokens")


def gqa_headline(r):
    mha = find(r, "MHA")
    others = [row for row in r["rows"] if row is not mha]
    listed = lambda key, rows, fmt="{}": ", ".join(f"{row['variant']} {num(row[key], fmt)}" for row in rows)  # noqa
    return (f"GQA and MQA, converted from MHA, {r['uptrain_steps']} uptraining steps",
            f"KV cache / MHA's: {listed('kv_vs_mha', others)}; TPOT at batch {mha['batch_size']}: "
            f"{listed('tpot_ms', [mha] + others, '{:.1f}')} ms; loss against MHA: {listed('loss_vs_mha', others, '{:+.4f}')}")


def mla_headline(r):
    mha = find(r, "MHA")
    latents = [row["d_latent"] for row in r["rows"] if row["absorb"] == "yes"]
    absorbed = {d: find(r, f"MLA-{d} absorbed") for d in latents}
    speed = [iu.ratio(find(r, f"MLA-{d} recomputed")["tpot_ms"], absorbed[d]["tpot_ms"]) for d in latents]
    speed = [s for s in speed if s is not None]
    figures = [f"MLA-{d} {absorbed[d]['loss_vs_mha']:+.4f} (cache {absorbed[d]['kv_vs_mha']})" for d in latents]
    figures += [f"{p['variant']} {p['val_loss'] - mha['val_loss']:+.4f} ({p['cache_per_token']} values)"
                for p in r.get("gqa_points") or []]
    return (f"MLA, converted by SVD, {r['uptrain_steps']} uptraining steps",
            "loss against MHA: " + ", ".join(figures)
            + (f"; TPOT recomputed / absorbed: {min(speed):.1f}x to {max(speed):.1f}x" if speed else ""))


def distillation_headline(r):
    teacher, hard, soft, both = (find(r, v) for v in ("teacher", "hard labels", "soft labels", "soft + hard"))
    return (f"distillation, {hard['params'] / 1e6:.2f}M student of the {teacher['params'] / 1e6:.2f}M model, "
            f"{r['iters']} steps",
            f"val loss soft + hard {both['val_loss']:.3f}, hard labels {hard['val_loss']:.3f}, soft labels "
            f"{soft['val_loss']:.3f} (teacher {teacher['val_loss']:.3f}); TPOT {num(hard['speedup'], '{:.1f}')}x "
            "below the teacher's")


def pruning_headline(r):
    original, one_shot, iterative, scratch, random_prune = (
        find(r, v) for v in ("original", "one-shot", "iterative", "random init", "random prune"))
    return (f"pruning to {r['config']['n_heads']} heads and {r['config']['d_ff']} neurons a block, "
            f"{r['iters']} distillation steps",
            f"val loss one-shot {one_shot['val_loss']:.3f}, iterative {iterative['val_loss']:.3f}, the same "
            f"architecture from random weights {scratch['val_loss']:.3f} (original {original['val_loss']:.3f}); "
            f"right after pruning {one_shot['val_pruned']:.2f} by importance against "
            f"{random_prune['val_pruned']:.2f} at random")


def structured_headline(r):
    turn = lambda v: find(r, v, grammar="play turn (EBNF)")  # noqa: E731
    direction = find(r, "constrained + jump-forward", grammar="stage direction (EBNF)")
    return ("structured decoding (XGrammar), jump-forward",
            f"play turns accepted: {turn('unconstrained')['accepted']:.0%} unconstrained, "
            f"{turn('constrained')['accepted']:.0%} constrained; jump-forward: "
            f"{turn('constrained + jump-forward')['calls_per_char']:.2f} model calls per character on play turns, "
            f"{direction['calls_per_char']:.2f} on stage directions; the same text")


def flash_decoding_headline(r):
    last = [k for k in find(r, "SDPA") if k.endswith(" ms")][-1]  # the longest context's column
    flash = [row for row in r["rows"] if row["n_splits"]]
    best = min(flash, key=lambda row: row[last])
    return (f"FlashDecoding (split-KV), one query over {last.removesuffix(' ms')} tokens, batch {r['bench_batch']}",
            "time / SDPA's: " + ", ".join(f"n_splits={row['n_splits']} {x(row[last], find(r, 'SDPA')[last], '{:.2f}x')}"
                                          for row in (flash[0], flash[-1]))
            + f" (best n_splits={best['n_splits']}) on {r['device']}; exact (max |diff| "
            f"{r['max_diff']:.0e}), the same tokens for every n_splits")


def sage_headline(r):
    exact, int8, int4 = (find(r, v) for v in ("exact", "INT8 + smooth K", "INT4 + smooth Q, K"))
    return ("SageAttention: INT8 Q and K per block, K smoothed; INT4 (SageAttention2-style)",
            f"val loss {int8['val_loss'] - exact['val_loss']:+.4f} (INT8), {int4['val_loss'] - exact['val_loss']:+.4f} "
            f"(INT4) against float32; relative L1 on the model's Q, K, V {int8['rel_l1_model']} (INT8); Q and K "
            f"bytes {x(exact['qk_bytes'], int8['qk_bytes'])} smaller than float32's")


def moba_headline(r):
    dense, rest = r["rows"][0], r["rows"][1:]
    return (f"MoBA, blocks of {r['block_size']}, {r['uptrain_steps']} uptraining steps",
            "loss against dense at inference only / uptrained: " + ", ".join(
                f"top-{row['top_k']} ({row['kv_kb_token'] / dense['kv_kb_token']:.0%} of the KV bytes) "
                f"{row['gap_inference']:+.4f} / {row['gap_uptrained']:+.4f}" for row in rest))


def sparse_headline(r):
    budgets = sorted({row["budget"] for row in r["rows"] if row["method"] != "dense"})
    budget = budgets[len(budgets) // 2]  # the middle one
    losses = ", ".join(f"{m} {find(r, f'{m} {budget}')['loss_vs_dense']:+.3f}"
                       for m in ("window", "sinks", "H2O", "SnapKV", "Quest"))
    stream = {row["variant"]: row for row in r["stream_rows"]}
    worst = lambda key: num(next(v for k, v in stream.items() if key in k)["worst_segment"], "{:.2f}")  # noqa: E731
    return (f"KV budgets without retraining (window, sinks, H2O, SnapKV, Quest), budget {budget} of "
            f"{find(r, 'dense')['budget']}",
            f"loss against dense: {losses}; streaming {r['segment']}-character worst segment: rotary window cache "
            f"{worst('window cache')}, sinks {worst('sinks')}, re-encoding {worst('rotary: re-encode')}; "
            f"the post's clamped cache {worst('clamp')} against re-encoding {worst('GPTlite: re-encode')}")


def prefix_sharing_headline(r):
    off, on = find(r, "system prompt, no sharing"), find(r, "system prompt, prefix sharing")
    turns_off, turns_on = find(r, "multi-turn, no sharing"), find(r, "multi-turn, prefix sharing")
    roomy = find(r, f"multi-turn, {r['roomy_blocks']} blocks, prefix sharing")
    return (f"prefix sharing in the paged engine: {r['system_len']}-token system prompt, {r['turns']}-turn "
            "conversations",
            f"p50 TTFT {x(off['ttft_arrival_ms'], on['ttft_arrival_ms'])} lower with shared blocks (hit rate "
            f"{on['hit_rate']:.0%}, peak KV blocks in use {off['kv_blocks_peak']} -> {on['kv_blocks_peak']}); "
            "multi-turn "
            f"{x(turns_off['ttft_arrival_ms'], turns_on['ttft_arrival_ms'])} (hit rate {turns_on['hit_rate']:.0%}), "
            f"{x(turns_off['ttft_arrival_ms'], roomy['ttft_arrival_ms'])} with a pool of {r['roomy_blocks']} blocks "
            f"(hit rate {roomy['hit_rate']:.0%}); identical tokens")


def linear_headline(r):
    softmax = find(r, "softmax")
    longest = max(row["context"] for row in r["context_rows"])
    at = {row["variant"]: row for row in r["context_rows"] if row["context"] == longest}
    recall = {row["variant"]: row for row in r["recall_rows"]}
    most = max(r["recall_pairs"])
    return (f"linear attention, gated, Gated DeltaNet and a 3:1 hybrid, trained {r['preset_config']['iters']} steps",
            "val loss against softmax: " + ", ".join(f"{row['variant']} {row['loss_vs_softmax']:+.3f}"
                                                     for row in r["rows"] if row is not softmax)
            + f"; at {longest} tokens cache {at['delta']['cache_kb']:.0f} against {at['softmax']['cache_kb']:.0f} KiB, "
            f"TPOT {num(at['delta']['tpot_ms'], '{:.1f}')} against {num(at['softmax']['tpot_ms'], '{:.1f}')} ms; "
            f"recall at {most} pairs: " + ", ".join(f"{name} {row[f'acc_{most}_pairs']:.2f}"
                                                    for name, row in recall.items()))


def tensor_parallel_headline(r):
    one, tp = find(r, "1 rank x 1 thread"), find(r, f"{r['world_size']} ranks")
    return (f"tensor parallelism, {r['world_size']} {r['backend']} ranks of {r['threads']} thread(s)",
            f"TP against 1 rank x 1 thread: prefill {x(one['prefill_ms'], tp['prefill_ms'], '{:.2f}x')}, TPOT at "
            f"batch 1 {x(one['tpot_b1_ms'], tp['tpot_b1_ms'], '{:.2f}x')}, at batch {tp['batch']} "
            f"{x(one['tpot_bB_ms'], tp['tpot_bB_ms'], '{:.2f}x')} (above 1: faster); all-reduce "
            f"{num(tp['ar_b1'], '{:.0f}')}% of a batch-1 step; max |logits diff| {r['logits_max_diff']:.0e}, identical tokens")


def multi_lora_headline(r):
    k = max(row["n_adapters"] for row in r["rows"])
    merged, batched = find(r, "merged", n_adapters=k), find(r, "batched", n_adapters=k)
    gains = ", ".join(f"{a['speaker']} {a['gain']:+.3f}" for a in r["adapter_losses"])
    return (f"multi-LoRA serving, {merged['batch_size']} requests over {k} adapters of rank {r['rank']}",
            f"one batched forward (BGMV) {x(batched['tokens_per_s'], merged['tokens_per_s'])} the throughput of "
            f"{k} merged copies, weights {batched['weights_mb']:.1f} MB against {merged['weights_mb']:.1f} MB; "
            f"loss on its speaker's held-out turns, base minus adapter (above 0: it learned): {gains} nats/char; "
            "the same tokens")


def disaggregation_headline(r):
    whole, chunked, split = (find(r, v) for v in ("colocated, whole prompts (2", "colocated, chunked prefill",
                                                  "disaggregated"))
    ms = lambda row, key: num(row[key], "{:.1f}")  # noqa: E731
    return ("disaggregated prefill and decode, 2 gloo workers against the colocated paged engine, equal CPU",
            f"p99 TPOT {ms(split, 'tpot_p99_ms')} ms against {ms(whole, 'tpot_p99_ms')} colocated "
            f"({ms(chunked, 'tpot_p99_ms')} chunked); p50 TTFT {ms(split, 'ttft_arrival_ms')} against "
            f"{ms(whole, 'ttft_arrival_ms')} ms; {num(split['kv_sent_KB'], '{:.0f}')} KB of KV per request, sent in "
            f"{num(split['send_ms'], '{:.2f}')} ms; the same tokens")


HEADLINES = {"main_kvcache": kvcache_headline, "main_prefix_cache": prefix_headline,
             "main_semantic_cache": semantic_headline, "main_static_batching": static_headline,
             "main_continuous_batching": continuous_headline,
             "main_continuous_batching_long_prompts": long_prompts_headline,
             "main_flash_attention": flash_headline, "main_gqa": gqa_headline, "main_mla": mla_headline,
             "main_distillation": distillation_headline, "main_pruning": pruning_headline,
             "main_structured_decoding": structured_headline,
             "main_flash_decoding": flash_decoding_headline, "main_sage_attention": sage_headline,
             "main_moba": moba_headline,
             "main_sparse_attention": sparse_headline,
             "main_continuous_batching_prefix_sharing": prefix_sharing_headline,
             "main_linear_attention": linear_headline,
             "main_tensor_parallel": tensor_parallel_headline,
             "main_multi_lora": multi_lora_headline,
             "main_disaggregation": disaggregation_headline}


def summary_block(results):
    """The README's one-glance table from every run's results."""
    rows = []
    for run in RUNS:
        result = results[run.name]
        technique, figure = HEADLINES[run.name](result)
        title = Path(run.page).stem.replace("_", " ")
        page = "[above](#kv-cache)" if run.page == SUMMARY[0] else f"[{title}]({run.page})"
        run_info = result["reproduce"]
        rows.append({"technique": technique, "figure": figure, "page": page,
                     "run": f"{run_info['date']}, {run_info['seconds']} s"})
    columns = [("technique", "technique", "{}"), ("figure", "headline figure", "{}"), ("run", "run", "{}"),
               ("page", "page", "{}")]
    machines = sorted({f"{results[run.name]['reproduce']['machine']}, torch {results[run.name]['torch']}, device "
                       f"`{results[run.name]['device']}`" for run in RUNS})
    untrained = any(results[run.name].get("untrained") for run in RUNS)
    return (f"*Generated by `python reproduce.py` from each script's last successful run on {'; '.join(machines)}.*"
            + (UNTRAINED if untrained else "")
            + "\n\n" + markdown_table(columns, rows))


# ----------------------------------------------------------------------------------------------------
# Rendering the pages.

def render(runs, pages, results_dir, problems):
    """Rewrite the blocks of `runs` (those without a problem) and the one-glance table; copy the plots."""
    edits = {}  # page -> text

    def edit(page, name, part, content):
        path = pages / page
        edits[page] = replace_block(edits.get(page) or read_text(path), name, part, content, path)

    for run in runs:
        if run.name in problems:
            continue
        path = results_dir / f"{run.name}.json"
        try:
            if not path.is_file():
                raise ReproduceError(f"no results at {path}: run it first (without --skip-run)")
            result = load_result(path)
            table = table_block(run, result)
            png = (results_dir / f"{run.name}.png").read_bytes() if run.plot else None
        except (ReproduceError, OSError, KeyError, TypeError, ValueError) as e:  # the block stays as it was
            problems[run.name] = f"{type(e).__name__}: {e}"
            continue
        edit(run.page, run.name, "table", table)
        if run.plot:
            files.atomic_write_bytes(png, pages / plot_path(run, result))
            edit(run.page, run.name, "plot", plot_block(run, result))
    results = {run.name: results_dir / f"{run.name}.json" for run in RUNS}  # a failed run's last good one
    missing = [name for name, path in results.items() if not path.is_file()]
    if missing:
        print(f"the one-glance table of {SUMMARY[0]} is left as it was: no results of {', '.join(missing)}")
    else:
        try:
            edit(SUMMARY[0], SUMMARY[1], "table", summary_block({n: load_result(p) for n, p in results.items()}))
        except Exception as e:  # a headline that no longer fits its script's JSON: reported, README untouched
            problems["one-glance table"] = f"{SUMMARY[0]} left as it was: {type(e).__name__}: {e}"
    for page, text in edits.items():
        files.atomic_write_bytes(text.encode(), pages / page)
        print(f"wrote {pages / page}")


def select(only, parser):
    if not only:
        return RUNS
    names = {run.name for run in RUNS} | {run.script for run in RUNS}
    unknown = [o for o in only if o not in names]
    if unknown:
        parser.error(f"--only {' '.join(unknown)}: choose among {', '.join(sorted(names))}")
    return [run for run in RUNS if run.name in only or run.script in only]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="a smoke run: every script with --untrained and small flags, rendered into --out")
    parser.add_argument("--device", default=None, help="passed to every script (default: theirs, CUDA when available)")
    parser.add_argument("--only", nargs="+", default=None, metavar="SCRIPT",
                        help="run only these scripts (main_gqa.py) or runs (main_continuous_batching_long_prompts)")
    parser.add_argument("--skip-run", action="store_true", help="run nothing: re-render from the JSON of the last runs")
    parser.add_argument("--out", default=None, metavar="DIR",
                        help="results and rendered copies of README.md and docs/ go to DIR, the repository's pages are "
                             "left alone (default with --quick: results/quick; else results/ and the pages themselves)")
    args = parser.parse_args(argv)
    runs = select(args.only, parser)
    try:
        harness.get_device(args.device)  # a bad --device is one error now, not one per script
    except GPTliteError as e:
        parser.error(str(e))
    out = Path(args.out) if args.out else ROOT / "results" / "quick" if args.quick else None
    results_dir, pages = (out, out / "pages") if out else (ROOT / "results", ROOT)
    if out:  # fresh copies of the pages, so that their prose is the repository's
        for page in {run.page for run in RUNS} | {SUMMARY[0]}:
            (pages / page).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(ROOT / page, pages / page)
    check_markers(pages, runs)

    problems = {}
    if not args.skip_run:
        bar = tqdm(runs, desc="scripts", unit="script", dynamic_ncols=True)
        for run in bar:
            bar.set_postfix_str(" ".join(command(run, args)))
            problem = execute(run, args, results_dir)
            if problem:
                problems[run.name] = problem
                tqdm.write(f"FAILED: {problem}")
    render(runs, pages, results_dir, problems)
    for run in runs:
        print(f"{run.name}: {'FAILED (block left as it was)' if run.name in problems else 'ok'}")
    if problems:
        sys.exit(f"{len(problems)} problem(s):\n" + "\n".join(f"- {name}: {p}" for name, p in problems.items()))


if __name__ == "__main__":
    harness.run(main)
