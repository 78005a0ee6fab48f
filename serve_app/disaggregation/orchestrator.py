"""The decode replica's side of disaggregated prefill/decode (decode-as-orchestrator, as Ray Serve LLM
2.60 does it): for each request, ask the prefix router which prefill replica it would use and how much of
the prompt that replica caches; below `min_uncached_prompt_tokens` uncached tokens prefill here (policy.py);
otherwise have that replica prefill it, fetch its KV (transfer.py) and hand the engine kv_transfer_params.

The prefill runs under an id of its own (the client's `request_id` names the request in responses and
logs, but a client may reuse it while the KV of its last use is still held on the prefill side), and with
the request's LoRA adapter: the prefill engine computes the KV the decode engine will decode with, and
stamps the adapter's weight digest on it, which the decode engine checks before loading it.

Any failure on the way (the prefill replica died, the lease ran out before the fetch, the transfer
failed or timed out) either falls back to prefilling here (`on_transfer_failure: recompute`) or fails the
request with a 503 (`fail`); nothing waits longer than `transfer_timeout_s` per hop. The staged copy
written here is deleted on every path but the one that hands it to the engine."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, field, replace

import ray
from ray import serve
from ray.exceptions import RayError
from ray.serve._private.constants import SERVE_NAMESPACE
from ray.serve.exceptions import RayServeException

from engine.core.prepared_request import PreparedRequest
from engine.sampling_params import SamplingParams
from engine.shm_files import owned_prefix
from serve_app import tracing
from serve_app.disaggregation.policy import should_disaggregate
from serve_app.disaggregation.transfer import (
    KVFetchRequest,
    PrefillResult,
    discard_staged,
    write_staged,
)
from serve_app.errors import APIError

logger = logging.getLogger(__name__)


@dataclass
class PDSettings:
    min_uncached_prompt_tokens: int
    on_transfer_failure: str  # "recompute" | "fail"
    transfer_timeout_s: float
    block_size: int
    staging_dir: str
    prefill_deployment: str = "PrefillServer"
    # Test hooks (LLMServer.set_pd_faults): faults are injected here, never by racing a kill. "pause_in_write_s"
    # holds the write of the fetched KV (in its thread), for a caller to go away meanwhile.
    faults: dict = field(default_factory=dict)


@dataclass
class RemoteKV:
    """What the decode engine gets for a request prefilled elsewhere."""

    kv_transfer_params: dict
    cached_tokens: int  # the prefill side's prefix-cache hit: what the client's usage reports


class TransferFailed(Exception):
    pass


class PrefillOrchestrator:
    def __init__(self, prefill_handle, settings: PDSettings, metrics) -> None:
        self.prefill = prefill_handle.options(method_name="prefill")
        self.fetch = prefill_handle.options(method_name="fetch_kv")
        self.release = prefill_handle.options(method_name="release_kv")
        self.settings, self.metrics = settings, metrics

    async def remote_kv(self, request: PreparedRequest) -> RemoteKV | None:
        """Prefill the request on the prefill pool and bring its KV here; None: prefill it locally."""
        s = self.settings
        if request.sampling_params.prompt_logprobs is not None:  # needs every prompt position's logits here
            self.metrics.local_prefill("ineligible")
            return None
        prefill = replace(request, request_id=f"{request.request_id}-prefill-{uuid.uuid4().hex}",
                          sampling_params=SamplingParams(max_tokens=1, temperature=0.0), routed_matched_blocks={})
        result = None
        try:
            with tracing.span("prefill", **{"pagedserve.prefill.prompt_tokens": len(request.prompt_token_ids)}) as span:
                async with self.prefill.choose_replica(prefill) as selection:
                    replica = _replica_id(selection)
                    matched = prefill.routed_matched_blocks.get(replica, 0)
                    uncached = len(request.prompt_token_ids) - matched * s.block_size
                    if span is not None:
                        span.set_attributes({"pagedserve.prefill.replica": replica,
                                             "pagedserve.prefill.uncached_tokens": uncached})
                    if not should_disaggregate(uncached, s.min_uncached_prompt_tokens):
                        self.metrics.local_prefill("short_prompt")
                        return None
                    result = await asyncio.wait_for(self.prefill.dispatch(selection, prefill), s.transfer_timeout_s)
            remote = await self._fetch(result)
        except asyncio.CancelledError:
            if result is not None:  # the caller went away: the prefill side need not hold the KV any longer
                self.release.remote(KVFetchRequest(result.replica_id, result.request_id))
            raise
        except (TimeoutError, RayError, RayServeException, TransferFailed, OSError) as e:
            return self._failed(request, e, result)
        self.metrics.remote_prefill()
        return remote

    async def _fetch(self, result: PrefillResult) -> RemoteKV:
        s, params = self.settings, result.kv_transfer_params
        pause = s.faults.get("pause_before_fetch_s")
        if pause:
            await asyncio.sleep(pause)
        if s.faults.get("fail_transfer"):
            raise TransferFailed("injected transfer failure")
        if not self._alive(result.replica_id):  # a fetch pinned to a dead replica would wait for nothing
            raise TransferFailed(f"prefill replica {result.replica_id} is gone")
        start = time.monotonic()
        with tracing.span("kv_transfer", **{"pagedserve.kv_transfer.tokens": params["num_tokens"]}) as span:
            fetched = await asyncio.wait_for(self.fetch.remote(KVFetchRequest(result.replica_id, result.request_id)),
                                             s.transfer_timeout_s)
            arrays = await asyncio.wait_for(asyncio.gather(*fetched.refs), s.transfer_timeout_s)
            name = owned_prefix("rx") + uuid.uuid4().hex
            await self._write(arrays, name)
            del arrays, fetched.refs  # the object store may drop its copy now
            seconds = time.monotonic() - start
            if span is not None:
                span.set_attributes({"pagedserve.kv_transfer.bytes": fetched.num_bytes,
                                     "pagedserve.kv_transfer.seconds": seconds,
                                     "pagedserve.kv_transfer.put_seconds": fetched.put_s})
        self.metrics.transfer(fetched.num_bytes, seconds)
        return RemoteKV({**params, "name": name}, int(params.get("cached_tokens", 0)))

    async def _write(self, arrays: list, name: str) -> None:
        """The fetched KV as staged files here. A caller that goes away cannot stop the writing thread: what
        it writes is deleted once it is done."""
        s = self.settings
        write = asyncio.get_running_loop().run_in_executor(None, _write_staged, arrays, name, s.staging_dir,
                                                           s.faults.get("pause_in_write_s", 0.0))
        try:
            await asyncio.shield(write)
        except asyncio.CancelledError:
            write.add_done_callback(lambda _: discard_staged(name, len(arrays), s.staging_dir))
            raise

    def _failed(self, request: PreparedRequest, error: BaseException, result: PrefillResult | None) -> None:
        if result is not None:
            self.release.remote(KVFetchRequest(result.replica_id, result.request_id))
        why = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
        logger.warning("request %s: remote prefill %sfailed (%s)", request.request_id,
                       f"{result.request_id} " if result is not None else "", why)
        if self.settings.faults.get("on_transfer_failure", self.settings.on_transfer_failure) == "fail":
            raise APIError(503, f"the remote prefill of this request failed ({why}); retry",
                           code="kv_transfer_failed", retry_after_s=1)
        self.metrics.local_prefill("fallback")
        return None

    def _alive(self, replica_id: str) -> bool:
        try:
            context = serve.get_replica_context()
            name = f"SERVE_REPLICA::{context.app_name}#{self.settings.prefill_deployment}#{replica_id}"
            ray.get_actor(name, namespace=SERVE_NAMESPACE)
            return True
        except ValueError:  # no such actor: it died
            return False
        except RayServeException:  # not in a replica (tests building the class): cannot tell
            return True

    def discard(self, remote: RemoteKV) -> None:
        """Staged KV the engine never loaded (the request ended before it was admitted)."""
        params = remote.kv_transfer_params
        discard_staged(params["name"], params["num_ranks"], self.settings.staging_dir)


def _write_staged(arrays: list, name: str, directory: str, pause_s: float) -> None:
    if pause_s:  # a test's fault (PDSettings.faults)
        time.sleep(pause_s)
    write_staged(arrays, name, directory)


def _replica_id(selection) -> str:
    rid = selection.replica_id
    return getattr(rid, "unique_id", rid)
