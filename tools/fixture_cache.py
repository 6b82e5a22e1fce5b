"""The on-disk cache the test fixtures are built into (tools/make_model.py's models,
tools/fixture_tokenizer.py's tokenizers, tools/make_gguf.py's GGUF files): where it is,
keys that hash what determines a fixture's files, and a build that other processes never
see half-written."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator

# Bump when a build recipe changes in a way the fixtures' keys (their builders' sources,
# recipes, corpus and library versions) would not notice.
RECIPE_VERSION = 1


def _repo_root() -> Path | None:
    root = Path(__file__).resolve().parent.parent
    if (root / "pyproject.toml").is_file() and (root / "tools").is_dir() and (root / "daemon").is_dir():
        return root
    return None


def default_cache_dir() -> Path:
    """``$LLMD_FIXTURE_CACHE``, else ``<repo>/.cache/fixtures``, else ``~/.cache/llmd/fixtures``."""
    env = os.environ.get("LLMD_FIXTURE_CACHE")
    if env:
        return Path(env).expanduser()
    root = _repo_root()
    if root is not None:
        return root / ".cache" / "fixtures"
    return Path.home() / ".cache" / "llmd" / "fixtures"


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def _build_atomically(final: Path, build_fn) -> Path:
    """Run ``build_fn(tmp_dir)`` and rename tmp_dir to ``final``; under a file lock, so
    concurrent processes build once and never see a half-written directory."""
    if final.is_dir():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(final.parent / f".{final.name}.lock"):
        if final.is_dir():
            return final
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=final.parent))
        try:
            build_fn(tmp)
            os.chmod(tmp, 0o755)  # mkdtemp makes it 0700
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return final


def _hash(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


def source_hash(*paths: Path) -> str:
    """Hash of the named files' bytes (the builders' own sources, in a fixture's key)."""
    return _hash([hashlib.sha256(Path(p).read_bytes()).hexdigest() for p in paths])


def _versions() -> dict[str, str]:
    import tokenizers
    import torch
    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__, "tokenizers": tokenizers.__version__}
