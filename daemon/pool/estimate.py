"""How much memory a model takes, per device, for the budget: before it loads, an
estimate from its files (its weights as the loader will hold them, below) plus its KV
pool as the engine settings size it; once loaded, what it holds (weights and KV pool as
the executor reports them).

The weights as held: where quantized weights stay packed, a GGUF's packed tensors in
the blocks of the type the device holds them as (gguf_types.held_bytes) and an
AWQ/GPTQ/FP8 checkpoint's quantized tensors at their size on disk (their CPU layouts
differ from it by a few percent: their scales are widened); every other tensor at the
run dtype; on CPU, where oneDNN packs the run dtype (cpu_linear), the dense linear
weights are held in its reordered layout instead of the checkpoint's, once, but for a
tied LM head's: its copy of the embedding comes beside the table the lookups read, so a
tied model holds its embedding twice. Reading a model's shape touches its files
(config.json and the safetensors headers, or a GGUF header) but no torch; the sums are
plain arithmetic."""
from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from llmd.config import KV_CACHE_FLOATS, EngineConfig
from llmd.gpu.layers.cpu.cpu_info import cpuinfo_field
from llmd.gpu.layers.gguf_types import DENSE_TYPES, file_dtype, held_block, held_bytes
from llmd.gpu.models.gguf_split import files_stamp
from llmd.gpu.layers.tp import split_share
from llmd.gpu.layers.quant.scheme import IntGroupScheme, config_scheme, weights_per_element

CPU_KV_DEFAULT_CAP = 4 << 30  # as llmd.engine_setup sizes a CPU KV pool with no setting
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
MAX_PADDED_TP = 8  # the act-order padding is counted for 2..8 ranks
_ROW_PARALLEL = (".o_proj.g_idx", ".down_proj.g_idx")  # the projections TP splits by input columns
_INDEX_DTYPES = {"I32": "<i4", "I64": "<i8"}
_FLOAT_TENSORS = ("F32", "F16", "BF16")  # safetensors dtypes held at the run dtype


@dataclass(frozen=True)
class ModelShape:
    """What the estimate needs from a model's files."""

    weights_bytes: int  # on disk
    num_params: int  # weight elements (what a dequantized model holds at its dtype)
    kv_elements_per_token: int  # K and V of every layer, per token
    max_position: int
    checkpoint_dtype: str | None
    gguf: bool
    quantized: bool = False  # an AWQ/GPTQ/FP8 safetensors checkpoint (kept packed on CPU, as a GGUF's)
    # Where quantized weights stay packed: those tensors' bytes as each device type holds
    # them, and the elements of every other tensor (held at the run dtype). None / 0 for
    # a dense checkpoint.
    packed_bytes: dict[str, int] | None = None
    dense_elements: int = 0
    # A tied LM head's elements (the embedding's), which oneDNN copies on CPU beside the
    # table: where quantized weights stay packed, only if the embedding is dense.
    tied_dense_elements: int = 0
    tied_elements: int = 0
    # (columns, block) of each packed down projection: with TP its intermediate dimension
    # is split in whole blocks (layers/tp.py), the first rank's share the largest
    split_widths: tuple[tuple[int, int], ...] = ()
    # GPTQ act-order projections split by their input columns under TP (o_proj, down_proj):
    # each rank's run of each group's columns is padded to whole blocks with zero weights
    # (int_groups.sorted_by_group). (tensor_parallel_size, the bytes the ranks add
    # together, the most one rank adds), for 2..MAX_PADDED_TP ranks.
    act_order_padding: tuple[tuple[int, int, int], ...] = ()

    def largest_share(self, tp: int) -> float:
        """The largest fraction of a split weight a rank holds at tensor_parallel_size `tp`."""
        shares = [1 / tp] + [(end - start) / size for size, unit in self.split_widths
                             if size % unit == 0 and size // unit >= tp
                             for start, end in [split_share(size, 0, tp, unit)]]
        return max(shares)

    def padding(self, tp: int) -> tuple[int, int]:
        """(bytes every rank's act-order padding adds together, the most one rank adds) at
        tensor_parallel_size `tp`; past MAX_PADDED_TP, the most MAX_PADDED_TP ranks add."""
        rows = [(total, most) for n, total, most in self.act_order_padding if n == min(tp, MAX_PADDED_TP)]
        return rows[0] if rows else (0, 0)


def read_shape(path: str) -> ModelShape:
    """A model directory's or GGUF file's shape (raises OSError/ValueError when the
    files cannot say), kept while its files are unchanged (a GGUF's header, with its
    vocabulary, takes the gguf package a while to read; a split GGUF's shards each)."""
    p = Path(path)
    if p.is_file():
        return _read_shape(str(p), files_stamp(p))
    st = (p / "config.json").stat()
    return _read_shape(str(p), ((st.st_mtime_ns, st.st_size),))


@functools.lru_cache(maxsize=64)
def _read_shape(path: str, stamp: tuple[tuple[int, int], ...]) -> ModelShape:
    p = Path(path)
    if p.is_file():
        return _gguf_shape(p)
    config = json.loads((p / "config.json").read_text())
    text = config.get("text_config") or config
    heads = text["num_attention_heads"]
    head_dim = text.get("head_dim") or text["hidden_size"] // heads
    kv_heads = text.get("num_key_value_heads") or heads
    weights = sorted(p.glob("*.safetensors"))
    size = sum(f.stat().st_size for f in weights)
    dtype = str(config.get("torch_dtype") or config.get("dtype") or "") or None
    scheme = config_scheme(config)
    headers = {file: _safetensors_header(file) for file in weights}
    tensors = {name: info for header in headers.values() for name, info in header.items() if name != "__metadata__"}
    # packed words stand for several weights, scales and zero points for none
    elements = {name: math.prod(info["shape"]) * weights_per_element(name, scheme) for name, info in tensors.items()}
    quantized = {name for name, info in tensors.items() if scheme is not None and info["dtype"] not in _FLOAT_TENSORS}
    tied = []
    if not any(name.endswith("lm_head.weight") for name in tensors):  # tied: the LM head's weight is the embedding
        tied = [name for name in tensors if name.endswith("embed_tokens.weight")]
    return ModelShape(weights_bytes=size, num_params=sum(elements.values()),
                      kv_elements_per_token=2 * text["num_hidden_layers"] * kv_heads * head_dim,
                      max_position=text.get("max_position_embeddings", 2048), checkpoint_dtype=dtype, gguf=False,
                      quantized=scheme is not None,
                      packed_bytes=dict.fromkeys(("cpu", "cuda"), sum(
                          tensors[n]["data_offsets"][1] - tensors[n]["data_offsets"][0] for n in quantized)),
                      dense_elements=sum(math.prod(info["shape"]) for n, info in tensors.items() if n not in quantized),
                      tied_dense_elements=sum(elements[n] for n in tied if n not in quantized),
                      tied_elements=sum(elements[n] for n in tied),
                      act_order_padding=_act_order_padding(scheme, headers) if getattr(scheme, "act_order", False)
                      else ())


def _act_order_padding(scheme: IntGroupScheme, headers: dict[Path, dict]) -> tuple[tuple[int, int, int], ...]:
    """ModelShape.act_order_padding from the g_idx of the projections TP splits by input
    columns: a rank's share of o_proj's columns is equal, of down_proj's equal or whole
    blocks (tp.split_share); its padded columns are held in the scheme's blocks. A
    down_proj whose MLP's intermediate dimension follows its group order needs none
    (_in_intermediate_order), nor do experts' (models/expert_sources.py)."""
    layers = []  # (output rows, each input column's group, whether down_proj's)
    names = {name for header in headers.values() for name in header}
    block = held_block(scheme.block_type, "cpu")
    for file, header in headers.items():
        with file.open("rb") as f:
            start = 8 + int.from_bytes(f.read(8), "little")  # the data after the header
            for name, info in header.items():
                qweight = header.get(name.removesuffix("g_idx") + "qweight")
                if not name.endswith(_ROW_PARALLEL) or ".experts." in name or qweight is None \
                        or info["dtype"] not in _INDEX_DTYPES:
                    continue
                a, b = info["data_offsets"]
                f.seek(start + a)
                groups = np.frombuffer(f.read(b - a), dtype=_INDEX_DTYPES[info["dtype"]])
                if not _in_intermediate_order(name, groups, names, block):
                    layers.append((qweight["shape"][1], groups, name.endswith(".down_proj.g_idx")))
    rows = []
    for tp in range(2, MAX_PADDED_TP + 1):
        ranks = [0] * tp
        for out, groups, down in layers:
            for rank in range(tp):
                try:
                    a, b = split_share(groups.size, rank, tp, block if down else 1)
                except ValueError:  # no whole share: the load refuses this TP size
                    continue
                counts = np.bincount(groups[a:b])
                ranks[rank] += held_bytes(scheme.block_type, int((-counts[counts > 0] % block).sum()) * out, "cpu")
        rows.append((tp, sum(ranks), max(ranks)))
    return tuple(rows)


def _in_intermediate_order(g_idx: str, groups: np.ndarray, names: set[str], block: int) -> bool:
    """Whether the loader puts the intermediate dimension of the MLP of down_proj `g_idx`
    in the order its columns sort into (quant_plan._order_intermediate_dims): its gate and
    up quantized too, no bias on them in the files, its groups whole blocks."""
    if not g_idx.endswith(".down_proj.g_idx"):
        return False
    mlp = g_idx.removesuffix(".down_proj.g_idx")
    parts = {f"{mlp}.gate_proj.qweight", f"{mlp}.up_proj.qweight"}
    quantized = parts <= names or f"{mlp}.gate_up_proj.qweight" in names
    bias = any(f"{mlp}.{p}.bias" in names for p in ("gate_proj", "up_proj", "gate_up_proj"))
    return quantized and not bias and groups.size > 0 and not (np.bincount(groups) % block).any()


def _safetensors_header(path: Path) -> dict:
    """A safetensors file's header: tensor name -> dtype, shape, offsets (8 bytes of
    length, little-endian, then that much JSON)."""
    with path.open("rb") as f:
        length = int.from_bytes(f.read(8), "little")
        return json.loads(f.read(length))


def _gguf_shape(p: Path) -> ModelShape:
    from llmd.gpu.models.gguf_file import GGUFFile

    reader = GGUFFile(p)
    get = reader.get

    arch = get("general.architecture")
    heads = get(f"{arch}.attention.head_count")
    if not isinstance(heads, int):  # per layer in some files (an array)
        heads = int(max(heads))
    kv_heads = get(f"{arch}.attention.head_count_kv", heads)
    if not isinstance(kv_heads, int):
        kv_heads = int(max(kv_heads))
    head_dim = get(f"{arch}.attention.key_length") or get(f"{arch}.embedding_length") // heads
    layers = get(f"{arch}.block_count")
    tensors = reader.tensors
    dense = [t for t in tensors.values() if t.tensor_type.name in DENSE_TYPES]
    packed = [t for t in tensors.values() if t.tensor_type.name not in DENSE_TYPES]
    tied = []
    if "output.weight" not in tensors and "token_embd.weight" in tensors:  # tied: the LM head's is the embedding
        tied.append(tensors["token_embd.weight"])
    return ModelShape(weights_bytes=reader.total_size, num_params=sum(t.n_elements for t in tensors.values()),
                      kv_elements_per_token=2 * layers * kv_heads * head_dim,
                      max_position=get(f"{arch}.context_length", 2048),
                      checkpoint_dtype=file_dtype(reader), gguf=True,
                      packed_bytes={device: sum(held_bytes(t.tensor_type.name, t.n_elements, device) for t in packed)
                                    for device in ("cpu", "cuda")},
                      dense_elements=sum(t.n_elements for t in dense),
                      tied_dense_elements=sum(t.n_elements for t in tied if t.tensor_type.name in DENSE_TYPES),
                      tied_elements=sum(t.n_elements for t in tied),
                      split_widths=tuple(sorted({(t.shape[0], held_block(t.tensor_type.name, "cuda"))
                                                 for t in packed if ".ffn_down" in t.name})))


def run_dtype(engine: EngineConfig, device_type: str, checkpoint_dtype: str | None) -> str:
    """The dtype the engine runs (llmd.gpu.models.loader.resolve_dtype's rule)."""
    if engine.dtype != "auto":
        return engine.dtype
    if device_type == "cuda" or checkpoint_dtype == "bfloat16":
        return "bfloat16"
    return "float32"


@functools.cache
def onednn_copies(dtype: str) -> bool:
    """Whether CPU linears of `dtype` get oneDNN's reordered copy (cpu_linear.packing_supported,
    without torch: float32 always; bfloat16 on CPUs with AVX512-BF16 or AMX)."""
    if dtype == "float32":
        return True
    if dtype != "bfloat16":
        return False
    flags = cpuinfo_field("flags").split()
    return "avx512_bf16" in flags or "amx_bf16" in flags


def estimate_need(engine: EngineConfig, shape: ModelShape, device_type: str, *, available_ram: int,
                  device_total: int | None = None) -> dict[str, int]:
    """Device -> bytes the model will hold once loaded. `available_ram`: free RAM now
    (a CPU KV pool with no size setting takes a share of it); `device_total`: one GPU's
    memory (a CUDA KV pool with no size setting takes gpu_memory_utilization of it)."""
    dtype = run_dtype(engine, device_type, shape.checkpoint_dtype)
    element = _DTYPE_BYTES[dtype]
    # A GGUF's or an AWQ/GPTQ/FP8 checkpoint's quantized weights stay packed on CPU and CUDA
    # (unless dequantize; with TP each rank its share); every other weight is held at the
    # run dtype.
    packed = ((shape.quantized or shape.gguf)
              and device_type in ("cpu", "cuda") and not engine.dequantize and shape.packed_bytes is not None)
    if packed:
        weights = shape.packed_bytes[device_type] + shape.dense_elements * element
        copied = shape.tied_dense_elements
    else:
        weights, copied = shape.num_params * element, shape.tied_elements
    if device_type == "cpu" and onednn_copies(dtype):
        weights += copied * element
    tp = engine.tensor_parallel_size
    per_rank = weights // tp if not packed else int(weights * shape.largest_share(tp))
    if packed and tp > 1:  # act-order columns padded to whole blocks on every rank
        padding, most = shape.padding(tp)
        weights, per_rank = weights + padding, per_rank + most
    kv = kv_pool_bytes(engine, shape, device_type, kv_element_bytes(engine.kv_cache_dtype, element), available_ram)
    if device_type == "cpu":
        return {"cpu": weights + kv}
    if kv is None:  # the pool takes what gpu_memory_utilization leaves: that share is the model's
        total = device_total or 0
        return {f"cuda:{rank}": max(int(engine.gpu_memory_utilization * total), per_rank) for rank in range(tp)}
    return {f"cuda:{rank}": per_rank + kv // tp for rank in range(tp)}


def kv_element_bytes(kv_cache_dtype: str, element: int) -> int:
    """Bytes of one KV cache element: the run dtype's (`element`) for "auto", two for a
    float16 / bfloat16 cache, one for a quantized one (fp8, int8)."""
    if kv_cache_dtype == "auto":
        return element
    return 2 if kv_cache_dtype in KV_CACHE_FLOATS else 1


def kv_pool_bytes(engine: EngineConfig, shape: ModelShape, device_type: str, element: int,
                  available_ram: int) -> int | None:
    """The KV pool's bytes on every rank together; None on CUDA with no size setting
    (sized by profiling at load)."""
    per_token = shape.kv_elements_per_token * element
    block = per_token * engine.block_size
    if engine.num_gpu_blocks_override is not None:
        return engine.num_gpu_blocks_override * block
    if engine.kv_cache_memory_bytes is not None:
        return engine.kv_cache_memory_bytes
    if device_type != "cpu":
        return None
    max_len = engine.max_model_len or shape.max_position
    full = (engine.max_num_seqs * math.ceil(max_len / engine.block_size) + 1) * block
    return min(full, int(available_ram * engine.cpu_kv_cache_fraction), CPU_KV_DEFAULT_CAP)


def loaded_need(device: str, weights_bytes: int, kv_cache_bytes: int, tensor_parallel_size: int) -> dict[str, int]:
    """Device -> bytes of a loaded model (its weights and KV pool on every rank, as the
    executor reports them); a model on CUDA spreads evenly over its ranks."""
    total = weights_bytes + kv_cache_bytes
    if not device.startswith("cuda"):
        return {"cpu": total}
    return {f"cuda:{rank}": total // tensor_parallel_size for rank in range(tensor_parallel_size)}
