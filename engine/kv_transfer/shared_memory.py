"""The shared-memory connector: KV staged in files under /dev/shm, one per rank and request.

A producer's ranks save a finished prompt's KV, layer by layer, into `<name>.rank<r>.kv` ([local layers,
2, tokens, kv heads, head dim] in the model's dtype); a consumer's ranks load such files into their
blocks. Between two engines on one host the files are the transfer; across hosts a transport moves them
(serve_app/disaggregation/transfer.py puts them in Ray's object store on the prefill side and writes them
back on the decode side). Staging costs one copy out of the blocks (gather) and one copy into them (scatter).
Names follow engine/shm_files.py (the owner's pid in each), whose sweep removes what a dead owner left.

Staged KV carries what it was computed with, and a consumer loads only KV that fits the request: the layout
(layers, heads, dtype per rank) and the LoRA adapter's weight digest (None: the base model)."""

from __future__ import annotations

import hashlib
import logging
import os
import time
from typing import Any

import torch

from engine.core.request import Request, RequestStatus
from engine.kv_transfer.base import KVConnector, KVConnectorMetadata, KVLayout, KVLoad, KVSave
from engine.kv_transfer.config import KVTransferConfig
from engine.shm_files import check_writable_dir, owner, staged_path, sweep
from ops.attention.backend import kv_rows

logger = logging.getLogger(__name__)

_SWEEP_INTERVAL_S = 10.0


def is_staged_name(name: Any) -> bool:
    """A staged KV's name as an engine or a decode replica makes it (engine/shm_files.py): nothing else may
    name a file this connector reads or deletes."""
    return isinstance(name, str) and "/" not in name and (owner(name) or ("", 0))[0] in ("kv", "rx")



class SharedMemoryConnector(KVConnector):
    def __init__(self, config: KVTransferConfig, engine_id: str, layout: KVLayout, block_size: int,
                 dtype: torch.dtype, rank: int = 0, layers_per_rank: list[int] | None = None) -> None:
        """`layers_per_rank`: how many layers each rank holds (pipeline stages), to check staged sizes. Refuses
        a staging directory it cannot write (every transfer would fail), and sweeps it of files whose
        owner died."""
        self.config, self.engine_id, self.layout = config, engine_id, layout
        self.block_size, self.dtype, self.rank = block_size, dtype, rank
        self.directory = config.directory
        check_writable_dir(self.directory, "kv_transfer_config.staging_dir")
        sweep(self.directory)
        self.layers_per_rank = layers_per_rank or [layout.num_layers]
        self.produces = config.kv_role in ("kv_producer", "kv_both")
        self.consumes = config.kv_role in ("kv_consumer", "kv_both")
        # Loads scheduled but not yet done, by request: a step that fails is retried request by request
        # (EngineCore._execute_isolated), and each retry must load its request's KV again.
        self._pending_loads: dict[str, KVLoad] = {}
        self._held: dict[str, tuple[Request, float, str]] = {}  # request id -> (request, lease end, staged name)
        self._released: set[str] = set()
        self._saving: dict[str, torch.Tensor] = {}  # this step's staged tensors, by name (worker side)
        self._next_sweep = time.monotonic() + _SWEEP_INTERVAL_S

    # --- scheduler side --------------------------------------------------------------------------------

    def staged_name(self, request: Request) -> str:
        # A digest, not the request id: ids come from clients and name files.
        return f"{self.engine_id}-{hashlib.sha1(request.request_id.encode()).hexdigest()[:20]}"

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int:
        params = request.kv_transfer_params
        if not self.consumes or not params or "name" not in params or request.wants_prompt_logprobs:
            return 0
        if not is_staged_name(params["name"]):
            logger.warning("request %s: %r names no staged KV; recomputing", request.request_id, params["name"])
            return 0
        if params.get("layout") != self.layout.as_dict():
            logger.warning("request %s: staged KV of layout %s does not fit this engine's %s; recomputing",
                           request.request_id, params.get("layout"), self.layout.as_dict())
            return 0
        if params.get("lora_digest") != request.lora_digest:  # KV of another adapter's (or the base model's) weights
            logger.warning("request %s: staged KV was computed under LoRA digest %s, the request runs under %s; "
                           "recomputing", request.request_id, params.get("lora_digest"), request.lora_digest)
            return 0
        end = min(int(params["num_tokens"]), request.num_prompt_tokens - 1)  # the last token is recomputed
        if end <= num_computed_tokens or not self._staged_complete(params["name"], int(params["num_tokens"])):
            return 0
        return end - num_computed_tokens

    def _staged_complete(self, name: str, num_tokens: int) -> bool:
        per_layer = (2 * num_tokens * self.layout.num_kv_heads * self.layout.head_dim
                     * torch.empty(0, dtype=self.dtype).element_size())
        for rank, layers in enumerate(self._layers_of_ranks()):
            path = staged_path(self.directory, name, rank)
            if not path.is_file() or path.stat().st_size != layers * per_layer:
                return False
        return True

    def _layers_of_ranks(self) -> list[int]:
        tp = self.layout.tensor_parallel_size
        return [layers for layers in self.layers_per_rank for _ in range(tp)]

    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_external_tokens: int) -> None:
        if num_external_tokens:
            start = request.num_computed_tokens
            self._pending_loads[request.request_id] = KVLoad(request.request_id, request.kv_transfer_params["name"],
                                                             list(block_ids), start, start + num_external_tokens)

    def build_connector_meta(self, requests: list[Request], num_scheduled_tokens: list[int],
                             block_ids: list[list[int]]) -> KVConnectorMetadata:
        saves = []
        if self.produces:
            for j, (request, n) in enumerate(zip(requests, num_scheduled_tokens)):
                params = request.kv_transfer_params
                prompt = request.num_prompt_tokens
                if (params and params.get("do_remote_decode")
                        and request.num_computed_tokens < prompt <= request.num_computed_tokens + n):
                    saves.append(KVSave(self.staged_name(request), list(block_ids[j]), prompt))
        loads = [self._pending_loads[r.request_id] for r in requests if r.request_id in self._pending_loads]
        return KVConnectorMetadata(loads, saves)

    def loads_done(self, meta: KVConnectorMetadata) -> None:
        for load in meta.loads:
            self._pending_loads.pop(load.request_id, None)
            self.discard(load.name)  # every rank has loaded it: the staged files are spent

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        params = request.kv_transfer_params
        self._pending_loads.pop(request.request_id, None)
        if self.consumes and params and is_staged_name(params.get("name")):  # loaded, or never will be: spent
            self.discard(params["name"])
        if not self.produces or not params or not params.get("do_remote_decode"):
            return False, None
        name = self.staged_name(request)
        if request.status in (RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR) or (
                request.num_computed_tokens < request.num_prompt_tokens):
            self.discard(name)
            return False, None
        self._held[request.request_id] = (request, time.monotonic() + self.config.lease_s, name)
        return True, {"name": name, "num_tokens": request.num_prompt_tokens, "layout": self.layout.as_dict(),
                      "num_ranks": len(self._layers_of_ranks()), "cached_tokens": max(request.num_cached_tokens, 0),
                      "engine_id": self.engine_id, "request_id": request.request_id, "lease_s": self.config.lease_s,
                      "lora_digest": request.lora_digest}

    def get_finished(self, now: float) -> list[Request]:
        if now >= self._next_sweep:
            self._next_sweep = now + _SWEEP_INTERVAL_S
            sweep(self.directory, older_than_s=max(600.0, 10 * self.config.lease_s))
        done = [rid for rid, (_, end, _) in self._held.items() if rid in self._released or now >= end]
        freed = []
        for rid in done:
            request, _, name = self._held.pop(rid)
            self._released.discard(rid)
            self.discard(name)
            freed.append(request)
        return freed

    def release(self, request_id: str) -> None:
        if request_id in self._held:
            self._released.add(request_id)

    @property
    def num_held(self) -> int:
        return len(self._held)

    def holds(self, request_id: str) -> bool:
        """Whether a finished request of this id still holds its blocks for a consumer: a new request of the
        same id would share its block table and its staged file."""
        return request_id in self._held

    def discard_held(self) -> None:
        """The engine stops: its staged KV will never be fetched."""
        for _, _, name in self._held.values():
            self.discard(name)
        self._held.clear()

    def discard(self, name: str) -> None:
        """Delete a staged KV's files (every rank's: they share this host)."""
        for rank in range(len(self._layers_of_ranks())):
            staged_path(self.directory, name, rank).unlink(missing_ok=True)

    # --- worker side -----------------------------------------------------------------------------------

    def start_load_kv(self, meta: KVConnectorMetadata, kv_caches: list[torch.Tensor]) -> None:
        for load in meta.loads:
            staged = self._open(load.name, len(kv_caches))
            rows = self._rows(load.block_ids, load.start, load.end, kv_caches[0].device)
            for cache, layer in zip(kv_caches, staged):
                flat = cache.view(-1, cache.shape[-2], cache.shape[-1])
                flat.index_copy_(0, rows[0], layer[0, load.start : load.end].to(cache.device))
                flat.index_copy_(0, rows[1], layer[1, load.start : load.end].to(cache.device))

    def save_kv_layer(self, layer: int, kv_cache: torch.Tensor, meta: KVConnectorMetadata) -> None:
        for save in meta.saves:
            staged = self._saving.get(save.name)
            if staged is None:
                staged = self._saving[save.name] = self._create(save, kv_cache)
            rows = self._rows(save.block_ids, 0, save.num_tokens, kv_cache.device)
            flat = kv_cache.view(-1, kv_cache.shape[-2], kv_cache.shape[-1])
            staged[layer, 0].copy_(flat.index_select(0, rows[0]))
            staged[layer, 1].copy_(flat.index_select(0, rows[1]))

    def wait_for_save(self) -> None:
        self._saving.clear()  # synchronous copies: done; the mapped files are flushed on unmap

    def _rows(self, block_ids: list[int], start: int, end: int,
              device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        positions = torch.arange(start, end)
        slots = (torch.tensor(block_ids, dtype=torch.long)[positions // self.block_size] * self.block_size
                 + positions % self.block_size)
        k, v = kv_rows(slots, self.block_size)
        return k.to(device), v.to(device)

    def _shape(self, num_layers: int, num_tokens: int) -> tuple[int, ...]:
        return (num_layers, 2, num_tokens, self.layout.num_kv_heads, self.layout.head_dim)

    def _create(self, save: KVSave, kv_cache: torch.Tensor) -> torch.Tensor:
        num_layers = self._layers_of_ranks()[self.rank]
        shape = self._shape(num_layers, save.num_tokens)
        path = staged_path(self.directory, save.name, self.rank)
        numel = int(torch.Size(shape).numel())
        with open(path, "wb") as f:  # sized first: from_file maps what exists
            f.truncate(numel * torch.empty(0, dtype=self.dtype).element_size())
        return torch.from_file(str(path), shared=True, size=numel, dtype=self.dtype).view(shape)

    def _open(self, name: str, num_layers: int) -> torch.Tensor:
        path = staged_path(self.directory, name, self.rank)
        elem = torch.empty(0, dtype=self.dtype).element_size()
        per_token = 2 * num_layers * self.layout.num_kv_heads * self.layout.head_dim * elem
        num_tokens = os.path.getsize(path) // per_token
        numel = num_layers * 2 * num_tokens * self.layout.num_kv_heads * self.layout.head_dim
        return torch.from_file(str(path), shared=False, size=numel,
                               dtype=self.dtype).view(self._shape(num_layers, num_tokens))
