"""What every benchmark reports: summary statistics, the machine's state, and how a
report is printed (a text table, or one JSON object with `--json`)."""
from __future__ import annotations

import math
import os
import sys
from collections.abc import Sequence
from typing import Protocol

import msgspec
import numpy as np
import psutil


class Stats(msgspec.Struct, kw_only=True):
    """Summary of one figure over many samples (p50 is the median; linear interpolation)."""

    mean: float
    p50: float
    p90: float
    p99: float
    min: float
    max: float

    @classmethod
    def of(cls, values: Sequence[float], scale: float = 1.0) -> Stats | None:
        """Stats of `values` times `scale`; None when there are none."""
        if not len(values):
            return None
        a = np.asarray(values, dtype=np.float64) * scale
        p50, p90, p99 = np.percentile(a, [50, 90, 99])
        return cls(mean=float(a.mean()), p50=float(p50), p90=float(p90), p99=float(p99),
                   min=float(a.min()), max=float(a.max()))

    def row(self, label: str, unit: str) -> str:
        return (f"{label:<24} mean {self.mean:9.2f}  p50 {self.p50:9.2f}  p90 {self.p90:9.2f}  "
                f"p99 {self.p99:9.2f}  max {self.max:9.2f} {unit}")


class Env(msgspec.Struct, kw_only=True):
    """Where the figures were taken: device, dtype, and the load on the machine before the
    run (other busy processes distort CPU timings badly)."""

    device: str
    dtype: str
    cpu_count: int
    load_avg_1m: float
    cpu_busy_percent: float  # of all CPUs, over the half second before the run
    torch_threads: int | None = None

    @classmethod
    def here(cls, device: str, dtype: str, torch_threads: int | None = None) -> Env:
        return cls(device=device, dtype=dtype, cpu_count=os.cpu_count() or 1, load_avg_1m=os.getloadavg()[0],
                   cpu_busy_percent=psutil.cpu_percent(interval=0.5), torch_threads=torch_threads)

    def line(self) -> str:
        threads = f", {self.torch_threads} torch threads" if self.torch_threads else ""
        return (f"device {self.device} ({self.dtype}{threads}); {self.cpu_count} CPUs, {self.cpu_busy_percent:.0f}% "
                f"busy and load average {self.load_avg_1m:.2f} just before the run")


class Report(Protocol):
    def text(self) -> str: ...


def footer(roofline: Report | None, env: Env) -> list[str]:
    """The last lines of an offline report: the roofline when there is one, the machine."""
    return ([roofline.text()] if roofline is not None else []) + [env.line()]


def emit(report: Report, as_json: bool) -> None:
    """Print the report: one JSON object, or its text form."""
    if as_json:
        sys.stdout.write(msgspec.json.encode(report).decode() + "\n")
    else:
        sys.stdout.write(report.text().rstrip("\n") + "\n")


def rate(count: float, seconds: float) -> float:
    return count / seconds if seconds > 0 else math.nan


class _NoProgress:
    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


def progress(total: int, desc: str):
    """A tqdm bar on stderr when it is a terminal (and tqdm is installed); otherwise an
    object with the same update()/close() that shows nothing."""
    if sys.stderr.isatty():
        try:
            from tqdm import tqdm
        except ImportError:
            pass
        else:
            return tqdm(total=total, desc=desc, leave=False, file=sys.stderr)
    return _NoProgress()
