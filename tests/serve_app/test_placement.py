"""The placement check that refuses a multi-rank replica the cluster cannot hold (pure core)."""

from __future__ import annotations

from serve_app.placement import placement_shortfall

GPU_NODE = {"CPU": 16.0, "GPU": 4.0}


def test_strict_pack_needs_one_node_for_every_bundle():
    bundles = [{"GPU": 1, "CPU": 5}] + [{"GPU": 1, "CPU": 1}] * 3
    assert placement_shortfall(bundles, "STRICT_PACK", [GPU_NODE]) is None
    assert "no node holds all 4 bundles" in placement_shortfall(bundles, "STRICT_PACK", [{"CPU": 16, "GPU": 2}] * 2)


def test_pack_may_split_across_nodes():
    bundles = [{"GPU": 1, "CPU": 1}] * 4
    assert placement_shortfall(bundles, "PACK", [{"CPU": 8, "GPU": 2}] * 2) is None
    why = placement_shortfall(bundles, "PACK", [{"CPU": 8, "GPU": 2}, {"CPU": 8}])
    assert why is not None and "GPU: 1" in why


def test_strict_spread_needs_a_node_per_bundle():
    bundles = [{"CPU": 1}] * 3
    assert placement_shortfall(bundles, "STRICT_SPREAD", [{"CPU": 4}] * 3) is None
    assert "a node of its own" in placement_shortfall(bundles, "STRICT_SPREAD", [{"CPU": 4}] * 2)


def test_fractional_cpu_bundles_fit_a_small_host():
    assert placement_shortfall([{"CPU": 0.01}] * 4, "PACK", [{"CPU": 2.0}]) is None
