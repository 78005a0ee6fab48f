"""DirectCall modules: called straight into forward, and their submodules pinned as plain attributes once the
model is built; replacing, clearing or deleting a submodule afterwards is seen (no stale pinned copy)."""

from __future__ import annotations

import torch
from torch import nn

from engine.models.layers.direct_call import DirectCall, pin_submodules


class Block(DirectCall, nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)


def test_pinned_submodules_follow_replacement_clearing_and_deletion():
    model = nn.Sequential(Block())
    block = model[0]
    pin_submodules(model)
    assert block.__dict__["inner"] is block._modules["inner"]
    x = torch.randn(3, 2)
    torch.testing.assert_close(block(x), block._modules["inner"](x))

    replacement = nn.Linear(2, 2)
    block.inner = replacement  # as LoRA's wrappers are put in place
    assert block.inner is replacement and "inner" not in block.__dict__
    torch.testing.assert_close(block(x), replacement(x))

    block.inner = None
    assert block.inner is None
    pin_submodules(model)  # nothing to pin for a cleared submodule
    assert block.inner is None

    block.inner = replacement
    pin_submodules(model)
    del block.inner
    assert not hasattr(block, "inner") and "inner" not in block.__dict__
    assert [name for name, _ in model.named_modules()] == ["", "0"]  # pinning adds no modules of its own
