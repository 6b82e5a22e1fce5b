"""The load's plan: which parameter (and shard) each checkpoint tensor fills
(`checkpoint_target`), and which of a GGUF's quantized weights stay packed, in which
types (`packed_params`), and, under tensor parallelism, in which shares of an
intermediate dimension (`split_units`, layers/tp.py). Decisions over a model built on
meta (no weights yet) and the file's tensor types; the loader (loader.py) builds, plans,
then fills."""
from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from llmd.gpu.layers.gguf_formats import FORMATS, PACKED_TYPES
from llmd.gpu.layers.gguf_types import DENSE_TYPES, held_type, kernel_types
from llmd.gpu.layers.linear import Shard
from llmd.gpu.models.decoder import CausalLM
from llmd.gpu.models.gguf_loader import gguf_tensor_types

# Checkpoint projections the layers fuse: checkpoint name part -> (fused name part, shard).
FUSED_SHARDS = {
    ".q_proj.": (".qkv_proj.", "q"), ".k_proj.": (".qkv_proj.", "k"), ".v_proj.": (".qkv_proj.", "v"),
    ".gate_proj.": (".gate_up_proj.", 0), ".up_proj.": (".gate_up_proj.", 1),
}


def checkpoint_target(model: CausalLM, name: str) -> tuple[str, Shard] | None:
    """(parameter, shard) checkpoint tensor `name` loads into (shard None: all of it);
    None for a tensor the model does not keep (rotary caches, a tied LM head)."""
    name = name.removeprefix("model.")
    for old, new in model.arch.checkpoint_renames:
        name = name.replace(old, new)
    if "rotary_emb.inv_freq" in name or (name.startswith("lm_head.") and model.tie_word_embeddings):
        return None
    gate, up, down = model.arch.expert_projections
    m = re.fullmatch(rf"(layers\.\d+\.mlp\.experts)\.(\d+)\.({gate}|{up}|{down})\.weight", name)
    if m is not None:
        expert = int(m.group(2))
        if m.group(3) == down:
            return f"{m.group(1)}.w2", expert
        return f"{m.group(1)}.w13", (expert, 0 if m.group(3) == gate else 1)
    for part, (fused, shard) in FUSED_SHARDS.items():
        if part in name:
            return name.replace(part, fused), shard
    return name, None


# Devices a GGUF's quantized weights stay packed on (C++ kernels on the CPU, Triton on CUDA).
PACKED_DEVICES = ("cpu", "cuda")


def packed_params(model: CausalLM, types: dict[str, tuple[str, str]],
                  device_type: str = "cpu") -> dict[str, str | dict[Shard, str]]:
    """Parameter -> GGUF type for every quantized weight of the checkpoint (`types`: HF
    name -> (GGUF name, type name)), each kept packed: a linear layer's or the
    vocabulary's weight, rows a whole number of its type's blocks (gguf_formats.FORMATS);
    a fused projection whose parts differ in type maps to {part: type}; a type held as
    another on this device (gguf_types.HELD_AS: IQ4_XS as IQ4_NL) maps to that one. A
    quantized tensor that cannot stay packed (a type without a kernel, rows its blocks do
    not fit, a parameter that takes no packed weight, a fused projection mixing it with a
    dense part) is a ValueError naming it: dequantizing it silently would cost memory and
    speed the user did not ask for (`dequantize=True` loads every weight dense)."""
    modules = dict(model.named_modules())
    parts: dict[str, dict[Shard, str]] = {}
    files: dict[str, dict[Shard, str]] = {}  # the GGUF tensor behind each part
    for name, (param, shard) in targets(model, types):
        gguf_name, quant = types[name]
        files.setdefault(param, {})[shard] = gguf_name
        parts.setdefault(param, {})[shard] = quant
    plan: dict[str, str | dict[Shard, str]] = {}
    for param, shards in parts.items():
        if set(shards.values()) <= set(DENSE_TYPES):
            continue
        module, _, attr = param.rpartition(".")
        layer = modules.get(module)
        for shard, quant in shards.items():
            reason = None if quant in DENSE_TYPES else _unpackable(layer, attr, quant, shards, device_type)
            if reason is not None:
                raise ValueError(f"GGUF tensor {files[param][shard]!r} of type {quant} cannot stay packed: {reason}; "
                                 f"dequantize=True (--dequantize) loads it dequantized")
        held = {shard: held_type(quant, kernel_types(device_type)) for shard, quant in shards.items()}
        quants = set(held.values())
        plan[param] = quants.pop() if len(quants) == 1 else held
    return plan


def split_units(model: CausalLM, types: dict[str, tuple[str, str]], device_type: str) -> dict[str, int]:
    """Role -> the columns a rank's share of that intermediate dimension must be a
    multiple of (tp.py): the widest block among its down projections' packed types
    (`types` as packed_params'), where an equal share would cut one; {} where none would."""
    units: dict[str, int] = {}
    cut = False
    for name, (param, _) in targets(model, types):
        module, _, attr = param.rpartition(".")
        layer = model.get_submodule(module)
        role = getattr(layer, "split_role", None)
        quant = held_type(types[name][1], kernel_types(device_type))
        if role is None or attr != ("w2" if hasattr(layer, "packed_columns") else "weight") or quant not in FORMATS:
            continue
        block = FORMATS[quant].block
        units[role] = max(units.get(role, 1), block)
        cut = cut or (layer.packed_columns("w2") if attr == "w2" else layer.in_features) % block != 0
    return units if cut else {}


def _unpackable(layer: Any, attr: str, quant: str, shards: dict[Shard, str], device_type: str) -> str | None:
    """Why a weight part of type `quant` (its parameter's parts: `shards`) cannot be kept
    packed, or None."""
    experts = hasattr(layer, "packed_columns")  # mlp.ExpertWeights: w13, w2
    if not hasattr(layer, "use_packed") or (attr != "weight" and not (experts and attr in ("w13", "w2"))):
        return "its parameter takes no packed weight"
    if experts and device_type not in PACKED_DEVICES:
        return f"llmd keeps a GGUF's experts packed on CPU and CUDA only (no packed MoE kernel for {device_type})"
    if any(q in DENSE_TYPES for q in shards.values()):
        return "its fused projection mixes dense and quantized parts"
    held = held_type(quant, kernel_types(device_type))
    if held not in FORMATS:
        return f"llmd has no kernel for {quant} (packed types: {', '.join(PACKED_TYPES)})"
    block, cols = FORMATS[held].block, layer.packed_columns(attr) if experts else layer.in_features
    if cols % block:
        share = f" (this rank's share of tensor_parallel_size {layer.world_size})" if layer.world_size > 1 else ""
        return f"its rows of {cols} weights{share} are not a whole number of {quant}'s {block}-weight blocks"
    if set(shards) != set(layer.shards(attr)) and set(shards) != {None}:
        return f"its projection has parts {tuple(layer.shards(attr))}, the file gives {tuple(shards)}"
    return None


def use_packed(model: CausalLM, plan: dict[str, str | dict[Shard, str]]) -> None:
    """Each planned parameter's layer keeps it packed (before any weight is placed)."""
    for param, quant in plan.items():
        module, _, attr = param.rpartition(".")
        layer = model.get_submodule(module)
        if attr == "weight":
            layer.use_packed(quant)
        else:  # an ExpertWeights' w13 or w2
            layer.use_packed(quant, attr)


def targets(model: CausalLM, names: Iterable[str]) -> list[tuple[str, tuple[str, Shard]]]:
    """(checkpoint name, (parameter, shard)) of each name the model keeps."""
    return [(name, target) for name in names if (target := checkpoint_target(model, name)) is not None]


def packed_gguf(model_dir: str | Path, model: CausalLM, build: Callable[[dict[str, int] | None], CausalLM],
                 device_type: str) -> tuple[CausalLM, dict[str, Any], dict[str, str]]:
    """(the model, its plan, {file tensor: the type it is held in}) where a GGUF's
    quantized weights stay packed; under TP the model built again (`build(units)`) where
    an equal share would cut a packed down projection's blocks (split_units)."""
    types = gguf_tensor_types(model_dir)
    if model.tp is not None and (units := split_units(model, types, device_type)):
        model = build(units)
    plan = packed_params(model, types, device_type)
    use_packed(model, plan)
    packed = {name: quant if isinstance(quant := plan[param], str) else quant[shard]
              for name, (param, shard) in targets(model, types) if param in plan}
    return model, plan, packed
