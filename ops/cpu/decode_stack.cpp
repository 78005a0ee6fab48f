// A decode step through a stage's decoder layers in one call, for the CPU: the Llama family's dense layer
// (engine/models/llama.py's DecoderLayer: RMSNorm, fused QKV, neox rotary, paged attention, O, RMSNorm, fused
// gate-up, SiLU-and-multiply, down) with our other modules' kernels, reached through capsules (kernel_capsules.h).
//
// Why: at batch 1 the kernels of the 56M model's step take ~4.7 ms and the Python between them ~1.4 ms more
// (~10 calls a layer, each a few microseconds of Python that runs cold once the weights have streamed through
// the caches). Here a layer costs its kernels and ~10 tensor allocations. The math, the kernels and their order
// are the Python path's, so results are the same bit for bit. For a whole model (one stage, one rank), logits()
// also takes the embedding, the final norm and the LM head: each torch op the Python around the layers calls costs
// ~50 us at its first call in a step, code and data having been streamed out of every cache by the weights.
#include <ATen/EmptyTensor.h>
#include <ATen/core/Tensor.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <cstring>
#include <optional>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "kernel_capsules.h"

namespace {

constexpr int64_t kRowBlock = 512;  // rows of x per linear call: ops/cpu/linear.py's ROW_BLOCK says why

// A linear layer: which of panel_linear.cpp's kernels computes it, with what (ops/cpu/decode_stack.py's Projection).
enum class Kernel { kFloat32, kBfloat16, kW8A8, kW4A8 };
struct Projection {
  Kernel kernel;
  at::Tensor weight;
  std::optional<at::Tensor> scales;
  int64_t group;
  std::optional<at::Tensor> bias;
};
using ProjectionArgs = std::tuple<std::string, at::Tensor, std::optional<at::Tensor>, int64_t, std::optional<at::Tensor>>;

// A layer's tensors, in the order the constructor takes them (ops/cpu/decode_stack.py's DecodeLayer).
struct Layer {
  at::Tensor input_norm;
  Projection qkv, o;
  at::Tensor post_norm;
  Projection gate_up, down;
  at::Tensor kv_cache;
};
using LayerArgs = std::tuple<at::Tensor, ProjectionArgs, ProjectionArgs, at::Tensor, ProjectionArgs, ProjectionArgs,
                             at::Tensor>;

Projection projection_of(const ProjectionArgs& args) {
  const auto& [name, weight, scales, group, bias] = args;
  const Kernel kernel = name == "float32" ? Kernel::kFloat32 : name == "bfloat16" ? Kernel::kBfloat16
                        : name == "w8a8" ? Kernel::kW8A8 : name == "w4a8" ? Kernel::kW4A8
                        : throw std::invalid_argument("DecodeStack: no linear kernel " + name);
  TORCH_CHECK(kernel == Kernel::kFloat32 || kernel == Kernel::kBfloat16 || scales, "DecodeStack: ", name,
              " projections take scales");
  return {kernel, weight, scales, group, bias};
}

// The W8A8 and W4A8 kernels quantize float32 rows of x (a bfloat16 model's widened first, as ops/cpu/linear.py does)
at::Tensor float32(const at::Tensor& x) {
  return x.scalar_type() == at::kFloat ? x : x.to(at::kFloat);
}

struct Shape {
  int64_t hidden, intermediate, heads, kv_heads, head_dim;
};

class DecodeStack {
 public:
  // kernels: each kernel's capsule by its name in kernel_capsules.h's modules (float32_linear, ..., store_kv).
  DecodeStack(const pybind11::dict& kernels, const std::vector<LayerArgs>& layers, at::Tensor cos, at::Tensor sin,
              double eps, double scale, int64_t hidden, int64_t intermediate, int64_t heads, int64_t kv_heads,
              int64_t head_dim)
      : float32_(kernel<pagedserve::LinearKernel>(kernels, "float32_linear", "LinearKernel")),
        bfloat16_(kernel<pagedserve::LinearKernel>(kernels, "bfloat16_linear", "LinearKernel")),
        w8a8_(kernel<pagedserve::W8A8Kernel>(kernels, "w8a8_linear", "W8A8Kernel")),
        w4a8_(kernel<pagedserve::W4A8Kernel>(kernels, "w4a8_linear", "W4A8Kernel")),
        rms_norm_(kernel<pagedserve::RmsNormKernel>(kernels, "rms_norm", "RmsNormKernel")),
        rotary_(kernel<pagedserve::RotaryKernel>(kernels, "rotary_neox", "RotaryKernel")),
        silu_and_mul_(kernel<pagedserve::SiluAndMulKernel>(kernels, "silu_and_mul", "SiluAndMulKernel")),
        store_kv_(kernel<pagedserve::StoreKvKernel>(kernels, "store_kv", "StoreKvKernel")),
        attention_(kernel<pagedserve::DecodeAttentionKernel>(kernels, "paged_decode_attention",
                                                             "DecodeAttentionKernel")),
        cos_(std::move(cos)), sin_(std::move(sin)), eps_(eps), scale_(scale),
        shape_{hidden, intermediate, heads, kv_heads, head_dim} {
    TORCH_CHECK(!layers.empty(), "DecodeStack: no layers");
    TORCH_CHECK(heads > 0 && kv_heads > 0 && heads % kv_heads == 0 && head_dim % 2 == 0,
                "DecodeStack: heads a multiple of kv_heads, head_dim even");
    dtype_ = std::get<0>(layers[0]).scalar_type();
    for (const LayerArgs& t : layers) {
      layers_.push_back({std::get<0>(t), projection_of(std::get<1>(t)), projection_of(std::get<2>(t)), std::get<3>(t),
                         projection_of(std::get<4>(t)), projection_of(std::get<5>(t)), std::get<6>(t)});
    }
    for (const Layer& l : layers_) {
      TORCH_CHECK(l.input_norm.scalar_type() == dtype_ && l.post_norm.scalar_type() == dtype_ &&
                      l.kv_cache.scalar_type() == dtype_ && l.input_norm.numel() == shape_.hidden &&
                      l.post_norm.numel() == shape_.hidden && l.kv_cache.dim() == 5 &&
                      l.kv_cache.size(3) == kv_heads && l.kv_cache.size(4) == head_dim,
                  "DecodeStack: every layer's norms and KV cache in the model's dtype and shape");
    }
  }

  // The rest of a whole model's decode step, for logits(): the embedding table [vocab rows, hidden], the final
  // norm's weight and eps, and the LM head (its panels' output columns, of which the first `vocab` are logits).
  void set_head(at::Tensor embedding, at::Tensor norm, double norm_eps, const ProjectionArgs& lm_head, int64_t vocab) {
    TORCH_CHECK(embedding.dim() == 2 && embedding.size(1) == shape_.hidden && embedding.is_contiguous() &&
                    embedding.scalar_type() == dtype_ && norm.numel() == shape_.hidden && norm.is_contiguous() &&
                    norm.scalar_type() == dtype_,
                "DecodeStack: the embedding [vocab, hidden] and the final norm in the model's dtype, contiguous");
    head_ = Head{std::move(embedding), std::move(norm), norm_eps, projection_of(lm_head), vocab};
  }

  // A decode step from token ids to logits [n, vocab] in the model's dtype: the embedding's rows, every layer
  // (forward), the final norm and the LM head. input_ids and slot_mapping int64 [n] (each token's KV slot:
  // block * block_size + offset); the rest as forward takes them.
  at::Tensor logits(const at::Tensor& input_ids, const at::Tensor& positions, const at::Tensor& block_tables,
                    const at::Tensor& seq_lens, const at::Tensor& slot_mapping, int64_t block_size) const {
    TORCH_CHECK(head_, "DecodeStack: logits() needs set_head() first");
    const Head& head = *head_;
    TORCH_CHECK(input_ids.dim() == 1 && input_ids.scalar_type() == at::kLong && input_ids.is_contiguous() &&
                    slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() &&
                    slot_mapping.numel() == input_ids.numel() && block_size > 0,
                "DecodeStack: input_ids and slot_mapping int64 [tokens]");
    const int64_t n = input_ids.size(0), rows = head.embedding.size(0);
    // The row of each token's K in the cache viewed as [blocks * 2 * block_size, kv_heads, head_dim]
    // (ops/attention/backend.py's kv_rows)
    at::Tensor k_rows = at::detail::empty_cpu({n}, at::kLong, false, std::nullopt);
    const int64_t* slots = slot_mapping.data_ptr<int64_t>();
    for (int64_t i = 0; i < n; ++i)
      k_rows.data_ptr<int64_t>()[i] = slots[i] / block_size * 2 * block_size + slots[i] % block_size;
    const int64_t row_bytes = shape_.hidden * static_cast<int64_t>(head.embedding.element_size());
    at::Tensor x = empty({n, shape_.hidden});
    const int64_t* ids = input_ids.data_ptr<int64_t>();
    const char* table = static_cast<const char*>(head.embedding.data_ptr());
    for (int64_t i = 0; i < n; ++i) {
      TORCH_CHECK(ids[i] >= 0 && ids[i] < rows, "DecodeStack: token id ", ids[i], " outside the embedding's ", rows,
                  " rows");
      std::memcpy(static_cast<char*>(x.data_ptr()) + i * row_bytes, table + ids[i] * row_bytes, row_bytes);
    }
    auto [h, res] = forward(x, std::nullopt, positions, block_tables, seq_lens, k_rows);
    at::Tensor normed = empty({n, shape_.hidden}), sum = empty({n, shape_.hidden});
    rms_norm_(normed, sum, h, res, head.norm, head.norm_eps);
    const int64_t columns = head.lm_head.weight.size(0) * 16;  // the panels' padded output columns
    at::Tensor out = empty({n, columns});
    linear(out, normed, head.lm_head);
    return columns == head.vocab ? out : out.narrow(1, 0, head.vocab);
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
      linear(qkv, h, l.qkv);
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
      linear(o, attended.view({n, s.heads * D}), l.o);
      h = empty({n, s.hidden});
      at::Tensor sum = empty({n, s.hidden});
      rms_norm_(h, sum, o, res, l.post_norm, eps_);
      res = sum;
      at::Tensor gate_up = empty({n, 2 * s.intermediate});
      linear(gate_up, h, l.gate_up);
      at::Tensor act = empty({n, s.intermediate});
      silu_and_mul_(act, gate_up);
      x = empty({n, s.hidden});
      linear(x, act, l.down);
    }
    return {x, res};
  }

 private:
  struct Head {
    at::Tensor embedding, norm;
    double norm_eps;
    Projection lm_head;
    int64_t vocab;
  };

  at::Tensor empty(std::initializer_list<int64_t> sizes) const {
    return at::detail::empty_cpu(sizes, dtype_, false, std::nullopt);
  }

  // out = in times p's weight, kRowBlock rows of in at a time
  void linear(const at::Tensor& out, const at::Tensor& in, const Projection& p) const {
    const int64_t n = in.size(0);
    for (int64_t r = 0; r < n; r += kRowBlock) {
      const int64_t rows = std::min(kRowBlock, n - r);
      project(p, rows == n ? out : out.narrow(0, r, rows), rows == n ? in : in.narrow(0, r, rows));
    }
  }

  template <typename Kernel>
  static Kernel kernel(const pybind11::dict& kernels, const char* name, const char* signature) {
    TORCH_CHECK(kernels.contains(name), "DecodeStack: no ", name, " kernel given");
    return pagedserve::kernel_of<Kernel>(kernels[name].cast<pybind11::capsule>(), signature);
  }

  void project(const Projection& p, const at::Tensor& out, const at::Tensor& x) const {
    switch (p.kernel) {
      case Kernel::kFloat32: return float32_(out, x, p.weight, p.bias);
      case Kernel::kBfloat16: return bfloat16_(out, x, p.weight, p.bias);
      case Kernel::kW8A8: return w8a8_(out, float32(x), p.weight, *p.scales, p.bias);
      case Kernel::kW4A8: return w4a8_(out, float32(x), p.weight, *p.scales, p.group, p.bias);
    }
  }

  pagedserve::LinearKernel float32_, bfloat16_;
  pagedserve::W8A8Kernel w8a8_;
  pagedserve::W4A8Kernel w4a8_;
  pagedserve::RmsNormKernel rms_norm_;
  pagedserve::RotaryKernel rotary_;
  pagedserve::SiluAndMulKernel silu_and_mul_;
  pagedserve::StoreKvKernel store_kv_;
  pagedserve::DecodeAttentionKernel attention_;
  std::vector<Layer> layers_;
  std::optional<Head> head_;
  at::Tensor cos_, sin_;
  at::Tensor no_sinks_ = at::detail::empty_cpu({0}, at::kFloat, false, std::nullopt);
  double eps_, scale_;
  at::ScalarType dtype_;
  Shape shape_{};
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  pybind11::class_<DecodeStack>(m, "DecodeStack")
      .def(pybind11::init<const pybind11::dict&, const std::vector<LayerArgs>&, at::Tensor, at::Tensor, double, double,
                          int64_t, int64_t, int64_t, int64_t, int64_t>())
      // Without the GIL: where the engine's loop runs on a thread of a serving process (AsyncLLM's default), a
      // step's one call would otherwise hold that process's event loop for the whole forward.
      .def("forward", &DecodeStack::forward, "A decode step through every layer: (hidden states, residual)",
           pybind11::call_guard<pybind11::gil_scoped_release>())
      .def("set_head", &DecodeStack::set_head, "The embedding, final norm and LM head that logits() adds")
      .def("logits", &DecodeStack::logits, "A decode step from token ids to logits",
           pybind11::call_guard<pybind11::gil_scoped_release>());
}
