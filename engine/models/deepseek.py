"""DeepSeek-V2 and DeepSeek-V3 (`DeepseekV2ForCausalLM`, `DeepseekV3ForCausalLM`): multi-head latent attention
(MLA) and DeepSeekMoE.

MLA. Each token's K and V come from one latent c (kv_lora_rank values, normed) shared by every head, and a
rotary key part k_pe (qk_rope_head_dim) shared too; a layer's KV cache keeps just [c, k_pe] per token
(`latent_dim` values: 576 for the real models, no separate K and V, so no factor 2 in a block's bytes), in
blocks of [block_size, latent_dim]. kv_b_proj = [W_UK; W_UV] up-projects c into each head's k_nope and v.
- Prefill chunks, compute-bound: the context's latents up-projected into per-head K and V, then causal SDPA
  over the cached prefix and the chunk.
- Decodes, memory-bound: W_UK folded into the query (q_nope W_UK: kv_lora_rank values per head), attention as
  MQA over the cached latents (QK dim latent_dim, V dim kv_lora_rank), then W_UV and o_proj. Each step reads
  latent_dim values per token of context instead of heads x (k + v) dims.
Under tensor parallelism the heads of q_b_proj / q_proj, kv_b_proj and o_proj are split; the latent
projections (q_a_proj, kv_a_proj_with_mqa) and the latent cache are whole on every rank: each rank holds the
whole cache. That is why DeepSeek is usually served with data-parallel attention (each rank its own requests'
latents), which the scale-out issue adds.

DeepSeekMoE. A router over n_routed_experts (V2: softmax, greedy or group-limited greedy top-k; V3: sigmoid
scores, groups and experts chosen on them plus e_score_correction_bias, weights normalized), scaled by
routed_scaling_factor; ungated shared experts on every token; dense MLPs before first_k_dense_replace.
Attention scores scale by qk_head_dim ** -0.5, times mscale(factor, mscale_all_dim) ** 2 under YaRN.
FP8 block-quantized checkpoints (the release format) are dequantized at load: linear layers by fp8.py, the
experts by fp8_moe.py; the router stays in its checkpoint's float."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.distributed import get_tp_group
from engine.models.config import ModelConfig
from engine.models.layers import ColumnParallelLinear, ReplicatedLinear, RMSNorm, RotaryEmbedding, RowParallelLinear
from engine.models.layers.fused_moe import FusedMoE
from engine.models.layers.linear import divide
from engine.models.layers.quantization import QuantizationConfig
from engine.models.layers.rotary import yarn_mscale
from engine.models.llama import MLP
from engine.models.moe import MoEDecoderLayer, MoEForCausalLM
from ops.attention import AttentionBackend


class MLAAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, rope: RotaryEmbedding, quant_config: QuantizationConfig | None,
                 prefix: str, layer: int) -> None:
        super().__init__()
        mla, h = cfg.mla, cfg.hidden_size
        self.mla = mla
        self.num_heads = divide(cfg.num_attention_heads, get_tp_group().size, "num_attention_heads")
        self.num_kv_heads, self.head_dim = 1, mla.latent_dim  # what the worker sizes the backend with
        self.latent_dim = mla.latent_dim  # the worker gives this layer a [blocks, block_size, latent_dim] cache
        self.sliding_window = None
        scale = mla.qk_head_dim**-0.5
        scaling = cfg.rope_scaling
        if scaling is not None and scaling["rope_type"] == "yarn" and scaling.get("mscale_all_dim"):
            scale *= yarn_mscale(scaling["factor"], scaling["mscale_all_dim"]) ** 2
        self.scale = scale
        heads = cfg.num_attention_heads
        if mla.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(h, heads * mla.qk_head_dim, quant_config=quant_config,
                                               prefix=f"{prefix}.q_proj")
        else:
            self.q_a_proj = ReplicatedLinear(h, mla.q_lora_rank, bias=cfg.o_proj_bias, quant_config=quant_config,
                                             prefix=f"{prefix}.q_a_proj")
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, cfg.rms_norm_eps)
            self.q_b_proj = ColumnParallelLinear(mla.q_lora_rank, heads * mla.qk_head_dim, quant_config=quant_config,
                                                 prefix=f"{prefix}.q_b_proj")
        self.kv_a_proj_with_mqa = ReplicatedLinear(h, mla.latent_dim, bias=cfg.o_proj_bias,
                                                   quant_config=quant_config, prefix=f"{prefix}.kv_a_proj_with_mqa")
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, cfg.rms_norm_eps)
        # Read whole by the absorbed decode (W_UK, W_UV): its (dequantized) weight kept beside the packed one.
        self.kv_b_proj = ColumnParallelLinear(mla.kv_lora_rank, heads * (mla.qk_nope_head_dim + mla.v_head_dim),
                                              quant_config=quant_config, prefix=f"{prefix}.kv_b_proj")
        self.kv_b_proj.keeps_weight = True
        self.o_proj = RowParallelLinear(heads * mla.v_head_dim, h, bias=cfg.o_proj_bias, quant_config=quant_config,
                                        prefix=f"{prefix}.o_proj")
        self.rope = rope
        self.kv_cache = torch.empty(0)  # bound by the worker (Worker.init_kv_cache)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, backend: AttentionBackend) -> torch.Tensor:
        mla, n, heads = self.mla, x.shape[0], self.num_heads
        q = self.q_proj(x) if mla.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_pe = q.view(n, heads, mla.qk_head_dim).split([mla.qk_nope_head_dim, mla.qk_rope_head_dim], -1)
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([mla.kv_lora_rank, mla.qk_rope_head_dim], -1)
        q_pe, k_pe = self.rope(positions, q_pe, k_pe.unsqueeze(1))
        md = backend.metadata
        rows = self.kv_cache.view(-1, mla.latent_dim)
        rows.index_copy_(0, md.slot_mapping, torch.cat([self.kv_a_layernorm(latent), k_pe[:, 0]], -1))
        out = x.new_empty(n, heads, mla.v_head_dim)
        nd = md.num_decodes
        if nd:
            out[:nd] = self._decode(q_nope[:nd], q_pe[:nd], md.block_tables[:nd], md.seq_lens[:nd],
                                    max(md.seq_lens_cpu[:nd]))
        for i in range(nd, md.num_seqs):
            start, end = md.query_start_loc_cpu[i], md.query_start_loc_cpu[i + 1]
            out[start:end] = self._prefill(q_nope[start:end], q_pe[start:end], md.block_tables[i],
                                           md.seq_lens_cpu[i])
        return self.o_proj(out.view(n, heads * mla.v_head_dim))

    def _latents(self, block_ids: torch.Tensor, num_tokens: int) -> torch.Tensor:
        """[..., num_tokens, latent_dim]: the cached latents of each row of `block_ids`."""
        blocks = self.kv_cache.index_select(0, block_ids.reshape(-1).long())
        return blocks.view(*block_ids.shape[:-1], -1, self.latent_dim)[..., :num_tokens, :]

    def _up_projection(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_UK [heads, qk_nope_head_dim, kv_lora_rank] and W_UV [heads, v_head_dim, kv_lora_rank]."""
        mla = self.mla
        w = self.kv_b_proj.weight.view(self.num_heads, mla.qk_nope_head_dim + mla.v_head_dim, mla.kv_lora_rank)
        return w[:, : mla.qk_nope_head_dim], w[:, mla.qk_nope_head_dim :]

    def _decode(self, q_nope, q_pe, block_tables, seq_lens, max_len: int) -> torch.Tensor:
        """Absorbed: one query token per sequence, its heads as an MQA query over the latents."""
        w_uk, w_uv = self._up_projection()
        block_size = self.kv_cache.shape[1]
        latents = self._latents(block_tables[:, : -(-max_len // block_size)], max_len)  # [seqs, L, latent]
        query = torch.cat([torch.einsum("shd,hdc->shc", q_nope, w_uk), q_pe], -1)  # [seqs, heads, latent]
        mask = torch.arange(max_len, device=latents.device)[None, :] < seq_lens[:, None]
        values = latents[:, None, :, : self.mla.kv_lora_rank]
        o = F.scaled_dot_product_attention(query[:, None], latents[:, None], values, attn_mask=mask[:, None, None, :],
                                           scale=self.scale)
        return torch.einsum("shc,hvc->shv", o[:, 0], w_uv)

    def _prefill(self, q_nope, q_pe, block_table, context_len: int) -> torch.Tensor:
        """Up-projected: the context's latents as per-head K and V; causal over the cached prefix and the chunk."""
        mla, heads, q_len = self.mla, self.num_heads, q_nope.shape[0]
        block_size = self.kv_cache.shape[1]
        latents = self._latents(block_table[None, : -(-context_len // block_size)], context_len)[0]
        latent, k_pe = latents.split([mla.kv_lora_rank, mla.qk_rope_head_dim], -1)
        kv = self.kv_b_proj(latent).view(context_len, heads, mla.qk_nope_head_dim + mla.v_head_dim)
        k_nope, v = kv.split([mla.qk_nope_head_dim, mla.v_head_dim], -1)
        k = torch.cat([k_nope, k_pe[:, None].expand(-1, heads, -1)], -1)
        q = torch.cat([q_nope, q_pe], -1)
        mask = None
        if context_len != q_len:  # query i sees keys up to context_len - q_len + i
            rows = torch.arange(q_len, device=q.device)[:, None] + (context_len - q_len)
            mask = torch.arange(context_len, device=q.device)[None, :] <= rows
        o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                           attn_mask=mask, is_causal=mask is None, scale=self.scale)
        return o[0].transpose(0, 1)


class DeepseekRouter(nn.Module):
    """The router's float32 weight and (V3) its e_score_correction_bias, as the checkpoint names them."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        moe = self.moe = cfg.moe
        self.weight = nn.Parameter(torch.zeros(moe.num_experts, cfg.hidden_size, dtype=torch.float32),
                                   requires_grad=False)
        if moe.topk_method == "noaux_tc":
            self.e_score_correction_bias = nn.Parameter(torch.zeros(moe.num_experts, dtype=torch.float32),
                                                        requires_grad=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] float32, expert ids [T, k]) as Hugging Face's DeepseekV2/V3 TopkRouter."""
        moe = self.moe
        logits = F.linear(x.float(), self.weight.float())
        per_group = moe.num_experts // moe.n_group
        if moe.scoring == "sigmoid":  # V3
            scores = logits.sigmoid()
            choice = scores + self.e_score_correction_bias
            group_scores = choice.view(-1, moe.n_group, per_group).topk(2, dim=-1)[0].sum(-1)
            choice = choice.masked_fill(~self._group_mask(group_scores, per_group), float("-inf"))
            ids = choice.topk(moe.top_k, dim=-1, sorted=False)[1]
            weights = scores.gather(1, ids)
            if moe.renormalize:
                weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        else:  # V2
            scores = logits.softmax(-1, dtype=torch.float32)
            if moe.topk_method == "group_limited_greedy":
                group_scores = scores.view(-1, moe.n_group, per_group).max(-1).values
                scores = scores.masked_fill(~self._group_mask(group_scores, per_group), 0.0)
            weights, ids = scores.topk(moe.top_k, dim=-1, sorted=False)
        return weights * moe.routed_scaling_factor, ids

    def _group_mask(self, group_scores: torch.Tensor, per_group: int) -> torch.Tensor:
        """[T, E] bool: the experts of each token's topk_group best groups."""
        chosen = group_scores.topk(self.moe.topk_group, dim=-1, sorted=False)[1]
        mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, chosen, True)
        return mask.repeat_interleave(per_group, dim=1)


class DeepseekMoE(nn.Module):
    def __init__(self, cfg: ModelConfig, quant_config: QuantizationConfig | None, prefix: str) -> None:
        super().__init__()
        moe = cfg.moe
        self.gate = DeepseekRouter(cfg)
        self.experts = FusedMoE(moe.num_experts, moe.top_k, cfg.hidden_size, moe.intermediate_size,
                                moe.expert_parallel, quant_config, f"{prefix}.experts")
        self.shared_experts = (MLP(cfg, quant_config, f"{prefix}.shared_experts",
                                   intermediate_size=moe.shared_expert_intermediate_size, reduce_results=False)
                               if moe.shared_expert_intermediate_size else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        shared = self.shared_experts(x) if self.shared_experts is not None else None
        return self.experts.forward_reduced(x, weights, ids, shared)


class DeepseekDecoderLayer(MoEDecoderLayer):
    attention_cls = MLAAttention
    sparse_block_cls = DeepseekMoE


class DeepseekForCausalLM(MoEForCausalLM):
    decoder_layer_cls = DeepseekDecoderLayer
    packed_modules = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}  # q_proj stays whole

    def __init__(self, cfg: ModelConfig, quant_config: QuantizationConfig | None = None) -> None:
        if quant_config is not None and quant_config.name != "fp8":
            raise ValueError(f"quantization: {quant_config.name} is not supported for {cfg.architecture} yet "
                             "(its latent attention reads kv_b_proj whole); serve it unquantized or from an FP8 "
                             "block-quantized checkpoint (DeepSeek's release format: dequantized at load)")
        super().__init__(cfg, quant_config)

    def checkpoint_to_param(self, name: str) -> tuple[str, object] | None:
        if ".layers." in name and int(name.split(".")[2]) >= self.config.num_hidden_layers:
            return None  # V3's multi-token prediction layer: a draft model of its own (deepseek_mtp.py)
        return super().checkpoint_to_param(name)

    @staticmethod
    def checkpoint_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
        """Names and full shapes of a Hugging Face DeepSeek-V2/V3 checkpoint's tensors, V3's multi-token
        prediction layers (after the decoder's, as DeepSeek's releases store them) included."""
        h = cfg.hidden_size
        shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, h)}
        for n in range(cfg.num_hidden_layers):
            shapes |= _layer_shapes(cfg, n)
        shapes["model.norm.weight"] = (h,)
        if not cfg.tie_word_embeddings:
            shapes["lm_head.weight"] = (cfg.vocab_size, h)
        for n in range(cfg.num_hidden_layers, cfg.num_hidden_layers + cfg.num_mtp_layers):
            p = f"model.layers.{n}."
            shapes |= _layer_shapes(cfg, n) | {
                p + "enorm.weight": (h,), p + "hnorm.weight": (h,), p + "eh_proj.weight": (h, 2 * h),
                p + "embed_tokens.weight": (cfg.vocab_size, h), p + "shared_head.norm.weight": (h,),
                p + "shared_head.head.weight": (cfg.vocab_size, h)}
        return shapes


def _layer_shapes(cfg: ModelConfig, n: int) -> dict[str, tuple[int, ...]]:
    mla, moe, h, heads = cfg.mla, cfg.moe, cfg.hidden_size, cfg.num_attention_heads
    p, a, m = f"model.layers.{n}.", f"model.layers.{n}.self_attn.", f"model.layers.{n}.mlp."
    shapes = {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,)}
    if mla.q_lora_rank is None:
        shapes[a + "q_proj.weight"] = (heads * mla.qk_head_dim, h)
    else:
        shapes |= {a + "q_a_proj.weight": (mla.q_lora_rank, h), a + "q_a_layernorm.weight": (mla.q_lora_rank,),
                   a + "q_b_proj.weight": (heads * mla.qk_head_dim, mla.q_lora_rank)}
    shapes |= {a + "kv_a_proj_with_mqa.weight": (mla.latent_dim, h),
               a + "kv_a_layernorm.weight": (mla.kv_lora_rank,),
               a + "kv_b_proj.weight": (heads * (mla.qk_nope_head_dim + mla.v_head_dim), mla.kv_lora_rank),
               a + "o_proj.weight": (h, heads * mla.v_head_dim)}
    mlps = {m: cfg.intermediate_size}
    if moe.is_moe_layer(n):
        mlps = {f"{m}experts.{e}.": moe.intermediate_size for e in range(moe.num_experts)}
        mlps[f"{m}shared_experts."] = moe.shared_expert_intermediate_size
        shapes[m + "gate.weight"] = (moe.num_experts, h)
        if moe.topk_method == "noaux_tc":
            shapes[m + "gate.e_score_correction_bias"] = (moe.num_experts,)
    for prefix, i in mlps.items():
        shapes |= {prefix + "gate_proj.weight": (i, h), prefix + "up_proj.weight": (i, h),
                   prefix + "down_proj.weight": (h, i)}
    return shapes
