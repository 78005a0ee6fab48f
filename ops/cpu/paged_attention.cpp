// Decode attention straight from the paged KV cache, for the CPU.
//
// The pure-torch path gathers every sequence's blocks into a padded tensor before attending: it reads
// the KV cache once, writes a copy, and reads the copy again, three passes over the largest tensor of
// a decode step. This kernel reads each block once, in place, with an online softmax.
//
// Layout (shared with FlashInfer's NHD paged layout): cache [num_blocks, 2, block_size, num_kv_heads,
// head_dim], K then V of a block side by side, so one block is one contiguous run of memory for every
// head. One work item per (sequence, KV head), so that a lone sequence's decode uses every thread; the KV
// head's g query heads share each K/V load. A sliding-window layer (window > 0) reads only the blocks that hold
// its last `window` positions. Attention sinks (gpt-oss: a learned logit per head in the softmax's denominator,
// with no value) start each head's online softmax: max = sink, sum = exp(0) = 1.

// ATen's tensor, dispatch and parallel headers and torch's pybind11 type casters, not torch/extension.h: that one
// also pulls in the whole C++ frontend (nn, optim, data, jit), which made each build ~4x slower for nothing we
// use. Still a pybind11 module rather than TORCH_LIBRARY ops: a torch.ops call went through the dispatcher,
// 2-4 us more per call, which a decode step pays once per layer and linear.
#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "fast_exp.h"
#include "kernel_capsules.h"
#include "work_sharing.h"

namespace {

// kHeadDim > 0 fixes head_dim at compile time (vectors stay in registers); 0 reads it at run time.
template <typename scalar_t, int kHeadDim>
void decode(const scalar_t* q, int64_t q_stride, const scalar_t* cache, const int32_t* block_tables,
            const int32_t* seq_lens, scalar_t* out, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
            int64_t head_dim, int64_t block_size, int64_t max_blocks, float scale, int64_t window, const float* sinks) {
  const int64_t group = num_heads / num_kv_heads, H = num_heads;
  const int64_t D = kHeadDim > 0 ? kHeadDim : head_dim;
  const int64_t half = block_size * num_kv_heads * D;  // elements of a block's K (or V)
  const int64_t token_stride = num_kv_heads * D;       // from one position's K (or V) row of a head to the next
  // One work item per (sequence, KV head): a lone sequence still spreads over every thread.
  pagedserve::shared_for(num_seqs * num_kv_heads, [&](int64_t begin, int64_t end) {
    std::vector<float> query(group * D), acc(group * D), scores(group * block_size), row_max(group), row_sum(group);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t seq = item / num_kv_heads, kv = item % num_kv_heads, h0 = kv * group;
      const int64_t len = seq_lens[seq];
      const int32_t* table = block_tables + seq * max_blocks;
      for (int64_t i = 0; i < group * D; ++i) query[i] = static_cast<float>(q[seq * q_stride + h0 * D + i]) * scale;
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t g = 0; g < group; ++g) {
        row_max[g] = sinks != nullptr ? sinks[h0 + g] : -std::numeric_limits<float>::infinity();
        row_sum[g] = sinks != nullptr ? 1.f : 0.f;
      }
      const int64_t first = window > 0 ? std::max<int64_t>(0, len - window) : 0;  // the first position seen
      for (int64_t b = first / block_size, start = b * block_size; start < len; start += block_size, ++b) {
        const int64_t t0 = std::max<int64_t>(0, first - start);  // positions of this block before the window
        const scalar_t* keys = cache + table[b] * 2 * half + t0 * token_stride + kv * D;
        const scalar_t* values = keys + half;
        const int64_t n = std::min(block_size, len - start) - t0;
        // Blocks are scattered: pull this head's rows of the next one in, into L2. Prefetches into L1 wait on
        // its few line-fill buffers once they are all taken: batch 1, 2,048 positions read the cache at ~12 GB/s
        // into L1, ~20 into L2, where the linear layers stream at ~30.
        if (start + block_size < len) {
          const scalar_t* next = cache + table[b + 1] * 2 * half + kv * D;
          for (int64_t part = 0; part < 2; ++part)
            for (int64_t t = 0; t < block_size; ++t)
              for (int64_t off = 0; off < D * static_cast<int64_t>(sizeof(scalar_t)); off += 64)
                __builtin_prefetch(reinterpret_cast<const char*>(next + part * half + t * token_stride) + off, 0, 2);
        }
        for (int64_t g = 0; g < group; ++g) {  // head-major: the query row stays in registers
          const float* qh = query.data() + g * D;
          const scalar_t* key = keys;
          for (int64_t t = 0; t < n; ++t, key += token_stride) {
            float s = 0.f;
#pragma omp simd reduction(+ : s)
            for (int64_t d = 0; d < D; ++d) s += qh[d] * static_cast<float>(key[d]);
            scores[g * block_size + t] = s;
          }
        }
        for (int64_t g = 0; g < group; ++g) {  // online softmax: rescale what was accumulated so far
          float* s = scores.data() + g * block_size;
          float m = row_max[g];
          for (int64_t t = 0; t < n; ++t) m = std::max(m, s[t]);
          const float correction = pagedserve::fast_exp(row_max[g] - m);
          float sum = 0.f;
#pragma omp simd reduction(+ : sum)
          for (int64_t t = 0; t < n; ++t) {
            s[t] = pagedserve::fast_exp(s[t] - m);
            sum += s[t];
          }
          row_sum[g] = row_sum[g] * correction + sum;
          row_max[g] = m;
          if (correction != 1.f) {
            float* a = acc.data() + g * D;
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) a[d] *= correction;
          }
        }
        for (int64_t g = 0; g < group; ++g) {  // head-major: the accumulator row stays in registers
          float* a = acc.data() + g * D;
          const float* p = scores.data() + g * block_size;
          const scalar_t* value = values;
          if constexpr (kHeadDim > 0) {  // a local row the compiler keeps in registers across the tokens
            float row[kHeadDim];
#pragma omp simd
            for (int64_t d = 0; d < kHeadDim; ++d) row[d] = a[d];
            for (int64_t t = 0; t < n; ++t, value += token_stride) {
#pragma omp simd
              for (int64_t d = 0; d < kHeadDim; ++d) row[d] += p[t] * static_cast<float>(value[d]);
            }
#pragma omp simd
            for (int64_t d = 0; d < kHeadDim; ++d) a[d] = row[d];
          } else {
            for (int64_t t = 0; t < n; ++t, value += token_stride) {
#pragma omp simd
              for (int64_t d = 0; d < D; ++d) a[d] += p[t] * static_cast<float>(value[d]);
            }
          }
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        const float inv = 1.f / row_sum[g];
        scalar_t* o = out + (seq * H + h0 + g) * D;
        for (int64_t d = 0; d < D; ++d) o[d] = static_cast<scalar_t>(acc[g * D + d] * inv);
      }
    }
  });
}

}  // namespace

// out, q: [num_seqs, num_heads, head_dim], q with any stride between sequences (a view of the fused QKV
// output); cache: [num_blocks, 2, block_size, num_kv_heads, head_dim];
// block_tables: int32 [num_seqs, max_blocks]; seq_lens: int32 [num_seqs], each >= 1.
// window: a sliding-window layer's (the last `window` positions, the query's own included); 0 for none.
// sinks: float32 [num_heads], each head's sink logit, or empty for none.
void paged_decode_attention(at::Tensor out, at::Tensor q, at::Tensor cache, at::Tensor block_tables,
                            at::Tensor seq_lens, double scale, int64_t window, at::Tensor sinks) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && q.stride(1) == q.size(2), "q: [num_seqs, num_heads, head_dim], "
              "each sequence's heads contiguous");
  TORCH_CHECK(out.is_contiguous() && cache.is_contiguous(), "out and cache must be contiguous");
  TORCH_CHECK(block_tables.is_contiguous() && block_tables.scalar_type() == at::kInt, "block_tables: int32");
  TORCH_CHECK(seq_lens.is_contiguous() && seq_lens.scalar_type() == at::kInt, "seq_lens: int32");
  TORCH_CHECK(cache.dim() == 5 && cache.size(1) == 2, "cache: [num_blocks, 2, block_size, kv_heads, head_dim]");
  TORCH_CHECK(sinks.numel() == 0 || (sinks.is_contiguous() && sinks.scalar_type() == at::kFloat &&
                                     sinks.numel() == q.size(1)), "sinks: float32 [num_heads] or empty");
  const float* sink_logits = sinks.numel() ? sinks.data_ptr<float>() : nullptr;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode_attention", [&] {
    auto run = [&](auto head_dim_tag) {
      decode<scalar_t, decltype(head_dim_tag)::value>(
          q.data_ptr<scalar_t>(), q.stride(0), cache.data_ptr<scalar_t>(), block_tables.data_ptr<int32_t>(),
          seq_lens.data_ptr<int32_t>(), out.data_ptr<scalar_t>(), q.size(0), q.size(1), cache.size(3), q.size(2),
          cache.size(2), block_tables.size(1), static_cast<float>(scale), window, sink_logits);
    };
    switch (q.size(2)) {
      case 64: run(std::integral_constant<int, 64>{}); break;
      case 128: run(std::integral_constant<int, 128>{}); break;
      default: run(std::integral_constant<int, 0>{});
    }
  });
}

// A step's K and V into the cache: k[i] to the cache's row k_rows[i] and v[i] to k_rows[i] + block_size, the cache
// viewed as rows of [kv_heads, head_dim] (ops/attention/backend.py's kv_rows). k, v: [tokens, kv_heads, head_dim],
// each token's heads contiguous, any stride between tokens (views of the fused QKV output). One call where
// index_copy_ took a view and two dispatches per layer, each several times this copy's cost at batch 1.
void store_kv(at::Tensor cache, at::Tensor k, at::Tensor v, at::Tensor k_rows) {
  TORCH_CHECK(cache.is_contiguous() && cache.dim() == 5 && cache.size(1) == 2,
              "cache: contiguous [num_blocks, 2, block_size, kv_heads, head_dim]");
  TORCH_CHECK(k.dim() == 3 && k.sizes() == v.sizes() && k.size(1) == cache.size(3) && k.size(2) == cache.size(4),
              "k, v: [tokens, kv_heads, head_dim] of the cache's heads");
  TORCH_CHECK(k.stride(2) == 1 && k.stride(1) == k.size(2) && v.stride(2) == 1 && v.stride(1) == v.size(2),
              "k, v: each token's heads contiguous");
  TORCH_CHECK(k.scalar_type() == cache.scalar_type() && v.scalar_type() == cache.scalar_type(),
              "k, v: the cache's dtype");
  TORCH_CHECK(k_rows.scalar_type() == at::kLong && k_rows.is_contiguous() && k_rows.numel() == k.size(0),
              "k_rows: int64 [tokens]");
  const int64_t tokens = k.size(0), block_size = cache.size(2), item = k.element_size();
  const int64_t row_bytes = k.size(1) * k.size(2) * item, rows = cache.numel() / (k.size(1) * k.size(2));
  const int64_t* row = k_rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < tokens; ++i)
    TORCH_CHECK(row[i] >= 0 && row[i] % (2 * block_size) < block_size && row[i] + block_size < rows, "k_rows[", i,
                "] = ", row[i], " is not a K row of the cache (", rows / (2 * block_size), " blocks of ", block_size, ")");
  char* base = static_cast<char*>(cache.data_ptr());
  const char* kp = static_cast<const char*>(k.data_ptr());
  const char* vp = static_cast<const char*>(v.data_ptr());
  const int64_t k_stride = k.stride(0) * item, v_stride = v.stride(0) * item;
  const auto copy = [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      std::memcpy(base + row[i] * row_bytes, kp + i * k_stride, row_bytes);
      std::memcpy(base + (row[i] + block_size) * row_bytes, vp + i * v_stride, row_bytes);
    }
  };
  if (tokens * row_bytes < (1 << 16)) {
    copy(0, tokens);  // a decode step's few rows: waking a second thread would cost more than the copy
  } else {
    pagedserve::shared_for(tokens, copy);
  }
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // for decode_stack.cpp
  m.attr("store_kv_kernel") = pagedserve::kernel_capsule<pagedserve::StoreKvKernel>(&store_kv, "StoreKvKernel");
  m.attr("paged_decode_attention_kernel") =
      pagedserve::kernel_capsule<pagedserve::DecodeAttentionKernel>(&paged_decode_attention, "DecodeAttentionKernel");
  m.def("paged_decode_attention", &paged_decode_attention, "Decode attention over a paged KV cache (CPU)");
  m.def("store_kv", &store_kv, "A step's K and V into the paged KV cache at their rows (CPU)");
}
