"""The repository's fast decode path on a CPU: GPTlite's cached forward pass as one C++ call.

Blog: part 2 ("kernel fusion and compilers"), the limit that compilers approach. At the cpu preset one
decoding step is about 1.7 MFLOP over 3.3 MB of weights, tens of microseconds of arithmetic, and eager
PyTorch spends about 2 ms on it in 666 operator calls. lib/fast_decode.cpp runs a whole step (all the
blocks, the final LayerNorm, the head) as one function over the model's own weight tensors, and
`generate_fast` runs the greedy token loop in C++ too. It is built on first use with the machine's C++
compiler (torch.utils.cpp_extension; about a minute, once) and threads follow torch.set_num_threads.

    native = native_view(model)                 # a GPTlite_KVCache whose cached pass is the C++ one
    native.forward_cache(idx, cache)            # logits [B, T, V] through a StaticKVCache, as eager
    generate_fast(model, prompt, n_tokens, seqlen)   # == generate_kvcache(model, prompt, n_tokens, seqlen)

`native_view` shares the model's modules (its linear weights packed once, a copy: a view made before
the weights change computes the old ones) and keeps the cached interface
(`hidden_states`, `forward_cache`, a StaticKVCache rolled back with `truncate`), so the speculative
decoding loop, its drafts and plain decoding run on it unchanged. The math is the eager model's; only
the order of float sums differs (tests/test_fast_decode.py: logits within 1e-4, the same tokens).
Models: GPTlite, GPTlite_KVCache, GPTlite_GQA (pruned ones too: every block of one shape), float32 on the CPU;
the blocks' linear layers may be lib/quantization.QuantLinear, int8 per channel or int4 per group (RTN or
GPTQ): the kernel then reads their codes, a quarter or an eighth of the bytes, and applies the scales to sums;
`native_view(model, torch.bfloat16)` stores the blocks' float weights in bfloat16 (half the bytes, float32 sums).
`linear(x, packed(w), scale, b)` is the kernel of one linear layer on its own. `PackedKIVICache` is a KIVI cache
(4 or 2 bits) laid out for the kernel: `forward_cache` through it attends over the codes, dequantizing nothing.
"""
import copy
import functools
import pathlib
import sys

import torch
import torch.nn as nn

from gptlite import GPTlite, Block, MultiHeadAttention, FeedForward, check_generation_args, decode_loop, window_step
from gptlite_kvcache import (GPTlite_KVCache, Block_KVCache, KVCache, MultiHeadAttention_KVCache, StaticKVCache,
                             cached_heads, kv_cache_view)
from gptlite_gqa import GPTlite_GQA, MultiHeadAttention_GQA
from lib.errors import GPTliteError
from lib import quantization as qz
from lib.quantization import QuantLinear
from lib.harness import PATHS, compiler_problem  # the decode paths a script times its technique on (its --paths)

SOURCE = pathlib.Path(__file__).with_name("fast_decode.cpp")
MODELS = (GPTlite, GPTlite_KVCache, GPTlite_GQA)  # exactly these classes: a subclass may change the math
BLOCKS = (Block, Block_KVCache)
ATTENTION = (MultiHeadAttention, MultiHeadAttention_KVCache, MultiHeadAttention_GQA)


def check_compiler():
    """A clear error, before any work, where the extension cannot be built."""
    problem = compiler_problem()
    if problem:
        raise GPTliteError(problem)


@functools.cache
def extension():
    """The compiled module (built on first use; later calls in this process reuse it, and later processes
    reuse torch's build directory unless the source changed)."""
    check_compiler()
    from torch.utils import cpp_extension
    print(f"fast decode path: loading {SOURCE.name} (built once per machine, about a minute) ...", file=sys.stderr)
    try:
        return cpp_extension.load(name="gptlite_fast_decode", sources=[str(SOURCE)],
                                  extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"])
    except (RuntimeError, OSError) as error:  # a compiler error: its output is above
        raise GPTliteError(f"building {SOURCE} failed ({str(error).splitlines()[0]}); "
                           "the compiler's output is above") from error


def check_model(model):
    """The models the kernel computes exactly: GPTlite's architecture (MHA or GQA), float32 (the blocks' linear
    layers float32 or int8 per channel, see linear_parts), on the CPU."""
    blocks = getattr(model, "blocks", ())
    if (type(model) not in MODELS or any(type(b) not in BLOCKS or type(b.mha) not in ATTENTION
                                         or type(b.ffwd) is not FeedForward for b in blocks)):
        raise ValueError(f"the fast decode path computes GPTlite, GPTlite_KVCache and GPTlite_GQA; got a "
                         f"{type(model).__name__}: use its eager path (generate_kvcache)")
    if type(model.fc_out) is not nn.Linear:
        raise ValueError("the fast decode path reads the head as a float32 nn.Linear: use the eager path")
    p = model.fc_out.weight
    if p.device.type != "cpu" or p.dtype != torch.float32:
        raise ValueError(f"the fast decode path is float32 on the CPU; the model is {p.dtype} on {p.device}: "
                         "use model.float().cpu(), or the compiled rows on a GPU")


PANEL = 32  # columns per weight panel of lib/fast_decode.cpp (kPanel)


def packed(weight):
    """A linear weight [N, K] (float32, or int8 codes) as lib/fast_decode.cpp reads it: panels of 32 output
    columns, each [K, 32] and contiguous, the last padded with zeros: [ceil(N / 32), K, 32]."""
    N, K = weight.shape
    wt = torch.zeros(K, -(-N // PANEL) * PANEL, dtype=weight.dtype)
    wt[:, :N] = weight.detach().t()
    return wt.view(K, -1, PANEL).transpose(0, 1).contiguous()


def packed_int4(q, scale, zero):
    """An int4 weight per group of G input columns, W = (q - 8) * scale + zero (lib/quantization.quantize_int4:
    codes q [N, K] in 0..15, scale and zero [N, K/G], G a multiple of 8), as lib/fast_decode.cpp reads it: the
    codes in panels of 32 columns, per eight rows k0 .. k0+7 one 32-bit word per column (row k0 + n in bits
    4n .. 4n+3, little-endian), [ceil(N / 32), K, 16] uint8 (K / 8 blocks of 128 bytes); and per panel and group
    the columns' scales then zero - 8 * scale, [ceil(N / 32), K/G, 2, 32] float32."""
    (N, n_groups), K = scale.shape, q.shape[1]
    if (K // n_groups) % 8:
        raise ValueError(f"the fast path's int4 kernel reads eight rows a word: the group size {K // n_groups} must be "
                         "a multiple of 8 (use --group-size 32), or use the eager path")
    p = packed(q.to(torch.uint8))  # [P, K, 32]
    P = p.shape[0]
    rows = p.view(P, K // 8, 4, 2, PANEL)  # [panel, eight rows, byte m of the word, its nibble, column]
    codes = (rows[:, :, :, 0] | (rows[:, :, :, 1] << 4)).transpose(2, 3).contiguous().view(P, K, PANEL // 2)
    sz = torch.zeros(P * PANEL, 2, n_groups)
    sz[:N, 0], sz[:N, 1] = scale, zero - 8 * scale
    return codes, sz.view(P, PANEL, 2, n_groups).permute(0, 3, 2, 1).contiguous()


def linear_parts(module, dtype=torch.float32):
    """A linear layer as the kernel reads it: (packed weight, its scales or NO_SCALE, bias [N]). nn.Linear: its
    float32 weight, stored in `dtype` (bfloat16: rounded to nearest, half the bytes); a QuantLinear of 8 bits (W = q * scale per output row): its codes and scales; of 4 bits
    (per group, built with kernel=False: the codes readable, not ATen's packed form): packed_int4. Anything
    else (AWQ's input scale, W8A8, FP8) is refused, with what to do."""
    if dtype not in WEIGHT_DTYPES:
        raise ValueError(f"the fast decode path stores float weights in {WEIGHT_DTYPES}, got {dtype}")
    if type(module) is nn.Linear and module.bias is not None:
        return packed(module.weight.to(dtype)), NO_SCALE, module.bias
    if type(module) is QuantLinear and module.input_scale is None and module.bias is not None:
        if module.bits == 8:
            return packed(module.q), module.scale, module.bias
        if not module.kernel:  # int4 codes packed two a byte by lib/quantization.pack
            return (*packed_int4(qz.unpack(module.q, 4), module.scale, module.zero), module.bias)
    raise ValueError(f"the fast decode path computes float32 nn.Linear layers and QuantLinear ones (int8; int4 "
                     f"built with kernel=False), with a bias and no input scale; got a {type(module).__name__}"
                     f"{f' of {module.bits} bits' if hasattr(module, 'bits') else ''}: use the eager path")


def block_linears(block):
    mha, net = block.mha, block.ffwd.net
    return mha.query_proj, mha.key_proj, mha.value_proj, mha.out_proj, net[0], net[2]


def block_tensors(block, dtype=torch.float32):
    """A block's 16 tensors in lib/fast_decode.cpp's order, the linear weights packed (linear_parts, float ones
    stored in `dtype`), and beside them their 16 scale entries."""
    q, k, v, out, ff1, ff2 = (linear_parts(m, dtype) for m in block_linears(block))
    parts = [(block.ln1.weight, NO_SCALE, block.ln1.bias), q, k, v, out, (block.ln2.weight, NO_SCALE, block.ln2.bias),
             ff1, ff2]
    return [t for weight, _, bias in parts for t in (weight, bias)], [t for _, sc, _ in parts for t in (sc, NO_SCALE)]


NO_SCALE = torch.empty(0)  # the scale entry of a float32 tensor
WEIGHT_DTYPES = (torch.float32, torch.bfloat16)  # how the blocks' float linear weights may be stored


def weight_list(model, dtype=torch.float32):
    """The weights in lib/fast_decode.cpp's order: embeddings, 16 tensors per block, final LayerNorm, head,
    and beside them, per tensor, its scales (int8, int4 weights) or an empty tensor. Linear weights are packed
    copies (packed; the blocks' float ones stored in `dtype`, the head float32); the other tensors share the
    model's storage."""
    w, scales = [model.token_embedding.weight, model.position_embedding.weight], [NO_SCALE, NO_SCALE]
    per_block = [block_tensors(block, dtype) for block in model.blocks]  # linear_parts checks each layer
    if len({tuple(t.shape for t in tensors + sc) for tensors, sc in per_block}) > 1:  # the kernel reads block 0's
        raise ValueError("the fast decode path needs every block of one shape (heads, key/value heads, d_ff); "
                         "this model's blocks differ: use its eager path (generate_kvcache)")
    for tensors, block_scales in per_block:
        w, scales = w + tensors, scales + block_scales
    w += [model.ln.weight, model.ln.bias, packed(model.fc_out.weight), model.fc_out.bias]
    scales += [NO_SCALE] * 4
    return [t.detach().contiguous() for t in w], [t.detach().float().contiguous() for t in scales]


def linear(x, weight, scale, bias):
    """x [M, K] @ W^T + bias by the kernel of every linear layer of the fast path: weight packed(W) with scale
    None (float32); packed(q) with q's per-row scales (int8, W = q * scale[:, None]); or packed_int4's pair."""
    return extension().linear(x.float().contiguous(), weight, NO_SCALE if scale is None else scale.float().contiguous(),
                              bias.float().contiguous())


def lanes(codes, bits):
    """Codes [..., 32] in 0..2^bits-1 packed as lib/fast_decode.cpp's widen_codes reads them, [..., 32 * bits / 8]:
    code p in byte p % (32 / P), at bits * (p // (32 / P)) (P = 8 / bits codes a byte)."""
    per = 8 // bits
    groups = codes.to(torch.uint8).view(*codes.shape[:-1], per, 32 // per)
    return sum(groups[..., i, :] << (bits * i) for i in range(per)).to(torch.uint8)


class PackedKIVICache(KVCache):
    """A KIVI cache (lib/quantization.KIVICache's: blocks of 32 tokens quantized to 4 or 2 bits, keys per channel
    and values per token, min and max; the latest partial block in float32, quantized as soon as it fills) in
    preallocated buffers that lib/fast_decode.cpp (KiviKV) writes and reads: the fast path's attention works on
    the codes, never on a dequantized copy. Codes in groups of 32 (`lanes`): a block's keys channel by channel,
    each channel's 32 tokens a group; a token's values 32 channels a group. No window: at most max_seqlen
    tokens."""

    BLOCK = 32  # tokens per block: one group of codes per key channel

    def __init__(self, n_layers, batch_size, n_heads, d_head, max_seqlen, bits, block=BLOCK):
        qz.check_bits(bits, qz.KV_BITS)
        if block != self.BLOCK or d_head % 32:
            raise ValueError(f"the fast path's KIVI kernel reads blocks of {self.BLOCK} tokens and heads a multiple of "
                             f"32 wide; got blocks of {block}, d_head {d_head}: use the eager KIVICache")
        n_blocks, C, D = -(-max_seqlen // block), block, d_head
        heads = (n_layers, batch_size, n_heads, n_blocks)
        self.kq = torch.zeros(*heads, D, C * bits // 8, dtype=torch.uint8)  # [.., block, channel, its tokens' codes]
        self.vq = torch.zeros(*heads, C, D * bits // 8, dtype=torch.uint8)  # [.., block, token, its channels' codes]
        self.ks, self.kl = torch.zeros(*heads, D), torch.zeros(*heads, D)  # keys: per block and channel
        self.vs, self.vl = torch.zeros(*heads, C), torch.zeros(*heads, C)  # values: per token
        self.rk, self.rv = (torch.zeros(n_layers, batch_size, n_heads, C, D) for _ in range(2))  # the residual
        self.bits, self.block, self.max_seqlen, self.n_tokens = bits, block, max_seqlen, 0

    @classmethod
    def for_model(cls, model, batch_size, bits, block=BLOCK, max_seqlen=None):
        c = model.config
        return cls(c.n_layers, batch_size, cached_heads(model.blocks[0].mha), c.d_head, max_seqlen or model.seqlen,
                   bits, block)

    @classmethod
    def from_kivi(cls, kivi, max_seqlen):
        """The entries of a lib/quantization.KIVICache (the same codes, scales and residual) in this layout."""
        (B, H, _, D), L = kivi.residual[0][0].shape, len(kivi.blocks)
        cache = cls(L, B, H, D, max_seqlen, kivi.bits, kivi.block)
        codes = lambda packed: qz.unpack(packed, kivi.bits)[..., :D]  # noqa: E731  [B, H, block, D]
        for layer in range(L):
            for c, ((kq, ks, kl), (vq, vs, vl)) in enumerate(kivi.blocks[layer]):
                cache.kq[layer, :, :, c] = lanes(codes(kq).transpose(2, 3), kivi.bits)  # [B, H, D, tokens]
                cache.vq[layer, :, :, c] = lanes(codes(vq).unflatten(3, (D // 32, 32)), kivi.bits).flatten(3)
                cache.ks[layer, :, :, c], cache.kl[layer, :, :, c] = ks[:, :, 0], kl[:, :, 0]
                cache.vs[layer, :, :, c], cache.vl[layer, :, :, c] = vs[..., 0], vl[..., 0]
            r = kivi.residual[layer]
            cache.rk[layer, :, :, :r[0].shape[2]], cache.rv[layer, :, :, :r[1].shape[2]] = r
        cache.n_tokens = kivi.n_tokens
        return cache

    @property
    def buffers(self):
        return [self.kq, self.ks, self.kl, self.vq, self.vs, self.vl, self.rk, self.rv]

    def __len__(self):
        return self.n_tokens

    def check_new_tokens(self, T):
        if self.n_tokens + T > self.max_seqlen:
            raise ValueError(f"{self.n_tokens} cached + {T} new tokens exceed the KIVI cache's {self.max_seqlen}")

    def truncate(self, n):
        """Keep tokens 0 .. n-1: as KIVICache.truncate, n at a block boundary or inside the float residual."""
        self.check_truncate(n)
        qz.check_kivi_rollback(n, self.n_tokens // self.block * self.block, self.block)
        self.n_tokens = n

    @property
    def nbytes(self):
        """Bytes of the entries held (as KIVICache.nbytes): the full blocks' codes, scales and minimums, and the
        residual's float32 tokens."""
        n_blocks, r = divmod(self.n_tokens, self.block)
        per_block = sum(t[:, :, :, 0].nbytes for t in (self.kq, self.ks, self.kl, self.vq, self.vs, self.vl))
        return n_blocks * per_block + 2 * self.rk[:, :, :, :r].nbytes


class GPTlite_Native(GPTlite_KVCache):
    """A GPTlite_KVCache whose cached forward pass through a StaticKVCache (or a PackedKIVICache) is the C++ one
    (native_view)."""

    def native_pass(self, idx, cache, with_head):
        if isinstance(cache, PackedKIVICache):
            cache.check_new_tokens(idx.shape[1])
            if cache.n_tokens + idx.shape[1] > self.seqlen:
                raise ValueError(f"{cache.n_tokens} cached + {idx.shape[1]} new tokens exceed the model's "
                                 f"{self.seqlen} positions")
            out = extension().forward_kivi(self.weights, self.scales, self.config.n_heads, self.ln.eps,
                                           idx.contiguous(), cache.n_tokens, cache.buffers, cache.bits, with_head)
            cache.advance(idx.shape[1])
            return out
        if not isinstance(cache, StaticKVCache):
            raise ValueError(f"the fast decode path writes a StaticKVCache's or a PackedKIVICache's buffers; got a "
                             f"{type(cache).__name__}: use StaticKVCache.for_model(model, batch_size)")
        cache.check_new_tokens(idx.shape[1])
        T, n, S = idx.shape[1], cache.n_tokens, cache.max_seqlen
        if T > 1 and n + T > S:  # past the window: fill it, then one token at a time (as the eager pass)
            n_fit = max(S - n, 0)
            chunks = ([idx[:, :n_fit]] if n_fit else []) + list(idx[:, n_fit:].split(1, dim=1))
            return torch.cat([self.native_pass(chunk, cache, with_head) for chunk in chunks], dim=1)
        out = extension().forward(self.weights, self.scales, self.config.n_heads, self.ln.eps, idx.contiguous(), n,
                                  cache.keys, cache.values, with_head)
        cache.advance(T)
        return out

    def hidden_states(self, idx, cache):
        return self.native_pass(idx, cache, with_head=False)  # [B, T, d_model]

    def forward_cache(self, idx, cache):
        return self.native_pass(idx, cache, with_head=True)  # [B, T, vocab]


def native_view(model, dtype=torch.float32):
    """`model` (see check_model) as a GPTlite_Native that shares its modules: the cached interface of
    GPTlite_KVCache, computed by lib/fast_decode.cpp on the weights as they are now (weight_list; dtype
    bfloat16: the blocks' float linear weights stored in bfloat16, the sums still float32, which is the model
    with those weights rounded, see rounded_to). Builds the extension if needed. A GPTlite_Native is returned
    as it is."""
    if type(model) is GPTlite_Native:
        return model
    check_model(model)
    weights, scales = weight_list(model, dtype)  # refuses a layer or block shape the kernel does not compute
    extension()
    view = copy.copy(kv_cache_view(model))
    view.__class__ = GPTlite_Native
    view.__dict__["weights"], view.__dict__["scales"] = weights, scales
    return view


def rounded_to(model, dtype):
    """A copy of `model` whose blocks' nn.Linear weights are rounded to `dtype` and back to float32: the eager
    model that native_view(model, dtype) computes (bfloat16 to float32 is exact)."""
    rounded = copy.deepcopy(model)
    with torch.no_grad():
        for block in rounded.blocks:
            for m in block_linears(block):
                if type(m) is nn.Linear:
                    m.weight.copy_(m.weight.to(dtype).float())
    return rounded


def read_sum(x):
    """The sum of a float32 tensor's values by the extension, every thread reading its share once in order:
    time it for the machine's read bandwidth (nbytes / time)."""
    return extension().read_sum(x.float().contiguous())


def on_path(model, path):
    """`model` on a decode path: "eager" as it is (PyTorch operators), "fast" as native_view(model)."""
    if path not in PATHS:
        raise ValueError(f"path must be one of {PATHS}, got {path!r}")
    return model if path == "eager" else native_view(model)


@torch.inference_mode()
def generate_fast(model, prompt, n_tokens, seqlen):
    """Greedy decoding with a KV cache, the whole loop in C++: generate_kvcache's arguments and result,
    the prompt followed by the n_tokens new tokens [B, P + n_tokens] (past seqlen, the window slides).
    model: a model of check_model, or its native_view (made once: the packing of the weights stays out
    of a timed call)."""
    native = native_view(model)
    check_generation_args(native, prompt, n_tokens, seqlen)
    cache = StaticKVCache.for_model(native, prompt.shape[0], seqlen)  # GQA: its groups' heads
    return extension().generate(native.weights, native.scales, native.config.n_heads, native.ln.eps, prompt.contiguous(),
                                n_tokens, cache.keys, cache.values)


@torch.inference_mode()
def generate_no_cache(model, prompt, n_tokens, seqlen):
    """gptlite.generate on the C++ pass: every step re-encodes the last seqlen tokens from an empty cache
    (the baseline of a KV cache on the fast path). Returns [B, P + n_tokens], as generate. model: as
    generate_fast's."""
    native = native_view(model)
    check_generation_args(native, prompt, n_tokens, seqlen)
    forward = lambda window: native.forward_cache(window, StaticKVCache.for_model(model, prompt.shape[0], seqlen))  # noqa: E731
    return torch.cat([prompt, decode_loop(window_step(forward, seqlen), prompt, n_tokens)], dim=1)
