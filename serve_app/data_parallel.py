"""A data-parallel engine deployment (engine.data_parallel_size = D, MoE models): its D replicas are the DP
ranks of one group (engine/distributed/data_parallel.py), each an engine with its own scheduler and KV cache
whose MoE layers share their experts with the others every step. The prefix router chooses among the ranks
as among any replicas.

A rank assigner (a deployment of the app, as Ray Serve LLM's DPRankAssigner is) gives each starting replica its
rank and the address of its group's store, which it hosts. Ranks are handed out in generations of D: when a
generation is full, the next replica to ask opens a new one. A rank's death breaks its group (the other ranks'
collectives and wave connections fail, their engines die, Serve replaces every replica), and the replacements
fill the next generation: the group is replaced as a whole. Being a deployment, the assigner goes with its app
(a named detached actor outlived it); if it dies, Serve starts it again, and the group, whose store it hosted,
is replaced as after a rank's death.

The group scales as one unit or not at all, and here: not at all. Each rank's weights hold 1/D of the experts,
so a D+1-th replica would need every rank to reload; autoscaling_config is refused with data_parallel_size > 1."""

from __future__ import annotations

import ray
from ray import serve


@serve.deployment(name="DataParallelRankAssigner", num_replicas=1, ray_actor_options={"num_cpus": 0})
class DataParallelRankAssigner:
    def __init__(self, size: int) -> None:
        self.size = size
        self.assigned = size  # ranks handed out in the current generation: none open yet, the first ask opens one
        self.stores: list = []  # the generations' TCPStores; a live group's ranks keep using theirs

    async def assign(self, replica_id: str) -> tuple[int, str]:
        """(rank, the group's store address) for a starting replica."""
        if self.assigned == self.size:
            from engine.distributed.data_parallel import host_store  # torch: here only, not where the app is built

            store, address = host_store(ray.util.get_node_ip_address())
            self.stores = [*self.stores[-1:], (store, address)]  # the previous group may still be tearing down
            self.assigned = 0
        rank, self.assigned = self.assigned, self.assigned + 1
        return rank, self.stores[-1][1]
