"""Multi-LoRA serving: PEFT adapters (peft.py), their device slots and host LRU (manager.py), and the LoRA
wrapper of the parallel linear layers (layers.py). An adapter's identity in the prefix cache is a digest
of its weights (engine/block_hash.py)."""

from engine.lora.peft import LoRAAdapter, load_peft_adapter
from engine.lora.request import LoRARequest

__all__ = ["LoRARequest", "LoRAAdapter", "load_peft_adapter"]
