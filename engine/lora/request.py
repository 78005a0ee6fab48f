"""LoRARequest: which adapter a request runs with (vLLM's API, so that callers' code carries over)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """`LoRARequest("sql", 1, "/adapters/sql")`: a PEFT adapter folder (adapter_config.json and
    adapter_model.safetensors). `lora_int_id` (> 0) names one version of the adapter: an engine keeps what
    it loaded under that id, so new weights at the same path need a new id (or `LLMEngine.remove_lora`
    first). Whatever the names, the prefix cache keys an adapter's blocks by a digest of its weights."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError("lora_request.lora_name: must be a non-empty string")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_request.lora_int_id: must be an int > 0, got {self.lora_int_id!r}")
        if not self.lora_path:
            raise ValueError(f"lora_request.lora_path: adapter {self.lora_name!r} has no path")
