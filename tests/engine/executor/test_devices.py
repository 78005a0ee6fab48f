"""Each rank has one device, and every tensor of the rank lives there: the GPU its launcher gave it, or the
CPU. A process group's collectives run on the group's device: NCCL moves only CUDA tensors of the rank's
own GPU, gloo CPU ones. No GPU here: the two rules are pure functions tested as such, and the code of a
rank's step is read for tensors made without naming their device (on a GPU such a tensor lands on the CPU,
or on GPU 0 for every rank of a host). benchmarks/gpu_check.sh runs the collectives on a GPU."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from engine.distributed.parallel_state import collective_backend, collective_device
from engine.executor.worker import rank_device

ROOT = Path(__file__).resolve().parents[3]
# The code a rank runs outside the model's layers (which are built under their device), from its groups'
# collectives to sampling.
RANK_CODE = sorted([*(ROOT / "engine" / "distributed").glob("*.py"), *(ROOT / "engine" / "executor").glob("*.py"),
                    *(ROOT / "engine" / "sample").glob("*.py"), ROOT / "engine" / "core" / "batch_builder.py",
                    *(ROOT / "engine" / "spec_decode").glob("*.py")])
# torch functions that make a tensor (or a generator) on the default device unless told which.
FACTORIES = {"tensor", "zeros", "ones", "empty", "full", "arange", "rand", "randn", "randint", "randperm", "eye",
             "linspace", "Generator"}


def test_collective_device_follows_the_backend():
    gpu1 = torch.device("cuda", 1)
    assert collective_backend(gpu1) == "nccl" and collective_backend(torch.device("cpu")) == "gloo"
    assert collective_device("nccl", gpu1) == gpu1  # the rank's own GPU, not GPU 0
    assert collective_device("gloo", torch.device("cpu")) == torch.device("cpu")
    assert collective_device("gloo", gpu1) == torch.device("cpu")  # gloo moves CPU tensors, whoever asks
    for device in (torch.device("cpu"), torch.device("cuda")):  # no GPU, or no GPU of its own
        with pytest.raises(ValueError, match="nccl"):
            collective_device("nccl", device)
    with pytest.raises(ValueError, match="backend"):
        collective_device("mpi", torch.device("cpu"))


def test_rank_device_is_the_gpu_its_launcher_gave_it():
    assert rank_device("cuda", 3) == torch.device("cuda", 3)
    assert rank_device("cuda", 0) == torch.device("cuda", 0)  # a Ray actor sees its one GPU as 0
    assert rank_device("cpu", 3) == torch.device("cpu")


def _undevised_factories(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in FACTORIES
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "torch"):
            continue
        named = any(k.arg == "device" for k in node.keywords) or (node.func.attr == "Generator" and node.args)
        if not named:
            found.append(f"{path.relative_to(ROOT)}:{node.lineno} torch.{node.func.attr}")
    return found


def _bare_cuda_devices(path: Path) -> list[str]:
    """torch.device("cuda") without an index: GPU 0, or whichever the process last made current."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "device"
                and len(node.args) == 1 and isinstance(node.args[0], ast.Constant) and node.args[0].value == "cuda"):
            found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return found


def test_rank_code_makes_every_tensor_on_a_named_device():
    assert RANK_CODE
    assert [f for path in RANK_CODE for f in _undevised_factories(path)] == []
    assert [f for path in sorted((ROOT / "engine").rglob("*.py")) for f in _bare_cuda_devices(path)] == []

