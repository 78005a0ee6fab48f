// A decode step through a stage's decoder layers in one call, for the CPU: the Llama family's dense layer
// (engine/models/llama.py's DecoderLayer: RMSNorm, fused QKV, neox rotary, paged attention, O, RMSNorm, fused
// gate-up, SiLU-and-multiply, down) with our other modules' kernels, reached through capsules (kernel_capsules.h).
//
// Why: at batch 1 the kernels of the 56M model's step take ~4.7 ms and the Python between them ~1.4 ms more
// (~10 calls a layer, each a few microseconds of Python that runs cold once the weights have streamed through
// the caches). Here a layer costs its kernels and ~10 tensor allocations. The math, the kernels and their order
// are the Python path's, so results are the same bit for bit.
#include <ATen/EmptyTensor.h>
#include <ATen/core/Tensor.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <optional>
#include <tuple>
#include <vector>

#include "kernel_capsules.h"

namespace {

constexpr int64_t kRowBlock = 512;  // rows of x per linear call: ops/cpu/linear.py's ROW_BLOCK says why

// A layer's tensors, in the order the constructor takes them (ops/cpu/decode_stack.py's DecodeLayer).
struct Layer {
  at::Tensor input_norm, qkv;
  std::optional<at::Tensor> qkv_bias;
  at::Tensor o;
  std::optional<at::Tensor> o_bias;
  at::Tensor post_norm, gate_up;
  std::optional<at::Tensor> gate_up_bias;
  at::Tensor down;
  std::optional<at::Tensor> down_bias;
  at::Tensor kv_cache;
};

using LayerTensors = std::tuple<at::Tensor, at::Tensor, std::optional<at::Tensor>, at::Tensor, std::optional<at::Tensor>,
                                at::Tensor, at::Tensor, std::optional<at::Tensor>, at::Tensor, std::optional<at::Tensor>,
                                at::Tensor>;

struct Shape {
  int64_t hidden, intermediate, heads, kv_heads, head_dim;
};

class DecodeStack {
 public:
  DecodeStack(const pybind11::capsule& linear, const pybind11::capsule& rms_norm, const pybind11::capsule& rotary,
              const pybind11::capsule& silu_and_mul, const pybind11::capsule& store_kv,
              const pybind11::capsule& attention, const std::vector<LayerTensors>& layers, at::Tensor cos,
              at::Tensor sin, double eps, double scale, int64_t heads, int64_t kv_heads, int64_t head_dim)
      : linear_(pagedserve::kernel_of<pagedserve::LinearKernel>(linear, "LinearKernel")),
        rms_norm_(pagedserve::kernel_of<pagedserve::RmsNormKernel>(rms_norm, "RmsNormKernel")),
        rotary_(pagedserve::kernel_of<pagedserve::RotaryKernel>(rotary, "RotaryKernel")),
        silu_and_mul_(pagedserve::kernel_of<pagedserve::SiluAndMulKernel>(silu_and_mul, "SiluAndMulKernel")),
        store_kv_(pagedserve::kernel_of<pagedserve::StoreKvKernel>(store_kv, "StoreKvKernel")),
        attention_(pagedserve::kernel_of<pagedserve::DecodeAttentionKernel>(attention, "DecodeAttentionKernel")),
        cos_(std::move(cos)), sin_(std::move(sin)), eps_(eps), scale_(scale) {
    TORCH_CHECK(!layers.empty(), "DecodeStack: no layers");
    for (const LayerTensors& t : layers) {
      layers_.push_back({std::get<0>(t), std::get<1>(t), std::get<2>(t), std::get<3>(t), std::get<4>(t),
                         std::get<5>(t), std::get<6>(t), std::get<7>(t), std::get<8>(t), std::get<9>(t),
                         std::get<10>(t)});
    }
    const at::Tensor& norm = layers_[0].input_norm;
    dtype_ = norm.scalar_type();
    shape_ = {norm.numel(), 0, heads, kv_heads, head_dim};
    // The linear kernels' panels say their output features (16 per panel); the caller checked they are exact.
    shape_.intermediate = layers_[0].down.size(1) * (layers_[0].down.dim() == 4 ? 2 : 1);
    TORCH_CHECK(heads > 0 && kv_heads > 0 && heads % kv_heads == 0 && head_dim % 2 == 0,
                "DecodeStack: heads a multiple of kv_heads, head_dim even");
    for (const Layer& l : layers_) {
      TORCH_CHECK(l.input_norm.scalar_type() == dtype_ && l.post_norm.scalar_type() == dtype_ &&
                      l.kv_cache.scalar_type() == dtype_ && l.input_norm.numel() == shape_.hidden &&
                      l.post_norm.numel() == shape_.hidden && l.kv_cache.dim() == 5 &&
                      l.kv_cache.size(3) == kv_heads && l.kv_cache.size(4) == head_dim,
                  "DecodeStack: every layer's norms and KV cache in the model's dtype and shape");
    }
  }

  // x [n, hidden] (n decoding sequences, one token each), residual as the Python layers pass it (None before the
  // first layer); positions int64 [n]; block_tables int32 [n, max_blocks], seq_lens int32 [n] and k_rows int64 [n]
  // as the torch attention backend plans them. Returns (hidden states, residual) after the last layer.
  std::tuple<at::Tensor, at::Tensor> forward(at::Tensor x, std::optional<at::Tensor> residual,
                                             const at::Tensor& positions, const at::Tensor& block_tables,
                                             const at::Tensor& seq_lens, const at::Tensor& k_rows) const {
    const Shape& s = shape_;
    TORCH_CHECK(x.dim() == 2 && x.size(1) == s.hidden && x.scalar_type() == dtype_ && x.is_contiguous(),
                "DecodeStack: x [tokens, ", s.hidden, "], contiguous, in the model's dtype");
    const int64_t n = x.size(0), D = s.head_dim, qkv_width = (s.heads + 2 * s.kv_heads) * D;
    const auto empty = [&](std::initializer_list<int64_t> sizes) {
      return at::detail::empty_cpu(sizes, dtype_, false, std::nullopt);
    };
    const auto linear = [&](const at::Tensor& out, const at::Tensor& in, const at::Tensor& w,
                            const std::optional<at::Tensor>& bias) {
      for (int64_t r = 0; r < n; r += kRowBlock) {
        const int64_t rows = std::min(kRowBlock, n - r);
        linear_(rows == n ? out : out.narrow(0, r, rows), rows == n ? in : in.narrow(0, r, rows), w, bias);
      }
    };
    at::Tensor res = residual ? *residual : at::Tensor();
    for (const Layer& l : layers_) {
      at::Tensor h = empty({n, s.hidden});
      if (res.defined()) {
        at::Tensor sum = empty({n, s.hidden});
        rms_norm_(h, sum, x, res, l.input_norm, eps_);
        res = sum;
      } else {
        rms_norm_(h, std::nullopt, x, std::nullopt, l.input_norm, eps_);
        res = x;
      }
      at::Tensor qkv = empty({n, qkv_width});
      linear(qkv, h, l.qkv, l.qkv_bias);
      // q's heads then k's, side by side in qkv: rotated in place, together
      at::Tensor qk = qkv.as_strided({n, s.heads + s.kv_heads, D}, {qkv_width, D, 1});
      rotary_(qk, qk, positions, cos_, sin_);
      const at::Tensor q = qkv.as_strided({n, s.heads, D}, {qkv_width, D, 1});
      const at::Tensor k = qkv.as_strided({n, s.kv_heads, D}, {qkv_width, D, 1}, s.heads * D);
      const at::Tensor v = qkv.as_strided({n, s.kv_heads, D}, {qkv_width, D, 1}, (s.heads + s.kv_heads) * D);
      store_kv_(l.kv_cache, k, v, k_rows);
      at::Tensor attended = empty({n, s.heads, D});
      attention_(attended, q, l.kv_cache, block_tables, seq_lens, scale_, 0, no_sinks_);
      at::Tensor o = empty({n, s.hidden});
      linear(o, attended.view({n, s.heads * D}), l.o, l.o_bias);
      h = empty({n, s.hidden});
      at::Tensor sum = empty({n, s.hidden});
      rms_norm_(h, sum, o, res, l.post_norm, eps_);
      res = sum;
      at::Tensor gate_up = empty({n, 2 * s.intermediate});
      linear(gate_up, h, l.gate_up, l.gate_up_bias);
      at::Tensor act = empty({n, s.intermediate});
      silu_and_mul_(act, gate_up);
      x = empty({n, s.hidden});
      linear(x, act, l.down, l.down_bias);
    }
    return {x, res};
  }

 private:
  pagedserve::LinearKernel linear_;
  pagedserve::RmsNormKernel rms_norm_;
  pagedserve::RotaryKernel rotary_;
  pagedserve::SiluAndMulKernel silu_and_mul_;
  pagedserve::StoreKvKernel store_kv_;
  pagedserve::DecodeAttentionKernel attention_;
  std::vector<Layer> layers_;
  at::Tensor cos_, sin_;
  at::Tensor no_sinks_ = at::detail::empty_cpu({0}, at::kFloat, false, std::nullopt);
  double eps_, scale_;
  at::ScalarType dtype_;
  Shape shape_{};
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  pybind11::class_<DecodeStack>(m, "DecodeStack")
      .def(pybind11::init<const pybind11::capsule&, const pybind11::capsule&, const pybind11::capsule&,
                          const pybind11::capsule&, const pybind11::capsule&, const pybind11::capsule&,
                          const std::vector<LayerTensors>&, at::Tensor, at::Tensor, double, double, int64_t, int64_t,
                          int64_t>())
      .def("forward", &DecodeStack::forward, "A decode step through every layer: (hidden states, residual)");
}
