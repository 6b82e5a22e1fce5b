"""What a person meets first on the command line: --version and -h on both tools, a
help text on every option, one for every engine setting."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import click
import pytest

from llmd.cli import main as llmd_main
from llmd.config import SETTING_HELP, EngineConfig
from llmd_client.llmctl import cli as llmctl_main

BIN = Path(sys.executable).parent  # CI does not activate the venv


@pytest.mark.parametrize("tool", ["llmd", "llmctl"])
def test_version_and_short_help_exit_zero(tool):
    out = subprocess.run([str(BIN / tool), "--version"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == f"{tool} {version('llmd')}"
    out = subprocess.run([str(BIN / tool), "-h"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "Usage:" in out.stdout


def _commands(group: click.Group, prefix: str):
    ctx = click.Context(group)
    for name in group.list_commands(ctx):
        command = group.get_command(ctx, name)
        if isinstance(command, click.Group):
            yield from _commands(command, f"{prefix} {name}")
        else:
            yield f"{prefix} {name}", command


def test_every_option_says_what_it_does():
    missing = [f"{where} {'/'.join(p.opts)}"
               for group, prefix in ((llmd_main, "llmd"), (llmctl_main, "llmctl"))
               for where, command in _commands(group, prefix)
               for p in command.params if isinstance(p, click.Option) and not (p.help or "").strip()]
    assert missing == []


def test_every_engine_setting_has_help():
    assert set(SETTING_HELP) == set(EngineConfig.__struct_fields__)


def _serve_refusal(model: Path, tmp_path: Path, user: list[str] = ()) -> subprocess.CompletedProcess:
    sock = tmp_path / "s.sock"
    out = subprocess.run([*user, str(BIN / "llmd"), "serve", "--model", str(model), "--socket", str(sock)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    assert not sock.exists() and not (tmp_path / "s-http.sock").exists()  # removed on the way out
    return out


def test_checkpoints_llmd_cannot_load_are_named(tmp_path):
    import json
    import shutil

    from llmd_tools.make_model import fixture_path

    fixture = fixture_path("tiny-llama")
    fp8 = tmp_path / "fp8-model"
    shutil.copytree(fixture, fp8)
    config = json.loads((fp8 / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    (fp8 / "config.json").write_text(json.dumps(config))
    out = _serve_refusal(fp8, tmp_path)
    assert "quantization_config.quant_method='bitsandbytes' is not implemented by llmd" in out.stderr
    assert "awq, gptq, fp8, compressed-tensors" in out.stderr
    bare = tmp_path / "no-tokenizer"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(fixture / name, bare / name)
    out = _serve_refusal(bare, tmp_path)
    assert "no tokenizer in" in out.stderr and "--tokenizer" in out.stderr


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"), reason="needs root and setpriv")
def test_unreadable_model_says_permission_denied(tmp_path):
    from llmd_tools.make_model import fixture_path

    private = tmp_path / "private"
    shutil.copytree(fixture_path("tiny-llama"), private / "model")
    private.chmod(0o700)  # root's alone
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    run_dir.chmod(0o777)
    tmp_path.chmod(0o755)
    out = _serve_refusal(private / "model", run_dir,
                         user=["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"])
    assert "permission denied" in out.stderr
