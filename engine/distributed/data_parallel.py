"""Data parallelism's control plane: the engines (DP ranks) of a data-parallel group step in lockstep, for
their MoE layers' collectives over the EP group (engine/distributed/parallel_state.py), and sleep together.

- The group meets at a TCPStore hosted by whoever starts its engines (the offline LLM: `host_store`), named in
  `EngineConfig.data_parallel_master`. Each rank's drivers (TP rank 0 of each engine) join a gloo group of
  their own there ("control"), whatever the ranks' device: one small all-gather per step, on the CPU.
- Each turn of a rank's engine loop while the group is busy (a "wave", vLLM's word) runs `exchange`: every
  rank tells the others the tokens it will run this step and whether it holds unfinished requests. No tokens
  anywhere: nobody runs; some elsewhere but none here: this rank runs a one-token dummy step so that the
  collectives stay in step; no tokens and no requests anywhere: the wave ends, on every rank at once (they
  all saw the same numbers), and each goes idle.
- Idle ranks sleep in the kernel on their command pipe and their socket to the wave coordinator, a thread of
  DP rank 0 (`_WaveRelay`, a TCP server). A rank that gets work while idle sends "wave w" (w: the waves
  ended so far, the same on every rank) and starts it; the relay forwards it to every rank, and an idle
  rank whose count is w joins. A message for a wave already running or already ended is stale and dropped,
  so ranks that start the same wave at once do no harm. Nothing depends on one process seeing every
  request: each DP rank may have a frontend of its own (a Serve replica per rank).
- A rank that leaves closes its socket; the relay then closes every socket, so idle ranks learn at once that
  the group is broken; busy ones learn it from their collectives (a dead peer's gloo connections close; a hung
  one is caught by the step timeout)."""

from __future__ import annotations

import datetime
import logging
import select
import socket
import struct
import threading

import torch
import torch.distributed as dist

from engine.distributed.parallel_state import GroupCoordinator, new_process_group
from engine.errors import WorkerFailedError

logger = logging.getLogger(__name__)

_WAVE = struct.Struct("<q")
_LOOPBACK = ("127.0.0.1", "localhost", "::1")


def host_store(host: str = "127.0.0.1", timeout: datetime.timedelta = datetime.timedelta(minutes=30)
               ) -> tuple[dist.TCPStore, str]:
    """A store for a data-parallel group to meet at (its host keeps it alive), and its 'host:port'."""
    store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=timeout)
    return store, f"{host}:{store.port}"


def connect_store(address: str, timeout: datetime.timedelta) -> dist.TCPStore:
    host, port = address.rsplit(":", 1)
    return dist.TCPStore(host, int(port), is_master=False, timeout=timeout)


def _local_host(master_host: str) -> str:
    """The address of this host that the group's other hosts reach it at (on one host, the loopback)."""
    if master_host in _LOOPBACK:
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((master_host, 1))  # no packet is sent: only the route is looked up
        return probe.getsockname()[0]


class _WaveRelay:
    """DP rank 0's thread: accepts one connection per rank, then forwards each new wave number it receives to
    every rank (once per wave). When a rank's connection closes, it closes them all."""

    def __init__(self, host: str, num_ranks: int, accept_timeout_s: float) -> None:
        self.listener = socket.create_server((host, 0))
        self.address = f"{host}:{self.listener.getsockname()[1]}"
        self._stop_r, self._stop_w = socket.socketpair()
        self._thread = threading.Thread(target=self._run, args=(num_ranks, accept_timeout_s),
                                         name="pagedserve-dp-waves", daemon=True)
        self._thread.start()

    def _run(self, num_ranks: int, accept_timeout_s: float) -> None:
        conns: list[socket.socket] = []
        try:
            self.listener.settimeout(accept_timeout_s)
            while len(conns) < num_ranks:
                conn, _ = self.listener.accept()
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                conns.append(conn)
            last, buffers = -1, {conn: b"" for conn in conns}
            while True:
                ready, _, _ = select.select([*conns, self._stop_r], [], [])
                if self._stop_r in ready:
                    return
                for conn in ready:
                    data = conn.recv(4096)
                    if not data:
                        logger.info("a data-parallel rank left; closing the group's wave connections")
                        return
                    buffers[conn] += data
                    while len(buffers[conn]) >= _WAVE.size:
                        (wave,), buffers[conn] = _WAVE.unpack(buffers[conn][: _WAVE.size]), buffers[conn][_WAVE.size :]
                        if wave > last:
                            last = wave
                            for other in conns:
                                other.sendall(_WAVE.pack(wave))
        except OSError as e:
            logger.info("the data-parallel wave relay stops: %s", e)
        finally:
            for conn in conns:
                conn.close()
            self.listener.close()

    def close(self) -> None:
        try:
            self._stop_w.send(b"x")
        except OSError:
            pass
        self._thread.join(2.0)
        self._stop_r.close()
        self._stop_w.close()


class DataParallelControl:
    """A DP rank's side of the lockstep, on its driver: the per-step exchange and the waves (module docstring).
    Not thread-safe: the engine loop's thread drives it."""

    def __init__(self, address: str, rank: int, size: int, step_timeout_s: float,
                 init_timeout: datetime.timedelta) -> None:
        self.rank, self.size = rank, size
        self.wave = 0  # waves ended so far: the same number on every rank between steps
        self.in_wave = False
        self.relay: _WaveRelay | None = None
        self.sock: socket.socket | None = None
        self._buffer = b""
        store = connect_store(address, init_timeout)
        try:
            group = new_process_group(dist.PrefixStore("control", store), rank, size, "gloo", init_timeout)
            self.group = GroupCoordinator(list(range(size)), rank, group)
            self.group.set_timeout(datetime.timedelta(seconds=step_timeout_s))
            if rank == 0:
                self.relay = _WaveRelay(_local_host(address.rsplit(":", 1)[0]), size, init_timeout.total_seconds())
                store.set("waves", self.relay.address)
            host, port = store.get("waves").decode().rsplit(":", 1)
            self.sock = socket.create_connection((host, int(port)), timeout=init_timeout.total_seconds())
            self.sock.settimeout(None)
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except BaseException:
            self.close()
            raise

    def wait_sources(self) -> list[socket.socket]:
        """What an idle engine loop waits on besides its commands: a wave starting elsewhere."""
        return [self.sock]

    def poll(self) -> None:
        """Take the wave messages that arrived (without blocking): joins a wave another rank started. Raises
        WorkerFailedError when the group is broken (a rank left)."""
        while True:
            try:
                data = self.sock.recv(4096, socket.MSG_DONTWAIT)
            except BlockingIOError:
                return
            except OSError as e:
                raise self._broken(e) from e
            if not data:
                raise self._broken(None)
            self._buffer += data
            while len(self._buffer) >= _WAVE.size:
                (wave,), self._buffer = _WAVE.unpack(self._buffer[: _WAVE.size]), self._buffer[_WAVE.size :]
                if wave == self.wave and not self.in_wave:
                    self.in_wave = True

    def start(self) -> None:
        """This rank has work: start a wave unless one is running (every other rank joins it)."""
        if self.in_wave:
            return
        try:
            self.sock.sendall(_WAVE.pack(self.wave))
        except OSError as e:
            raise self._broken(e) from e
        self.in_wave = True

    def exchange(self, num_tokens: int, unfinished: bool) -> list[int]:
        """Every rank's tokens of this step, in rank order (all ranks call this once per turn of a wave). When
        no rank has tokens or unfinished requests, the wave ends here, on every rank."""
        mine = torch.tensor([num_tokens, int(unfinished)], dtype=torch.int64, device="cpu")  # a gloo group
        every = self.group.all_gather(mine, dim=0).view(self.size, 2)
        counts = every[:, 0].tolist()
        if not any(counts) and not bool(every[:, 1].any()):
            self.wave += 1
            self.in_wave = False
        return counts

    def _broken(self, error: BaseException | None) -> WorkerFailedError:
        why = f": {error}" if error is not None else ""
        return WorkerFailedError(f"the data-parallel group is broken: another DP rank left or died (DP rank "
                                 f"{self.rank} lost its wave connection{why})")

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None
        if self.relay is not None:
            self.relay.close()
            self.relay = None
