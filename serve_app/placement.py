"""Whether a multi-rank replica's placement group can be placed on the cluster's nodes as they are: Serve
would otherwise keep such a replica pending forever. A pure check (first fit, bundles largest first) and
its thin Ray adapter."""

from __future__ import annotations

Resources = dict[str, float]


def placement_shortfall(bundles: list[Resources], strategy: str, nodes: list[Resources]) -> str | None:
    """Why `bundles` cannot be placed with `strategy` on nodes with these free-or-total resources; None if
    they can."""
    if strategy == "STRICT_PACK":
        need = _sum(bundles)
        if any(_fits(need, node) for node in nodes):
            return None
        return f"no node holds all {len(bundles)} bundles together ({_fmt(need)}; STRICT_PACK puts them on one node)"
    free = [dict(node) for node in nodes]
    used_nodes: set[int] = set()
    for i, bundle in sorted(enumerate(bundles), key=lambda ib: -sum(ib[1].values())):
        choice = next((n for n, node in enumerate(free)
                       if _fits(bundle, node) and not (strategy == "STRICT_SPREAD" and n in used_nodes)), None)
        if choice is None:
            where = "a node of its own" if strategy == "STRICT_SPREAD" else "any node"
            return f"bundle {i} ({_fmt(bundle)}) fits no {where} after the others are placed"
        used_nodes.add(choice)
        for key, amount in bundle.items():
            free[choice][key] = free[choice].get(key, 0.0) - amount
    return None


def check_placement(bundles: list[Resources], strategy: str) -> None:
    """Raise naming the fix when the running Ray cluster's alive nodes cannot hold the bundles."""
    import ray

    nodes = [node["Resources"] for node in ray.nodes() if node.get("Alive")]
    why = placement_shortfall(bundles, strategy, nodes)
    if why is not None:
        raise ValueError(
            f"placement_group_config: a replica of {len(bundles)} ranks cannot be placed on this cluster: {why}. "
            "Lower tensor_parallel_size / pipeline_parallel_size, change placement_group_config.bundle_per_worker "
            "or .strategy, or set placement_group_config.check_fits: false on a cluster that adds nodes on demand"
        )


def _sum(bundles: list[Resources]) -> Resources:
    total: Resources = {}
    for bundle in bundles:
        for key, amount in bundle.items():
            total[key] = total.get(key, 0.0) + amount
    return total


def _fits(need: Resources, node: Resources) -> bool:
    return all(node.get(key, 0.0) + 1e-9 >= amount for key, amount in need.items() if amount > 0)


def _fmt(resources: Resources) -> str:
    return ", ".join(f"{k}: {v:g}" for k, v in sorted(resources.items()))
