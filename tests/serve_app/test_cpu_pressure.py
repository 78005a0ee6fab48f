"""CPU pressure (Linux PSI) as engine replicas read it to decide whether streams coalesce."""

from __future__ import annotations

from serve_app.cpu_pressure import CpuPressure, read_stall_us, stall_share

PSI = "some avg10=12.50 avg60=3.00 avg300=1.00 total={}\nfull avg10=0.00 avg60=0.00 avg300=0.00 total=0\n"


def test_stall_share_is_the_stalled_part_of_the_interval():
    assert stall_share((10.0, 1_000_000), (12.0, 2_000_000)) == 0.5
    assert stall_share((10.0, 0), (11.0, 3_000_000)) == 1.0  # clamped
    assert stall_share((10.0, 5), (10.0, 9)) == 0.0  # no time passed


def test_reads_the_some_line(tmp_path):
    path = tmp_path / "cpu"
    path.write_text(PSI.format(123456))
    assert read_stall_us(path) == 123456
    assert read_stall_us(tmp_path / "absent") is None
    (tmp_path / "garbled").write_text("nonsense\n")
    assert read_stall_us(tmp_path / "garbled") is None


def test_samples_the_first_readable_source(tmp_path):
    path = tmp_path / "cpu"
    path.write_text(PSI.format(0))
    pressure = CpuPressure(sources=(tmp_path / "absent", path))
    assert pressure.path == path and pressure.share is None  # one reading: no interval yet
    path.write_text(PSI.format(10**9))  # far more stall than wall time since: saturated
    assert pressure.sample() == 1.0


def test_without_psi_there_is_no_answer(tmp_path):
    pressure = CpuPressure(sources=(tmp_path / "absent",))
    assert pressure.path is None and pressure.sample() is None
