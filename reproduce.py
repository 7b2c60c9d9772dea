"""One command reproduces the results pages: every script's default run, then every table and plot.

    python reproduce.py                         # every script in turn (about 2 hours on 2 CPU cores)
    python reproduce.py --quick                 # a smoke run in a few minutes, rendered into results/quick/
    python reproduce.py --only main_gqa.py      # rerun some scripts; the other blocks stay as they are
    python reproduce.py --skip-run              # re-render the pages from the results/ JSON of the last run
    python reproduce.py --fresh                 # every checkpoint trained again from scratch first (over 2 hours)
    python reproduce.py --dry-run               # print the commands it would run, and the last run's minutes
    python reproduce.py --device cuda --budget 10   # one GPU: the post's headline scripts in 10 minutes

The GPU run (--budget, with --device cuda) trains checkpoints/gptlite.pt for a share of the budget (the post's
preset, its steps cut to fit), then runs the post's headline scripts at that preset (GPU_STEPS) with that
checkpoint, in order, each only when its estimated minutes still fit in what is left (else one line says it
is skipped), each stopped when the budget runs out; --dry-run prints that plan without a GPU.

Each script runs as `python <script> --json PATH --plot PATH` (plus --device), one after the other: the
first one trains checkpoints/<preset>.pt when it is missing. Its JSON, with the machine and date added ("reproduce"),
goes to results/<run>.json; then the blocks between `<!-- reproduce:<run>:<part> -->` and
`<!-- /reproduce:<run>:<part> -->` in README.md and docs/*.md are rewritten from it, and nothing else
is. A script that fails is reported (exit code, last lines of its stderr); its block, plot and results
stay as they were, the other scripts still run, and the command exits with 1 at the end.

Each script words its own headline (the README's one-glance row) and extra tables in its JSON: this file
knows no variant of any script. A GPU's results (--device cuda) go to results/cuda/ and into blocks of
their own, `<!-- reproduce:<run>:<part>:cuda -->`, made beside the CPU's when a page lacks them: never over
the CPU figures. On a busy machine (load average above 1.5 per core) nothing replaces the repository's
pages unless --busy-ok says so: its timings would be distorted. A run for the pages starts each script once
the load average is below 1 (the previous script's load decays in about a minute; at most 5 minutes' wait),
and each caption shows the load at its script's start.

After the scripts, the checkpoints they used (checkpoints/*.pt) are listed with the sha256 of their weights
(saved in each file, verified when it is read) in results/checkpoints.json and the README's block
`<!-- reproduce:checkpoints:table -->`, with the machine: training is deterministic on one kind of CPU (not
across CPU models, whose kernels round differently), so a fresh clone that runs `python reproduce.py --fresh`
on such a machine gets these hashes and the figures of the pages (timings aside). --fresh moves the existing
checkpoints to checkpoints/before-fresh-<time>/ first, so that every script trains what it uses.
"""
import argparse
import datetime
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from lib import attention_summary, distributed, files, harness, presets
from lib.errors import GPTliteError

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
        args=("--sweep",), quick=("--n-tokens", "16", "--repeats", "1")),
    Run("main_prefix_cache", "main_prefix_cache.py", "docs/caching.md", "prefix_cache",
        "TTFT against the shared prefix length, with and without the prefix cache",
        args=("--sweep",), quick=("--repeats", "1", "--n-requests", "3", "--turns", "2")),
    Run("main_semantic_cache", "main_semantic_cache.py", "docs/caching.md", "semantic_cache",
        "precision, recall and hit rate against the threshold", quick=("--n-tokens", "8", "--repeats", "1")),
    Run("main_static_batching", "main_static_batching.py", "docs/batching.md", "static_batching",
        "wasted slot-steps of static batching against batch size", quick=("--n-requests", "8", "--repeats", "1")),
    Run("main_continuous_batching", "main_continuous_batching.py", "docs/batching.md", "continuous_batching",
        "throughput and p99 TPOT against batch size", args=("--sweep-batch-sizes", "2", "4", "8", "16"),
        quick=("--n-requests", "8", "--repeats", "1", "--sweep-batch-sizes", "2", "4")),
    Run("main_continuous_batching_long_prompts", "main_continuous_batching.py", "docs/batching.md",
        args=("--prompt-median", "80", "--repeats", "5"), quick=("--n-requests", "8", "--repeats", "1")),
    Run("main_flash_attention", "main_flash_attention.py", "docs/flash_attention.md", "flash_attention",
        "attention time and peak memory against context length",
        quick=("--n-tokens", "8", "--repeats", "1", "--val-batches", "2", "--contexts", "128", "256", "512",
               "--bench-repeats", "1", "--no-flex")),
    Run("main_gqa", "main_gqa.py", "docs/gqa_mla.md", "gqa",
        "validation loss and TPOT against KV-cache size, and TPOT against bytes per step at the gptlite shape",
        quick=("--uptrain-steps", "2", "--batch-size", "4", "--n-tokens", "8", "--repeats", "1", "--shape-batch", "2",
               "--shape-context", "16", "--shape-tokens", "2")),
    Run("main_mla", "main_mla.py", "docs/gqa_mla.md", "mla",
        "MLA and GQA: validation loss against cache size, and TPOT against bytes per step at the gptlite shape",
        quick=("--uptrain-steps", "2", "--batch-size", "4", "--n-tokens", "8", "--repeats", "1", "--shape-batch", "2",
               "--shape-context", "16", "--shape-tokens", "2")),
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
    Run("main_trainable_sparse", "main_trainable_sparse.py", "docs/trainable_sparse.md", "trainable_sparse",
        "validation loss against keys read per query (inference only and uptrained), and decode attention time "
        "against context",
        quick=("--uptrain-steps", "1", "--dsa-warmup-steps", "1", "--val-batches", "1", "--bench-contexts", "256",
               "512", "--bench-repeats", "1")),
    Run("main_sparse_attention", "main_sparse_attention.py", "docs/sparse_attention.md", "sparse_attention",
        "validation loss against KV budget per method, and streaming loss per 250 characters",
        quick=("--n-windows", "2", "--n-prompts", "2", "--n-tokens", "16", "--stream-chars", "200", "--segment", "100",
               "--time-tokens", "16", "--repeats", "1")),
    Run("main_continuous_batching_prefix_sharing", "main_continuous_batching.py", "docs/batching.md",
        args=("--prefix-sharing",), quick=("--n-requests", "8", "--repeats", "1", "--turns", "2")),
    # --full-recipe: the page compares trained language models (800 steps each, the preset's own recipe; 71
    # minutes the first time on 2026-12-07's slower 2-core machine), where the default 80 steps rank early learning
    Run("main_linear_attention", "main_linear_attention.py", "docs/linear_attention.md", "linear_attention",
        "cache per sequence and TPOT against context, recall accuracy against key-value pairs and against state size",
        args=("--full-recipe",), quick=("--contexts", "128", "256", "--n-tokens", "4", "--repeats", "1", "--val-batches", "2",
               "--recall-steps", "2")),
    Run("main_sla", "main_sla.py", "docs/sla.md", "sla",
        "relative error of the attention outputs and validation loss against the share of exact tiles, SLA and "
        "sparse only, and attention FLOPs against sequence length",
        quick=("--exact", "0.25", "--fit-steps", "2", "--fit-sequences", "4", "--error-sequences", "2",
               "--val-batches", "1")),
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
    Run("main_speculative_decoding", "main_speculative_decoding.py", "docs/speculative_decoding.md",
        "speculative_decoding", "speedup over plain decoding and tokens per target call against gamma, measured "
        "beside the formulas", quick=("--draft-iters", "2", "--head-iters", "2", "--mtp-steps", "2", "--gammas", "1",
                                      "2", "--n-tokens", "8", "--repeats", "1", "--stat-samples", "200",
                                      "--stat-chars", "2", "--batch-sizes", "1", "2")),
    Run("main_moe", "main_moe.py", "docs/moe.md", "moe",
        "each layer's expert load, busiest first, with and without balancing; dropped assignments against capacity factor",
        quick=("--iters", "2", "--repeats", "1", "--n-tokens", "4", "--val-batches", "2")),
    # after main_moe: its balanced MoE is the model split here (2 gloo processes, started by the script)
    Run("main_expert_parallel", "main_expert_parallel.py", "docs/moe.md", "expert_parallel",
        "TPOT relative to one process, expert-parallel and tensor-parallel experts, the collectives hatched",
        quick=("--batch-sizes", "2", "4", "--n-tokens", "4", "--repeats", "1")),
    Run("main_pipeline_parallel", "main_pipeline_parallel.py", "docs/distributed.md", "pipeline_parallel",
        "decode throughput and bubble against micro-batches, per number of stages",
        quick=("--batch-size", "4", "--micro-batches", "1", "2", "--n-tokens", "4", "--repeats", "1")),
    Run("main_offloading", "main_offloading.py", "docs/offloading.md", "offloading",
        "TPOT and throughput against batch size: resident weights against weights streamed from disk block by block, "
        "with and without prefetch", quick=("--batch-sizes", "1", "4", "--n-tokens", "8", "--repeats", "1")),
    Run("main_quantization", "main_quantization.py", "docs/quantization.md", "quantization",
        "validation loss change against bits per weight, a matrix-vector product larger than the cache, TPOT against bytes per token at the gptlite shape, and TPOT against bytes per step from full float32 and KIVI caches there",
        quick=("--n-tokens", "4", "--prompt-len", "8", "--repeats", "1", "--val-batches", "1", "--calib-windows", "2",
               "--bench-size", "256", "--shape-batch", "2", "--shape-context", "64", "--shape-tokens", "2")),
    Run("main_sequence_parallel", "main_sequence_parallel.py", "docs/sequence_parallel.md", "sequence_parallel",
        "causal attention time and per-rank peak memory against prompt length: one process, ring, zigzag and Ulysses "
        "on 2 ranks", quick=("--seq-lens", "1024", "2048", "--check-len", "256", "--repeats", "1")),
    Run("main_compile", "main_compile.py", "docs/compile.md", "compile",
        "TPOT per variant (eager, torch.compile, transformers, CTranslate2) at batch 1 and 8, log scale, on the cpu "
        "and distilled presets' shapes", quick=("--n-tokens", "8", "--prompt-len", "8", "--repeats", "1", "--batch-sizes",
                                               "1", "--extra-presets", "--modes", "default")),
]
SUMMARY = ("README.md", "summary")  # the one-glance table: <!-- reproduce:summary:table -->
CHECKPOINTS = ("README.md", "checkpoints")  # the weights behind the figures: <!-- reproduce:checkpoints:table -->
# The post's summary of attention methods, from the rows of the scripts' JSON (lib/attention_summary.py):
ATTENTION = ("docs/attention_summary.md", "attention_summary")  # every cell with its figure
ATTENTION_SHORT = ("README.md", "attention_summary")  # the short version
BUSY_LOAD = 1.5  # load average per core above which a run's timings do not replace the pages' figures
QUIET_LOAD = 1.0  # each script of a run for the pages starts once the load average is below this (the last
QUIET_WAIT_S = 300  # script's own load decays from about 2 in some 40 s), waiting at most this long


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


def markers(name, part, device="cpu"):
    """A block's two marker lines; a GPU's blocks carry the device type: reproduce:NAME:table:cuda."""
    tag = f"{name}:{part}" + ("" if device == "cpu" else f":{device}")
    return f"<!-- reproduce:{tag} -->", f"<!-- /reproduce:{tag} -->"


def replace_block(text, name, part, content, where, device="cpu"):
    """`text` with the lines between the block's two markers replaced by `content`; nothing else changes.
    A block of another device than the CPU that the page lacks is made right after the CPU's block: the GPU
    figures go beside the CPU ones, never over them."""
    start, end = markers(name, part, device)
    if device != "cpu" and start not in text and end not in text:
        cpu_end = markers(name, part)[1]
        if text.count(cpu_end) == 1:
            i = text.index(cpu_end) + len(cpu_end)
            text = text[:i] + f"\n\n{start}\n{end}" + text[i:]
    i, j = text.find(start), text.find(end)
    if i < 0 or j < i or text.count(start) > 1 or text.count(end) > 1:
        raise ReproduceError(f"{where} needs exactly one block {start} ... {end} (a marker line each) "
                             "where these figures go")
    return text[:i + len(start)] + "\n\n" + content.strip("\n") + "\n\n" + text[j:]


def check_markers(pages, runs):
    """Every CPU block the runs will write exists: a missing marker is an error before any script runs (a
    GPU's blocks are made beside the CPU's when missing)."""
    wanted = [(run.page, run.name, part) for run in runs for part in ("table", "plot")[:1 + bool(run.plot)]]
    fixed = [(SUMMARY[0], SUMMARY[1], "table"), (CHECKPOINTS[0], CHECKPOINTS[1], "table"),
             (ATTENTION[0], ATTENTION[1], "table"), (ATTENTION_SHORT[0], ATTENTION_SHORT[1], "table")]
    for page, name, part in wanted + fixed:
        replace_block(read_text(pages / page), name, part, "", pages / page)


def read_text(path):
    try:
        return path.read_text()
    except OSError as e:
        raise ReproduceError(f"cannot read {path} ({e})") from None


# ----------------------------------------------------------------------------------------------------
# Running the scripts.

def machine(device):
    """CPU model (with its family and model numbers, which tell its generation where a virtual machine names
    only "AMD EPYC"), cores and the instruction set PyTorch's kernels use (AVX2, AVX512: their sums round
    differently, so a checkpoint trained on one differs from the other's), and the GPU's name on CUDA."""
    fields = {}
    try:
        for line in open("/proc/cpuinfo"):
            key, _, value = line.partition(":")
            if not key.strip():
                break  # the first processor's block
            fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    cpu = fields.get("model name") or platform.processor() or platform.machine()
    if "cpu family" in fields and "model" in fields:
        cpu += f" (family {fields['cpu family']}, model {fields['model']})"
    text = f"{cpu}, {os.cpu_count()} cores, {torch.backends.cpu.get_cpu_capability()}"
    if device.startswith("cuda") and torch.cuda.is_available():
        text += f", GPU {torch.cuda.get_device_name(torch.device(device))}"
    return text


def command(run, args):
    flags = list(run.args) + (["--untrained", *run.quick] if args.quick else [])
    return [run.script, *flags] + (["--device", args.device] if args.device else [])


def stderr_tail(path, n=12):
    """The last lines of a log; tqdm's carriage returns split lines too."""
    lines = [line for line in read_text(path).replace("\r", "\n").splitlines() if line.strip()]
    return "\n".join(lines[-n:])


def execute(run, cmd, results, timeout_s=None):
    """Run one script, `cmd` (the script and its flags); on success save its JSON (with the machine, date and
    command) and plot under `results` and return None, else a message with the exit code and the end of its
    stderr. A script still running after `timeout_s` seconds is stopped and reported."""
    partial, logs = results / "partial", results / "logs"
    partial.mkdir(parents=True, exist_ok=True)
    logs.mkdir(parents=True, exist_ok=True)
    out_json, out_png = partial / f"{run.name}.json", partial / f"{run.name}.png"
    out_json.unlink(missing_ok=True)
    out_png.unlink(missing_ok=True)
    full = [sys.executable, *cmd, "--json", str(out_json)] + (["--plot", str(out_png)] if run.plot else [])
    load, start = load_average(), time.time()
    with open(logs / f"{run.name}.out", "w") as out, open(logs / f"{run.name}.err", "w") as err:
        try:  # a stop ends it too
            rc = distributed.run_child(full, cwd=ROOT, stdout=out, stderr=err, timeout_s=timeout_s).returncode
        except subprocess.TimeoutExpired:
            return f"{' '.join(cmd)} was stopped after {timeout_s / 60:.1f} min, the budget's end; its block stays as it was"
    err = logs / f"{run.name}.err"
    if rc != 0:
        return (f"{' '.join(cmd)} failed with exit code {rc}; its block stays as it was. Last lines of its stderr "
                f"({err}):\n{stderr_tail(err)}")
    if run.plot and not out_png.is_file():
        return f"{' '.join(cmd)} exited with 0 but saved no plot at {out_png}; its block stays as it was"
    try:
        result = load_result(out_json, keys=("script", "preset", "device", "torch", "columns", "rows", "headline"))
    except ReproduceError as e:
        return f"{' '.join(cmd)} exited with 0, but {e}; its block stays as it was"
    result["reproduce"] = {"command": " ".join(["python", *cmd]), "machine": machine(result["device"]),
                     "date": datetime.date.today().isoformat(), "seconds": round(time.time() - start),
                     "load_average": round(load, 2)}
    files.atomic_write_bytes((json.dumps(result, indent=2) + "\n").encode(), results / f"{run.name}.json")
    out_json.unlink()
    if run.plot:
        os.replace(out_png, results / f"{run.name}.png")
    return None


def load_result(path, keys=("script", "preset", "device", "torch", "columns", "rows", "headline", "reproduce")):
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


def table_block(result):
    """The caption, the script's table, its summary lines and its extra tables, as its JSON holds them."""
    parts = [caption(result), markdown_table(result["columns"], result["rows"])]
    lines = list(result.get("summary") or [])  # the script's printed lines under its table (checks included)
    if lines:
        parts.append("\n".join(f"- {line}" for line in lines))
    for table in result.get("tables") or []:
        parts.append(f"{table['title']}\n\n{markdown_table(table['columns'], table['rows'])}")
    return "\n\n".join(p for p in parts if p)


def plot_path(run, result):
    return f"docs/{run.plot}_{device_type(result['device'])}.png"


def device_type(device):
    return device.split(":")[0]


def plot_block(run, result):
    link = os.path.relpath(plot_path(run, result), Path(run.page).parent)
    run_info = result["reproduce"]
    return (f"![{run.alt}]({link})\n\n*The plot of `{run_info['command']} --plot`, {run_info['date']}: "
            f"{run_info['machine']}, device `{result['device']}`.*" + (UNTRAINED if result.get("untrained") else ""))


def summary_row(run, result):
    """One run's row of the README's one-glance table: its headline, as its script worded it in its JSON."""
    title = Path(run.page).stem.replace("_", " ")
    page = "[above](#kv-cache)" if run.page == SUMMARY[0] else f"[{title}]({run.page})"
    run_info = result["reproduce"]
    return {"technique": result["headline"]["technique"], "figure": result["headline"]["figure"], "page": page,
            "run": f"{run_info['date']}, {run_info['seconds']} s"}


def summary_block(results):
    """The README's one-glance table from the runs' results ({run name: result}: every run on the CPU), in
    RUNS' order."""
    runs = [run for run in RUNS if run.name in results]
    rows = [summary_row(run, results[run.name]) for run in runs]
    columns = [("technique", "technique", "{}"), ("figure", "headline figure", "{}"), ("run", "run", "{}"),
               ("page", "page", "{}")]
    machines = sorted({f"{results[run.name]['reproduce']['machine']}, torch {results[run.name]['torch']}, device "
                       f"`{results[run.name]['device']}`" for run in runs})
    untrained = any(results[run.name].get("untrained") for run in runs)
    return (f"*Generated by `python reproduce.py` from each script's last successful run on {'; '.join(machines)}.*"
            + (UNTRAINED if untrained else "")
            + "\n\n" + markdown_table(columns, rows))


def attention_blocks(results):
    """The summary of attention methods, full and short, from the runs' results ({run name: result}, in
    RUNS' order) that carry `attention_methods`, with a caption naming the scripts behind it; None if none does."""
    scripts = {}  # script -> its last result (a script of several runs reports its methods once)
    for run in RUNS:
        if run.name in results and results[run.name].get("attention_methods"):
            scripts.setdefault(run.script, results[run.name])
    if not scripts:
        return None
    dates = sorted({r["reproduce"]["date"] for r in scripts.values()})
    machines = sorted({f"{r['reproduce']['machine']}, device `{r['device']}`" for r in scripts.values()})
    caption = (f"*Generated by `python reproduce.py` from the last runs of {', '.join(f'`{s}`' for s in scripts)} "
               f"({', '.join(dates)}; {'; '.join(machines)}).*")
    if any(r.get("untrained") for r in scripts.values()):
        caption += UNTRAINED
    return tuple(caption + "\n\n" + markdown_table(*table(scripts))
                 for table in (attention_summary.full_table, attention_summary.short_table))


def checkpoint_rows(folder):
    """Every checkpoint in `folder`, read and verified: its file, the sha256 of its config, vocabulary and
    weights (files.checkpoint_sha256, saved in the file), its validation loss when training saved one, and
    the command that rebuilds it."""
    rows = []
    for path in sorted(Path(folder).glob("*.pt")):
        ckpt = files.load_checkpoint(path)  # a damaged file is an error here, not a hash on the page
        meta = ckpt.get("meta") if isinstance(ckpt.get("meta"), dict) else {}
        rows.append(dict(checkpoint=f"checkpoints/{path.name}", sha256=ckpt["sha256"], val_loss=meta.get("val_loss"),
                         train_seconds=meta.get("train_seconds"), rebuild=meta.get("rebuild")))
    return rows


def record_checkpoints(results_dir, fresh):
    """results/checkpoints.json: the checkpoints after this run's scripts, rendered by checkpoints_block. Each
    row names the machine that holds the file (a checkpoint trained on another CPU generation has other
    hashes). The record of earlier runs keeps its rows of the files this machine lacks (a partial run, --only,
    on a clone that has trained only what its scripts used), and of the same file on another machine while a
    result in results_dir was measured there; a file here replaces its row of this machine."""
    path = results_dir / "checkpoints.json"
    here = machine("cpu")
    try:
        earlier = {} if fresh or not path.is_file() else json.loads(path.read_text())
        earlier_rows = [dict(row, machine=row.get("machine", earlier.get("machine"))) for row in earlier.get("rows", [])]
    except (OSError, ValueError, AttributeError) as e:
        raise ReproduceError(f"{path} is not a readable checkpoints record ({e}); delete it and rerun") from None
    measured_on = {here} | {result_machine(p) for p in results_dir.glob("*.json") if p.name != path.name}
    rows = {(row["checkpoint"], row["machine"]): row for row in earlier_rows
            if row["machine"] is None or row["machine"] in measured_on}
    rows |= {(row["checkpoint"], here): dict(row, machine=here) for row in checkpoint_rows(ROOT / "checkpoints")}
    record = {"date": datetime.date.today().isoformat(), "fresh": fresh, "machine": here,
              "rows": [rows[key] for key in sorted(rows, key=lambda key: (key[0], key[1] or ""))]}
    files.atomic_write_bytes((json.dumps(record, indent=2) + "\n").encode(), path)


def result_machine(path):
    """The machine a results JSON was measured on (None when it does not say)."""
    try:
        return json.loads(path.read_text()).get("reproduce", {}).get("machine")
    except (OSError, ValueError, AttributeError):
        return None


def checkpoints_block(record):
    """The README's table of the checkpoints behind the figures, with their hashes (and the machine of each
    when the pages' runs were measured on more than one)."""
    if not record["rows"]:
        return f"*The run of {record['date']} used no checkpoint (untrained weights only).*"
    how = ("trained from scratch by `python reproduce.py --fresh`" if record["fresh"] else
           "as the scripts found or trained them in `python reproduce.py`")

    def command(text):  # files saved before rebuild_command left the output paths out still carry them
        return f"`{shlex.join(files.without_output_flags(shlex.split(text)))}`" if text else None

    rows = [dict(r, sha256=f"`{r['sha256']}`", rebuild=command(r.get("rebuild"))) for r in record["rows"]]
    columns = [("checkpoint", "checkpoint", "{}"), ("sha256", "sha256 of config, vocabulary and weights", "{}"),
               ("val_loss", "training's last val loss (10 batches)", "{:.4f}"), ("train_seconds", "training s", "{}"),
               ("rebuild", "rebuilt by", "{}")]
    rows = [dict(r, machine=r.get("machine", record.get("machine"))) for r in rows]  # older records: one machine
    machines = {r["machine"] for r in rows}
    if len(machines) > 1:
        columns.insert(1, ("machine", "machine", "{}"))
        where = f" on {len(machines)} machines (each page's caption names its own)"
    else:
        where = f" on {record['machine']}" if record.get("machine") else ""
    return f"*The checkpoints of the runs up to {record['date']}{where}, {how}.*\n\n" + markdown_table(columns, rows)


def load_average():
    """The machine's load average over the last minute."""
    return os.getloadavg()[0]


def wait_for_quiet(limit=QUIET_LOAD, max_s=QUIET_WAIT_S, poll_s=5):
    """Wait until the load average is below `limit` (the previous script's own load decays), at most `max_s`
    seconds; return the load then. A run that starts above it records its load, which its caption shows."""
    waited, load = 0, load_average()
    while round(load, 2) >= limit and waited < max_s:  # as the caption shows it: 0.996 would read 1.0
        time.sleep(poll_s)
        waited, load = waited + poll_s, load_average()
    return load


def busy(result, busy_ok):
    """Why a run's figures must not replace the pages: the machine was loaded when it started (its timings
    would be distorted: load 6 on 2 cores gave TPOT 30x the quiet figure); None when it was quiet enough."""
    load, limit = result["reproduce"]["load_average"], BUSY_LOAD * (os.cpu_count() or 1)
    if busy_ok or load <= limit:
        return None
    return (f"the machine was busy when it ran (load average {load} on {os.cpu_count()} cores, above {limit:g}): its "
            "timings would be distorted, so its blocks stay as they were; rerun it on a quiet machine, or pass "
            "--busy-ok to render it anyway")


# ----------------------------------------------------------------------------------------------------
# Rendering the pages.

def render(runs, pages, results_dir, problems, device="cpu", busy_ok=True):
    """Rewrite the blocks of `runs` (those without a problem) of `device` and its one-glance table; copy the
    plots. A run that started on a busy machine is left out unless `busy_ok`."""
    edits = {}  # page -> text

    def edit(page, name, part, content):
        path = pages / page
        edits[page] = replace_block(edits.get(page) or read_text(path), name, part, content, path, device)

    for run in runs:
        if run.name in problems:
            continue
        path = results_dir / f"{run.name}.json"
        try:
            if not path.is_file():
                raise ReproduceError(f"no results at {path}: run it first (without --skip-run)")
            result = load_result(path)
            table = table_block(result)
            png = results_dir / f"{run.name}.png"  # not kept in git: a clone renders with the page's own image
            png = png.read_bytes() if run.plot and png.is_file() else None
            if run.plot and png is None and not (pages / plot_path(run, result)).is_file():
                raise ReproduceError(f"no plot at {results_dir / f'{run.name}.png'} nor {pages / plot_path(run, result)}: "
                                     "rerun the script (without --skip-run)")
        except (ReproduceError, OSError, KeyError, TypeError, ValueError) as e:  # the block stays as it was
            problems[run.name] = f"{type(e).__name__}: {e}"
            continue
        if busy(result, busy_ok):
            problems[run.name] = busy(result, busy_ok)
            continue
        edit(run.page, run.name, "table", table)
        if run.plot:
            if png is not None:
                files.atomic_write_bytes(png, pages / plot_path(run, result))
            edit(run.page, run.name, "plot", plot_block(run, result))
    results = {run.name: results_dir / f"{run.name}.json" for run in RUNS}  # a failed run's last good one
    if device != "cpu":  # a GPU's one-glance table holds the runs it made (a GPU run plans a part of RUNS)
        results = {name: path for name, path in results.items() if path.is_file()}
    missing = [name for name, path in results.items() if not path.is_file()]
    if missing:
        print(f"the one-glance table of {SUMMARY[0]} is left as it was: no results of {', '.join(missing)}")
    elif not any(name in problems for name in results):
        try:
            edit(SUMMARY[0], SUMMARY[1], "table", summary_block({n: load_result(p) for n, p in results.items()}))
        except (ReproduceError, OSError, KeyError, TypeError, ValueError) as e:  # reported, README untouched
            problems["one-glance table"] = f"{SUMMARY[0]} left as it was: {type(e).__name__}: {e}"
    attention = {name: path for name, path in results.items() if path.is_file() and name not in problems}
    lacking = sorted({run.name for run in RUNS if run.script in attention_summary.ORDER and run.name not in attention})
    try:
        blocks = None if device == "cpu" and lacking else attention_blocks(
            {name: load_result(path) for name, path in attention.items()})
        if device == "cpu" and lacking:  # a partial summary would drop the rows of the runs it lacks
            print(f"the summary of attention methods ({ATTENTION[0]}) is left as it was: no results of "
                  f"{', '.join(lacking)}")
        elif blocks is None:
            print(f"the summary of attention methods ({ATTENTION[0]}) is left as it was: no results hold its rows")
        else:
            edit(ATTENTION[0], ATTENTION[1], "table", blocks[0])
            edit(ATTENTION_SHORT[0], ATTENTION_SHORT[1], "table", blocks[1])
    except (ReproduceError, OSError, KeyError, TypeError, ValueError) as e:  # reported, pages untouched
        problems["attention summary"] = f"{ATTENTION[0]} left as it was: {type(e).__name__}: {e}"
    record = results_dir / "checkpoints.json"
    if record.is_file() and "checkpoints table" not in problems:
        try:
            edit(CHECKPOINTS[0], CHECKPOINTS[1], "table", checkpoints_block(json.loads(record.read_text())))
        except (ReproduceError, OSError, KeyError, TypeError, ValueError) as e:  # reported, README untouched
            problems["checkpoints table"] = f"{CHECKPOINTS[0]} left as it was: {type(e).__name__}: {e}"
    for page, text in edits.items():
        files.atomic_write_bytes(text.encode(), pages / page)
        print(f"wrote {pages / page}")


# ----------------------------------------------------------------------------------------------------
# The GPU run: python reproduce.py --device cuda --budget MINUTES.

@dataclass(frozen=True)
class GpuStep:
    name: str        # a run of RUNS
    minutes: float   # estimated on one H100-class GPU at the gptlite preset (process start included)
    args: tuple = ()  # flags that size the script's own training to a GPU run of minutes


# The post's headline scripts, most telling first (a small budget keeps the first ones). Their minutes are
# estimates, never measured: the repository has not run on a GPU yet (about 15 s to start a process with a
# CUDA context, then the script's work at the gptlite preset, 19M parameters). Each run's measured seconds
# go into results/cuda/<run>.json.
GPU_STEPS = [
    GpuStep("main_kvcache", 1.0),
    GpuStep("main_speculative_decoding", 2.0, ("--draft-iters", "1000", "--head-iters", "200", "--mtp-steps", "200")),
    GpuStep("main_quantization", 1.0),
    GpuStep("main_compile", 1.5, ("--extra-presets",)),  # the distilled shape would need a checkpoint of its own
    GpuStep("main_flash_attention", 1.0),
    GpuStep("main_gqa", 1.0, ("--uptrain-steps", "200")),
    GpuStep("main_mla", 1.0, ("--uptrain-steps", "200")),
    GpuStep("main_prefix_cache", 1.0),
    GpuStep("main_continuous_batching", 1.5),
    GpuStep("main_static_batching", 0.5),
]
GPU_PRESET = "gptlite"
GPU_TRAIN_STEP_S = 0.03  # one training step of the gptlite preset (batch 32 x 128 characters), estimated
GPU_TRAIN_SHARE = 0.2    # of the budget, for the checkpoint's training (at most the preset's own steps)
MAX_BUDGET = 600         # minutes


def gpu_plan(budget, names):
    """The GPU run of `budget` minutes over the runs `names`: (checkpoint steps, training minutes, planned
    GpuSteps, one line per skipped step). A step is planned when its estimate fits in what is left."""
    preset = presets.get_preset(GPU_PRESET)
    iters = max(1, min(preset.iters, int(budget * 60 * GPU_TRAIN_SHARE / GPU_TRAIN_STEP_S)))
    train_minutes = iters * GPU_TRAIN_STEP_S / 60
    left, planned, skipped = budget - train_minutes, [], []
    for step in (s for s in GPU_STEPS if s.name in names):
        if step.minutes <= left:
            planned.append(step)
            left -= step.minutes
        else:
            skipped.append(f"skipped {step.name}: about {step.minutes:g} min, {max(left, 0):.1f} of the budget left")
    return iters, train_minutes, planned, skipped


def gpu_train_command(iters, device):
    return ["gptlite.py", "--preset", GPU_PRESET, "--device", device, "--iters", str(iters)]


def gpu_command(run, step, iters, device):
    return [run.script, *run.args, "--device", device, "--preset", GPU_PRESET, "--train-iters", str(iters), *step.args]


def print_plan(runs, args, results_dir):
    """--dry-run: the commands in order with their minutes (the GPU plan's estimates, else the last run's)."""
    if args.budget:
        device = args.device or "cuda"
        iters, train_minutes, planned, skipped = gpu_plan(args.budget, {run.name for run in runs})
        by_name = {run.name: run for run in RUNS}
        print(f"GPU plan of --budget {args.budget:g} min on {device} (estimated minutes, not measured):")
        print(f"  {train_minutes:4.1f} min  python {' '.join(gpu_train_command(iters, device))}"
              f"  # {iters} of the {GPU_PRESET} preset's {presets.get_preset(GPU_PRESET).iters} steps")
        for step in planned:
            print(f"  {step.minutes:4.1f} min  python {' '.join(gpu_command(by_name[step.name], step, iters, device))}")
        for line in skipped:
            print(f"  {line}")
        total = train_minutes + sum(step.minutes for step in planned)
        print(f"total: about {total:.1f} of {args.budget:g} min; results to {results_dir}, pages' :{device_type(device)} blocks")
        return
    total = 0
    print("plan (minutes: the last run's, from its results JSON):")
    for run in runs:
        path = results_dir / f"{run.name}.json"
        seconds = json.loads(path.read_text())["reproduce"]["seconds"] if path.is_file() else None
        total += seconds or 0
        minutes = f"{seconds / 60:4.1f} min" if seconds is not None else "   ? min"
        print(f"  {minutes}  python {' '.join(command(run, args))}")
    print(f"total: {total / 60:.0f} min for the runs with results")


def run_gpu(runs, args, results_dir, problems):
    """The GPU run: the checkpoint for a share of the budget, then each planned script while the budget lasts.
    Returns the runs that ran."""
    device, deadline = args.device, time.time() + args.budget * 60
    iters, _, planned, skipped = gpu_plan(args.budget, {run.name for run in runs})
    for line in skipped:
        print(line)
    logs = results_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, *gpu_train_command(iters, device)]
    try:
        with open(logs / "checkpoint.out", "w") as out, open(logs / "checkpoint.err", "w") as err:
            rc = distributed.run_child(cmd, cwd=ROOT, stdout=out, stderr=err, timeout_s=deadline - time.time()).returncode
    except subprocess.TimeoutExpired:
        rc = "timeout"
    if rc != 0:
        problems["checkpoint"] = (f"{' '.join(cmd[1:])} ended with {rc}; no script ran. Last lines of its stderr:\n"
                                  f"{stderr_tail(logs / 'checkpoint.err')}")
        return []
    by_name, ran = {run.name: run for run in RUNS}, []
    for step in tqdm(planned, desc="GPU scripts", unit="script", dynamic_ncols=True):
        left = deadline - time.time()
        if step.minutes * 60 > left:
            tqdm.write(f"skipped {step.name}: about {step.minutes:g} min, {max(left, 0) / 60:.1f} of the budget left")
            continue
        run = by_name[step.name]
        problem = execute(run, gpu_command(run, step, iters, device), results_dir, timeout_s=left)
        ran.append(run)
        if problem:
            problems[run.name] = problem
            tqdm.write(f"FAILED: {problem}")
    return ran


def select(only, parser):
    if not only:
        return RUNS
    names = {run.name for run in RUNS} | {run.script for run in RUNS}
    unknown = [o for o in only if o not in names]
    if unknown:
        parser.error(f"--only {' '.join(unknown)}: choose among {', '.join(sorted(names))}")
    return [run for run in RUNS if run.name in only or run.script in only]


def parse_args(argv):
    """The flags, checked before any script runs: (args, runs, device type, results folder, pages folder)."""
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
    parser.add_argument("--busy-ok", action="store_true",
                        help=f"render into the repository's pages even runs that started with a load average above "
                             f"{BUSY_LOAD:g} per core (their timings are distorted)")
    parser.add_argument("--fresh", action="store_true",
                        help="train every checkpoint from scratch: checkpoints/*.pt are moved to "
                             "checkpoints/before-fresh-<time>/ first, then each script trains what it uses")
    parser.add_argument("--budget", type=float, default=None, metavar="MINUTES",
                        help="with --device cuda: the GPU run, the post's headline scripts at the gptlite preset in "
                             "this many minutes, its checkpoint's steps sized to them (see GPU_STEPS)")
    parser.add_argument("--dry-run", action="store_true",
                        help="print the commands and their minutes (the plan of --budget), run and write nothing")
    args = parser.parse_args(argv)
    runs = select(args.only, parser)
    if args.budget is not None:
        if not 0 < args.budget <= MAX_BUDGET:
            parser.error(f"--budget {args.budget:g}: give minutes above 0 and at most {MAX_BUDGET}")
        if not (args.device or "").startswith("cuda"):
            parser.error("--budget sizes the GPU run: add --device cuda")
        for flag in ("skip_run", "quick", "fresh"):
            if getattr(args, flag):
                parser.error(f"--budget plans its own runs and checkpoint: drop --{flag.replace('_', '-')}")
    for flag in ("skip_run", "quick", "only"):
        if args.fresh and getattr(args, flag):
            parser.error(f"--fresh renders every page from new checkpoints: drop --{flag.replace('_', '-')}")
    try:  # a bad --device is one error now, not one per script; a dry run needs no GPU
        device = (torch.device(args.device or "cpu") if args.dry_run else harness.get_device(args.device)).type
    except (GPTliteError, RuntimeError) as e:
        parser.error(str(e) if isinstance(e, GPTliteError) else f"--device {args.device} is not a device")
    out = Path(args.out) if args.out else ROOT / "results" / "quick" if args.quick else None
    if out is not None and out.exists() and not out.is_dir():
        parser.error(f"--out {out} is a file: give a folder (made if missing) for the results and the rendered pages")
    if out is not None:  # the folder, or the nearest one above it that exists (where it will be made), writable
        existing = next(p for p in [out.absolute(), *out.absolute().parents] if p.exists())
        error = files.unwritable(existing) if existing.is_dir() else None
        if not existing.is_dir() or error:
            reason = f"cannot be written ({error})" if error else "is not a folder"
            parser.error(f"--out {out}: {existing} {reason}; give a folder you can write")
    results, pages = (out, out / "pages") if out else (ROOT / "results", ROOT)
    results = results if device == "cpu" else results / device  # each device's results apart
    return args, runs, device, results, pages, out


def set_aside_checkpoints():
    """--fresh: move checkpoints/*.pt to checkpoints/before-fresh-<time>/ (kept, not deleted)."""
    old = sorted((ROOT / "checkpoints").glob("*.pt"))
    if old:
        aside = ROOT / "checkpoints" / f"before-fresh-{datetime.datetime.now():%Y%m%d-%H%M%S}"
        aside.mkdir()
        for path in old:
            os.replace(path, aside / path.name)
        print(f"--fresh: {len(old)} checkpoint(s) moved to {aside}; every script trains what it uses")


def main(argv=None):
    args, runs, device, results_dir, pages, out = parse_args(argv)
    if args.dry_run:
        return print_plan(runs, args, results_dir)
    busy_ok = args.busy_ok or out is not None  # only the repository's own pages are guarded
    load, limit = load_average(), BUSY_LOAD * (os.cpu_count() or 1)
    if not busy_ok and not args.skip_run and load > limit:
        raise ReproduceError(f"the machine is busy (load average {load:.1f} on {os.cpu_count()} cores, above {limit:g}): "
                             "its timings would be distorted and would replace the pages' figures; wait for a quiet "
                             "machine, or pass --busy-ok (or --out DIR to render copies)")
    if out:  # fresh copies of the pages, so that their prose is the repository's
        for page in {run.page for run in RUNS} | {SUMMARY[0], ATTENTION[0]}:
            (pages / page).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(ROOT / page, pages / page)
    check_markers(pages, runs)

    problems = {}
    if args.fresh:
        set_aside_checkpoints()
    if args.budget:
        runs = run_gpu(runs, args, results_dir, problems)
    elif not args.skip_run:
        bar = tqdm(runs, desc="scripts", unit="script", dynamic_ncols=True)
        for run in bar:
            if not busy_ok:  # the pages' figures: each script starts on a quiet machine
                bar.set_postfix_str(f"waiting for a load average below {QUIET_LOAD:g}")
                wait_for_quiet()
            bar.set_postfix_str(" ".join(command(run, args)))
            problem = execute(run, command(run, args), results_dir)
            if problem:
                problems[run.name] = problem
                tqdm.write(f"FAILED: {problem}")
    if not args.skip_run and not args.quick:  # a smoke run uses no checkpoint
        if runs != RUNS and not (results_dir / "checkpoints.json").is_file():  # its few rows would shrink the table
            print(f"the checkpoints table of {CHECKPOINTS[0]} is left as it was: a partial run, and no earlier record")
        else:
            try:
                record_checkpoints(results_dir, args.fresh)
            except GPTliteError as e:  # a damaged file: no hash of it on the page
                problems["checkpoints table"] = f"{CHECKPOINTS[0]} left as it was: {e}"
    render(runs, pages, results_dir, problems, device, busy_ok)
    for run in runs:
        print(f"{run.name}: {'FAILED (block left as it was)' if run.name in problems else 'ok'}")
    if problems:
        sys.exit(f"{len(problems)} problem(s):\n" + "\n".join(f"- {name}: {p}" for name, p in problems.items()))


if __name__ == "__main__":
    harness.run(main)
