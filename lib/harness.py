"""The script skeleton: flags (checked before any work), set-up, checks, and the report (table, JSON,
plot), the same in every main_<technique>.py."""
import argparse
import dataclasses
import json
import math
import os
import shutil
import sys
from dataclasses import asdict
from pathlib import Path

import torch

from lib.corpus import load_data
from lib.errors import GPTliteError
from lib.files import atomic_file, atomic_write_bytes, output_problems
from lib.presets import PRESETS, get_preset
from lib.training import activation_bytes


def get_device(name=None):
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise GPTliteError(f"--device {name} is not a device; use cpu, cuda or cuda:N") from None
    if device.type not in ("cpu", "cuda"):
        raise GPTliteError(f"--device {name}: only cpu and cuda are supported")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise GPTliteError(f"--device {name} asked for CUDA, which this machine does not have; use --device cpu")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise GPTliteError(f"--device {name}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return device


def int_at_least(low, high=None):
    """An argparse type: an integer of at least `low` and at most `high` (the error names the flag and the
    bounds). Every count has a `high`: a value past it is refused before any work, not run for hours."""
    def parse(text):
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low or high is not None and value > high:
            bounds = f"at least {low}" + ("" if high is None else f" and at most {high:,}")
            raise argparse.ArgumentTypeError(f"must be {bounds}, got {value}")
        return value
    parse.__name__ = f"integer >= {low}" if high is None else f"integer in [{low}, {high}]"
    return parse


def cores():
    """The CPU cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


MAX_STEPS = 100_000  # training steps of one model: 20x the gptlite preset's 5,000
MAX_REPEATS = 1_000  # timed runs of one figure
MAX_BATCHES = 10_000  # validation or calibration batches (of 32 windows): 90x the validation split
MAX_SIZE = 1 << 16  # a length, width or count of heads that is not bounded by the preset where it is checked
steps = int_at_least(1, MAX_STEPS)
repeats = int_at_least(1, MAX_REPEATS)
batches = int_at_least(1, MAX_BATCHES)
seed_type = int_at_least(0, 2**32 - 1)
thread_count = int_at_least(1, cores())  # more threads than cores time waits (and a huge count crashes torch)


def float_in(low=-math.inf, high=math.inf, low_open=False, high_open=False):
    """An argparse type: a finite float in [low, high] (an open end with low_open / high_open).
    inf and nan are refused: a non-finite learning rate or temperature trains a NaN model."""
    def parse(text):
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        below = value <= low if low_open else value < low
        above = value >= high if high_open else value > high
        if not math.isfinite(value) or below or above:
            interval = (f"{'(' if low_open or low == -math.inf else '['}{low:g}, "
                        f"{high:g}{')' if high_open or high == math.inf else ']'}")
            raise argparse.ArgumentTypeError(f"must be a finite number in {interval}, got {text}")
        return value
    parse.__name__ = "number"
    return parse


positive_float = float_in(0.0, low_open=True)
learning_rate = float_in(0.0, 1.0, low_open=True)
temperature = float_in(0.0, 100.0, low_open=True)
weight = float_in(0.0, 100.0)  # a loss's weight


def add_model_args(parser):
    parser.add_argument("--preset", choices=sorted(PRESETS), default=None,
                        help="model preset (default: gptlite on CUDA, cpu elsewhere)")
    parser.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda when available)")
    parser.add_argument("--seed", type=seed_type, default=0, help="random seed of training, prompts and weights")
    parser.add_argument("--data", default=None, metavar="PATH",
                        help="tiny Shakespeare file (default: $GPTLITE_DATA, else data/tinyshakespeare.txt)")


def add_generation_flags(parser, batch_size=None, prompt_len=None, n_tokens=None, repeats=None, least_tokens=2):
    """The flags of timed generation that most scripts have, each with the script's own default; a flag
    whose default is None is not added."""
    flags = [("--batch-size", batch_size, 1, "prompts generated together"),
             ("--prompt-len", prompt_len, 1, "prompt length in characters"),
             ("--n-tokens", n_tokens, least_tokens, "new tokens generated per prompt"),
             ("--repeats", repeats, 1, "timed runs per figure, median taken (after a warm-up)")]
    for flag, default, low, text in flags:
        if default is not None:
            high = MAX_REPEATS if flag == "--repeats" else None  # the others: bounded by the preset or memory
            parser.add_argument(flag, type=int_at_least(low, high), default=default, help=text)


def add_sweep_flags(parser, batch_help, sweep_help):
    """--batch-sizes (a row group each, [1, 8] by default) and --sweep (the curve that --plot draws, which
    only --sweep measures); check_sweep_flags checks them."""
    parser.add_argument("--batch-sizes", type=int_at_least(1), nargs="+", default=[1, 8], help=batch_help)
    parser.add_argument("--sweep", action="store_true", help=sweep_help)


def check_sweep_flags(parser, args, curve):
    """Refuse a repeated batch size, and --plot without the --sweep that measures its `curve`."""
    if len(set(args.batch_sizes)) != len(args.batch_sizes):
        parser.error(f"--batch-sizes repeats a value: {args.batch_sizes}")
    if args.plot and not args.sweep:
        parser.error(f"--plot draws {curve}, which only --sweep measures: add --sweep")


def script_parser(doc):
    """A script's argument parser: its docstring as the help text, and the common flags."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser)
    return parser


def add_common_args(parser):
    add_model_args(parser)
    parser.add_argument("--untrained", action="store_true",
                        help="random weights, no checkpoint: a quick smoke run (loss figures are meaningless)")
    parser.add_argument("--train-iters", type=steps, default=None,
                        help="training steps of the preset's checkpoint, where it is trained (default: the preset's; "
                             "a checkpoint of other steps is trained again: the GPU run of reproduce.py sizes it)")
    parser.add_argument("--json", default=None, metavar="PATH", help="also write the results as JSON to PATH")
    parser.add_argument("--plot", default=None, metavar="PATH", help="also save the script's plot as PNG to PATH")


OUTPUT_FLAGS = ("json", "plot", "save")  # the files a script writes when asked: checked in setup


def setup(args, parser, check_args=None):
    """Check the common flags (and the output paths and prompt length of the scripts that have them),
    choose device and preset (and say which), run the script's own `check_args(preset)`, then load the
    data: every flag error comes before any work."""
    outputs = {f"--{flag.replace('_', '-')}": getattr(args, flag) for flag in OUTPUT_FLAGS
               if getattr(args, flag, None) is not None}
    problems = output_problems(outputs, checkpoint_flags=("--save",))
    if problems:
        parser.error("; ".join(problems))
    if getattr(args, "plot", None) is not None and Path(args.plot).suffix.lower() != ".png":
        parser.error(f"--plot {args.plot}: the plot is a PNG, give a path ending in .png")
    try:
        device = get_device(args.device)
    except GPTliteError as e:
        parser.error(str(e))
    preset = get_preset(args.preset or ("gptlite" if device.type == "cuda" else "cpu"))
    if getattr(args, "train_iters", None) is not None:  # the checkpoint's recipe, and so its stamp, with these steps
        preset = dataclasses.replace(preset, iters=args.train_iters)
    if getattr(args, "prompt_len", None) is not None and args.prompt_len > preset.seqlen:
        parser.error(f"--prompt-len must be at most the model's seqlen={preset.seqlen}, got {args.prompt_len}")
    if hasattr(args, "paths"):  # the scripts timed on both decode paths (add_paths_flag)
        check_paths(parser, args, device)
    if check_args is not None:
        check_args(preset)
    print(f"preset: {preset.name} ({'from --preset' if args.preset else 'default for ' + device.type}), "
          f"device: {device}, torch {torch.__version__}")
    torch.manual_seed(args.seed)
    return preset, device, load_data(args.data)


def check_applies(parser, args, flags, needs, applies):
    """A flag that does not apply is an error, not ignored: when `applies` is false, each of `flags` given
    a value other than its default is refused, naming `needs`, what would make it apply."""
    given = [f for f in flags if getattr(args, f[2:].replace("-", "_")) != parser.get_default(f[2:].replace("-", "_"))]
    if not applies and given:
        parser.error(f"{' and '.join(given)} appl{'y' if len(given) > 1 else 'ies'} only with {needs}: add it, "
                     f"or drop {' and '.join(given)}")


PATHS = ("eager", "fast")  # decode paths: PyTorch operators, and lib/fast_decode.py's C++ step


def add_paths_flag(parser):
    """--paths: the decode paths a technique is timed on, side by side (lib/fast_decode.py)."""
    parser.add_argument("--paths", nargs="+", choices=PATHS, default=None,
                        help="decode paths to time each variant on: eager (PyTorch operators) and fast (the C++ "
                        "step of lib/fast_decode.py, CPU only; built on first use); default both on a CPU, eager on CUDA")


def check_paths(parser, args, device):
    """--paths checked before any work (by setup, before the script's own checks); its default filled in."""
    args.paths = args.paths or (list(PATHS) if device.type == "cpu" else ["eager"])
    if len(set(args.paths)) != len(args.paths):
        parser.error(f"--paths repeats a value: {args.paths}")
    if "fast" in args.paths and device.type != "cpu":
        parser.error(f"--paths fast is the C++ decode path of a CPU; this run is on {device}: use --paths eager")
    if "fast" in args.paths:
        check_compiler(parser, "--paths fast: ")


def check_compiler(parser, prefix=""):
    """A parser error, before any work, where no C++ compiler can build the fast path (or Inductor's code)."""
    problem = compiler_problem()
    if problem:
        parser.error(f"{prefix}{problem}")


def compiler_problem():
    """Why this machine cannot build C++ extensions (lib/fast_decode.cpp, Inductor's code), or None."""
    if shutil.which("c++") is None and shutil.which("g++") is None:
        return ("no C++ compiler (c++ or g++) on this machine: the fast decode path (lib/fast_decode.cpp) "
                "and torch.compile on a CPU build C++ code; install one (e.g. `apt install g++`), "
                "or leave the compiled and fast variants out")
    if shutil.which("ninja") is None:
        return ("torch.utils.cpp_extension builds with ninja, which is not installed: "
                "`pip install -r requirements.txt` installs it")
    return None


def check_fits(parser, flag, nbytes, what):
    """A size flag bounded by the machine: `parser.error` naming `flag` when `nbytes`, the memory that the
    flag's value makes the script allocate (estimated from the flags, before any work), exceeds what the
    machine has available now. A huge batch or request count is then one line, not an out-of-memory
    traceback or unbounded work."""
    available = available_memory()
    if nbytes > available:
        parser.error(f"{flag}: {what} needs about {nbytes / 2**30:,.1f} GiB, more than the {available / 2**30:.1f} GiB "
                     "this machine has available; give a smaller value")


def check_generation_sizes(parser, preset, batch_size, prompt_len, n_tokens):
    """--batch-size: full windows through a model of `preset` (and its caches); --n-tokens: the tokens generated
    for each of batch_size prompts."""
    check_fits(parser, "--batch-size", activation_bytes(preset, batch_size), f"a batch of {batch_size} full windows")
    check_fits(parser, "--n-tokens", 3 * batch_size * (prompt_len + n_tokens) * 8,
               f"{n_tokens} new tokens for each of {batch_size} prompts")


def available_memory():
    """Bytes of memory available to a new allocation (Linux: MemAvailable; elsewhere: physical pages)."""
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def report(args, script, preset, device, rows, headline, summary=(), tables=(), plot=None, **extra):
    """The end of every script, once its checks have passed: print the table, the summary lines and the
    headline, then write the JSON (--json) and the plot (--plot). The JSON holds the rows, the `headline`
    ({"technique", "figure"}: the README's one-glance row, worded by the script), the `summary` lines, the
    extra `tables` (each from `table()`) and `extra`; `plot()` draws a matplotlib figure from what was
    measured: --plot never measures, and the JSON is the same with or without it."""
    print_table(rows, untrained=args.untrained)
    for t in tables:
        untrained = args.untrained and any("val_loss" in r for r in t["rows"])  # its losses marked too
        print(f"\n{t['title']}\n{format_table(t['rows'], untrained=untrained, columns=t['columns'])}")
    if summary:
        print("\n" + "\n".join(summary))
    print(f"\n{headline['technique']}: {headline['figure']}")
    if args.json:
        save_json(args.json, script, preset, device, rows, untrained=args.untrained, headline=headline,
                  summary=list(summary), tables=list(tables), **extra)
    if args.plot and plot is not None:
        save_plot(plot(), args.plot)


def table(title, rows, columns=None):
    """An extra table of a script's results: a title line, its rows and their [key, header, format] columns
    (default: as the main table chooses them)."""
    return dict(title=title, columns=[list(c) for c in (columns or table_columns(rows))], rows=rows)


def training_args(description, sample_tokens, argv=None):
    """The flags of a model file's command line, checked before any work: (args, preset, device, data)."""
    parser = argparse.ArgumentParser(description=description)
    add_model_args(parser)
    parser.add_argument("--iters", type=steps, default=None, help="training steps (default: the preset's)")
    parser.add_argument("--sample-tokens", type=int_at_least(1, 10_000), default=sample_tokens,
                        help="length of the printed sample")
    parser.add_argument("--out", default=None, metavar="PATH",
                        help="write the checkpoint there instead of checkpoints/ (the file every script loads)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace a trained checkpoint of another recipe (without it: refused)")
    args = parser.parse_args(argv)
    problems = output_problems({"--out": args.out}, checkpoint_flags=("--out",)) if args.out else []
    if problems:
        parser.error("; ".join(problems))
    return (args, *setup(args, parser))


def training_cli(description, train, sample, sample_tokens, argv=None):
    """The command line of a model file (python gptlite.py --preset cpu): train its checkpoint with the
    preset's recipe, `train(preset, data, device, iters=, seed=, path=, overwrite=)`, then print a greedy
    sample of it, `sample(model, prompt, n_tokens)` -> [1, 1 + n_tokens] token ids."""
    args, preset, device, data = training_args(description, sample_tokens, argv)
    model = train(preset, data, device, iters=args.iters, seed=args.seed, path=args.out,
                  overwrite=args.overwrite)  # a diverged run saves nothing
    prompt = torch.tensor([data.encode("\n")], device=device)
    print(data.decode(sample(model.eval(), prompt, args.sample_tokens)[0, 1:].tolist()))  # without the newline


def require_checks(checks):
    """Stop with one clear error, before anything is written, when a check ({name: ok}) failed."""
    failures = [name for name, ok in checks.items() if not ok]
    if failures:
        raise GPTliteError(f"checks failed: {'; '.join(failures)}; this is a bug (nothing written)")


def run(main):
    """Run a script's main(); our own errors are printed as one clear line, without a traceback."""
    try:
        main()
    except GPTliteError as e:
        sys.exit(f"error: {e}")


COLUMNS = [  # key, header, format
    ("variant", "variant", "{}"),
    ("ttft_ms", "TTFT ms", "{:.2f}"),  # one generation: prefill + the first token
    ("ttft_arrival_ms", "TTFT arrival ms", "{:.1f}"),  # serving: from the request's arrival, queueing included
    ("ttft_arrival_p99_ms", "p99", "{:.1f}"),
    ("tpot_ms", "TPOT ms", "{:.3f}"),
    ("tpot_p99_ms", "p99", "{:.3f}"),
    ("tokens_per_s", "tok/s", "{:.0f}"),
    ("peak_mem_mb", "peak MB", "{:.2f}"),
    ("kv_cache_mb", "KV MB", "{:.3f}"),
    ("val_loss", "val loss", "{:.4f}"),
]


def make_row(variant, **figures):
    """A result row with every standard column (None where a figure does not apply) plus extras."""
    row = {key: None for key, _, _ in COLUMNS}
    row.update(variant=variant, **figures)
    return row


def float_format(values):
    """One format for a column of numbers: as many decimals as its most precise value needs (at most
    4), so that 0.940 stands beside 0.938, not 0.94; integers as integers."""
    if all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        return "{}"
    decimals = max((len(f"{v:.4f}".rstrip("0").split(".")[1]) for v in values if math.isfinite(v)), default=0)
    return f"{{:.{decimals}f}}"


def table_columns(rows):
    """The printed columns: the standard ones that some row fills (TTFT ms, TPOT ms, ...), then every
    extra key in first-seen order; extra numbers get one format per column. [(key, header, format)]"""
    standard = {key for key, _, _ in COLUMNS}
    columns = [c for c in COLUMNS if c[0] == "variant" or any(r.get(c[0]) is not None for r in rows)]
    extras = dict.fromkeys(k for r in rows for k in r if k not in standard)
    for key in extras:
        numbers = [r[key] for r in rows if isinstance(r.get(key), (int, float)) and not isinstance(r.get(key), bool)]
        columns.append((key, key, float_format(numbers) if numbers else "{}"))
    return columns


def format_table(rows, untrained=False, columns=None):
    columns = columns or table_columns(rows)

    def cell(row, key, fmt):
        value = row.get(key)
        if value is None:
            return "-"
        text = fmt.format(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else str(value)
        return text + "*" if key == "val_loss" and untrained else text

    table = [[header for _, header, _ in columns]] + [[cell(r, k, f) for k, _, f in columns] for r in rows]
    widths = [max(len(line[i]) for line in table) for i in range(len(columns))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths)))
             for line in table]
    lines.insert(1, "-" * len(lines[0]))
    if untrained:
        lines.append("* untrained weights (--untrained): loss figures are meaningless")
    return "\n".join(lines)


def print_table(rows, untrained=False):
    print(format_table(rows, untrained))


def strict_json(value):
    """`value` with every NaN or infinity replaced by None: JSON has no such numbers (json.dumps would
    write NaN/Infinity, which strict parsers reject)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: strict_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict_json(v) for v in value]
    return value


def save_json(path, script, preset, device, rows, untrained=False, **extra):
    """Write the results as {"script", "preset", "device", "columns", "rows": [...]} (temp file, then
    rename): `columns` are the table's [key, header, format] as printed; strict JSON (no NaN)."""
    result = {"script": script, "preset": preset.name, "device": str(device), "untrained": untrained,
              "torch": torch.__version__, "preset_config": asdict(preset),
              "columns": [list(c) for c in table_columns(rows)], "rows": rows, **extra}
    text = json.dumps(strict_json(result), indent=2, allow_nan=False)
    atomic_write_bytes((text + "\n").encode(), path)
    print(f"wrote {path}")


def save_plot(fig, path):
    """Save a matplotlib figure as PNG (temp file, then rename), then close it."""
    import matplotlib.pyplot as plt
    with atomic_file(path) as tmp:
        fig.savefig(tmp, format="png", dpi=120, bbox_inches="tight")
    plt.close(fig)
    print(f"saved {path}")


def new_figure(n_axes=1):
    import matplotlib
    matplotlib.use("Agg")  # no screen needed
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, n_axes, figsize=(6 * n_axes, 4.2))
    return fig, axes

