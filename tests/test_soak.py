"""The soak tool, briefly: concurrent streaming clients on their own connections get a
final message for every request, and its report adds up."""
from __future__ import annotations

import json
import subprocess
import sys


def test_short_soak_loses_nothing():
    out = subprocess.run([sys.executable, "-m", "llmd_tools.soak", "--clients", "16", "--minutes", "0.1",
                          "--warmup-s", "2", "--json"], capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["lost"] == 0 and report["refused"] == 0 and report["errors"] == []
    assert report["completed"] >= 16 and report["tokens"] > 0
    assert report["rss_after_warmup_bytes"] <= report["rss_peak_bytes"]
