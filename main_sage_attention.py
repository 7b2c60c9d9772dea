"""Quantized attention (SageAttention): Q and K in INT8 per block, K smoothed first, P.V in 16 bits.

    python main_sage_attention.py                     # cpu preset on CPU, gptlite on CUDA
    python main_sage_attention.py --bench-len 4096 --json sage.json --plot sage.png
    python main_sage_attention.py --untrained --val-batches 2 --n-tokens 8 --bench-len 256 --repeats 1  # smoke run

Blog section: "Quantized attention: SageAttention". The scores Q K^T are computed as an
INT8 matrix product with INT32 accumulation (torch._int_mm), each block of block_q queries and of block_k
keys with its own scale max|x| / 127. K has a large offset per channel, shared by all tokens, that would
eat the INT8 range; subtracting K's mean over the tokens removes it without changing the softmax (every
score of a row, q.k_j - q.mean(k), moves by the same q.mean(k)). P.V stays in float16 (bfloat16 on a CPU
that has it, else float32). The INT4 rows follow SageAttention2 (values in [-7, 7]; Q smoothed per block
too, its mean's scores q_mean.K^T added back in float).

The script checks the smoothing invariance and the INT8 product (against an int64 product) before any
timing, then reports the error against exact attention on random inputs with a per-channel offset in K
and on the trained model's own Q, K, V, the validation loss and greedy-token agreement of the model with
the variant in every layer, the bytes of Q and K read per token and head, and times where INT8 is fast.
SageAttention's speed-up (about 2x FlashAttention2 on GPUs) needs a fused kernel; this eager version
shows the numerics and the INT8 product's own speed, not that.
"""
import copy
import math

import torch
import torch.nn.functional as F

import inference_utils as iu
from gptlite_kvcache import GPTlite_KVCache, MultiHeadAttention_KVCache, generate_kvcache
from gptlite_kvcache import scaled_dot_product_attention_kv_cache as exact_attention
from gptlite_kvcache import swap_attention
from lib import attention_benchmark as ab
from lib import attention_summary, corpus, harness, training

ATOL = 1e-5  # float32 attention outputs: the smoothing invariance


def sage_attention(q, k, v, smooth_k=True, block_q=128, block_k=64, *, causal=False, bits=8, smooth_q=False):
    """q: [B, H, Tq, D], k and v: [B, H, Tk, D]. causal: query i sees keys up to Tk - Tq + i (a cache's
    shifted mask). bits 8 (SageAttention) or 4 (SageAttention2's INT4, with smooth_q). Returns [B, H, Tq, D]."""
    check_sage_args(q, k, v, block_q, block_k, bits)
    if smooth_k:
        k = k - k.mean(dim=-2, keepdim=True)  # the same shift q.mean(k) for every score of a row
    q_mean = 0
    if smooth_q:  # SageAttention2: quantize q - mean(q) per block, add mean(q).K^T back in float
        q_mean = per_block(q, block_q, lambda blocks: blocks.mean(dim=-2, keepdim=True))  # [B, H, Tq, D]
    q_int, q_scale = quantize_per_block(q - q_mean, block_q, bits)  # int8 [B, H, Tq, D], [B, H, Tq]
    k_int, k_scale = quantize_per_block(k, block_k, bits)
    scores = int_matmul(q_int, k_int).float() * q_scale[..., :, None] * k_scale[..., None, :]  # [B, H, Tq, Tk]
    if smooth_q:
        scores = scores + q_mean @ k.transpose(-2, -1)
    scores = scores / q.shape[-1] ** 0.5
    Tq, Tk = q.shape[-2], k.shape[-2]
    if causal and Tq > 1:
        mask = torch.ones(Tq, Tk, dtype=torch.bool, device=q.device).tril(diagonal=Tk - Tq)
        scores = scores.masked_fill(~mask, float("-inf"))
    p = F.softmax(scores, dim=-1)  # [B, H, Tq, Tk], float32
    dtype = pv_dtype(q.device)
    return (p.to(dtype) @ v.to(dtype)).to(q.dtype)  # [B, H, Tq, D]


def per_block(x, block, fn):
    """fn applied to each block of `block` tokens of x [B, H, T, D] ([B, H, n, block, D], the last zero-padded
    then cut), its result [B, H, n, 1 or block, ...] repeated over the block's tokens and cut back to T."""
    B, H, T, D = x.shape
    n = math.ceil(T / block)
    blocks = F.pad(x, (0, 0, 0, n * block - T)).view(B, H, n, block, D)
    out = fn(blocks)
    return out.expand(B, H, n, block, *out.shape[4:]).reshape(B, H, n * block, *out.shape[4:])[:, :, :T]


def quantize_per_block(x, block, bits):
    """Symmetric quantization of x [B, H, T, D], one scale max|x| / qmax per block of `block` tokens.
    Returns int8 values in [-qmax, qmax] (INT4 values held in int8) and each token's scale [B, H, T]."""
    qmax = 2 ** (bits - 1) - 1  # 127 or 7
    scale = per_block(x.float(), block, lambda b: b.abs().amax(dim=(-2, -1), keepdim=True)[..., 0]) / qmax
    scale = scale.clamp(min=1e-12)  # [B, H, T]; an all-zero block keeps zeros
    return (x / scale[..., None]).round().clamp(-qmax, qmax).to(torch.int8), scale


def int_matmul(a, b):
    """a [B, H, M, D] @ b[B, H, N, D]^T of int8 tensors with int32 accumulation, one torch._int_mm per head
    (it takes 2-D tensors only). CUDA's kernel needs M > 16 and D, N multiples of 8: other shapes (a decode
    step) are computed in float32, exact here since |sum| <= D * 127^2 < 2^24."""
    *lead, M, D = a.shape
    N = b.shape[-2]
    if a.device.type == "cuda" and not (M > 16 and D % 8 == 0 and N % 8 == 0):
        return (a.float() @ b.float().transpose(-2, -1)).to(torch.int32)
    a2, b2 = a.reshape(-1, M, D), b.reshape(-1, N, D)
    out = torch.empty(a2.shape[0], M, N, dtype=torch.int32, device=a.device)
    for i in range(a2.shape[0]):
        out[i] = torch._int_mm(a2[i], b2[i].T)
    return out.view(*lead, M, N)


def pv_dtype(device):
    """P.V's precision: float16 on CUDA, bfloat16 on a CPU with bf16 support (AVX512-BF16/AMX), else float32."""
    if device.type == "cuda":
        return torch.float16
    return torch.bfloat16 if torch.ops.mkldnn._is_mkldnn_bf16_supported() else torch.float32


def check_sage_args(q, k, v, block_q, block_k, bits):
    if q.dim() != 4 or k.shape != v.shape or k.dim() != 4 or k.shape[:2] != q.shape[:2] or k.shape[3] != q.shape[3]:
        raise ValueError(f"q must be [B, H, Tq, D] and k, v both [B, H, Tk, D] with its B, H and D; got "
                         f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    for name, value in (("block_q", block_q), ("block_k", block_k)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer (tokens per quantization block), got {value!r}")
    if bits not in (4, 8):
        raise ValueError(f"bits must be 8 (SageAttention) or 4 (SageAttention2's INT4), got {bits!r}")


# ----------------------------------------------------------------------------------------------------
# The variants, the model with a variant in every layer, and the measurements.

VARIANTS = {"exact (float32)": None,
            "float32 Q K^T, P.V in 16 bits": "pv16",  # the error of P.V alone, no quantization
            "INT8, no smoothing": dict(smooth_k=False),
            "INT8 + smooth K (SageAttention)": dict(smooth_k=True),
            "INT4 + smooth K": dict(smooth_k=True, bits=4),
            "INT4 + smooth Q, K (SageAttention2-style)": dict(smooth_k=True, bits=4, smooth_q=True)}


class MultiHeadAttention_Sage(MultiHeadAttention_KVCache):
    """The cached attention of GPTlite_KVCache computed by `self.attend(Q, K, V, causal)` (a variant)."""

    def attention(self, Q, K, V):
        return self.attend(Q, K, V, True)


def use_attention(model, attend):
    """Make every attention module of a GPTlite_KVCache compute with attend(q, k, v, causal), in place."""
    return swap_attention(model, MultiHeadAttention_Sage, attend=attend)


def use_sage_attention(model, **options):
    """Every layer of a GPTlite_KVCache with sage_attention(**options), in place. Returns model."""
    return use_attention(model, attention_fn(options))


def pv16_attention(q, k, v, causal):
    """Exact scores and softmax in float32, then P.V in sage_attention's 16-bit dtype."""
    Tq, Tk = q.shape[-2], k.shape[-2]
    scores = q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5  # [B, H, Tq, Tk]
    if causal and Tq > 1:
        scores = scores.masked_fill(~torch.ones(Tq, Tk, dtype=torch.bool, device=q.device).tril(Tk - Tq), float("-inf"))
    dtype = pv_dtype(q.device)
    return (F.softmax(scores, dim=-1).to(dtype) @ v.to(dtype)).to(q.dtype)


def attention_fn(options):
    if options is None:
        return lambda q, k, v, causal: exact_attention(q, k, v, causal_mask=causal)
    if options == "pv16":
        return pv16_attention
    return lambda q, k, v, causal: sage_attention(q, k, v, causal=causal, **options)


def errors(out, ref):
    """Cosine similarity and relative L1 (SageAttention's two accuracy metrics) of out against ref."""
    cos = F.cosine_similarity(out.flatten().double(), ref.flatten().double(), dim=0).item()
    return cos, ((out - ref).abs().sum() / ref.abs().sum()).item()


@torch.inference_mode()
def capture_qkv(model, x):
    """Each layer's Q, K, V [B, H, T, D] on the input x [B, T]: recomputed from the attention input."""
    captured = []

    def hook(mha, args):
        h = args[0]  # [B, T, d_model], after ln1
        captured.append(tuple(mha.split_heads(p(h)) for p in (mha.query_proj, mha.key_proj, mha.value_proj)))
    handles = [block.mha.register_forward_pre_hook(hook) for block in model.blocks]
    model(x)
    for handle in handles:
        handle.remove()
    return captured


def offset_inputs(batch, n_heads, T, d_head, offset, seed):
    """Random q, k, v with a per-channel offset in K (the same for every token), as SageAttention observed."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = torch.randn(3, batch, n_heads, T, d_head, generator=g)
    return q, k + offset * torch.randn(1, n_heads, 1, d_head, generator=g), v


def qk_bytes(options, d_head, block_q, block_k, dtype_bytes):
    """Bytes of Q and K per token and head: the values (INT4 packed two a byte, as a kernel stores them) and
    the float32 scales (and SageAttention2's float32 mean of Q) amortized over their blocks."""
    if not isinstance(options, dict):  # exact, pv16: Q and K as they are
        return 2 * d_head * dtype_bytes
    bits = options.get("bits", 8)
    extra = 4 * d_head / block_q if options.get("smooth_q") else 0
    return 2 * d_head * bits / 8 + 4 / block_q + 4 / block_k + extra


def time_variants(variants, shape, repeats, seed):
    """Median ms of each whole attention (causal) and of its Q K^T product alone; variants round-robin."""
    q, k, v = offset_inputs(*shape, offset=2.0, seed=seed)
    q_int, _ = quantize_per_block(q, 128, 8)
    k_int, _ = quantize_per_block(k, 64, 8)
    fns = {name: (lambda f=attention_fn(o): f(q, k, v, True)) for name, o in variants.items()}
    fns.update({"float32": lambda: q @ k.transpose(-2, -1), "int8": lambda: int_matmul(q_int, k_int)})
    with torch.inference_mode():
        times = iu.time_round_robin(fns, "cpu", warmup=1, repeats=repeats)
    return {name: iu.median(ts) * 1e3 for name, ts in times.items()}


def run_checks(n_heads, d_head, seed):
    """The smoothing invariance (exact attention of K and of K - mean(K)) and _int_mm against an int64 product:
    ({check: ok}, the smoothing's max |difference|)."""
    q, k, v = offset_inputs(2, n_heads, 100, d_head, offset=8.0, seed=seed)
    smooth = (exact_attention(q, k - k.mean(-2, keepdim=True), v) - exact_attention(q, k, v)).abs().max().item()
    a, b = quantize_per_block(q, 16, 8)[0], quantize_per_block(k, 16, 8)[0]
    int_ok = torch.equal(int_matmul(a, b).long(), a.long() @ b.long().transpose(-2, -1))
    return {f"smoothing leaves exact attention unchanged (max |diff| {smooth:.1e}, atol {ATOL})": smooth <= ATOL,
            "the INT8 product equals the int64 one": int_ok}, smooth


def model_rows(model, data, prompts, n_tokens, offset, val_batches, seed, seqlen):
    """Per variant: errors on random offset inputs and on the model's own Q, K, V (the worst layer),
    validation loss and greedy-token agreement with the variant in every layer."""
    H, D = model.config.n_heads, model.config.d_head
    q, k, v = offset_inputs(4, H, seqlen, D, offset, seed)
    x = corpus.get_batch(data.val, 8, seqlen, torch.Generator().manual_seed(seed + 1))[0].to(prompts.device)
    layers = capture_qkv(model, x)
    ref_tokens = generate_kvcache(model, prompts, n_tokens, seqlen)[:, prompts.shape[1]:]
    rows = []
    for name, options in VARIANTS.items():
        attention = attention_fn(options)
        with torch.inference_mode():
            random = errors(attention(q, k, v, False), exact_attention(q, k, v, causal_mask=False))  # as the listing
            real = [errors(attention(*qkv, True), exact_attention(*qkv)) for qkv in layers]  # causal, per layer
        variant = model if options is None else use_attention(copy.deepcopy(model), attention)
        tokens = generate_kvcache(variant, prompts, n_tokens, seqlen)[:, prompts.shape[1]:]
        figures = dict(cos_random=f"{random[0]:.5f}", rel_l1_random=f"{random[1]:.1e}",  # model: the worst layer
                       cos_model=f"{min(c for c, _ in real):.5f}", rel_l1_model=f"{max(e for _, e in real):.1e}")
        if options is None:  # the reference itself
            figures = dict.fromkeys(figures)
        rows.append(harness.make_row(name, val_loss=training.validation_loss(variant, data, n_batches=val_batches),
                                **figures,
                                token_agreement=(tokens == ref_tokens).float().mean().item(),
                                first_diff=first_difference(tokens, ref_tokens),
                                qk_bytes=round(qk_bytes(options, D, 128, 64, model.fc_out.weight.element_size()), 2)))
    k_offset = max((kk.mean(-2).norm(dim=-1) / (kk - kk.mean(-2, keepdim=True)).norm(dim=-1).mean(-1)).max().item()
                   for _, kk, _ in layers)
    return rows, k_offset


def first_difference(tokens, ref_tokens):
    """Median over the prompts of the greedy tokens generated before the first that differs (all: none differs):
    after one token differs, the two texts go their own ways, and agreement position by position drops."""
    first = [row.nonzero()[0].item() if row.any() else len(row) for row in tokens != ref_tokens]
    return iu.median(first)


def plot(rows, title):
    """Each variant's relative L1 error, and its validation loss against float32's: the figure."""
    fig, (ax_err, ax_loss) = harness.new_figure(2)
    names = [r["variant"].split(" (")[0] for r in rows[1:]]
    pos = range(len(names))
    ax_err.bar([p - 0.2 for p in pos], [float(r["rel_l1_random"]) for r in rows[1:]], 0.4, label="random, offset K")
    ax_err.bar([p + 0.2 for p in pos], [float(r["rel_l1_model"]) for r in rows[1:]], 0.4,
               label="GPTlite's Q, K, V (worst layer)")
    ax_err.set(yscale="log", ylabel="relative L1 error against exact attention", title=title)
    ax_loss.bar(pos, [r["val_loss"] - rows[0]["val_loss"] for r in rows[1:]], 0.6, color="tab:red")
    ax_loss.axhline(0, color="gray", linewidth=0.8)
    ax_loss.set(ylabel="validation loss - float32's", title="the model with the variant in every layer")
    for ax in (ax_err, ax_loss):
        ax.set_xticks(list(pos), names, rotation=20, ha="right", fontsize=8)
        ax.grid(True, axis="y", alpha=0.3)
    ax_err.legend(fontsize=8)
    return fig


def headline(rows):
    """The README's row: the loss of INT8 and INT4 against float32's, INT8's error and Q, K bytes."""
    row = {r["variant"]: r for r in rows}
    exact, int8 = row["exact (float32)"], row["INT8 + smooth K (SageAttention)"]
    int4 = row["INT4 + smooth Q, K (SageAttention2-style)"]
    smaller = iu.ratio(exact["qk_bytes"], int8["qk_bytes"])
    return dict(technique="SageAttention: INT8 Q and K per block, K smoothed; INT4 (SageAttention2-style)",
                figure=f"val loss {int8['val_loss'] - exact['val_loss']:+.4f} (INT8), "
                       f"{int4['val_loss'] - exact['val_loss']:+.4f} (INT4) against float32; relative L1 on the "
                       f"model's Q, K, V {int8['rel_l1_model']} (INT8); Q and K bytes "
                       f"{'-' if smaller is None else f'{smaller:.1f}x'} smaller than float32's")


def attention_methods(rows, ms, bench_len):
    """The summary of attention methods' rows (lib/attention_summary.py): INT8 and INT4 against float32."""
    row = {r["variant"]: r for r in rows}
    exact = row["exact (float32)"]
    pays = (f"INT8 Q K^T {ms['float32'] / ms['int8']:.1f}x faster at {bench_len:,} tokens" if ms["int8"] < ms["float32"]
            else f"not on this CPU: INT8 Q K^T {ms['int8']:.3g} ms against float32's {ms['float32']:.3g} ms at "
                 f"{bench_len:,} tokens (GPU INT8 tensor cores are where it pays)")
    return [attention_summary.method_row(
        name, False, f"relative L1 {r['rel_l1_model']} on the model's Q, K, V; val loss "
        f"{r['val_loss'] - exact['val_loss']:+.4f}", 0, "none", "Q and K bytes (and on a GPU the Q K^T time)",
        f"{exact['qk_bytes'] / r['qk_bytes']:.1f}x fewer", pays)
        for name, r in ((label, row[variant]) for label, variant in (
            ("SageAttention (INT8 Q, K)", "INT8 + smooth K (SageAttention)"),
            ("SageAttention2-style (INT4 Q, K)", "INT4 + smooth Q, K (SageAttention2-style)")))]


def parse_args(argv):
    """The flags, checked before any work: (args, preset, device, data)."""
    parser = harness.script_parser(__doc__)
    at_least = harness.int_at_least
    parser.add_argument("--val-batches", type=harness.batches, default=10,
                        help="validation batches (of 32 x seqlen) for the loss")
    harness.add_generation_flags(parser, batch_size=8, prompt_len=32, n_tokens=96, repeats=5, least_tokens=1)
    parser.add_argument("--offset", type=harness.float_in(0.0, 1000.0), default=5.0,
                        help="std of the per-channel offset added to K in the random inputs (K itself is N(0, 1))")
    parser.add_argument("--bench-len", type=at_least(1), default=2048,
                        help="tokens of the timed attention (batch 1, the model's heads, causal)")
    args = parser.parse_args(argv)

    def check_args(preset):
        H, D = preset.n_heads, preset.d_head
        harness.check_fits(parser, "--batch-size", ab.generation_bytes(preset, args.batch_size, preset.seqlen),
                           "the token agreement's prompts")
        harness.check_fits(parser, "--n-tokens", ab.generation_bytes(preset, args.batch_size,
                                                                     args.prompt_len + args.n_tokens),
                           "the generated tokens")
        # the variants hold the float32 scores and their softmax, plus copies of Q, K, V (quantized, smoothed)
        harness.check_fits(parser, "--bench-len", 2 * ab.benchmark_bytes([args.bench_len], 1, H, D),
                           "the timed attention's scores")
    return (args, *harness.setup(args, parser, check_args))


def main(argv=None):
    args, preset, device, data = parse_args(argv)
    if device.type != "cpu":
        print("note: the checks and errors run on the device; the INT8 timing runs on the CPU (torch._int_mm)")
    checks, smooth_diff = run_checks(preset.n_heads, preset.d_head, args.seed)
    harness.require_checks(checks)
    model = iu.load_model(GPTlite_KVCache, preset, device, data, untrained=args.untrained, seed=args.seed)
    prompts = corpus.sample_prompts(data, args.batch_size, args.prompt_len, seed=args.seed, device=device)
    rows, k_offset = model_rows(model, data, prompts, args.n_tokens, args.offset, args.val_batches, args.seed,
                                preset.seqlen)
    ms = time_variants(VARIANTS, (1, preset.n_heads, args.bench_len, preset.d_head), args.repeats, args.seed)
    fast_int8 = ms["int8"] < ms["float32"]
    for row in rows:
        row["attn_ms"] = ms[row["variant"]]
        row["qk_ms"] = ms["int8"] if "INT" in row["variant"] else ms["float32"]
    print(f"\nerrors against exact attention on random q, k, v with a per-channel K offset of std {args.offset} "
          f"(non-causal, as the listing) and on the model's own Q, K, V (causal, worst layer); loss on "
          f"{args.val_batches} validation batches; {args.batch_size} x {args.n_tokens} greedy tokens (first_diff: "
          f"median tokens before the first difference); qk_bytes per token and head; ms: batch 1, {preset.n_heads} "
          f"heads, {args.bench_len} tokens, median of {args.repeats}, CPU")
    pv = str(pv_dtype(device)).removeprefix("torch.")
    summary = [f"smoothing invariance: exact attention of K and of K - mean(K) differ by {smooth_diff:.1e}",
               f"the model's keys: the mean over tokens is up to {k_offset:.2f}x the tokens' own spread (one head)",
               f"P.V in {pv}; Q K^T alone: INT8 (torch._int_mm, one call per head) {ms['int8']:.2f} ms against float32 "
               f"{ms['float32']:.2f} ms at {args.bench_len} tokens: INT8 is {'' if fast_int8 else 'not '}faster here "
               f"(CPU capability {torch.backends.cpu.get_cpu_capability()}); INT4 runs on the INT8 product (no INT4 "
               "matmul in torch)",
               f"the whole attention: {ms['INT8 + smooth K (SageAttention)']:.1f} ms INT8 + smooth K against "
               f"{ms['exact (float32)']:.1f} ms exact (eager: quantizing is extra passes over Q and K)"]
    title = f"SageAttention variants ({preset.name}, {device.type})"
    harness.report(args, "main_sage_attention.py", preset, device, rows, headline(rows), summary=summary,
                   attention_methods=attention_methods(rows, ms, args.bench_len),
                   plot=lambda: plot(rows, title), smooth_diff=smooth_diff, k_offset=k_offset,
                   int8_qk_ms=ms["int8"], float32_qk_ms=ms["float32"], bench_len=args.bench_len, pv_dtype=pv,
                   checks=checks)


if __name__ == "__main__":
    harness.run(main)
