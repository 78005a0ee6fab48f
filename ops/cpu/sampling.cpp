// Sampling on CPU, without sorting a row. A sampled step's rows in one call (sample_rows: temperature, top-k,
// softmax, top-p and the draw, row by row in a buffer that stays in L2), and the masks and the draw on their own
// for the distributions speculative decoding keeps (top_k_mask, top_p_mask, draw).
// Top-k: the k-th largest logit, through an order-preserving integer key of the float bits: the values at or
// above a floor guessed from a sample of the row, gathered and selected; where the guess holds fewer than k, radix
// selection (a histogram of the keys' top 12 bits, then the bucket holding the k-th largest). Top-p's floor: the
// smallest probability a row's nucleus keeps, by radix selection on the probabilities' float bits (positive floats
// order as their bit patterns): histograms of probability mass over 12, 12 and 8 bits of the pattern, walked from
// the largest: the bucket where the mass above reaches top_p is the one refined next. A token is kept while the
// mass of the tokens ranked above it is under top_p, as the sort-based reference (engine/sample/sampler.py) keeps
// it; tokens tied with the floor (or, for top-k, with the k-th largest) are all kept. torch's CPU sort of a 32k row
// took 1.2 ms and numpy's 0.6; this ~0.1. The draw: an inverse CDF over each row's weights.
#include <ATen/core/Tensor.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <vector>

#include "fast_exp.h"
#include "work_sharing.h"

namespace {

struct Level {
  int shift, width;  // the bits [shift, shift + width) of the pattern this pass buckets by
};
constexpr Level kLevels[] = {{20, 12}, {8, 12}, {0, 8}};

// One pass of the selection over p[0, n): among the values whose bits above `level` equal `prefix`, the bucket
// where the mass above it (with `above`, the mass above those values) reaches top_p; -1 for none. The last
// non-empty bucket is taken when no bucket reaches top_p: the sums of this pass may round below those of the last
// (or a row's whole mass be under top_p): everything down to it is kept then. `above` becomes the mass above the
// bucket taken, and count[bucket] its number of values.
int64_t select_bucket(const float* p, int64_t n, const Level& level, uint32_t prefix, double top_p, double& above,
                      std::vector<double>& mass, std::vector<int32_t>& count) {
  const int64_t buckets = int64_t{1} << level.width;
  const int high = level.shift + level.width;
  std::fill(mass.begin(), mass.begin() + buckets, 0.0);
  std::fill(count.begin(), count.begin() + buckets, 0);
  for (int64_t i = 0; i < n; ++i) {
    uint32_t bits;
    std::memcpy(&bits, p + i, 4);
    if (high < 32 && (bits >> high) != prefix) continue;
    const uint32_t b = (bits >> level.shift) & (buckets - 1);
    mass[b] += p[i];
    ++count[b];
  }
  int64_t chosen = -1;
  bool reached = false;
  for (int64_t b = buckets - 1; b >= 0 && !reached; --b) {
    if (!count[b]) continue;
    chosen = b;
    reached = above + mass[b] >= top_p;
    if (!reached) above += mass[b];
  }
  if (chosen >= 0 && !reached) above -= mass[chosen];
  return chosen;
}

// The row's nucleus floor: the first level over the whole row, the other two over the values of the bucket it
// took, gathered (a few hundred of 32k in a peaked row; never more than the row).
float row_floor(const float* p, int64_t V, double top_p, std::vector<double>& mass, std::vector<int32_t>& count,
                std::vector<float>& candidates, double* kept_mass = nullptr) {
  double above = 0.0;  // the mass of the tokens above the bucket being refined (under top_p throughout)
  const int64_t first = select_bucket(p, V, kLevels[0], 0, top_p, above, mass, count);
  if (first < 0) return 0.f;  // an empty row
  const int high = kLevels[0].shift;
  candidates.resize(count[first] + 1);  // + 1: the slot a non-member writes before it is overwritten
  int64_t n = 0;
  for (int64_t i = 0; i < V; ++i) {
    uint32_t bits;
    std::memcpy(&bits, p + i, 4);
    candidates[n] = p[i];
    n += (bits >> high) == static_cast<uint32_t>(first);
  }
  uint32_t prefix = static_cast<uint32_t>(first);  // the bits above the next level's, fixed by the levels before
  for (const Level& level : {kLevels[1], kLevels[2]}) {
    const int64_t chosen = select_bucket(candidates.data(), n, level, prefix, top_p, above, mass, count);
    if (chosen < 0) return 0.f;
    prefix = (prefix << level.width) | static_cast<uint32_t>(chosen);
    if (kept_mass) *kept_mass = above + mass[chosen];  // the last level's bucket holds the floor's value only
  }
  float floor;
  std::memcpy(&floor, &prefix, 4);
  return floor;
}

// The sum of p[0, V), in 16 float lanes.
double row_sum(const float* p, int64_t V) {
  float lanes[16] = {};
  int64_t i = 0;
  for (; i + 16 <= V; i += 16) {
    for (int j = 0; j < 16; ++j) lanes[j] += p[i + j];
  }
  double total = 0.0;
  for (; i < V; ++i) total += p[i];
  for (float lane : lanes) total += lane;
  return total;
}

// out [R, V] = probs [R, V] zeroed below each row's nucleus floor under top_p [R] (1 or more: floor 0) and
// renormalized by the kept mass (the floor's selection sums it; a whole row's in 16 lanes), in one scaled write.
// float32, contiguous.
void top_p_mask(at::Tensor& out, const at::Tensor& probs, const at::Tensor& top_p) {
  TORCH_CHECK(probs.scalar_type() == at::kFloat && probs.dim() == 2 && probs.is_contiguous(),
              "top_p_mask: probs contiguous float32 [rows, vocab]");
  const int64_t R = probs.size(0), V = probs.size(1);
  TORCH_CHECK(top_p.scalar_type() == at::kFloat && top_p.is_contiguous() && top_p.numel() == R &&
                  out.scalar_type() == at::kFloat && out.is_contiguous() && out.sizes() == probs.sizes(),
              "top_p_mask: top_p float32 [rows] and out float32 as probs, contiguous");
  const float* p = probs.data_ptr<float>();
  const float* tp = top_p.data_ptr<float>();
  float* y = out.data_ptr<float>();
  pagedserve::shared_for(R, [&](int64_t begin, int64_t end) {
    std::vector<double> mass(4096);
    std::vector<int32_t> count(4096);
    std::vector<float> candidates;
    for (int64_t r = begin; r < end; ++r) {
      const float* row = p + r * V;
      float* kept = y + r * V;
      double total = 0.0;
      const float floor = tp[r] < 1.f ? row_floor(row, V, tp[r], mass, count, candidates, &total) : 0.f;
      if (!(tp[r] < 1.f)) total = row_sum(row, V);
      const float scale = static_cast<float>(1.0 / total);
      for (int64_t i = 0; i < V; ++i) kept[i] = row[i] >= floor ? row[i] * scale : 0.f;
    }
  });
}

// Larger floats, larger keys; every NaN above +inf, as torch's topk ranks NaN first. Branch-free: a row's signs
// are as unpredictable as coin flips.
inline uint32_t order_key(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  const uint32_t key = bits ^ (static_cast<uint32_t>(static_cast<int32_t>(bits) >> 31) | 0x80000000u);
  return f != f ? 0xFFFFFFFFu : key;
}

inline float key_value(uint32_t key) {
  if (key == 0xFFFFFFFFu) return std::numeric_limits<float>::quiet_NaN();
  const uint32_t bits = (key & 0x80000000u) ? (key & 0x7FFFFFFFu) : ~key;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// The k-th largest of x[0, V), 1 <= k <= V, by radix selection: a histogram of the keys' top 12 bits (sign,
// exponent, 3 bits of mantissa), then the bucket holding the k-th largest gathered and selected.
float radix_kth_largest(const float* x, int64_t V, int64_t k, std::vector<int32_t>& count,
                        std::vector<uint32_t>& candidates) {
  constexpr int kShift = 20;
  std::fill(count.begin(), count.end(), 0);
  for (int64_t i = 0; i < V; ++i) ++count[order_key(x[i]) >> kShift];
  int64_t above = 0, b = static_cast<int64_t>(count.size()) - 1;
  for (; b > 0 && above + count[b] < k; --b) above += count[b];
  candidates.resize(count[b] + 1);  // + 1: the slot a non-member writes before it is overwritten
  int64_t n = 0;
  for (int64_t i = 0; i < V; ++i) {
    const uint32_t key = order_key(x[i]);
    candidates[n] = key;
    n += (key >> kShift) == static_cast<uint32_t>(b);
  }
  const auto nth = candidates.begin() + (k - above - 1);
  std::nth_element(candidates.begin(), nth, candidates.begin() + n, std::greater<uint32_t>());
  return key_value(*nth);
}

// The k-th largest of x[0, V), 1 <= k <= V. One pass where a guess holds: a sample of every kStride-th value
// puts a floor under the row's k largest (its r-th largest, r ~ k / kStride plus a margin of a few standard
// deviations), the values at or above it are gathered, and when there are k or more the k-th largest is among
// them. Else (an unlucky sample, or k near V) the radix selection's two passes.
float row_kth_largest(const float* x, int64_t V, int64_t k, std::vector<int32_t>& count,
                      std::vector<uint32_t>& candidates) {
  constexpr int64_t kStride = 32;
  const int64_t samples = V / kStride;
  const int64_t expected = k / kStride;
  const int64_t rank = expected + 4 + 3 * static_cast<int64_t>(std::sqrt(static_cast<double>(expected)));
  if (rank < samples / 4) {
    candidates.resize(std::max(V, samples) + 1);
    for (int64_t j = 0; j < samples; ++j) candidates[j] = order_key(x[j * kStride]);
    std::nth_element(candidates.begin(), candidates.begin() + (rank - 1), candidates.begin() + samples,
                     std::greater<uint32_t>());
    const uint32_t guess = candidates[rank - 1];
    int64_t n = 0;
    for (int64_t i = 0; i < V; ++i) {
      const uint32_t key = order_key(x[i]);
      candidates[n] = key;
      n += key >= guess;
    }
    if (n >= k) {
      const auto nth = candidates.begin() + (k - 1);
      std::nth_element(candidates.begin(), nth, candidates.begin() + n, std::greater<uint32_t>());
      return key_value(*nth);
    }
  }
  return radix_kth_largest(x, V, k, count, candidates);
}

// out [R, V] = logits with every value below its row's k-th largest set to -inf (ties with it kept; NaN kept),
// k [R] int64 (clamped to [1, V]: V or more keeps the row whole). float32, contiguous.
void top_k_mask(at::Tensor& out, const at::Tensor& logits, const at::Tensor& k) {
  TORCH_CHECK(logits.scalar_type() == at::kFloat && logits.dim() == 2 && logits.is_contiguous(),
              "top_k_mask: logits contiguous float32 [rows, vocab]");
  const int64_t R = logits.size(0), V = logits.size(1);
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.sizes() == logits.sizes() &&
                  k.scalar_type() == at::kLong && k.is_contiguous() && k.numel() == R,
              "top_k_mask: out float32 as logits, k int64 [rows], contiguous");
  const float* x = logits.data_ptr<float>();
  const int64_t* kk = k.data_ptr<int64_t>();
  float* y = out.data_ptr<float>();
  if (V == 0) return;
  pagedserve::shared_for(R, [&](int64_t begin, int64_t end) {
    std::vector<int32_t> count(4096);
    std::vector<uint32_t> candidates;
    for (int64_t r = begin; r < end; ++r) {
      const float* row = x + r * V;
      float* masked = y + r * V;
      const int64_t rank = std::clamp<int64_t>(kk[r], 1, V);
      if (rank >= V) {
        std::memcpy(masked, row, V * sizeof(float));
        continue;
      }
      const float kth = row_kth_largest(row, V, rank, count, candidates);
      const float none = -std::numeric_limits<float>::infinity();
      for (int64_t i = 0; i < V; ++i) masked[i] = row[i] < kth ? none : row[i];
    }
  });
}

// The first index whose running sum of w exceeds u * the sum (zero weights never are); the last weighted index
// should rounding carry the target past the sum; 0 for a row without weight (NaN).
int64_t row_draw(const float* w, int64_t V, double u) {
  double total = 0.0;
  for (int64_t i = 0; i < V; ++i) total += w[i];
  const double target = u * total;
  double running = 0.0;
  int64_t last = 0;
  for (int64_t i = 0; i < V; ++i) {
    if (!(w[i] > 0.f)) continue;
    running += w[i];
    last = i;
    if (running > target) return i;
  }
  return last;
}

// tokens [R] (int64) = one index per row of weights [R, V] (float32, non-negative), drawn by inverse CDF with
// u [R] (float64, uniform in [0, 1)): two passes over the row, where torch's float64 running sums took ~3x.
void draw(at::Tensor& tokens, const at::Tensor& weights, const at::Tensor& u) {
  TORCH_CHECK(weights.scalar_type() == at::kFloat && weights.dim() == 2 && weights.is_contiguous(),
              "draw: weights contiguous float32 [rows, vocab]");
  const int64_t R = weights.size(0), V = weights.size(1);
  TORCH_CHECK(u.scalar_type() == at::kDouble && u.is_contiguous() && u.numel() == R &&
                  tokens.scalar_type() == at::kLong && tokens.is_contiguous() && tokens.numel() == R,
              "draw: u float64 and tokens int64, contiguous [rows]");
  const float* w = weights.data_ptr<float>();
  const double* uu = u.data_ptr<double>();
  int64_t* out = tokens.data_ptr<int64_t>();
  pagedserve::shared_for(R, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) out[r] = row_draw(w + r * V, V, uu[r]);
  });
}

// The first index whose running sum of w's kept values (>= floor and > 0) exceeds target: by blocks of 16, summed
// in float lanes, to the block where the sum crosses, then value by value; the last kept index should rounding
// carry the target past the sum; 0 for a row with nothing kept.
int64_t draw_kept(const float* w, int64_t V, double target, float floor) {
  const auto kept = [floor](float x) { return (x >= floor) & (x > 0.f) ? x : 0.f; };
  double running = 0.0;
  int64_t i = 0;
  for (; i + 16 <= V; i += 16) {
    float lanes[16];
#pragma GCC unroll 16
    for (int j = 0; j < 16; ++j) lanes[j] = kept(w[i + j]);
    for (int width = 8; width > 0; width /= 2) {
      for (int j = 0; j < width; ++j) lanes[j] += lanes[j + width];
    }
    if (running + lanes[0] > target) break;
    running += lanes[0];
  }
  for (; i < V; ++i) {
    running += kept(w[i]);
    if (kept(w[i]) > 0.f && running > target) return i;
  }
  for (i = V - 1; i >= 0; --i) {
    if (kept(w[i]) > 0.f) return i;
  }
  return 0;
}

struct RowScratch {
  explicit RowScratch(int64_t V) : w(V), count(4096), mass(4096) {}
  std::vector<float> w, candidates;
  std::vector<int32_t> count;
  std::vector<uint32_t> keys;
  std::vector<double> mass;
};

// The largest value of the row (NaN aside).
float row_max(const float* __restrict row, int64_t V) {
  float top[16];
  std::fill(top, top + 16, -std::numeric_limits<float>::infinity());
  int64_t i = 0;
  for (; i + 16 <= V; i += 16) {
#pragma GCC unroll 16  // unrolled in full, the 16 lanes become vector registers
    for (int j = 0; j < 16; ++j) top[j] = row[i + j] > top[j] ? row[i + j] : top[j];
  }
  for (; i < V; ++i) top[0] = row[i] > top[0] ? row[i] : top[0];
  return *std::max_element(top, top + 16);
}

// w = exp(row / t - largest) where row / t >= lowest, else 0; returns the sum.
double exp_row(const float* __restrict row, int64_t V, float t, float largest, float lowest, float* __restrict w) {
  const auto weight = [=](float x) {
    const float v = x / t;
    const bool kept = v >= lowest;
    float d = v - largest;
    d = kept ? d : -100.f;  // within exp's clamp, never NaN
    const float e = pagedserve::fast_exp(d);
    return kept ? e : 0.f;
  };
  float lanes[16] = {};
  int64_t i = 0;
  for (; i + 16 <= V; i += 16) {
    for (int j = 0; j < 16; ++j) {
      w[i + j] = weight(row[i + j]);
      lanes[j] += w[i + j];
    }
  }
  double total = 0.0;
  for (; i < V; ++i) total += w[i] = weight(row[i]);
  for (float lane : lanes) total += lane;
  return total;
}

// Division by t > 0 keeps the order of the row, and rounding keeps it monotone: the largest scaled value and the
// k-th largest are the raw row's, divided; so only the exp pass divides.
int64_t sample_row(const float* row, int64_t V, float t, int64_t top_k, float top_p, double u, RowScratch& s) {
  float* w = s.w.data();
  const float largest = row_max(row, V) / t;
  // Kept: at least the k-th largest, and finite (-inf: masked already; NaN: a broken row's, never drawn).
  const int64_t k = std::clamp<int64_t>(top_k, 1, V);
  const float kth = k < V ? row_kth_largest(row, V, k, s.count, s.keys) / t : -std::numeric_limits<float>::infinity();
  const double total = exp_row(row, V, t, largest, std::max(kth, std::numeric_limits<float>::lowest()), w);
  double kept = total;
  const float floor = top_p < 1.f ? row_floor(w, V, top_p * total, s.mass, s.count, s.candidates, &kept) : 0.f;
  return draw_kept(w, V, u * kept, floor);
}

// tokens [R] = one token per row of logits [R, V] drawn as Sampler draws it (processed_probs, then an inverse CDF
// with u [R] float64), for rows without min_p: logits / temperature [R] (> 0), the values below the top_k [R]-th
// largest masked (V or more: none), softmax, the tokens outside the top_p [R] nucleus (1 or more: none) dropped.
// Row by row in a buffer that stays in L2: torch's ops for the same steps each stream the whole batch's logits
// (64 x 32k: 8 MiB) through memory, one to four times. The probabilities are left unnormalized: exp(w - max), and
// the nucleus's floor and the draw take the row's kept mass as the whole.
void sample_rows(at::Tensor& tokens, const at::Tensor& logits, const at::Tensor& temperature, const at::Tensor& top_k,
                 const at::Tensor& top_p, const at::Tensor& u) {
  TORCH_CHECK(logits.scalar_type() == at::kFloat && logits.dim() == 2 && logits.is_contiguous(),
              "sample_rows: logits contiguous float32 [rows, vocab]");
  const int64_t R = logits.size(0), V = logits.size(1);
  TORCH_CHECK(temperature.scalar_type() == at::kFloat && temperature.is_contiguous() && temperature.numel() == R &&
                  top_p.scalar_type() == at::kFloat && top_p.is_contiguous() && top_p.numel() == R &&
                  top_k.scalar_type() == at::kLong && top_k.is_contiguous() && top_k.numel() == R &&
                  u.scalar_type() == at::kDouble && u.is_contiguous() && u.numel() == R &&
                  tokens.scalar_type() == at::kLong && tokens.is_contiguous() && tokens.numel() == R,
              "sample_rows: temperature and top_p float32, top_k and tokens int64, u float64, contiguous [rows]");
  const float* x = logits.data_ptr<float>();
  const float* temp = temperature.data_ptr<float>();
  const int64_t* kk = top_k.data_ptr<int64_t>();
  const float* tp = top_p.data_ptr<float>();
  const double* uu = u.data_ptr<double>();
  int64_t* out = tokens.data_ptr<int64_t>();
  if (V == 0) return;
  pagedserve::shared_for(R, [&](int64_t begin, int64_t end) {
    RowScratch scratch(V);
    for (int64_t r = begin; r < end; ++r) out[r] = sample_row(x + r * V, V, temp[r], kk[r], tp[r], uu[r], scratch);
  });
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("top_k_mask", &top_k_mask, "each row's logits below its k-th largest masked with -inf (CPU)");
  m.def("top_p_mask", &top_p_mask, "each row's probabilities outside its top-p nucleus zeroed, renormalized (CPU)");
  m.def("draw", &draw, "one index per row of weights, by inverse CDF (CPU)");
  m.def("sample_rows", &sample_rows, "one token per row of logits: temperature, top-k, softmax, top-p, draw (CPU)");
}
