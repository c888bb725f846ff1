// Vector helpers shared by lit_rl's CPU kernels (attention_backward.cpp, sampling.cpp): float32 vectors of the width
// -march=native gives through GCC's vector extension, one-instruction loads and stores, and a vectorised exp.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace lit_rl_vec {

// float32 values per vector step and register blocks (MR rows x NV vectors of accumulators, attention_backward.cpp),
// sized to the vector registers -march=native gives: 32 AVX-512 registers of 16 hold 24 accumulators; 16 AVX2 ones of 8, and 16 SSE ones
// of 4, hold 8. GCC's vector extension lowers ``vec`` to those registers.
#if defined(__AVX512F__)
constexpr int64_t kW = 16;
constexpr int kMR = 6, kNV = 4;
#elif defined(__AVX2__) || defined(__AVX__)
constexpr int64_t kW = 8;
constexpr int kMR = 4, kNV = 2;
#else
constexpr int64_t kW = 4;
constexpr int kMR = 4, kNV = 2;
#endif
typedef float vec __attribute__((vector_size(kW * sizeof(float)), aligned(4)));

// unaligned loads, stores and broadcasts as one instruction each (through memcpy or ``vec{} + a`` GCC's AVX2 code
// went through the stack lane by lane or half by half: 5x slower than SSE)
#if defined(__AVX512F__)
inline vec loadv(const float* p) { return (vec)_mm512_loadu_ps(p); }
inline void storev(float* p, vec x) { _mm512_storeu_ps(p, (__m512)x); }
inline vec splat(float a) { return (vec)_mm512_set1_ps(a); }
#elif defined(__AVX__)
inline vec loadv(const float* p) { return (vec)_mm256_loadu_ps(p); }
inline void storev(float* p, vec x) { _mm256_storeu_ps(p, (__m256)x); }
inline vec splat(float a) { return (vec)_mm256_set1_ps(a); }
#else
inline vec loadv(const float* p) { return (vec)_mm_loadu_ps(p); }
inline void storev(float* p, vec x) { _mm_storeu_ps(p, (__m128)x); }
inline vec splat(float a) { return (vec)_mm_set1_ps(a); }
#endif

inline vec vmax(vec a, vec b) { return a > b ? a : b; }

// exp(x) for x <= 0 (x = n ln2 + r, Cephes' expf polynomial on r, 2^n put in the exponent bits): within 2 ulp of
// expf; x below -87 gives 0 (the float32 normal range ends there)
inline vec vexp(vec x) {
  typedef int32_t ivec __attribute__((vector_size(kW * sizeof(int32_t)), aligned(4)));
  const vec low = splat(-87.f);
  const ivec under = x < low;
  x = vmax(x, low);
  const vec t = x * 1.44269504088896341f;
  ivec n = __builtin_convertvector(t, ivec);  // toward zero, then rounded to nearest
  const vec frac = t - __builtin_convertvector(n, vec);
  n += (frac > 0.5f) ? 1 : 0;
  n -= (frac < -0.5f) ? 1 : 0;
  const vec nf = __builtin_convertvector(n, vec);
  vec r = x - nf * 0.693359375f;
  r = r - nf * -2.12194440e-4f;
  vec p = splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + (r + 1.f);
  ivec bits;
  std::memcpy(&bits, &p, sizeof(vec));
  bits += (n << 23);
  bits = under ? 0 : bits;
  vec out;
  std::memcpy(&out, &bits, sizeof(vec));
  return out;
}

}  // namespace lit_rl_vec
