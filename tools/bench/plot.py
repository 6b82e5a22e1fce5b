"""`llmd bench serve --plot FILE.png`: latency percentiles against the request rate of a
sweep, one panel each for TTFT, TPOT and end-to-end latency. Needs matplotlib (the
optional `bench` extra); imported only here."""
from __future__ import annotations

import importlib.util

from llmd_tools.bench.serve import ServeSweep

MISSING = "--plot needs matplotlib, which is not installed: pip install 'llmd[bench]'"
PANELS = (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("e2e_ms", "E2E latency"))


def available() -> bool:
    return importlib.util.find_spec("matplotlib") is not None


def plot_sweep(sweep: ServeSweep, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # Rates as evenly spaced categories: "inf" (all at once) has no place on a number line.
    labels = ["inf" if r.request_rate is None else f"{r.request_rate:g}" for r in sweep.runs]
    x = list(range(len(labels)))
    fig, axes = plt.subplots(1, len(PANELS), figsize=(5 * len(PANELS), 4), constrained_layout=True)
    for ax, (attr, title) in zip(axes, PANELS):
        for pct in ("p50", "p90", "p99"):
            ys = [getattr(getattr(r, attr), pct) if getattr(r, attr) else float("nan") for r in sweep.runs]
            ax.plot(x, ys, marker="o", label=pct)
        ax.set_title(title)
        ax.set_xticks(x, labels)
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel("ms")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"{sweep.model}: {sweep.config.workload} workload")
    fig.savefig(path, dpi=120)
    plt.close(fig)
