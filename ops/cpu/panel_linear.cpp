// Linear layers for the CPU over weights in panels of 16 output rows: y = x @ W.T, x and y float32, W stored as
// float32 (the dense method's path), int8 (one scale per output row) or int4 (a scale and a float zero per
// output row and group of input columns).
//
// Quantized weights are widened to float32 in registers (and at most 16 KiB of them at a time into an L1
// buffer), never in full; every product and sum is a float32 one. torch's own weight-only ops
// (_weight_int8pack_mm, _weight_int4pack_mm_for_cpu) were 2x (batch 1) to 16x (batch 16) slower than the
// dense float32 matmul they should beat on our AVX2 machines, and _weight_int8pack_mm ran at 2.5 GMAC/s on an
// AVX-512 one (these loops: 40-190). For float32 weights these same loops beat oneDNN's prepacked matmul by
// 1.1-1.4x from 1 to 64 rows of x (2-core AMD EPYC, AVX2). Vectors are vec16.h's: one AVX-512 register or
// two AVX2 ones per panel column (AVX-512 did 1.4-1.6x the multiply-adds per second at 16-256 rows).
//
// Layout: output rows in panels of 16 (the last one padded with zero rows), each panel column-major, so
// that one input column's 16 weights are adjacent:
//   float32: float [P, K, 16]: W[16 p + j, k] = w[p, k, j].
//   int8: int8 [P, K, 16]: W[16 p + j, k] = scales[16 p + j] * q[p, k, j].
//   int4: uint8 [P, K / 2, 16]: byte j of column pair i holds row 16 p + j's column 2 i in its low nibble and
//         column 2 i + 1 in its high one; W[n, k] = q * scales[n, g] + zeros[n, g], g = k / group (scales,
//         zeros [N, K / group]; K and the group even). Pairs along K, not rows 0-7 and 8-15 of one column (this
//         file's layout before): one 16-byte load then widens to two whole columns, half the instructions per
//         column with AVX-512 (int4 decode at batch 1 and 16 was bound by widening, not by bytes).
// Every kernel keeps [rows of x] x [16 output rows] accumulators and broadcasts one x element per column:
// x is read 4 bytes per 16 multiply-adds. (Dot products along K, this file's first design, read x 32 bytes
// per 8, from L2 once x outgrew L1, and widened each weight once per 4 rows of x.)
//   - A few rows of x (decode at small batches, bound by the bytes of weights read): the panel's weights are
//     widened in registers as they stream past.
//   - More rows (bound by arithmetic): the first 4 rows of x multiply a chunk of the panel as it is widened,
//     which also writes the widened chunk to an L1 buffer; float32 tiles of 12 x 16 (AVX2: 6 x 16) then
//     multiply it by every other row of x. The widening is paid once per call, not once per few rows, and
//     overlaps the FMAs.
//     A float32 chunk is its own buffer: it stays in L1 while every tile passes over it.
// Work is shared out over panels in chunks (work_sharing.h).
//
// bfloat16 weights with bfloat16 x, and int8 weights with int8 x (W8A8), multiply without widening: their
// panels are 64-byte units of 16 rows x 4 bytes, one row's 2 (bfloat16) or 4 (int8) consecutive columns each,
//   bfloat16: [P, K / 2, 16, 2]: W[16 p + j, 2 u + b] = w[p, u, j, b];
//   int8 (W8A8): uint8 [P, K4 / 4, 16, 4], K4 = K rounded up to 4: W[16 p + j, 4 u + b] = w[p, u, j, b] - 128;
// and one instruction takes a unit, one row of x's matching 4 bytes broadcast to all 16 lanes, and adds each
// lane's 2 or 4 products to its 32-bit sum: vdpbf16ps (AVX512_BF16, float32 sums: 32 multiply-adds where a
// float32 FMA does 16, reading half the bytes) and vpdpbusd (AVX512-VNNI, int32 sums of unsigned bytes times
// signed ones: 64 per instruction, a quarter of float32's bytes). W8A8 stores its weights plus 128 as unsigned
// bytes, quantizes each row of x on entry, symmetric (x / (max|x| / 127), rounded half to even), and takes
// 128 * the row's sum off each integer sum, which is exact. Where the CPU lacks the instruction,
// bfloat16 widens its panels to float32 in registers (the float32 paths above). W8A8 and W4A8 keep their
// panels and exact integer sums with AVX2, a unit in two 256-bit registers (rows 0-7, 8-15) times x's bytes
// broadcast by vpbroadcastd: vpdpbusd where the CPU has AVX-VNNI (AVX-512's sums, two instructions a unit),
// else vpmaddubsw + vpmaddwd over |q| and x with q's signs (vpmaddubsw saturates int16, which (q + 128) x
// overflows: U8S8Dot). A 2048 -> 1536 layer at 1 / 16 / 64 rows of x, 2 threads, on an Intel AVX-512 host
// built without it: W8A8 ran 5.3 / 1.0 / 1.0x float32 panels with AVX2 alone (its three instructions share two
// ports there: 16 multiply-adds a cycle, float32's FMAs' rate), 7.9 / 2.7 / 2.9x with AVX-VNNI; W4A8 6.9 /
// 1.6 / 1.6x and 8.4 / 2.1 / 2.0x. Only builds without AVX2 run a portable loop of the same integer sums
// (9-25x slower than AVX2 alone for W8A8, 76-160x for W4A8).

// Not torch/extension.h: paged_attention.cpp says why.
#include <ATen/core/Tensor.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <vector>

#include "kernel_capsules.h"
#include "vec16.h"
#include "work_sharing.h"

namespace {

constexpr int64_t kPanel = 16;        // output rows per panel
constexpr int64_t kDirectRows = 4;    // rows of x up to which weights are only widened in registers
#ifdef PAGEDSERVE_VEC16
constexpr int64_t kTileRows = pagedserve::kVec16TileRows;  // rows of x per float32 tile
#endif
constexpr int64_t kChunk = 256;       // input columns widened at a time: 16 KiB of float32, half of L1
// Streaming a panel while doing little arithmetic per byte, the hardware prefetcher alone left these loops
// reading DRAM at 8-15 GB/s; software prefetches this far ahead keep batch-1 decode at the bandwidth.
// float32 panels prefetch 16 KiB ahead into L2: into L1, each core's few line-fill buffers held them at ~24-27
// GB/s where a sum over memory reads 31-33 (2-core EPYC: float32 decode 1.19x / 1.12x at batch 1 / 16 on the
// 56M model, 1.16x / 1.14x on the 600M). The others keep 8 KiB into L1: into L2, int8 at batch 1 on the 600M
// model and bfloat16 at batch 1 ran slower. Except the dot kernels' direct tiles (bfloat16 and W8A8 at up to
// kDirectRows rows), which prefetch like the float32 panels, every kDirectPrefetchStride bytes (the L2's stream
// prefetcher fills the lines between): one L1 prefetch per line held the 600M model's batch-1 step at 0.90-0.92x
// of that (bfloat16 29.5 against 31.3 GB/s, W8A8 28.3 against 30.8; the 56M: 0.92x, 0.91x). Their packed tiles
// (more rows) keep every line into L1: this way they ran 0.78x (16 rows) and 0.93x (64).
constexpr int64_t kPrefetchBytes = 8192;
constexpr int64_t kFloat32PrefetchBytes = 16384;
constexpr int64_t kDirectPrefetchStride = 256;

// One panel: its rows' scales and zeros per group as 16-wide vectors, 0 for the padding rows: params[g][0..15]
// scales, params[g][16..31] zeros. int4 weights carry them in this layout (packed once, with the weight); int8
// scales are gathered per panel (16 floats).
struct Panel {
  int64_t index, rows;  // panel number, real rows in it (16 but in the last panel)
  const float* params;

  Panel(int64_t p, int64_t N) : index(p), rows(std::min(kPanel, N - p * kPanel)), params(nullptr) {}
  const float* scales(int64_t g) const { return params + g * 2 * kPanel; }
  const float* zeros(int64_t g) const { return params + g * 2 * kPanel + kPanel; }
};

// Where a call's results go: out [M, N], float32 or bfloat16 (rounded once, to nearest even), plus the bias
// (float32 [N]) when there is one. Writing the caller's dtype here spares it a pass over out to convert it.
struct Output {
  void* data;
  int64_t N;
  bool bf16;
  const float* bias;
};

Output output_of(const at::Tensor& out, const std::optional<at::Tensor>& bias, int64_t M) {
  TORCH_CHECK(out.scalar_type() == at::kFloat || out.scalar_type() == at::kBFloat16, "out: float32 or bfloat16");
  TORCH_CHECK(out.is_contiguous() && out.dim() == 2 && out.size(0) == M, "out: contiguous [M, N]");
  const int64_t N = out.size(1);
  TORCH_CHECK(!bias || (bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N),
              "bias: float32 [N]");
  return {out.data_ptr(), N, out.scalar_type() == at::kBFloat16, bias ? bias->data_ptr<float>() : nullptr};
}

// Write tiles [rows of x][16]'s first `panel.rows` columns to out.
inline void store_tiles(const float* tiles, int64_t M, const Panel& panel, const Output& out) {
  const int64_t n0 = panel.index * kPanel;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t j = 0; j < panel.rows; ++j) {
      const float v = tiles[m * kPanel + j] + (out.bias ? out.bias[n0 + j] : 0.f);
      if (out.bf16)
        static_cast<uint16_t*>(out.data)[m * out.N + n0 + j] = pagedserve::to_bfloat16(v);
      else
        static_cast<float*>(out.data)[m * out.N + n0 + j] = v;
    }
}

#ifdef PAGEDSERVE_VEC16
using pagedserve::Vec16;

// Software prefetch kAhead bytes ahead of a panel's column k (columns `column_bytes` apart) when called for every
// `step`-th column: once per cache line, also where `step` columns span several (bfloat16 at one row of x: four
// columns of 32 bytes; prefetching only the first of each two lines read the panels slower than no prefetch at
// all, 13-16 against 17-20 GB/s on a 2-core EPYC, Zen 3, AVX2; every line read 17-20). kEveryLine false: once
// per call (float32 panels at few rows of x: one line in four, into L2, whose stream prefetcher fetches the rest;
// every line read no faster there). kLocality: __builtin_prefetch's (3: into L1, 2: into L2).
template <int64_t kAhead = kPrefetchBytes, int kLocality = 3, bool kEveryLine = true>
inline void prefetch_ahead(const void* panel, int64_t k, int64_t column_bytes, int64_t step = 1) {
  const char* ahead = static_cast<const char*>(panel) + k * column_bytes + kAhead;
  const int64_t span = step * column_bytes;
  if (kEveryLine && span > 64) {
    for (int64_t b = 0; b < span; b += 64) __builtin_prefetch(ahead + b, 0, kLocality);
  } else if ((k * column_bytes) % 64 < span) {
    __builtin_prefetch(ahead, 0, kLocality);
  }
}

// A panel's columns as 16 float32 lanes each: float32; int8 as integers; int4 as integers or dequantized.
// `pair(k, a, b)`: columns k and k + 1 (k even); `single(k)`: column k alone (for an odd K: never int4's);
// `prefetch(k)`: prefetch_ahead over the panel's bytes.
struct Float32Columns {
  const float* w;
  Vec16 single(int64_t k) const { return Vec16::load(w + k * kPanel); }
  void pair(int64_t k, Vec16& a, Vec16& b) const { a = single(k), b = single(k + 1); }
  void prefetch(int64_t k, int64_t step = 1) const {
    prefetch_ahead<kFloat32PrefetchBytes, 2, false>(w, k, kPanel * 4, step);
  }
};

struct Int8Columns {
  const int8_t* w;
  Vec16 single(int64_t k) const { return Vec16::from_int8(w + k * kPanel); }
  void pair(int64_t k, Vec16& a, Vec16& b) const { a = single(k), b = single(k + 1); }
  void prefetch(int64_t k, int64_t step = 1) const { prefetch_ahead(w, k, kPanel, step); }
};

// Column k alone out of its pair.
template <typename Columns>
Vec16 single_of_pair(const Columns& columns, int64_t k) {
  Vec16 a, b;
  columns.pair(k - k % 2, a, b);
  return k % 2 ? b : a;
}

struct Int4Columns {
  const uint8_t* w;
  Vec16 single(int64_t k) const { return single_of_pair(*this, k); }
  void pair(int64_t k, Vec16& a, Vec16& b) const { Vec16::from_nibbles(w + k * kPanel / 2, a, b); }
  void prefetch(int64_t k, int64_t step = 1) const { prefetch_ahead(w, k, kPanel / 2, step); }
};

struct Int4DequantizedColumns {
  Int4Columns integers;
  const Panel& panel;
  int64_t group;
  Vec16 single(int64_t k) const { return single_of_pair(*this, k); }
  void pair(int64_t k, Vec16& a, Vec16& b) const {  // k even and the group even: one group for both
    integers.pair(k, a, b);
    const Vec16 scales = Vec16::load(panel.scales(k / group)), zeros = Vec16::load(panel.zeros(k / group));
    a = fmadd(a, scales, zeros), b = fmadd(b, scales, zeros);
  }
  void prefetch(int64_t k, int64_t step = 1) const { integers.prefetch(k, step); }
};

template <int MB, int SPLIT>
using Accumulators = Vec16[SPLIT][MB];

template <int MB, int SPLIT>
inline void zero(Accumulators<MB, SPLIT>& acc) {
  PAGEDSERVE_UNROLL for (int s = 0; s < SPLIT; ++s)
    PAGEDSERVE_UNROLL for (int m = 0; m < MB; ++m) acc[s][m] = Vec16::zero();
}

// acc[s][m] += x[m, k] * column k of the panel for columns [begin, end) (begin even), widened by `columns`
// in pairs, s = k % SPLIT: SPLIT independent sums per accumulator for few rows of x, where one would chain a
// dependent FMA per column.
template <int MB, int SPLIT, typename Columns>
inline void direct_columns(const float* x, int64_t K, int64_t begin, int64_t end, const Columns& columns,
                           Accumulators<MB, SPLIT>& acc) {
  constexpr int kStep = SPLIT < 2 ? 2 : SPLIT;
  int64_t k = begin;
  for (; k + kStep <= end; k += kStep) {
    columns.prefetch(k, kStep);
    PAGEDSERVE_UNROLL for (int s = 0; s < kStep; s += 2) {
      Vec16 a, b;
      columns.pair(k + s, a, b);
      PAGEDSERVE_UNROLL for (int m = 0; m < MB; ++m) {
        acc[s % SPLIT][m] = fmadd(Vec16::broadcast(x + m * K + k + s), a, acc[s % SPLIT][m]);
        acc[(s + 1) % SPLIT][m] = fmadd(Vec16::broadcast(x + m * K + k + s + 1), b, acc[(s + 1) % SPLIT][m]);
      }
    }
  }
  for (; k + 2 <= end; k += 2) {
    Vec16 a, b;
    columns.pair(k, a, b);
    PAGEDSERVE_UNROLL for (int m = 0; m < MB; ++m) {
      acc[0][m] = fmadd(Vec16::broadcast(x + m * K + k), a, acc[0][m]);
      acc[SPLIT - 1][m] = fmadd(Vec16::broadcast(x + m * K + k + 1), b, acc[SPLIT - 1][m]);
    }
  }
  if (k < end) {
    const Vec16 column = columns.single(k);
    PAGEDSERVE_UNROLL for (int m = 0; m < MB; ++m)
      acc[0][m] = fmadd(Vec16::broadcast(x + m * K + k), column, acc[0][m]);
  }
}

// tiles[m] (+)= the SPLIT sums of row m, times `scales` (16 floats) when given.
template <int MB, int SPLIT>
inline void accumulate(const Accumulators<MB, SPLIT>& acc, const float* scales, float* tiles, bool first) {
  PAGEDSERVE_UNROLL for (int m = 0; m < MB; ++m) {
    Vec16 sum = acc[0][m];
    PAGEDSERVE_UNROLL for (int s = 1; s < SPLIT; ++s) sum = sum + acc[s][m];
    float* t = tiles + m * kPanel;
    if (scales) sum = sum * Vec16::load(scales);
    if (!first) sum = sum + Vec16::load(t);
    sum.store(t);
  }
}

// MB (<= 4) rows of x times one int8 panel, widened in registers.
template <int MB, int SPLIT>
void int8_direct(const float* x, int64_t K, const int8_t* w, const Panel& panel, float* tiles) {
  Accumulators<MB, SPLIT> acc;
  zero(acc);
  direct_columns<MB, SPLIT>(x, K, 0, K, Int8Columns{w}, acc);
  accumulate(acc, panel.scales(0), tiles, true);
}

// MB (<= 4) rows of x times one int4 panel, widened in registers. Per group the products with the bare
// integers q are summed first and scaled once: sum_k x (q s + z) over a group is s * sum_k x q + z * sum_k x,
// and xsum [MB, groups] holds the last sum. (Dequantizing each column instead costs two FMAs more per
// column: a fifth more work at one row of x.)
template <int MB, int SPLIT>
void int4_direct(const float* x, int64_t K, int64_t group, const float* xsum, const uint8_t* w, const Panel& panel,
                 float* tiles) {
  const int64_t groups = K / group;
  for (int64_t g = 0; g < groups; ++g) {
    Accumulators<MB, SPLIT> acc;
    zero(acc);
    direct_columns<MB, SPLIT>(x, K, g * group, (g + 1) * group, Int4Columns{w}, acc);
    accumulate(acc, panel.scales(g), tiles, g == 0);
    const Vec16 zeros = Vec16::load(panel.zeros(g));
    for (int m = 0; m < MB; ++m) {
      float* t = tiles + m * kPanel;
      fmadd(zeros, Vec16::broadcast(xsum + m * groups + g), Vec16::load(t)).store(t);
    }
  }
}

// tiles[MB][16] (+)= MB rows of x (K apart) times columns [c, c + kc) of the panel, widened by `columns`, which
// are also written to buffer [kc][16] for the other rows of x.
template <int MB, typename Columns>
void widening_tile(const float* x, int64_t K, int64_t c, int64_t kc, const Columns& columns, float* buffer,
                   float* tiles) {
  Accumulators<MB, 1> acc;
  zero(acc);
  int64_t k = 0;
  for (; k + 2 <= kc; k += 2) {
    columns.prefetch(c + k, 2);
    Vec16 a, b;
    columns.pair(c + k, a, b);
    a.store(buffer + k * kPanel);
    b.store(buffer + (k + 1) * kPanel);
    PAGEDSERVE_UNROLL for (int m = 0; m < MB; ++m) {
      acc[0][m] = fmadd(Vec16::broadcast(x + m * K + c + k), a, acc[0][m]);
      acc[0][m] = fmadd(Vec16::broadcast(x + m * K + c + k + 1), b, acc[0][m]);
    }
  }
  if (k < kc) {
    const Vec16 column = columns.single(c + k);
    column.store(buffer + k * kPanel);
    PAGEDSERVE_UNROLL for (int m = 0; m < MB; ++m)
      acc[0][m] = fmadd(Vec16::broadcast(x + m * K + c + k), column, acc[0][m]);
  }
  accumulate(acc, nullptr, tiles, c == 0);
}

// tiles[MB][16] (+)= MB rows of x (K apart) times buffer [kc][16], the widened columns [c, c + kc). `stream`:
// the buffer is a float32 panel read from memory for the first time, prefetched ahead.
template <int MB>
void float_tile(const float* x, int64_t K, int64_t c, int64_t kc, const float* buffer, float* tiles, bool stream) {
  Accumulators<MB, 1> acc;
  zero(acc);
  for (int64_t k = 0; k < kc; ++k) {
    if (stream) Float32Columns{buffer}.prefetch(k);
    const Vec16 column = Vec16::load(buffer + k * kPanel);
    PAGEDSERVE_UNROLL for (int m = 0; m < MB; ++m)
      acc[0][m] = fmadd(Vec16::broadcast(x + m * K + c + k), column, acc[0][m]);
  }
  accumulate(acc, nullptr, tiles, c == 0);
}

// Rows [m, M) of x times columns [c, c + kc) of a panel, float32 in chunk [kc][16], into tiles [M][16]. `stream`:
// the chunk is read from memory (a float32 panel, not an L1 buffer): the first tile prefetches ahead. Without
// it a 600M model's float32 panels streamed at ~13 GB/s at batch 16, against ~46 at batch 1.
void float_tiles(const float* x, int64_t m, int64_t M, int64_t K, int64_t c, int64_t kc, const float* chunk,
                 float* tiles, bool stream) {
  for (; m + kTileRows <= M; m += kTileRows, stream = false)
    float_tile<kTileRows>(x + m * K, K, c, kc, chunk, tiles + m * kPanel, stream);
  // The rest (fewer than kTileRows rows) in one tile of that many rows.
  pagedserve::with_rows<kTileRows - 1>(static_cast<int>(M - m), [&](auto rows) {
    float_tile<decltype(rows)::value>(x + m * K, K, c, kc, chunk, tiles + m * kPanel, stream);
  });
}

// Every row of x (M > kDirectRows of them) times the panel `columns` widens, chunk by chunk, into tiles [M][16].
template <typename Columns>
void chunked_panel(const float* x, int64_t M, int64_t K, const Columns& columns, float* buffer, float* tiles) {
  for (int64_t c = 0; c < K; c += kChunk) {
    const int64_t kc = std::min(kChunk, K - c);
    widening_tile<kDirectRows>(x, K, c, kc, columns, buffer, tiles);
    float_tiles(x, kDirectRows, M, K, c, kc, buffer, tiles, false);
  }
}

// MB (<= 4) rows of x times one panel, widened in registers by `columns` (float32: read as it is).
template <int MB, int SPLIT, typename Columns>
void direct_panel(const float* x, int64_t K, const Columns& columns, float* tiles) {
  Accumulators<MB, SPLIT> acc;
  zero(acc);
  direct_columns<MB, SPLIT>(x, K, 0, K, columns, acc);
  accumulate(acc, nullptr, tiles, true);
}

// Up to kDirectRows rows of x: direct_panel. Returns whether it took them.
template <typename Columns>
bool few_rows_panel(const float* x, int64_t M, int64_t K, const Columns& columns, float* tiles) {
  switch (M) {
    case 1: return direct_panel<1, 4>(x, K, columns, tiles), true;
    case 2: return direct_panel<2, 2>(x, K, columns, tiles), true;
    case 3: return direct_panel<3, 1>(x, K, columns, tiles), true;
    case 4: return direct_panel<4, 1>(x, K, columns, tiles), true;
  }
  return false;
}

void float32_panel(const float* x, int64_t M, int64_t K, const float* w, float* tiles) {
  if (few_rows_panel(x, M, K, Float32Columns{w}, tiles)) return;
  for (int64_t c = 0; c < K; c += kChunk)
    float_tiles(x, 0, M, K, c, std::min(kChunk, K - c), w + c * kPanel, tiles, true);
}

// tiles [M][16] *= the panel's scales (int8, whose chunked tiles multiply the bare integers).
void scale_tiles(float* tiles, int64_t M, const Panel& panel) {
  const Vec16 scales = Vec16::load(panel.scales(0));
  for (int64_t m = 0; m < M; ++m) (Vec16::load(tiles + m * kPanel) * scales).store(tiles + m * kPanel);
}

// bfloat16 panels widened in registers, for CPUs without AVX512_BF16.
struct Bf16Columns {
  const uint16_t* w;
  Vec16 single(int64_t k) const { return single_of_pair(*this, k); }
  void pair(int64_t k, Vec16& a, Vec16& b) const { Vec16::from_bf16_pairs(w + k * kPanel, a, b); }
  void prefetch(int64_t k, int64_t step = 1) const { prefetch_ahead(w, k, kPanel * 2, step); }
};
#endif

constexpr int64_t kUnitBytes = 64;       // 16 rows x 4 bytes
constexpr int64_t kChunkUnits = 128;     // units per chunk of a panel that tiles of rows pass over: 8 KiB
constexpr int64_t kDotTileRows = 16;     // rows of x per tile: 16 accumulators + a unit + a broadcast

// W8A8's and W4A8's integer sums: vpdpbusd over zmm (AVX512-VNNI), else over pairs of ymm (AVX2, below).
#if defined(__AVX512VNNI__) || defined(__AVX2__)
#define PAGEDSERVE_INT8_DOT 1
#endif

#if defined(__AVX512BF16__) || defined(PAGEDSERVE_INT8_DOT)
// A dot policy: one step of dot_tile over a panel. Acc the 16 sums (float32 or int32); Unit what a step
// reads of the panel (64 bytes at `at(w, s)`) in registers; dot(acc, x, unit) adds its products with one row
// of x's kXBytes bytes for that step; kUnits: 4-byte units of x per step (W4A8 over ymm takes two at once);
// kTileRows: rows of x per tile; kSplit[m - 1]: sums per row for m direct rows (dot_tile's SPLIT); kOffset:
// what the weights it multiplies exceed the stored q by (W8A8), times the row's sum to take off.
//
// Over zmm: the dot-product instructions over 16 32-bit lanes, a unit of the panel in a register, x's 4 bytes
// broadcast from memory by the instruction itself ({1to16}, in inline assembly: GCC emits a separate
// vpbroadcastd for the intrinsics, a second load per instruction that held vdpbf16ps at ~0.8x oneDNN's
// bfloat16 from 16 to 256 rows). vpdpbusd's broadcast operand is its signed one: x, not the weights.
#if defined(__AVX512BF16__) || defined(__AVX512VNNI__)
struct ZmmDot {
  using Unit = __m512i;
  static constexpr int kXBytes = 4, kUnits = 1;
  static constexpr int64_t kTileRows = kDotTileRows;
  static constexpr int kSplit[4] = {4, 2, 2, 1};
  static const uint8_t* at(const uint8_t* w, int64_t u) { return w + u * kUnitBytes; }
  static __m512i unit(const uint8_t* w, int64_t u) { return _mm512_loadu_si512(at(w, u)); }
};
#endif
#if defined(__AVX512BF16__)
struct Bf16Dot : ZmmDot {
  using Acc = __m512;
  static Acc zero() { return _mm512_setzero_ps(); }
  static Acc dot(Acc acc, const uint8_t* x, __m512i w) {
    asm("vdpbf16ps %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*reinterpret_cast<const int32_t*>(x)));
    return acc;
  }
  static Acc add(Acc a, Acc b) { return _mm512_add_ps(a, b); }
  static Acc load(const void* p) { return _mm512_loadu_ps(p); }
  static void store(void* p, Acc a) { _mm512_storeu_ps(p, a); }
};
#endif
#if defined(__AVX512VNNI__)
struct U8S8Dot : ZmmDot {
  using Acc = __m512i;
  static constexpr int32_t kOffset = 128;
  static Acc zero() { return _mm512_setzero_si512(); }
  static Acc dot(Acc acc, const uint8_t* x, __m512i w) {
    asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*reinterpret_cast<const int32_t*>(x)));
    return acc;
  }
  static Acc add(Acc a, Acc b) { return _mm512_add_epi32(a, b); }
  static Acc load(const void* p) { return _mm512_loadu_si512(p); }
  static void store(void* p, Acc a) { _mm512_storeu_si512(p, a); }
};

// W4A8's panels: 64 bytes hold two units, unit 2 v in their low nibbles and 2 v + 1 in their high ones.
struct U4S8Dot : U8S8Dot {
  static const uint8_t* at(const uint8_t* w, int64_t u) { return w + (u >> 1) * kUnitBytes; }
  static __m512i unit(const uint8_t* w, int64_t u) {
    const __m512i bytes = _mm512_loadu_si512(at(w, u));
    return _mm512_and_si512(_mm512_srl_epi16(bytes, _mm_cvtsi64_si128((u & 1) * 4)), _mm512_set1_epi8(0x0F));
  }
};
#elif defined(__AVX2__)
// Over ymm: a unit's rows 0-7 and 8-15 in two registers, two int32 sums each, x's 4 bytes broadcast by
// vpbroadcastd (AVX2 has no embedded broadcast). Sums of 16 lanes: lo rows 0-7, hi rows 8-15.
struct Ymm2 {
  __m256i lo, hi;
  static Ymm2 load(const void* p) {
    return {_mm256_loadu_si256(static_cast<const __m256i*>(p)),
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const char*>(p) + 32))};
  }
};

inline __m256i broadcast_x(const uint8_t* x) {
  int32_t v;
  std::memcpy(&v, x, 4);
  return _mm256_set1_epi32(v);
}

struct YmmDot {
  using Acc = Ymm2;
  static Acc zero() { return {_mm256_setzero_si256(), _mm256_setzero_si256()}; }
  static Acc add(Acc a, Acc b) { return {_mm256_add_epi32(a.lo, b.lo), _mm256_add_epi32(a.hi, b.hi)}; }
  static Acc load(const void* p) { return Ymm2::load(p); }
  static void store(void* p, Acc a) {
    _mm256_storeu_si256(static_cast<__m256i*>(p), a.lo);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<char*>(p) + 32), a.hi);
  }
  static const uint8_t* at(const uint8_t* w, int64_t s) { return w + s * kUnitBytes; }
};

// W4A8 over ymm steps through a 64-byte block at once, its two units (low nibbles, high ones) times x's 8 bytes.
struct NibbleUnits {
  Ymm2 low, high;
  static NibbleUnits of(const uint8_t* w) {
    const Ymm2 bytes = Ymm2::load(w);
    const __m256i mask = _mm256_set1_epi8(0x0F);
    return {{_mm256_and_si256(bytes.lo, mask), _mm256_and_si256(bytes.hi, mask)},
            {_mm256_and_si256(_mm256_srli_epi16(bytes.lo, 4), mask),
             _mm256_and_si256(_mm256_srli_epi16(bytes.hi, 4), mask)}};
  }
};

#if defined(__AVXVNNI__)
// AVX-VNNI: vpdpbusd over ymm, the AVX-512 path's arithmetic in two instructions per unit.
struct U8S8Dot : YmmDot {
  using Unit = Ymm2;
  static constexpr int kXBytes = 4, kUnits = 1;
  static constexpr int64_t kTileRows = 6;  // 12 sums + a unit + a broadcast of 16 registers
  static constexpr int kSplit[4] = {4, 2, 1, 1};
  static constexpr int32_t kOffset = 128;
  static Unit unit(const uint8_t* w, int64_t s) { return Ymm2::load(at(w, s)); }
  static Acc dot(Acc acc, const uint8_t* x, Unit w) {
    const __m256i xb = broadcast_x(x);
    return {_mm256_dpbusd_avx_epi32(acc.lo, w.lo, xb), _mm256_dpbusd_avx_epi32(acc.hi, w.hi, xb)};
  }
};

struct U4S8Dot : YmmDot {
  using Unit = NibbleUnits;
  static constexpr int kXBytes = 8, kUnits = 2;
  static constexpr int64_t kTileRows = 4;  // 8 sums + two units + two broadcasts
  static constexpr int kSplit[4] = {4, 2, 1, 1};
  static Unit unit(const uint8_t* w, int64_t s) { return NibbleUnits::of(at(w, s)); }
  static Acc dot(Acc acc, const uint8_t* x, const Unit& w) {
    const __m256i x0 = broadcast_x(x), x1 = broadcast_x(x + 4);
    return {_mm256_dpbusd_avx_epi32(_mm256_dpbusd_avx_epi32(acc.lo, w.low.lo, x0), w.high.lo, x1),
            _mm256_dpbusd_avx_epi32(_mm256_dpbusd_avx_epi32(acc.hi, w.low.hi, x0), w.high.hi, x1)};
  }
};
#else
// AVX2 alone: vpmaddubsw (unsigned bytes times signed ones, each pair of products added into an int16 lane)
// and vpmaddwd by 1 (pairs of those into int32). vpmaddubsw saturates: the stored q + 128 (up to 255) times x
// (up to 127 in magnitude) overflows int16 in two products. It multiplies |q| (up to 128, unsigned) by x with
// q's signs (vpsignb; x is never -128, so negating it is exact) instead: a pair at most 2 * 128 * 127 = 32512
// in magnitude. (|x| times q with x's signs would not do: vpsignb cannot negate q = -128, which int8
// checkpoints hold.) q itself is the stored byte with its top bit flipped (q + 128 mod 256): nothing to take off.
struct U8S8Dot : YmmDot {
  struct Unit {
    Ymm2 q, magnitudes;
  };
  static constexpr int kXBytes = 4, kUnits = 1;
  static constexpr int64_t kTileRows = 3;  // 6 sums + a unit (4) + ...: 1.1x 5 rows, whose sums GCC spilled
  static constexpr int kSplit[4] = {2, 1, 1, 1};  // a sum's chain is one vpaddd
  static constexpr int32_t kOffset = 0;
  static Unit unit(const uint8_t* w, int64_t s) {
    const Ymm2 stored = Ymm2::load(at(w, s));
    const __m256i top = _mm256_set1_epi8(static_cast<char>(0x80));
    const __m256i lo = _mm256_xor_si256(stored.lo, top), hi = _mm256_xor_si256(stored.hi, top);
    return {{lo, hi}, {_mm256_abs_epi8(lo), _mm256_abs_epi8(hi)}};
  }
  static __m256i product(__m256i magnitudes, __m256i q, __m256i x) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(magnitudes, _mm256_sign_epi8(x, q)), _mm256_set1_epi16(1));
  }
  static Acc dot(Acc acc, const uint8_t* x, const Unit& w) {
    const __m256i xb = broadcast_x(x);
    return {_mm256_add_epi32(acc.lo, product(w.magnitudes.lo, w.q.lo, xb)),
            _mm256_add_epi32(acc.hi, product(w.magnitudes.hi, w.q.hi, xb))};
  }
};

// The nibbles (q + 8, at most 15) are vpmaddubsw's unsigned operand as they are: a pair of products is at
// most 3810 in magnitude, the two units' pairs together 7620, and both go through one vpmaddwd.
struct U4S8Dot : YmmDot {
  using Unit = NibbleUnits;
  static constexpr int kXBytes = 8, kUnits = 2;
  static constexpr int64_t kTileRows = 3;  // 6 sums + two units + two broadcasts + ones + a product
  static constexpr int kSplit[4] = {2, 1, 1, 1};
  static Unit unit(const uint8_t* w, int64_t s) { return NibbleUnits::of(at(w, s)); }
  static __m256i product(__m256i low, __m256i high, __m256i x0, __m256i x1) {
    const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(low, x0), _mm256_maddubs_epi16(high, x1));
    return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
  }
  static Acc dot(Acc acc, const uint8_t* x, const Unit& w) {
    const __m256i x0 = broadcast_x(x), x1 = broadcast_x(x + 4);
    return {_mm256_add_epi32(acc.lo, product(w.low.lo, w.high.lo, x0, x1)),
            _mm256_add_epi32(acc.hi, product(w.low.hi, w.high.hi, x0, x1))};
  }
};
#endif
#endif

// tiles[MB][16] (+)= MB rows of x times steps [u0, u1) of a panel. x: row-major steps of Dot::kXBytes (row m's
// step u at x + kXBytes (m * units + u)), or, when PACKED, the tile's rows interleaved (at x + kXBytes (u * MB +
// m)): rows of x a power of two apart (4 KiB, 8 KiB) fall in one set of L1, which holds 8 lines; a tile's 12
// rows then missed L1 (vdpbf16ps at 0.6x oneDNN's rate; interleaved, level). SPLIT independent sums per row for
// few rows, where one chain would wait on each instruction's latency. `stream`: the panel comes from memory:
// prefetch ahead.
template <typename Dot, int MB, int SPLIT, bool PACKED>
void dot_tile(const uint8_t* x, int64_t units, int64_t u0, int64_t u1, const uint8_t* w, void* tiles, bool first,
              bool stream) {
  const auto x_unit = [&](int m, int64_t u) { return x + Dot::kXBytes * (PACKED ? u * MB + m : m * units + u); };
  typename Dot::Acc acc[SPLIT][MB];
  PAGEDSERVE_UNROLL for (int s = 0; s < SPLIT; ++s)
    PAGEDSERVE_UNROLL for (int m = 0; m < MB; ++m) acc[s][m] = Dot::zero();
  int64_t u = u0;
  for (; u + SPLIT <= u1; u += SPLIT) {
    PAGEDSERVE_UNROLL for (int s = 0; s < SPLIT; ++s) {
      if (stream) {
        const char* line = reinterpret_cast<const char*>(Dot::at(w, u + s));
        if (PACKED)
          _mm_prefetch(line + kPrefetchBytes, _MM_HINT_T0);
        else if ((line - reinterpret_cast<const char*>(w)) % kDirectPrefetchStride == 0)
          _mm_prefetch(line + kFloat32PrefetchBytes, _MM_HINT_T1);
      }
      const typename Dot::Unit units_of_w = Dot::unit(w, u + s);
      PAGEDSERVE_UNROLL for (int m = 0; m < MB; ++m) acc[s][m] = Dot::dot(acc[s][m], x_unit(m, u + s), units_of_w);
    }
  }
  for (; u < u1; ++u) {
    const typename Dot::Unit units_of_w = Dot::unit(w, u);
    PAGEDSERVE_UNROLL for (int m = 0; m < MB; ++m) acc[0][m] = Dot::dot(acc[0][m], x_unit(m, u), units_of_w);
  }
  char* t = static_cast<char*>(tiles);
  PAGEDSERVE_UNROLL for (int m = 0; m < MB; ++m) {
    typename Dot::Acc sum = acc[0][m];
    PAGEDSERVE_UNROLL for (int s = 1; s < SPLIT; ++s) sum = Dot::add(sum, acc[s][m]);
    if (!first) sum = Dot::add(sum, Dot::load(t + m * kUnitBytes));
    Dot::store(t + m * kUnitBytes, sum);
  }
}

#if defined(__AVX512F__)
// 16 rows of 16 4-byte steps (rows `stride` bytes apart) to 16 steps of 16 rows at `to`, 64 bytes each: the
// classic 16 x 16 transpose of 32-bit lanes in four rounds of shuffles.
inline void transpose_16x16(const uint8_t* from, int64_t stride, uint8_t* to) {
  __m512i r[16], t[16];
  PAGEDSERVE_UNROLL for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(from + i * stride);
  PAGEDSERVE_UNROLL for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  PAGEDSERVE_UNROLL for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  PAGEDSERVE_UNROLL for (int h = 0; h < 16; h += 8)
    PAGEDSERVE_UNROLL for (int i = 0; i < 4; ++i) {
      t[h + i] = _mm512_shuffle_i32x4(r[h + i], r[h + i + 4], 0x88);
      t[h + i + 4] = _mm512_shuffle_i32x4(r[h + i], r[h + i + 4], 0xdd);
    }
  PAGEDSERVE_UNROLL for (int i = 0; i < 8; ++i) {
    _mm512_storeu_si512(to + 64 * i, _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88));
    _mm512_storeu_si512(to + 64 * (i + 8), _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd));
  }
}
#endif

// x [M, units] in kBytes-byte steps, rearranged for PACKED dot tiles: each tile of `tile_rows` rows (the last:
// the rest) interleaved, step by step, at its first row's offset. Not zeroed first: every byte is written.
template <int kBytes>
std::unique_ptr<uint8_t[]> pack_x_tiles(const uint8_t* x, int64_t M, int64_t units, int64_t tile_rows) {
  std::unique_ptr<uint8_t[]> packed(new uint8_t[M * units * kBytes]);
  at::parallel_for(0, (M + tile_rows - 1) / tile_rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t m0 = begin * tile_rows; m0 < std::min(M, end * tile_rows); m0 += tile_rows) {
      const int64_t rows = std::min(tile_rows, M - m0);
      uint8_t* to = packed.get() + kBytes * m0 * units;
      const uint8_t* from = x + kBytes * m0 * units;
      int64_t u = 0;
#if defined(__AVX512F__)
      if (kBytes == 4 && rows == 16)  // the per-step loop below took ~5% of a 64-row bfloat16 call
        for (; u + 16 <= units; u += 16, to += 16 * 64) transpose_16x16(from + 4 * u, 4 * units, to);
#endif
      for (; u < units; ++u)
        for (int64_t r = 0; r < rows; ++r, to += kBytes) std::memcpy(to, from + kBytes * (r * units + u), kBytes);
    }
  });
  return packed;
}

// x [M, units] as the dot tiles read it: row-major for up to kDirectRows rows, else packed (into `packed`).
template <typename Dot>
const uint8_t* x_for_tiles(const uint8_t* x, int64_t M, int64_t units, std::unique_ptr<uint8_t[]>& packed) {
  if (M <= kDirectRows) return x;
  packed = pack_x_tiles<Dot::kXBytes>(x, M, units, Dot::kTileRows);
  return packed.get();
}

// tiles [M][16] = M (<= kDirectRows) rows of x (row-major) times steps [u0, u1) of a panel, straight through
// it from memory (bound by its bytes).
template <typename Dot>
void direct_dot(const uint8_t* x, int64_t M, int64_t units, int64_t u0, int64_t u1, const uint8_t* w, void* tiles) {
  switch (M) {
    case 1: return dot_tile<Dot, 1, Dot::kSplit[0], false>(x, units, u0, u1, w, tiles, true, true);
    case 2: return dot_tile<Dot, 2, Dot::kSplit[1], false>(x, units, u0, u1, w, tiles, true, true);
    case 3: return dot_tile<Dot, 3, Dot::kSplit[2], false>(x, units, u0, u1, w, tiles, true, true);
    case 4: return dot_tile<Dot, 4, Dot::kSplit[3], false>(x, units, u0, u1, w, tiles, true, true);
  }
}

// tiles [M][16] (+)= every row of x (packed) times steps [u0, u1) of a panel, in tiles of Dot::kTileRows rows
// (the first prefetching ahead when `stream`).
template <typename Dot>
void dot_tiles(const uint8_t* x, int64_t M, int64_t units, int64_t u0, int64_t u1, const uint8_t* w, void* tiles,
               bool first, bool stream) {
  constexpr int64_t kRows = Dot::kTileRows;
  int64_t m = 0;
  for (; m + kRows <= M; m += kRows, stream = false)
    dot_tile<Dot, kRows, 1, true>(x + Dot::kXBytes * m * units, units, u0, u1, w,
                                  static_cast<char*>(tiles) + m * kUnitBytes, first, stream);
  pagedserve::with_rows<kRows - 1>(static_cast<int>(M - m), [&](auto rows) {
    dot_tile<Dot, decltype(rows)::value, 1, true>(x + Dot::kXBytes * m * units, units, u0, u1, w,
                                                  static_cast<char*>(tiles) + m * kUnitBytes, first, stream);
  });
}

// tiles [M][16] = every row of x (x_for_tiles) times a panel of `units` steps: up to 4 rows straight through the
// panel, more in tiles over chunks of kChunkUnits steps that stay in L1.
template <typename Dot>
void dot_panel(const uint8_t* x, int64_t M, int64_t units, const uint8_t* w, void* tiles) {
  if (M <= kDirectRows) return direct_dot<Dot>(x, M, units, 0, units, w, tiles);
  for (int64_t c = 0; c < units; c += kChunkUnits)
    dot_tiles<Dot>(x, M, units, c, std::min(units, c + kChunkUnits), w, tiles, c == 0, true);
}
#endif

// Portable fallback: tiles [M][16] = x times the panel, `weight_at(k, j)` giving row j's weight in column k.
template <typename WeightAt>
void portable_panel(const float* x, int64_t M, int64_t K, WeightAt weight_at, float* tiles) {
  std::fill(tiles, tiles + M * kPanel, 0.f);
  for (int64_t k = 0; k < K; ++k)
    for (int64_t j = 0; j < kPanel; ++j) {
      const float w = weight_at(k, j);
      for (int64_t m = 0; m < M; ++m) tiles[m * kPanel + j] += x[m * K + k] * w;
    }
}

// weight [ceil(N / 16), K / columns_per_entry, 16]: int4 packs two columns in each byte.
void check_common(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& out, int64_t columns_per_entry = 1) {
  TORCH_CHECK(x.scalar_type() == at::kFloat, "x: float32");
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous(), "inputs must be contiguous");
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2 && out.size(0) == x.size(0), "x [M, K], out [M, N]");
  TORCH_CHECK(weight.dim() == 3 && weight.size(0) == (out.size(1) + kPanel - 1) / kPanel &&
                  x.size(1) % columns_per_entry == 0 && weight.size(1) == x.size(1) / columns_per_entry &&
                  weight.size(2) == kPanel,
              "weight: [ceil(N / 16), K", columns_per_entry > 1 ? " / 2" : "", ", 16]");
}

// `compute(panel, tiles [M][16], buffer)` on every panel, in parallel; each panel's tiles are then stored. A
// panel's params: `packed_params` [P, groups, 32] when given, else `row_scales` [N] gathered (or none).
template <typename Compute>
void run_panels(int64_t M, const Output& out, const float* row_scales, const float* packed_params,
                int64_t groups, Compute compute) {
  const int64_t N = out.N;
  pagedserve::shared_for((N + kPanel - 1) / kPanel, [&](int64_t begin, int64_t end) {
    std::vector<float> tiles(M * kPanel), gathered(2 * kPanel, 0.f);
    alignas(64) float buffer[kChunk * kPanel];
    for (int64_t p = begin; p < end; ++p) {
      Panel panel(p, N);
      if (packed_params) {
        panel.params = packed_params + p * groups * 2 * kPanel;
      } else {
        for (int64_t j = 0; j < kPanel; ++j) gathered[j] = row_scales && j < panel.rows ? row_scales[p * kPanel + j] : 0.f;
        panel.params = gathered.data();
      }
      compute(panel, tiles.data(), buffer);
      store_tiles(tiles.data(), M, panel, out);
    }
  });
}

}  // namespace

// out[m, n] = sum_k x[m, k] * w[n, k]
void float32_linear(at::Tensor out, at::Tensor x, at::Tensor weight, std::optional<at::Tensor> bias) {
  check_common(x, weight, out);
  const Output output = output_of(out, bias, x.size(0));
  TORCH_CHECK(weight.scalar_type() == at::kFloat, "weight: float32");
  const int64_t M = x.size(0), K = x.size(1), N = out.size(1);
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  run_panels(M, output, nullptr, nullptr, 1, [&](const Panel& panel, float* tiles, float*) {
    const float* w = wp + panel.index * K * kPanel;
#ifdef PAGEDSERVE_VEC16
    float32_panel(xp, M, K, w, tiles);
#else
    portable_panel(xp, M, K, [&](int64_t k, int64_t j) { return w[k * kPanel + j]; }, tiles);
#endif
  });
}

// out[m, n] = scales[n] * sum_k x[m, k] * q[n, k]
void int8_linear(at::Tensor out, at::Tensor x, at::Tensor weight, at::Tensor scales, std::optional<at::Tensor> bias) {
  check_common(x, weight, out);
  const Output output = output_of(out, bias, x.size(0));
  TORCH_CHECK(weight.scalar_type() == at::kChar, "weight: int8");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.numel() == out.size(1),
              "scales: float32 [N]");
  const int64_t M = x.size(0), K = x.size(1), N = out.size(1);
  const float* xp = x.data_ptr<float>();
  const int8_t* wp = weight.data_ptr<int8_t>();
  run_panels(M, output, scales.data_ptr<float>(), nullptr, 1,
             [&](const Panel& panel, float* tiles, float* buffer) {
    const int8_t* w = wp + panel.index * K * kPanel;
#ifdef PAGEDSERVE_VEC16
    switch (M) {
      case 1: return int8_direct<1, 4>(xp, K, w, panel, tiles);
      case 2: return int8_direct<2, 2>(xp, K, w, panel, tiles);
      case 3: return int8_direct<3, 1>(xp, K, w, panel, tiles);
      case 4: return int8_direct<4, 1>(xp, K, w, panel, tiles);
    }
    chunked_panel(xp, M, K, Int8Columns{w}, buffer, tiles);
    scale_tiles(tiles, M, panel);
#else
    const float* s = panel.scales(0);
    portable_panel(xp, M, K, [&](int64_t k, int64_t j) { return s[j] * static_cast<float>(w[k * kPanel + j]); }, tiles);
#endif
  });
}

// out[m, n] = sum_k x[m, k] * (q[n, k] * scales[n, k / group] + zeros[n, k / group]), scales and zeros as
// params [P, K / group, 32] (Panel's layout).
void int4_linear(at::Tensor out, at::Tensor x, at::Tensor weight, at::Tensor params, int64_t group,
                 std::optional<at::Tensor> bias) {
  check_common(x, weight, out, 2);
  const Output output = output_of(out, bias, x.size(0));
  TORCH_CHECK(weight.scalar_type() == at::kByte, "weight: uint8");
  const int64_t M = x.size(0), K = x.size(1), N = out.size(1);
  TORCH_CHECK(group > 0 && group % 2 == 0 && K % group == 0, "group must be even and divide K");
  const int64_t groups = K / group;
  TORCH_CHECK(params.scalar_type() == at::kFloat && params.is_contiguous() &&
                  params.numel() == weight.size(0) * groups * 2 * kPanel,
              "params: float32 [ceil(N / 16), K / group, 32]");
  const float* xp = x.data_ptr<float>();
  const uint8_t* wp = weight.data_ptr<uint8_t>();
  std::vector<float> xsum;  // each row's sum over each group of columns (int4_direct's zero terms)
  if (M <= kDirectRows) {
    xsum.assign(M * groups, 0.f);
    for (int64_t m = 0; m < M; ++m)
      for (int64_t g = 0; g < groups; ++g)
        for (int64_t k = g * group; k < (g + 1) * group; ++k) xsum[m * groups + g] += xp[m * K + k];
  }
  run_panels(M, output, nullptr, params.data_ptr<float>(), groups,
             [&](const Panel& panel, float* tiles, float* buffer) {
    const uint8_t* w = wp + panel.index * K * kPanel / 2;
#ifdef PAGEDSERVE_VEC16
    switch (M) {
      case 1: return int4_direct<1, 4>(xp, K, group, xsum.data(), w, panel, tiles);
      case 2: return int4_direct<2, 2>(xp, K, group, xsum.data(), w, panel, tiles);
      case 3: return int4_direct<3, 1>(xp, K, group, xsum.data(), w, panel, tiles);
      case 4: return int4_direct<4, 1>(xp, K, group, xsum.data(), w, panel, tiles);
    }
    chunked_panel(xp, M, K, Int4DequantizedColumns{Int4Columns{w}, panel, group}, buffer, tiles);
#else
    portable_panel(xp, M, K, [&](int64_t k, int64_t j) {
      const uint8_t byte = w[k / 2 * kPanel + j];
      const int64_t g = k / group;
      return static_cast<float>(k % 2 ? byte >> 4 : byte & 0x0F) * panel.scales(g)[j] + panel.zeros(g)[j];
    }, tiles);
#endif
  });
}

inline float bf16_to_float(uint16_t v) {
  const uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// out[m, n] = sum_k x[m, k] * w[n, k], x bfloat16 [M, K] (K even), w bfloat16 in [P, K / 2, 16, 2] panels.
void bfloat16_linear(at::Tensor out, at::Tensor x, at::Tensor weight, std::optional<at::Tensor> bias) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16, "x, weight: bfloat16");
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous(), "inputs must be contiguous");
  const Output output = output_of(out, bias, x.size(0));
  const int64_t M = x.size(0), K = x.size(1), N = out.size(1);
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2 && out.size(0) == M && K % 2 == 0, "x [M, K] (K even), out [M, N]");
  TORCH_CHECK(weight.dim() == 4 && weight.size(0) == (N + kPanel - 1) / kPanel && weight.size(1) == K / 2 &&
                  weight.size(2) == kPanel && weight.size(3) == 2, "weight: [ceil(N / 16), K / 2, 16, 2]");
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr());
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(weight.data_ptr());
#if defined(__AVX512BF16__)
  std::unique_ptr<uint8_t[]> packed;
  const uint8_t* x_units = x_for_tiles<Bf16Dot>(reinterpret_cast<const uint8_t*>(xp), M, K / 2, packed);
#else
  std::vector<float> widened(M * K);  // x in float32 for the widening paths
  for (int64_t i = 0; i < M * K; ++i) widened[i] = bf16_to_float(xp[i]);
  const float* xf = widened.data();
#endif
  run_panels(M, output, nullptr, nullptr, 1, [&](const Panel& panel, float* tiles, float* buffer) {
    const uint16_t* w = wp + panel.index * K * kPanel;
#if defined(__AVX512BF16__)
    dot_panel<Bf16Dot>(x_units, M, K / 2, reinterpret_cast<const uint8_t*>(w), tiles);
#elif defined(PAGEDSERVE_VEC16)
    if (!few_rows_panel(xf, M, K, Bf16Columns{w}, tiles)) chunked_panel(xf, M, K, Bf16Columns{w}, buffer, tiles);
#else
    portable_panel(xf, M, K, [&](int64_t k, int64_t j) { return bf16_to_float(w[k / 2 * 2 * kPanel + 2 * j + k % 2]); },
                   tiles);
#endif
  });
}

// Row m of x [M, K] quantized: writes round(x / scale) to `bytes` [K4] (0 past K), its sum to `sum`; returns the scale.
float quantize_row(const float* x, int64_t K, int64_t K4, int8_t* bytes, int32_t& sum) {
  float absmax = 0.f;
  for (int64_t k = 0; k < K; ++k) absmax = std::max(absmax, std::fabs(x[k]));
  const float scale = absmax > 0.f ? absmax / 127.f : 1.f;
  int32_t total = 0;
  for (int64_t k = 0; k < K; ++k) {
    bytes[k] = static_cast<int8_t>(std::clamp(std::nearbyint(x[k] / scale), -127.f, 127.f));
    total += bytes[k];
  }
  std::fill(bytes + K, bytes + K4, int8_t{0});
  sum = total;
  return scale;
}

// out[m, n] = sx[m] * scales[n] * sum_k xq[m, k] * q[n, k]: x float32 [M, K] quantized per row (quantize_row),
// weight q + 128 as uint8 in [P, K4 / 4, 16, 4] panels, scales float32 [N]. vpdpbusd multiplies unsigned bytes
// (the weights) by signed ones (x, broadcast from memory, which must be the signed operand): the sum it makes
// is sum_k (q + 128) xq, and 128 sum_k xq (U8S8Dot::kOffset: 0 for AVX2's, which multiplies q) is taken off.
void w8a8_linear(at::Tensor out, at::Tensor x, at::Tensor weight, at::Tensor scales, std::optional<at::Tensor> bias) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kByte, "x: float32; weight: uint8");
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous(), "inputs must be contiguous");
  const Output output = output_of(out, bias, x.size(0));
  const int64_t M = x.size(0), K = x.size(1), N = out.size(1), K4 = (K + 3) / 4 * 4;
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2 && out.size(0) == M, "x [M, K], out [M, N]");
  TORCH_CHECK(weight.dim() == 4 && weight.size(0) == (N + kPanel - 1) / kPanel && weight.size(1) == K4 / 4 &&
                  weight.size(2) == kPanel && weight.size(3) == 4, "weight: [ceil(N / 16), ceil(K / 4), 16, 4]");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.numel() == N,
              "scales: float32 [N]");
  const float* xp = x.data_ptr<float>();
  std::vector<int8_t> bytes(M * K4);
  std::vector<float> row_scales(M);
  std::vector<int32_t> row_sums(M);
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m)
      row_scales[m] = quantize_row(xp + m * K, K, K4, bytes.data() + m * K4, row_sums[m]);
  });
#if defined(PAGEDSERVE_INT8_DOT)
  std::unique_ptr<uint8_t[]> packed;
  const uint8_t* x_units = x_for_tiles<U8S8Dot>(reinterpret_cast<const uint8_t*>(bytes.data()), M, K4 / 4, packed);
  constexpr int32_t offset = U8S8Dot::kOffset;
#else
  constexpr int32_t offset = 128;
#endif
  const uint8_t* wp = weight.data_ptr<uint8_t>();
  const float* sp = scales.data_ptr<float>();
  run_panels(M, output, nullptr, nullptr, 1, [&](const Panel& panel, float* tiles, float*) {
    const uint8_t* w = wp + panel.index * K4 * kPanel;
    int32_t* sums_of_products = reinterpret_cast<int32_t*>(tiles);  // the tiles' own memory, 4 bytes a lane
#if defined(PAGEDSERVE_INT8_DOT)
    dot_panel<U8S8Dot>(x_units, M, K4 / 4, w, sums_of_products);
#else
    std::fill(sums_of_products, sums_of_products + M * kPanel, 0);
    for (int64_t m = 0; m < M; ++m)
      for (int64_t k = 0; k < K4; ++k) {
        const int32_t xk = bytes[m * K4 + k];
        const uint8_t* column = w + (k / 4) * kUnitBytes + k % 4;
        for (int64_t j = 0; j < kPanel; ++j) sums_of_products[m * kPanel + j] += xk * column[4 * j];
      }
#endif
    for (int64_t m = 0; m < M; ++m)
      for (int64_t j = 0; j < panel.rows; ++j) {
        const int64_t n = panel.index * kPanel + j;
        const int32_t exact = sums_of_products[m * kPanel + j] - offset * row_sums[m];
        tiles[m * kPanel + j] = static_cast<float>(exact) * row_scales[m] * sp[n];
      }
  });
}

// out[m, n] = sx[m] * sum_g scales[n, g] * sum_{k in g} xq[m, k] * q[n, k] (W4A8): x float32 [M, K] quantized
// per row (quantize_row), q in [-8, 7] stored + 8 as nibbles in uint8 [P, K / 8, 16, 4] panels (byte (u, j, b):
// column 8 u + b in its low nibble, 8 u + 4 + b in its high one), scales float32 [P, K / group, 16]. Per group
// the integer sums are exact; each is scaled once (group a multiple of 8).
void w4a8_linear(at::Tensor out, at::Tensor x, at::Tensor weight, at::Tensor scales, int64_t group,
                 std::optional<at::Tensor> bias) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kByte, "x: float32; weight: uint8");
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous() && scales.is_contiguous(), "inputs must be contiguous");
  const Output output = output_of(out, bias, x.size(0));
  const int64_t M = x.size(0), K = x.size(1), N = out.size(1);
  TORCH_CHECK(group > 0 && group % 8 == 0 && K % group == 0, "group: a multiple of 8 that divides K");
  const int64_t groups = K / group, P = (N + kPanel - 1) / kPanel;
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2 && out.size(0) == M, "x [M, K], out [M, N]");
  TORCH_CHECK(weight.dim() == 4 && weight.size(0) == P && weight.size(1) == K / 8 && weight.size(2) == kPanel &&
                  weight.size(3) == 4, "weight: [ceil(N / 16), K / 8, 16, 4]");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.numel() == P * groups * kPanel,
              "scales: float32 [ceil(N / 16), K / group, 16]");
  const float* xp = x.data_ptr<float>();
  std::vector<int8_t> bytes(M * K);
  std::vector<float> row_scales(M);
  std::vector<int32_t> row_sums(M), group_sums(M * groups);  // sum_{k in g} xq[m, k]: the + 8 taken off
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      row_scales[m] = quantize_row(xp + m * K, K, K, bytes.data() + m * K, row_sums[m]);
      for (int64_t g = 0; g < groups; ++g)
        for (int64_t k = g * group; k < (g + 1) * group; ++k) group_sums[m * groups + g] += bytes[m * K + k];
    }
  });
  const uint8_t* wp = weight.data_ptr<uint8_t>();
  const float* sp = scales.data_ptr<float>();
#if defined(PAGEDSERVE_INT8_DOT)
  const int64_t steps = K / 4 / U4S8Dot::kUnits, group_steps = group / 4 / U4S8Dot::kUnits;
  std::unique_ptr<uint8_t[]> packed;
  const uint8_t* x_units = x_for_tiles<U4S8Dot>(reinterpret_cast<const uint8_t*>(bytes.data()), M, steps, packed);
#endif
  run_panels(M, output, nullptr, nullptr, 1, [&](const Panel& panel, float* tiles, float*) {
    const uint8_t* w = wp + panel.index * K * kPanel / 2;
    std::vector<int32_t> sums(M * kPanel);  // per group: sum_k xq (q + 8)
    std::fill(tiles, tiles + M * kPanel, 0.f);
    for (int64_t g = 0; g < groups; ++g) {
      const float* group_scales = sp + (panel.index * groups + g) * kPanel;
#if defined(PAGEDSERVE_INT8_DOT)
      const int64_t s0 = g * group_steps, s1 = s0 + group_steps;
      if (M <= kDirectRows)
        direct_dot<U4S8Dot>(x_units, M, steps, s0, s1, w, sums.data());
      else
        dot_tiles<U4S8Dot>(x_units, M, steps, s0, s1, w, sums.data(), true, true);
#else
      for (int64_t m = 0; m < M; ++m)
        for (int64_t j = 0; j < kPanel; ++j) {
          int32_t sum = 0;
          for (int64_t k = g * group; k < (g + 1) * group; ++k) {
            const uint8_t byte = w[(k / 8) * kUnitBytes + 4 * j + k % 4];
            sum += bytes[m * K + k] * (k % 8 < 4 ? byte & 0x0F : byte >> 4);
          }
          sums[m * kPanel + j] = sum;
        }
#endif
#if defined(__AVX512VNNI__)
      for (int64_t m = 0; m < M; ++m) {
        const __m512i exact = _mm512_sub_epi32(_mm512_loadu_si512(sums.data() + m * kPanel),
                                               _mm512_set1_epi32(8 * group_sums[m * groups + g]));
        const __m512 sum = _mm512_fmadd_ps(_mm512_cvtepi32_ps(exact), _mm512_loadu_ps(group_scales),
                                           _mm512_loadu_ps(tiles + m * kPanel));
        _mm512_storeu_ps(tiles + m * kPanel, sum);
      }
#else
      for (int64_t m = 0; m < M; ++m)
        for (int64_t j = 0; j < kPanel; ++j) {
          const int32_t exact = sums[m * kPanel + j] - 8 * group_sums[m * groups + g];
          tiles[m * kPanel + j] += static_cast<float>(exact) * group_scales[j];
        }
#endif
    }
    for (int64_t m = 0; m < M; ++m)
      for (int64_t j = 0; j < kPanel; ++j) tiles[m * kPanel + j] *= row_scales[m];
  });
}

// Which instructions this build's bfloat16 and W8A8 kernels use (the engine prefers oneDNN's bfloat16 where
// the CPU lacks AVX512_BF16).
pybind11::dict instruction_sets() {
  pybind11::dict sets;
#ifdef __AVX512BF16__
  sets["avx512_bf16"] = true;
#else
  sets["avx512_bf16"] = false;
#endif
#ifdef __AVX512VNNI__
  sets["avx512_vnni"] = true;
#else
  sets["avx512_vnni"] = false;
#endif
  return sets;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // for decode_stack.cpp
  m.attr("float32_linear_kernel") = pagedserve::kernel_capsule<pagedserve::LinearKernel>(&float32_linear, "LinearKernel");
  m.attr("bfloat16_linear_kernel") =
      pagedserve::kernel_capsule<pagedserve::LinearKernel>(&bfloat16_linear, "LinearKernel");
  m.attr("w8a8_linear_kernel") = pagedserve::kernel_capsule<pagedserve::W8A8Kernel>(&w8a8_linear, "W8A8Kernel");
  m.attr("w4a8_linear_kernel") = pagedserve::kernel_capsule<pagedserve::W4A8Kernel>(&w4a8_linear, "W4A8Kernel");
  m.def("bfloat16_linear", &bfloat16_linear, "Linear over bfloat16 weight panels, bfloat16 x (CPU, float32 out)");
  m.def("w8a8_linear", &w8a8_linear, "int8 weights x per-row dynamic int8 activations (CPU, float32)");
  m.def("w4a8_linear", &w4a8_linear, "grouped int4 weights x per-row dynamic int8 activations (CPU, float32)");
  m.def("instruction_sets", &instruction_sets, "The dot-product instructions this build uses");
  m.def("float32_linear", &float32_linear, "Linear over float32 weight panels (CPU)");
  m.def("int8_linear", &int8_linear, "Weight-only int8 linear, per-row scales (CPU, float32)");
  m.def("int4_linear", &int4_linear, "Weight-only int4 linear, grouped scales and zeros (CPU, float32)");
}
