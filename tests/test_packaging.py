"""Every module imports from the installed packages, and the pure-logic layer (scheduler,
KV cache manager, detokenizer, protocol, client) never pulls in torch."""
from __future__ import annotations

import importlib
import pkgutil
import subprocess
import sys

import pytest

PACKAGES = ["llmd", "llmd_client", "llmd_tools"]
# The whole scheduler side (llmd.core), with what it stands on.
PURE = ["llmd.core." + m.name for m in pkgutil.iter_modules(importlib.import_module("llmd.core").__path__)] + \
    ["llmd.detokenizer.incremental", "llmd.config", "llmd_client", "llmd.engine_setup"]


def all_modules() -> list[str]:
    names = []
    for pkg_name in PACKAGES:
        pkg = importlib.import_module(pkg_name)
        names.append(pkg_name)
        names += [m.name for m in pkgutil.walk_packages(pkg.__path__, prefix=pkg_name + ".")]
    return names


@pytest.mark.parametrize("name", all_modules())
def test_module_imports(name):
    importlib.import_module(name)


def test_every_source_folder_is_a_declared_package():
    """pyproject's `packages` lists every folder with an __init__.py (a package left out
    is missing from a wheel, though an editable install finds it)."""
    import tomllib
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    setuptools = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    tops = {folder: name for name, folder in setuptools["package-dir"].items()}
    folders = {".".join([tops[base], *p.parent.relative_to(root / base).parts])
               for base in ("daemon", "client", "tools") for p in (root / base).rglob("__init__.py")}
    assert folders == set(setuptools["packages"]), "a subpackage folder is missing from pyproject.toml"


def test_pure_logic_does_not_import_torch():
    code = "import sys\n" + "".join(f"import {m}\n" for m in PURE) + \
        "bad = [m for m in ('torch', 'transformers', 'xgrammar') if m in sys.modules]\nprint(bad)\n"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
