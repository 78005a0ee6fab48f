"""The KV connector interface, in vLLM V1's split: one instance on the driver, next to the scheduler
(how many of a request's tokens can be loaded from elsewhere, what to load and save in each step, what
happens to a request's blocks when it finishes), and one on every rank, next to the KV cache (start
loading, wait for a layer, save a layer, wait for the saves).

A producer (the prefill side) runs a request's prompt, saves its KV for a consumer and, when the request
finishes, holds its blocks under a lease until the consumer confirms or the lease runs out. A consumer
(the decode side) is handed that KV with the request (`kv_transfer_params`), loads it into blocks of its
own in the step that admits the request, recomputes the last prompt token (whose logits it samples) and
decodes. Transports differ in where the bytes live between the two; the interface admits pulling from
the producer's blocks (NIXL, NCCL point to point) as well as copying through a store."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from engine.request import Request
from engine.shm_files import SHM_DIR


class KVTransferConfig(BaseModel):
    """EngineConfig.kv_transfer_config: this engine's part in disaggregated prefill/decode."""

    model_config = ConfigDict(extra="forbid")

    kv_role: Literal["kv_producer", "kv_consumer", "kv_both"] = Field(
        "kv_both", description="Produce KV for other engines (prefill), consume it (decode), or both.")
    kv_connector: Literal["shared_memory"] = Field(
        "shared_memory", description="Where KV is staged: files in shared memory on this host.")
    lease_s: float = Field(
        30.0, gt=0, description="A producer holds a finished request's blocks this long at most; a consumer's "
        "confirmation releases them earlier.")
    staging_dir: str | None = Field(
        None, description="Directory of staged KV files (default /dev/shm); the engine refuses to start when it "
        "cannot create files there.")

    @property
    def directory(self) -> str:
        return self.staging_dir or SHM_DIR


@dataclass(frozen=True)
class KVLayout:
    """The shape of one rank's staged KV: a consumer loads it only into an engine of the same layout
    (re-slicing heads across different tensor-parallel sizes is not supported)."""

    num_layers: int
    tensor_parallel_size: int
    pipeline_parallel_size: int
    num_kv_heads: int  # per rank
    head_dim: int
    dtype: str

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class KVLoad:
    """A request's KV to load in this step: tokens [start, end) of the staged KV `name` into its blocks."""

    request_id: str
    name: str
    block_ids: list[int]
    start: int
    end: int


@dataclass
class KVSave:
    """A request's KV to save once this step has computed it: its first `num_tokens` tokens."""

    name: str
    block_ids: list[int]
    num_tokens: int


@dataclass
class KVConnectorMetadata:
    """What every rank's connector does in one step (it travels in the step's ModelInput)."""

    loads: list[KVLoad] = field(default_factory=list)
    saves: list[KVSave] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.loads or self.saves)


class KVConnector(ABC):
    # --- scheduler side (the driver) ------------------------------------------------------------------

    @abstractmethod
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int:
        """Tokens of the request, after its `num_computed_tokens` local prefix-cache hit, whose KV can be
        loaded from elsewhere (never its last prompt token). No side effects."""

    @abstractmethod
    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_external_tokens: int) -> None:
        """The request got blocks for its external tokens: load them in the coming step."""

    @abstractmethod
    def build_connector_meta(self, requests: list[Request], num_scheduled_tokens: list[int]) -> KVConnectorMetadata:
        """The loads and saves of the step about to run: the pending loads of `requests` stay pending until
        `loads_done`, so that a failed step's requests, retried one by one, load their KV again."""

    @abstractmethod
    def loads_done(self, meta: KVConnectorMetadata) -> None:
        """Every rank ran the step of `meta`: its loads are done."""

    @abstractmethod
    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """The request finished: whether the connector keeps its blocks (freed later, see
        `get_finished`), and the kv_transfer_params its final output carries for a consumer."""

    @abstractmethod
    def get_finished(self, now: float) -> list[Request]:
        """Held requests whose blocks may be freed now (confirmed, or their lease ran out)."""

    @abstractmethod
    def release(self, request_id: str) -> None:
        """The consumer has the request's KV: release what is held for it."""

    # --- worker side (every rank) ---------------------------------------------------------------------

    @abstractmethod
    def start_load_kv(self, meta: KVConnectorMetadata, kv_caches: list[torch.Tensor]) -> None:
        """Start loading this step's KV into this rank's caches (one per local layer)."""

    def wait_for_layer_load(self, layer: int) -> None:
        """Block until layer `layer`'s KV is loaded (a no-op for connectors that load synchronously)."""

    @abstractmethod
    def save_kv_layer(self, layer: int, kv_cache: torch.Tensor, meta: KVConnectorMetadata) -> None:
        """Save layer `layer`'s KV of this step's saves, once the layer has computed it."""

    def wait_for_save(self) -> None:
        """Block until this step's saves are complete."""
