"""Worker: one rank's part of the engine's model, its attention backend and its KV cache.

Every rank runs the same forward on the same ModelInput: its heads and MLP slice under tensor
parallelism, its layers under pipeline parallelism (receiving the previous stage's hidden states and
residual, sending its own on). Only the driver's worker, TP rank 0 of the last stage, returns logits.
`run_worker` is the whole life of a rank other than the driver's, in a process of its own (started by
the multiproc launcher, or a Ray actor of the serving app)."""

from __future__ import annotations

import datetime
import logging
import math
import os
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from engine.config import EngineConfig, resolve_max_num_batched_tokens
from engine.core.kv_cache_groups import KVCacheGroups
from engine.distributed import (
    DataParallelPlace,
    ParallelGroups,
    ParallelLayout,
    data_parallel_step,
    init_parallel_groups,
    parallel_groups,
)
from engine.distributed.data_parallel import connect_store
from engine.distributed.message_queue import MessageQueueReader
from engine.executor.model_input import ModelInput
from engine.kv_transfer.factory import create_kv_connector
from engine.lora.layers import LoRASlots
from engine.lora.peft import LoRAAdapter
from engine.model_spec import ModelSpec
from engine.models.layers.direct_call import pin_submodules
from engine.models.loader import build_model, weight_bytes
from engine.pooling.pooler import segment_sums
from ops.attention import get_attention_backend

logger = logging.getLogger(__name__)

_CPU_KV_CACHE_GB = 2.0
# Setting up waits for the slowest rank to load its weights (minutes for a large model from network
# storage); steps then run under the engine's step_timeout_s.
INIT_TIMEOUT = datetime.timedelta(minutes=30)


@dataclass(frozen=True)
class Rendezvous:
    """How the ranks of one engine find each other: a TCPStore (hosted by whoever launched the workers)
    and a name unique to the engine, prefixing every key and shared-memory file."""

    host: str
    port: int
    name: str
    layout: ParallelLayout
    timeout_s: float  # a step's collectives; a peer silent this long is dead
    driver_device_index: int = 0  # the driver's GPU among those its process sees (CUDA only; rank_device)
    node_id: str = ""  # the driver's node as the launcher names nodes: ranks on another read the step queue by TCP

    def connect(self) -> dist.Store:
        """The store, scoped to this engine's name."""
        store = dist.TCPStore(self.host, self.port, is_master=False, timeout=INIT_TIMEOUT)
        return dist.PrefixStore(self.name, store)


def rank_device(device_type: str, device_index: int) -> torch.device:
    """A rank's one device: the GPU its launcher gave it (`device_index` among the GPUs its process sees:
    the rank's number for the multiproc launcher, which puts every rank on one host; 0 for a Ray actor,
    which sees only its own GPU), or the CPU. Every tensor of the rank is made there."""
    return torch.device("cuda", device_index) if device_type == "cuda" else torch.device("cpu")


def start_rank(device: torch.device) -> None:
    """Make `device` the process's current GPU, once, as the rank starts: what NCCL and any tensor made
    on plain "cuda" (a library's) use; else GPU 0 for every rank of a host."""
    if device.type == "cuda":
        torch.cuda.set_device(device)


class Worker:
    def __init__(self, config: EngineConfig, spec: ModelSpec, device: torch.device,
                 groups: ParallelGroups | None = None) -> None:
        self.config, self.spec, self.device = config, spec, device
        self.threads = torch.get_num_threads()  # what the rank's process was given (threads_per_rank)
        small = config.small_step_threads
        self.small_step_threads = max(1, self.threads - 1) if small == "auto" else small
        self.groups = groups
        load_format = "safetensors" if config.load_format == "auto" else config.load_format
        if groups is None:
            self.model = build_model(spec.model_config, spec.path, load_format, spec.dtype, device, config.seed,
                                     config.max_num_seqs, spec.quant_config, config.task == "generate")
        else:
            with parallel_groups(groups):
                self.model = build_model(spec.model_config, spec.path, load_format, spec.dtype, device,
                                         config.seed, config.max_num_seqs, spec.quant_config, config.task == "generate")
        # Adapter slots: the model's projections wrapped, loaded through Executor.collective_rpc.
        self.lora = LoRASlots(self.model, config.max_loras, config.max_lora_rank, spec.dtype, device) \
            if config.enable_lora else None
        pin_submodules(self.model)
        # Whether the model may take a decode-only step's logits in one call (engine/models/llama.py's decode_logits)
        self._has_decode_logits = hasattr(self.model, "decode_logits")
        self.pp = groups.pp if groups is not None else None
        self.kv_connector = create_kv_connector(config, spec.model_config, spec.dtype, "worker",
                                                rank=groups.world.global_rank if groups is not None else 0)
        self.kv_groups = KVCacheGroups.of(spec.model_config)
        self.attn_backend = None
        self._sends: list = []  # in-flight sends to the next stage, with the tensors they read
        # With keep_hidden_states (the driver, under MTP speculation), the final hidden states of the last
        # step, every token's: what the MTP draft layer continues from (engine/spec_decode/mtp_proposer.py
        # takes them and clears this). Off otherwise: a long prefill's would stay held until the next step.
        self.keep_hidden_states = False
        self.hidden_states: torch.Tensor | None = None
        # A vision-language model's image embeddings by content hash, as the driver's EncoderCache decides.
        self.encoder_cache: dict[str, torch.Tensor] = {}
        self.encoder_seconds = 0.0  # in the vision encoder, since start (host time: exact on CPU)

    @property
    def weight_bytes(self) -> int:
        return weight_bytes(self.model)

    def kv_bytes_per_block(self) -> list[int]:
        """Bytes of one block of each KV cache group over this rank's layers of it (`_kv_block_shape`)."""
        per_group = [0] * len(self.kv_groups.windows)
        for attn in self.model.attention_layers:
            per_group[self.kv_groups.windows.index(attn.sliding_window)] += (
                math.prod(self._kv_block_shape(attn)) * self.spec.dtype.itemsize)
        return per_group

    def _kv_block_shape(self, attn) -> tuple[int, ...]:
        """One block of a layer's KV cache: K and V (the factor 2) of block_size tokens, num_kv_heads x head_dim
        each (the backends' NHD layout, ops/attention/backend.py); for latent attention (DeepSeek's MLA),
        block_size latents of latent_dim values: no K and V, no factor 2."""
        if getattr(attn, "latent_dim", None):
            return (self.config.block_size, attn.latent_dim)
        return (2, self.config.block_size, attn.num_kv_heads, attn.head_dim)

    def num_kv_blocks(self, extra_bytes_per_block: int = 0) -> int:
        """KV blocks this rank's budget holds (per rank: `kv_cache_memory_gb` is each rank's budget)."""
        config = self.config
        if config.num_kv_blocks is not None:
            return config.num_kv_blocks
        if config.kv_cache_memory_gb is not None:
            budget = config.kv_cache_memory_gb * 2**30
        elif self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            used = total - free
            budget = total * config.gpu_memory_utilization - used
            if budget <= 0:
                raise ValueError(
                    f"gpu_memory_utilization: {config.gpu_memory_utilization} leaves no room for the KV cache "
                    f"({used / 2**30:.1f} GiB already in use); raise it or set kv_cache_memory_gb"
                )
        else:
            budget = _CPU_KV_CACHE_GB * 2**30
        # No point holding more than every running request at full length could use.
        ceiling = config.max_num_seqs * -(-self.spec.max_model_len // config.block_size) + 1
        per_block = self.kv_bytes_per_block()
        per_block[0] += extra_bytes_per_block
        blocks = self.kv_groups.primary_blocks(budget, per_block, config.block_size, config.max_num_seqs,
                                               resolve_max_num_batched_tokens(config, self.spec.max_model_len))
        return min(blocks, ceiling)

    def init_kv_cache(self, num_blocks: int) -> None:
        layer = self.model.attention_layers[0]
        backend_cls = get_attention_backend(self.config.attention_backend, self.device.type)
        windows = tuple({a.sliding_window for a in self.model.attention_layers if a.sliding_window})
        if backend_cls.name == "flashinfer" and any(getattr(a, "sinks", None) is not None
                                                    for a in self.model.attention_layers):
            raise ValueError("attention_backend: flashinfer does not apply attention sinks (gpt-oss) yet; use "
                             "attention_backend='torch'")
        self.attn_backend = backend_cls(layer.num_heads, layer.num_kv_heads, layer.head_dim, self.config.block_size,
                                        num_blocks, self.spec.dtype, self.device, scale=layer.scale,
                                        sliding_windows=windows)
        config = self.config
        pool_sizes = self.kv_groups.pool_sizes(num_blocks, config.block_size, config.max_num_seqs,
                                               resolve_max_num_batched_tokens(config, self.spec.max_model_len))
        # Zeroed, not empty: padded gathers read unwritten slots, and garbage could hold NaNs. A layer's cache
        # holds its KV cache group's pool (engine/core/kv_cache_groups.py).
        for attn in self.model.attention_layers:
            size = pool_sizes[self.kv_groups.windows.index(attn.sliding_window)]
            attn.kv_cache = torch.zeros((size, *self._kv_block_shape(attn)), dtype=self.spec.dtype,
                                        device=self.device)

    @torch.inference_mode()
    def load_lora(self, slot: int, adapter: LoRAAdapter) -> None:
        """Load this rank's shard of an adapter into a slot (every rank runs it, through collective_rpc)."""
        self.lora.load(slot, adapter)

    @torch.inference_mode()
    def execute_model(self, inp: ModelInput) -> torch.Tensor | None:
        """Run this rank's part of the step; on the driver the logits of `inp.logit_rows`, or an embedder's
        pooled sums of `inp.pool_segments`; else None."""
        for work in self._sends:  # the previous step's hidden states must have left before new ones do
            work.wait(self.pp.timeout)
        self._sends = []
        dev = self.device
        self._set_threads(inp.num_tokens)
        if self._decodes_in_one_call(inp):
            tables, lens = (torch.from_numpy(a.astype(np.int32)) for a in (inp.block_tables, inp.seq_lens))
            ids, pos, slots = (torch.from_numpy(a) for a in (inp.input_ids, inp.positions, inp.slot_mapping))
            logits = self.model.decode_logits(ids, pos, tables, lens, slots, self.config.block_size)
            if logits is not None:
                return logits
        self.attn_backend.plan(inp.attention_metadata(dev, self.kv_groups.windows))
        meta = inp.kv_meta
        layers = self.model.attention_layers
        if meta is not None and meta.loads:  # loaded synchronously: every layer's before the forward
            self.kv_connector.start_load_kv(meta, [attn.kv_cache for attn in layers])
        if self.lora is not None:
            self.lora.set_step(inp.lora_slots)
        input_ids = torch.from_numpy(inp.input_ids).to(dev)
        positions = torch.from_numpy(inp.positions if inp.mrope_positions is None else inp.mrope_positions).to(dev)
        intermediate = inp.previous_hidden  # an MTP layer's (engine/models/deepseek_mtp.py)
        pp = self.pp
        if pp is not None and not pp.is_first:
            shape = (inp.num_tokens, self.spec.model_config.hidden_size)
            intermediate = tuple(pp.recv([shape, shape], self.spec.dtype, pp.rank_in_group - 1))
        if inp.mm_placements:
            out = self.model(input_ids, positions, self.attn_backend, intermediate, mm_embeds=self._image_embeds(inp))
        elif inp.dp_num_tokens is not None:  # the MoE layers gather every DP rank's tokens
            with data_parallel_step(inp.dp_num_tokens):
                out = self.model(input_ids, positions, self.attn_backend, intermediate)
        else:
            out = self.model(input_ids, positions, self.attn_backend, intermediate)
        last_stage = pp is None or pp.is_last
        if not last_stage:  # hidden states on their way to the next stage before anything else
            self._sends = pp.send(list(out), pp.rank_in_group + 1)
        if meta is not None and meta.saves:
            for i, attn in enumerate(layers):
                self.kv_connector.save_kv_layer(i, attn.kv_cache, meta)
            self.kv_connector.wait_for_save()
            if self.groups is not None:  # the driver reports the KV saved only once every rank has saved
                self.groups.world.barrier()
        if not last_stage:
            return None
        if self.keep_hidden_states:
            self.hidden_states = out
        if inp.pool_segments is not None:  # an embedder's step: its pooled rows, summed per request
            return segment_sums(out, inp.pool_segments)
        if not len(inp.logit_rows):
            return None
        return self.model.compute_logits(out[torch.from_numpy(inp.logit_rows).to(dev)])

    def _decodes_in_one_call(self, inp: ModelInput) -> bool:
        """Whether the model may take this step whole through decode_logits: every token decodes and samples, on
        the CPU kernels, with nothing around the plain forward (no other stage or DP rank, KV transfer, adapter,
        image, window group or kept hidden states)."""
        return (self._has_decode_logits and inp.logits_of_every_row and inp.num_decodes == inp.num_tokens
                and self.attn_backend.decodes_on_cpu_kernels and self.pp is None and inp.kv_meta is None
                and inp.previous_hidden is None and inp.lora_slots is None and not inp.mm_placements
                and inp.mrope_positions is None and inp.window_block_tables is None and inp.dp_num_tokens is None
                and inp.pool_segments is None and not self.keep_hidden_states)

    def _image_embeds(self, inp: ModelInput) -> tuple[torch.Tensor, torch.Tensor]:
        """(token rows, embeddings) of the step's image placeholders, encoding the images it brings first."""
        cache = self.encoder_cache
        for content_hash in inp.mm_evict or ():
            cache.pop(content_hash, None)
        if inp.mm_encode:
            start = time.perf_counter()
            cache.update(zip([image.content_hash for image in inp.mm_encode], self.model.embed_images(inp.mm_encode)))
            self.encoder_seconds += time.perf_counter() - start
        rows = torch.cat([torch.arange(row, row + count, device=self.device) for _, _, count, row in inp.mm_placements])
        values = torch.cat([cache[h][first : first + count] for h, first, count, _ in inp.mm_placements])
        return rows, values

    def _set_threads(self, num_tokens: int) -> None:
        """small_step_threads for small steps, the rank's threads otherwise (EngineConfig says why)."""
        small = self.small_step_threads
        if small is None or self.device.type != "cpu":
            return
        threads = small if num_tokens <= self.config.small_step_max_tokens else self.threads
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)


def threads_per_rank(config: EngineConfig, ranks_on_host: int) -> int:
    """`num_threads` is per rank; by default the host's cores are shared out among its ranks."""
    return config.num_threads or max(1, (os.cpu_count() or 1) // ranks_on_host)


def data_parallel_place(config: EngineConfig) -> DataParallelPlace | None:
    """Where an engine's ranks find the other DP ranks' (their EP and DP groups); None without data parallelism."""
    if config.data_parallel_size == 1:
        return None
    if config.data_parallel_master is None:
        raise ValueError(f"data_parallel_size: {config.data_parallel_size} engines are started together by the "
                         "offline LLM (or the serving app), which host their store; this engine was started alone")
    return DataParallelPlace(config.data_parallel_rank, config.data_parallel_size,
                             connect_store(config.data_parallel_master, INIT_TIMEOUT))


def init_rank(config: EngineConfig, spec: ModelSpec, rendezvous: Rendezvous, rank: int, device: torch.device,
              store: dist.Store, extra_bytes_per_block: int = 0) -> Worker:
    """Join the engine's groups, build this rank's part of the model and its KV cache. Every rank runs
    these collectives in this order: groups, then the KV block count (the smallest budget wins)."""
    start_rank(device)
    groups = init_parallel_groups(rendezvous.layout, rank, store, device, INIT_TIMEOUT, data_parallel_place(config))
    worker = Worker(config, spec, device, groups)
    store.set(f"weight_bytes/{rank}", str(worker.weight_bytes))
    num_blocks = groups.world.all_reduce_min(worker.num_kv_blocks(extra_bytes_per_block))
    if num_blocks < 2:
        raise ValueError("kv_cache_memory_gb: the budget holds less than 2 KV blocks on some rank; raise it")
    worker.init_kv_cache(num_blocks)
    groups.set_timeout(datetime.timedelta(seconds=rendezvous.timeout_s))
    return worker


def run_worker(config: EngineConfig, rendezvous: Rendezvous, rank: int, device_index: int, ranks_on_host: int,
               node_id: str | None = None) -> None:
    """The life of a non-driver rank: set up, then run every broadcast step until told to stop or the
    driver goes away. A failure is written to the store under `error/<rank>` for the driver to report.
    `node_id`: this rank's node as the launcher names nodes (None: the driver's)."""
    torch.set_num_threads(threads_per_rank(config, ranks_on_host))  # Ray gives thread-less actors one thread
    store = rendezvous.connect()
    try:
        spec = ModelSpec.resolve(config)
        worker = init_rank(config, spec, rendezvous, rank, rank_device(spec.device_type, device_index), store)
        queue = MessageQueueReader(store, step_queue_name(rendezvous), reader_index(rendezvous.layout, rank), node_id)
        while True:
            kind, payload = queue.dequeue()
            if kind == "stop":
                break
            if kind == "call":
                method, args = payload
                getattr(worker, method)(*args)
            else:
                worker.execute_model(payload)
    except EOFError:
        logger.info("rank %d: the driver is gone; exiting", rank)
    except BaseException as e:
        logger.exception("rank %d failed", rank)
        try:
            store.set(f"error/{rank}", f"{type(e).__name__}: {e}")
        except Exception:  # noqa: BLE001 - the store may be gone with the driver
            pass
        raise


def reader_index(layout: ParallelLayout, rank: int) -> int:
    """The step queue's readers are the ranks other than the driver, in rank order."""
    return rank if rank < layout.output_rank else rank - 1


def step_queue_name(rendezvous: Rendezvous) -> str:
    return f"{rendezvous.name}-step"  # also its shared-memory file's name: unique per engine


def rank_error(store: dist.Store | None, rendezvous: Rendezvous | None, rank: int) -> str | None:
    """The error a failed rank left in the store (launchers hold the store's master), if any."""
    key = f"{rendezvous.name}/error/{rank}" if rendezvous is not None else ""
    try:
        return store.get(key).decode() if store is not None and store.check([key]) else None
    except Exception:  # noqa: BLE001 - the store is closing
        return None
