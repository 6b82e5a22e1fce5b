"""Load a GGUF checkpoint (llama.cpp's one-file format) behind the same interface as an
HF directory: its metadata becomes a transformers config, its vocabulary a fast
tokenizer, its tensors the model's weights under HF names: packed rows of the types the
model keeps packed (gguf_quant), else dequantized at load by the `gguf` package. The file
is read by llmd's own reader (gguf_file), its tokenizer built by gguf_tokenizer.

What llmd cannot run as llama.cpp would is refused naming the metadata key or tensor: an
architecture other than llama (with experts: Mixtral), qwen2, qwen3, gemma2, gemma3, phi3,
smollm3, granite, qwen2moe and qwen3moe (gguf_arch.py says what each means), experts in another, partial
rotary (but phi3's), an unknown rope scaling type, per-frequency rope factors
(`rope_freqs.weight`, Llama 3.x's rope scaling) that llama.cpp would not apply
(gguf_rope.py reads them), or an unknown `{arch}.*`.
A file whose matrices are all BF16 (or F16, F32) says so as an HF checkpoint's dtype does
(an F16 file of bf16 values as BF16: gguf_types.file_dtype).

llama.cpp's converter reorders the rows of every llama q/k projection head so that its
rotary embedding can rotate adjacent pairs; llmd (like transformers) rotates halves, so
those rows are put back in HF order here (transformers' GGUF loader undoes the same).

A 3-D expert tensor (`ffn_gate_exps`: every expert's projection stacked) comes out as one
tensor per expert, under the name an HF checkpoint gives that expert's projection."""
from __future__ import annotations

import functools
import re
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from llmd.gpu.layers.gguf_formats import reencoded
from llmd.gpu.layers.gguf_quant import PackedSource
from llmd.gpu.layers.gguf_types import dequantizable_types, file_dtype, supported_tensor_types
from llmd.gpu.models.gguf_arch import (ARCHITECTURES, BLOCK_TENSORS, EXPERT, GLOBAL_TENSORS, GGUFArchitecture,
                                       gguf_architecture)
from llmd.gpu.models.architectures import get_architecture
from llmd.gpu.models.gguf_file import GGUFFile
from llmd.gpu.models.gguf_rope import ROPE_TENSORS, gguf_rope_parameters
from llmd.gpu.models.gguf_split import files_stamp
from llmd.gpu.models.gguf_tokenizer import build_tokenizer, converter_available, end_of_generation_ids

_BLOCK_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_SKIPPED_BLOCK_TENSORS = {"attn_rot_embd"}  # old converters' rotary inverse frequencies: derived
# A dense type's tensor as the file holds it: numpy's view of its bytes, then torch's.
_AS_HELD = {"F32": (np.float32, torch.float32), "F16": (np.float16, torch.float16), "BF16": (np.int16, torch.bfloat16)}
SHARED_EXPERT_GATE = "mlp.shared_expert_gate.weight"  # Qwen2-MoE's: a vector in llama.cpp, [1, hidden] in HF


def is_gguf_path(path: str | Path) -> bool:
    """A model path that is a file (not an HF directory) is read as GGUF."""
    return Path(path).is_file()


@functools.lru_cache(maxsize=4)
def _open_cached(path: str, stamp: tuple[tuple[int, int], ...]) -> GGUFFile:
    g = GGUFFile(path)
    _ = g.architecture  # a GGUF without one is not a model: refused at open
    return g


def open_gguf(path: str | Path) -> GGUFFile:
    """The opened file (gguf_file; a split model's shards with its first), shared by
    every reader in this process until a file changes or release_gguf_readers is called."""
    p = Path(path).resolve()
    return _open_cached(str(p), files_stamp(p))


def release_gguf_readers() -> None:
    """Forget the opened files: their maps of the file (whose pages a loaded model no
    longer reads: it holds its own copies) close with the last view of them."""
    _open_cached.cache_clear()


def load_gguf_config(path: str | Path):
    """The transformers config the GGUF's metadata describes (`architectures` set to the
    llmd model that runs it), or ValueError naming what llmd does not implement."""
    from transformers import AutoConfig

    g = open_gguf(path)
    where = repr(str(path))
    spec = _supported_architecture(g, where)
    a = g.architecture
    heads, kv_heads, hidden, head_dim, rotary_dim = _attention_sizes(g, a, where, spec.partial_rotary)
    fields: dict[str, Any] = dict(
        architectures=[spec.hf_architecture],
        vocab_size=_vocab_size(g, a, where),
        hidden_size=hidden,
        intermediate_size=_int(g, f"{a}.feed_forward_length"),
        num_hidden_layers=_int(g, f"{a}.block_count"),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=_int(g, f"{a}.context_length"),
        rms_norm_eps=float(g.require(f"{a}.attention.layer_norm_rms_epsilon")),
        rope_parameters=gguf_rope_parameters(g, a, where, head_dim, rotary_dim, spec),
        tie_word_embeddings="output.weight" not in g.tensors,
        hidden_act="silu",
        bos_token_id=g.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=g.get("tokenizer.ggml.eos_token_id"),
        pad_token_id=g.get("tokenizer.ggml.padding_token_id"), dtype=file_dtype(g),
    )
    if spec.hf_architecture in ("LlamaForCausalLM", "SmolLM3ForCausalLM", "GraniteForCausalLM"):
        fields["attention_bias"] = "blk.0.attn_q.bias" in g.tensors
        fields["mlp_bias"] = "blk.0.ffn_up.bias" in g.tensors
    if a in ("qwen2", "qwen2moe"):
        fields.pop("head_dim")  # Qwen2Config and Qwen2MoeConfig derive it; key_length must agree
        if head_dim != hidden // heads:
            raise ValueError(f"{where}: GGUF metadata {a}.attention.key_length={head_dim} differs from "
                             f"embedding_length / head_count = {hidden // heads}: not implemented for qwen2")
    if spec.config_fields is not None:
        try:
            fields.update(spec.config_fields(g.get, a, fields))
        except ValueError as exc:  # a key the architecture needs is missing
            raise ValueError(f"{where}: {exc}") from None
    if spec.config_class is not None:
        config = spec.config_class(**fields)
    else:
        config = AutoConfig.for_model(spec.model_type, **fields)
    get_architecture(spec.hf_architecture).check_config(config)
    return config


def _supported_architecture(g: GGUFFile, where: str) -> GGUFArchitecture:
    """The file's architecture, after checking from the header alone that llmd runs it as
    llama.cpp would: every `{arch}.*` key known, experts only where the architecture has
    them, every tensor placeable."""
    spec = file_architecture(g)
    if spec is None:
        raise ValueError(f"{where}: GGUF architecture {g.architecture!r} is not implemented by llmd "
                         f"(supported: {', '.join(sorted(ARCHITECTURES))})")
    a = g.architecture
    unknown = sorted(k for k in g.metadata if k.startswith(a + ".") and k[len(a) + 1:] not in spec.known_keys)
    if unknown:
        raise ValueError(f"{where}: GGUF metadata {', '.join(unknown)} is not implemented by llmd for "
                         f"architecture {a!r}; refusing rather than running the model differently")
    for key in ("expert_count", "expert_used_count"):
        if g.get(f"{a}.{key}", 0) and not spec.moe:
            raise ValueError(f"{where}: GGUF metadata {a}.{key}={g.get(f'{a}.{key}')}: mixture-of-experts "
                             f"models of architecture {a!r} are not implemented by llmd")
    _check_tensors(g, where, spec)
    return spec


def file_architecture(g: GGUFFile) -> GGUFArchitecture | None:
    """What the file runs as (gguf_arch.gguf_architecture; None: not implemented)."""
    a = g.architecture
    try:
        experts = int(g.get(f"{a}.expert_count", 0) or 0)
    except (TypeError, ValueError):
        raise ValueError(f"{str(g.path)!r}: GGUF metadata {a}.expert_count={g.get(f'{a}.expert_count')!r} "
                         "is not a number") from None
    return gguf_architecture(a, experts)


def _attention_sizes(g: GGUFFile, a: str, where: str, partial: bool) -> tuple[int, int, int, int, int]:
    """(heads, kv heads, hidden size, head size, rotated dimensions); refuses value heads of
    another size, and partial rotary where the architecture has none (`partial`)."""
    heads = _int(g, f"{a}.attention.head_count")
    kv_heads = _int(g, f"{a}.attention.head_count_kv", heads)
    hidden = _int(g, f"{a}.embedding_length")
    head_dim = _int(g, f"{a}.attention.key_length", hidden // heads)
    value_dim = _int(g, f"{a}.attention.value_length", head_dim)
    if value_dim != head_dim:
        raise ValueError(f"{where}: GGUF metadata {a}.attention.value_length={value_dim} differs from the key "
                         f"length {head_dim}: not implemented by llmd")
    rotary_dim = _int(g, f"{a}.rope.dimension_count", head_dim)
    if rotary_dim != head_dim and not (partial and 0 < rotary_dim < head_dim and rotary_dim % 2 == 0):
        raise ValueError(f"{where}: GGUF metadata {a}.rope.dimension_count={rotary_dim} differs from the head "
                         f"size {head_dim} (partial rotary): not implemented by llmd for architecture {a!r}")
    return heads, kv_heads, hidden, head_dim, rotary_dim


def _vocab_size(g: GGUFFile, a: str, where: str) -> int:
    """The rows of the embedding, which `{arch}.vocab_size` must agree with when given."""
    embed = g.tensors.get("token_embd.weight")
    if embed is None:
        raise ValueError(f"{where}: GGUF has no token_embd.weight tensor")
    vocab_size = int(embed.shape[1])  # ggml shapes list the fastest-varying dimension first
    declared_vocab = g.get(f"{a}.vocab_size")
    if declared_vocab is not None and int(declared_vocab) != vocab_size:
        raise ValueError(f"{where}: GGUF metadata {a}.vocab_size={declared_vocab} but token_embd.weight has "
                         f"{vocab_size} rows")
    return vocab_size


def _int(g: GGUFFile, key: str, default: int | None = None) -> int:
    value = g.get(key, default)
    if value is None:
        raise ValueError(f"{str(g.path)!r}: GGUF metadata {key} is missing")
    if isinstance(value, list | np.ndarray):  # per layer
        value = [int(v) for v in value]
        if len(set(value)) != 1:
            raise ValueError(f"{str(g.path)!r}: GGUF metadata {key} differs between layers ({value}): "
                             "per-layer sizes are not implemented by llmd")
        value = value[0]
    return int(value)


def _check_tensors(g: GGUFFile, where: str, spec: GGUFArchitecture) -> None:
    """Every tensor has an llmd parameter to go to and a type the gguf package can
    dequantize: checked from the header, before any weight is read."""
    types = dequantizable_types()
    for name, t in g.tensors.items():
        if name in ROPE_TENSORS:
            continue  # not a weight: the rope parameters (gguf_rope), checked with them
        hf_name = hf_tensor_name(name, spec.block_tensors)
        if hf_name is None and not _is_skipped(name):
            raise ValueError(f"{where}: GGUF tensor {name!r} has no counterpart in llmd's "
                             f"{g.architecture} model ({spec.hf_architecture})")
        try:
            hf_expert_names(hf_name or "", t.torch_shape)
        except ValueError as exc:
            raise ValueError(f"{where}: GGUF tensor {name!r}: {exc}") from None
        if t.tensor_type not in types:
            raise ValueError(f"{where}: GGUF tensor {name!r} has type {t.tensor_type.name}, which llmd cannot "
                             f"dequantize (supported: {', '.join(supported_tensor_types())})")


def _is_skipped(name: str) -> bool:
    """Tensors that are not weights: read into the config (rope factors) or derived from it."""
    m = _BLOCK_NAME.fullmatch(name)
    return name in ROPE_TENSORS or (m is not None and m.group(2) in _SKIPPED_BLOCK_TENSORS)


def hf_tensor_name(name: str, block_tensors: dict[str, str] = BLOCK_TENSORS) -> str | None:
    """The HF checkpoint name of GGUF tensor `name` (None: no counterpart), block
    tensors named by the architecture's `block_tensors`; an expert tensor's holds EXPERT
    where each expert's index goes (hf_expert_names)."""
    if name in GLOBAL_TENSORS:
        return GLOBAL_TENSORS[name]
    m = _BLOCK_NAME.fullmatch(name)
    if m is None or m.group(2) not in block_tensors:
        return None
    return f"model.layers.{m.group(1)}.{block_tensors[m.group(2)]}.{m.group(3)}"


def hf_expert_names(hf_name: str, shape: tuple[int, ...]) -> list[str] | None:
    """The HF name of each expert's projection in an expert tensor of torch shape `shape`
    ([experts, rows, cols]); None for a tensor of one weight."""
    if EXPERT not in hf_name:
        return None
    if len(shape) != 3:
        raise ValueError(f"an expert tensor must have 3 dimensions [experts, rows, columns], has shape {shape}")
    return [hf_name.replace(EXPERT, str(e)) for e in range(shape[0])]


def unpermute_rotary_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Inverse of llama.cpp's `permute` (convert_hf_to_gguf.py): within each head, rows
    were reordered from HF's [first half, second half] to interleaved pairs."""
    rest = w.shape[1:]
    return w.reshape(n_heads, w.shape[0] // n_heads // 2, 2, *rest).swapaxes(1, 2).reshape(w.shape)


def gguf_tensor_types(path: str | Path) -> dict[str, tuple[str, str]]:
    """HF name -> (GGUF name, GGUF type name: F32, Q4_K, ...) of every weight of the file
    (each expert's projection of an expert tensor under its own HF name)."""
    g = open_gguf(path)
    spec = file_architecture(g)
    types = {}
    for name, t in g.tensors.items():
        if _is_skipped(name) or (hf := hf_tensor_name(name, spec.block_tensors)) is None:
            continue
        for one in hf_expert_names(hf, t.torch_shape) or [hf]:
            types[one] = (name, t.tensor_type.name)
    return types


def iter_gguf_weights(path: str | Path, config: Any,
                      packed: Mapping[str, str] | None = None) -> Iterator[tuple[str, torch.Tensor | PackedSource]]:
    """(HF name, tensor) for every weight of the GGUF, one at a time: dense ones as the file
    holds them, others dequantized to float32 (with TP each rank reads the whole tensor and
    its layer keeps its piece); one named in `packed` ({HF name: the type it is held in}) as
    its packed rows (PackedSource, a layer taking its share; re-encoded where held in
    another type than the file's, gguf_formats.HELD_AS); q/k rows unpermuted."""
    from gguf.quants import dequantize

    g = open_gguf(path)
    spec = file_architecture(g)
    for name, t in g.tensors.items():
        if _is_skipped(name):
            continue
        hf_name = hf_tensor_name(name, spec.block_tensors)
        if hf_name is None:
            raise ValueError(f"{str(path)!r}: GGUF tensor {name!r} has no counterpart in llmd's model")
        shape = t.torch_shape
        experts = hf_expert_names(hf_name, shape)  # an expert tensor: a weight per expert
        hf_names = experts or [hf_name]
        if hf_names[0] in (packed or {}):
            held, quant = packed[hf_names[0]], t.tensor_type.name
            pieces = g.tensor_data(t).reshape(len(hf_names), shape[-2], -1)
            for one, rows in zip(hf_names, pieces):
                rows = _unpermuted(rows, name, spec, config)
                if held == quant:
                    yield one, MappedPackedSource(quant, rows, shape[-2:], g)
                    continue
                try:  # re-encoded into the type it is held in (a copy, not the map)
                    yield one, PackedSource(held, reencoded(quant, rows, held), shape[-2:])
                except ValueError as exc:
                    raise ValueError(f"{str(path)!r}: GGUF tensor {name!r} of type {quant}: {exc}") from None
            g.drop_pages(t)  # the model copied it
            continue
        offset = spec.norm_offset if name.endswith("norm.weight") else 0
        # (dequantized, an F16 / BF16 tensor was a float32 array twice it; the model's copy casts)
        held = None if offset else _AS_HELD.get(t.tensor_type.name)
        try:
            array = g.tensor_data(t).view(held[0]) if held else dequantize(g.tensor_data(t), t.tensor_type)
        except NotImplementedError as exc:
            raise ValueError(f"{str(path)!r}: GGUF tensor {name!r} of type {t.tensor_type.name}: {exc}") from None
        array = (array if held else np.asarray(array, dtype=np.float32)).reshape(shape)
        if offset:
            array = array - np.float32(offset)
        if hf_name.endswith(SHARED_EXPERT_GATE) and array.ndim == 1:
            array = array[None]  # llama.cpp's [hidden]: the HF layer's one row
        array = _unpermuted(array, name, spec, config)
        if not (array.flags.writeable and array.flags.c_contiguous):
            array = np.array(array, order="C")  # a dense tensor is a read-only view of the file's map
        for one, piece in zip(hf_names, array if experts else [array]):
            yield one, torch.from_numpy(piece).view(held[1]) if held else torch.from_numpy(piece)
        g.drop_pages(t)


@dataclass
class MappedPackedSource(PackedSource):
    """Packed rows that the layer reads straight from the file's map: its rows come as
    tensors viewing the map, not as copies (PackedSource copies, as the map is read-only),
    so loading a weight does not hold a third copy of it (the file's pages and the
    layer's weight are the other two: Gemma 3's 171 MB vocabulary table). Each view
    carries `drop_pages` (the file's GGUFFile.drop_memory), with which the layer's copy
    (linear.copy_checked) drops the file's pages of the rows it has copied as it goes, so
    the two are not both resident either. The layers only read a source (linear.read,
    copy_checked); the map is read-only, so one that wrote to it would fault rather than
    change the file."""

    file: GGUFFile | None = None

    def __getitem__(self, index) -> torch.Tensor:
        if not isinstance(index, slice) or not self.data.flags.c_contiguous:
            return super().__getitem__(index)  # its error, its columns, or a copy of a share of them
        with warnings.catch_warnings():  # torch warns that it cannot write to the view: it won't
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            view = torch.from_numpy(self.data[index])
        if self.file is not None:
            view.drop_pages = self.file.drop_memory
        return view


def _unpermuted(rows: np.ndarray, name: str, spec: GGUFArchitecture, config: Any) -> np.ndarray:
    """q and k rows (dequantized or packed: whole rows either way) in HF's order."""
    if spec.permuted_rotary:
        if ".attn_q." in name:
            return unpermute_rotary_rows(rows, config.num_attention_heads)
        if ".attn_k." in name:
            return unpermute_rotary_rows(rows, config.num_key_value_heads)
    return rows


def load_gguf_tokenizer(path: str | Path):
    """The fast tokenizer transformers builds from the GGUF's vocabulary, merges, special
    tokens and chat template (`from_pretrained(gguf_file=)`'s), built from the fields
    this module's reader already holds (gguf_tokenizer)."""
    if converter_available():
        return build_tokenizer(open_gguf(path))
    from transformers import PreTrainedTokenizerFast

    p = Path(path).resolve()
    try:  # a transformers without the conversion gguf_tokenizer calls: it reads the file itself
        return PreTrainedTokenizerFast.from_pretrained(str(p.parent), gguf_file=p.name, local_files_only=True)
    except (ValueError, KeyError) as exc:
        raise ValueError(f"{str(path)!r}: cannot build a tokenizer from the GGUF's vocabulary ({exc})") from None


def gguf_stop_token_ids(path: str | Path) -> set[int]:
    """End-of-generation ids beside EOS that llama.cpp stops on (gguf_tokenizer's
    end_of_generation_ids: end of turn and of message, by id and by text)."""
    return end_of_generation_ids(open_gguf(path))
