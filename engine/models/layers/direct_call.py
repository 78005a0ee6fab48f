"""Modules that a decode step calls dozens of times: `module(x)` runs their forward directly, and their
submodules are plain attributes once the model is built.

nn.Module.__call__ passes through two frames and its hook checks before forward: at batch 1 that machinery
was ~20% of a step's Python outside the kernels (76 module calls a step for the 56M model), and between the
kernels, which stream the weights through every cache, each frame runs cold. Forward hooks are not run on
these modules; nothing in the engine registers any.

`self.qkv_proj` on an nn.Module misses the instance dict and falls through to nn.Module.__getattr__, which looks
in _modules: ~100 such lookups a decode step on the 56M model, ~7% of its Python outside the kernels.
`pin_submodules` copies each one's submodules into its instance dict, where lookup finds them first; replacing
or deleting one afterwards (LoRA's wrappers replace projections) drops the copy, so lookups stay right."""

from __future__ import annotations

from torch import nn


class DirectCall:
    """Mix in before nn.Module: each subclass's __call__ is its own forward."""

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if "__call__" not in cls.__dict__:
            cls.__call__ = cls.forward

    def __setattr__(self, name: str, value) -> None:
        _unpin(self, name)
        super().__setattr__(name, value)

    def __delattr__(self, name: str) -> None:
        _unpin(self, name)
        super().__delattr__(name)


def _unpin(module: DirectCall, name: str) -> None:
    modules = module.__dict__.get("_modules")  # absent while nn.Module.__init__ runs
    if modules is not None and name in modules:
        module.__dict__.pop(name, None)


def pin_submodules(model: nn.Module) -> None:
    """Each DirectCall module's submodules into its instance dict (call once the model is built and wrapped)."""
    for module in model.modules():
        if isinstance(module, DirectCall):
            module.__dict__.update((name, child) for name, child in module._modules.items() if child is not None)
