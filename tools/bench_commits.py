"""One offline benchmark, two commits, one run: does a change move the engine's speed?

    python -m llmd_tools.bench_commits OLD NEW [--rounds 3] -- <llmd bench throughput options>

Checks both commits out into temporary git worktrees (this checkout's files are not
touched), then runs `llmd bench throughput --json` with the given options under each,
alternating OLD, NEW, OLD, NEW... so that a machine whose load drifts during the run
weighs on both alike. Each run is a fresh process importing that commit's code (the
worktree goes first on PYTHONPATH, through links named llmd, llmd_client and
llmd_tools). Prints every run's output tokens/s and, per commit, the median and the
spread (min..max), and NEW's median relative to OLD's.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

PACKAGES = {"llmd": "daemon", "llmd_client": "client", "llmd_tools": "tools"}


def _repo_root() -> Path:
    out = subprocess.run(["git", "rev-parse", "--show-toplevel"], capture_output=True, text=True, check=True)
    return Path(out.stdout.strip())


def _checkout(repo: Path, rev: str, where: Path) -> Path:
    """A worktree of `rev` and a folder of links that makes its packages importable."""
    tree = where / "tree"
    subprocess.run(["git", "-C", str(repo), "worktree", "add", "--detach", "-q", str(tree), rev], check=True)
    links = where / "path"
    links.mkdir()
    for name, folder in PACKAGES.items():
        (links / name).symlink_to(tree / folder)
    return links


@contextlib.contextmanager
def checkouts(revs: Sequence[str], prefix: str) -> Iterator[dict[str, Path]]:
    """Each commit of `revs` in a temporary worktree of this repository, as a folder of
    links to put first on PYTHONPATH (see env_for); the worktrees are removed on exit."""
    repo = _repo_root()
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        paths: dict[str, Path] = {}
        try:
            for rev in revs:
                where = Path(tmp) / rev.replace("/", "_")
                where.mkdir()
                paths[rev] = _checkout(repo, rev, where)
            yield paths
        finally:
            for rev in paths:
                subprocess.run(["git", "-C", str(repo), "worktree", "remove", "--force",
                                str(paths[rev].parent / "tree")], check=False)


def env_for(path: Path) -> dict[str, str]:
    """The environment of a process that imports the commit behind `path`."""
    return dict(os.environ, PYTHONPATH=f"{path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")


def _run_once(path: Path, options: list[str]) -> dict:
    env = env_for(path)
    code = "import sys; from llmd.cli import main; sys.exit(main())"
    out = subprocess.run([sys.executable, "-c", code, "bench", "throughput", "--json", *options],
                         capture_output=True, text=True, env=env)
    if out.returncode != 0:
        raise SystemExit(f"the benchmark failed (exit {out.returncode}):\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _output_tokens_per_s(report: dict) -> float:
    return float(report["output_tokens_per_s"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("old")
    parser.add_argument("new")
    parser.add_argument("--rounds", type=int, default=3, help="runs of each commit, alternating")
    argv = sys.argv[1:] if argv is None else argv
    ours, options = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    args = parser.parse_args(ours)
    figures: dict[str, list[float]] = {args.old: [], args.new: []}
    with checkouts((args.old, args.new), "llmd-bench-commits-") as paths:
        for round_ in range(args.rounds):
            for rev in (args.old, args.new):
                tok_s = _output_tokens_per_s(_run_once(paths[rev], options))
                figures[rev].append(tok_s)
                print(f"round {round_ + 1}  {rev:>12}  {tok_s:9.1f} output tok/s", flush=True)
    medians = {rev: statistics.median(v) for rev, v in figures.items()}
    for rev, values in figures.items():
        print(f"{rev:>12}: median {medians[rev]:.1f} output tok/s (min {min(values):.1f}, max {max(values):.1f})")
    print(f"new / old: {medians[args.new] / medians[args.old]:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
