// One decode step's attention on the CPU: each (row, key/value head) pair's G grouped query heads against its
// cached keys and values, streamed once. Built and loaded by lit_rl/kernels/decode_attention.py (the formula,
// shapes and why are documented there).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t kLanes = 16;  // values per vector step (one AVX-512 register of float32)

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) { return static_cast<float>(x); }

#if defined(__AVX512F__)
// AVX-512 (F) steps: 16 values at a time. Other CPUs take the portable loops below (slow: engine.decode_attention
// =auto times both kernels and keeps torch's SDPA where this one is not faster).
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {  // bf16 -> float32 is exact: the 16 bits move up
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
// exp(x) for x <= 0 (Cephes' expf polynomial after x = n ln2 + r; 2^n by scalef): within 2 ulp of expf
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-103.9f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(p, n);
}
// round float32 to bf16 (nearest even) and back, for finite x: what a bf16 store and load give
inline __m512 round_bf16(__m512 x) {
  const __m512i u = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb));
  return _mm512_castsi512_ps(_mm512_and_si512(r, _mm512_set1_epi32(static_cast<int>(0xffff0000u))));
}
#endif

// The portable loops (any CPU, any D and G): slow; see below for the AVX-512 ones.
template <typename T>
void scores_any(const float* qf, const T* kb, int64_t ldk, int64_t G, int64_t D, int64_t L, float scale, float* s) {
  for (int64_t l = 0; l < L; ++l)
    for (int64_t g = 0; g < G; ++g) {
      float acc = 0.f;
      for (int64_t i = 0; i < D; ++i) acc += qf[g * D + i] * to_float(kb[l * ldk + i]);
      s[g * L + l] = scale * acc;
    }
}

template <typename T>
void weigh_values_any(const float* p, const T* vb, int64_t ldv, int64_t G, int64_t D, int64_t L, float* acc) {
  for (int64_t l = 0; l < L; ++l)
    for (int64_t g = 0; g < G; ++g)
      for (int64_t i = 0; i < D; ++i) acc[g * D + i] += p[g * L + l] * to_float(vb[l * ldv + i]);
}

#if defined(__AVX512F__)
// 16 vectors -> one: lane j holds the sum of v[j]'s 16 lanes (a 16 x 16 transpose folded into the additions)
inline __m512 sum_lanes16(const __m512* v) {
  __m512 x[4];
  for (int q = 0; q < 4; ++q) {
    const __m512* w = v + 4 * q;
    const __m512 a = _mm512_add_ps(_mm512_unpacklo_ps(w[0], w[1]), _mm512_unpackhi_ps(w[0], w[1]));
    const __m512 b = _mm512_add_ps(_mm512_unpacklo_ps(w[2], w[3]), _mm512_unpackhi_ps(w[2], w[3]));
    x[q] = _mm512_add_ps(_mm512_shuffle_ps(a, b, _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(a, b, _MM_SHUFFLE(3, 2, 3, 2)));
  }
  const __m512 z01 = _mm512_add_ps(_mm512_shuffle_f32x4(x[0], x[1], _MM_SHUFFLE(1, 0, 1, 0)),
                                   _mm512_shuffle_f32x4(x[0], x[1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 z23 = _mm512_add_ps(_mm512_shuffle_f32x4(x[2], x[3], _MM_SHUFFLE(1, 0, 1, 0)),
                                   _mm512_shuffle_f32x4(x[2], x[3], _MM_SHUFFLE(3, 2, 3, 2)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(z01, z23, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(z01, z23, _MM_SHUFFLE(3, 1, 3, 1)));
}

// D = 16 C and G fixed at compile time: the G query rows stay in registers, each key row is converted once for
// the G dot products, and 16 keys' dot products are summed across lanes together (sum_lanes16)
template <int C, int G, typename T>
void scores_fixed(const float* qf, const T* kb, int64_t ldk, int64_t L, float scale, float* s) {
  __m512 q[G][C];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) q[g][c] = _mm512_loadu_ps(qf + (g * C + c) * kLanes);
  const __m512 vscale = _mm512_set1_ps(scale);
  __m512 part[G][kLanes];
  int64_t l = 0;
  for (; l + kLanes <= L; l += kLanes) {
    for (int j = 0; j < kLanes; ++j) {
      const T* kr = kb + (l + j) * ldk;
      __m512 kv[C];
      for (int c = 0; c < C; ++c) kv[c] = load16(kr + c * kLanes);
      for (int g = 0; g < G; ++g) {
        __m512 acc = _mm512_mul_ps(q[g][0], kv[0]);
        for (int c = 1; c < C; ++c) acc = _mm512_fmadd_ps(q[g][c], kv[c], acc);
        part[g][j] = acc;
      }
    }
    for (int g = 0; g < G; ++g) _mm512_storeu_ps(s + g * L + l, _mm512_mul_ps(vscale, sum_lanes16(part[g])));
  }
  for (; l < L; ++l) {
    const T* kr = kb + l * ldk;
    __m512 kv[C];
    for (int c = 0; c < C; ++c) kv[c] = load16(kr + c * kLanes);
    for (int g = 0; g < G; ++g) {
      __m512 acc = _mm512_mul_ps(q[g][0], kv[0]);
      for (int c = 1; c < C; ++c) acc = _mm512_fmadd_ps(q[g][c], kv[c], acc);
      s[g * L + l] = scale * _mm512_reduce_add_ps(acc);
    }
  }
}

// acc [G, D] += sum_l p[g * L + l] * v_l, the accumulators in registers, each value row converted once
template <int C, int G, typename T>
void weigh_values_fixed(const float* p, const T* vb, int64_t ldv, int64_t L, float* out) {
  __m512 acc[G][C];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) acc[g][c] = _mm512_setzero_ps();
  for (int64_t l = 0; l < L; ++l) {
    const T* vr = vb + l * ldv;
    __m512 vv[C];
    for (int c = 0; c < C; ++c) vv[c] = load16(vr + c * kLanes);
    for (int g = 0; g < G; ++g) {
      const __m512 pg = _mm512_set1_ps(p[g * L + l]);
      for (int c = 0; c < C; ++c) acc[g][c] = _mm512_fmadd_ps(pg, vv[c], acc[g][c]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(out + (g * C + c) * kLanes, acc[g][c]);
}

template <typename T>
using ScoresFn = void (*)(const float*, const T*, int64_t, int64_t, float, float*);
template <typename T>
using ValuesFn = void (*)(const float*, const T*, int64_t, int64_t, float*);

template <int C, typename T>
bool pick_g(int64_t G, ScoresFn<T>& sf, ValuesFn<T>& vf) {
  switch (G) {
#define LIT_RL_G(g)                           \
  case g:                                     \
    sf = &scores_fixed<C, g, T>;              \
    vf = &weigh_values_fixed<C, g, T>;        \
    return true;
    LIT_RL_G(1) LIT_RL_G(2) LIT_RL_G(3) LIT_RL_G(4) LIT_RL_G(5) LIT_RL_G(6) LIT_RL_G(7) LIT_RL_G(8)
#undef LIT_RL_G
    default: return false;
  }
}

// the register-held kernels for head_dim D = 32, 64, 128, 256 and G = 1..8 query heads per key/value head
template <typename T>
bool pick(int64_t D, int64_t G, ScoresFn<T>& sf, ValuesFn<T>& vf) {
  switch (D) {
    case 32: return pick_g<2, T>(G, sf, vf);
    case 64: return pick_g<4, T>(G, sf, vf);
    case 128: return pick_g<8, T>(G, sf, vf);
    case 256: return pick_g<16, T>(G, sf, vf);
    default: return false;
  }
}
#endif

// in place: s -> exp(s - max s) (rounded through T, as torch's CPU flash kernel rounds the weights of its second
// product); returns the float32 sum of the unrounded values (0 when every score is -inf)
template <typename T>
float softmax_numerators(float* s, int64_t L) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  float m = neg_inf;
  for (int64_t l = 0; l < L; ++l) m = std::max(m, s[l]);
  if (m == neg_inf) {
    std::fill(s, s + L, 0.f);
    return 0.f;
  }
  float sum = 0.f;
  int64_t l = 0;
#if defined(__AVX512F__)
  __m512 vsum = _mm512_setzero_ps();
  const __m512 vm = _mm512_set1_ps(m);
  const __m512 vneg_inf = _mm512_set1_ps(neg_inf);
  for (; l + kLanes <= L; l += kLanes) {
    const __m512 x = _mm512_loadu_ps(s + l);
    // a masked position weighs exactly 0 (exp16 would give 2^-149 for -inf), as in the scalar tail
    __m512 p = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, vneg_inf, _CMP_NEQ_OQ), exp16(_mm512_sub_ps(x, vm)));
    vsum = _mm512_add_ps(vsum, p);
    if constexpr (!std::is_same_v<T, float>) p = round_bf16(p);
    _mm512_storeu_ps(s + l, p);
  }
  sum = _mm512_reduce_add_ps(vsum);
#endif
  for (; l < L; ++l) {
    const float p = s[l] == neg_inf ? 0.f : std::exp(s[l] - m);
    sum += p;
    s[l] = to_float(static_cast<T>(p));
  }
  return sum;
}

template <typename T>
void run(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const bool* mask, int64_t mask_stride_b,
         int64_t mask_stride_l, double scale, at::Tensor& out) {
  const int64_t B = q.size(0), H = q.size(1), G = q.size(2), D = q.size(3), L = k.size(2);
  const T* qp = q.data_ptr<T>();
  const T* kp = k.data_ptr<T>();
  const T* vp = v.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const auto qs = q.strides(), ks = k.strides(), vs = v.strides(), os = out.strides();
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const float sc = static_cast<float>(scale);
  bool fixed = false;
#if defined(__AVX512F__)
  ScoresFn<T> sf = nullptr;
  ValuesFn<T> vf = nullptr;
  fixed = pick<T>(D, G, sf, vf);
#endif
  at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(G * D), s(G * L), acc(G * D), denom(G);
    for (int64_t u = begin; u < end; ++u) {
      const int64_t b = u / H, h = u % H;
      for (int64_t g = 0; g < G; ++g)
        for (int64_t i = 0; i < D; ++i) qf[g * D + i] = to_float(qp[b * qs[0] + h * qs[1] + g * qs[2] + i]);
      const T* kb = kp + b * ks[0] + h * ks[1];
      const T* vb = vp + b * vs[0] + h * vs[1];
#if defined(__AVX512F__)
      if (fixed) sf(qf.data(), kb, ks[2], L, sc, s.data());
#endif
      if (!fixed) scores_any(qf.data(), kb, ks[2], G, D, L, sc, s.data());
      if (mask) {
        const bool* mb = mask + b * mask_stride_b;
        for (int64_t l = 0; l < L; ++l)
          if (!mb[l * mask_stride_l])
            for (int64_t g = 0; g < G; ++g) s[g * L + l] = neg_inf;
      }
      for (int64_t g = 0; g < G; ++g) denom[g] = softmax_numerators<T>(s.data() + g * L, L);
#if defined(__AVX512F__)
      if (fixed) vf(s.data(), vb, vs[2], L, acc.data());
#endif
      if (!fixed) {
        std::fill(acc.begin(), acc.end(), 0.f);
        weigh_values_any(s.data(), vb, vs[2], G, D, L, acc.data());
      }
      for (int64_t g = 0; g < G; ++g) {
        const float inv = denom[g] > 0.f ? 1.f / denom[g] : 0.f;  // a row that sees no key: zeros
        T* og = op + b * os[0] + h * os[1] + g * os[2];
        for (int64_t i = 0; i < D; ++i) og[i] = static_cast<T>(acc[g * D + i] * inv);
      }
    }
  });
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const c10::optional<at::Tensor>& mask, double scale) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "decode_attention: q, k, v must be 4-D");
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu(), "decode_attention: CPU only");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type(),
              "decode_attention: q, k, v must share a dtype");
  TORCH_CHECK(k.sizes() == v.sizes() && q.size(0) == k.size(0) && q.size(1) == k.size(1) && q.size(3) == k.size(3),
              "decode_attention: q [B, H, G, D] against k, v [B, H, L, D]");
  TORCH_CHECK(q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1, "decode_attention: head_dim contiguous");
  const bool* mp = nullptr;
  int64_t msb = 0, msl = 0;
  at::Tensor m;
  if (mask.has_value()) {
    m = *mask;
    TORCH_CHECK(m.scalar_type() == at::kBool && m.dim() == 2 && m.size(0) == q.size(0) && m.size(1) == k.size(2),
                "decode_attention: mask must be bool [B, L]");
    mp = m.data_ptr<bool>();
    msb = m.stride(0);
    msl = m.stride(1);
  }
  auto out = at::empty(q.sizes(), q.options());
  if (q.scalar_type() == at::kBFloat16) {
    run<c10::BFloat16>(q, k, v, mp, msb, msl, scale, out);
  } else {
    TORCH_CHECK(q.scalar_type() == at::kFloat, "decode_attention: bfloat16 or float32");
    run<float>(q, k, v, mp, msb, msl, scale, out);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(lit_rl, m) {
  m.def("decode_attention(Tensor q, Tensor k, Tensor v, Tensor? mask, float scale) -> Tensor");
  m.impl("decode_attention", c10::DispatchKey::CPU, TORCH_FN(decode_attention));
}
