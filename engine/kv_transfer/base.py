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
from typing import Any

import torch

from engine.config import EngineConfig
from engine.core.request import Request
from engine.distributed import pp_layer_range
from engine.kv_transfer.config import KVTransferConfig
from engine.models.config import ModelConfig


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


def kv_layout(config: EngineConfig, model_config: ModelConfig, dtype: torch.dtype) -> tuple[KVLayout, list[int]]:
    """The staged-KV layout of an engine, and how many layers each pipeline stage holds."""
    tp, pp = config.tensor_parallel_size, config.pipeline_parallel_size
    kv_heads = max(1, model_config.num_key_value_heads // tp)
    layout = KVLayout(model_config.num_hidden_layers, tp, pp, kv_heads, model_config.head_dim,
                      str(dtype).removeprefix("torch."))
    stages = [end - start for start, end in (pp_layer_range(model_config.num_hidden_layers, s, pp) for s in range(pp))]
    return layout, stages


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
    """A transport registers here (engine/kv_transfer/factory.py) and is built with
    `(config, engine_id, layout, block_size, dtype, rank, layers_per_rank)`: on the driver `engine_id` names
    this engine's staged KV; on a rank it is "worker"."""

    @abstractmethod
    def __init__(self, config: KVTransferConfig, engine_id: str, layout: KVLayout, block_size: int,
                 dtype: torch.dtype, rank: int = 0, layers_per_rank: list[int] | None = None) -> None: ...

    # --- scheduler side (the driver) ------------------------------------------------------------------

    @abstractmethod
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int:
        """Tokens of the request, after its `num_computed_tokens` local prefix-cache hit, whose KV can be
        loaded from elsewhere (never its last prompt token). No side effects."""

    @abstractmethod
    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_external_tokens: int) -> None:
        """The request got blocks for its external tokens: load them in the coming step."""

    @abstractmethod
    def build_connector_meta(self, requests: list[Request], num_scheduled_tokens: list[int],
                             block_ids: list[list[int]]) -> KVConnectorMetadata:
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

    @property
    @abstractmethod
    def num_held(self) -> int:
        """Finished requests whose blocks are held for a consumer."""

    @abstractmethod
    def holds(self, request_id: str) -> bool:
        """Whether a finished request of this id still holds its blocks for a consumer: a new request of the
        same id is refused meanwhile (it would share the held request's block table and staged KV)."""

    @abstractmethod
    def discard_held(self) -> None:
        """The engine stops: drop everything held for consumers that will not fetch it now."""

    # --- worker side (every rank) ---------------------------------------------------------------------

    @abstractmethod
    def start_load_kv(self, meta: KVConnectorMetadata, kv_caches: list[torch.Tensor]) -> None:
        """Start loading this step's KV into this rank's caches (one per local layer)."""

    def wait_for_layer_load(self, layer: int) -> None:  # noqa: B027 - optional hook, a no-op by default
        """Block until layer `layer`'s KV is loaded (a no-op for connectors that load synchronously)."""

    @abstractmethod
    def save_kv_layer(self, layer: int, kv_cache: torch.Tensor, meta: KVConnectorMetadata) -> None:
        """Save layer `layer`'s KV of this step's saves, once the layer has computed it."""

    def wait_for_save(self) -> None:  # noqa: B027 - optional hook, a no-op for connectors that save synchronously
        """Block until this step's saves are complete."""
