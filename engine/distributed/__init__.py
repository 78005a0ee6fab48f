"""Process groups and collectives of a multi-device engine (gloo on CPU, NCCL on GPU), the broadcast of
each step's input from the driver to the other ranks, and the lockstep of a data-parallel group's engines
(data_parallel.py)."""

from engine.distributed.parallel_state import (
    DataParallelPlace,
    GroupCoordinator,
    ParallelGroups,
    ParallelLayout,
    data_parallel_step,
    dp_num_tokens,
    get_dp_group,
    get_ep_group,
    get_pp_group,
    get_tp_group,
    get_world_group,
    init_parallel_groups,
    parallel_groups,
    pp_layer_range,
)

__all__ = [
    "DataParallelPlace",
    "GroupCoordinator",
    "ParallelGroups",
    "ParallelLayout",
    "data_parallel_step",
    "dp_num_tokens",
    "get_dp_group",
    "get_ep_group",
    "get_pp_group",
    "get_tp_group",
    "pp_layer_range",
    "get_world_group",
    "init_parallel_groups",
    "parallel_groups",
]
