"""Modules that a decode step calls dozens of times: `module(x)` runs their forward directly.

nn.Module.__call__ passes through two frames and its hook checks before forward: at batch 1 that machinery
was ~20% of a step's Python outside the kernels (76 module calls a step for the 56M model), and between the
kernels, which stream the weights through every cache, each frame runs cold. Forward hooks are not run on
these modules; nothing in the engine registers any."""

from __future__ import annotations


class DirectCall:
    """Mix in before nn.Module: each subclass's __call__ is its own forward."""

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if "__call__" not in cls.__dict__:
            cls.__call__ = cls.forward
