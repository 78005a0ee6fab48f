"""Where a rank sits in the engine's grid of ranks, and the collectives of its groups.

Ranks are laid out as vLLM lays them out: global rank = pp_rank * tp_size + tp_rank. A tensor-parallel
group is the ranks of one pipeline stage; a pipeline group is the ranks holding the same TP slot in every
stage. Groups are process-group objects of their own (gloo on CPU, NCCL on GPU) rendezvousing through
one TCPStore under the engine's unique prefix, never torch.distributed's global default group: several
engines (tests, replicas sharing a host) can live in one process and on one host.

Every tensor that crosses a group lives on the group's collective device (`collective_device`): NCCL moves
only CUDA tensors, of the rank's own GPU; gloo moves CPU ones. The rank's tensors already live there (a rank
on a GPU talks NCCL, a CPU rank gloo); the tensors a group makes itself (a barrier's, a reduced count's, a
receive's buffers) are made there.

Layers take their groups while they are built (`parallel_groups(...)` sets them for the duration) and
keep them; a single-rank engine builds under the default groups of one, whose collectives return their
input and touch nothing.

Data parallelism (MoE models, engine/distributed/data_parallel.py) adds two groups spanning the engines of
a data-parallel group, which meet at the group's own store: `ep`, every rank of every DP rank (index
dp_rank * tp_size + tp_rank; the experts are sharded over it and their partial outputs summed), and `dp`,
the ranks holding this rank's TP slot in each DP rank (the MoE layers gather the DP ranks' tokens over
it). Each step's token counts of the DP ranks are the forward's context (`data_parallel_step`)."""

from __future__ import annotations

import contextlib
import datetime
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class ParallelLayout:
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def output_rank(self) -> int:
        """The rank that gets full logits and samples: TP rank 0 of the last stage (vLLM's output rank)."""
        return (self.pipeline_parallel_size - 1) * self.tensor_parallel_size

    def tp_rank(self, rank: int) -> int:
        return rank % self.tensor_parallel_size

    def pp_rank(self, rank: int) -> int:
        return rank // self.tensor_parallel_size

    def tp_ranks(self, pp_rank: int) -> list[int]:
        tp = self.tensor_parallel_size
        return list(range(pp_rank * tp, (pp_rank + 1) * tp))

    def pp_ranks(self, tp_rank: int) -> list[int]:
        return [s * self.tensor_parallel_size + tp_rank for s in range(self.pipeline_parallel_size)]


def pp_layer_range(num_layers: int, pp_rank: int, pp_size: int) -> tuple[int, int]:
    """Layers [start, end) of a stage: an even split, the remainder on the first stages (the last one
    also holds the norm and the LM head)."""
    base, extra = divmod(num_layers, pp_size)
    start = pp_rank * base + min(pp_rank, extra)
    return start, start + base + (pp_rank < extra)


_CPU = torch.device("cpu")


def collective_backend(device: torch.device) -> str:
    """The backend a rank on `device` talks through: NCCL between GPUs, gloo between CPUs."""
    return "nccl" if device.type == "cuda" else "gloo"


def collective_device(backend: str, device: torch.device) -> torch.device:
    """Where a group's tensors must be for `backend`, from a member whose rank lives on `device`: NCCL
    takes CUDA tensors of the rank's own GPU only, gloo CPU tensors."""
    if backend == "nccl":
        if device.type != "cuda" or device.index is None:
            raise ValueError(f"nccl: a group member on {device} has no GPU of its own; NCCL moves CUDA tensors only")
        return device
    if backend == "gloo":
        return _CPU
    raise ValueError(f"backend: {backend!r} is neither nccl nor gloo")


class GroupCoordinator:
    """One process group seen from one member: its rank in the group and the collectives over it."""

    def __init__(self, ranks: list[int], global_rank: int, group: dist.ProcessGroup | None,
                 device: torch.device = _CPU) -> None:
        self.ranks = ranks
        self.global_rank = global_rank
        self.rank_in_group = ranks.index(global_rank)
        self.group = group  # None for a group of one: nothing to talk to
        self.device = device  # the collective device: every tensor that crosses the group lives there
        self.busy_s = 0.0  # time spent in this group's collectives and receives (benchmarks read it)
        # Point-to-point waits take it explicitly (gloo's receive would otherwise wait forever).
        self.timeout = datetime.timedelta(minutes=30)

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def is_first(self) -> bool:
        return self.rank_in_group == 0

    @property
    def is_last(self) -> bool:
        return self.rank_in_group == self.size - 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.group is not None:
            start = time.perf_counter()
            self.group.allreduce([x]).wait()
            self.busy_s += time.perf_counter() - start
        return x

    def all_reduce_min(self, value: int) -> int:
        if self.group is None:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        self.group.allreduce([t], _min_options()).wait()
        return int(t.item())

    def all_reduce_max(self, x: torch.Tensor) -> torch.Tensor:
        """Elementwise maximum over the group, in place (load-time: online quantization's row maxima)."""
        if self.group is not None:
            opts = dist.AllreduceOptions()
            opts.reduceOp = dist.ReduceOp.MAX
            self.group.allreduce([x], opts).wait()
        return x

    def all_gather_rows(self, x: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        """Every member's `x` ([sizes[i], ...] on member i) concatenated along dim 0; the collective moves
        each padded to the largest."""
        if self.group is None:
            return x
        start = time.perf_counter()
        most = max(sizes)
        if x.shape[0] < most:
            x = torch.cat([x, x.new_zeros(most - x.shape[0], *x.shape[1:])])
        parts = [torch.empty_like(x) for _ in self.ranks]
        self.group.allgather([parts], [x.contiguous()]).wait()
        self.busy_s += time.perf_counter() - start
        return torch.cat([part[:n] for part, n in zip(parts, sizes)])

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        if self.group is None:
            return x
        parts = [torch.empty_like(x) for _ in self.ranks]
        self.group.allgather([parts], [x.contiguous()]).wait()
        return torch.cat(parts, dim=dim)

    def gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor | None:
        """Every member's `x` concatenated along `dim` on the group's first rank; None elsewhere."""
        if self.group is None:
            return x
        opts = dist.GatherOptions()
        opts.rootRank = 0
        start = time.perf_counter()
        parts = [torch.empty_like(x) for _ in self.ranks] if self.is_first else None
        self.group.gather([parts] if parts is not None else [], [x.contiguous()], opts).wait()
        self.busy_s += time.perf_counter() - start
        return torch.cat(parts, dim=dim) if parts is not None else None

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        self.timeout = timeout
        if self.group is not None:
            self.group.set_timeout(timeout)

    def barrier(self) -> None:
        if self.group is not None:
            self.group.allreduce([torch.zeros(1, device=self.device)]).wait()

    def send(self, tensors: list[torch.Tensor], dst_in_group: int) -> list[dist.Work]:
        """Start sending; the caller waits on the returned works (with `self.timeout`) before reusing the
        tensors."""
        return [self.group.send([t.contiguous()], dst_in_group, i) for i, t in enumerate(tensors)]

    def recv(self, shapes: list[tuple[int, ...]], dtype: torch.dtype, src_in_group: int) -> list[torch.Tensor]:
        start = time.perf_counter()
        out = [torch.empty(shape, dtype=dtype, device=self.device) for shape in shapes]
        for i, t in enumerate(out):
            self.group.recv([t], src_in_group, i).wait(self.timeout)
        self.busy_s += time.perf_counter() - start
        return out


def _min_options() -> dist.AllreduceOptions:
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.MIN
    return opts


_SINGLE = GroupCoordinator([0], 0, None)


@dataclass
class ParallelGroups:
    world: GroupCoordinator
    tp: GroupCoordinator
    pp: GroupCoordinator
    # Data parallelism only (groups of one otherwise): the ranks of every DP rank, and this TP slot's in each.
    ep: GroupCoordinator = _SINGLE
    dp: GroupCoordinator = _SINGLE

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        for group in (self.world, self.tp, self.pp, self.ep, self.dp):
            group.set_timeout(timeout)


_current = ParallelGroups(_SINGLE, _SINGLE, _SINGLE)
_dp_num_tokens: list[int] | None = None  # the step's tokens on each DP rank, while a forward runs


def get_world_group() -> GroupCoordinator:
    return _current.world


def get_tp_group() -> GroupCoordinator:
    return _current.tp


def get_pp_group() -> GroupCoordinator:
    return _current.pp


def get_ep_group() -> GroupCoordinator:
    return _current.ep


def get_dp_group() -> GroupCoordinator:
    return _current.dp


def dp_num_tokens() -> list[int] | None:
    """The running step's token count on each DP rank, 0 for a rank running a one-token dummy step (None outside
    a data-parallel forward)."""
    return _dp_num_tokens


@contextlib.contextmanager
def data_parallel_step(num_tokens: list[int] | None) -> Iterator[None]:
    """Run a forward knowing every DP rank's token count in this step (what the MoE layers gather)."""
    global _dp_num_tokens
    previous, _dp_num_tokens = _dp_num_tokens, num_tokens
    try:
        yield
    finally:
        _dp_num_tokens = previous


@contextlib.contextmanager
def parallel_groups(groups: ParallelGroups) -> Iterator[None]:
    """Build layers under these groups (they keep the ones current when they were built)."""
    global _current
    previous, _current = _current, groups
    try:
        yield
    finally:
        _current = previous


def new_process_group(store: dist.Store, index: int, size: int, backend: str,
                      timeout: datetime.timedelta) -> dist.ProcessGroup:
    """A process group of `size` members meeting at `store`, this one the `index`-th."""
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, index, size, options)
    return dist.ProcessGroupGloo(store, index, size, timeout)


def _new_group(store: dist.Store, name: str, ranks: list[int], rank: int, device: torch.device,
               timeout: datetime.timedelta) -> GroupCoordinator:
    backend = collective_backend(device)
    group = None  # a group of one talks to nobody
    if len(ranks) > 1:
        group = new_process_group(dist.PrefixStore(name, store), ranks.index(rank), len(ranks), backend, timeout)
    return GroupCoordinator(ranks, rank, group, collective_device(backend, device))


@dataclass(frozen=True)
class DataParallelPlace:
    """Where an engine sits in its data-parallel group: its DP rank among `size`, and the group's store."""

    rank: int
    size: int
    store: dist.Store


def init_parallel_groups(layout: ParallelLayout, rank: int, store: dist.Store | None, device: torch.device,
                         timeout: datetime.timedelta, data_parallel: DataParallelPlace | None = None) -> ParallelGroups:
    """Create this rank's world, TP and PP groups, over the backend of the rank's `device` (NCCL for a
    GPU, gloo for the CPU); every rank of the engine calls this once, and each group connects only its
    own members (`store` may be None for an engine of one rank). With `data_parallel`, also the EP and DP
    groups at the data-parallel group's store (pipeline parallelism is refused with it)."""
    tp_rank, pp_rank = layout.tp_rank(rank), layout.pp_rank(rank)
    world = _new_group(store, "world", list(range(layout.world_size)), rank, device, timeout)
    tp = _new_group(store, f"tp{pp_rank}", layout.tp_ranks(pp_rank), rank, device, timeout)
    pp = _new_group(store, f"pp{tp_rank}", layout.pp_ranks(tp_rank), rank, device, timeout)
    groups = ParallelGroups(world, tp, pp)
    if data_parallel is not None and data_parallel.size > 1:
        dp_rank, tp_size = data_parallel.rank, layout.tensor_parallel_size
        groups.ep = _new_group(data_parallel.store, "ep", list(range(data_parallel.size * tp_size)),
                               dp_rank * tp_size + tp_rank, device, timeout)
        groups.dp = _new_group(data_parallel.store, f"dp{tp_rank}", list(range(data_parallel.size)), dp_rank, device,
                               timeout)
    return groups
