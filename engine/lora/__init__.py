"""Multi-LoRA serving: PEFT adapters (peft.py), their device slots and host LRU (manager.py), and the LoRA
wrapper of the parallel linear layers (layers.py). An adapter's identity in the prefix cache is a digest
of its weights (engine/core/block_hash.py). Nothing is imported here: `engine.lora.request` (LoRARequest)
is needed where torch is not."""
