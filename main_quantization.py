"""Quantization: weights in 8 and 4 bits (RTN, GPTQ, AWQ, torchao), W8A8 with SmoothQuant, FP8 emulated, and a
KV cache in 4 and 2 bits (KIVI), against float32 on the same trained GPTlite.

    python main_quantization.py                                   # cpu preset
    python main_quantization.py --group-size 64 --kv-bits 4 2 --json q.json --plot q.png
    python main_quantization.py --untrained --n-tokens 8 --repeats 1 --val-batches 2 --bench-size 1024

Blog section: part 2 (quantization). lib/quantization.py holds the methods. Every Linear of the blocks is
quantized (96% of the cpu preset's weights); the embeddings, LayerNorms and the head stay float32 and count in
the size. Per variant: bits per weight (the serialized state dict's bytes x 8 over the float model's
parameters: scales and float parts included), size, validation loss and its change, the share of greedy
tokens equal to float32's, TPOT of greedy decoding with the KV cache at batch 1 and 8, KV-cache bytes per
token. The int8 and int4 weight-only rows run ATen's packed CPU kernels.

On this machine the model (3 MB) sits in the CPU's cache, so fewer weight bytes do not make a decode step
faster here: a second table times one matrix-vector product on a matrix larger than the last-level cache (its
size read from the machine), where the weights' bytes do bind, float32 against int8 and int4.

Decode paths (--paths): `eager` (PyTorch operators: every row above) and `fast` (lib/fast_decode.py, the whole
step as one C++ call), where float32, int8 per channel (RTN) and int4 per group (RTN, GPTQ) are timed again, in
the same round-robin: the fast kernel reads the int8 and int4 codes themselves. The benchmark then times the
fast path's kernel, float32, int8 and int4, on the same large matrix, beside one plain read of that matrix (the
machine's read bandwidth, measured in this run). A third table decodes at the post's gptlite shape (70 MB of
float32 weights, more than the cache; random weights, so only time is measured) on the fast path in float32,
bfloat16, int8 and int4: TPOT against the bytes each step reads, the plot's third panel. A fourth decodes there
from full KV caches (--shape-batch sequences of --shape-context random entries; 0: none): a float32 cache against
KIVI's, on each path: eager PyTorch dequantizes the cache's blocks at every step, the fast path's attention reads
the codes (lib/fast_decode.PackedKIVICache); TPOT against the bytes each step reads, the plot's fourth panel.

Checks first: each weight-only variant's packed kernel gives the logits of its dequantize-then-matmul form
(atol 1e-4); at the shape, a step over each KIVI cache gives the logits of one over a float32 cache holding its
dequantized entries, and the fast path's step the eager one's. Nothing is timed or written unless they hold.
"""
import argparse
import copy
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

import inference_utils as iu
from gptlite_kvcache import GPTlite_KVCache, generate_kvcache
from lib import corpus, engines, fast_decode, harness, llamacpp, memory_bound, quantization as qz, training
from lib.presets import PRESETS

ATOL = 1e-4  # float32 logits: the packed kernels sum the same products in another order
TORCHAO = "torchao==0.18.0"


def fast_variants(group_size):
    """The rows the fast path computes (lib/fast_decode.linear_parts), timed on both paths."""
    return ("float32", "int8 per channel, RTN", f"int4 g{group_size}, RTN", f"int4 g{group_size}, GPTQ")


def weight_variants(group_size, alpha):
    """{name: quantize_model's keyword arguments} (None: the float32 model)."""
    G = group_size
    return {"float32": None, "int8 per channel, RTN": dict(method="rtn", bits=8),
            f"int4 g{G}, RTN": dict(method="rtn", bits=4), f"int4 g{G}, GPTQ": dict(method="gptq", bits=4),
            f"int4 g{G}, AWQ": dict(method="awq", bits=4), f"W8A8 SmoothQuant (alpha {alpha:g})":
            dict(method="w8a8", alpha=alpha), "W8A8 without smoothing": dict(method="w8a8", alpha=None),
            "FP8 e4m3 per row (emulated)": dict(method="fp8")}


def torchao_variants(model):
    """torchao's int8 weight-only and dynamic int8 (W8A8) on the blocks' Linears; {} with a line when torchao is
    not installed or its CPU path fails."""
    try:
        with iu.stderr_silenced():  # its optional CUDA extensions say on stderr that they did not load
            from torchao.quantization import Int8DynamicActivationInt8WeightConfig, Int8WeightOnlyConfig, quantize_
    except ImportError:
        print(f"torchao is not installed (pip install {TORCHAO}): its rows are skipped")
        return {}
    out = {}
    for name, config in (("torchao int8 weight-only", Int8WeightOnlyConfig()),
                         ("torchao int8 dynamic (W8A8)", Int8DynamicActivationInt8WeightConfig())):
        m = copy.deepcopy(model)
        quantize_(m, config, filter_fn=lambda mod, fqn: isinstance(mod, nn.Linear) and fqn.startswith("blocks."))
        out[name] = m
    return out


@torch.no_grad()
def kernel_matches(model, kwargs, calibration, window):
    """The quantized model with the packed kernels (for decoding), its dequantize-then-matmul form (for the
    validation loss: ATen's int4 kernel is built for a few rows, slow on a batch of windows) and the max |logits
    difference| between the two."""
    plain = qz.quantize_model(model, calibration=calibration, kernel=False, **kwargs)
    fast = qz.with_kernels(plain)
    return fast, plain, (fast(window)[0] - plain(window)[0]).abs().max().item()


@torch.no_grad()
def kivi_loss(model, data, bits, block, n_batches):
    """Validation loss with the KIVI cache: each window fed in chunks of `block` tokens, so that a token sees
    the earlier blocks quantized and its own block in float32, as when decoding (validation_loss's batches)."""
    def loss(model, x, y):
        cache = new_cache(model, bits, block)
        logits = torch.cat([model(chunk, cache)[0] for chunk in x.split(block, dim=1)], dim=1)
        return F.cross_entropy(logits.flatten(0, 1), y.flatten())
    return training.validation_loss(model, data, n_batches, loss=loss)


def kivi_names(kv_bits):
    """{row name: KIVI's bits}."""
    return {f"KIVI {bits}-bit KV cache": bits for bits in kv_bits}


def new_cache(model, bits, block):
    """None (the float32 dynamic cache) or a KIVI cache of `bits` for `model`."""
    return None if bits is None else qz.KIVICache(model.config.n_layers, bits, block, model.seqlen)


def generators(models, plain, kv_bits, block, fast):
    """{(name, path): fn(prompts, n) -> tokens}: greedy decoding with the KV cache (KIVI rows with their cache)
    on the eager path; the `fast` variants also on the fast path, from their codes (`plain`: the int4 codes
    readable), the weights packed once here, outside the timings."""
    fns = {(name, "eager"): (lambda p, n, m=m: generate_kvcache(m, p, n, m.seqlen)) for name, m in models.items()}
    base = models["float32"]
    for name, bits in kivi_names(kv_bits).items():
        fns[name, "eager"] = lambda p, n, b=bits: generate_kvcache(base, p, n, base.seqlen, new_cache(base, b, block))
    for name in fast:
        fns[name, "fast"] = lambda p, n, v=fast_decode.native_view(plain.get(name, models[name])): (
            fast_decode.generate_fast(v, p, n, v.seqlen))
    return fns


def kv_bytes_per_token(model, bits, block, prompts):
    """Bytes the cache holds per token after `prompts` (KIVI: its packed blocks, scales and residual)."""
    with torch.inference_mode():
        _, held = model(prompts, new_cache(model, bits, block))
    return iu.kv_cache_bytes(held) / prompts.numel()


MEMORY_READ = "memory read (the float32 W, summed)"
BENCH_MAX = 16384  # the default benchmark matrix's largest side: 1 GiB of float32


def bench_layers(size, paths, candidates):
    """The benchmark's layers on one matrix W [size, size] and its input x [1, size]: float32, dequantize-then-
    matmul int8, ATen's int8 and int4 kernels, (candidates) the others a practitioner would try, and (fast in
    paths) the fast path's kernel on float32, int8 and int4."""
    torch.manual_seed(0)
    linear = nn.Linear(size, size)
    nn.init.zeros_(linear.bias)  # the fast kernel adds a bias: zeros, [size] floats beside size^2 weights
    int8, int4 = qz.rtn(linear, 8, 32), qz.rtn(linear, 4, 32, kernel=False)
    plain8 = qz.rtn(linear, 8, 32, kernel=False)
    layers = {"float32 (F.linear)": linear, "int8 dequantize + F.linear": plain8,
              "int8 _weight_int8pack_mm": int8, "int4 g32 _weight_int4pack_mm_for_cpu": qz.rtn(linear, 4, 32)}
    if candidates:
        layers |= candidate_layers(linear, plain8, torch.randn(1, size))
    if "fast" in paths:
        layers |= {"float32 fast path kernel": FastLinear(linear), "int8 fast path kernel": FastLinear(int8),
                   "int4 g32 fast path kernel": FastLinear(int4), MEMORY_READ: MemoryRead(linear.weight.detach())}
    return layers, torch.randn(1, size)


class Candidate(nn.Module):
    """A benchmark row computed by another library: fn(x), reading `nbytes` of weights; compiled rows say their
    compile time (compile_s, outside every timing)."""

    def __init__(self, fn, nbytes, compile_s=None):
        super().__init__()
        self.fn, self.nbytes, self.compile_s = fn, nbytes, compile_s

    def forward(self, x):
        return self.fn(x)


INDUCTOR_INT8 = "int8 weight-only, Inductor max-autotune"


@torch.inference_mode()
def candidate_layers(linear, plain8, x):
    """The int8 weight-only products that exist beside ATen's: Inductor's (max-autotune on the dequantize-then-matmul
    pattern it recognizes, x in float32 and in bfloat16) and torchao's int8 weight-only (its int4 weight-only has no
    CPU layout in torchao 0.18). Each compiled once here; a row is skipped, with a line, where it cannot be made."""
    n = linear.weight.numel() + 2 * 4 * linear.out_features  # int8 codes, scales and bias
    q, scale, bias = plain8.q, plain8.scale.float(), linear.bias.detach()
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        fn = torch.compile(lambda x, d=dtype: (F.linear(x.to(d), q.to(d)) * scale.to(d) + bias.to(d)).float(),
                           mode="max-autotune")
        try:
            with iu.Timer() as compiling:
                fn(x)
            out[f"{INDUCTOR_INT8} ({'bfloat16' if dtype == torch.bfloat16 else 'float32'} x)"] = Candidate(
                fn, n, round(compiling.seconds, 1))
        except Exception as error:  # noqa: BLE001 (Inductor's errors have no common type): the row is skipped
            print(f"{INDUCTOR_INT8}: not compiled ({type(error).__name__}: {str(error).splitlines()[0][:120]}); skipped")
    try:
        with iu.stderr_silenced():
            from torchao.quantization import Int8WeightOnlyConfig, quantize_
    except ImportError:
        print(f"torchao is not installed (pip install {TORCHAO}): its benchmark row is skipped")
        return out
    ao = copy.deepcopy(linear)
    quantize_(ao, Int8WeightOnlyConfig())
    return out | {"torchao int8 weight-only": Candidate(ao, n)}


@torch.inference_mode()
def bench_checks(layers, x):
    """The fast path's kernels against the layers they stand for, on the benchmark's matrix ({check: ok})."""
    atol = ATOL * math.sqrt(x.shape[1])  # float32 sums of K products in another order: the error grows with K
    checks = {}
    for name, reference in ((f"{INDUCTOR_INT8} (float32 x)", "int8 dequantize + F.linear"),
                            ("float32 fast path kernel", "float32 (F.linear)"),
                            ("int8 fast path kernel", "int8 _weight_int8pack_mm"),
                            ("int4 g32 fast path kernel", "int4 g32 _weight_int4pack_mm_for_cpu")):
        if name in layers:
            diff = (layers[name](x) - layers[reference](x)).abs().max().item()
            checks[f"benchmark: {name} = {reference} (max |diff| {diff:.1e}, atol {atol:.0e})"] = diff <= atol
    return checks


def matmul_benchmark(layers, x, repeats):
    """Each layer's x @ W^T, timed round-robin: rows of weight MB, ms (median) and weight GB/s."""
    with torch.inference_mode():
        times = iu.time_round_robin({name: (lambda m=m: m(x)) for name, m in layers.items()}, warmup=2, repeats=repeats)
    rows = []
    for name, layer in layers.items():
        nbytes = layer.nbytes if isinstance(layer, Candidate) else sum(
            t.nbytes for t in list(layer.parameters()) + list(layer.buffers()))
        ms = iu.median(times[name]) * 1e3
        rows.append(dict(variant=name, weight_mb=round(nbytes / 2**20, 1), ms=round(ms, 3),
                         weight_GB_per_s=round(nbytes / ms / 1e6, 1)))
    bandwidth = next((r["weight_GB_per_s"] for r in rows if r["variant"] == MEMORY_READ), None)
    for row in rows:
        row["speedup_vs_float32"] = round(rows[0]["ms"] / row["ms"], 2)
        row["share_of_bandwidth"] = None if bandwidth is None else round(row["weight_GB_per_s"] / bandwidth, 2)
    return rows


class FastLinear(nn.Module):
    """A linear layer (nn.Linear or QuantLinear) through the fast path's kernel (lib/fast_decode.linear), its
    weight packed once (lib/fast_decode.linear_parts)."""

    def __init__(self, layer):
        super().__init__()
        weight, scale, bias = fast_decode.linear_parts(layer)
        self.register_buffer("weight", weight)  # [ceil(N / 32), K, 32] (int4: [.., K, 16] bytes)
        self.register_buffer("scale", scale)
        self.register_buffer("bias", bias)

    def forward(self, x):
        return fast_decode.linear(x, self.weight, self.scale, self.bias)


class MemoryRead(nn.Module):
    """The benchmark's bandwidth row: one read of `tensor` (lib/fast_decode.read_sum), x ignored."""

    def __init__(self, tensor):
        super().__init__()
        self.register_buffer("tensor", tensor)

    def forward(self, x):
        return fast_decode.read_sum(self.tensor)


SHAPE = "gptlite"  # the memory-bound shape: the post's model, 70 MB of float32 weights


def shape_variants(group_size, seed):
    """The post's gptlite shape with random weights (only time is measured there: quality is the trained cpu
    preset's) on the fast path, float32, bfloat16, int8 and int4 weights: {name: (its native view, the eager
    model it computes: rounded or dequantize-then-matmul weights)}."""
    torch.manual_seed(seed)
    model = GPTlite_KVCache(**PRESETS[SHAPE].gptlite_kwargs()).eval()
    G = group_size
    int8, int4 = (qz.quantize_model(model, "rtn", bits, G, kernel=False) for bits in (8, 4))
    return {"float32": (fast_decode.native_view(model), model),
            "bfloat16": (fast_decode.native_view(model, torch.bfloat16), fast_decode.rounded_to(model, torch.bfloat16)),
            "int8 per channel, RTN": (fast_decode.native_view(int8), int8),
            f"int4 g{G}, RTN": (fast_decode.native_view(int4), int4)}


def bytes_per_token(view, context):
    """Bytes one decoding step of `view` reads at batch 1: its weights (the embedding tables one row each) and
    scales, and the KV cache of `context` tokens. Returns (weight bytes, KV bytes)."""
    weights = 2 * view.weights[0].shape[1] * 4 + sum(t.nbytes for t in view.weights[2:] + view.scales)
    c = view.config
    return weights, context * c.n_layers * 2 * c.n_heads * c.d_head * 4


SHAPE_TITLE = (f"Decoding at the {SHAPE} shape (random weights: time only), batch 1; tpot_vs_float32: this TPOT / "
               "float32's on the fast path; at_bandwidth_ms: bytes_per_token at the measured read bandwidth")


@torch.inference_mode()
def shape_checks(variants, prompts, n_tokens):
    """{check: ok}: each shape variant's greedy tokens on the fast path equal those of the eager model it computes."""
    checks = {}
    for name, (view, eager) in variants.items():
        ok = torch.equal(fast_decode.generate_fast(view, prompts, n_tokens, view.seqlen),
                         generate_kvcache(eager, prompts, n_tokens, eager.seqlen))
        checks[f"{SHAPE} shape, {name}, fast path: greedy tokens = the eager model's "
               f"({'rounded' if name == 'bfloat16' else 'dequantize + matmul' if name != 'float32' else 'float32'})"] = ok
    return checks


def shape_rows(variants, peers, prompt, n_tokens, repeats, bandwidth, llc):
    """Each variant's greedy decoding at batch 1 on the fast path, round-robin with eager float32 and the `peers`
    ({name: (fn(prompt, n) -> tokens, fn(context) -> (weight bytes, KV bytes) read per step)}): TPOT,
    tpot_vs_float32 (this TPOT / float32's on the fast path), bytes read per token and the time that many bytes
    take at the measured `bandwidth` (GB/s), and whether the weights fit the last-level cache."""
    fns = {(name, "fast"): (lambda n, v=v: fast_decode.generate_fast(v, prompt, n, v.seqlen))
           for name, (v, _) in variants.items()}
    eager = variants["float32"][1]
    fns["float32", "eager"] = lambda n: generate_kvcache(eager, prompt, n, eager.seqlen)
    fns |= {(name, "llama.cpp"): (lambda n, f=f: f(prompt, n)) for name, (f, _) in peers.items()}
    timing = iu.compare_generation(fns, n_tokens, 1, repeats=repeats)
    context = prompt.shape[1] + n_tokens / 2  # the mean context of the timed steps
    rows = []
    for (name, path), t in timing.items():
        weight_bytes, kv_bytes = (peers[name][1] if path == "llama.cpp"
                                  else lambda c, v=variants[name][0]: bytes_per_token(v, c))(context)
        total = weight_bytes + kv_bytes
        rows.append(harness.make_row(
            name, shape=SHAPE, path=path, tpot_b1_ms=t["tpot_ms"],
            tpot_vs_float32=iu.ratio(t["tpot_ms"], timing["float32", "fast"]["tpot_ms"]) if path != "eager" else None,
            bytes_per_token=round(total), weight_mb=round(weight_bytes / 2**20, 2),
            kv_mb=round(kv_bytes / 2**20, 2), at_bandwidth_ms=round(total / bandwidth / 1e6, 3),
            in_cache="yes" if weight_bytes <= llc else "no"))
    for r in rows:
        r["tpot_vs_float32"] = None if r["tpot_vs_float32"] is None else round(r["tpot_vs_float32"], 2)
    return rows


LLAMACPP = {"llama.cpp f32": "f32", "llama.cpp q8_0": "q8_0", "llama.cpp q4_0": "q4_0"}


def llamacpp_peers(model, vocab, source, folder, threads):
    """llama.cpp on `model`'s weights: {row name: (fn(prompt, n) -> greedy tokens, fn(context) -> (weight bytes,
    KV bytes) read per step)} in float32, Q8_0 and Q4_0, each file written to `folder` (the float32 GGUF, then
    llama.cpp's quantizer on it), the seconds that took (outside every timing), and a line for each file that
    llama.cpp failed to decode in a child process (lib/llamacpp.probe): that row is skipped."""
    peers, failed = {}, []
    with iu.Timer() as writing:
        f32 = llamacpp.write_gguf(model, vocab, f"{folder}/{source}-f32.gguf", source=source)
        paths = {kind: f32 if kind == "f32" else llamacpp.quantize(f32, f"{folder}/{source}-{kind}.gguf", kind, threads)
                 for kind in LLAMACPP.values()}
    for name, kind in LLAMACPP.items():
        if failure := llamacpp.probe(paths[kind], model.seqlen, threads):
            failed.append(f"{name}: {failure}; its rows are skipped (README: llama.cpp without AMX)")
            continue
        llm = llamacpp.load(paths[kind], model.seqlen, threads)
        config, _, sizes = llamacpp.read_config(paths[kind])
        peers[name] = (lambda p, n, llm=llm: llamacpp.generate(llm, p, n),
                       lambda c, config=config, sizes=sizes: llamacpp.bytes_per_token(sizes, config, c))
    return peers, writing.seconds, failed


def llamacpp_checks(peers, model, prompts, n_tokens, where):
    """{check: ok}: llama.cpp's float32 greedy tokens equal ours (generate_kvcache); and the line that gives the
    share of the quantized files' greedy tokens equal to float32's at the same position."""
    ours = generate_kvcache(model, prompts, n_tokens, model.seqlen)
    tokens = {name: fn(prompts, n_tokens) for name, (fn, _) in peers.items()}
    checks = {f"{where}, llama.cpp f32: greedy tokens = ours ({prompts.shape[0]} prompts x {n_tokens})":
              torch.equal(tokens["llama.cpp f32"], ours)} if "llama.cpp f32" in tokens else {}
    shares = [f"{name.split()[1]} {(t[:, -n_tokens:] == ours[:, -n_tokens:]).float().mean().item():.0%}"
              for name, t in tokens.items() if name != "llama.cpp f32"]
    return checks, f"{where}: share of llama.cpp's greedy tokens equal to float32's: {', '.join(shares) or 'none'}"


def kv_shape_setup(kv_bits, block, batch_size, context, n_tokens, seed):
    """The gptlite shape's model (random weights, a window of context + n_tokens + 1) and its full caches of
    `context` random entries: {"float32": a static float32 cache, each KIVI row: a KIVI cache, (each KIVI row,
    "fast"): its entries packed for the fast path (blocks of 32 only)} ((None, {}) with batch_size 0: no rows)."""
    if not batch_size:
        return None, {}
    torch.manual_seed(seed)
    model = GPTlite_KVCache(**memory_bound.shape_config(context, n_tokens)).eval()
    caches = {"float32": memory_bound.filled_cache(model, batch_size, context, n_tokens + 1, seed)}
    for name, bits in kivi_names(kv_bits).items():
        caches[name] = memory_bound.filled_cache(model, batch_size, context, seed=seed, kv_bits=bits, kv_block=block)
        if block == fast_decode.PackedKIVICache.BLOCK:  # the fast path's kernel: the same entries, packed for it
            caches[name, "fast"] = fast_decode.PackedKIVICache.from_kivi(caches[name], context + n_tokens + 1)
    return model, caches


def kv_shape_checks(model, caches, batch_size, context, paths):
    """{check: ok}: over each KIVI cache, a step's logits equal those over a float32 cache holding its dequantized
    entries; on the fast path (in paths), float32's and each packed KIVI cache's equal eager's."""
    pairs = {}  # {subject: ((model, cache), (reference model, reference cache), what the reference is)}
    for name, cache in caches.items():
        cache.truncate(context)
        if isinstance(name, tuple):  # a KIVI cache packed for the fast path
            if "fast" in paths:
                pairs[f"fast path, {name[0]}"] = ((fast_decode.native_view(model), cache), (model, caches[name[0]]),
                                                  "the eager KIVI cache's")
        elif name != "float32":
            pairs[name] = ((model, cache), (model, memory_bound.dequantized_copy(cache)),
                           "those over a float32 cache of its dequantized entries")
        elif "fast" in paths:
            pairs["fast path, float32"] = ((fast_decode.native_view(model), cache), (model, cache), "eager's")
    checks = {}
    for subject, (got, want, against) in pairs.items():
        diff = (memory_bound.decode_steps(*got, context, batch_size)(1)
                - memory_bound.decode_steps(*want, context, batch_size)(1)).abs().max().item()
        checks[f"{SHAPE} shape, batch {batch_size}, context {context}, {subject}: a step's logits = {against} "
               f"(max |diff| {diff:.1e}, atol {ATOL:g})"] = diff <= ATOL
    return checks


def kv_shape_rows(model, caches, batch_size, context, n_tokens, paths, repeats, bandwidth, llc):
    """Decoding at the shape from each full cache, round-robin, on each path: eager (KIVI's attention PyTorch's,
    over the blocks dequantized) and fast (KIVI's on the codes); the bytes each step reads."""
    if not caches:
        return []
    names = [name for name in caches if not isinstance(name, tuple)]
    views = {(name, path): fast_decode.on_path(model, path) for path in paths for name in names
             if path == "eager" or name == "float32" or (name, path) in caches}
    return memory_bound.step_rows(views, dict.fromkeys(names, model), caches, batch_size, context, n_tokens, repeats,
                                  bandwidth, llc, reference="float32")


def shape_tables(shape_table, kv_table, kv_block):
    """The tables at the gptlite shape that this run has."""
    tables = [harness.table(SHAPE_TITLE, shape_table)] if shape_table else []
    if kv_table:
        title = memory_bound.shape_title(kv_table[0]["batch_size"], kv_table[0]["context"], "float32")
        tables.append(harness.table(f"{title}; KIVI: {kv_block}-token blocks, the KV cache's bytes", kv_table))
    return tables


def headline(rows, shape_table, kv_table):
    """The README's one-glance row, from this run's rows: the best int4's quality, and at the gptlite shape on
    the fast path the weights' and the KV cache's TPOT against float32's."""
    best = min((r for r in rows if r["variant"].startswith("int4")), key=lambda r: r["loss_change"])
    figure = f"{best['variant']}: {best['bits_per_weight']:.1f} bits per weight, loss {best['loss_change']:+.4f}"
    weights = [f"{r['variant'] if r['path'] == 'llama.cpp' else r['variant'].split(' ')[0]} {r['tpot_vs_float32']:.2f}x"
               for r in shape_table if r["path"] != "eager" and r["variant"] != "float32"
               and r["tpot_vs_float32"] is not None]
    kivi = [f"{r['variant'].split(' KV')[0]} {r['tpot_vs_float32']:.2f}x" for r in kv_table
            if r["path"] == "fast" and r["variant"] != "float32" and r["tpot_vs_float32"] is not None]
    if weights:
        figure += f"; gptlite shape, fast path, TPOT vs float32 at batch 1: {', '.join(weights)}"
    if kivi:
        figure += (f"; KV cache at batch {kv_table[0]['batch_size']} x {kv_table[0]['context']} tokens: "
                   f"{', '.join(kivi)}")
    return dict(technique="quantization: weights (RTN, GPTQ, AWQ, torchao), W8A8, FP8, KIVI", figure=figure)


def plot_results(rows, bench, shape_table, kv_table, bandwidth, llc, preset, device):
    fig, (ax_loss, ax_bench, ax_bytes, ax_kv) = harness.new_figure(4)
    plot_bytes(ax_bytes, shape_table, bandwidth, llc)
    memory_bound.plot_step_rows(ax_kv, kv_table, bandwidth, llc)
    for r in rows:
        if r["bits_per_weight"] is not None and r["val_loss"] is not None:
            ax_loss.scatter(r["bits_per_weight"], r["loss_change"])
            ax_loss.annotate(r["variant"], (r["bits_per_weight"], r["loss_change"]), fontsize=6)
    ax_loss.axhline(0, color="gray", linewidth=0.8)
    ax_loss.set(xlabel="bits per weight (scales and float parts included)", ylabel="validation loss - float32's",
                title=f"quality against size (preset {preset.name})")
    ax_bench.barh(range(len(bench)), [b["speedup_vs_float32"] for b in bench])
    ax_bench.set_yticks(range(len(bench)), [b["variant"] for b in bench], fontsize=7)
    ax_bench.invert_yaxis()
    ax_bench.axvline(1, color="gray", linewidth=0.8)
    ax_bench.set(xlabel="speedup over float32 (F.linear)",
                 title=f"x @ W^T, W {bench[0]['weight_mb']:.0f} MB in float32 ({device})")
    return fig


def plot_bytes(ax, shape_table, bandwidth, llc):
    """TPOT against the bytes read per token at the gptlite shape, fast path, with the bandwidth and cache lines."""
    points = [(r["variant"], r["bytes_per_token"], r["tpot_b1_ms"]) for r in shape_table if r["path"] != "eager"]
    memory_bound.plot_bytes(ax, points, bandwidth, llc, "MiB read per token (weights + KV cache)",
                            "TPOT (ms), fast path and llama.cpp, batch 1", f"decode is memory-bound: {SHAPE} shape")


def parse_args(argv):
    """The flags, checked before any work: (args, preset, device, data)."""
    parser = harness.script_parser(__doc__)
    add = parser.add_argument
    add("--group-size", type=harness.int_at_least(1), default=32, help="input columns per int4 scale and zero")
    add("--alpha", type=harness.float_in(0.0, 1.0), default=0.5, help="SmoothQuant's migration strength")
    add("--kv-bits", type=int, nargs="+", default=[4, 2], help=f"KIVI's bits per key and value, of {qz.KV_BITS}")
    add("--kv-block", type=harness.int_at_least(1), default=32, help="KIVI's block of tokens (the float32 residual)")
    add("--calib-windows", type=harness.batches, default=16, help="calibration windows of GPTQ, AWQ, SmoothQuant")
    add("--val-batches", type=harness.batches, default=10, help="validation batches of 32 windows per loss")
    add("--bench-size", type=harness.int_at_least(64), default=None,
        help="the benchmark matrix's side (default: a multiple of 256 whose int4 form is 1.5x the last-level cache, "
             "at most 16384)")
    harness.add_generation_flags(parser, prompt_len=32, n_tokens=32, repeats=3)
    add("--candidates", action=argparse.BooleanOptionalAction, default=True,
        help="benchmark Inductor's and torchao's int8 weight-only products too (Inductor compiles each once)")
    harness.add_paths_flag(parser)
    add("--llamacpp", action=argparse.BooleanOptionalAction, default=True,
        help=f"llama.cpp's rows (float32, Q8_0, Q4_0 on the same weights; pip install {llamacpp.INSTALL})")
    memory_bound.add_shape_flags(parser)
    args = parser.parse_args(argv)

    def check_args(preset):
        for p in (preset, PRESETS[SHAPE]):  # the trained model's widths and the timed shape's
            for width in (p.d_model, p.n_heads * p.d_head, 4 * p.d_model):
                try:
                    qz.check_group(width, args.group_size)
                except ValueError as e:
                    parser.error(f"--group-size: {e} (preset {p.name})")
        if "fast" in args.paths and args.group_size % 8:
            parser.error(f"--group-size {args.group_size}: the fast path's int4 kernel reads groups of a multiple of 8 "
                         "rows (use 32), or pass --paths eager")
        bad = [b for b in args.kv_bits if b not in qz.KV_BITS]
        if bad:
            parser.error(f"--kv-bits {bad}: KIVI here stores {qz.KV_BITS} bits per value")
        if preset.seqlen % args.kv_block:
            parser.error(f"--kv-block {args.kv_block} must divide the window of {preset.seqlen} tokens")
        if args.prompt_len + args.n_tokens > preset.seqlen:
            parser.error(f"--prompt-len + --n-tokens exceed the window of {preset.seqlen}")
        if args.bench_size is None:
            llc = memory_bound.last_level_cache_bytes() or 32 * 2**20
            # int4 (size^2 / 2 bytes): 1.5x the cache, at most 1 GiB of float32 (a VM may report its host's whole cache)
            args.bench_size = min(256 * math.ceil(math.sqrt(3 * llc) / 256), BENCH_MAX)
        harness.check_fits(parser, "--bench-size", 14 * args.bench_size**2, "the benchmark's matrices")
    args.kv_bits = sorted(set(args.kv_bits), reverse=True)
    return (args, *harness.setup(args, parser, check_args))


def summary_lines(checks, path_rows, args, layers):
    """The lines under the table: the checks, what the columns mean, the candidates' compile times, and each
    quantized variant's speed against float32 on each path."""
    compiled = [f"{name} {m.compile_s} s" for name, m in layers.items() if getattr(m, "compile_s", None) is not None]
    summary = list(checks) + ([f"benchmark, compile time (once, outside the timings): {'; '.join(compiled)}"]
                              if compiled else []) + [
        "bits_per_weight: 8 x the serialized state dict's bytes / the float model's parameters; token_agreement: the "
        f"share of greedy tokens (8 prompts x {args.n_tokens}) equal to float32's at the same position; KIVI: "
        f"{args.kv_block}-token blocks, the latest (up to {args.kv_block - 1}) tokens in float32",
        f"benchmark: x [1, {args.bench_size}] @ W^T, W [{args.bench_size}, {args.bench_size}]; last-level cache "
        f"{(memory_bound.last_level_cache_bytes() or 0) / 2**20:.0f} MiB; median of {args.repeats + 2}, round-robin"]
    for b in (1, 8):  # each quantized variant's speed against float32, on each path
        ratios = {}
        for r in path_rows:
            if r["variant"] != "float32" and r[f"vs_float32_b{b}"] is not None:
                ratios.setdefault(r["variant"], []).append(f"{r['path']} {r[f'vs_float32_b{b}']:.2f}x")
        summary += [f"batch {b}, float32's TPOT / this one's: " + "; ".join(
            f"{name} {', '.join(v)}" for name, v in ratios.items())]
    return summary


def llamacpp_setup(args, device, preset, model, shape, vocab, prompts, folder):
    """llama.cpp's rows, when asked for and installed (else a line says why not): the peers at the gptlite shape,
    the checks of its float32 tokens against ours (the trained model's and the shape's) and the summary lines."""
    if not args.llamacpp:
        return {}, {}, []
    skip = engines.missing("llama_cpp", llamacpp.INSTALL) or (
        f"llama.cpp runs on the CPU here, the run is on {device}: its rows are skipped" if device.type != "cpu" else None)
    if skip:  # one line, in the summary under the tables
        return {}, {}, [skip]
    threads = torch.get_num_threads()
    trained, seconds, failed = llamacpp_peers(model, vocab, preset.name, folder, threads)
    checks, line = llamacpp_checks(trained, model, prompts, args.n_tokens, f"{preset.name} preset")
    lines = failed + [line]
    peers = {}
    if shape:
        peers, shape_seconds, failed = llamacpp_peers(shape["float32"][1], vocab, SHAPE, folder, threads)
        shape_checks_, shape_line = llamacpp_checks(peers, shape["float32"][1], prompts[:2], args.n_tokens,
                                                    f"{SHAPE} shape")
        checks |= shape_checks_
        lines += failed + [shape_line]
        seconds += shape_seconds
    lines.append(f"llama.cpp: GGUF files written and quantized in {seconds:.1f} s (outside the timings); "
                 f"{threads} threads, a float32 KV cache; its GPT-2 graph runs GPTlite exactly (lib/llamacpp.py)")
    return peers, checks, lines


def main(argv=None):
    args, preset, device, data = parse_args(argv)
    with engines.temp_dir() as folder:  # llama.cpp's GGUF files, for this run only
        run_all(args, preset, device, data, folder)


def run_all(args, preset, device, data, folder):
    model = iu.load_model(GPTlite_KVCache, preset, device, data, untrained=args.untrained, seed=args.seed)
    calibration = corpus.sample_prompts(data, args.calib_windows, preset.seqlen, seed=args.seed + 1, device=device)
    window = corpus.sample_prompts(data, 4, preset.seqlen, seed=args.seed, device=device)
    models, plain, diffs = {"float32": model}, {}, {}
    for name, kwargs in list(weight_variants(args.group_size, args.alpha).items())[1:]:
        if kwargs["method"] in ("rtn", "gptq", "awq"):
            models[name], plain[name], diffs[name] = kernel_matches(model, kwargs, calibration, window)
        else:
            models[name] = qz.quantize_model(model, calibration=calibration, **kwargs)
    models.update(torchao_variants(model))
    layers, x = bench_layers(args.bench_size, args.paths, args.candidates)
    fast = fast_variants(args.group_size) if "fast" in args.paths else ()
    fns = generators(models, plain, args.kv_bits, args.kv_block, fast)
    prompts = corpus.sample_prompts(data, 8, args.prompt_len, seed=args.seed, device=device)
    tokens = {key: fn(prompts, args.n_tokens)[:, args.prompt_len:] for key, fn in fns.items()}
    checks = {f"{name}: packed kernel = dequantize + matmul (max |logits diff| {d:.1e}, atol {ATOL:g})": d <= ATOL
              for name, d in diffs.items()} | bench_checks(layers, x)
    checks |= {f"{name}, fast path: greedy tokens = the eager path's": torch.equal(tokens[name, "fast"],
                                                                                    tokens[name, "eager"])
               for name, path in fns if path == "fast"}
    shape = shape_variants(args.group_size, args.seed) if fast else {}
    kv_model, kv_caches = kv_shape_setup(args.kv_bits, args.kv_block, args.shape_batch, args.shape_context,
                                         args.shape_tokens, args.seed)
    checks |= shape_checks(shape, prompts[:2], args.n_tokens) | kv_shape_checks(
        kv_model, kv_caches, args.shape_batch, args.shape_context, args.paths)
    peers, peer_checks, peer_lines = llamacpp_setup(args, device, preset, model, shape, data.vocab, prompts, folder)
    checks |= peer_checks
    harness.require_checks(checks)
    rows, path_rows = measure(models, plain, diffs, fns, prompts, tokens, data, args, preset)
    bench = matmul_benchmark(layers, x, args.repeats + 2)
    bandwidth = next((b["weight_GB_per_s"] for b in bench if b["variant"] == MEMORY_READ), None)
    llc = memory_bound.last_level_cache_bytes() or 32 * 2**20
    shape_table = shape_rows(shape, peers, prompts[:1], args.n_tokens, args.repeats, bandwidth, llc) if shape else []
    kv_table = kv_shape_rows(kv_model, kv_caches, args.shape_batch, args.shape_context, args.shape_tokens,
                             args.paths, args.repeats, bandwidth, llc)
    summary = summary_lines(checks, path_rows, args, layers) + peer_lines
    harness.report(args, "main_quantization.py", preset, device, rows, headline(rows, shape_table, kv_table),
                   summary=summary,
                   tables=[harness.table("Greedy decoding on each path (TPOT ms; vs_float32: float32's TPOT on the "
                                         "same path / this one's)", path_rows),
                           harness.table("Matrix-vector product on a matrix larger than the last-level cache", bench)]
                   + shape_tables(shape_table, kv_table, args.kv_block),
                   plot=lambda: plot_results(rows, bench, shape_table, kv_table, bandwidth, llc, preset, device),
                   checks=checks,
                   bandwidth_GB_per_s=bandwidth, last_level_cache_bytes=llc)


def measure(models, plain, diffs, fns, prompts, tokens, data, args, preset):
    """Every variant's row (eager path): size, loss (of the dequantizing form where there is one: the same logits),
    token agreement, TPOT at batch 1 and 8, KV bytes per token; and the rows of fast_variants on each path."""
    timing = {b: iu.compare_generation({k: (lambda n, f=f: f(prompts[:b], n)) for k, f in fns.items()}, args.n_tokens,
                                       b, prompts.device, repeats=args.repeats) for b in (1, 8)}
    n_float = iu.n_params(models["float32"])
    base_loss = training.validation_loss(models["float32"], data, args.val_batches)
    window = corpus.sample_prompts(data, 1, preset.seqlen, seed=args.seed, device=prompts.device)
    kivi = kivi_names(args.kv_bits)
    rows = []
    for name, _ in (key for key in fns if key[1] == "eager"):
        model = models.get(name, models["float32"])
        bits = kivi.get(name)
        loss = (kivi_loss(model, data, bits, args.kv_block, args.val_batches) if bits
                else base_loss if name == "float32" else training.validation_loss(plain.get(name, model), data,
                                                                                  args.val_batches))
        size = qz.serialized_bytes(model)
        rows.append(harness.make_row(
            name, bits_per_weight=round(8 * size / n_float, 2), size_mb=round(size / 2**20, 3), val_loss=loss,
            loss_change=round(loss - base_loss, 4),
            token_agreement=round((tokens[name, "eager"] == tokens["float32", "eager"]).float().mean().item(), 3),
            tpot_b1_ms=timing[1][name, "eager"]["tpot_ms"], tpot_b8_ms=timing[8][name, "eager"]["tpot_ms"],
            kv_bytes_per_token=round(kv_bytes_per_token(model, bits, args.kv_block, window), 1),
            kernel_eq_dequant="-" if name not in diffs else "yes" if diffs[name] <= ATOL else "NO"))
    path_rows = []
    for path in args.paths:
        for name in (n for n in fast_variants(args.group_size) if (n, path) in fns):
            tpot = {b: timing[b][name, path]["tpot_ms"] for b in (1, 8)}
            ratios = {b: iu.ratio(timing[b]["float32", path]["tpot_ms"], tpot[b]) for b in (1, 8)}
            path_rows.append(harness.make_row(name, path=path, tpot_b1_ms=tpot[1], tpot_b8_ms=tpot[8], **{
                f"vs_float32_b{b}": None if r is None else round(r, 2) for b, r in ratios.items()}))
    return rows, path_rows


if __name__ == "__main__":
    harness.run(main)
