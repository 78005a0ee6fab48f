// A mixture-of-experts layer's experts for the CPU, float32 or bfloat16: from the router's choice (expert ids
// and weights per token) to the layer's output, in one call.
//
// Why: at decode sizes the torch path spends as long on bookkeeping (sort the (token, expert) pairs,
// gather, scatter, combine: a dozen small ops per layer) as on the expert weights it reads, and torch's
// grouped matmul multiplies one or two rows by a weight with strided loads. Here each expert's weights are
// packed into panels of 16 output rows stored input-major ([E, N / 16, K, 16]), so a panel is one
// contiguous stream and every weight load feeds up to kMaxRows rows' FMAs (12 with AVX-512, 6 with AVX2).
//
// Steps, each a parallel loop (work_sharing.h for the first two): (1) per (expert, gate panel) the gate
// and up panels for the expert's rows, silu(gate) * up into act [pairs, I]; (2) per (expert, down panel)
// act @ W2.T into y [pairs, H]; (3) per token the sum over its k experts of weight * y, in the router's
// slot order. Every product and
// sum is float32; only the order of the sums within a dot product differs from a matmul's.
//
// bfloat16 experts (where the CPU has AVX512_BF16) are packed in pairs of input columns, [E, N / 16, K / 2, 16,
// 2] (panel_linear.cpp's bfloat16 layout), and multiplied by vdpbf16ps, float32 sums; silu(gate) * up is
// rounded to bfloat16 once (the down projection's input), the output is float32 until the caller rounds it.

// Not torch/extension.h: paged_attention.cpp says why.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "vec16.h"
#include "work_sharing.h"

namespace {

constexpr int64_t kPanel = 16;   // output rows per packed panel
#ifdef PAGEDSERVE_VEC16
constexpr int64_t kMaxRows = pagedserve::kVec16TileRows;  // rows of x one microkernel call covers
#else
constexpr int64_t kMaxRows = 6;
#endif
// How far ahead of its loads a panel is prefetched (the hardware prefetcher alone leaves DRAM streams of
// compute-heavy loops well under the bandwidth; ops/cpu/panel_linear.cpp measured it).
constexpr int64_t kPrefetchFloats = 1024;

// out[m][0..16) = sum_k rows[m][k] * panel[k][0..16), for m < mb (mb <= kMaxRows). PF: prefetch ahead, for
// an expert whose rows fit one pass (bound by the bytes it reads); with more rows the loop is bound by
// arithmetic and the prefetches halved its speed.
template <int MB, bool PF>
inline void panel_kernel(const float* const* rows, const float* panel, int64_t K, float out[kMaxRows][kPanel]) {
#ifdef PAGEDSERVE_VEC16
  using pagedserve::Vec16;
  Vec16 acc[MB];
  PAGEDSERVE_UNROLL for (int m = 0; m < MB; ++m) acc[m] = Vec16::zero();
  for (int64_t k = 0; k < K; ++k) {
    if (PF) _mm_prefetch(reinterpret_cast<const char*>(panel + k * kPanel + kPrefetchFloats), _MM_HINT_T0);  // a line per k
    const Vec16 column = Vec16::load(panel + k * kPanel);
    PAGEDSERVE_UNROLL for (int m = 0; m < MB; ++m) acc[m] = fmadd(Vec16::broadcast(rows[m] + k), column, acc[m]);
  }
  PAGEDSERVE_UNROLL for (int m = 0; m < MB; ++m) acc[m].store(out[m]);
#else
  for (int m = 0; m < MB; ++m) {
    for (int r = 0; r < kPanel; ++r) out[m][r] = 0.f;
    for (int64_t k = 0; k < K; ++k)
      for (int r = 0; r < kPanel; ++r) out[m][r] += rows[m][k] * panel[k * kPanel + r];
  }
#endif
}

inline void panel_rows(int mb, bool prefetch, const float* const* rows, const float* panel, int64_t K,
                       float out[kMaxRows][kPanel]) {
  pagedserve::with_rows<kMaxRows>(mb, [&](auto size) {
    constexpr int MB = decltype(size)::value;
    prefetch ? panel_kernel<MB, true>(rows, panel, K, out) : panel_kernel<MB, false>(rows, panel, K, out);
  });
}

#if defined(__AVX512BF16__)
// panel_kernel over bfloat16: rows bfloat16 [K], panel [K / 2][16][2], K even.
template <int MB, bool PF>
inline void panel_kernel(const uint16_t* const* rows, const uint16_t* panel, int64_t K,
                         float out[kMaxRows][kPanel]) {
  __m512 acc[MB];
  PAGEDSERVE_UNROLL for (int m = 0; m < MB; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t u = 0; u < K / 2; ++u) {  // a 64-byte line per pair of columns
    if (PF) _mm_prefetch(reinterpret_cast<const char*>(panel + u * 2 * kPanel) + 4 * kPrefetchFloats, _MM_HINT_T0);
    const __m512bh pair = (__m512bh)_mm512_loadu_si512(panel + u * 2 * kPanel);
    PAGEDSERVE_UNROLL for (int m = 0; m < MB; ++m) {
      int32_t x;
      std::memcpy(&x, rows[m] + 2 * u, 4);
      acc[m] = _mm512_dpbf16_ps(acc[m], (__m512bh)_mm512_set1_epi32(x), pair);
    }
  }
  PAGEDSERVE_UNROLL for (int m = 0; m < MB; ++m) _mm512_storeu_ps(out[m], acc[m]);
}

inline void panel_rows(int mb, bool prefetch, const uint16_t* const* rows, const uint16_t* panel, int64_t K,
                       float out[kMaxRows][kPanel]) {
  pagedserve::with_rows<kMaxRows>(mb, [&](auto size) {
    constexpr int MB = decltype(size)::value;
    prefetch ? panel_kernel<MB, true>(rows, panel, K, out) : panel_kernel<MB, false>(rows, panel, K, out);
  });
}
#endif

// The activations' element: float32 stays, bfloat16 rounds to nearest even (finite values).
inline void store_act(float v, float& to) { to = v; }
inline void store_act(float v, uint16_t& to) { to = pagedserve::to_bfloat16(v); }

inline float silu(float g) { return g / (1.f + std::exp(-g)); }

struct WorkItem {
  int64_t expert, panel;
};

}  // namespace

// W [E, N, K] -> [E, N / 16, K, 16]: the panel layout above (N % 16 == 0).
at::Tensor moe_pack_panels(at::Tensor weight) {
  TORCH_CHECK(weight.dim() == 3 && weight.scalar_type() == at::kFloat && weight.size(1) % kPanel == 0,
              "weight: float32 [E, N, K] with N % 16 == 0");
  const int64_t E = weight.size(0), N = weight.size(1), K = weight.size(2);
  return weight.reshape({E, N / kPanel, kPanel, K}).transpose(2, 3).contiguous();
}

// The experts' checks shared by both element types: out and weights float32, ids int64, all contiguous.
void check_experts(const at::Tensor& out, const at::Tensor& x, const at::Tensor& ids, const at::Tensor& weights,
                   const at::Tensor& w13, const at::Tensor& w2) {
  TORCH_CHECK(out.scalar_type() == at::kFloat && weights.scalar_type() == at::kFloat && ids.scalar_type() == at::kLong,
              "out, weights: float32; ids: int64");
  TORCH_CHECK(x.is_contiguous() && out.is_contiguous() && ids.is_contiguous() && weights.is_contiguous() &&
                  w13.is_contiguous() && w2.is_contiguous(),
              "inputs must be contiguous");
}

// Elem: float (float32 weights and x, [E, N / 16, K, 16] panels) or uint16_t (bfloat16, [E, N / 16, K / 2, 16,
// 2]): the same number of elements per panel, at the same offsets. I: the experts' intermediate size.
template <typename Elem>
void run_experts(at::Tensor out, at::Tensor x, at::Tensor ids, at::Tensor weights, at::Tensor w13,
                 at::Tensor w2, int64_t expert_start, int64_t I) {
  const int64_t T = x.size(0), H = x.size(1), k = ids.size(1), E = w13.size(0);
  const Elem* xp = static_cast<const Elem*>(x.data_ptr());
  const int64_t* idp = ids.data_ptr<int64_t>();
  const float* wp = weights.data_ptr<float>();
  const Elem* w13p = static_cast<const Elem*>(w13.data_ptr());
  const Elem* w2p = static_cast<const Elem*>(w2.data_ptr());
  float* op = out.data_ptr<float>();

  // Pairs grouped by local expert: pair p is (token pair_token[p], slot), its rows of act and y are p.
  std::vector<int64_t> count(E + 1, 0), pair_of(T * k, -1);
  for (int64_t i = 0; i < T * k; ++i) {
    const int64_t e = idp[i] - expert_start;
    if (e >= 0 && e < E) ++count[e + 1];
  }
  for (int64_t e = 0; e < E; ++e) count[e + 1] += count[e];
  const int64_t pairs = count[E];
  std::vector<int64_t> pair_token(pairs), fill(count.begin(), count.end() - 1);
  for (int64_t i = 0; i < T * k; ++i) {
    const int64_t e = idp[i] - expert_start;
    if (e >= 0 && e < E) {
      pair_of[i] = fill[e]++;
      pair_token[pair_of[i]] = i / k;
    }
  }
  std::vector<Elem> act(pairs * I);
  std::vector<float> y(pairs * H);
  // Panel-major order: threads take contiguous chunks of items, and this way each chunk holds a share of
  // every expert's panels, so chunks cost about the same however the tokens routed.
  std::vector<WorkItem> up_items, down_items;
  for (int64_t p = 0; p < std::max(I, H) / kPanel; ++p)
    for (int64_t e = 0; e < E; ++e) {
      if (count[e + 1] == count[e]) continue;
      if (p < I / kPanel) up_items.push_back({e, p});
      if (p < H / kPanel) down_items.push_back({e, p});
    }

  // (1) act[p, panel] = silu(x W_gate.T) * (x W_up.T)
  pagedserve::shared_for(static_cast<int64_t>(up_items.size()), [&](int64_t begin, int64_t end) {
    float gate[kMaxRows][kPanel], up[kMaxRows][kPanel];
    const Elem* rows[kMaxRows];
    for (int64_t it = begin; it < end; ++it) {
      const auto [e, p] = up_items[it];
      const Elem* gate_panel = w13p + (e * (2 * I / kPanel) + p) * H * kPanel;
      const Elem* up_panel = gate_panel + (I / kPanel) * H * kPanel;
      for (int64_t r0 = count[e]; r0 < count[e + 1]; r0 += kMaxRows) {
        const int mb = static_cast<int>(std::min(kMaxRows, count[e + 1] - r0));
        for (int m = 0; m < mb; ++m) rows[m] = xp + pair_token[r0 + m] * H;
        const bool prefetch = count[e + 1] - count[e] <= kMaxRows;
        panel_rows(mb, prefetch, rows, gate_panel, H, gate);
        panel_rows(mb, prefetch, rows, up_panel, H, up);
        for (int m = 0; m < mb; ++m)
          for (int r = 0; r < kPanel; ++r) store_act(silu(gate[m][r]) * up[m][r], act[(r0 + m) * I + p * kPanel + r]);
      }
    }
  });
  // (2) y[p, panel] = act[p] W_down.T
  pagedserve::shared_for(static_cast<int64_t>(down_items.size()), [&](int64_t begin, int64_t end) {
    float acc[kMaxRows][kPanel];
    const Elem* rows[kMaxRows];
    for (int64_t it = begin; it < end; ++it) {
      const auto [e, p] = down_items[it];
      const Elem* panel = w2p + (e * (H / kPanel) + p) * I * kPanel;
      for (int64_t r0 = count[e]; r0 < count[e + 1]; r0 += kMaxRows) {
        const int mb = static_cast<int>(std::min(kMaxRows, count[e + 1] - r0));
        for (int m = 0; m < mb; ++m) rows[m] = act.data() + (r0 + m) * I;
        panel_rows(mb, count[e + 1] - count[e] <= kMaxRows, rows, panel, I, acc);
        for (int m = 0; m < mb; ++m) std::copy(acc[m], acc[m] + kPanel, y.data() + (r0 + m) * H + p * kPanel);
      }
    }
  });
  // (3) out[t] = sum over slots of weight * y, in slot order
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      float* o = op + t * H;
      std::fill(o, o + H, 0.f);
      for (int64_t s = 0; s < k; ++s) {
        const int64_t p = pair_of[t * k + s];
        if (p < 0) continue;
        const float w = wp[t * k + s];
        const float* yp = y.data() + p * H;
        for (int64_t h = 0; h < H; ++h) o[h] += w * yp[h];
      }
    }
  });
}

// out [T, H] = sum over slots s of weights[t, s] * expert(ids[t, s] - expert_start)(x[t]), experts outside
// [0, E_local) skipped (another rank's, under expert parallelism). w13: packed [E_local, 2I / 16, H, 16]
// (gate rows, then up rows); w2: packed [E_local, H / 16, I, 16].
void moe_experts(at::Tensor out, at::Tensor x, at::Tensor ids, at::Tensor weights, at::Tensor w13,
                 at::Tensor w2, int64_t expert_start) {
  check_experts(out, x, ids, weights, w13, w2);
  TORCH_CHECK(x.scalar_type() == at::kFloat && w13.scalar_type() == at::kFloat && w2.scalar_type() == at::kFloat,
              "x, w13, w2: float32");
  const int64_t H = x.size(1), E = w13.size(0), I = w2.size(2);
  TORCH_CHECK(I % kPanel == 0 && w13.dim() == 4 && w13.size(1) * kPanel == 2 * I && w13.size(2) == H &&
                  w2.dim() == 4 && w2.size(0) == E && w2.size(1) * kPanel == H,
              "w13 [E, 2I/16, H, 16], w2 [E, H/16, I, 16], I % 16 == 0");
  run_experts<float>(out, x, ids, weights, w13, w2, expert_start, I);
}

// moe_experts over bfloat16 x and experts packed in pairs of columns: w13 [E_local, 2I / 16, H / 2, 16, 2],
// w2 [E_local, H / 16, I / 2, 16, 2]; out float32.
void moe_experts_bf16(at::Tensor out, at::Tensor x, at::Tensor ids, at::Tensor weights, at::Tensor w13,
                      at::Tensor w2, int64_t expert_start) {
  check_experts(out, x, ids, weights, w13, w2);
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w13.scalar_type() == at::kBFloat16 &&
                  w2.scalar_type() == at::kBFloat16, "x, w13, w2: bfloat16");
  const int64_t H = x.size(1), E = w13.size(0), I = 2 * w2.size(2);
  TORCH_CHECK(I % kPanel == 0 && H % 2 == 0 && w13.dim() == 5 && w13.size(1) * kPanel == 2 * I &&
                  w13.size(2) * 2 == H && w2.dim() == 5 && w2.size(0) == E && w2.size(1) * kPanel == H,
              "w13 [E, 2I/16, H/2, 16, 2], w2 [E, H/16, I/2, 16, 2], I % 16 == 0, H even");
#if defined(__AVX512BF16__)
  run_experts<uint16_t>(out, x, ids, weights, w13, w2, expert_start, I);
#else
  TORCH_CHECK(false, "moe_experts_bf16 needs AVX512_BF16 (bfloat16_experts() is false in this build)");
#endif
}

bool bfloat16_experts() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("moe_pack_panels", &moe_pack_panels, "Pack expert weights [E, N, K] into 16-row panels (CPU, float32)");
  m.def("moe_experts", &moe_experts, "A MoE layer's experts from the router's choice (CPU, float32)");
  m.def("moe_experts_bf16", &moe_experts_bf16, "moe_experts over bfloat16 pair panels (CPU, AVX512_BF16)");
  m.def("bfloat16_experts", &bfloat16_experts, "Whether this build runs moe_experts_bf16");
}
