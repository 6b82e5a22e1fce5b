"""llmd's reader of a GGUF file (llama.cpp's one-file format, little-endian v2 and v3):
its header, metadata and tensor table parsed once, its tensor data left in the file. A
model split in shards is opened by its first shard and read as one file (gguf_split).

The file is memory-mapped read-only. Metadata scalars become Python values; an array of
numbers is ONE numpy array viewing the file's bytes; an array of strings (a vocabulary, its
merges) is a GGUFStringArray that decodes when read, so opening a 262k-token vocabulary
costs a walk over it and a few bytes, not a Python object per token (gguf-py's reader
builds one numpy view per element: ~700 MB for Gemma 3's vocabulary). A tensor's data is a
view of the map: nothing is read from disk until it is used.

Every bound is checked against the file's size, so a truncated or corrupt file is a
GGUFFormatError (a ValueError) naming the file and what is wrong, never an exception from
numpy or struct. What it does not read is refused by name: big-endian files, versions other
than 2 and 3, tensor types the `gguf` package does not know.
"""
from __future__ import annotations

import dataclasses
import mmap
import os
import struct
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, overload

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from llmd.gpu.models.gguf_split import join_shards

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32  # llama.cpp's, unless general.alignment says otherwise
MAX_DIMS = 4  # GGML_MAX_DIMS: llama.cpp refuses tensors of more dimensions

# Fixed-size metadata types: struct format (little-endian) and numpy dtype.
_SCALAR_FORMATS: dict[GGUFValueType, str] = {
    GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H", GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i", GGUFValueType.FLOAT32: "<f", GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q", GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d",
}
_U64 = struct.Struct("<Q")
_SCALAR_DTYPES: dict[GGUFValueType, np.dtype] = {t: np.dtype(f) for t, f in _SCALAR_FORMATS.items()}

# Tensor types whose elements numpy has a dtype for (gguf-py's reader views these typed;
# every other type, BF16 included, as its raw bytes).
_ELEMENT_DTYPES: dict[GGMLQuantizationType, np.dtype] = {
    GGMLQuantizationType.F32: np.dtype("<f4"), GGMLQuantizationType.F16: np.dtype("<f2"),
    GGMLQuantizationType.F64: np.dtype("<f8"), GGMLQuantizationType.I8: np.dtype("i1"),
    GGMLQuantizationType.I16: np.dtype("<i2"), GGMLQuantizationType.I32: np.dtype("<i4"),
    GGMLQuantizationType.I64: np.dtype("<i8"),
}


class GGUFFormatError(ValueError):
    """The file is not a GGUF llmd can read: the message names the file and the problem."""


@dataclass(frozen=True, slots=True)
class GGUFTensorInfo:
    """One entry of the tensor table."""

    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]  # ggml's order: the fastest-varying dimension first
    n_elements: int
    n_bytes: int
    data_offset: int  # from the start of the file
    shard: int = 0  # the file holding it: GGUFFile.shards[shard]

    @property
    def torch_shape(self) -> tuple[int, ...]:
        """The shape as numpy and torch write it (slowest-varying dimension first)."""
        return tuple(reversed(self.shape))


class GGUFStringArray(Sequence[str]):
    """A metadata array of strings, decoded from the file when read. Indexing walks the
    array once to record where each string starts (8 bytes a string)."""

    def __init__(self, buffer: mmap.mmap, where: str, key: str, start: int, count: int) -> None:
        # The map, not the GGUFFile: no reference cycle, so the map closes as soon as the
        # file and its views are dropped, without waiting for the cyclic collector.
        self._buffer, self._where, self._key, self._start, self._count = buffer, where, key, start, count
        self._offsets: array | None = None

    def __len__(self) -> int:
        return self._count

    def __iter__(self) -> Iterator[str]:
        buf, pos = self._buffer, self._start
        for i in range(self._count):
            (length,) = _U64.unpack_from(buf, pos)
            yield self._decode(buf[pos + 8:pos + 8 + length], i)
            pos += 8 + length

    @overload
    def __getitem__(self, index: int) -> str: ...
    @overload
    def __getitem__(self, index: slice) -> list[str]: ...
    def __getitem__(self, index: int | slice) -> str | list[str]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(self._count))]
        if index < 0:
            index += self._count
        if not 0 <= index < self._count:
            raise IndexError(f"{self._key} has {self._count} strings, no index {index}")
        if self._offsets is None:
            self._offsets = self._walk()
        pos = self._offsets[index]
        (length,) = _U64.unpack_from(self._buffer, pos)
        return self._decode(self._buffer[pos + 8:pos + 8 + length], index)

    def tolist(self) -> list[str]:
        return list(self)

    def __repr__(self) -> str:
        return f"<GGUFStringArray {self._key}: {self._count} strings>"

    def _walk(self) -> array:
        buf, pos, offsets = self._buffer, self._start, array("Q")
        for _ in range(self._count):
            offsets.append(pos)
            pos += 8 + _U64.unpack_from(buf, pos)[0]
        return offsets

    def _decode(self, raw: bytes, index: int) -> str:
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise GGUFFormatError(f"{self._where}: metadata {self._key}[{index}] is not UTF-8 ({exc.reason})") from None


class GGUFFile:
    """An opened GGUF file: `metadata` (key -> value, in file order), `tensors` (name ->
    GGUFTensorInfo, in file order) and each tensor's data as a view of the file
    (`tensor_data`). Raises GGUFFormatError for a file it cannot read. The first shard of
    a split model holds every shard's tensors (`shards`); `whole=False` opens one shard
    alone."""

    def __init__(self, path: str | Path, whole: bool = True) -> None:
        self.path = Path(path)
        self.where = repr(str(path))
        with self.path.open("rb") as f:
            magic = f.read(4)
            if magic != GGUF_MAGIC:
                raise self.error(f"is not a GGUF file: it starts with {magic!r}, not the GGUF magic {GGUF_MAGIC!r}")
            self.size = os.fstat(f.fileno()).st_size
            # Views of the map (np.frombuffer) keep it open; it closes with the last of them.
            self.buffer: mmap.mmap = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self._address = np.frombuffer(self.buffer, dtype=np.uint8).ctypes.data if self.size else 0
        self._pos = 4
        self.version = self._version()
        self.tensor_count = self._u64("the tensor count")
        self.kv_count = self._u64("the metadata count")
        self.metadata: dict[str, Any] = {}
        self.value_types: dict[str, GGUFValueType] = {}  # each key's type (for an array, ARRAY)
        for _ in range(self.kv_count):
            key = self._string("a metadata key")
            if key in self.metadata:
                raise self.error(f"metadata {key} appears twice")
            vtype = self._value_type(key)
            self.value_types[key] = vtype
            self.metadata[key] = self._value(key, vtype)
        self.alignment = self._alignment()
        infos = [self._tensor_info() for _ in range(self.tensor_count)]
        self.data_offset = -(-self._pos // self.alignment) * self.alignment
        self.tensors: dict[str, GGUFTensorInfo] = {}
        for name, dims, ttype, offset in infos:
            if name in self.tensors:
                raise self.error(f"tensor {name!r} appears twice")
            self.tensors[name] = self._placed(name, dims, ttype, offset)
        # the other shards (not this one: a list holding itself is a cycle, which would keep
        # the map open until the cyclic collector came)
        self._others = join_shards(self, lambda p: GGUFFile(p, whole=False))[1:] if whole else []
        for index, shard in enumerate(self._others, 1):
            for name, info in shard.tensors.items():
                if name in self.tensors:
                    raise shard.error(f"tensor {name!r} is in shard {self.tensors[name].shard + 1} too")
                self.tensors[name] = dataclasses.replace(info, shard=index)

    @property
    def shards(self) -> list[GGUFFile]:
        """The model's files, this one first (itself alone unless it is a split's first)."""
        return [self, *self._others]

    @property
    def total_size(self) -> int:
        """The bytes of the model's files (every shard's)."""
        return sum(shard.size for shard in self.shards)

    def error(self, problem: str) -> GGUFFormatError:
        """The error naming this file: "'path' is truncated: ...", "'path' has ...", else
        "'path': <problem>"."""
        return GGUFFormatError(f"{self.where} {problem}" if problem.startswith(("is ", "has ")) else
                               f"{self.where}: {problem}")

    def get(self, key: str, default: Any = None) -> Any:
        """The value of metadata `key`, or `default` when the file has none."""
        return self.metadata.get(key, default)

    def require(self, key: str) -> Any:
        value = self.metadata.get(key)
        if value is None:
            raise self.error(f"GGUF metadata {key} is missing")
        return value

    @property
    def architecture(self) -> str:
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise self.error("has no general.architecture: not a model GGUF")
        return arch

    def tensor_data(self, info: GGUFTensorInfo | str) -> np.ndarray:
        """The tensor's data as a read-only view of the file, shaped as gguf-py's reader
        shapes it: typed elements for F32/F16/F64/I8..I64, else raw bytes whose last
        dimension is the bytes of a row."""
        t = self.tensors[info] if isinstance(info, str) else info
        raw = np.frombuffer(self.shards[t.shard].buffer, dtype=np.uint8, count=t.n_bytes, offset=t.data_offset)
        dims = t.torch_shape
        dtype = _ELEMENT_DTYPES.get(t.tensor_type)
        if dtype is not None:
            return raw.view(dtype).reshape(dims)
        block, type_size = GGML_QUANT_SIZES[t.tensor_type]
        return raw.reshape(*dims[:-1], dims[-1] // block * type_size)

    def drop_pages(self, info: GGUFTensorInfo) -> None:
        """Take the tensor's pages out of this process's resident memory (the page cache
        keeps them; a later read maps them again): called once a loaded model holds its
        own copy, so the file's pages and the copy are not both counted."""
        self.shards[info.shard]._drop(info.data_offset, info.data_offset + info.n_bytes)

    def drop_memory(self, address: int, nbytes: int) -> None:
        """drop_pages for `nbytes` at `address` in this process where they lie in the map
        (the rows of a tensor viewing it once copied: linear.copy_checked), whichever
        shard's; nothing for memory elsewhere."""
        for shard in self.shards:
            start = address - shard._address
            if 0 <= start < shard.size:
                shard._drop(start, start + nbytes)

    def _drop(self, start: int, end: int) -> None:
        """Drop the pages of bytes [start, end) (whole pages: one shared with a neighbour
        is read again from the page cache if the neighbour is read later)."""
        start -= start % mmap.PAGESIZE
        end = min(end, self.size)
        if end > start and hasattr(mmap, "MADV_DONTNEED"):  # Linux, macOS
            self.buffer.madvise(mmap.MADV_DONTNEED, start, end - start)

    # -- parsing (each read checks the file's bounds) --------------------------------------

    def _take(self, n: int, what: str) -> int:
        """The position of the next `n` bytes, which are `what`; advances past them."""
        pos = self._pos
        if n < 0 or pos + n > self.size:
            raise self.error(f"is truncated: {what} at byte {pos} needs {n} bytes, the file has {self.size}")
        self._pos = pos + n
        return pos

    def _scalar(self, fmt: str, what: str) -> Any:
        return struct.unpack_from(fmt, self.buffer, self._take(struct.calcsize(fmt), what))[0]

    def _u64(self, what: str) -> int:
        return self._scalar("<Q", what)

    def _string(self, what: str) -> str:
        length = self._u64(f"the length of {what}")
        pos = self._take(length, what)
        try:
            return self.buffer[pos:pos + length].decode("utf-8")
        except UnicodeDecodeError as exc:
            raise self.error(f"{what} at byte {pos} is not UTF-8 ({exc.reason})") from None

    def _version(self) -> int:
        version = self._scalar("<I", "the version")
        if version & 0xFFFF == 0 and version >> 16:  # a small number written big-endian
            swapped = struct.unpack("<I", struct.pack(">I", version))[0]
            raise self.error(f"is a big-endian GGUF (version {swapped}): llmd reads little-endian GGUF only")
        if version not in SUPPORTED_VERSIONS:
            raise self.error(f"has GGUF version {version}, which llmd does not read "
                             f"(supported: {', '.join(map(str, SUPPORTED_VERSIONS))})")
        return version

    def _value_type(self, key: str) -> GGUFValueType:
        raw = self._scalar("<I", f"the type of metadata {key}")
        try:
            return GGUFValueType(raw)
        except ValueError:
            raise self.error(f"metadata {key} has unknown value type {raw}") from None

    def _value(self, key: str, vtype: GGUFValueType) -> Any:
        if vtype == GGUFValueType.STRING:
            return self._string(f"metadata {key}")
        if vtype in _SCALAR_FORMATS:
            return self._scalar(_SCALAR_FORMATS[vtype], f"metadata {key}")
        # An array: element type, count, elements.
        etype = self._value_type(f"{key}[]")
        count = self._u64(f"the length of metadata {key}")
        if etype in _SCALAR_DTYPES:
            dtype = _SCALAR_DTYPES[etype]
            pos = self._take(count * dtype.itemsize, f"metadata {key} ({count} values)")
            return np.frombuffer(self.buffer, dtype=dtype, count=count, offset=pos)
        if etype == GGUFValueType.STRING:
            start = self._pos
            self._pos = self._skip_strings(key, count)
            return GGUFStringArray(self.buffer, self.where, key, start, count)
        return [self._value(f"{key}[{i}]", etype) for i in range(count)]  # nested arrays: rare

    def _skip_strings(self, key: str, count: int) -> int:
        """The position past the `count` strings of array `key` that start here (walked
        without building them: a vocabulary has 10^5 of them)."""
        buf, size, pos, unpack = self.buffer, self.size, self._pos, _U64.unpack_from
        for i in range(count):
            if pos + 8 > size:
                raise self.error(f"is truncated: metadata {key}[{i}] at byte {pos} runs past the end "
                                 f"({size} bytes)")
            pos += 8 + unpack(buf, pos)[0]
        if pos > size:
            raise self.error(f"is truncated: metadata {key}[{count - 1}] ends at byte {pos}, the file has {size}")
        return pos

    def _alignment(self) -> int:
        if "general.alignment" not in self.metadata:
            return DEFAULT_ALIGNMENT
        value = self.metadata["general.alignment"]
        if self.value_types["general.alignment"] != GGUFValueType.UINT32 or value <= 0 or value & (value - 1):
            raise self.error(f"metadata general.alignment={value!r} is not a power of two stored as uint32")
        return value

    def _tensor_info(self) -> tuple[str, tuple[int, ...], int, int]:
        name = self._string("a tensor name")
        n_dims = self._scalar("<I", f"the dimension count of tensor {name!r}")
        if n_dims > MAX_DIMS:
            raise self.error(f"tensor {name!r} has {n_dims} dimensions, more than GGUF's {MAX_DIMS}")
        pos = self._take(8 * n_dims, f"the dimensions of tensor {name!r}")
        dims = struct.unpack_from(f"<{n_dims}Q", self.buffer, pos)
        ttype = self._scalar("<I", f"the type of tensor {name!r}")
        offset = self._u64(f"the offset of tensor {name!r}")
        return name, dims, ttype, offset

    def _placed(self, name: str, dims: tuple[int, ...], raw_type: int, offset: int) -> GGUFTensorInfo:
        """The tensor's entry, after checking its type, its size and that it lies in the file."""
        try:
            ttype = GGMLQuantizationType(raw_type)
        except ValueError:
            raise self.error(f"tensor {name!r} has GGML type {raw_type}, which llmd does not know") from None
        block, type_size = GGML_QUANT_SIZES[ttype]
        n_elements = 1
        for d in dims:
            n_elements *= d
        if not dims or dims[0] % block:
            raise self.error(f"tensor {name!r} of type {ttype.name} has rows of {dims[0] if dims else 0} "
                             f"values, not a whole number of its {block}-value blocks")
        if offset % self.alignment:
            raise self.error(f"tensor {name!r} starts at data offset {offset}, not a multiple of the "
                             f"alignment {self.alignment}")
        n_bytes = n_elements // block * type_size
        start = self.data_offset + offset
        if start + n_bytes > self.size:
            raise self.error(f"is truncated: tensor {name!r} ends at byte {start + n_bytes}, "
                             f"the file has {self.size}")
        return GGUFTensorInfo(name, ttype, tuple(dims), n_elements, n_bytes, start)
