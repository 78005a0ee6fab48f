// exp for the CPU kernels' vector loops: std::exp does not vectorise (without -ffast-math), this does.
// Cephes' exp2f polynomial after reduction to 2^n * 2^f, |f| <= 1/2; relative error ~2e-7 over [-87, 88],
// arguments outside clamped to it (exp(-87) ~ 2e-38, exp(88) ~ 1.7e38: no denormals, no infinity).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace pagedserve {

inline float fast_exp(float x) {
  x = std::min(std::max(x, -87.0f), 88.0f);
  const float t = x * 1.44269504088896341f;
  // Rounded to nearest by the float32 mantissa's own rounding (exact for |t| < 2^22): GCC does not vectorise
  // std::floor without -fno-trapping-math, and with it the whole loop stayed scalar.
  const float n = (t + 12582912.0f) - 12582912.0f;
  const float f = t - n;
  float p = 1.535336188319500e-4f;
  p = p * f + 1.339887440266574e-3f;
  p = p * f + 9.618437357674640e-3f;
  p = p * f + 5.550332471162809e-2f;
  p = p * f + 2.402264791363012e-1f;
  p = p * f + 6.931472028550421e-1f;
  p = p * f + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

}  // namespace pagedserve
