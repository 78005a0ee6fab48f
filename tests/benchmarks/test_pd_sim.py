"""Disaggregated prefill/decode in the cluster simulator: the KV-transfer arithmetic, the selective decision,
and tiny P/D runs whose timing can be worked out by hand."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest

from benchmarks.cluster_sim.fit import GPU_8B
from benchmarks.cluster_sim.pd import Fabric, PDConfig, simulate_pd, summarize_pd
from benchmarks.cluster_sim.replica import ReplicaConfig
from benchmarks.cluster_sim.workloads import SimRequest, Workload, chat_and_long, io_mix
from serve_app.disaggregation.policy import KVLink, itl_safe_prompt_tokens, kv_bytes_per_token, should_disaggregate

REPLICA = ReplicaConfig(num_kv_blocks=2048, max_num_seqs=64, max_num_batched_tokens=512)
PREFILL = ReplicaConfig(num_kv_blocks=2048, max_num_seqs=64, max_num_batched_tokens=2048)
KV = kv_bytes_per_token(32, 8, 128, 2)
LINK = KVLink(100.0, latency_s=0.002)


def pd(mode: str, p: int, d: int, threshold: int = 0, **kw) -> PDConfig:
    return PDConfig(mode, p, d, threshold, PREFILL, REPLICA, LINK, KV, **kw)


def timeline(outcome) -> list[tuple]:
    return sorted((t.sim.request_id, t.decode_replica, tuple(t.token_times), t.finished) for t in outcome.traces)


# --- transfer model and decision ------------------------------------------------------------------------

def test_the_decision_module_is_a_pure_core_without_ray():
    code = "import sys, serve_app.disaggregation.policy; sys.exit('ray' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


def test_kv_bytes_per_token_from_the_model_shape():
    assert kv_bytes_per_token(32, 8, 128, 2) == 128 * 1024  # Llama-3.1-8B, bf16
    assert kv_bytes_per_token(24, 2, 64, 2) == 12 * 1024  # Qwen2.5-0.5B
    assert kv_bytes_per_token(80, 8, 128, 2, tp=4) == 320 * 1024 // 4  # Llama-70B, per rank at TP 4


def test_a_lone_transfer_takes_bytes_over_bandwidth_plus_the_latency():
    # reference/scale_out.md B8: a 4k-token 8B prompt is 512 MiB, ~43 ms at 100 Gbit/s, ~0.43 s at 10.
    assert LINK.transfer_time_s(4096, KV) == pytest.approx(512 * 2**20 * 8 / 100e9 + 0.002)
    assert KVLink(10.0, 0.0).transfer_time_s(4096, KV) == pytest.approx(0.429, abs=1e-3)


def test_transfers_share_a_nic_fairly_and_leave_other_nics_alone():
    fabric = Fabric(bandwidth_bytes_s=100.0)
    fabric.add(0.0, "a", 100.0, ("p0/send", "d0/recv"))
    fabric.add(0.0, "b", 100.0, ("p1/send", "d0/recv"))  # the same decode NIC: half each
    fabric.add(0.0, "c", 100.0, ("p1/send", "d1/recv"))  # shares p1 with b, which d0 already holds to 50
    rates = {k: f.rate for k, f in fabric.flows.items()}
    assert rates == {"a": 50.0, "b": 50.0, "c": 50.0}
    assert fabric.next_done() == (2.0, "a")
    fabric.remove(2.0, "a")
    fabric.remove(2.0, "b")  # both finished together
    assert fabric.flows["c"].rate == 100.0 and fabric.next_done() == (2.0, "c")  # c too: 100 bytes at 50/s


def test_the_decision_is_a_threshold_on_uncached_tokens():
    assert should_disaggregate(512, 512) and not should_disaggregate(511, 512)
    assert should_disaggregate(0, 0)  # threshold 0: always P/D


def test_itl_safe_threshold_keeps_exactly_the_prompts_a_full_decode_step_absorbs():
    t = itl_safe_prompt_tokens(0.050, GPU_8B.alpha, GPU_8B.beta, GPU_8B.gamma, 256)
    assert t == 195
    assert GPU_8B.step_time(t - 1, 256) <= 0.050 < GPU_8B.step_time(t, 256)
    assert itl_safe_prompt_tokens(0.020, GPU_8B.alpha, GPU_8B.beta, GPU_8B.gamma, 256) == 0  # decode alone misses


# --- the simulation -------------------------------------------------------------------------------------

def lone(prompt_len: int, output_len: int, at: float = 0.0, rid: str = "x", group: str = "g") -> SimRequest:
    return SimRequest(rid, at, group, list(range(3, 3 + prompt_len)), list(range(100, 100 + output_len)))


def test_a_lone_request_pays_prefill_transfer_and_the_recomputed_token():
    n = 1000
    out = simulate_pd(Workload("one", [lone(n, 8)], "", 0), GPU_8B, pd("always", 1, 1))
    (t,) = out.traces
    prefill = GPU_8B.step_time(n, 0)  # one step on the prefill replica (n <= its budget)
    wire = n * KV * 8 / 100e9
    recompute = GPU_8B.step_time(1, 0)  # the last prompt token, on the decode replica
    assert t.prefill_done == pytest.approx(prefill)
    assert t.wire_done - t.transfer_start == pytest.approx(wire) and t.transfer_tokens == n
    assert t.kv_ready - t.wire_done == pytest.approx(0.002)
    assert t.ttft == pytest.approx(prefill + wire + 0.002 + recompute)
    assert t.gaps() == pytest.approx([GPU_8B.step_time(0, 1)] * 7)  # then plain decode steps


@pytest.mark.parametrize("mode,p,d", [("colocated", 0, 3), ("always", 1, 2), ("selective", 2, 2)])
def test_every_request_finishes_with_all_its_tokens_and_transfers_accounted(mode, p, d):
    wl = io_mix(0, rate=8.0, duration_s=6.0, input_len=600, output_len=24)
    out = simulate_pd(wl, GPU_8B, pd(mode, p, d, threshold=300))
    assert len(out.traces) == len(wl.requests) > 30
    for t in out.traces:
        assert t.finished is not None and len(t.token_times) == len(t.sim.output)
        assert t.disaggregated == (mode != "colocated")
        if t.disaggregated:
            assert t.arrival < t.prefill_done <= t.blocks_reserved == t.transfer_start < t.wire_done
            assert t.wire_done - t.transfer_start >= LINK.wire_time_s(t.transfer_tokens * KV) - 1e-12
            assert t.kv_ready == pytest.approx(t.wire_done + LINK.latency_s) and t.kv_ready < t.first_token
    for r in out.prefill + out.decode:  # nothing left behind: every block back in the free queue
        assert r.pool.get_num_free_blocks() == r.config.num_kv_blocks and r.num_in_flight == 0


def test_selective_at_threshold_0_is_always_and_at_a_huge_threshold_is_colocated_on_the_decode_pool():
    wl = io_mix(1, rate=6.0, duration_s=5.0, input_len=300, output_len=16)
    assert timeline(simulate_pd(wl, GPU_8B, pd("selective", 1, 2, 0))) == timeline(
        simulate_pd(wl, GPU_8B, pd("always", 1, 2)))
    local = simulate_pd(wl, GPU_8B, pd("selective", 1, 2, 10**9))
    assert timeline(local) == timeline(simulate_pd(wl, GPU_8B, pd("colocated", 0, 2)))
    assert local.prefill[0].num_steps == 0


def test_selective_sends_only_long_prompts_and_spares_short_streams_their_chunks():
    wl = chat_and_long(0, chat_rate=4.0, long_rate=1.0, duration_s=8.0)
    colocated = simulate_pd(wl, GPU_8B, pd("colocated", 0, 2))
    selective = simulate_pd(wl, GPU_8B, pd("selective", 1, 1, threshold=512))
    assert {t.sim.group for t in selective.traces if t.disaggregated} == {"long"}
    assert all(t.disaggregated for t in selective.traces if t.sim.group == "long")
    # Colocated, a 1,500-token prompt runs in 512-token chunks beside the chat streams: some of their gaps
    # are full chunk steps. With the long prompts on the prefill replica, no decode step is that long.
    chunk_step = GPU_8B.step_time(512, 0)
    worst = lambda out: max(g for t in out.traces if t.sim.group == "chat" for g in t.gaps())  # noqa: E731
    assert worst(colocated) >= chunk_step > worst(selective)


def test_pulls_wait_for_decode_blocks_and_still_finish():
    small = ReplicaConfig(num_kv_blocks=160, max_num_seqs=64, max_num_batched_tokens=512)  # 2,560 tokens
    wl = Workload("burst", [lone(1000, 40, at=0.001 * i, rid=f"r{i}") for i in range(4)], "", 0)
    out = simulate_pd(wl, GPU_8B, PDConfig("always", 2, 1, 0, PREFILL, small, LINK, KV))
    assert all(t.finished is not None for t in out.traces)
    assert any(t.blocks_reserved > t.prefill_done for t in out.traces)  # waited for another request's blocks
    r = summarize_pd(out, window_s=1.0)
    assert r.finished == r.requests == 4 and r.disaggregated == 4 and not math.isnan(r.transfer_p50)
