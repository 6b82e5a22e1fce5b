"""The C++ paged decode kernel as another commit wrote it, loaded beside this checkout's,
so that a benchmark times old and new in one process (bench_kv_cache_dtype --attention
--baseline REV).

`git show REV:daemon/gpu/layers/cpu/cpu_kernels.cpp` and the headers it includes from its
folder (and theirs) are written to a folder keyed by their digest, the operator
namespace renamed (`llmd_cpu` -> `llmd_cpu_rev_<digest>`: two libraries may not register
one namespace), and built alone through kernel_build with this CPU's flags (one source:
~30-60 s, once per revision's sources). The old kernel never enters the daemon: only the
benchmark loads it.
"""
from __future__ import annotations

import hashlib
import os
import re
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from llmd.gpu.layers.cpu.cpu_kernels import kernel_build_timeout, kernels_build
from llmd.gpu.layers.cpu.kernel_build import ExtensionBuild, build_library, extensions_root

KERNEL_DIR = "daemon/gpu/layers/cpu"
KERNEL_SOURCE = "cpu_kernels.cpp"
NAMESPACE = "llmd_cpu"
_LOCAL_INCLUDE = re.compile(r'^#include "([^"]+)"', re.MULTILINE)


@dataclass(frozen=True)
class RevisionSources:
    """A revision's kernel source, its operators moved to `namespace`, and its headers."""

    namespace: str
    source: str
    headers: dict[str, bytes]
    digest: str


def _git_show(repo: Path, rev: str, path: str) -> bytes:
    out = subprocess.run(["git", "-C", str(repo), "show", f"{rev}:{path}"], capture_output=True, check=False)
    if out.returncode != 0:
        raise ValueError(f"--baseline {rev!r}: git cannot show {path} ({out.stderr.decode(errors='replace').strip()})")
    return out.stdout


def repo_root() -> Path:
    """The git checkout this file lies in."""
    return Path(subprocess.run(["git", "rev-parse", "--show-toplevel"], capture_output=True, text=True,
                               check=True, cwd=Path(__file__).parent).stdout.strip())


def revision_sources(rev: str, repo: Path) -> RevisionSources:
    """cpu_kernels.cpp of commit `rev` with its operators in a namespace of their own."""
    source = _git_show(repo, rev, f"{KERNEL_DIR}/{KERNEL_SOURCE}").decode()
    headers: dict[str, bytes] = {}
    todo = _LOCAL_INCLUDE.findall(source)
    while todo:  # the headers it includes, and theirs
        name = todo.pop()
        if name not in headers:
            headers[name] = _git_show(repo, rev, f"{KERNEL_DIR}/{name}")
            todo += _LOCAL_INCLUDE.findall(headers[name].decode())
    digest = hashlib.sha256(source.encode() + b"".join(headers[n] for n in sorted(headers))).hexdigest()[:10]
    namespace = f"{NAMESPACE}_rev_{digest}"
    renamed = re.sub(rf"\bTORCH_LIBRARY(_IMPL)?\({NAMESPACE},", rf"TORCH_LIBRARY\1({namespace},", source)
    if renamed == source:
        raise ValueError(f"--baseline {rev!r}: its {KERNEL_SOURCE} registers no {NAMESPACE} operators")
    return RevisionSources(namespace, renamed, headers, digest)


def _write_atomic(path: Path, data: bytes) -> None:
    """Another benchmark may be compiling from the same folder: it sees the old file or the new one."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def revision_paged_decode(rev: str) -> Callable[..., torch.Tensor]:
    """paged_decode as commit `rev` built it: the arguments of cpu_kernels.paged_decode_op()'s."""
    sources = revision_sources(rev, repo_root())
    folder = extensions_root() / f"llmd_kernel_rev_sources_{sources.digest}"
    folder.mkdir(parents=True, exist_ok=True)
    for name, data in ((KERNEL_SOURCE, sources.source.encode()), *sources.headers.items()):
        _write_atomic(folder / name, data)
    flags = kernels_build()
    ext = ExtensionBuild(name=f"llmd_kernel_rev_{sources.digest}", sources=(folder / KERNEL_SOURCE,),
                         headers=tuple(folder / name for name in sorted(sources.headers)), cflags=flags.cflags,
                         ldflags=flags.ldflags)
    torch.ops.load_library(str(build_library(ext, kernel_build_timeout())))
    return getattr(torch.ops, sources.namespace).paged_decode
