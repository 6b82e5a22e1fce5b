"""A GGUF split in shards, read as one file: what llama.cpp's `gguf-split` writes, and its
converter with `--split-max-tensors` / `--split-max-size` (models past Hugging Face's
50 GB a file come that way: `Llama-3.3-70B-Q8_0-00001-of-00002.gguf`, ...).

Every shard is a GGUF of its own, with `split.no` (from 0), `split.count` and
`split.tensors.count` (the tensors of all shards); the first holds the model's metadata
(the others nothing but those keys, as both writers make them: anything else there is
ignored, as llama.cpp ignores it) and may hold no tensors at all. A model is given by its
first shard, as llama.cpp's loader takes it; the others are found beside it by name,
`<prefix>-<i>-of-<count>.gguf` (five digits each), and each must say it is that shard of
that split. Whatever does not fit is refused naming the file: another shard given in the
first's place (the error names the first), a first shard renamed so that the others
cannot be found, a shard missing or of another split, a tensor in two shards, a count of
tensors other than the first shard says.
"""
from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

SPLIT_NO, SPLIT_COUNT, SPLIT_TENSORS = "split.no", "split.count", "split.tensors.count"
_SHARD_NAME = re.compile(r"(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf")


class Shard(Protocol):
    """What is read here of an opened shard (a gguf_file.GGUFFile, whose module imports
    this one)."""

    path: Path
    metadata: dict[str, Any]
    tensors: dict[str, Any]

    def error(self, problem: str) -> ValueError: ...


def shard_name(prefix: str, no: int, count: int) -> str:
    """Shard `no` (from 1) of `count`'s file name, as llama.cpp and gguf-py write it."""
    return f"{prefix}-{no:05d}-of-{count:05d}.gguf"


def shard_paths(path: Path) -> list[Path]:
    """The files of the model `path` names, by name alone: every shard's where it is a
    first shard's (`-00001-of-N.gguf`), else the file itself."""
    m = _SHARD_NAME.fullmatch(path.name)
    if m is None or int(m["no"]) != 1:
        return [path]
    count = int(m["count"])
    return [path.with_name(shard_name(m["prefix"], i, count)) for i in range(1, count + 1)]


def files_stamp(path: Path) -> tuple[tuple[int, int], ...]:
    """(mtime_ns, size) of each of the model's files there is (shard_paths): what a cache
    of what was read from them is keyed by, so that a shard rewritten is read again."""
    stats = [p.stat() for p in shard_paths(path) if p.exists()]
    return tuple((st.st_mtime_ns, st.st_size) for st in stats)


def _number(g: Shard, key: str, default: int) -> int:
    value = g.metadata.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise g.error(f"metadata {key}={value!r} is not a count")
    return value


def join_shards(first: Shard, open_shard: Callable[[Path], Shard]) -> list[Shard]:
    """The shards of the model whose file `first` is, in order, `first` the first of them
    (alone when it is not split), each other one opened with `open_shard`; GGUFFormatError
    for a split that does not hold together (module doc)."""
    count, no = _number(first, SPLIT_COUNT, 1), _number(first, SPLIT_NO, 0)
    if count <= 1 and no == 0:
        return [first]
    m = _SHARD_NAME.fullmatch(first.path.name)
    if no != 0:
        named = f", {shard_name(m['prefix'], 1, count)}" if m else ""
        raise first.error(f"is shard {no + 1} of {count} of a split GGUF: load the model from its first "
                          f"shard{named}")
    if m is None or int(m["no"]) != 1 or int(m["count"]) != count:
        raise first.error(f"is the first of {count} shards of a split GGUF, but its name does not end in "
                          f"-00001-of-{count:05d}.gguf, by which the other shards are found")
    shards = [first]
    for i in range(2, count + 1):
        path = first.path.with_name(shard_name(m["prefix"], i, count))
        if not path.is_file():
            raise first.error(f"is the first of {count} shards of a split GGUF; shard {i}, {path.name!r}, "
                              "is missing beside it")
        shard = open_shard(path)
        said = (_number(shard, SPLIT_NO, 0) + 1, _number(shard, SPLIT_COUNT, 1))
        if said != (i, count):
            raise shard.error(f"is shard {said[0]} of {said[1]} by its {SPLIT_NO} and {SPLIT_COUNT}, not shard "
                              f"{i} of {count} as its name and the first shard say")
        shards.append(shard)
    total = sum(len(s.tensors) for s in shards)
    expected = _number(first, SPLIT_TENSORS, total)
    if expected != total:
        raise first.error(f"has {SPLIT_TENSORS}={expected}, but its {count} shards hold {total} tensors")
    return shards
