"""The CPU utilization engine replicas read to decide whether streams coalesce (serve_app/cpu_utilization.py),
on fake cgroup and /proc trees."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from serve_app.cpu_utilization import CpuUtilization, cgroup_v1, cgroup_v2, proc_stat


def write(root: Path, rel: str, text: str) -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def v2(root: Path, usage_us: int, limit: str = "max 100000") -> None:
    write(root, "sys/fs/cgroup/cpu.stat", f"usage_usec {usage_us}\nuser_usec 0\nsystem_usec 0\n")
    write(root, "sys/fs/cgroup/cpu.max", limit + "\n")


def test_cgroup_v2_busy_time_and_limit(tmp_path):
    v2(tmp_path, 2_500_000)
    assert cgroup_v2(tmp_path, cpus=8) == (2.5, 8)  # no limit: every CPU of the affinity
    v2(tmp_path, 2_500_000, "150000 100000")
    assert cgroup_v2(tmp_path, cpus=8) == (2.5, 1.5)  # a limit of 1.5 CPUs
    assert cgroup_v2(tmp_path / "absent", cpus=8) is None


def test_cgroup_v1_busy_time_and_limit(tmp_path):
    write(tmp_path, "sys/fs/cgroup/cpuacct/cpuacct.usage", "3000000000\n")
    write(tmp_path, "sys/fs/cgroup/cpu/cpu.cfs_quota_us", "-1\n")
    write(tmp_path, "sys/fs/cgroup/cpu/cpu.cfs_period_us", "100000\n")
    assert cgroup_v1(tmp_path, cpus=4) == (3.0, 4)
    write(tmp_path, "sys/fs/cgroup/cpu/cpu.cfs_quota_us", "200000\n")
    assert cgroup_v1(tmp_path, cpus=4) == (3.0, 2.0)


def test_proc_stat_counts_every_cpu_of_the_machine(tmp_path):
    hz = os.sysconf("SC_CLK_TCK")
    # user nice system idle iowait irq softirq steal: idle and iowait are not busy, steal is
    write(tmp_path, "proc/stat",
          f"cpu  {hz} 0 {hz} {50 * hz} {hz} 0 0 {hz} 0 0\ncpu0 1 0 0 0\ncpu1 1 0 0 0\ncpu2 1 0 0 0\nintr 5\n")
    assert proc_stat(tmp_path, cpus=1) == (3.0, 3.0)
    write(tmp_path, "proc/stat", "garbled\n")
    assert proc_stat(tmp_path, cpus=1) is None


def test_share_is_the_busy_part_of_the_usable_cpus(tmp_path):
    v2(tmp_path, 0, "200000 100000")  # 2 CPUs usable
    cpu = CpuUtilization(root=tmp_path, cpus=4)
    assert cpu.source is cgroup_v2 and cpu.share is None  # one reading: no interval yet
    time.sleep(0.2)
    v2(tmp_path, 200_000, "200000 100000")  # 0.2 CPU-seconds in >= 0.2 s over 2 CPUs: at most half busy
    assert 0.0 < cpu.sample() <= 0.5 + 1e-9
    v2(tmp_path, 10**12, "200000 100000")  # far more busy time than wall time: clamped, saturated
    assert cpu.sample() == 1.0


def test_falls_back_in_order_and_without_any_source_has_no_answer(tmp_path):
    write(tmp_path, "proc/stat", "cpu  1 0 0 0 0 0 0 0\ncpu0 1 0 0 0\n")
    assert CpuUtilization(root=tmp_path, cpus=1).source is proc_stat
    empty = CpuUtilization(root=tmp_path / "nothing", cpus=1)
    assert empty.source is None and empty.sample() is None


@pytest.mark.skipif(not Path("/proc/stat").exists(), reason="not Linux")
def test_this_machine_has_a_source():
    assert CpuUtilization().source is not None
