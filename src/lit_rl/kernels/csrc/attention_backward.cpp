// The trainer's attention backward on the CPU: each (row, key/value head) problem -- its H / KVH grouped query
// heads' rows against the key/value head's keys -- recomputed and differentiated in float32 inside the caches.
// Built and loaded with decode_attention.cpp by lit_rl/kernels/decode_attention.py; the formula, shapes and why
// are documented in lit_rl/kernels/attention_backward.py.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "vec.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <tuple>
#include <vector>

namespace {

using namespace lit_rl_vec;

// bytes of float32 scores (P, and dS beside it) one pass over a problem's query rows holds: blocks that stay in the
// caches, so memory is O(rows x Lk) whatever the length
constexpr int64_t kBlockBytes = 256 << 10;

// One block: C[m0 .. m0 + mr, n0 .. n0 + nv * kW] (+)= A . B over K (fixed trip counts when full: all in registers).
template <int MR, int NV>
inline void block(int64_t m0, int64_t n0, int64_t K, const float* a, int64_t ars, int64_t acs, const float* b,
                  int64_t ldb, float* c, int64_t ldc, bool add) {
  vec acc[MR][NV];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NV; ++j) acc[r][j] = add ? loadv(c + (m0 + r) * ldc + n0 + j * kW) : vec{};
  for (int64_t k = 0; k < K; ++k) {
    const float* bk = b + k * ldb + n0;
    vec bv[NV];
    for (int j = 0; j < NV; ++j) bv[j] = loadv(bk + j * kW);
    for (int r = 0; r < MR; ++r) {
      const vec x = splat(a[(m0 + r) * ars + k * acs]);
      for (int j = 0; j < NV; ++j) acc[r][j] += x * bv[j];
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NV; ++j) storev(c + (m0 + r) * ldc + n0 + j * kW, acc[r][j]);
}

// C[M x N] = A[M x K] . B[K x N] in float32 (``add``: C += A . B). A's element (m, k) at a[m * ars + k * acs]; B
// row-major with row stride ldb; C row stride ldc; N a multiple of kW.
void gemm(int64_t M, int64_t N, int64_t K, const float* a, int64_t ars, int64_t acs, const float* b, int64_t ldb,
          float* c, int64_t ldc, bool add = false) {
  int64_t n0 = 0;
  for (; n0 + kNV * kW <= N; n0 += kNV * kW) {
    int64_t m0 = 0;
    for (; m0 + kMR <= M; m0 += kMR) block<kMR, kNV>(m0, n0, K, a, ars, acs, b, ldb, c, ldc, add);
    for (; m0 < M; ++m0) block<1, kNV>(m0, n0, K, a, ars, acs, b, ldb, c, ldc, add);
  }
  for (; n0 < N; n0 += kW) {  // the last columns, one vector at a time
    int64_t m0 = 0;
    for (; m0 + kMR <= M; m0 += kMR) block<kMR, 1>(m0, n0, K, a, ars, acs, b, ldb, c, ldc, add);
    for (; m0 < M; ++m0) block<1, 1>(m0, n0, K, a, ars, acs, b, ldb, c, ldc, add);
  }
}

// One query row: s (its scores Q K^T, unscaled; Lp wide) becomes P = softmax(scale s + mask) with keys at or beyond
// ``seen`` and the padding 0, and dp (dO V^T) becomes dS = scale P (dP - sum P dP). A row that reads no key (all
// masked) gets P = 0 and dS = 0: output 0, gradient 0 (torch's flash kernel's convention).
inline void softmax_backward_row(float* s, float* dp, const float* mrow, int64_t seen, int64_t Lp, float scale) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  for (int64_t j = seen; j < Lp; ++j) s[j] = neg_inf;
  vec top = splat(neg_inf);
  for (int64_t j = 0; j < seen; ++j) s[j] = mrow ? s[j] * scale + mrow[j] : s[j] * scale;
  for (int64_t j = 0; j < Lp; j += kW) top = vmax(top, loadv(s + j));
  float m = neg_inf;
  for (int l = 0; l < kW; ++l) m = std::max(m, top[l]);
  if (m == neg_inf) {
    std::fill(s, s + Lp, 0.f);
    std::fill(dp, dp + Lp, 0.f);
    return;
  }
  vec sum = vec{};
  for (int64_t j = 0; j < Lp; j += kW) {
    const vec x = loadv(s + j);
    const vec e = vexp(x - m);  // -inf - m: below -87, so exactly 0
    storev(s + j, e);
    sum += e;
  }
  float total = 0.f;
  for (int l = 0; l < kW; ++l) total += sum[l];
  const float inv = 1.f / total;
  vec dot = vec{};
  for (int64_t j = 0; j < Lp; j += kW) {
    const vec p = loadv(s + j) * inv;
    storev(s + j, p);
    dot += p * loadv(dp + j);
  }
  float d = 0.f;
  for (int l = 0; l < kW; ++l) d += dot[l];
  for (int64_t j = 0; j < Lp; j += kW) storev(dp + j, loadv(s + j) * (loadv(dp + j) - d) * scale);
}

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) { return static_cast<float>(x); }

template <typename T>
void widen(const T* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = to_float(src[i]);
}

// Per problem (b, kvh): rows r = g * Lq + i (query head kvh * G + g, position i).
template <typename T>
void run(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& go, const float* mask,
         const int64_t* ms, bool causal, float scale, at::Tensor& dq, at::Tensor& dk, at::Tensor& dv) {
  const int64_t B = q.size(0), H = q.size(1), Lq = q.size(2), D = q.size(3), KVH = k.size(1), Lk = k.size(2);
  const int64_t G = H / KVH, R = G * Lq, Lp = (Lk + kW - 1) / kW * kW;
  const T* qp = q.data_ptr<T>();
  const T* kp = k.data_ptr<T>();
  const T* vp = v.data_ptr<T>();
  const T* gp = go.data_ptr<T>();
  float* dqp = dq.data_ptr<float>();
  float* dkp = dk.data_ptr<float>();
  float* dvp = dv.data_ptr<float>();
  // query rows a pass holds: P and dS blocks of at most kBlockBytes each (all rows at the update's lengths)
  const int64_t RB = std::min(R, std::max<int64_t>(kMR, kBlockBytes / (Lp * 4) / kMR * kMR));
  at::parallel_for(0, B * KVH, 1, [&](int64_t begin, int64_t end) {
    // Kf and Vf padded to Lp rows of zeros; KT and VT their transposes [D, Lp]; P and dS [RB, Lp]
    std::vector<float> Q(R * D), dO(R * D), Kf(Lp * D, 0.f), Vf(Lp * D, 0.f), KT(D * Lp, 0.f), VT(D * Lp, 0.f);
    std::vector<float> P(RB * Lp), dS(RB * Lp), out(RB * D);
    for (int64_t u = begin; u < end; ++u) {
      const int64_t b = u / KVH, kh = u % KVH;
      for (int64_t g = 0; g < G; ++g) {
        const int64_t h = kh * G + g;
        widen(qp + (b * H + h) * Lq * D, Q.data() + g * Lq * D, Lq * D);
        widen(gp + (b * H + h) * Lq * D, dO.data() + g * Lq * D, Lq * D);
      }
      widen(kp + (b * KVH + kh) * Lk * D, Kf.data(), Lk * D);
      widen(vp + (b * KVH + kh) * Lk * D, Vf.data(), Lk * D);
      for (int64_t j = 0; j < Lk; ++j)
        for (int64_t c = 0; c < D; ++c) {
          KT[c * Lp + j] = Kf[j * D + c];
          VT[c * Lp + j] = Vf[j * D + c];
        }
      float* dvb = dvp + (b * KVH + kh) * Lk * D;
      float* dkb = dkp + (b * KVH + kh) * Lk * D;
      for (int64_t r0 = 0; r0 < R; r0 += RB) {
        const int64_t rows = std::min(RB, R - r0);
        const float* Qr = Q.data() + r0 * D;
        const float* dOr = dO.data() + r0 * D;
        gemm(rows, Lp, D, Qr, D, 1, KT.data(), Lp, P.data(), Lp);    // S = Q K^T
        gemm(rows, Lp, D, dOr, D, 1, VT.data(), Lp, dS.data(), Lp);  // dP = dO V^T
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t g = (r0 + r) / Lq, i = (r0 + r) % Lq, h = kh * G + g;
          const float* mrow = mask ? mask + b * ms[0] + h * ms[1] + i * ms[2] : nullptr;
          const int64_t seen = causal ? std::min(Lk, i + 1) : Lk;  // keys the row may read: [0, seen)
          softmax_backward_row(P.data() + r * Lp, dS.data() + r * Lp, mrow, seen, Lp, scale);
        }
        // dV += P^T dO, dK += scale dS^T Q ([Lk, D] each: the grouped heads and row blocks summed in the products)
        gemm(Lk, D, rows, P.data(), 1, Lp, dOr, D, dvb, D, r0 > 0);
        gemm(Lk, D, rows, dS.data(), 1, Lp, Qr, D, dkb, D, r0 > 0);
        // dQ = scale dS K, each row to its query head
        gemm(rows, D, Lp, dS.data(), Lp, 1, Kf.data(), D, out.data(), D);
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t g = (r0 + r) / Lq, i = (r0 + r) % Lq;
          std::memcpy(dqp + ((b * H + kh * G + g) * Lq + i) * D, out.data() + r * D, D * sizeof(float));
        }
      }
    }
  });
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_backward(const at::Tensor& q, const at::Tensor& k,
                                                                  const at::Tensor& v, const at::Tensor& go,
                                                                  const c10::optional<at::Tensor>& mask,
                                                                  bool causal, double scale) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && go.dim() == 4,
              "attention_backward: q, k, v, grad_out must be 4-D");
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu() && go.device().is_cpu(),
              "attention_backward: CPU only");
  const auto dtype = q.scalar_type();
  TORCH_CHECK(k.scalar_type() == dtype && v.scalar_type() == dtype && go.scalar_type() == dtype,
              "attention_backward: q, k, v, grad_out must share a dtype");
  TORCH_CHECK(q.is_contiguous() && k.is_contiguous() && v.is_contiguous() && go.is_contiguous(),
              "attention_backward: q, k, v, grad_out must be contiguous");
  TORCH_CHECK(k.sizes() == v.sizes() && go.sizes() == q.sizes() && q.size(0) == k.size(0) &&
                  q.size(3) == k.size(3) && q.size(1) % k.size(1) == 0,
              "attention_backward: q, grad_out [B, H, Lq, D] against k, v [B, KVH, Lk, D], H a multiple of KVH");
  TORCH_CHECK(q.size(3) % 16 == 0, "attention_backward: head_dim must be a multiple of 16");
  const float* mp = nullptr;
  int64_t ms[3] = {0, 0, 0};
  if (mask.has_value()) {
    const at::Tensor& m = *mask;
    TORCH_CHECK(m.scalar_type() == at::kFloat && m.dim() == 4 && m.size(2) == q.size(2) && m.size(3) == k.size(2) &&
                    (m.size(0) == 1 || m.size(0) == q.size(0)) && (m.size(1) == 1 || m.size(1) == q.size(1)) &&
                    m.stride(3) == 1,
                "attention_backward: mask must be float32 [B or 1, H or 1, Lq, Lk], the last dimension contiguous");
    mp = m.data_ptr<float>();
    ms[0] = m.size(0) == 1 ? 0 : m.stride(0);
    ms[1] = m.size(1) == 1 ? 0 : m.stride(1);
    ms[2] = m.stride(2);
  }
  auto f32 = q.options().dtype(at::kFloat);
  if (q.size(2) == 0 || k.size(2) == 0) {  // no query rows, or no key to read: every gradient is 0
    return {at::zeros(q.sizes(), f32), at::zeros(k.sizes(), f32), at::zeros(v.sizes(), f32)};
  }
  auto dq = at::empty(q.sizes(), f32), dk = at::empty(k.sizes(), f32), dv = at::empty(v.sizes(), f32);
  const float sc = static_cast<float>(scale);
  if (dtype == at::kBFloat16) {
    run<c10::BFloat16>(q, k, v, go, mp, ms, causal, sc, dq, dk, dv);
  } else {
    TORCH_CHECK(dtype == at::kFloat, "attention_backward: bfloat16 or float32");
    run<float>(q, k, v, go, mp, ms, causal, sc, dq, dk, dv);
  }
  return {dq, dk, dv};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(lit_rl, m) {
  m.def("attention_backward(Tensor q, Tensor k, Tensor v, Tensor grad_out, Tensor? mask, bool causal, float scale)"
        " -> (Tensor, Tensor, Tensor)");
  m.impl("attention_backward", c10::DispatchKey::CPU, TORCH_FN(attention_backward));
}
