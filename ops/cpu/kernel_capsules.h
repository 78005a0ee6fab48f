// Our kernels' entry points as one compiled module hands them to another (decode_stack.cpp calls the linear,
// elementwise and attention modules' kernels from C++): a PyCapsule per function, named by its signature's
// type below, so that a capsule of the wrong kernel is refused rather than called. Every module is built by the
// same compiler against the same torch (ops/cpu/__init__.py), so their at::Tensor ABIs agree.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/csrc/utils/pybind.h>

#include <cstring>
#include <optional>

namespace pagedserve {

// out [M, N] = x [M, K] times a panel weight, plus the bias (ops/cpu/panel_linear.cpp)
using LinearKernel = void (*)(at::Tensor out, at::Tensor x, at::Tensor weight, std::optional<at::Tensor> bias);
using W8A8Kernel = void (*)(at::Tensor out, at::Tensor x, at::Tensor weight, at::Tensor scales,
                            std::optional<at::Tensor> bias);
using W4A8Kernel = void (*)(at::Tensor out, at::Tensor x, at::Tensor weight, at::Tensor scales, int64_t group,
                            std::optional<at::Tensor> bias);
// ops/cpu/elementwise.cpp
using RmsNormKernel = void (*)(at::Tensor& out, std::optional<at::Tensor> residual_out, const at::Tensor& x,
                               std::optional<at::Tensor> residual, const at::Tensor& weight, double eps);
using RotaryKernel = void (*)(at::Tensor& out, const at::Tensor& x, const at::Tensor& positions, const at::Tensor& cos,
                              const at::Tensor& sin);
using SiluAndMulKernel = void (*)(at::Tensor& out, const at::Tensor& x);
// ops/cpu/paged_attention.cpp
using StoreKvKernel = void (*)(at::Tensor cache, at::Tensor k, at::Tensor v, at::Tensor k_rows);
using DecodeAttentionKernel = void (*)(at::Tensor out, at::Tensor q, at::Tensor cache, at::Tensor block_tables,
                                       at::Tensor seq_lens, double scale, int64_t window, at::Tensor sinks);

template <typename Kernel>
pybind11::capsule kernel_capsule(Kernel kernel, const char* signature) {
  return pybind11::capsule(reinterpret_cast<void*>(kernel), signature);
}

template <typename Kernel>
Kernel kernel_of(const pybind11::capsule& capsule, const char* signature) {
  TORCH_CHECK(capsule.name() != nullptr && std::strcmp(capsule.name(), signature) == 0, "expected a ", signature,
              " kernel capsule, got ", capsule.name() ? capsule.name() : "an unnamed one");
  return reinterpret_cast<Kernel>(capsule.get_pointer());
}

}  // namespace pagedserve
