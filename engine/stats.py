"""EngineStats: one immutable snapshot of the engine's load and counters. The engine thread publishes a
new one after every step; readers on other threads just read the reference (no lock)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class EngineStats:
    kv_cache_usage: float  # fraction of KV blocks referenced by requests, 0..1
    num_running: int
    num_waiting: int
    num_kv_blocks: int
    block_size: int
    # KV bytes a token of context takes on this engine's driver rank, over its layers: a K and a V per layer,
    # or one latent per layer (no factor 2) for latent attention (DeepSeek's MLA).
    kv_bytes_per_token: int = 0
    queued_prefill_tokens: int = 0  # prompt tokens of waiting and running requests not yet computed
    num_kv_held: int = 0  # finished requests whose blocks a KV producer holds for a consumer
    # Ranks that read each step's input over TCP rather than from the driver's shared memory: those on
    # other nodes than the driver (a multi-rank engine spread over hosts).
    step_queue_tcp_readers: int = 0
    # Counters since start.
    num_preemptions: int = 0
    prefix_cache_queries: int = 0  # tokens
    prefix_cache_hits: int = 0  # tokens
    prompt_tokens: int = 0
    generation_tokens: int = 0
    num_requests_finished: int = 0
    num_steps: int = 0
    # Speculative decoding: verifications of at least one draft token, the draft tokens verified, and
    # those accepted (vLLM's spec_decode_num_drafts / _num_draft_tokens / _num_accepted_tokens).
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    # LoRA: adapter names held in host memory or device slots (what routers prefer a replica for), and
    # adapters loaded into device slots since start (each load reaches every rank).
    loaded_loras: tuple[str, ...] = ()
    num_lora_slot_loads: int = 0
    # Mixture-of-experts models: (token, expert) assignments routed to each expert, summed over the MoE
    # layers (the load balance across experts; each token counts top_k times per layer). Under pipeline
    # parallelism, the layers of the last stage only. Empty for dense models.
    expert_tokens: tuple[int, ...] = ()
    # Vision-language models: images in admitted prompts (images per request = over num_requests), images
    # the encoder ran on, images a step read from the encoder cache instead, and the encoder's time.
    mm_prompt_images: int = 0
    mm_images_encoded: int = 0
    mm_encoder_cache_hits: int = 0
    mm_encoder_seconds: float = 0.0

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0

    @property
    def spec_decode_acceptance_rate(self) -> float:
        """Fraction of draft tokens the target accepted."""
        if not self.spec_decode_num_draft_tokens:
            return 0.0
        return self.spec_decode_num_accepted_tokens / self.spec_decode_num_draft_tokens

    @property
    def spec_decode_mean_acceptance_length(self) -> float:
        """Tokens emitted per verification: the accepted drafts plus the target's own token."""
        return (1.0 + self.spec_decode_num_accepted_tokens / self.spec_decode_num_drafts
                if self.spec_decode_num_drafts else 0.0)
