"""Process groups and collectives of a multi-device engine (gloo on CPU, NCCL on GPU), and the
broadcast of each step's input from the driver to the other ranks."""

from engine.distributed.parallel_state import (
    GroupCoordinator,
    ParallelGroups,
    ParallelLayout,
    get_pp_group,
    get_tp_group,
    get_world_group,
    init_parallel_groups,
    parallel_groups,
    pp_layer_range,
)

__all__ = [
    "GroupCoordinator",
    "ParallelGroups",
    "ParallelLayout",
    "get_pp_group",
    "get_tp_group",
    "pp_layer_range",
    "get_world_group",
    "init_parallel_groups",
    "parallel_groups",
]
