"""CUDA only: where the packed GEMV's time goes, by the GPU's own program-counter sampling
(Triton's proton profiler: backend cupti, mode pcsampling): the kernel's source lines with
their samples and stall reasons, most sampled first.

    python -m llmd_tools.profile_quant_gemv [--types Q4_K Q4_0] [--shape 14336x4096]
        [--calls 300] [--out DIR] [--top 25]

Why: on an H200 the W4A16 GEMV ran at 21-26 % of its packed bytes' roofline (tile sweep
included, docs/benchmarks.md), while the instructions its K loop issues would allow ~64 %
(tools/quant_kernel_resources.py) and reshaping the loop offline moves that count little
(~7 a weight either way): the time is lost to stalls, which only the device can show —
waiting on global loads (long scoreboard), on barriers, on the pipeline's cp.async waits,
or on issue. Each type's weight is one random-block copy per call in turn (four copies:
read from device memory, not the L2), x one bf16 row, the default tile
(quant_tiles.tiles_for), eager launches (sampling needs no graph). The raw profile (a
hatchet JSON tree) is written under --out for reading offline; the summary prints every
numeric metric of the most sampled lines. If this Triton's proton cannot sample (no
CUPTI, an older proton), it says why and exits 3: the other steps are unaffected.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import sys

import torch


def _nodes(node: dict, path: tuple[str, ...] = ()):
    """(frame path, metrics) of every node of a hatchet tree."""
    name = node.get("frame", {}).get("name", "?")
    here = (*path, name)
    yield here, node.get("metrics", {})
    for child in node.get("children", []):
        yield from _nodes(child, here)


def summarize(tree: list | dict, top: int) -> list[dict]:
    """The `top` leaf lines by their largest sample count: each {"line", "metrics"}."""
    roots = tree if isinstance(tree, list) else [tree]
    rows = []
    for root in roots:
        for path, metrics in _nodes(root):
            numeric = {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and v}
            if numeric:
                rows.append({"line": " / ".join(path[-2:]), "metrics": numeric})
    key = lambda r: r["metrics"].get("num_samples", max(r["metrics"].values()))  # noqa: E731
    return sorted(rows, key=key, reverse=True)[:top]


def profile(quant: str, n: int, k: int, calls: int, out: str, device: torch.device) -> str:
    """The hatchet file of `calls` GEMVs of a [n, k] `quant` weight under PC sampling."""
    import triton.profiler as proton

    from llmd.gpu.layers.quant.triton_quant_mm import quant_matmul
    from llmd_tools.bench_quant_gpu import _weights

    weights, _, _ = _weights(quant, n, k, 4, device)
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16).to(device)
    for w in weights:  # compiled before sampling starts
        quant_matmul(x, w)
    torch.cuda.synchronize()
    name = os.path.join(out, f"gemv-{quant}-{n}x{k}")
    proton.start(name, backend="cupti", mode="pcsampling")
    for i in range(calls):
        quant_matmul(x, weights[i % len(weights)])
    torch.cuda.synchronize()
    proton.finalize()
    found = sorted(glob.glob(name + "*"))
    if not found:
        raise RuntimeError(f"proton wrote no profile at {name}*")
    return found[0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--types", nargs="+", default=["Q4_K", "Q4_0"])
    parser.add_argument("--shape", default="14336x4096", help="N x K")
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("profile_quant_gemv: needs a CUDA device", file=sys.stderr)
        return 2
    n, k = (int(v) for v in args.shape.split("x"))
    os.makedirs(args.out, exist_ok=True)
    status = 0
    for quant in args.types:
        try:
            path = profile(quant, n, k, args.calls, args.out, torch.device("cuda"))
            with open(path) as f:
                rows = summarize(json.load(f), args.top)
        except Exception as exc:  # noqa: BLE001 - a profiler that cannot sample here: say why, go on
            print(f"profile_quant_gemv: {quant}: {type(exc).__name__}: {exc}", flush=True)
            status = 3
            continue
        print(f"== {quant} {n}x{k}: {path}", flush=True)
        for row in rows:
            metrics = sorted(row["metrics"].items(), key=lambda kv: -kv[1])[:8]
            print(f"{row['line'][-90:]:90} " + ", ".join(f"{m}={v:g}" for m, v in metrics), flush=True)
    return status


if __name__ == "__main__":
    raise SystemExit(main())
