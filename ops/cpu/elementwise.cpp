// Three elementwise parts of a decoder layer, one pass each, for the CPU: RMSNorm (after the residual add),
// neox-style rotary embeddings and SiLU-and-multiply. In torch each is 3-8 ops, each a dispatch and a pass over
// memory; here RMSNorm with its residual add took 0.15 ms against torch's 0.3 for 2,048 tokens of the 56M model,
// the rotary embedding of q and k 0.14 ms against 0.7-1.5 (2 threads). At batch 1 the dispatches are the cost:
// a decode step of the 56M model ran chunk, SiLU and multiply in 0.2 ms, ~25 us a layer, for 1,376 values.
// Rotary embeddings rotate in place when given their input as output: q's and k's heads, side by side in the
// fused QKV output, turn in one call. The math is the torch path's (engine/models/layers), in float32, rounded to
// bfloat16 where torch rounds, so results differ only in summation order (and SiLU's exp, ~2e-7 relative).
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <torch/csrc/utils/pybind.h>

#include <cmath>
#include <vector>

#include "fast_exp.h"
#include "kernel_capsules.h"
#include "work_sharing.h"

namespace {

constexpr int64_t kParallelGrain = 1 << 15;  // below this many elements a call stays on the calling thread

template <typename F>
void for_rows(int64_t rows, int64_t width, const F& f) {
  if (rows * width < kParallelGrain) {
    f(0, rows);
  } else {
    pagedserve::shared_for(rows, f);
  }
}

// float32 in and out as is; bfloat16 widened, and rounded to nearest even on the way back.
template <typename T>
inline float wide(T x) {
  return static_cast<float>(x);
}
template <typename T>
inline T narrow(float x) {
  return static_cast<T>(x);
}

template <typename T>
void rms_norm_rows(T* out, T* residual_out, const T* x, const T* residual, const T* weight, int64_t rows, int64_t D,
                   float eps) {
  for_rows(rows, D, [&](int64_t begin, int64_t end) {
    std::vector<float> h(D);
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * D;
      if (residual != nullptr) {  // torch adds in the model's dtype, then normalises that sum
        const T* rr = residual + r * D;
        T* sum = residual_out + r * D;
        for (int64_t d = 0; d < D; ++d) {
          sum[d] = narrow<T>(wide(xr[d]) + wide(rr[d]));
          h[d] = wide(sum[d]);
        }
      } else {
        for (int64_t d = 0; d < D; ++d) h[d] = wide(xr[d]);
      }
      float squares = 0.0f;
#pragma omp simd reduction(+ : squares)
      for (int64_t d = 0; d < D; ++d) squares += h[d] * h[d];
      const float inv = 1.0f / std::sqrt(squares / static_cast<float>(D) + eps);
      T* o = out + r * D;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) o[d] = narrow<T>(wide(weight[d]) * wide(narrow<T>(h[d] * inv)));
    }
  });
}

// x and out [tokens, heads, D], each with its own token and head strides (views of the fused QKV output); out
// may be x: each pair is read before it is written.
template <typename T>
void rotary_rows(T* out, const T* x, int64_t tokens, int64_t heads, int64_t D, int64_t token_stride,
                 int64_t head_stride, int64_t out_token_stride, int64_t out_head_stride, const int64_t* positions,
                 const float* cos, const float* sin) {
  const int64_t half = D / 2;
  for_rows(tokens, heads * D, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cos + positions[t] * half;
      const float* s = sin + positions[t] * half;
      for (int64_t h = 0; h < heads; ++h) {
        const T* xi = x + t * token_stride + h * head_stride;
        T* o = out + t * out_token_stride + h * out_head_stride;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = wide(xi[i]), x2 = wide(xi[i + half]);
          o[i] = narrow<T>(x1 * c[i] - x2 * s[i]);
          o[i + half] = narrow<T>(x2 * c[i] + x1 * s[i]);
        }
      }
    }
  });
}

// x [rows, 2 I]: gate then up; out [rows, I] = silu(gate) * up, rounded where torch rounds (silu's result, then
// the product).
template <typename T>
void silu_and_mul_rows(T* out, const T* x, int64_t rows, int64_t I) {
  for_rows(rows, 2 * I, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* gate = x + r * 2 * I;
      const T* up = gate + I;
      T* o = out + r * I;
#pragma omp simd
      for (int64_t i = 0; i < I; ++i) {
        const float g = wide(gate[i]);
        o[i] = narrow<T>(wide(narrow<T>(g / (1.0f + pagedserve::fast_exp(-g)))) * wide(up[i]));
      }
    }
  });
}

template <typename F>
void dispatch(const at::Tensor& t, const F& f) {
  if (t.scalar_type() == at::kFloat) {
    f(float{});
  } else {
    TORCH_CHECK(t.scalar_type() == at::kBFloat16, "elementwise kernels take float32 or bfloat16, got ", t.scalar_type());
    f(c10::BFloat16{});
  }
}

// x, weight and out contiguous; with `residual` (same shape as x), residual_out = x + residual is normalised.
void rms_norm(at::Tensor& out, std::optional<at::Tensor> residual_out, const at::Tensor& x,
              std::optional<at::Tensor> residual, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.is_contiguous() && out.is_contiguous() && weight.is_contiguous(), "rms_norm: contiguous tensors only");
  const int64_t D = x.size(-1), rows = x.numel() / D;
  dispatch(x, [&](auto zero) {
    using T = decltype(zero);
    rms_norm_rows<T>(out.data_ptr<T>(), residual ? residual_out->data_ptr<T>() : nullptr, x.data_ptr<T>(),
                     residual ? residual->data_ptr<T>() : nullptr, weight.data_ptr<T>(), rows, D, static_cast<float>(eps));
  });
}

// out may be x (in place); both [tokens, heads, head_dim] with unit stride in head_dim.
void rotary_neox(at::Tensor& out, const at::Tensor& x, const at::Tensor& positions, const at::Tensor& cos,
                 const at::Tensor& sin) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && out.dim() == 3 && out.stride(2) == 1 &&
              out.sizes() == x.sizes() && out.scalar_type() == x.scalar_type(),
              "rotary_neox: x and out [tokens, heads, head_dim], same dtype");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() && cos.scalar_type() == at::kFloat && cos.is_contiguous() &&
              sin.is_contiguous(), "rotary_neox: int64 positions, contiguous float32 cos and sin");
  TORCH_CHECK(cos.size(-1) * 2 == x.size(2) && positions.numel() == x.size(0), "rotary_neox: shapes disagree");
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < positions.numel(); ++t) {  // a bad position would read outside the tables
    TORCH_CHECK(pos[t] >= 0 && pos[t] < cos.size(0), "rotary_neox: position ", pos[t], " outside [0, ", cos.size(0), ")");
  }
  dispatch(x, [&](auto zero) {
    using T = decltype(zero);
    rotary_rows<T>(out.data_ptr<T>(), x.data_ptr<T>(), x.size(0), x.size(1), x.size(2), x.stride(0), x.stride(1),
                   out.stride(0), out.stride(1), pos, cos.data_ptr<float>(), sin.data_ptr<float>());
  });
}

void silu_and_mul(at::Tensor& out, const at::Tensor& x) {
  TORCH_CHECK(x.is_contiguous() && out.is_contiguous() && x.size(-1) % 2 == 0 && out.size(-1) * 2 == x.size(-1) &&
              out.numel() * 2 == x.numel() && out.scalar_type() == x.scalar_type(),
              "silu_and_mul: contiguous x [..., 2 I] and out [..., I], same dtype");
  const int64_t I = out.size(-1);
  dispatch(x, [&](auto zero) {
    using T = decltype(zero);
    silu_and_mul_rows<T>(out.data_ptr<T>(), x.data_ptr<T>(), out.numel() / std::max<int64_t>(I, 1), I);
  });
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // for decode_stack.cpp
  m.attr("rms_norm_kernel") = pagedserve::kernel_capsule<pagedserve::RmsNormKernel>(&rms_norm, "RmsNormKernel");
  m.attr("rotary_neox_kernel") = pagedserve::kernel_capsule<pagedserve::RotaryKernel>(&rotary_neox, "RotaryKernel");
  m.attr("silu_and_mul_kernel") =
      pagedserve::kernel_capsule<pagedserve::SiluAndMulKernel>(&silu_and_mul, "SiluAndMulKernel");
  m.def("rms_norm", &rms_norm, "RMSNorm, after adding the residual when one is given (CPU)");
  m.def("rotary_neox", &rotary_neox, "Neox-style rotary embedding, in place when out is x (CPU)");
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up of x = [gate, up] (CPU)");
}
