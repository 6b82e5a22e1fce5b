"""Random-weight HF fixtures of make_model's tiny preset, by recipe name, for a test
module's fixtures."""
from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from llmd_tools.make_model import build_model


def tiny_models(root: Path, recipes: Mapping[str, Mapping[str, Any]], prefix: str = "") -> Callable[[str], Path]:
    """name -> the HF directory of `recipes[name]` (its `arch` and make_model overrides),
    built once into `root` (as `prefix` + name)."""
    @functools.cache
    def get(name: str) -> Path:
        recipe = dict(recipes[name])
        return build_model(root / f"{prefix}{name}", recipe.pop("arch"), "tiny", **recipe)

    return get
