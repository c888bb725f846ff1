// A decode step's next token per row and its log-prob in three passes over the row's logits (max; exp and block
// sums; the inverse-CDF search inside one block). Built and loaded with decode_attention.cpp by
// lit_rl/kernels/decode_attention.py; the formula, shapes and why are documented in lit_rl/kernels/sampling.py.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "vec.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <tuple>
#include <vector>

namespace {

using namespace lit_rl_vec;

// elements per block of the search: the exp pass keeps each block's sum, the search walks the sums and then one
// block element by element
constexpr int64_t kBlock = 256;

// kW logits widened to float32
inline vec load_logits(const float* p) { return loadv(p); }
inline vec load_logits(const c10::BFloat16* p) {
#if defined(__AVX512F__)
  return (vec)_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
#elif defined(__AVX2__)
  return (vec)_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
#elif defined(__AVX__)  // 8 lanes without AVX2's integer ops: each half's 16 bits moved up by an SSE unpack
  const __m128i h = _mm_loadu_si128((const __m128i*)p), zero = _mm_setzero_si128();
  return (vec)_mm256_set_m128(_mm_castsi128_ps(_mm_unpackhi_epi16(zero, h)), _mm_castsi128_ps(_mm_unpacklo_epi16(zero, h)));
#else
  return (vec)_mm_castsi128_ps(_mm_unpacklo_epi16(_mm_setzero_si128(), _mm_loadl_epi64((const __m128i*)p)));
#endif
}

// One row: x = logits / temperature (``scaled``), p = softmax(x); the first index whose running sum of exp(x - max)
// reaches u * (the sum), skipping zero-probability entries, and its log-prob x - max - log(sum). A row with a NaN, a
// +inf (after the division) or every entry -inf gets id -1 (the caller raises).
template <typename T>
void sample_row(const T* logits, int64_t V, bool scaled, float temperature, double u, float* e, double* sums,
                int64_t* id, float* logprob) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const vec t = splat(temperature);
  vec top = splat(neg_inf);
  vec nan = splat(0.f);
  int64_t j = 0;
  for (; j + kW <= V; j += kW) {
    vec x = load_logits(logits + j);
    if (scaled) x = x / t;
    nan = (x != x) ? splat(1.f) : nan;
    top = vmax(top, x);
  }
  float m = neg_inf;
  bool bad = false;
  for (int l = 0; l < kW; ++l) {
    m = std::max(m, top[l]);
    bad = bad || nan[l] != 0.f;
  }
  for (int64_t k = j; k < V; ++k) {
    const float x = scaled ? static_cast<float>(logits[k]) / temperature : static_cast<float>(logits[k]);
    bad = bad || x != x;
    m = std::max(m, x);
  }
  if (bad || !std::isfinite(m)) {
    *id = -1;
    *logprob = std::numeric_limits<float>::quiet_NaN();
    return;
  }
  const vec mv = splat(m);
  double total = 0.0;
  const int64_t nblocks = (V + kBlock - 1) / kBlock;
  for (int64_t b = 0; b < nblocks; ++b) {
    const int64_t lo = b * kBlock, hi = std::min(V, lo + kBlock);
    vec acc = vec{};
    int64_t k = lo;
    for (; k + kW <= hi; k += kW) {
      vec x = load_logits(logits + k);
      if (scaled) x = x / t;
      const vec ex = vexp(x - mv);  // -inf - m: 0
      storev(e + k, ex);
      acc += ex;
    }
    float s = 0.f;
    for (int l = 0; l < kW; ++l) s += acc[l];
    for (; k < hi; ++k) {
      const float x = scaled ? static_cast<float>(logits[k]) / temperature : static_cast<float>(logits[k]);
      e[k] = std::exp(x - m);
      s += e[k];
    }
    sums[b] = s;
    total += s;
  }
  const double target = u * total;
  int64_t pick = -1;
  double c = 0.0;
  for (int64_t b = 0; b < nblocks && pick < 0; ++b) {
    const double next = c + sums[b];
    if (next >= target) {
      double run = c;
      for (int64_t k = b * kBlock, hi = std::min(V, k + kBlock); k < hi; ++k) {
        run += e[k];
        if (e[k] > 0.f && run >= target) {
          pick = k;
          break;
        }
      }
    }
    c = next;
  }
  if (pick < 0) {  // u * total past the elementwise sum by a rounding: the last entry with probability
    for (int64_t k = V - 1; k >= 0 && pick < 0; --k)
      if (e[k] > 0.f) pick = k;
  }
  if (pick < 0) {  // unreachable for a finite max (its own entry has e = 1); kept so nothing reads logits[-1]
    *id = -1;
    *logprob = std::numeric_limits<float>::quiet_NaN();
    return;
  }
  const float x = scaled ? static_cast<float>(logits[pick]) / temperature : static_cast<float>(logits[pick]);
  *id = pick;
  *logprob = (x - m) - std::log(static_cast<float>(total));
}

std::tuple<at::Tensor, at::Tensor> sample_next(const at::Tensor& logits, const at::Tensor& uniforms,
                                               double temperature) {
  TORCH_CHECK(logits.dim() == 2, "sample_next: logits must be [B, V], got ", logits.sizes());
  TORCH_CHECK(logits.stride(1) == 1, "sample_next: logits' rows must be contiguous");
  TORCH_CHECK(logits.scalar_type() == at::kFloat || logits.scalar_type() == at::kBFloat16,
              "sample_next: logits must be float32 or bfloat16, got ", logits.scalar_type());
  TORCH_CHECK(uniforms.dim() == 1 && uniforms.size(0) == logits.size(0) && uniforms.scalar_type() == at::kFloat,
              "sample_next: uniforms must be float32 [B] with B = logits.size(0)");
  TORCH_CHECK(temperature > 0, "sample_next: temperature must be > 0, got ", temperature);
  const int64_t B = logits.size(0), V = logits.size(1), ld = logits.stride(0);
  TORCH_CHECK(V > 0, "sample_next: an empty vocabulary");
  const at::Tensor u = uniforms.contiguous();
  at::Tensor ids = at::empty({B}, logits.options().dtype(at::kLong));
  at::Tensor logprobs = at::empty({B}, logits.options().dtype(at::kFloat));
  const float* up = u.data_ptr<float>();
  int64_t* ip = ids.data_ptr<int64_t>();
  float* lp = logprobs.data_ptr<float>();
  const bool scaled = temperature != 1.0;
  const float t = static_cast<float>(temperature);
  const int64_t nblocks = (V + kBlock - 1) / kBlock;
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> e(V);
    std::vector<double> sums(nblocks);
    for (int64_t r = begin; r < end; ++r) {
      if (logits.scalar_type() == at::kBFloat16) {
        const auto* row = logits.const_data_ptr<c10::BFloat16>() + r * ld;
        sample_row(row, V, scaled, t, up[r], e.data(), sums.data(), ip + r, lp + r);
      } else {
        const float* row = logits.const_data_ptr<float>() + r * ld;
        sample_row(row, V, scaled, t, up[r], e.data(), sums.data(), ip + r, lp + r);
      }
    }
  });
  return {ids, logprobs};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(lit_rl, m) {
  m.def("sample_next(Tensor logits, Tensor uniforms, float temperature) -> (Tensor, Tensor)");
  m.impl("sample_next", c10::DispatchKey::CPU, TORCH_FN(sample_next));
}
