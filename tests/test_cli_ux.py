"""What a person meets first on the command line: --version and -h on both tools, a
help text on every option, one for every engine setting."""
from __future__ import annotations

import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import click
import pytest

from llmd.cli import main as llmd_main
from llmd.config import SETTING_HELP, EngineConfig
from llmd_client.cli import cli as llmctl_main

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
