"""Split a GGUF file into shards as llama.cpp's `gguf-split --split` does: the model's
metadata in the first, the tensors in order, at most `--max-tensors` tensors or
`--max-size` bytes of tensor data a shard, `split.no` / `split.count` /
`split.tensors.count` in each, the files `<prefix>-00001-of-0000N.gguf`, ... beside the
source. Written by gguf-py's GGUFWriter (what llama.cpp's converter splits with), read by
gguf-py's GGUFReader: neither is llmd's reader, so a split made here tests llmd's.

    python -m llmd_tools.split_gguf SRC.gguf [--max-tensors 64 | --max-size 500M]
        [--out DIR/PREFIX] [--small-first-shard]

prints the shards' paths (load the model from the first, as llama.cpp does).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def split_gguf(src: Path, out: Path, max_tensors: int = 0, max_size: int = 0,
               small_first_shard: bool = False) -> list[Path]:
    """Shards of `src` named after `out` (`<out stem>-00001-of-0000N.gguf`); the paths."""
    import gguf

    reader = gguf.GGUFReader(str(src))
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(str(out), arch, split_max_tensors=max_tensors, split_max_size=max_size,
                             small_first_shard=small_first_shard)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key in ("general.architecture", "general.alignment") or key.startswith("split."):
            continue
        vtype = field.types[0]
        sub_type = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), vtype, sub_type=sub_type)
    for t in reader.tensors:
        writer.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)  # (packed: bytes a row, as the reader gives them)
    shards = writer.format_shard_names(Path(out))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return shards


def _size(text: str) -> int:
    unit = _UNITS.get(text[-1:].upper())
    return int(float(text[:-1]) * unit) if unit else int(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m llmd_tools.split_gguf", description=__doc__.splitlines()[0])
    parser.add_argument("src", type=Path)
    limit = parser.add_mutually_exclusive_group(required=True)
    limit.add_argument("--max-tensors", type=int, default=0, help="tensors a shard")
    limit.add_argument("--max-size", type=_size, default=0, help="tensor bytes a shard (K, M, G suffixes)")
    parser.add_argument("--out", type=Path, default=None, help="where and under which name (default: SRC's)")
    parser.add_argument("--small-first-shard", action="store_true", help="the first shard holds the metadata alone")
    args = parser.parse_args(argv)
    for path in split_gguf(args.src, args.out or args.src, args.max_tensors, args.max_size, args.small_first_shard):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
