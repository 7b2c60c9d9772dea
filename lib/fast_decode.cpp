// GPTlite's cached forward pass as one C++ call: the repository's fast decode path on a CPU.
//
// Why: at the cpu preset one decoding step is about 1.7 MFLOP over 3.3 MB of weights, tens of
// microseconds of work, while eager PyTorch spends 666 operator calls on it (about 2 ms). Here a whole
// step (all layers, the head and the greedy argmax) is one function with no operator dispatch, no
// intermediate tensors and no Python; generate() runs the token loop in C++ as well.
//
// The math is the eager model's (lib/fast_decode.py passes its weights, the linear ones packed in panels):
// embeddings, per block x += out(attn(ln1(x))), x += W2 relu(W1 ln2(x)), then ln and the head. Only the
// order of the float sums differs (tests/test_fast_decode.py: logits within 1e-4 of the eager model's,
// the same greedy tokens). The cache is a StaticKVCache's buffers [L, B, G, S, D], written in place, as
// StaticKVCache.update writes them: token n goes to slot n % S and attends over slots 0 .. n (all S once
// the buffer has wrapped; its position embedding is then the last one, S - 1, as KVCache.positions).
// G key/value heads serve the H query heads in groups of H/G consecutive heads (GQA; G = H is plain
// multi-head attention). A KIVI cache (KiviKV, lib/fast_decode.py's PackedKIVICache) goes through the same
// blocks(): its attention reads the 4- or 2-bit codes.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <type_traits>
#include <vector>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

constexpr int kPerBlock = 16;  // tensors per block in the weight list (see lib/fast_decode.py)

// Eight floats in one register (a GCC/Clang vector type: AVX2 or AVX-512 code from -march=native).
typedef float v8 __attribute__((vector_size(32)));
inline v8 load8(const float* p) {
  v8 v;
  __builtin_memcpy(&v, p, sizeof v);  // an unaligned load
  return v;
}

// Eight int8 codes widened to eight floats: one sign extension and one conversion on AVX2 (the compilers
// turn a generic vector conversion into eight scalar ones).
inline v8 widen8(const int8_t* p) {
#if defined(__AVX2__)
  return (v8)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
#else
  v8 v;
  for (int i = 0; i < 8; ++i) v[i] = p[i];
  return v;
#endif
}

// Eight bfloat16 values widened to float32, exactly: a bfloat16 is the top half of a float32's bits.
inline v8 widen_bf16(const uint16_t* p) {
#if defined(__AVX2__)
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return (v8)_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
#else
  v8 v;
  for (int i = 0; i < 8; ++i) {
    const uint32_t bits = static_cast<uint32_t>(p[i]) << 16;
    __builtin_memcpy(&v[i], &bits, sizeof bits);
  }
  return v;
#endif
}

constexpr int64_t kPanel = 32;  // columns per weight panel: four vectors of eight

// One row of an int4 panel, 16 bytes (byte j: column j in its low nibble, column j + 16 in its high one),
// as the four vectors of its 32 codes 0..15 in float.
inline void widen4(const uint8_t* p, v8* w) {
#if defined(__AVX2__)
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)), mask = _mm_set1_epi8(0x0F);
  const __m128i lo = _mm_and_si128(v, mask), hi = _mm_and_si128(_mm_srli_epi16(v, 4), mask);
  w[0] = (v8)_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
  w[1] = (v8)_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
  w[2] = (v8)_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
  w[3] = (v8)_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
#else
  for (int c = 0; c < 16; ++c) {
    w[c / 8][c % 8] = p[c] & 0x0F;
    w[2 + c / 8][c % 8] = p[c] >> 4;
  }
#endif
}

// The tile's column sums into y: times each column's scale (none: 1), plus b, ReLU when asked; the
// columns past N (a padded panel) are dropped.
template <int MR>
void store(const v8 (&acc)[MR][4], const float* scale, const float* b, float* y, int64_t N, int64_t n0, bool relu) {
  const int64_t n_cols = std::min(kPanel, N - n0);
  for (int i = 0; i < MR; ++i)
    for (int64_t c = 0; c < n_cols; ++c) {
      const float v = acc[i][c / 8][c % 8] * (scale ? scale[n0 + c] : 1.f) + b[n0 + c];
      y[i * N + n0 + c] = relu && v < 0.f ? 0.f : v;
    }
}

// Rows x [MR, K] times one weight panel [K, 32] (columns n0 .. n0+31, zero past N) plus b, into y: the
// register tile of a matrix product. Per k, four loads of the panel's row serve MR rows of x and each
// x[m, k] (broadcast) four vectors: at MR = 4 that is 8 loads for 16 vector multiply-adds, with no
// horizontal sums, and the panel is read in order, once per MR rows.
// load_row(k, w) puts row k of the panel in four vectors: float32 panels are loaded as they are, bfloat16
// ones widened exactly (half the bytes, the same sums as float32 on the rounded weights); int8 ones
// (the codes q [K, 32] of a per-channel quantized weight, W = q * scale, one scale per output column) are
// read as 8-bit integers and widened to float in registers, a quarter of the float32 panel's bytes, and the
// scale multiplies each column's sum once (store): sum_k x[k] q[k, c] * scale[c] is the dequantized
// product up to the order of the float roundings.
// At one or two rows, 4 or 8 chains of sums would wait on the multiply-add's latency at every k: even and odd
// k then go to two sets of sums, added at the end (kSets).
template <int MR>
constexpr int kSets = MR <= 2 ? 2 : 1;

// acc[0] += acc[1] ... : the sets of sums in one.
template <int MR>
void merge_sets(v8 (&acc)[kSets<MR>][MR][4]) {
  for (int s = 1; s < kSets<MR>; ++s)
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < 4; ++j) acc[0][i][j] += acc[s][i][j];
}

template <int MR, typename LoadRow>
void panel(const float* x, LoadRow load_row, const float* scale, const float* b, float* y, int64_t K, int64_t N,
           int64_t n0, bool relu) {
  v8 acc[kSets<MR>][MR][4] = {};
  auto step = [&](int64_t k, v8 (&sums)[MR][4]) {
    v8 w[4];
    load_row(k, w);
    for (int i = 0; i < MR; ++i) {
      const float xi = x[i * K + k];
      for (int j = 0; j < 4; ++j) sums[i][j] += xi * w[j];
    }
  };
  int64_t k = 0;
  for (; k + kSets<MR> <= K; k += kSets<MR>)
    for (int set = 0; set < kSets<MR>; ++set) step(k + set, acc[set]);  // unrolled: the sets stay in registers
  for (; k < K; ++k) step(k, acc[0]);
  merge_sets<MR>(acc);
  store<MR>(acc[0], scale, b, y, N, n0, relu);
}

// Eight 32-bit words, one per column (unsigned: the shifts below are logical).
typedef uint32_t u8v __attribute__((vector_size(32)));

// The int4 form of panel, for MR <= 2: a weight quantized per group of G input rows k (G a multiple of 8),
// W[k, c] = (q[k, c] - 8) * s[g, c] + zero[g, c]. Wq [K / 8, 128 bytes]: per eight rows k0 .. k0+7, one
// 32-bit word per column, row k0 + n in bits 4n .. 4n+3 (lib/fast_decode.py's packed_int4). A code becomes a
// float with no conversion instruction: placed in the top of a float's mantissa under the exponent of 1.0,
// its word reads as u = 1 + q / 16 exactly (two or three integer operations for eight columns, where a
// widening conversion takes four). Per group, part = sum_k x[k] u[k, c] and xs = sum_k x[k]; then
// sum_k x[k] W[k, c] = s * sum_k x q + z8 * xs = 16 s * part + (z8 - 16 s) * xs, where z8 = zero - 8 s (sz
// holds, per group, the 32 columns' s and then their z8). An eighth of float32's bytes.
template <int MR>
void panel_q4(const float* x, const uint8_t* Wq, const float* sz, int64_t G, const float* b, float* y, int64_t K,
              int64_t N, int64_t n0, bool relu) {
  v8 acc[MR][4] = {};
  for (int64_t g0 = 0; g0 < K; g0 += G) {
    static_assert(kSets<MR> == 2, "int4 panels take one or two rows");
    v8 sets[2][MR][4] = {};
    float xs[MR] = {};
    for (int64_t k0 = g0; k0 < g0 + G; k0 += 8) {
      u8v words[4];
      __builtin_memcpy(words, Wq + k0 * (kPanel / 2), sizeof words);  // columns 0..7, 8..15, 16..23, 24..31
      auto row = [&](auto n, v8 (&sums)[MR][4]) {  // row k0 + n, n a compile-time constant: shifts by immediates
        for (int j = 0; j < 4; ++j) {
          const u8v at19 = n * 4 <= 19 ? words[j] << (19 - 4 * n) : words[j] >> (4 * n - 19);  // code at bit 19
          const u8v bits = (at19 & 0x00780000u) | 0x3F800000u;  // 1.0's exponent, the code in mantissa bits 19..22
          v8 u;
          __builtin_memcpy(&u, &bits, sizeof u);
          for (int i = 0; i < MR; ++i) sums[i][j] += x[i * K + k0 + n] * u;
        }
      };
      row(std::integral_constant<int, 0>{}, sets[0]);  // even rows and odd rows in two sets of sums
      row(std::integral_constant<int, 1>{}, sets[1]);
      row(std::integral_constant<int, 2>{}, sets[0]);
      row(std::integral_constant<int, 3>{}, sets[1]);
      row(std::integral_constant<int, 4>{}, sets[0]);
      row(std::integral_constant<int, 5>{}, sets[1]);
      row(std::integral_constant<int, 6>{}, sets[0]);
      row(std::integral_constant<int, 7>{}, sets[1]);
      for (int i = 0; i < MR; ++i)
        for (int n = 0; n < 8; ++n) xs[i] += x[i * K + k0 + n];
    }
    merge_sets<MR>(sets);
    const float* s = sz + (g0 / G) * 2 * kPanel;
    for (int j = 0; j < 4; ++j) {
      const v8 s16 = 16.f * load8(s + 8 * j), zj = load8(s + kPanel + 8 * j) - s16;
      for (int i = 0; i < MR; ++i) acc[i][j] += s16 * sets[0][i][j] + xs[i] * zj;
    }
  }
  store<MR>(acc, nullptr, b, y, N, n0, relu);
}

// A linear layer's weight as the kernels read it: float32 panels; int8 panels and their scales; or int4
// panels and their groups' scales and offsets.
struct Weight {
  const float* f = nullptr;
  const uint16_t* h = nullptr;  // bfloat16
  const int8_t* q = nullptr;
  const float* scale = nullptr;
  const uint8_t* q4 = nullptr;
  int64_t group = 0;  // int4: input rows per group
};

// w: float32 or bfloat16 [P, K, 32]; int8 [P, K, 32] with scale [N]; uint8 (int4) [P, K, 16] with scale
// [P, K / G, 2, 32].
Weight weight_of(const torch::Tensor& w, const torch::Tensor& scale) {
  Weight W;
  if (w.scalar_type() == torch::kBFloat16) {
    W.h = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  } else if (w.scalar_type() == torch::kChar) {
    W.q = w.data_ptr<int8_t>();
    W.scale = scale.data_ptr<float>();
  } else if (w.scalar_type() == torch::kByte) {
    TORCH_CHECK(scale.dim() == 4 && scale.size(0) == w.size(0) && w.size(1) % scale.size(1) == 0,
                "an int4 weight's groups do not match its scales");
    W.q4 = w.data_ptr<uint8_t>();
    W.scale = scale.data_ptr<float>();
    W.group = w.size(1) / scale.size(1);
  } else {
    W.f = w.data_ptr<float>();
  }
  return W;
}

// MR rows of x times panel p of W, in the weight's form (int4: two rows at a time at most, for registers).
template <int MR>
void tile(const float* x, const Weight& W, int64_t p, const float* b, float* y, int64_t K, int64_t N, bool relu) {
  if (W.q4) {
    const uint8_t* Wq = W.q4 + p * K * (kPanel / 2);
    const float* sz = W.scale + p * (K / W.group) * 2 * kPanel;
    for (int i = 0; i + 2 <= MR; i += 2) panel_q4<2>(x + i * K, Wq, sz, W.group, b, y + i * N, K, N, p * kPanel, relu);
    if (MR % 2) panel_q4<1>(x + (MR - 1) * K, Wq, sz, W.group, b, y + (MR - 1) * N, K, N, p * kPanel, relu);
  } else if (W.q) {
    const int8_t* Wq = W.q + p * K * kPanel;
    panel<MR>(x, [Wq](int64_t k, v8* w) { for (int j = 0; j < 4; ++j) w[j] = widen8(Wq + k * kPanel + 8 * j); },
              W.scale, b, y, K, N, p * kPanel, relu);
  } else if (W.h) {
    const uint16_t* Wh = W.h + p * K * kPanel;
    panel<MR>(x, [Wh](int64_t k, v8* w) { for (int j = 0; j < 4; ++j) w[j] = widen_bf16(Wh + k * kPanel + 8 * j); },
              nullptr, b, y, K, N, p * kPanel, relu);
  } else {
    const float* Wf = W.f + p * K * kPanel;
    panel<MR>(x, [Wf](int64_t k, v8* w) { for (int j = 0; j < 4; ++j) w[j] = load8(Wf + k * kPanel + 8 * j); },
              nullptr, b, y, K, N, p * kPanel, relu);
  }
}

// y [M, N] = x [M, K] W^T + b, then ReLU when asked: nn.Linear, its weight packed by lib/fast_decode.py
// into panels of 32 columns, Wp [ceil(N / 32), K, 32] (each panel contiguous: read in order, no cache-set
// conflicts between rows far apart). Threads split the panels; rows of x go four at a time, the rest as one tile.
void linear(const float* x, const Weight& W, const float* b, float* y, int64_t M, int64_t K, int64_t N,
            bool relu = false) {
  const int64_t grain = std::max<int64_t>(1, 1024 / std::max<int64_t>(1, M * K));  // >= 64K FLOP per thread
  at::parallel_for(0, (N + kPanel - 1) / kPanel, grain, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      int64_t m = 0;
      for (; m + 4 <= M; m += 4) tile<4>(x + m * K, W, p, b, y + m * N, K, N, relu);
      // the last 1 to 3 rows in one tile too: a verification pass of 2 or 3 tokens reads the panel once
      if (M - m == 3) tile<3>(x + m * K, W, p, b, y + m * N, K, N, relu);
      if (M - m == 2) tile<2>(x + m * K, W, p, b, y + m * N, K, N, relu);
      if (M - m == 1) tile<1>(x + m * K, W, p, b, y + m * N, K, N, relu);
    }
  });
}

// LayerNorm over the last dimension d of x [M, d] into y (biased variance, as nn.LayerNorm).
void layer_norm(const float* x, const float* g, const float* b, float* y, int64_t M, int64_t d, double eps) {
  for (int64_t m = 0; m < M; ++m) {
    const float* xm = x + m * d;
    float mean = 0.f, var = 0.f;
#pragma omp simd reduction(+ : mean)
    for (int64_t i = 0; i < d; ++i) mean += xm[i];
    mean /= d;
#pragma omp simd reduction(+ : var)
    for (int64_t i = 0; i < d; ++i) var += (xm[i] - mean) * (xm[i] - mean);
    const float inv = 1.f / std::sqrt(var / d + static_cast<float>(eps));
    for (int64_t i = 0; i < d; ++i) y[m * d + i] = (xm[i] - mean) * inv * g[i] + b[i];
  }
}

struct Model {
  std::vector<torch::Tensor> w;  // the weight list, contiguous: float32, the linear weights float32, int8, int4
  std::vector<torch::Tensor> s;  // per entry of w: an int8 or int4 weight's scales (weight_of), else empty
  int64_t n_layers, n_heads, d_model, d_head, d_ff, vocab;
  double eps;
  const float* p(int64_t i) const { return w[i].data_ptr<float>(); }
  const float* layer(int64_t l, int64_t i) const { return p(2 + l * kPerBlock + i); }
  Weight lin(int64_t i) const { return weight_of(w[i], s[i]); }
  Weight layer_lin(int64_t l, int64_t i) const { return lin(2 + l * kPerBlock + i); }
};

Model make_model(const std::vector<torch::Tensor>& w, const std::vector<torch::Tensor>& s, int64_t n_heads,
                 double eps) {
  TORCH_CHECK(w.size() == s.size(), "one scale entry per weight");
  Model m{w, s};
  m.n_layers = (static_cast<int64_t>(w.size()) - 6) / kPerBlock;
  m.d_model = w[0].size(1);
  m.n_heads = n_heads;
  m.d_head = w[2 + 3].size(0) / n_heads;  // query_proj's bias [H D] (the weights are packed)
  m.d_ff = w[2 + 13].size(0);
  m.vocab = w[w.size() - 1].size(0);  // the head's bias
  m.eps = eps;
  return m;
}

// Softmax attention of one query q [D] over n cached tokens into out [D], the scores in s [n]:
// score(j) is q . k_j, add_value(j, w, out) adds w v_j to out; both read the cache's own form.
template <typename Score, typename AddValue>
void attend(int64_t n, float scale, float* s, float* out, int64_t D, Score score, AddValue add_value) {
  float mx = -INFINITY;
  for (int64_t j = 0; j < n; ++j) mx = std::max(mx, s[j] = score(j) / scale);
  float sum = 0.f;
  for (int64_t j = 0; j < n; ++j) sum += (s[j] = std::exp(s[j] - mx));
  for (int64_t e = 0; e < D; ++e) out[e] = 0.f;
  for (int64_t j = 0; j < n; ++j) add_value(j, s[j] / sum, out);
}

// The float32 cache: a StaticKVCache's buffers [L, B, G, S, D]; token t in slot t % S.
struct FloatKV {
  float* keys;
  float* values;
  int64_t B, G, S, D;
  int64_t capacity() const { return S; }
  void write(int64_t l, int64_t b, int64_t g, int64_t t, const float* k, const float* v) {
    const int64_t at = (((l * B + b) * G + g) * S + t % S) * D;
    std::copy(k, k + D, keys + at);
    std::copy(v, v + D, values + at);
  }
  void attend_one(int64_t l, int64_t b, int64_t g, const float* q, int64_t n, int64_t, float scale, float* s,
                  float* out) const {
    const float* K = keys + ((l * B + b) * G + g) * S * D;
    const float* V = values + ((l * B + b) * G + g) * S * D;
    const int64_t D_ = D;
    attend(n, scale, s, out, D, [&](int64_t j) {
      float dot = 0.f;
#pragma omp simd reduction(+ : dot)
      for (int64_t e = 0; e < D_; ++e) dot += q[e] * K[j * D_ + e];
      return dot;
    }, [&](int64_t j, float w, float* o) {
#pragma omp simd
      for (int64_t e = 0; e < D_; ++e) o[e] += w * V[j * D_ + e];
    });
  }
};

// 32 codes of `bits` (4 or 2) as four vectors of floats, from 32 * bits / 8 bytes in which code p sits in
// byte p % (32 / P) at slot p / (32 / P) (P = 8 / bits codes a byte; at 4 bits this is widen4's layout).
inline void widen_codes(const uint8_t* p, int64_t bits, v8* w) {
  if (bits == 4) return widen4(p, w);
#if defined(__AVX2__)
  const __m128i v = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)), mask = _mm_set1_epi8(0x03);
  for (int i = 0; i < 4; ++i)
    w[i] = (v8)_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(v, 2 * i), mask)));
#else
  for (int c = 0; c < 32; ++c) w[c / 8][c % 8] = (p[c % 8] >> (2 * (c / 8))) & 0x03;
#endif
}

// A KIVI cache (lib/fast_decode.py's PackedKIVICache): tokens in blocks of C = 32; each full block
// quantized to `bits` (keys per channel, values per token: min and max, x = code * scale + lo), the latest
// partial block in float32 (the residual), quantized as soon as it fills, before attention reads it (as
// lib/quantization.KIVICache.update). Codes go in groups of 32 (widen_codes' layout, 32 * bits / 8 bytes):
// a block's keys channel by channel, each channel's 32 tokens one group (kq [L, B, G, NB, D, 4 * bits]);
// a token's values in groups of 32 channels (vq [L, B, G, NB, C, D * bits / 8]). ks, kl [L, B, G, NB, D];
// vs, vl [L, B, G, NB, C]; rk, rv [L, B, G, C, D]. Attention never dequantizes: a block's 32 scores are
// sum_e (q[e] ks[e]) codes[e, :] + q . kl, the int4 panel product with the tokens as its columns, and its
// values add sum_r (w_r vs_r) codes[r, :] to the output and sum_r w_r vl_r to every channel.
struct KiviKV {
  uint8_t *kq, *vq;
  float *ks, *kl, *vs, *vl, *rk, *rv;
  int64_t B, G, NB, C, D, bits;
  int64_t capacity() const { return NB * C; }
  int64_t group_bytes() const { return 4 * bits; }  // 32 codes
  int64_t head(int64_t l, int64_t b, int64_t g) const { return (l * B + b) * G + g; }
  void write(int64_t l, int64_t b, int64_t g, int64_t t, const float* k, const float* v) {
    const int64_t h = head(l, b, g);
    std::copy(k, k + D, rk + (h * C + t % C) * D);
    std::copy(v, v + D, rv + (h * C + t % C) * D);
    if ((t + 1) % C == 0) seal(h, t / C);
  }
  // x [C, D] quantized with the min and max of each column (keys) or row (values), as quantize_asym.
  void quantize(const float* x, bool keys, uint8_t* codes, float* scale, float* lo) const {
    const float levels = static_cast<float>((1 << bits) - 1);
    const int64_t n_stats = keys ? D : C, span = keys ? C : D, P = 8 / bits, lanes = 32 / P;
    for (int64_t i = 0; i < n_stats; ++i) {
      float mn = INFINITY, mx = -INFINITY;
      for (int64_t r = 0; r < span; ++r) {
        const float value = keys ? x[r * D + i] : x[i * D + r];
        mn = std::min(mn, value);
        mx = std::max(mx, value);
      }
      scale[i] = std::max((mx - mn) / levels, 1e-8f);
      lo[i] = mn;
    }
    std::fill(codes, codes + C * D / P, 0);
    for (int64_t r = 0; r < C; ++r)
      for (int64_t e = 0; e < D; ++e) {
        const int64_t stat = keys ? e : r;
        const float code = std::min(std::max(std::nearbyint((x[r * D + e] - lo[stat]) / scale[stat]), 0.f), levels);
        const int64_t group = keys ? e : r * (D / 32) + e / 32, p = keys ? r : e % 32;  // 32 codes a group
        codes[group * group_bytes() + p % lanes] |= static_cast<uint8_t>(code) << (bits * (p / lanes));
      }
  }
  void seal(int64_t h, int64_t block) {
    const int64_t hb = h * NB + block;
    quantize(rk + h * C * D, true, kq + hb * C * D * bits / 8, ks + hb * D, kl + hb * D);
    quantize(rv + h * C * D, false, vq + hb * C * D * bits / 8, vs + hb * C, vl + hb * C);
  }
  // written: the tokens written so far (this pass's included); those of its full blocks are quantized.
  void attend_one(int64_t l, int64_t b, int64_t g, const float* q, int64_t n, int64_t written, float scale, float* s,
                  float* out) const {
    const int64_t h = head(l, b, g), sealed = std::min(written / C * C, n), n_blocks = (sealed + C - 1) / C;
    const int64_t block_bytes = C * D * bits / 8;
    float mx = -INFINITY;
    for (int64_t c = 0; c < n_blocks; ++c) {  // 32 scores a block
      const int64_t hb = h * NB + c;
      const float *sc = ks + hb * D, *mn = kl + hb * D;
      const uint8_t* codes = kq + hb * block_bytes;
      v8 acc[4] = {};
      float q0 = 0.f;
      for (int64_t e = 0; e < D; ++e) {
        v8 w[4];
        widen_codes(codes + e * group_bytes(), bits, w);
        const float xe = q[e] * sc[e];
        q0 += q[e] * mn[e];
        for (int j = 0; j < 4; ++j) acc[j] += xe * w[j];
      }
      for (int64_t r = 0; r < std::min(C, n - c * C); ++r) mx = std::max(mx, s[c * C + r] = (acc[r / 8][r % 8] + q0) / scale);
    }
    for (int64_t j = sealed; j < n; ++j) {  // the float32 residual
      const float* k = rk + (h * C + j % C) * D;
      float dot = 0.f;
      for (int64_t e = 0; e < D; ++e) dot += q[e] * k[e];
      mx = std::max(mx, s[j] = dot / scale);
    }
    float sum = 0.f;
    for (int64_t j = 0; j < n; ++j) sum += (s[j] = std::exp(s[j] - mx));
    for (int64_t e = 0; e < D; ++e) out[e] = 0.f;
    float offset = 0.f;  // sum_j w_j vl_j over the quantized tokens
    for (int64_t c = 0; c < n_blocks; ++c) {
      const int64_t hb = h * NB + c, m = std::min(C, n - c * C);
      for (int64_t r = 0; r < m; ++r) offset += s[c * C + r] / sum * vl[hb * C + r];
      for (int64_t k = 0; k < D / 32; ++k) {  // 32 channels at a time
        v8 acc[4] = {};
        for (int64_t r = 0; r < m; ++r) {
          v8 w[4];
          widen_codes(vq + hb * block_bytes + r * D * bits / 8 + k * group_bytes(), bits, w);
          const float ws = s[c * C + r] / sum * vs[hb * C + r];
          for (int j = 0; j < 4; ++j) acc[j] += ws * w[j];
        }
        for (int j = 0; j < 32; ++j) out[k * 32 + j] += acc[j / 8][j % 8];
      }
    }
    for (int64_t j = sealed; j < n; ++j) {
      const float* v = rv + (h * C + j % C) * D;
      const float w = s[j] / sum;
#pragma omp simd
      for (int64_t e = 0; e < D; ++e) out[e] += w * v[e];
    }
    for (int64_t e = 0; e < D; ++e) out[e] += offset;
  }
};

// The blocks over T new tokens per row, tokens start .. start+T-1 of the sequence: idx [B, T] -> x [B*T,
// d_model], the last block's output (before the final LayerNorm), the new keys and values written to the
// cache `kv` (FloatKV or KiviKV, capacity S tokens). T > 1 must fit the buffer unwrapped (start + T <= S):
// past it, tokens come one at a time (a FloatKV then wraps).
template <typename KV>
std::vector<float> blocks(const Model& m, const int64_t* idx, int64_t B, int64_t T, int64_t start, KV& kv, int64_t G) {
  const int64_t S = kv.capacity();
  TORCH_CHECK(T == 1 || start + T <= S, "a pass of ", T, " tokens from token ", start, " wraps the cache of ", S);
  const int64_t d = m.d_model, H = m.n_heads, D = m.d_head, M = B * T, per_group = H / G;
  std::vector<float> x(M * d), h(M * d), q(M * H * D), k(M * G * D), v(M * G * D), att(M * H * D),
      ff(M * m.d_ff), o(M * d);
  const float* tok = m.p(0);
  const float* pos = m.p(1);
  for (int64_t i = 0; i < M; ++i)
    for (int64_t j = 0; j < d; ++j) x[i * d + j] = tok[idx[i] * d + j] + pos[std::min(start + i % T, S - 1) * d + j];
  const float scale = std::sqrt(static_cast<float>(D));
  for (int64_t l = 0; l < m.n_layers; ++l) {
    layer_norm(x.data(), m.layer(l, 0), m.layer(l, 1), h.data(), M, d, m.eps);
    linear(h.data(), m.layer_lin(l, 2), m.layer(l, 3), q.data(), M, d, H * D);
    linear(h.data(), m.layer_lin(l, 4), m.layer(l, 5), k.data(), M, d, G * D);
    linear(h.data(), m.layer_lin(l, 6), m.layer(l, 7), v.data(), M, d, G * D);
    at::parallel_for(0, B * G, 1, [&](int64_t i0, int64_t i1) {  // the new keys and values, token by token
      for (int64_t bg = i0; bg < i1; ++bg)
        for (int64_t t = 0; t < T; ++t) {
          const int64_t b = bg / G, g = bg % G, row = ((b * T + t) * G + g) * D;
          kv.write(l, b, g, start + t, k.data() + row, v.data() + row);
        }
    });
    at::parallel_for(0, B * H, std::max<int64_t>(1, 4096 / std::max<int64_t>(1, T * (start + T) * D)),
                     [&](int64_t i0, int64_t i1) {
      std::vector<float> s(std::min(start + T, S));
      for (int64_t bh = i0; bh < i1; ++bh) {
        const int64_t b = bh / H, hd = bh % H, g = hd / per_group;
        for (int64_t t = 0; t < T; ++t)  // slots 0 .. start+t: the causal mask (all S once wrapped)
          kv.attend_one(l, b, g, q.data() + (b * T + t) * H * D + hd * D, std::min(start + t + 1, S), start + T, scale, s.data(),
                        att.data() + (b * T + t) * H * D + hd * D);
      }
    });
    linear(att.data(), m.layer_lin(l, 8), m.layer(l, 9), o.data(), M, H * D, d);
    for (int64_t i = 0; i < M * d; ++i) x[i] += o[i];
    layer_norm(x.data(), m.layer(l, 10), m.layer(l, 11), h.data(), M, d, m.eps);
    linear(h.data(), m.layer_lin(l, 12), m.layer(l, 13), ff.data(), M, d, m.d_ff, /*relu=*/true);
    linear(ff.data(), m.layer_lin(l, 14), m.layer(l, 15), o.data(), M, m.d_ff, d);
    for (int64_t i = 0; i < M * d; ++i) x[i] += o[i];
  }
  return x;
}

// The final LayerNorm and the head on rows x [M, d] -> logits [M, vocab].
void head(const Model& m, const float* x, float* logits, int64_t M) {
  const int64_t n = m.w.size();
  std::vector<float> h(M * m.d_model);
  layer_norm(x, m.p(n - 4), m.p(n - 3), h.data(), M, m.d_model, m.eps);
  linear(h.data(), m.lin(n - 2), m.p(n - 1), logits, M, m.d_model, m.vocab);
}

// The first index of the largest value, as torch.argmax.
int64_t argmax(const float* row, int64_t n) {
  int64_t best = 0;
  for (int64_t i = 1; i < n; ++i)
    if (row[i] > row[best]) best = i;
  return best;
}

// The last block's output x [B*T, d] as a tensor [B, T, d] (with_head false), or the logits [B, T, vocab].
torch::Tensor output(const Model& m, const std::vector<float>& x, int64_t B, int64_t T, bool with_head) {
  if (!with_head) return torch::from_blob(const_cast<float*>(x.data()), {B, T, m.d_model}, torch::kFloat32).clone();
  torch::Tensor logits = torch::empty({B, T, m.vocab}, torch::kFloat32);
  head(m, x.data(), logits.data_ptr<float>(), B * T);
  return logits;
}

// forward: idx [B, T] at positions start .. start+T-1 through the cache -> the last block's output
// [B, T, d_model] (with_head false), or the logits [B, T, vocab].
torch::Tensor forward(const std::vector<torch::Tensor>& w, const std::vector<torch::Tensor>& s, int64_t n_heads, double eps, torch::Tensor idx,
                      int64_t start, torch::Tensor keys, torch::Tensor values, bool with_head) {
  const Model m = make_model(w, s, n_heads, eps);
  const int64_t B = idx.size(0), G = keys.size(2);
  FloatKV kv{keys.data_ptr<float>(), values.data_ptr<float>(), B, G, keys.size(3), m.d_head};
  return output(m, blocks(m, idx.data_ptr<int64_t>(), B, idx.size(1), start, kv, G), B, idx.size(1), with_head);
}

// forward_kivi: forward through a KIVI cache (KiviKV; lib/fast_decode.py's PackedKIVICache), its buffers
// in the order kq, ks, kl, vq, vs, vl, rk, rv.
torch::Tensor forward_kivi(const std::vector<torch::Tensor>& w, const std::vector<torch::Tensor>& s, int64_t n_heads,
                           double eps, torch::Tensor idx, int64_t start, const std::vector<torch::Tensor>& c,
                           int64_t bits, bool with_head) {
  const Model m = make_model(w, s, n_heads, eps);
  TORCH_CHECK(c.size() == 8 && c[0].dim() == 6 && c[4].size(4) == 32 && m.d_head % 32 == 0 && (bits == 4 || bits == 2),
              "a PackedKIVICache's eight buffers: blocks of 32 tokens, d_head a multiple of 32, 4 or 2 bits");
  const int64_t B = idx.size(0), G = c[0].size(2);
  KiviKV kv{c[0].data_ptr<uint8_t>(), c[3].data_ptr<uint8_t>(), c[1].data_ptr<float>(), c[2].data_ptr<float>(),
            c[4].data_ptr<float>(), c[5].data_ptr<float>(), c[6].data_ptr<float>(), c[7].data_ptr<float>(),
            B, G, c[0].size(3), c[4].size(4), m.d_head, bits};
  return output(m, blocks(m, idx.data_ptr<int64_t>(), B, idx.size(1), start, kv, G), B, idx.size(1), with_head);
}

// generate: greedy decoding of n_tokens after prompt [B, P] from an empty cache -> [B, P + n_tokens].
// The prefill, then one step per token; only the last position's logits are computed.
torch::Tensor generate(const std::vector<torch::Tensor>& w, const std::vector<torch::Tensor>& s, int64_t n_heads, double eps, torch::Tensor prompt,
                       int64_t n_tokens, torch::Tensor keys, torch::Tensor values) {
  const Model m = make_model(w, s, n_heads, eps);
  const int64_t B = prompt.size(0), P = prompt.size(1), G = keys.size(2), d = m.d_model;
  FloatKV kv{keys.data_ptr<float>(), values.data_ptr<float>(), B, G, keys.size(3), m.d_head};
  torch::Tensor out = torch::empty({B, P + n_tokens}, torch::kInt64);
  int64_t* seq = out.data_ptr<int64_t>();
  const int64_t* p = prompt.data_ptr<int64_t>();
  for (int64_t i = 0; i < B * P; ++i) seq[(i / P) * (P + n_tokens) + i % P] = p[i];
  std::vector<int64_t> token(p, p + B * P);
  std::vector<float> last(B * d), logits(B * m.vocab);
  int64_t start = 0, T = P;
  for (int64_t step = 0; step < n_tokens; ++step) {
    std::vector<float> x = blocks(m, token.data(), B, T, start, kv, G);
    for (int64_t b = 0; b < B; ++b)  // each row's last position
      std::copy(x.begin() + ((b + 1) * T - 1) * d, x.begin() + (b + 1) * T * d, last.begin() + b * d);
    head(m, last.data(), logits.data(), B);
    token.assign(B, 0);
    for (int64_t b = 0; b < B; ++b) {
      token[b] = argmax(logits.data() + b * m.vocab, m.vocab);
      seq[b * (P + n_tokens) + P + step] = token[b];
    }
    start += T;
    T = 1;
  }
  return out;
}

// linear_op: x [M, K] through one packed weight (float32; int8 with its scales; int4 with its groups'
// scales and offsets: see weight_of) plus b [N] -> [M, N]:
// the kernel of every linear layer above, on its own (lib/fast_decode.py's linear, the benchmarks).
torch::Tensor linear_op(torch::Tensor x, torch::Tensor w, torch::Tensor scale, torch::Tensor b) {
  const int64_t M = x.size(0), K = x.size(1), N = b.size(0);
  TORCH_CHECK(w.size(1) == K && w.size(0) == (N + kPanel - 1) / kPanel, "the packed weight's shape does not match");
  torch::Tensor y = torch::empty({M, N}, torch::kFloat32);
  linear(x.data_ptr<float>(), weight_of(w, scale), b.data_ptr<float>(), y.data_ptr<float>(), M, K, N);
  return y;
}

// read_sum: the sum of a float32 tensor's values, read once in order by every thread's share, eight
// accumulators of eight floats so that the adds never wait: the machine's read bandwidth, as the kernels
// above see it (main_quantization.py times it on the benchmark's matrix).
double read_sum(torch::Tensor x) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.is_contiguous(), "read_sum reads a contiguous float32 tensor");
  const float* p = x.data_ptr<float>();
  const int64_t n = x.numel(), chunk = 64;  // floats per step: eight vectors
  std::vector<double> part(at::get_num_threads(), 0.0);
  at::parallel_for(0, n / chunk, 4096, [&](int64_t c0, int64_t c1) {
    v8 acc[8] = {};
    for (int64_t c = c0; c < c1; ++c)
      for (int j = 0; j < 8; ++j) acc[j] += load8(p + c * chunk + 8 * j);
    double total = 0.0;
    for (int j = 0; j < 8; ++j)
      for (int i = 0; i < 8; ++i) total += acc[j][i];
    part[at::get_thread_num()] += total;
  });
  double total = 0.0;
  for (double v : part) total += v;
  for (int64_t i = n / chunk * chunk; i < n; ++i) total += p[i];
  return total;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  module.def("forward", &forward, "GPTlite's cached forward pass over new tokens (see fast_decode.py)");
  module.def("forward_kivi", &forward_kivi, "the cached forward pass through a KIVI cache (see fast_decode.py)");
  module.def("generate", &generate, "greedy decoding from an empty cache (see fast_decode.py)");
  module.def("linear", &linear_op, "one linear layer on a packed weight (see fast_decode.py)");
  module.def("read_sum", &read_sum, "the sum of a float32 tensor, read at the memory's speed (see fast_decode.py)");
}
