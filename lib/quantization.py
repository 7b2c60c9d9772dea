"""Weight, activation and KV-cache quantization of GPTlite (part 2 of the post: quantization).

Weights (every Linear of the blocks; the embeddings and the head stay float32):
- round to nearest (RTN): int8 symmetric per output channel; int4 asymmetric per group of `group_size`
  input columns (gpt-fast's convention: w = (q - 8) * scale + zero, q in 0..15);
- GPTQ (Frantar et al.): the columns quantized one after the other, each one's rounding error spread over
  the columns not yet quantized through the inverse Hessian of the layer's inputs (H = 2 X^T X), group
  scales taken when a group starts;
- AWQ (Lin et al.): a per-input-channel scale s = mean|x|^alpha, alpha searched on a grid to minimise the
  layer's output error; the weight is quantized as W * s and the input divided by s.
QuantLinear runs the quantized weight two ways with the same result: dequantize then matmul (plain
PyTorch), or ATen's packed CPU kernels (`_weight_int8pack_mm`, `_weight_int4pack_mm_for_cpu`).

Activations: W8A8 in SmoothQuant's way (Xiao et al.): s_j = max|X_j|^alpha / max|W_j|^(1-alpha) moves the
activations' outlier channels into the weights, folded into the LayerNorm before the query/key/value and
the first MLP projections; then int8 activations per token and int8 weights per channel, multiplied with
`torch._int_mm` (int32 accumulation). FP8 (e4m3, per-row scales) is emulated: quantized and dequantized in
float32, a numerics row (this CPU has no FP8 matmul).

KV cache: KIVI (Liu et al.): keys quantized per channel (over a block of tokens), values per token, 2 or 4
bits, the most recent tokens kept in float32 until a block fills (`KIVICache`, through the cache interface).
"""
import copy
import io
import math
import types

import torch
import torch.nn as nn
import torch.nn.functional as F

from gptlite_kvcache import KVCache

WEIGHT_BITS = (4, 8)
KV_BITS = (2, 4, 8)
FP8_MAX = 448.0  # the largest float8_e4m3fn


def check_group(width, group_size):
    """A group of input columns must divide the layer's width."""
    if not isinstance(group_size, int) or group_size < 1 or width % group_size:
        divisors = [g for g in (16, 32, 64, 128, 256) if width % g == 0]
        raise ValueError(f"group size {group_size!r} does not divide the width {width}; use one of {divisors}")


def check_bits(bits, allowed):
    if bits not in allowed:
        raise ValueError(f"{bits} bits is not supported here; choose one of {allowed}")


# ----------------------------------------------------------------------------------------------------
# Round to nearest, and the two packed forms.

def quantize_int8(w):
    """Symmetric int8 per output row: w [N, K] -> q int8 [N, K], scale [N]."""
    scale = w.abs().amax(dim=1).clamp(min=1e-8) / 127
    return torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8), scale


def int4_params(w):
    """Asymmetric int4 parameters of groups w [..., G] (one group per row): scale and zero, [...]."""
    lo, hi = w.amin(dim=-1), w.amax(dim=-1)
    scale = ((hi - lo) / 15).clamp(min=1e-8)
    return scale, lo + 8 * scale  # w = (q - 8) * scale + zero with q in 0..15


def quantize_int4_group(w, scale, zero):
    """Columns w [N, G] of one group with their [N] parameters -> q in 0..15 (int32)."""
    return torch.round((w - zero[:, None]) / scale[:, None] + 8).clamp(0, 15).to(torch.int32)


def quantize_int4(w, group_size):
    """int4 per group of `group_size` input columns: q int32 [N, K] in 0..15, scale and zero [N, K/G]."""
    N, K = w.shape
    check_group(K, group_size)
    groups = w.reshape(N, K // group_size, group_size)
    scale, zero = int4_params(groups)
    q = torch.round((groups - zero[..., None]) / scale[..., None] + 8).clamp(0, 15).to(torch.int32)
    return q.reshape(N, K), scale, zero


def dequantize(q, scale, zero=None, group_size=None):
    """The float weight of an int8 (zero None) or int4 quantized one."""
    if zero is None:
        return q.float() * scale[:, None]
    N, K = q.shape
    return ((q.reshape(N, K // group_size, group_size).float() - 8) * scale[..., None] + zero[..., None]).reshape(N, K)


def pack(q, bits):
    """Values in 0..2^bits-1 (uint8) [..., n] -> 8/bits of them a byte [..., n * bits / 8]."""
    per = 8 // bits
    q = q.reshape(*q.shape[:-1], -1, per)
    return sum(q[..., i] << (bits * i) for i in range(per)).to(torch.uint8)


def unpack(p, bits):
    per, mask = 8 // bits, (1 << bits) - 1
    return torch.stack([(p >> (bits * i)) & mask for i in range(per)], dim=-1).reshape(*p.shape[:-1], -1)


class QuantLinear(nn.Module):
    """A Linear with an int8 (per channel) or int4 (per group) weight, and an optional input scale (AWQ:
    x / s). kernel=True: ATen's packed CPU matmuls (the int4 codes in the kernel's own packed layout);
    False: the codes packed two a byte by `pack`, dequantized, then F.linear. Either stores half a byte per
    int4 weight, one per int8 weight, and float32 scales (and zeros)."""

    def __init__(self, linear, q, scale, zero=None, group_size=None, input_scale=None, kernel=True):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.bits = 8 if zero is None else 4
        self.group_size, self.kernel = group_size, kernel
        if self.bits == 8:
            self.register_buffer("q", q)  # [N, K] int8: _weight_int8pack_mm's layout as it is
        elif kernel:  # packed by ATen, scales and zeros [K/G, N, 2]
            self.register_buffer("q", torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 2))
            self.register_buffer("scales_and_zeros", torch.stack([scale.t(), zero.t()], dim=-1).contiguous())
        else:
            self.register_buffer("q", pack(q.to(torch.uint8), 4))  # [N, K/2]
        self.register_buffer("scale", scale if self.bits == 8 or not kernel else None)
        self.register_buffer("zero", zero if not kernel else None)
        self.register_buffer("input_scale", input_scale)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())

    def kernel_form(self):
        """This layer run by ATen's packed kernels: the same codes, scales and zeros."""
        if self.kernel:
            return self
        codes = self.q if self.bits == 8 else unpack(self.q, 4).to(torch.int32)
        shape = types.SimpleNamespace(in_features=self.in_features, out_features=self.out_features, bias=self.bias)
        return QuantLinear(shape, codes, self.scale, self.zero, self.group_size, self.input_scale, kernel=True)

    def weight(self):
        """The dequantized weight [N, K] (not for the int4 kernel's packed layout)."""
        if self.bits == 8:
            return dequantize(self.q, self.scale)
        if self.kernel:
            raise ValueError("the int4 kernel's packed weight is read by the kernel only; build with kernel=False")
        return dequantize(unpack(self.q, 4).to(torch.int32), self.scale, self.zero, self.group_size)

    def forward(self, x):
        if self.input_scale is not None:
            x = x / self.input_scale
        if not self.kernel:
            return F.linear(x, self.weight(), self.bias)
        flat = x.reshape(-1, self.in_features)
        if self.bits == 8:
            y = torch.ops.aten._weight_int8pack_mm(flat, self.q, self.scale)
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self.q, self.group_size, self.scales_and_zeros)
        y = y.reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias


def rtn(linear, bits, group_size, kernel=True):
    w = linear.weight.detach()
    if bits == 8:
        return QuantLinear(linear, *quantize_int8(w), kernel=kernel)
    return QuantLinear(linear, *quantize_int4(w, group_size), group_size=group_size, kernel=kernel)


# ----------------------------------------------------------------------------------------------------
# GPTQ and AWQ: a layer's weight quantized with its calibration inputs X [n, K] in view.

def gptq(linear, X, bits, group_size, damp=0.01, kernel=True):
    """GPTQ's column-by-column quantization (no act-order): the error of column i, divided by the inverse
    Hessian's diagonal, is subtracted from the later columns in proportion to its row of the inverse."""
    W = linear.weight.detach().clone().double()  # [N, K]
    N, K = W.shape
    H = 2 * X.double().t() @ X.double()  # [K, K]
    dead = torch.diag(H) == 0  # an input that is always 0: its column does not matter
    H[dead, dead] = 1
    W[:, dead] = 0
    H += damp * torch.diag(H).mean() * torch.eye(K, dtype=H.dtype)
    Hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)  # [K, K]
    Q = torch.zeros_like(W)
    scales, zeros = [], []
    if bits == 8:
        scale = W.abs().amax(dim=1).clamp(min=1e-8) / 127  # per channel: taken once, before the updates
    for i in range(K):
        w = W[:, i]
        if bits == 8:
            q = torch.round(w / scale).clamp(-127, 127) * scale
        else:
            if i % group_size == 0:  # a group's parameters from its columns as they are now
                scale, zero = int4_params(W[:, i:i + group_size])
                scales.append(scale)
                zeros.append(zero)
            q = (quantize_int4_group(w[:, None], scale, zero)[:, 0] - 8) * scale + zero
        Q[:, i] = q
        err = (w - q) / Hinv[i, i]
        W[:, i + 1:] -= err[:, None] * Hinv[i, i + 1:][None, :]
    if bits == 8:
        return QuantLinear(linear, torch.round(Q / scale[:, None]).to(torch.int8), scale.float(), kernel=kernel)
    scale, zero = torch.stack(scales, 1).float(), torch.stack(zeros, 1).float()  # [N, K/G]
    q = torch.round((Q.float().reshape(N, K // group_size, group_size) - zero[..., None]) / scale[..., None] + 8)
    return QuantLinear(linear, q.clamp(0, 15).to(torch.int32).reshape(N, K), scale, zero, group_size, kernel=kernel)


def awq(linear, X, bits, group_size, grid=20, kernel=True):
    """AWQ's scale search: s = mean|x|^alpha per input channel (normalised), alpha in [0, 1] on a grid; the
    alpha whose quantized (W * s, x / s) gives the smallest output error on X is kept."""
    W = linear.weight.detach()
    x_mean = X.abs().mean(dim=0).clamp(min=1e-8)  # [K]
    reference = X @ W.t()
    best = (math.inf, None)
    for alpha in torch.linspace(0, 1, grid + 1).tolist():
        s = x_mean ** alpha
        s = s / (s.max() * s.min()).sqrt()  # around 1, so that neither W * s nor x / s runs away
        layer = rtn(with_weight(linear, W * s), bits, group_size, kernel=False)
        err = ((X / s) @ layer.weight().t() - reference).pow(2).mean().item()
        best = min(best, (err, s), key=lambda b: b[0])
    q = rtn(with_weight(linear, W * best[1]), bits, group_size, kernel)
    q.input_scale = best[1]
    return q


def with_weight(linear, weight):
    """A new Linear with `weight` and `linear`'s bias (`linear` itself unchanged)."""
    new = nn.Linear(linear.in_features, linear.out_features, bias=linear.bias is not None)
    new.weight.data = weight
    if linear.bias is not None:
        new.bias.data = linear.bias.detach().clone()
    return new


# ----------------------------------------------------------------------------------------------------
# Activations: SmoothQuant's W8A8, and FP8 emulated.

def quantize_per_token(x):
    """Symmetric int8 per row of x [M, K]: q int8, scale [M, 1] (the dynamic activation quantization)."""
    scale = x.abs().amax(dim=-1, keepdim=True).clamp(min=1e-8) / 127
    return torch.round(x / scale).clamp(-127, 127).to(torch.int8), scale


class W8A8Linear(nn.Module):
    """int8 activations per token x int8 weights per output channel, int32 accumulation (torch._int_mm)."""

    def __init__(self, linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        q, scale = quantize_int8(linear.weight.detach())
        self.register_buffer("q_t", q.t().contiguous())  # [K, N]: _int_mm's right operand
        self.register_buffer("scale", scale)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())

    def forward(self, x):
        xq, xs = quantize_per_token(x.reshape(-1, self.in_features))
        y = torch._int_mm(xq, self.q_t).float() * xs * self.scale  # [M, N]: int32 sums, rescaled once
        y = y.reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias


def smooth(ln, linears, x_absmax, alpha=0.5):
    """SmoothQuant's migration for the Linears that read LayerNorm `ln`'s output: divide the output channel
    j of `ln` by s_j and multiply input column j of each Linear by s_j (the same function, smoother inputs)."""
    w_absmax = torch.stack([l.weight.detach().abs().amax(dim=0) for l in linears]).amax(dim=0)  # [K]
    s = (x_absmax.clamp(min=1e-5) ** alpha / w_absmax.clamp(min=1e-5) ** (1 - alpha)).clamp(min=1e-5)
    with torch.no_grad():
        ln.weight /= s
        ln.bias /= s
        for l in linears:
            l.weight *= s
    return s


def fake_fp8(x):
    """x quantized to float8 e4m3 with one scale per row (amax / 448) and back to float32."""
    scale = x.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / FP8_MAX
    return (x / scale).to(torch.float8_e4m3fn).float() * scale


class FP8Linear(nn.Module):
    """e4m3 weights (per output row) and activations (per token), emulated in float32."""

    def __init__(self, linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("weight", fake_fp8(linear.weight.detach()))  # emulated: stored as float32
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())

    def forward(self, x):
        return F.linear(fake_fp8(x), self.weight, self.bias)


# ----------------------------------------------------------------------------------------------------
# The model: every Linear of the blocks replaced, in order, each seeing the calibration inputs that the
# layers before it (already quantized) give it.

def block_linears(model):
    """[(module that holds it, attribute name, Linear)] in forward order: the attention's projections, then
    the MLP's two layers, block by block."""
    out = []
    for block in model.blocks:
        out += [(block.mha, name, getattr(block.mha, name)) for name in ("query_proj", "key_proj", "value_proj",
                                                                          "out_proj")]
        out += [(block.ffwd.net, str(i), block.ffwd.net[i]) for i in (0, 2)]
    return out


@torch.no_grad()
def layer_inputs(model, module, calibration):
    """The inputs [n, K] that `module` receives when `model` runs the calibration windows [B, S]."""
    seen = []
    handle = module.register_forward_hook(lambda m, args, out: seen.append(args[0].reshape(-1, args[0].shape[-1])))
    try:
        model(calibration)
    finally:
        handle.remove()
    return torch.cat(seen)


@torch.no_grad()
def quantize_model(model, method, bits=8, group_size=32, calibration=None, kernel=True, alpha=0.5):
    """A copy of `model` (a GPTlite_KVCache) with every Linear of its blocks quantized by `method`: "rtn",
    "gptq", "awq" (weight-only, `bits` 8 or 4 with `group_size`), "w8a8" (SmoothQuant with `alpha`; None: no
    smoothing), "fp8" (emulated). GPTQ, AWQ and SmoothQuant read `calibration` windows [B, S]."""
    check_bits(bits, WEIGHT_BITS)
    if method in ("gptq", "awq", "w8a8") and calibration is None:
        raise ValueError(f"{method} needs calibration windows")
    model = copy.deepcopy(model).eval()
    if bits == 4 and method in ("rtn", "gptq", "awq"):
        for _, _, linear in block_linears(model):
            check_group(linear.in_features, group_size)
    if method == "w8a8" and alpha is not None:
        for block in model.blocks:
            qkv = [block.mha.query_proj, block.mha.key_proj, block.mha.value_proj]
            smooth(block.ln1, qkv, layer_inputs(model, block.mha.query_proj, calibration).abs().amax(0), alpha)
            smooth(block.ln2, [block.ffwd.net[0]], layer_inputs(model, block.ffwd.net[0], calibration).abs().amax(0),
                   alpha)
    for parent, name, linear in block_linears(model):
        if method == "rtn":
            new = rtn(linear, bits, group_size, kernel)
        elif method in ("gptq", "awq"):
            X = layer_inputs(model, linear, calibration)  # through the layers quantized so far
            new = (gptq if method == "gptq" else awq)(linear, X, bits, group_size, kernel=kernel)
        elif method == "w8a8":
            new = W8A8Linear(linear)
        elif method == "fp8":
            new = FP8Linear(linear)
        else:
            raise ValueError(f"unknown method {method!r}")
        setattr(parent, name, new)
    return model


def with_kernels(model):
    """A copy of a quantize_model(..., kernel=False) model whose QuantLinears run the packed kernels."""
    model = copy.deepcopy(model)
    for parent, name, layer in block_linears(model):
        if isinstance(layer, QuantLinear):
            setattr(parent, name, layer.kernel_form())
    return model


def serialized_bytes(model):
    """Bytes of the model's state dict as torch.save writes it: what the weights take on disk and to load,
    whatever their form (float32, our int8 and int4 buffers, torchao's tensor subclasses)."""
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    return buffer.tell()


# ----------------------------------------------------------------------------------------------------
# KIVI: the KV cache in 2 or 4 bits.

def quantize_asym(x, bits, dim):
    """Asymmetric quantization of x along `dim` (min and max over it): packed codes, scale, minimum."""
    lo, hi = x.amin(dim=dim, keepdim=True), x.amax(dim=dim, keepdim=True)
    scale = ((hi - lo) / (2**bits - 1)).clamp(min=1e-8)
    q = torch.round((x - lo) / scale).clamp(0, 2**bits - 1).to(torch.uint8)
    return pack(q, bits), scale, lo


def dequantize_asym(packed, scale, lo, bits, shape):
    return unpack(packed, bits)[..., :shape[-1]].reshape(shape).float() * scale + lo


def check_kivi_rollback(n, n_quantized, block):
    """A KIVI cache keeps no float values of a block once it is quantized: a rollback to n tokens must not fall
    inside one (n a multiple of `block`, or at least the n_quantized tokens of the full blocks)."""
    if n < n_quantized and n % block:
        raise ValueError(f"KIVI cannot roll back to {n} tokens: token {n} is inside a block already quantized "
                         f"(blocks of {block}); keep a multiple of {block}, or at least {n_quantized}")


class KIVICache(KVCache):
    """Per layer: quantized blocks of `block` tokens (keys per channel: min and max over the block's tokens;
    values per token: over its channels) and a float32 residual of the latest tokens, quantized once it holds a
    whole block. Attention reads the blocks dequantized and the residual as it is. No window: at most
    `max_seqlen` tokens."""

    def __init__(self, n_layers, bits, block=32, max_seqlen=None):
        check_bits(bits, KV_BITS)
        self.bits, self.block, self.max_seqlen = bits, block, max_seqlen
        self.blocks = [[] for _ in range(n_layers)]  # (keys (packed, scale, lo), values (...)) per block
        self.residual = [None] * n_layers  # (keys, values) [B, H, r, D], r < block
        self.n_tokens = 0

    def __len__(self):
        return self.n_tokens

    def check_new_tokens(self, T):
        if self.max_seqlen is not None and self.n_tokens + T > self.max_seqlen:
            raise ValueError(f"{self.n_tokens} cached + {T} new tokens exceed the window of {self.max_seqlen}")

    def update(self, layer, k, v):
        res = self.residual[layer]
        k, v = (k, v) if res is None else (torch.cat([res[0], k], 2), torch.cat([res[1], v], 2))
        n_full = k.shape[2] // self.block * self.block
        for start in range(0, n_full, self.block):
            kb, vb = k[:, :, start:start + self.block], v[:, :, start:start + self.block]  # [B, H, block, D]
            self.blocks[layer].append((quantize_asym(kb, self.bits, dim=2), quantize_asym(vb, self.bits, dim=3)))
        self.residual[layer] = (k[:, :, n_full:], v[:, :, n_full:])
        return (*self.dequantized(layer), None)

    def dequantized(self, layer):
        """The keys and values [B, H, n, D] of `layer` as attention reads them: the blocks dequantized, then the
        float32 residual."""
        B, H, _, D = self.residual[layer][0].shape
        shape = (B, H, self.block, D)
        keys = [dequantize_asym(*kq, self.bits, shape) for kq, _ in self.blocks[layer]] + [self.residual[layer][0]]
        values = [dequantize_asym(*vq, self.bits, shape) for _, vq in self.blocks[layer]] + [self.residual[layer][1]]
        return torch.cat(keys, 2), torch.cat(values, 2)

    def truncate(self, n):
        """Keep tokens 0 .. n-1 (a rollback, as speculative decoding's): the blocks before n and the residual's
        tokens before n. A block already quantized keeps no float values, so n must not fall inside one."""
        self.check_truncate(n)
        n_quantized = len(self.blocks[0]) * self.block
        check_kivi_rollback(n, n_quantized, self.block)
        keep = min(n, n_quantized) // self.block
        for layer, res in enumerate(self.residual):
            self.blocks[layer] = self.blocks[layer][:keep]
            if res is not None:
                start = keep * self.block  # the residual's first token
                self.residual[layer] = tuple(t[:, :, :max(n - start, 0)] for t in res) if n >= n_quantized else (
                    res[0][:, :, :0], res[1][:, :, :0])
        self.n_tokens = n

    @property
    def nbytes(self):
        """Bytes held: the packed codes, their scales and minimums, and the float32 residual."""
        total = 0
        for blocks, res in zip(self.blocks, self.residual):
            total += sum(t.nbytes for kq, vq in blocks for t in (*kq, *vq))
            total += 0 if res is None else res[0].nbytes + res[1].nbytes
        return total
