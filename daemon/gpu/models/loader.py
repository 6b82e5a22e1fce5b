"""Load a model from a local Hugging Face directory (config and tokenizer via
transformers, weights from safetensors through our own name mapping) or from a GGUF file
(gguf_loader: the same three things read from the one file). Nothing is fetched."""
from __future__ import annotations

import contextlib
import functools
import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from llmd.gpu.layers.cpu.cpu_decode_layers import attach_decode_layers
from llmd.gpu.layers.cpu.cpu_kernels import attach_cpu_kernels, attach_expert_kernels, attach_gguf_kernels
from llmd.gpu.layers.cpu.cpu_linear import pack_linears
from llmd.gpu.layers.gguf_quant import PackedSource
from llmd.gpu.layers.linear import Shard, WeightLoading
from llmd.gpu.layers.quant.scheme import quant_scheme
from llmd.gpu.models.architectures import get_architecture
from llmd.gpu.models.checkpoint_kv_scales import KVScaleCollector, kv_scale_target
from llmd.gpu.models.decoder import CausalLM
from llmd.gpu.models.gguf_loader import (gguf_stop_token_ids, gguf_tensor_types, is_gguf_path,
                                         iter_gguf_weights, load_gguf_config, load_gguf_tokenizer,
                                         release_gguf_readers)
from llmd.gpu.models.quant_plan import (apply_plan, finalize_quantized, plan_quantized, plan_quantized_experts,
                                        quantized_weights, resolve_scheme, safetensors_index)
from llmd.gpu.models.weight_plan import PACKED_DEVICES, checkpoint_target, packed_gguf
from llmd.load_progress import LoadProgress

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str, device: torch.device, checkpoint_dtype: str | None) -> torch.dtype:
    """`auto`: bfloat16 on CUDA; on CPU the checkpoint's dtype, float32 for fp16 checkpoints
    (CPU float16 matmuls are slow and lossy)."""
    if name != "auto":
        return _DTYPES[name]
    if device.type == "cuda":
        return torch.bfloat16
    if checkpoint_dtype == "bfloat16":
        return torch.bfloat16
    return torch.float32


def load_hf_config(model_dir: str | Path):
    """The model's transformers config, checked before any weight is read: an
    architecture llmd does not run, or a config field its model would not honour as
    transformers does (a layer type other than full or sliding attention, a window where
    the architecture has none, a rope type, activation or soft-cap llmd does not
    implement, odd head sizes: the model class's check_config), is a ValueError naming
    the architecture and the field.
    `model_dir` may be a GGUF file (its metadata is the config)."""
    if is_gguf_path(model_dir):
        return load_gguf_config(model_dir)
    path = Path(model_dir)
    if not path.exists():
        raise FileNotFoundError(f"model path {str(path)!r} does not exist")
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"model directory {str(path)!r} has no config.json")
    config = _lean_llama_config(path)
    if config is None:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(str(path), local_files_only=True)
    get_architecture(_architecture(config)).check_config(config)
    try:
        quant_scheme(config)  # a quantization llmd does not run is refused here, before any weight is read
    except ValueError as exc:
        raise ValueError(f"{str(path)!r}: {exc}") from None
    return config


def load_tokenizer(path: str | Path):
    """The tokenizer of an HF directory, or the one a GGUF file's vocabulary describes."""
    if is_gguf_path(path):
        return load_gguf_tokenizer(path)
    from transformers import AutoTokenizer

    # AutoTokenizer reads a directory's config itself unless handed one (only its
    # model_type and names matter to it); where AutoConfig fails it falls back to the
    # plain config, and so it does here
    config = None
    if (Path(path) / "config.json").is_file():
        with contextlib.suppress(ValueError, OSError):
            config = _lean_llama_config(Path(path))
    return AutoTokenizer.from_pretrained(str(path), local_files_only=True, config=config)


def _lean_llama_config(path: Path):
    """A llama directory's config as AutoConfig makes it, but as LeanLlamaConfig
    (llama_config.py: LlamaConfig's own module imports ~700 modules llmd never uses,
    ~0.9 s and ~56 MiB of every process that loads the model); None for another model
    type (AutoConfig's class is imported for it)."""
    try:
        model_type = json.loads((path / "config.json").read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None  # AutoConfig says what is wrong with the file
    if model_type != "llama":
        return None
    from llmd.gpu.models.llama_config import LeanLlamaConfig

    return LeanLlamaConfig.from_pretrained(str(path), local_files_only=True, name_or_path=str(path))


def stop_token_ids(path: str | Path) -> set[int]:
    """End-of-generation ids besides the tokenizer's EOS: generation_config.json's
    eos_token_id of an HF directory, a GGUF's end-of-turn/end-of-message ids."""
    if is_gguf_path(path):
        return gguf_stop_token_ids(path)
    file = Path(path) / "generation_config.json"
    if not file.is_file():
        return set()
    eos = json.loads(file.read_text()).get("eos_token_id")
    if eos is None:
        return set()
    return set(eos) if isinstance(eos, list) else {eos}


def _architecture(config: Any) -> str:
    archs = getattr(config, "architectures", None) or [""]
    return archs[0]


def iter_safetensors(model_dir: str | Path) -> Iterator[tuple[str, Any]]:
    """(name, safetensors slice) for every checkpoint tensor: a layer reads only the
    piece it keeps (with tensor parallelism, this rank's rows or columns)."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {str(model_dir)!r}")
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_slice(name)


def _count_safetensors(model_dir: str | Path) -> int:
    """The checkpoint's tensors the layers load (its K/V cache scales are not theirs)."""
    total = 0
    for file in Path(model_dir).glob("*.safetensors"):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            total += sum(kv_scale_target(name) is None for name in f.keys())
    return total


def load_weights(model: CausalLM, weights: Iterable[tuple[str, Any]]) -> None:
    """Each checkpoint tensor through the layer that holds it (layers/linear.py: the
    layer takes its piece); raise on unexpected, misshapen or missing weights so a wrong
    checkpoint fails loudly."""
    modules = dict(model.named_modules())
    params = dict(model.named_parameters(remove_duplicate=False))
    plain = WeightLoading()  # a norm's weight: copied whole

    def owner(param: str) -> tuple[WeightLoading, str]:
        module, _, attr = param.rpartition(".")
        layer = modules.get(module)
        method = getattr(layer, "quant_method", None)  # a quantized layer's checkpoint tensors (quant_linear)
        if method is not None and attr in method.scheme.checkpoint_names:
            return method, attr
        return (layer if isinstance(layer, WeightLoading) else plain), attr

    loaded: set[tuple[str, Shard]] = set()
    for name, source in weights:
        target = checkpoint_target(model, name)
        if target is None:
            continue
        param, shard = target
        if param not in params:
            raise ValueError(f"unexpected weight {name!r} in checkpoint")
        layer, attr = owner(param)
        quant = layer.packed_quant(shard, attr)
        if isinstance(source, PackedSource) and source.quant != quant:
            if quant is not None:
                raise ValueError(f"weight {name!r} is {source.quant}, but its layer keeps {quant} (the parts of a "
                                 f"fused projection must share one type to stay packed)")
            source = source.dequantize()  # a layer kept dense
        elif quant is not None and not isinstance(source, PackedSource):
            raise ValueError(f"weight {name!r} is not packed, but its layer keeps {quant}")
        try:
            layer.load(attr, params[param], source, shard)
        except ValueError as exc:
            raise ValueError(f"weight {name!r} {exc}") from None
        loaded.update((param, s) for s in (layer.shards(attr) if shard is None else (shard,)))
    missing = [(param, shard) for param in params if not (param == "lm_head.weight" and model.tie_word_embeddings)
               for shard in owner(param)[0].shards(owner(param)[1]) if (param, shard) not in loaded]
    if missing:
        param, shard = missing[0]
        where = repr(param) if shard is None else f"{param!r} (shard {shard!r})"
        raise ValueError(f"checkpoint is missing {len(missing)} weight(s), e.g. {where}")


def load_model(model_dir: str | Path, dtype: torch.dtype, device: torch.device,
               max_positions: int, tp_rank: int = 0, tp_size: int = 1,
               attention_backend: str = "torch", progress: LoadProgress | None = None,
               dequantize: bool = False, int8_activations: bool = False) -> nn.Module:
    """The model, or with tp_size > 1 this rank's tensor-parallel shard of it; its layers
    attend with `attention_backend` (a name resolve_attention_backend returned). From a
    GGUF file on CPU or CUDA, every quantized weight stays packed (gguf_quant; on CUDA
    laid out for the Triton kernels, quant/cuda_matmul; with TP each rank its share) or
    the load is refused naming the tensor (packed_params); from an AWQ, GPTQ or FP8
    safetensors checkpoint every quantized module stays packed, on any number of ranks,
    on CPU or CUDA (quant_plan). `dequantize`: every weight is dequantized instead (each
    rank dequantizes a tensor whole and its layers keep their share). Then its kernels
    are attached (_attach_kernels); `int8_activations`: packed weights on CPU meet
    activations rounded to int8 once (gguf_quant.x16_passes).
    A checkpoint's own K/V cache scales are kept as `model.kv_amax` (checkpoint_kv_scales;
    None without them)."""
    config = load_hf_config(model_dir)
    gguf = is_gguf_path(model_dir)
    scheme = None if gguf else quant_scheme(config)
    # on meta (no random init, no memory), then materialized and filled from disk; the
    # dtype before any packed weight is placed: those keep their own
    build = functools.partial(_on_meta, config, max_positions, tp_rank, tp_size, attention_backend, device, dtype)
    model = build(None)
    plan: dict[str, str] = {}
    packed: dict[str, str] = {}  # the file's tensors read as packed rows: the type each is held in
    if gguf and device.type in PACKED_DEVICES and not dequantize:
        model, plan, packed = packed_gguf(model_dir, model, build, device.type)
    index = safetensors_index(model_dir) if scheme is not None else {}
    if scheme is not None:
        scheme = resolve_scheme(scheme, index)
    experts: dict[str, str] = {}  # quantized experts: the GGUF type each is held in
    if scheme is not None and not dequantize:
        apply_plan(model, scheme, plan_quantized(model, scheme, index, checkpoint_target), index)
        experts = plan_quantized_experts(model, scheme, index, checkpoint_target, device.type)
    model = _materialized(model, device)
    model.reset_rotary(device)
    model.tie_weights()
    kv_scales = KVScaleCollector(getattr(scheme, "kv_qmax", None))  # the checkpoint's own, if any
    if gguf:
        weights, total = iter_gguf_weights(model_dir, config, packed), len(gguf_tensor_types(model_dir))
    else:
        weights, total = kv_scales.weights(iter_safetensors(model_dir)), _count_safetensors(model_dir)
        if scheme is not None:
            weights = quantized_weights(weights, model, scheme, index, checkpoint_target, dequantize, experts)
    load_weights(model, progress.track("weights", weights, total) if progress is not None else weights)
    model.kv_amax = kv_scales.amax(len(model.layers))  # kv_calibration's scales when the cache is quantized
    if gguf:
        release_gguf_readers()  # the model holds its own copy of every weight: the file's map closes
    model.eval()
    model.requires_grad_(False)
    _attach_kernels(model, dtype, device, packed_gguf=bool(plan), int8_activations=int8_activations)
    return model


def _on_meta(config: Any, max_positions: int, tp_rank: int, tp_size: int, attention_backend: str,
             device: torch.device, dtype: torch.dtype, units: dict[str, int] | None) -> CausalLM:
    with torch.device("meta"):
        return CausalLM(config, max_positions, tp_rank, tp_size, attention_backend=attention_backend,
                        device=device, tp_units=units).to(dtype=dtype)


def _materialized(model: nn.Module, device: torch.device) -> nn.Module:
    """nn.Module.to_empty: every tensor an uninitialized one on `device`, of its shape,
    dtype and (contiguous or not) layout. torch.empty_like of a meta tensor runs torch's
    Python reference, which imports torch.fx's symbolic shapes and with them sympy (~30 MiB
    resident, for nothing llmd computes); an empty tensor of the same size does not."""
    def empty(t: torch.Tensor) -> torch.Tensor:
        if t.is_contiguous():
            return torch.empty(t.shape, dtype=t.dtype, device=device)
        return torch.empty_like(t, device=device)

    return model._apply(empty)


def _attach_kernels(model: nn.Module, dtype: torch.dtype, device: torch.device, packed_gguf: bool,
                    int8_activations: bool = False) -> None:
    """The loaded model's fast paths: its AWQ / GPTQ / FP8 layers packed for their
    kernels; on CPU oneDNN-packed dense weights and the C++ decode attention; a GGUF's
    packed weights with the C++ kernels (CPU) or the Triton ones (CUDA)."""
    finalize_quantized(model, dtype, device, int8_activations)
    if device.type == "cpu":
        pack_linears(model)  # oneDNN's blocked weights: faster GEMMs than MKL's on plain ones (cpu_linear)
        attach_cpu_kernels(model)  # decode attention over the paged cache in place (cpu_kernels)
    if packed_gguf and device.type == "cuda":
        from llmd.gpu.layers.quant.cuda_matmul import attach_cuda_gguf_kernels

        attach_cuda_gguf_kernels(model, dtype)  # the Triton kernels, over planes laid out in place
    elif packed_gguf:
        attach_gguf_kernels(model, dtype, int8_activations)
    elif device.type == "cpu":
        attach_expert_kernels(model, int8_activations)  # an AWQ / GPTQ / FP8 checkpoint's packed experts
    elif device.type == "cuda":
        from llmd.gpu.layers.quant.cuda_matmul import attach_cuda_expert_kernels

        attach_cuda_expert_kernels(model)
    if device.type == "cpu":
        attach_decode_layers(model)  # decode steps through the layers in C++ where they qualify
