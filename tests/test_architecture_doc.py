"""docs/architecture.md is the map of the code: it must name every module of daemon/
and client/, and every file it names must exist, so the map cannot drift from the
territory unnoticed."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = (ROOT / "docs" / "architecture.md").read_text()


def _mentioned(path: Path) -> bool:
    """Named by its path from the repository root, or from its top folder (`gpu/x.py`)."""
    rel = path.relative_to(ROOT).as_posix()
    inner = rel.split("/", 1)[1]
    return re.search(rf"(?<![\w/]){re.escape(rel)}\b", DOC) is not None or \
        re.search(rf"(?<![\w/]){re.escape(inner)}\b", DOC) is not None


def test_every_module_is_on_the_map():
    modules = sorted(p for folder in ("daemon", "client") for p in (ROOT / folder).rglob("*.py"))
    assert modules
    missing = [p.relative_to(ROOT).as_posix() for p in modules if not _mentioned(p)]
    assert missing == []


def test_every_path_on_the_map_exists():
    named = set(re.findall(r"(?:daemon|client|tools|docs|systemd)/[\w/.-]*", DOC))
    assert len(named) > 20
    missing = sorted(p for p in named if not (ROOT / p.rstrip(".")).exists())
    assert missing == []


def test_a_missing_module_would_be_noticed():
    assert not _mentioned(ROOT / "daemon" / "no_such_module.py")
    assert _mentioned(ROOT / "daemon" / "core" / "engine_core.py")
