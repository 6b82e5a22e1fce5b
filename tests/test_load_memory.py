"""tools/load_memory.py reports the RSS of each step of a load in its own process, and
of `llmd serve` once it serves (a tiny GGUF fixture; the figures are the tool's
business, the test checks they are there and consistent)."""
from __future__ import annotations

import json
import subprocess
import sys

from gguf import GGMLQuantizationType as T

from llmd_tools.load_memory import STEPS
from test_gguf import ggufs, hf_dirs  # noqa: F401


def _run(*args: str) -> dict:
    out = subprocess.run([sys.executable, "-m", "llmd_tools.load_memory", *args, "--json"], capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_each_step_of_a_gguf_load_is_reported(ggufs):  # noqa: F811
    report = _run("--model", ggufs("llama", T.Q8_0), "--max-model-len", "128", "--blocks", "16")
    steps = [r["step"] for r in report["steps"]]
    assert steps[0] == "imports" and steps[-1].startswith("loaded")
    for name in ("load_hf_config", "load_tokenizer", "load_weights", "release_gguf_readers", "attach_gguf_kernels"):
        assert name in STEPS and name in steps
    assert steps.index("load_weights") < steps.index("release_gguf_readers") < steps.index("attach_gguf_kernels")
    for row in report["steps"]:
        assert row["peak"] >= row["rss"] > 50 and row["anon"] > 0 and row["file"] > 0
    assert report["steps"][-1]["peak"] >= max(r["rss"] for r in report["steps"])


def test_a_serving_daemon_is_reported(ggufs):  # noqa: F811
    report = _run("--model", ggufs("llama", T.Q8_0), "--serve", "--max-model-len", "128", "--blocks", "16")
    assert report["executor"] == "uni" and report["workers"] == [] and report["ready_s"] > 0
    assert report["daemon"]["VmHWM"] >= report["daemon"]["VmRSS"] > 50
