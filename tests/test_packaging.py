"""Our top-level packages must not shadow an installed distribution's: a dependency that imports one by
name would get ours (transformers 5.25 requires Hugging Face's `kernels`, which our old kernels/ hid)."""

from __future__ import annotations

import importlib.metadata
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_no_top_level_package_shadows_an_installed_distribution():
    include = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    ours = {pattern.rstrip("*") for pattern in include}
    assert ours == {"engine", "ops", "serve_app", "autoscale"}
    installed = importlib.metadata.packages_distributions()
    clashes = {name: installed[name] for name in ours if set(installed.get(name, ())) - {"pagedserve"}}
    assert not clashes, f"installed distributions ship top-level packages named like ours: {clashes}"
