// Weight-only quantized linear layers for the CPU: y = x @ W.T + b with W stored as int8 (one scale per
// output row) or int4 (a scale and a float zero per row and group of input columns), x and y float32.
//
// Decoding reads every weight once per step and does little arithmetic with it, so a decode step is
// bound by the bytes of weights it reads: int8 reads a quarter of float32's, int4 an eighth. The
// weights are widened to float32 in registers and never written back; every product and sum is a
// float32 one. torch's own weight-only ops (_weight_int8pack_mm, _weight_int4pack_mm_for_cpu) have
// fast paths for AVX-512 only: on our AVX2 machines they were 2x (batch 1) to 16x (batch 16) slower
// than the dense float32 matmul they should beat.
//
// Layouts (row n of the weight, K input columns):
//   int8: int8 [N, K]; scales float [N]; W[n, k] = scales[n] * q[n, k].
//   int4: uint8 [N, K / 2], each run of 32 columns in 16 bytes: byte j holds column j in its low nibble and
//         column j + 16 in its high nibble (int4_block reads a run with one load and shifts, x permuted
//         to its column order);
//         scales, zeros float [N, K / group]; W[n, k] = q[n, k] * scales[n, g] + zeros[n, g], g = k / group.
// Work is split over blocks of output rows; each block's weights stay in cache while every row of x
// passes over them.

// Not torch/extension.h: paged_attention.cpp says why.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PAGEDSERVE_AVX2 1
#endif

namespace {

constexpr int64_t kRowsPerBlock = 3;  // output rows (weight rows) one microkernel call covers
constexpr int64_t kMaxBatch = 4;      // rows of x one microkernel call covers
// How far ahead of its loads a weight row is prefetched: the hardware prefetcher alone left these
// compute-heavy loops reading DRAM at 8-15 GB/s (1 thread: 2-2.7x slower at 1 row of x; flat from 4 KiB).
// Only when x's rows fit one pass (decode at small batches, bound by the bytes it reads): at more rows the
// loops are bound by arithmetic, and the prefetches cost int8 at 16 rows a third of its speed.
constexpr int64_t kPrefetchBytes = 4096;

#ifdef PAGEDSERVE_AVX2
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// MB rows of x times NB int8 weight rows (ldx, ldw apart) over their first K columns (K % 8 == 0 here; the
// tail is the caller's).
template <int MB, int NB, bool PF>
inline void int8_block(const float* x, int64_t ldx, const int8_t* w, int64_t ldw, int64_t K,
                       float out[kMaxBatch][kRowsPerBlock]) {
  __m256 acc[MB][NB];
  for (int m = 0; m < MB; ++m)
    for (int n = 0; n < NB; ++n) acc[m][n] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 8) {
    for (int n = 0; n < NB; ++n) {  // one widened weight vector live at a time: no accumulator spills
      if (PF && k % 64 == 0) _mm_prefetch(reinterpret_cast<const char*>(w + n * ldw + k) + kPrefetchBytes, _MM_HINT_T0);
      const __m256 wv =
          _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w + n * ldw + k))));
      for (int m = 0; m < MB; ++m) acc[m][n] = _mm256_fmadd_ps(_mm256_loadu_ps(x + m * ldx + k), wv, acc[m][n]);
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int n = 0; n < NB; ++n) out[m][n] = hsum(acc[m][n]);
}

// Column order inside a run of 32 as int4_block reads it: step s (0..3) of a run takes 8 columns, lane i
// of the 8 being byte (i % 4) * 4 + s of the run, low nibble for i < 4 and high nibble for i >= 4. x is
// permuted into this order once per call (int4_linear), so the weights need no shuffles at all.
inline int64_t int4_lane_column(int64_t step, int64_t lane) { return (lane % 4) * 4 + step + (lane / 4) * 16; }

// MB rows of (permuted) x times NB int4 weight rows over all K columns (K % 32 == 0, group % 32 == 0). Per
// group the products with the bare integers q are summed first and scaled once: sum_k x (q s + z) over a
// group is s * sum_k x q + z * sum_k x, and xsum [MB, groups] holds the second sum. A run of 32 columns
// is one 16-byte load broadcast to both halves of a register; a variable shift puts the high nibbles in
// the upper half, and each step shifts, masks and converts 8 columns.
template <int MB, int NB, bool PF>
inline void int4_block(const float* x, int64_t ldx, const float* xsum, const uint8_t* w, const float* scales,
                       const float* zeros, int64_t K, int64_t group, float out[kMaxBatch][kRowsPerBlock]) {
  const int64_t groups = K / group;
  const __m256i low = _mm256_set1_epi32(0x0F), halves = _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4);
  // Independent sums per step for few rows: one sum per (m, n) would chain 4 dependent FMAs per run.
  constexpr int kSplit = MB == 1 ? 4 : (MB == 2 ? 2 : 1);
  __m256 total[MB][NB];
  for (int m = 0; m < MB; ++m)
    for (int n = 0; n < NB; ++n) total[m][n] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m256 acc[MB][NB][kSplit];
    for (int m = 0; m < MB; ++m)
      for (int n = 0; n < NB; ++n)
        for (int i = 0; i < kSplit; ++i) acc[m][n][i] = _mm256_setzero_ps();
    for (int64_t k = g * group; k < (g + 1) * group; k += 32) {
      for (int n = 0; n < NB; ++n) {
        if (PF) _mm_prefetch(reinterpret_cast<const char*>(w + n * (K / 2) + k / 2) + kPrefetchBytes, _MM_HINT_T0);
        const __m256i words = _mm256_srlv_epi32(
            _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + n * (K / 2) + k / 2))),
            halves);
        for (int step = 0; step < 4; ++step) {
          const __m256 wv = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(words, 8 * step), low));
          for (int m = 0; m < MB; ++m)
            acc[m][n][step % kSplit] =
                _mm256_fmadd_ps(_mm256_loadu_ps(x + m * ldx + k + step * 8), wv, acc[m][n][step % kSplit]);
        }
      }
    }
    for (int n = 0; n < NB; ++n) {
      const __m256 sv = _mm256_broadcast_ss(scales + n * groups + g);
      for (int m = 0; m < MB; ++m) {
        __m256 sum = acc[m][n][0];
        for (int i = 1; i < kSplit; ++i) sum = _mm256_add_ps(sum, acc[m][n][i]);
        total[m][n] = _mm256_fmadd_ps(sum, sv, total[m][n]);
      }
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int n = 0; n < NB; ++n) {
      float zero_terms = 0.f;
      for (int64_t g = 0; g < groups; ++g) zero_terms += zeros[n * groups + g] * xsum[m * groups + g];
      out[m][n] = hsum(total[m][n]) + zero_terms;
    }
}
#endif

// Portable fallbacks (and the int8 K tail): plain loops the compiler vectorises as it can.
inline float int8_dot(const float* x, const int8_t* w, int64_t begin, int64_t end) {
  float s = 0.f;
  for (int64_t k = begin; k < end; ++k) s += x[k] * static_cast<float>(w[k]);
  return s;
}

inline float int4_dot(const float* x, const uint8_t* w, const float* scales, const float* zeros, int64_t K,
                      int64_t group) {
  float s = 0.f;
  for (int64_t k = 0; k < K; k += 32) {
    const float sc = scales[k / group], z = zeros[k / group];
    const uint8_t* b = w + k / 2;
    for (int j = 0; j < 16; ++j) {
      s += x[k + j] * (static_cast<float>(b[j] & 0x0F) * sc + z);
      s += x[k + 16 + j] * (static_cast<float>(b[j] >> 4) * sc + z);
    }
  }
  return s;
}

// Dispatch a block of (mb <= 4) x (nb <= 3) to the microkernel instantiated for it.
template <template <int, int> class Kernel, typename... Args>
inline void dispatch(int mb, int nb, Args&&... args) {
#define PAGEDSERVE_CASE(M, N) \
  if (mb == M && nb == N) return Kernel<M, N>::run(std::forward<Args>(args)...);
  PAGEDSERVE_CASE(4, 3) PAGEDSERVE_CASE(4, 2) PAGEDSERVE_CASE(4, 1)
  PAGEDSERVE_CASE(3, 3) PAGEDSERVE_CASE(3, 2) PAGEDSERVE_CASE(3, 1)
  PAGEDSERVE_CASE(2, 3) PAGEDSERVE_CASE(2, 2) PAGEDSERVE_CASE(2, 1)
  PAGEDSERVE_CASE(1, 3) PAGEDSERVE_CASE(1, 2) PAGEDSERVE_CASE(1, 1)
#undef PAGEDSERVE_CASE
}

#ifdef PAGEDSERVE_AVX2
template <int MB, int NB>
struct Int8Kernel {
  static void run(const float* x, int64_t ldx, const int8_t* w, int64_t ldw, int64_t K, bool prefetch,
                  float (*out)[kRowsPerBlock]) {
    prefetch ? int8_block<MB, NB, true>(x, ldx, w, ldw, K, out) : int8_block<MB, NB, false>(x, ldx, w, ldw, K, out);
  }
};
template <int MB, int NB>
struct Int4Kernel {
  static void run(const float* x, int64_t ldx, const float* xsum, const uint8_t* w, const float* s, const float* z,
                  int64_t K, int64_t group, bool prefetch, float (*out)[kRowsPerBlock]) {
    prefetch ? int4_block<MB, NB, true>(x, ldx, xsum, w, s, z, K, group, out)
             : int4_block<MB, NB, false>(x, ldx, xsum, w, s, z, K, group, out);
  }
};
#endif

void check_common(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& out) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat, "x, out: float32");
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous() && out.is_contiguous(), "inputs must be contiguous");
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2 && out.size(0) == x.size(0) && out.size(1) == weight.size(0),
              "x [M, K], out [M, N]");
}

}  // namespace

// out[m, n] = scales[n] * sum_k x[m, k] * weight[n, k]
void int8_linear(at::Tensor out, at::Tensor x, at::Tensor weight, at::Tensor scales) {
  check_common(x, weight, out);
  TORCH_CHECK(weight.scalar_type() == at::kChar && weight.size(1) == x.size(1), "weight: int8 [N, K]");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.numel() == weight.size(0), "scales: float32 [N]");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  const float* xp = x.data_ptr<float>();
  const int8_t* wp = weight.data_ptr<int8_t>();
  const float* sp = scales.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t blocks = (N + kRowsPerBlock - 1) / kRowsPerBlock;
  const bool prefetch = M <= kMaxBatch;
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    float acc[kMaxBatch][kRowsPerBlock];
    for (int64_t b = begin; b < end; ++b) {
      const int64_t n0 = b * kRowsPerBlock, nb = std::min(kRowsPerBlock, N - n0);
      for (int64_t m0 = 0; m0 < M; m0 += kMaxBatch) {
        const int64_t mb = std::min(kMaxBatch, M - m0);
        int64_t done = 0;
#ifdef PAGEDSERVE_AVX2
        done = K - K % 8;
        dispatch<Int8Kernel>(static_cast<int>(mb), static_cast<int>(nb), xp + m0 * K, K, wp + n0 * K, K, done, prefetch, acc);
#endif
        for (int64_t m = 0; m < mb; ++m)
          for (int64_t n = 0; n < nb; ++n) {
            const float tail = int8_dot(xp + (m0 + m) * K, wp + (n0 + n) * K, done, K);
            op[(m0 + m) * N + n0 + n] = sp[n0 + n] * ((done ? acc[m][n] : 0.f) + tail);
          }
      }
    }
  });
}

// out[m, n] = sum_k x[m, k] * (q[n, k] * scales[n, k / group] + zeros[n, k / group])
void int4_linear(at::Tensor out, at::Tensor x, at::Tensor weight, at::Tensor scales, at::Tensor zeros,
                 int64_t group) {
  check_common(x, weight, out);
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  TORCH_CHECK(weight.scalar_type() == at::kByte && weight.size(1) * 2 == K, "weight: uint8 [N, K / 2]");
  TORCH_CHECK(group % 32 == 0 && K % group == 0, "group must be a multiple of 32 dividing K");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && zeros.scalar_type() == at::kFloat &&
                  scales.is_contiguous() && zeros.is_contiguous() && scales.numel() == N * (K / group) &&
                  zeros.numel() == N * (K / group),
              "scales, zeros: float32 [N, K / group]");
  const int64_t groups = K / group;
  const float* xp = x.data_ptr<float>();
  const uint8_t* wp = weight.data_ptr<uint8_t>();
  const float* sp = scales.data_ptr<float>();
  const float* zp = zeros.data_ptr<float>();
  float* op = out.data_ptr<float>();
#ifdef PAGEDSERVE_AVX2
  std::vector<float> xsum(M * groups, 0.f);  // each row's sum over each group of columns (the zero terms)
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < K; ++k) xsum[m * groups + k / group] += xp[m * K + k];
  std::vector<float> x_lanes(M * K);  // x in the kernel's column order (int4_lane_column)
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < K; k += 32)
      for (int64_t step = 0; step < 4; ++step)
        for (int64_t lane = 0; lane < 8; ++lane)
          x_lanes[m * K + k + step * 8 + lane] = xp[m * K + k + int4_lane_column(step, lane)];
#endif
  const int64_t blocks = (N + kRowsPerBlock - 1) / kRowsPerBlock;
  const bool prefetch = M <= kMaxBatch;
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    float acc[kMaxBatch][kRowsPerBlock];
    for (int64_t b = begin; b < end; ++b) {
      const int64_t n0 = b * kRowsPerBlock, nb = std::min(kRowsPerBlock, N - n0);
      for (int64_t m0 = 0; m0 < M; m0 += kMaxBatch) {
        const int64_t mb = std::min(kMaxBatch, M - m0);
#ifdef PAGEDSERVE_AVX2
        dispatch<Int4Kernel>(static_cast<int>(mb), static_cast<int>(nb), x_lanes.data() + m0 * K, K, xsum.data() + m0 * groups,
                             wp + n0 * (K / 2), sp + n0 * groups, zp + n0 * groups, K, group, prefetch, acc);
#else
        for (int64_t m = 0; m < mb; ++m)
          for (int64_t n = 0; n < nb; ++n)
            acc[m][n] = int4_dot(xp + (m0 + m) * K, wp + (n0 + n) * (K / 2), sp + (n0 + n) * groups,
                                 zp + (n0 + n) * groups, K, group);
#endif
        for (int64_t m = 0; m < mb; ++m)
          for (int64_t n = 0; n < nb; ++n) op[(m0 + m) * N + n0 + n] = acc[m][n];
      }
    }
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("int8_linear", &int8_linear, "Weight-only int8 linear, per-row scales (CPU, float32)");
  m.def("int4_linear", &int4_linear, "Weight-only int4 linear, grouped scales and zeros (CPU, float32)");
}
