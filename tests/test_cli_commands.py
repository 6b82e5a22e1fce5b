"""`llmd` sub-commands added through the "llmd.commands" entry points: `bench` is found
there (the daemon imports nothing of llmd_tools), and one that cannot be loaded is
listed and refused with its reason, never a traceback."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

BIN = Path(sys.executable).parent


def _llmd(*args: str, path: Path | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    if path is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(path), env.get("PYTHONPATH")]))
    return subprocess.run([str(BIN / "llmd"), *args], capture_output=True, text=True, timeout=120, env=env)


def test_bench_comes_from_an_entry_point():
    from importlib.metadata import entry_points

    assert [e.value for e in entry_points(group="llmd.commands", name="bench")] == ["llmd_tools.bench.command:bench"]
    out = _llmd("--help")
    assert out.returncode == 0 and "bench" in out.stdout and "serve" in out.stdout


def test_a_command_that_cannot_be_loaded_is_refused_with_its_reason(tmp_path):
    info = tmp_path / "llmd_broken_plugin-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: llmd-broken-plugin\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[llmd.commands]\nmissing = no_such_module_here:command\n"
                                           "notacommand = json:dumps\n")
    listed = _llmd("--help", path=tmp_path)
    assert listed.returncode == 0 and "missing" in listed.stdout and "notacommand" in listed.stdout
    for args, reason in ((["missing", "--any", "thing"], "No module named 'no_such_module_here'"),
                         (["notacommand"], "not a click command")):
        out = _llmd(*args, path=tmp_path)
        assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
        assert "could not be loaded" in out.stderr and reason in out.stderr
    served = _llmd("serve", "--help", path=tmp_path)  # the built-in commands are untouched
    assert served.returncode == 0 and "--model" in served.stdout
