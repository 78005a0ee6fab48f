"""The driver's adapter bookkeeping: an LRU of adapters in host memory, and which adapter each device
slot holds and how many running requests pin it.

- Host: up to `max_cpu_loras` adapters read from disk, by `lora_int_id`, least recently used evicted
  first. A request holds its own reference to its adapter, so an evicted adapter's weights live on until
  its requests finish: a request always runs with the weights its block hashes were made from.
- Device: `max_loras` slots on every rank, keyed by the adapter's digest (two names of one adapter share
  a slot). A request pins its adapter's slot while it runs (scheduled, until it finishes or is
  preempted); a slot no running request pins is evictable, least recently used first. A request whose
  adapter cannot get a slot (every slot pinned) waits in the queue; to keep it from waiting forever
  behind a stream of requests for the resident adapters, the scheduler drains one slot (`draining_slot`:
  no new pins there) until the waiting adapter gets it."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from engine.lora.peft import LoRAAdapter, load_peft_adapter
from engine.lora.request import LoRARequest
from engine.models.config import ModelConfig


class LoRAManager:
    def __init__(self, model_config: ModelConfig, max_loras: int, max_cpu_loras: int, max_lora_rank: int,
                 load_slot: Callable[[int, LoRAAdapter], None]) -> None:
        """`load_slot(slot, adapter)` loads an adapter into a slot on every rank (Executor.collective_rpc)."""
        self.model_config = model_config
        self.max_loras, self.max_cpu_loras, self.max_lora_rank = max_loras, max_cpu_loras, max_lora_rank
        self._load_slot = load_slot
        self.host: OrderedDict[int, LoRAAdapter] = OrderedDict()
        self.slots: list[LoRAAdapter | None] = [None] * max_loras
        self.pins = [0] * max_loras
        self._slot_of: dict[str, int] = {}  # digest -> slot
        self._slot_lru: OrderedDict[int, None] = OrderedDict((s, None) for s in range(max_loras))
        self.num_slot_loads = 0  # adapters loaded into slots since start (each load reaches every rank)

    # --- host memory -------------------------------------------------------------------------------

    def resolve(self, request: LoRARequest) -> LoRAAdapter:
        """The adapter of a request, from the host cache or read from disk (ValueError if it is bad)."""
        adapter = self.host.get(request.lora_int_id)
        if adapter is not None and adapter.name == request.lora_name and adapter.path == request.lora_path:
            self.host.move_to_end(request.lora_int_id)
            return adapter
        adapter = load_peft_adapter(request.lora_name, request.lora_int_id, request.lora_path, self.model_config,
                                    self.max_lora_rank)
        self.host[request.lora_int_id] = adapter
        self.host.move_to_end(request.lora_int_id)
        while len(self.host) > self.max_cpu_loras:
            self.host.popitem(last=False)
        return adapter

    def remove(self, lora_int_id: int) -> bool:
        """Forget an adapter: out of host memory, and out of its slot unless running requests pin it (then
        the slot is evicted like any other once they finish; until then a request with the same weights,
        by digest, may still use it)."""
        adapter = self.host.pop(lora_int_id, None)
        if adapter is None:
            return False
        slot = self._slot_of.get(adapter.digest)
        if slot is not None and self.pins[slot] == 0:
            self._evict(slot)
        return True

    def loaded_names(self) -> list[str]:
        """The adapters this engine can serve without reading them from disk (for routers)."""
        names = {a.name for a in self.host.values()} | {a.name for a in self.slots if a is not None}
        return sorted(names)

    # --- device slots ------------------------------------------------------------------------------

    def acquire(self, adapter: LoRAAdapter, draining_slot: int | None = None) -> int | None:
        """Pin a slot holding `adapter`, loading it into the least recently used evictable slot if need
        be; None when every slot is pinned (or the adapter sits in the slot being drained)."""
        slot = self._slot_of.get(adapter.digest)
        if slot is None:
            slot = next((s for s in self._slot_lru if self.pins[s] == 0 and s != draining_slot), None)
            if slot is None:
                return None
            if self.slots[slot] is not None:
                self._evict(slot)
            self._load_slot(slot, adapter)
            self.num_slot_loads += 1
            self.slots[slot] = adapter
            self._slot_of[adapter.digest] = slot
        elif slot == draining_slot:
            return None
        self.pins[slot] += 1
        self._slot_lru.move_to_end(slot)
        return slot

    def release(self, slot: int) -> None:
        self.pins[slot] -= 1

    def draining_slot(self) -> int | None:
        """The pinned slot to drain for a waiting adapter: the one fewest requests pin, least recently used."""
        pinned = [s for s in self._slot_lru if self.pins[s] > 0]
        return min(pinned, key=lambda s: self.pins[s]) if pinned else None

    def _evict(self, slot: int) -> None:
        adapter = self.slots[slot]
        self.slots[slot] = None
        del self._slot_of[adapter.digest]
        # The slot's weights stay on the ranks until overwritten: no request runs with this slot any more.
