"""What a listing of models says about a GGUF file (architecture, size, type, a digest),
read from its header alone, and kept while the file is unchanged: the HTTP APIs
describe the served model with it after the loader has let go of the file."""
from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass
from pathlib import Path

from llmd.gpu.models.gguf_file import GGUFFile
from llmd.gpu.models.gguf_loader import file_architecture, open_gguf
from llmd.gpu.models.gguf_split import files_stamp


@dataclass(frozen=True)
class GGUFSummary:
    """What a listing of models says about a GGUF, read from its header only."""

    architecture: str  # the HF architecture llmd runs it as, else the GGUF's own name
    num_params: int
    size_bytes: int
    header_sha256: str  # of the metadata and tensor tables: names the model without reading its weights
    quantization: str  # as llama.cpp and Ollama name the file's type: Q4_1, Q4_K_M, F16, ...


def gguf_summary(path: str | Path) -> GGUFSummary:
    """The file's summary (a split model's: every shard's), kept (it is small) until a
    file changes."""
    p = Path(path).resolve()
    return _summary(str(p), files_stamp(p))


@functools.lru_cache(maxsize=16)
def _summary(path: str, stamp: tuple[tuple[int, int], ...]) -> GGUFSummary:
    g = open_gguf(path)
    try:
        spec = file_architecture(g)
    except ValueError:  # an expert count that is not a number: the file's own name
        spec = None
    digest = hashlib.sha256()
    for index, shard in enumerate(g.shards):  # each file's header, up to its first tensor's data
        data_start = min((t.data_offset for t in g.tensors.values() if t.shard == index), default=shard.size)
        with shard.path.open("rb") as f:
            digest.update(f.read(data_start))
    return GGUFSummary(architecture=spec.hf_architecture if spec else g.architecture,
                       num_params=sum(int(t.n_elements) for t in g.tensors.values()),
                       size_bytes=g.total_size, header_sha256=digest.hexdigest(),
                       quantization=_file_type_name(g))


def _file_type_name(g: GGUFFile) -> str:
    """The file's type from general.file_type (llama.cpp's converters write it), else the
    type holding most of the matrices' elements (norms stay F32 in every file)."""
    from gguf import GGMLQuantizationType, LlamaFileType

    try:
        file_type = LlamaFileType(g.get("general.file_type"))
    except ValueError:  # absent, or a type newer than the gguf package
        file_type = LlamaFileType.GUESSED
    if file_type != LlamaFileType.GUESSED:
        return file_type.name.removeprefix("MOSTLY_").removeprefix("ALL_")
    elements: dict[str, int] = {}
    for t in g.tensors.values():
        if len(t.shape) >= 2:
            name = GGMLQuantizationType(t.tensor_type).name
            elements[name] = elements.get(name, 0) + int(t.n_elements)
    return max(elements, key=elements.__getitem__, default="F32")
