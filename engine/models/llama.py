"""One decoder for the Llama family: Llama (incl. Llama 3 rope scaling), Mistral, Qwen2 (qkv bias) and
Qwen3 (per-head q/k RMSNorm). Tokens arrive flattened ([num_tokens]); attention goes through the
paged attention backend. Projections are fused (qkv, gate_up) so each layer runs four matmuls.

Under tensor parallelism each rank holds its heads and its slice of the MLP (engine/models/layers);
under pipeline parallelism a stage holds a contiguous run of layers, the first stage the embedding,
the last the final norm and LM head, and stages hand each other (hidden states, residual)."""

from __future__ import annotations

import zlib
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from engine.distributed import get_pp_group, pp_layer_range
from engine.models.checkpoint import CheckpointTensor
from engine.models.config import ModelConfig
from engine.models.layers import (
    MergedColumnParallelLinear,
    MRotaryEmbedding,
    ParallelLMHead,
    QKVParallelLinear,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from engine.models.layers.direct_call import DirectCall
from engine.models.layers.linear import copy_checked
from engine.models.layers.quantization import QuantizationConfig
from ops.attention import AttentionBackend
from ops.cpu import elementwise
from ops.cpu.decode_stack import DecodeLayer, attach_head, build_decode_stack

# What a pipeline stage hands the next one: (hidden states, residual).
IntermediateTensors = tuple[torch.Tensor, torch.Tensor]
# The MLP gate's activation, by the config's name (hidden_act, or Gemma's hidden_activation).
_ACTIVATIONS = {"silu": F.silu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"), "gelu": F.gelu}


class Attention(DirectCall, nn.Module):
    def __init__(self, cfg: ModelConfig, rope: RotaryEmbedding, quant_config: QuantizationConfig | None,
                 prefix: str, layer: int) -> None:
        super().__init__()
        self.head_dim = cfg.head_dim
        self.scale = cfg.attention_scale
        self.sliding_window = cfg.sliding_window_of(layer)
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads,
                                          cfg.num_key_value_heads, bias=cfg.qkv_bias, quant_config=quant_config,
                                          prefix=f"{prefix}.qkv_proj")
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * cfg.head_dim, cfg.hidden_size, bias=cfg.o_proj_bias,
                                        quant_config=quant_config, prefix=f"{prefix}.o_proj")
        self.rope = rope
        if cfg.qk_norm:
            self.q_norm = self.norm_cls(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = self.norm_cls(self.head_dim, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.kv_cache = torch.empty(0)  # bound by the worker (Worker.init_kv_cache)
        self.register_parameter("sinks", None)  # gpt-oss's per-head attention sinks (engine/models/gpt_oss.py)

    norm_cls: type[nn.Module] = RMSNorm  # Gemma's differs

    def forward(self, positions: torch.Tensor, x: torch.Tensor, backend: AttentionBackend) -> torch.Tensor:
        n, heads, kv_heads, d = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k, v = q.view(n, heads, d), k.view(n, kv_heads, d), v.view(n, kv_heads, d)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
            q, k = self.rope(positions, q, k)
        else:  # q's heads then k's, side by side in qkv: rotated in place, together
            self.rope.rotate_(positions, qkv[:, : self.q_size + self.kv_size].view(n, heads + kv_heads, d))
        out = backend.forward(q, k, v, self.kv_cache, self.sliding_window, self.sinks)
        return self.o_proj(out.view(n, self.q_size))


class MLP(DirectCall, nn.Module):
    def __init__(self, cfg: ModelConfig, quant_config: QuantizationConfig | None, prefix: str,
                 intermediate_size: int | None = None, reduce_results: bool = True) -> None:
        """`intermediate_size` other than the config's and `reduce_results=False` (partial sums left to the
        caller's all-reduce) serve MoE shared experts."""
        super().__init__()
        size = intermediate_size or cfg.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [size, size], bias=cfg.mlp_bias,
                                                       quant_config=quant_config, prefix=f"{prefix}.gate_up_proj")
        self.down_proj = RowParallelLinear(size, cfg.hidden_size, bias=cfg.mlp_bias, quant_config=quant_config,
                                           prefix=f"{prefix}.down_proj", reduce_results=reduce_results)

        self.act = _ACTIVATIONS[cfg.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.act is F.silu and elementwise.available(gate_up):
            return self.down_proj(elementwise.silu_and_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)


class DecoderLayer(DirectCall, nn.Module):
    attention_cls: type[Attention] = Attention
    norm_cls: type[nn.Module] = RMSNorm

    def __init__(self, cfg: ModelConfig, rope: RotaryEmbedding, quant_config: QuantizationConfig | None,
                 prefix: str, layer: int) -> None:
        super().__init__()
        self.input_layernorm = self.norm_cls(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = self.attention_cls(cfg, rope, quant_config, f"{prefix}.self_attn", layer)
        self.post_attention_layernorm = self.norm_cls(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = self.make_mlp(cfg, quant_config, f"{prefix}.mlp")

    def make_mlp(self, cfg: ModelConfig, quant_config: QuantizationConfig | None, prefix: str) -> nn.Module:
        """The feed-forward block (a mixture-of-experts decoder overrides this)."""
        return MLP(cfg, quant_config, prefix)

    def forward(self, positions, x, residual, backend):
        if residual is None:
            residual = x
            x = self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x, backend)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual

    def decode_layer(self) -> DecodeLayer | None:
        """This layer's tensors for ops/cpu/decode_stack.cpp, which runs this class's forward for a decode step in
        C++; None where that would compute something else: a subclass's forward, projections that LoRA wraps or
        whose method has no kernel there, q/k norms, a sliding window, sinks, tensor parallelism, another activation
        or rotary embedding, or no KV cache bound yet."""
        attn, mlp = self.self_attn, self.mlp
        if (type(self) is not DecoderLayer or type(attn) is not Attention or type(mlp) is not MLP
                or type(self.input_layernorm) is not RMSNorm or type(self.post_attention_layernorm) is not RMSNorm
                or attn.q_norm is not None or attn.sliding_window or attn.sinks is not None
                or type(attn.rope) is not RotaryEmbedding or attn.rope.interleaved or mlp.act is not F.silu
                or attn.kv_cache.dim() != 5 or attn.kv_cache.dtype not in (torch.float32, torch.bfloat16)):
            return None
        kinds = {attn.qkv_proj: QKVParallelLinear, attn.o_proj: RowParallelLinear,
                 mlp.gate_up_proj: MergedColumnParallelLinear, mlp.down_proj: RowParallelLinear}
        projections = [p.decode_projection() if type(p) is kind else None for p, kind in kinds.items()]
        if None in projections:
            return None
        dtype = attn.kv_cache.dtype
        qkv, o, gate_up, down = projections
        return DecodeLayer(self.input_layernorm.weight.to(dtype).contiguous(), qkv, o,
                           self.post_attention_layernorm.weight.to(dtype).contiguous(), gate_up, down, attn.kv_cache)


class LlamaModel(nn.Module):
    norm_cls: type[nn.Module] = RMSNorm

    def __init__(self, cfg: ModelConfig, quant_config: QuantizationConfig | None, prefix: str = "model",
                 layer_cls: type[DecoderLayer] = DecoderLayer) -> None:
        super().__init__()
        pp = get_pp_group()
        self.is_first_stage, self.is_last_stage = pp.is_first, pp.is_last
        self.start_layer, self.end_layer = pp_layer_range(cfg.num_hidden_layers, pp.rank_in_group, pp.size)
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size) if pp.is_first else None
        rope = (MRotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling,
                                 cfg.mrope_section) if cfg.mrope_section else
                RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling,
                                cfg.rope_interleaved))
        local_rope = rope
        if cfg.local_rope_theta is not None:  # Gemma 3's sliding layers rotate with a base of their own
            local_rope = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.local_rope_theta,
                                         cfg.local_rope_scaling)
        # Other stages' layers are placeholders, so that parameter names keep the checkpoint's indices.
        self.layers = nn.ModuleList(
            layer_cls(cfg, local_rope if cfg.sliding_window_of(i) else rope, quant_config, f"{prefix}.layers.{i}", i)
            if self.start_layer <= i < self.end_layer else nn.Identity()
            for i in range(cfg.num_hidden_layers)
        )
        # This stage's layers as a plain tuple: slicing the ModuleList builds a new one, ~30 us every step.
        self.stage_layers: tuple[DecoderLayer, ...] = tuple(self.layers[self.start_layer : self.end_layer])
        self.norm = self.norm_cls(cfg.hidden_size, cfg.rms_norm_eps) if pp.is_last else None
        self._decode_stack = None  # ops/cpu/decode_stack.py's, over the KV caches in _decode_stack_caches
        self._decode_stack_caches: torch.Tensor | None = None

    def decode_stack(self):
        """This stage's layers as one C++ call for decode-only steps on CPU (ops/cpu/decode_stack.py), or None where
        a layer does not qualify (DecoderLayer.decode_layer). Built at the first such step, once the worker has
        bound the KV caches, and again whenever it binds new ones."""
        caches = self.stage_layers[0].self_attn.kv_cache if self.stage_layers else None
        if caches is not self._decode_stack_caches:
            self._decode_stack_caches, self._decode_stack = caches, self._build_decode_stack()
        return self._decode_stack

    def _build_decode_stack(self):
        layers = [layer.decode_layer() for layer in self.stage_layers]
        if not layers or None in layers:
            return None
        eps = {n.eps for layer in self.stage_layers for n in (layer.input_layernorm, layer.post_attention_layernorm)}
        first = self.stage_layers[0]
        attn = first.self_attn
        if len(eps) > 1 or any(layer.self_attn.rope is not attn.rope for layer in self.stage_layers):
            return None
        return build_decode_stack(layers, attn.rope.cos, attn.rope.sin, eps.pop(), attn.scale,
                                  first.input_layernorm.weight.numel(), first.mlp.down_proj.input_size_per_partition,
                                  attn.num_heads, attn.num_kv_heads, attn.head_dim)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(self, input_ids, positions, backend, intermediate: IntermediateTensors | None = None,
                inputs_embeds: torch.Tensor | None = None):
        """`inputs_embeds`: the first stage's input embeddings where a caller made them (images placed)."""
        if self.is_first_stage:
            x, residual = (self.embed(input_ids) if inputs_embeds is None else inputs_embeds), None
        else:
            x, residual = intermediate
        plan = backend.cpu_decode_plan()
        stack = self.decode_stack() if plan is not None else None
        if (stack is not None and positions.dtype == torch.int64 and positions.dim() == 1 and x.is_contiguous()
                and (residual is None or residual.is_contiguous())):  # another stage's tensors, as they came
            x, residual = stack.forward(x, residual, positions, *plan)
        else:
            for layer in self.stage_layers:
                x, residual = layer(positions, x, residual, backend)
        if not self.is_last_stage:
            return x, residual
        x, _ = self.norm(x, residual)
        return x


class LlamaForCausalLM(nn.Module):
    # Hugging Face checkpoint name -> (our fused parameter, shard index)
    packed_modules = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }
    decoder_layer_cls: type[DecoderLayer] = DecoderLayer
    model_cls: type[LlamaModel] = LlamaModel

    def __init__(self, cfg: ModelConfig, quant_config: QuantizationConfig | None = None) -> None:
        super().__init__()
        self.config = cfg
        if quant_config is not None:
            quant_config.fused_modules = self.fused_modules()
        self.model = self.model_cls(cfg, quant_config, layer_cls=self.decoder_layer_cls)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size) if self.model.is_last_stage else None
        if cfg.tie_word_embeddings and self.lm_head is not None and self.model.embed_tokens is not None:
            self.lm_head.tie_to(self.model.embed_tokens)
        self._decode_head_stack = None  # the decode stack decode_logits last handed the head to, and whether it took it
        self._decode_head = False

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, backend: AttentionBackend,
                intermediate: IntermediateTensors | None = None) -> torch.Tensor | IntermediateTensors:
        """Final hidden states on the last stage; (hidden states, residual) for the next stage elsewhere."""
        return self.model(input_ids, positions, backend, intermediate)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Full-vocabulary logits on the rank that samples, None on its TP peers."""
        return self.lm_head.compute_logits(hidden)

    def decode_logits(self, input_ids: torch.Tensor, positions: torch.Tensor, block_tables: torch.Tensor,
                      seq_lens: torch.Tensor, slot_mapping: torch.Tensor, block_size: int) -> torch.Tensor | None:
        """Every token's logits for a step whose every token decodes, in one C++ call from the embedding to the LM
        head (decode_stack.cpp's logits), as forward then compute_logits would give them: input_ids, positions and
        slot_mapping int64 [n], block_tables int32 [n, max_blocks], seq_lens int32 [n], for an attention backend
        that decodes on the CPU kernels (not planned: the stack reads these itself). None where this model does not
        qualify; the caller then plans and runs those. Why: after a step's weights have streamed through the caches,
        each torch op's Python and dispatch runs from memory at ~50 us apiece (the attention plan, the embedding,
        the final norm, the row gather and the LM head's call: ~0.4 ms of a 7 ms step of the 56M model at batch 1)."""
        stack = self.model.decode_stack()
        if stack is None:
            return None
        if stack is not self._decode_head_stack:
            self._decode_head_stack, self._decode_head = stack, self._attach_decode_head(stack)
        if not self._decode_head:
            return None
        return stack.logits(input_ids, positions, block_tables, seq_lens, slot_mapping, block_size)

    def _attach_decode_head(self, stack) -> bool:
        """Hand `stack` the embedding, final norm and LM head; False where they are not the plain ones whose
        computation logits() repeats: one stage and one rank, no subclass's forward, embedding or logits, the LM
        head on our panels."""
        model, head = self.model, self.lm_head
        cls, model_cls = type(self), type(model)
        plain = (cls.forward is LlamaForCausalLM.forward and cls.compute_logits is LlamaForCausalLM.compute_logits
                 and model_cls.forward is LlamaModel.forward and model_cls.embed is LlamaModel.embed
                 and model.is_first_stage and model.is_last_stage and type(model.norm) is RMSNorm
                 and type(model.embed_tokens) is VocabParallelEmbedding and type(head) is ParallelLMHead
                 and model.embed_tokens.tp_size == 1 and head.tp_size == 1)
        projection = head.quant_method.decode_projection(head) if plain else None
        if projection is None:
            return False
        dtype = model.stage_layers[0].self_attn.kv_cache.dtype
        embedding = model.embed_tokens.weight
        if embedding.dtype != dtype or not embedding.is_contiguous():
            return False
        attach_head(stack, embedding, model.norm.weight.to(dtype).contiguous(), model.norm.eps, projection,
                    head.num_embeddings)
        return True

    @classmethod
    def fused_modules(cls) -> dict[str, list[str]]:
        """Our fused layer -> the checkpoint modules in it, in shard order."""
        fused: dict[str, list[str]] = {}
        for hf, (ours, _shard) in sorted(cls.packed_modules.items(), key=lambda item: item[1]):
            fused.setdefault(ours, []).append(hf)
        return fused

    @staticmethod
    def checkpoint_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
        """Names and full shapes of this architecture's checkpoint tensors (dummy and built-in weights)."""
        return checkpoint_shapes(cfg)

    @property
    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn for layer in self.model.stage_layers]

    def checkpoint_to_param(self, name: str) -> tuple[str, int | None] | None:
        """Our parameter name and shard for a checkpoint tensor name, or None to skip it."""
        if "rotary_emb" in name:
            return None
        if name.startswith(("layers.", "embed_tokens.", "norm.")):  # a base model's (Qwen3Model's) names
            name = "model." + name
        if name == "lm_head.weight" and self.config.tie_word_embeddings:
            return None
        if name == "model.embed_tokens.weight" and self.model.embed_tokens is None:
            # A last stage without the embedding loads it as its tied LM head.
            return ("lm_head.weight", None) if self.config.tie_word_embeddings and self.lm_head is not None else None
        for hf, (ours, shard) in self.packed_modules.items():
            if f".{hf}." in name:
                return name.replace(f".{hf}.", f".{ours}."), shard
        return name, None

    def _on_other_stage(self, param_name: str) -> bool:
        parts = param_name.split(".")
        if parts[:2] == ["model", "layers"]:
            return not self.model.start_layer <= int(parts[2]) < self.model.end_layer
        return ((parts[:2] == ["model", "norm"] and self.model.norm is None)
                or (parts[0] == "lm_head" and self.lm_head is None))

    def load_weights(self, weights: Iterable[tuple[str, CheckpointTensor]]) -> None:
        """Load checkpoint tensors, each narrowed to this rank's part; raises naming what is missing."""
        params = dict(self.named_parameters())
        loaded: set[tuple[str, int | None]] = set()
        for name, tensor in weights:
            target = self.checkpoint_to_param(name)
            if target is None:
                continue
            ours, shard = target
            if ours not in params:
                if self._on_other_stage(ours):
                    continue
                raise ValueError(f"model: checkpoint tensor {name!r} matches no parameter of "
                                 f"{self.config.architecture}")
            param = params[ours]
            loader = getattr(param, "weight_loader", None)
            try:
                if loader is None:
                    copy_checked(param, tensor)
                else:
                    loader(param, tensor, shard)
            except ValueError as e:
                raise ValueError(f"model: {name!r} {e}") from None
            loaded.add((ours, shard))
        missing = sorted(f"{n}[{s}]" if s is not None else n for n, s in self._expected_weights() - loaded)
        if missing:
            raise ValueError(f"model: the checkpoint lacks weights: {', '.join(missing[:8])}")

    def _expected_weights(self) -> set[tuple[str, int | None]]:
        expected, seen = set(), set()
        for module_name, module in self.named_modules():
            shards = range(module.num_shards) if getattr(module, "num_shards", 1) > 1 else [None]
            for param_name, param in module.named_parameters(recurse=False):
                # a tied LM head shares the embedding's weight
                if id(param) not in seen and not getattr(param, "optional", False):
                    seen.add(id(param))
                    expected.update((f"{module_name}.{param_name}", s) for s in shards)
        return expected


def checkpoint_shapes(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Names and full shapes of the tensors of a Hugging Face checkpoint of this architecture."""
    h, i, d = c.hidden_size, c.intermediate_size, c.head_dim
    q, kv = c.num_attention_heads * d, c.num_key_value_heads * d
    shapes = {"model.embed_tokens.weight": (c.vocab_size, h)}
    for n in range(c.num_hidden_layers):
        p = f"model.layers.{n}."
        shapes |= {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                   p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                   p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
                   p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
                   p + "mlp.down_proj.weight": (h, i)}
        if c.qkv_bias:
            shapes |= {p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                       p + "self_attn.v_proj.bias": (kv,)}
        if c.o_proj_bias:
            shapes[p + "self_attn.o_proj.bias"] = (h,)
        if c.mlp_bias:
            shapes |= {p + f"mlp.{m}_proj.bias": ((h,) if m == "down" else (i,)) for m in ("gate", "up", "down")}
        if c.qk_norm:
            shapes |= {p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,)}
    shapes["model.norm.weight"] = (h,)
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, h)
    return shapes


class _RandomTensor:
    """A random tensor drawn only when read (a rank reads the slices it holds)."""

    def __init__(self, shape: tuple[int, ...], seed: int, std: float) -> None:
        self.shape, self.seed, self.std = shape, seed, std

    def __getitem__(self, index) -> torch.Tensor:
        gen = torch.Generator().manual_seed(self.seed)
        return (torch.randn(self.shape, generator=gen) * self.std)[index]


def dummy_checkpoint(model: LlamaForCausalLM, seed: int) -> Iterable[tuple[str, CheckpointTensor]]:
    """Random weights at the checkpoint's full shapes, drawn per tensor name: every parallel layout of an
    engine sees the same model (norms 1, biases 0, the rest normal with the config's initializer_range)."""
    std = model.config.initializer_range
    for name, shape in model.checkpoint_shapes(model.config).items():
        if name.endswith("norm.weight"):
            yield name, CheckpointTensor.of(torch.ones(shape))
        elif name.endswith(".bias"):
            yield name, CheckpointTensor.of(torch.zeros(shape))
        else:
            yield name, CheckpointTensor(_RandomTensor(shape, seed ^ zlib.crc32(name.encode()), std), shape,
                                         torch.float32)
