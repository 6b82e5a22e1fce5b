"""llmd's GGUF reader (gguf_file) reads what the `gguf` package's GGUFReader reads:
every metadata value and type, every tensor's name, type, shape, size, offset and bytes,
on the fixture GGUFs of every type the tests write, one holding every metadata type, and
the real SmolLM2 and Gemma 3 files (checked against transformers' own GGUF reader: the
gguf package takes a minute and ~700 MB for Gemma's vocabulary; LLMD_GGUF_PY_REFERENCE=1
checks them against it too). Bad files are a GGUFFormatError naming the file and the
problem, at every truncation point of a file. Opening Gemma's file allocates kilobytes,
not the gguf package's ~700 MB, and its map closes as soon as the loader lets go."""
from __future__ import annotations

import gc
import os
import re
import struct
import tracemalloc
import weakref
from pathlib import Path

import numpy as np
import pytest
import torch

import gguf
from gguf import GGMLQuantizationType as T
from gguf import GGUFValueType as V
from llmd.gpu.layers import linear
from llmd.gpu.layers.gguf_quant import PackedSource
from llmd.gpu.models import gguf_loader
from llmd.gpu.models.gguf_file import GGUFFile, GGUFFormatError, GGUFStringArray
from test_gguf import K_QUANTS, ggufs, hf_dirs  # noqa: F401

FIXTURE_FILES = [("llama", T.F32, ()), ("llama", T.Q8_0, ()), ("llama-tied", T.Q4_1, ()), ("qwen2", T.F16, ()),
                 ("qwen3", T.BF16, ()), ("llama-256", T.F32, K_QUANTS)]


def assert_same_as_gguf_py(path: Path | str) -> None:
    """Every field and tensor of `path` as gguf.GGUFReader reads it."""
    ref, ours = gguf.GGUFReader(str(path)), GGUFFile(path)
    assert (ours.version, ours.tensor_count, ours.kv_count) == tuple(
        ref.fields[f"GGUF.{k}"].contents() for k in ("version", "tensor_count", "kv_count"))
    keys = [k for k in ref.fields if not k.startswith("GGUF.")]
    assert list(ours.metadata) == keys
    for key in keys:
        field, got = ref.fields[key], ours.metadata[key]
        assert ours.value_types[key] == field.types[0], key
        want = field.contents()
        if isinstance(got, np.ndarray):
            assert got.tolist() == want and not got.flags.writeable, key
            if len(field.data):
                assert got.dtype == field.parts[field.data[0]].dtype, key
        elif isinstance(got, GGUFStringArray):
            assert len(got) == len(want) and got.tolist() == want and list(got) == want, key
            assert [got[i] for i in (0, len(want) // 2, -1)] == [want[0], want[len(want) // 2], want[-1]], key
        else:
            assert got == want and type(got) is type(want), key
    assert list(ours.tensors) == [t.name for t in ref.tensors]
    assert ours.data_offset == ref.data_offset and ours.alignment == ref.alignment
    for t in ref.tensors:
        info = ours.tensors[t.name]
        assert (info.tensor_type, info.shape, info.n_elements, info.n_bytes, info.data_offset) == (
            t.tensor_type, tuple(t.shape.tolist()), t.n_elements, t.n_bytes, t.data_offset), t.name
        data = ours.tensor_data(info)
        assert (data.dtype, data.shape) == (t.data.dtype, t.data.shape) and not data.flags.writeable, t.name
        assert np.array_equal(data.reshape(-1).view(np.uint8), t.data.reshape(-1).view(np.uint8)), t.name


def assert_same_as_transformers_reader(path: Path) -> None:
    """Every field and tensor of `path` as transformers' GGUF reader reads it (it reads the
    string arrays it is asked for, and counts the others), the bytes of every tensor
    as plain file reads give them."""
    from transformers.integrations.gguf.reader import _read_metadata, _read_tensor_table, read_gguf_metadata

    wanted = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges")
    ref, _ = read_gguf_metadata(str(path), wanted)
    ours = GGUFFile(path)
    assert list(ours.metadata) == list(ref)
    for key, want in ref.items():
        got = ours.metadata[key]
        if isinstance(got, GGUFStringArray):
            assert (got.tolist() == want) if key in wanted else (len(got) == want), key
        elif isinstance(got, np.ndarray):
            assert got.tolist() == want, key
        else:
            assert got == want and type(got) is type(want), key
    # its tensor table as it reads it (GgufHeader, which would size them, knows no Q5_0)
    blob = np.memmap(str(path), mode="r", dtype=np.uint8)
    _, count, pos = _read_metadata(blob, str(path))
    entries, end = _read_tensor_table(blob, count, pos)
    alignment = ref.get("general.alignment", 32)
    data_start = -(-end // alignment) * alignment
    assert [name for name, *_ in entries] == list(ours.tensors)
    with open(path, "rb") as f:
        for name, shape, ggml_type, offset in entries:
            info = ours.tensors[name]
            block, type_size = gguf.GGML_QUANT_SIZES[T(ggml_type)]
            assert (info.torch_shape, int(info.tensor_type), info.data_offset, info.n_bytes) == (
                shape, ggml_type, data_start + offset, int(np.prod(shape)) // block * type_size), name
            f.seek(data_start + offset)
            assert ours.tensor_data(info).tobytes() == f.read(info.n_bytes), name


@pytest.mark.parametrize("name,qtype,k_quants", FIXTURE_FILES,
                         ids=["-".join(q.name for q in k) or f"{n}-{q.name}" for n, q, k in FIXTURE_FILES])
def test_reader_reads_the_fixtures_as_the_gguf_package_does(ggufs, name, qtype, k_quants):  # noqa: F811
    assert_same_as_gguf_py(ggufs(name, qtype, k_quants))


def test_reader_reads_every_metadata_type_as_the_gguf_package_does(tmp_path):
    """Each scalar type, arrays of each, strings with multi-byte UTF-8,
    a string array with an empty string, general.alignment, typed tensors and a 3-D one
    (not F64: the gguf package's reader misreads the F64 tensors its writer writes)."""
    path = tmp_path / "types.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    numeric = {V.UINT8: 200, V.INT8: -100, V.UINT16: 60000, V.INT16: -30000, V.UINT32: 4_000_000_000,
               V.INT32: -2_000_000_000, V.FLOAT32: 0.1, V.UINT64: 2**63 + 5, V.INT64: -(2**62), V.FLOAT64: 1 / 3,
               V.BOOL: True}
    for vtype, value in numeric.items():
        w.add_key_value(f"test.scalar.{vtype.name.lower()}", value, vtype)
        w.add_key_value(f"test.array.{vtype.name.lower()}", [value, value, value], V.ARRAY, sub_type=vtype)
    w.add_key_value("test.string", "héllo wörld — 日本語 🤖", V.STRING)
    w.add_key_value("test.strings", ["a", "", "ünï", "🤖" * 3, " "], V.ARRAY, sub_type=V.STRING)
    w.add_key_value("general.alignment", 64, V.UINT32)
    w.add_tensor("f16", np.arange(64, dtype=np.float16).reshape(2, 32))
    w.add_tensor("i8", np.arange(-32, 32, dtype=np.int8))
    w.add_tensor("i32", np.arange(96, dtype=np.int32).reshape(2, 3, 16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert_same_as_gguf_py(path)
    g = GGUFFile(path)
    assert g.alignment == 64 and g.data_offset % 64 == 0
    assert g.get("test.scalar.float32") == float(np.float32(0.1)) and g.get("test.scalar.bool") is True
    assert g.get("test.strings")[2] == "ünï" and g.get("test.strings")[1:3] == ["", "ünï"]
    assert g.tensor_data("i32").shape == (2, 3, 16) and g.tensors["i32"].shape == (16, 3, 2)


def test_reader_reads_the_builtin_model_as_transformers_does(builtin_gguf):
    assert_same_as_transformers_reader(builtin_gguf)
    if os.environ.get("LLMD_GGUF_PY_REFERENCE"):
        assert_same_as_gguf_py(builtin_gguf)


def test_reader_reads_gemma3_as_transformers_does(gemma3_270m):
    assert_same_as_transformers_reader(gemma3_270m)
    if os.environ.get("LLMD_GGUF_PY_REFERENCE"):
        assert_same_as_gguf_py(gemma3_270m)


def test_opening_gemma3_allocates_kilobytes(gemma3_270m):
    """A 262,144-token vocabulary costs its walk, not an object per token: the gguf
    package's reader allocates ~700 MB of numpy views here (tracemalloc sees numpy's
    allocations too); the bound leaves room for the reader's own few KB twentyfold."""
    tracemalloc.start()
    try:
        g = GGUFFile(gemma3_270m)
        opened = tracemalloc.get_traced_memory()[1]
        tokens = g.get("tokenizer.ggml.tokens")
        assert tokens[105] == "<start_of_turn>"  # indexing records one offset a token
        indexed = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(tokens) == 262144 and len(g.tensors) == 236
    assert opened < 4 << 20, f"opening allocated {opened / 2**20:.1f} MiB at its peak"
    assert indexed < 8 << 20, f"indexing the vocabulary allocated {indexed / 2**20:.1f} MiB at its peak"


def test_released_reader_closes_its_map_at_once(ggufs):  # noqa: F811
    """No reference cycle holds the map: once the loader's cache lets go (and no view is
    held), the file is unmapped without the cyclic collector."""
    path = ggufs("llama", T.Q8_0)
    gc.disable()
    try:
        g = gguf_loader.open_gguf(path)
        g.get("tokenizer.ggml.tokens")[3]  # the string array's offsets too
        ref = weakref.ref(g)
        del g
        gguf_loader.release_gguf_readers()
        assert ref() is None
    finally:
        gc.enable()


def _resident_kib(path: Path) -> int:
    """KiB of `path`'s maps resident in this process (/proc/self/smaps' Rss)."""
    target, total, ours = str(Path(path).resolve()), 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            if re.match(r"[0-9a-f]+-[0-9a-f]+ ", line):
                fields = line.split(maxsplit=5)
                ours = len(fields) == 6 and fields[5].strip() == target
            elif ours and line.startswith("Rss:"):
                total += int(line.split()[1])
    return total


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="reads Linux's /proc/self/smaps")
def test_a_weight_copied_from_the_map_leaves_the_files_pages_out_of_memory(tmp_path, monkeypatch):
    """A layer's copy of a tensor viewing the file's map (linear.copy_checked of
    MappedPackedSource's rows) drops the pages of the rows copied as it goes, so the load never
    holds the weight twice: after copying 17 MiB in 1 MiB slices, less than a slice of
    the file is resident (all of it before), and the copy is the file's bytes, whole or
    in part; a source that is a copy (PackedSource) is copied as it is. While it copies,
    the file's resident pages stay under a slice and two 2 MiB folios (the kernel may
    map a file's pages 2 MiB at a time)."""
    monkeypatch.setattr(linear, "COPY_SLICE_BYTES", 1 << 20)
    rows = np.random.default_rng(0).integers(0, 256, size=(4096, 4096 // 32 * 34), dtype=np.uint8)
    w = gguf.GGUFWriter(str(tmp_path / "w.gguf"), "llama")
    w.add_tensor("w", rows, raw_dtype=T.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    g = GGUFFile(tmp_path / "w.gguf")
    data = g.tensor_data("w")
    source = gguf_loader.MappedPackedSource("Q8_0", data, (4096, 4096), g)
    whole = source[:]
    assert int(whole.sum()) == int(rows.sum())  # every page read: resident
    assert _resident_kib(tmp_path / "w.gguf") >= rows.nbytes >> 10
    g.drop_memory(whole.data_ptr(), whole.nbytes)
    assert _resident_kib(tmp_path / "w.gguf") < 1 << 10
    resident = []  # the file's pages as each slice is copied, before they are dropped
    whole.drop_pages = lambda address, nbytes: (resident.append(_resident_kib(tmp_path / "w.gguf")),
                                               g.drop_memory(address, nbytes))
    target = torch.empty(rows.shape, dtype=torch.uint8)
    linear.copy_checked(target, whole)
    assert torch.equal(target, torch.from_numpy(rows))
    assert len(resident) == -(-4096 // ((1 << 20) // rows.shape[1]))  # slices of 240 rows
    assert max(resident) <= (1 << 10) + (4 << 10), resident
    assert _resident_kib(tmp_path / "w.gguf") < 1 << 10
    part = torch.empty(100, rows.shape[1], dtype=torch.uint8)
    linear.copy_checked(part, source[1000:1100])  # the pages read again from the page cache
    assert torch.equal(part, torch.from_numpy(rows[1000:1100]))
    linear.copy_checked(target, PackedSource("Q8_0", data, (4096, 4096))[:])
    assert torch.equal(target, torch.from_numpy(rows))
    with pytest.raises(ValueError, match=r"has shape \(100, 4352\), expected \(4096, 4352\)"):
        linear.copy_checked(target, source[:100])


# -- bad files: GGUFFormatError naming the file and the problem ------------------------------

def where(path: Path) -> str:
    """How an error names the file, as a pattern."""
    return re.escape(repr(str(path)))


def _str(s: str | bytes) -> bytes:
    raw = s.encode() if isinstance(s, str) else s
    return struct.pack("<Q", len(raw)) + raw


def _kv(key: str | bytes, vtype: int, payload: bytes) -> bytes:
    return _str(key) + struct.pack("<I", vtype) + payload


def _tensor(name: str, dims: tuple[int, ...], ttype: int, offset: int) -> bytes:
    return _str(name) + struct.pack(f"<I{len(dims)}QIQ", len(dims), *dims, ttype, offset)


def _file(kvs: list[bytes], tensors: list[bytes] = (), data: bytes = b"", version: int = 3,
          magic: bytes = b"GGUF") -> bytes:
    """A GGUF written by hand (independently of any writer), data padded to 32 bytes."""
    head = magic + struct.pack("<IQQ", version, len(tensors), len(kvs)) + b"".join(kvs) + b"".join(tensors)
    return head + b"\0" * (-len(head) % 32) + data


ARCH = _kv("general.architecture", V.STRING, _str("llama"))
F32_W = _tensor("w", (4,), T.F32, 0)

BAD_FILES = {
    "wrong magic": (_file([ARCH], magic=b"GGUX"), r"is not a GGUF file: it starts with b'GGUX', not the GGUF magic"),
    "empty": (b"", r"is not a GGUF file: it starts with b''"),
    "version 4": (_file([ARCH], version=4), r"has GGUF version 4, which llmd does not read \(supported: 2, 3\)"),
    "version 1": (_file([ARCH], version=1), r"has GGUF version 1, which llmd does not read"),
    "unknown value type": (_file([ARCH, _kv("general.x", 99, b"")]), r"metadata general.x has unknown value type 99"),
    "unknown tensor type": (_file([ARCH], [_tensor("w", (4,), 99, 0)], b"\0" * 16),
                            r"tensor 'w' has GGML type 99, which llmd does not know"),
    "tensor past the end": (_file([ARCH], [_tensor("w", (4,), T.F32, 32)], b"\0" * 16),
                            r"is truncated: tensor 'w' ends at byte \d+, the file has \d+"),
    "unaligned tensor": (_file([ARCH], [_tensor("w", (4,), T.F32, 4)], b"\0" * 64),
                         r"tensor 'w' starts at data offset 4, not a multiple of the alignment 32"),
    "partial block": (_file([ARCH], [_tensor("w", (31,), T.Q8_0, 0)], b"\0" * 64),
                      r"tensor 'w' of type Q8_0 has rows of 31 values, not a whole number of its 32-value blocks"),
    "five dimensions": (_file([ARCH], [_tensor("w", (1, 1, 1, 1, 4), T.F32, 0)], b"\0" * 16),
                        r"tensor 'w' has 5 dimensions, more than GGUF's 4"),
    "huge string": (_file([ARCH, _kv("general.name", V.STRING, struct.pack("<Q", 2**64 - 1))]),
                    r"is truncated: metadata general.name at byte \d+ needs 18446744073709551615 bytes"),
    "huge array": (_file([ARCH, _kv("test.a", V.ARRAY, struct.pack("<IQ", V.UINT32, 2**62))]),
                   r"is truncated: metadata test.a \(4611686018427387904 values\) at byte \d+ needs"),
    "huge string array": (_file([ARCH, _kv("test.s", V.ARRAY, struct.pack("<IQ", V.STRING, 2**62) + _str("a"))]),
                          r"is truncated: metadata test.s\[\d+\] at byte \d+ runs past the end"),
    "duplicate key": (_file([ARCH, ARCH]), r"metadata general.architecture appears twice"),
    "duplicate tensor": (_file([ARCH], [F32_W, F32_W], b"\0" * 16), r"tensor 'w' appears twice"),
    "key not UTF-8": (_file([_kv(b"general.\xff", V.UINT32, b"\0" * 4)]), r"a metadata key at byte 32 is not UTF-8"),
    "alignment not a power of two": (_file([ARCH, _kv("general.alignment", V.UINT32, struct.pack("<I", 48))]),
                                     r"metadata general.alignment=48 is not a power of two stored as uint32"),
}


@pytest.mark.parametrize("case", list(BAD_FILES))
def test_bad_files_are_refused_naming_file_and_problem(tmp_path, case):
    content, message = BAD_FILES[case]
    path = tmp_path / "bad.gguf"
    path.write_bytes(content)
    with pytest.raises(GGUFFormatError, match=rf"^{where(path)}:? {message}"):
        GGUFFile(path)


def test_big_endian_file_is_refused_by_name(tmp_path):
    path = tmp_path / "be.gguf"
    w = gguf.GGUFWriter(str(path), "llama", endianess=gguf.GGUFEndian.BIG)
    w.add_tensor("w", np.ones(4, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(GGUFFormatError, match=rf"^{where(path)} is a big-endian GGUF \(version 3\): llmd reads "
                                              "little-endian GGUF only"):
        GGUFFile(path)


def test_string_array_that_is_not_utf8_fails_when_read(tmp_path):
    path = tmp_path / "tokens.gguf"
    tokens = struct.pack("<IQ", V.STRING, 2) + _str("ok") + _str(b"\xc3")
    path.write_bytes(_file([ARCH, _kv("tokenizer.ggml.tokens", V.ARRAY, tokens)]))
    g = GGUFFile(path)
    assert g.get("tokenizer.ggml.tokens")[0] == "ok"
    with pytest.raises(GGUFFormatError, match=rf"^{where(path)}: metadata tokenizer.ggml.tokens\[1\] is not UTF-8"):
        g.get("tokenizer.ggml.tokens").tolist()


def test_empty_and_nested_arrays(tmp_path):
    """What the gguf package's writer will not write: empty arrays, an array of arrays."""
    path = tmp_path / "arrays.gguf"
    nested = struct.pack("<IQ", V.ARRAY, 2) + struct.pack("<IQ2h", V.INT16, 2, 1, -2) + struct.pack("<IQ", V.STRING, 1)
    path.write_bytes(_file([ARCH, _kv("test.empty", V.ARRAY, struct.pack("<IQ", V.FLOAT32, 0)),
                            _kv("test.no_strings", V.ARRAY, struct.pack("<IQ", V.STRING, 0)),
                            _kv("test.nested", V.ARRAY, nested + _str("x")), _kv("test.after", V.UINT8, b"\x07")]))
    g = GGUFFile(path)
    assert g.get("test.empty").dtype == np.float32 and len(g.get("test.empty")) == 0
    assert g.get("test.no_strings").tolist() == [] and len(g.get("test.no_strings")) == 0
    first, second = g.get("test.nested")
    assert first.tolist() == [1, -2] and second.tolist() == ["x"] and g.get("test.after") == 7


def test_every_truncation_is_a_format_error(ggufs, tmp_path):  # noqa: F811
    """A fixture cut at a spread of points through its header, and just short of its
    end: each is a GGUFFormatError saying it is truncated (never struct's or numpy's
    exception), and the whole file opens."""
    data = Path(ggufs("llama", T.Q8_0)).read_bytes()
    header_end = GGUFFile(ggufs("llama", T.Q8_0)).data_offset
    cuts = sorted({*range(4, header_end, max(1, header_end // 300)), header_end, len(data) - 1})
    path = tmp_path / "cut.gguf"
    for cut in cuts:
        path.write_bytes(data[:cut])
        with pytest.raises(GGUFFormatError, match=rf"^{where(path)} is truncated: "):
            GGUFFile(path)
