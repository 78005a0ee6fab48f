"""The fused mixture-of-experts layer: every expert of one MoE layer in two 3-D weights, and the router's
choice applied to a batch of tokens at once.

- Weights: `w13_weight` [E_local, 2·I_part, H] (each expert's gate rows, then its up rows: Hugging Face's
  `gate_up_proj`, vLLM's `w13`) and `w2_weight` [E_local, H, I_part] (down), fused at load from the
  checkpoint's per-expert tensors (`experts.{e}.gate_proj` / `w1`, ...).
- Tensor parallelism, expert parallelism off: every rank holds every expert, sliced along the expert's
  intermediate dim like the dense MLP (I_part = I / tp); the partial outputs are all-reduced by the caller.
- Expert parallelism on: experts are partitioned across the TP ranks (E / tp whole experts each). Every
  rank routes every token (the router is replicated), computes only its own experts' contributions and
  leaves zeros for the rest; the caller's all-reduce sums them. This is the simple all-gather/all-reduce
  dispatch: hidden states are already on every rank after attention's all-reduce, so no all-to-all is
  needed, at the price of one all-reduce of [tokens, H] per layer (the same as EP off).
- Data parallelism (EngineConfig.data_parallel_size, vLLM's DP attention + EP): the experts are sharded as
  above over every rank of every DP rank (the EP group, dp_size x tp_size ranks) instead of the TP group;
  attention runs on each DP rank's own tokens only. `forward_reduced` gathers the DP group's tokens with
  their routing (each rank routes its own; sizes differ per rank, known from the step's exchange), runs the
  local experts on all of them, sums the partial outputs over the EP group (an all-reduce: simple, and fine
  over gloo) and keeps this rank's rows. A DP rank without work runs a one-token dummy step to take part.
- Compute on CPU in float32: ops/cpu/fused_moe.cpp takes the router's choice and returns the layer's
  output in one call (weights packed into its panel layout at load).
- Compute elsewhere: the (token, expert) pairs are sorted by expert, so each expert's rows are contiguous; one
  grouped matrix multiply per projection (torch.nn.functional.grouped_mm where it runs, a per-expert loop
  where it does not); then each pair's output times its routing weight, summed over the token's k experts
  in float32 with one rounding (the order of Hugging Face's `grouped_mm` experts implementation).
- Weights belong to a FusedMoEMethod (this file's dense one by default), the MoE counterpart of a linear
  layer's QuantMethod: a quantization config may hand the layer its own (e.g. int8 experts), which owns
  the parameters and the two grouped projections; routing, sorting and combining stay here."""

from __future__ import annotations

import functools
import logging
from abc import ABC, abstractmethod

import torch
import torch.nn.functional as F
from torch import nn

from engine.distributed import dp_num_tokens, get_dp_group, get_ep_group, get_tp_group
from engine.models.checkpoint import CheckpointTensor
from engine.models.layers.linear import copy_checked, divide
from engine.models.layers.quantization.base import QuantizationConfig, set_weight_attrs
from ops.cpu import load_moe_kernels

logger = logging.getLogger(__name__)

# Which fused parameter and which half of it each checkpoint projection fills.
EXPERT_PROJECTIONS = {"gate": ("w13_weight", 0), "up": ("w13_weight", 1), "down": ("w2_weight", None)}


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool,
          float32_weights: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k], expert ids [T, k]) as Hugging Face's Mixtral / Qwen2-MoE / Qwen3-MoE routers compute
    them: softmax in float32, top-k, optionally divided by their sum; Mixtral keeps the weights in float32,
    Qwen casts them back to the logits' dtype."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights /= weights.sum(dim=-1, keepdim=True)
    return (weights if float32_weights else weights.to(router_logits.dtype)), ids


class FusedMoEMethod(ABC):
    """How a FusedMoE layer's expert weights are stored and multiplied (dense, or a quantized format)."""

    # What each expert projection's checkpoint tensors add to the parameter's name (`w13_weight` + suffix):
    # FP8 block-quantized experts bring their tile scales (`_scale_inv`).
    suffixes: tuple[str, ...] = ("",)

    @abstractmethod
    def create_weights(self, layer: FusedMoE, num_local_experts: int, hidden_size: int,
                       intermediate_size_per_partition: int, params_dtype: torch.dtype) -> None:
        """Register the expert parameters: `w13_weight` and `w2_weight` (or a quantized format's tensors), each
        carrying `expert_dim`, `output_dim`, `input_dim` and the layer's `weight_loader`, which fills one
        expert's projection at a time."""

    def process_weights_after_loading(self, layer: FusedMoE,  # noqa: B027 - optional hook, a no-op by default
                                      batch_size_hint: int) -> None:
        """Turn loaded weights into their compute form (once, after every expert is loaded)."""

    @abstractmethod
    def apply(self, layer: FusedMoE, x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """The expert MLP of rows sorted by local expert: x [S, H], expert e's rows end at offsets[e]
        (int32 cumulative counts, [E_local]) -> [S, H]. Rows past offsets[-1] may be left unwritten."""

    def apply_routed(self, layer: FusedMoE, x: torch.Tensor, weights: torch.Tensor,
                     ids: torch.Tensor) -> torch.Tensor | None:
        """The layer's whole partial output [T, H] from the router's choice, where the method has a kernel
        that takes it unsorted; None leaves the layer to sort the pairs and call `apply`."""
        return None


@functools.cache
def grouped_mm_available(dtype: torch.dtype, device_type: str) -> bool:
    """Whether torch's grouped matmul runs here for `dtype` (CPU since torch 2.9; CUDA SM80+ in bfloat16)
    and agrees with plain matmuls."""
    if not hasattr(F, "grouped_mm"):
        return False
    try:
        gen = torch.Generator().manual_seed(0)
        x, w = torch.randn(5, 16, generator=gen), torch.randn(3, 8, 16, generator=gen)
        x, w = x.to(device_type, dtype), w.to(device_type, dtype)
        offs = torch.tensor([2, 2, 5], dtype=torch.int32, device=device_type)
        out = F.grouped_mm(x, w.transpose(-2, -1), offs=offs)
        ref = torch.cat([x[:2] @ w[0].T, x[2:] @ w[2].T])
        return torch.allclose(out.float(), ref.float(), atol=0.05, rtol=0.01)
    except (RuntimeError, NotImplementedError, TypeError) as e:
        logger.info("grouped_mm unavailable for %s on %s (%s); MoE experts loop over experts", dtype, device_type, e)
        return False


class DenseFusedMoEMethod(FusedMoEMethod):
    """Unquantized experts: on CPU in float32 through ops/cpu/fused_moe.cpp (weights repacked into its
    panels), elsewhere through torch's grouped matmul where it runs, else a loop of per-expert F.linear.

    Measured on pagedserve-56m-moe's expert shape (8 experts, H 512, I 704, top-2; float32, 2 threads, quiet
    2-core host), the whole layer from the router's choice: the kernel took 0.12 / 1.5 / 2.7-3.2 / 8-9 / 30-34 ms
    at 1 / 16 / 64 / 256 / 1024 tokens against 0.42 / 4.7-5.2 / 6.4-7.2 / 14-15 / 31-32 ms for grouped_mm
    (weights stored expert-major transposed) with the sorting and combining around it, so the kernel serves
    every size on CPU. Earlier, grouped_mm had beaten the F.linear loop by 10-30% up to 32 tokens; the loop
    serves where neither runs (e.g. float32 on CUDA)."""

    def create_weights(self, layer, num_local_experts, hidden_size, intermediate_size_per_partition,
                       params_dtype) -> None:
        e, h, i = num_local_experts, hidden_size, intermediate_size_per_partition
        w13 = nn.Parameter(torch.empty(e, 2 * i, h, dtype=params_dtype), requires_grad=False)
        w2 = nn.Parameter(torch.empty(e, h, i, dtype=params_dtype), requires_grad=False)
        for param in (w13, w2):
            # [expert, out, in]: the TP slice runs along w13's output dim and w2's input dim.
            set_weight_attrs(param, {"expert_dim": 0, "output_dim": 1, "input_dim": 2,
                                     "weight_loader": layer.weight_loader})
        layer.register_parameter("w13_weight", w13)
        layer.register_parameter("w2_weight", w2)

    def process_weights_after_loading(self, layer, batch_size_hint) -> None:
        w13, w2 = layer.w13_weight, layer.w2_weight
        cpu = w13.device.type == "cpu" and w13.dtype in (torch.float32, torch.bfloat16)
        kernel = load_moe_kernels() if cpu else None
        # Panels of 16 rows must not straddle gate and up: the intermediate and hidden sizes divide by 16.
        fits = kernel is not None and w2.shape[1] % 16 == 0 and w2.shape[2] % 16 == 0
        if fits and w13.dtype == torch.float32:
            layer.expert_compute = "cpu_kernel"
            for param in (w13, w2):  # [E, out, in] -> [E, out / 16, in, 16]
                param.data = kernel.moe_pack_panels(param.data)
        elif fits and kernel.bfloat16_experts():
            layer.expert_compute = "cpu_kernel_bf16"
            for param in (w13, w2):  # [E, out, in] -> [E, out / 16, in / 2, 16, 2]
                e, n, k = param.shape
                param.data = param.data.view(e, n // 16, 16, k // 2, 2).permute(0, 1, 3, 2, 4).contiguous()
        elif grouped_mm_available(w13.dtype, w13.device.type):
            layer.expert_compute = "grouped_mm"
            # Same [E, out, in] tensors, each expert stored column-major: grouped_mm multiplies by their
            # transposes, which are then contiguous (faster at decode sizes than the strided views).
            for param in (w13, w2):
                param.data = param.data.transpose(1, 2).contiguous().transpose(1, 2)
        else:
            layer.expert_compute = "loop"

    def apply_routed(self, layer, x, weights, ids) -> torch.Tensor | None:
        if layer.expert_compute not in ("cpu_kernel", "cpu_kernel_bf16"):
            return None
        out = torch.empty(x.shape[0], layer.hidden_size)
        kernels = load_moe_kernels()
        run = kernels.moe_experts if layer.expert_compute == "cpu_kernel" else kernels.moe_experts_bf16
        run(out, x.contiguous(), ids.contiguous(), weights.float().contiguous(), layer.w13_weight, layer.w2_weight,
            layer.expert_start)
        return out

    def apply(self, layer, x, offsets) -> torch.Tensor:
        w13, w2 = layer.w13_weight, layer.w2_weight
        if layer.expert_compute == "grouped_mm":
            gate, up = F.grouped_mm(x, w13.transpose(-2, -1), offs=offsets).chunk(2, dim=-1)
            return F.grouped_mm(F.silu(gate) * up, w2.transpose(-2, -1), offs=offsets)
        out = x.new_empty(x.shape[0], w2.shape[1])
        start = 0
        for e, end in enumerate(offsets.tolist()):  # one device sync for the whole loop
            if end > start:
                gate, up = F.linear(x[start:end], w13[e]).chunk(2, dim=-1)
                out[start:end] = F.linear(F.silu(gate) * up, w2[e])
            start = end
        return out


class FusedMoE(nn.Module):
    """The experts of one MoE layer (SwiGLU experts). `forward(x, weights, ids)` returns this rank's
    partial sum [T, H]; `forward_reduced` the layer's output, reduced over the ranks (what blocks call)."""

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 expert_parallel: bool = False, quant_config: QuantizationConfig | None = None,
                 prefix: str = "") -> None:
        super().__init__()
        # The group the experts are sharded over: the TP group, or under data parallelism the EP group (every
        # rank of every DP rank). tp_rank and tp_size (what quantization methods slice by) are this group's.
        self.dp_group = get_dp_group()
        self.tp_group = get_ep_group() if self.dp_group.size > 1 else get_tp_group()
        self.tp_rank, self.tp_size = self.tp_group.rank_in_group, self.tp_group.size
        self.num_experts, self.top_k, self.hidden_size = num_experts, top_k, hidden_size
        self.prefix = prefix
        if expert_parallel:
            self.num_local_experts = divide(num_experts, self.tp_size, "num_experts (expert parallel)")
            self.expert_start = self.tp_rank * self.num_local_experts
            self.intermediate_size_per_partition = intermediate_size
        else:
            self.num_local_experts, self.expert_start = num_experts, 0
            self.intermediate_size_per_partition = divide(intermediate_size, self.tp_size,
                                                          f"{prefix} moe_intermediate_size")
        self.expert_parallel = expert_parallel and self.tp_size > 1
        # Each rank holds a slice of every expert's intermediate dim (tensor parallelism without EP).
        self.intermediate_sliced = self.tp_size > 1 and not self.expert_parallel
        method = quant_config.get_quant_method(self, prefix) if quant_config is not None else None
        if method is not None and not isinstance(method, FusedMoEMethod):
            raise ValueError(f"quantization: {quant_config.name} has no method for MoE experts ({prefix}); "
                             "quantize the experts online from a dense checkpoint ('int8', 'int4'), or use none")
        self.quant_method = method or DenseFusedMoEMethod()
        self.quant_method.create_weights(self, self.num_local_experts, hidden_size,
                                         self.intermediate_size_per_partition, torch.get_default_dtype())
        self.expert_compute = "loop"  # the method's process_weights_after_loading chooses
        # Tokens routed to each (global) expert since start, shared by the model's MoE layers (metrics).
        self.expert_load: torch.Tensor | None = None

    def expected_shards(self) -> list[tuple[str, tuple[int, str]]]:
        """(parameter, (expert, projection)) for every checkpoint tensor this rank must load."""
        local = range(self.expert_start, self.expert_start + self.num_local_experts)
        return [(param + suffix, (e, proj)) for e in local for proj, (param, _) in EXPERT_PROJECTIONS.items()
                for suffix in self.quant_method.suffixes]

    def weight_loader(self, param: torch.Tensor, loaded: CheckpointTensor, shard_id: tuple[int, str]) -> None:
        """Copy expert `e`'s `proj` ("gate", "up" or "down") into its slot; other ranks' experts are skipped."""
        expert, proj = shard_id
        local = expert - self.expert_start
        if not 0 <= local < self.num_local_experts:
            return
        _, half = EXPERT_PROJECTIONS[proj]
        size = self.intermediate_size_per_partition
        # The checkpoint tensor is one expert's [out, in]: the parameter's dims less the expert dim.
        dim = (param.output_dim if half is not None else param.input_dim) - 1
        target = param.data.select(param.expert_dim, local)
        if half is not None:  # gate or up: rows [half * size, (half + 1) * size) of w13
            target = target.narrow(dim, half * size, size)
        if self.intermediate_sliced:  # this rank's slice of the intermediate dim
            loaded = loaded.narrow(dim, self.tp_rank * size, size)
        copy_checked(target, loaded)

    def forward_reduced(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                        shared: torch.Tensor | None = None) -> torch.Tensor:
        """The layer's output for this rank's tokens x [T, H] routed to (weights, ids) [T, k], plus `shared`
        (a shared expert's partial sum over the TP group, [T, H]): partial sums reduced over the ranks. Under
        data parallelism the experts run on every DP rank's tokens (gathered over the DP group) and the sums
        are reduced over the EP group; this rank keeps its own rows."""
        if self.dp_group.size == 1:
            out = self(x, weights, ids)
            return self.tp_group.all_reduce(out if shared is None else out + shared)
        counts = dp_num_tokens()
        if counts is None:
            raise RuntimeError("a data-parallel MoE layer ran outside a data-parallel step (no token counts)")
        dp = self.dp_group
        if counts[dp.rank_in_group]:  # not a dummy step's token
            self._count_load(ids)
        sizes = [n or 1 for n in counts]  # a rank without tokens runs one dummy token
        start, num_tokens, k = sum(sizes[: dp.rank_in_group]), x.shape[0], ids.shape[1]
        # Routing travels with the tokens (ids are exact in float32): each token is routed once, by its own rank.
        routing = dp.all_gather_rows(torch.cat([weights.float(), ids.float()], dim=1), sizes)
        out = self._experts(dp.all_gather_rows(x, sizes), routing[:, :k].to(weights.dtype), routing[:, k:].long())
        if shared is not None:
            out[start : start + num_tokens] += shared
        return self.tp_group.all_reduce(out)[start : start + num_tokens]

    def _count_load(self, ids: torch.Tensor) -> None:
        if self.expert_load is not None:
            flat = ids.reshape(-1)
            self.expert_load.index_add_(0, flat, torch.ones_like(flat))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        self._count_load(ids)
        return self._experts(x, weights, ids)

    def _experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        num_tokens, k = ids.shape
        flat = ids.reshape(-1)
        out = self.quant_method.apply_routed(self, x, weights, ids)
        if out is not None:
            return out.to(x.dtype)
        local = flat - self.expert_start
        if self.expert_parallel:  # other ranks' experts sort to the end, past the last offset
            local = torch.where((local >= 0) & (local < self.num_local_experts), local, self.num_local_experts)
        sorted_ids, order = torch.sort(local, stable=True)
        counts = torch.zeros(self.num_local_experts + 1, dtype=torch.int32, device=x.device)
        counts.index_add_(0, sorted_ids, torch.ones_like(sorted_ids, dtype=torch.int32))
        offsets = torch.cumsum(counts[:-1], dim=0, dtype=torch.int32)
        rows = order // k
        if self.expert_parallel:
            n = int(offsets[-1])
            y = x.new_zeros(flat.shape[0], self.hidden_size)
            if n:
                y[:n] = self.quant_method.apply(self, x[rows[:n]], offsets)
        else:
            y = self.quant_method.apply(self, x[rows], offsets)
        # Each pair times its weight (float32 for Mixtral's float32 weights), back in token order, summed
        # over the token's k experts with one rounding to the activations' dtype.
        weighted = y * weights.reshape(-1)[order].unsqueeze(-1)
        combined = torch.empty_like(weighted)
        combined[order] = weighted
        return combined.view(num_tokens, k, self.hidden_size).sum(dim=1).to(x.dtype)
