"""Loading an AWQ, GPTQ or FP8 safetensors checkpoint (quant/scheme.py says which): which
of the model's layers keep which checkpoint modules packed, read from the files'
headers before any weight (`plan_quantized`); the layers finalized and given their
matmuls after the load (`finalize_quantized`); and with `dequantize=True` every quantized
module dequantized to a dense weight as it is read (`iter_dequantized`).

The files decide what is quantized: a module with a `qweight` (AWQ, GPTQ) or a float8
`weight` (FP8) is, any other stays dense — modules_to_not_convert / ignore lists
included, which are checked against the files. A quantized module whose layer cannot
keep it packed (the embedding, a fused projection mixing it with a dense part) is
refused by name; a quantized LM head under tensor parallelism keeps its rank's
vocabulary rows packed, the last rank's padding rows zero blocks (quant_linear). Packed
layers run on the CPU (C++ kernels) and on CUDA (Triton kernels).

A mixture of experts' AWQ / GPTQ experts (`plan_quantized_experts`) are held as a GGUF's
are (mlp.ExpertWeights): each expert's codes transcoded into GGUF blocks as it is read
(`quantized_weights`; int_groups: Q4_0 for symmetric 4-bit GPTQ, Q5_0 for other 4-bit,
Q8_0 for 8-bit; act-order columns sorted by group, the order kept beside), FP8 experts
as their e4m3 bytes and scales (quant/fp8), on CPU and CUDA, each rank its share with
tensor parallelism (act-order experts: expert_sources.py); experts on another device are
refused by name."""
from __future__ import annotations

import contextlib
import dataclasses
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from llmd.gpu.layers.gguf_quant import PackedSource
from llmd.gpu.layers.linear import LinearBase, ParallelLMHead, Shard
from llmd.gpu.layers.mlp import FP8, ExpertWeights, GatedMLP
from llmd.gpu.layers.quant.fp8 import fp8_rows
from llmd.gpu.layers.quant.int_groups import BLOCK, IntGroups, awq_groups, gptq_groups, intermediate_order
from llmd.gpu.layers.quant.quant_linear import finalize, quantized_matmul, use_quantized
from llmd.gpu.layers.quant.scheme import FP8Scheme, QuantScheme
from llmd.gpu.models.expert_sources import (FP8Source, OrderedPackedSource, Parts, expert_parts, intermediate_orders,
                                            split_down_without_its_expert)

DEQUANTIZE_HINT = "dequantize=True (--dequantize) loads it dense"


def safetensors_index(model_dir: str | Path) -> dict[str, tuple[str, tuple[int, ...], str]]:
    """Every checkpoint tensor's (safetensors dtype, shape, file), from the headers alone."""
    index = {}
    for file in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                piece = f.get_slice(name)
                index[name] = (piece.get_dtype(), tuple(piece.get_shape()), str(file))
    return index


def quantized_prefixes(scheme: QuantScheme, index: dict[str, tuple[str, tuple[int, ...], str]]) -> list[str]:
    """The checkpoint modules the files hold quantized (module doc), in file order."""
    if not isinstance(scheme, FP8Scheme):
        return [name.removesuffix(".qweight") for name in index if name.endswith(".qweight")]
    found = []
    for name, (dtype, _, _) in index.items():
        if not name.endswith(".weight") or not dtype.startswith("F8_"):
            continue
        if dtype != "F8_E4M3":
            raise ValueError(f"tensor {name!r} is {dtype}: not implemented by llmd (implemented: F8_E4M3)")
        found.append(name.removesuffix(".weight"))
    return found


def resolve_scheme(scheme: QuantScheme, index: dict[str, tuple[str, tuple[int, ...], str]]) -> QuantScheme:
    """The scheme with what the files say: HF's `fp8` names its scales `weight_scale_inv`
    (per tensor or per block), vLLM's / AutoFP8's `weight_scale`; the files tell which."""
    if not isinstance(scheme, FP8Scheme) or scheme.method != "fp8":
        return scheme
    prefixes = quantized_prefixes(scheme, index)
    names = {n for n in ("weight_scale", "weight_scale_inv") if any(f"{p}.{n}" in index for p in prefixes)}
    if len(names) > 1:
        raise ValueError("the checkpoint names its FP8 scales both weight_scale and weight_scale_inv")
    return dataclasses.replace(scheme, scale_name=names.pop()) if names else scheme


def plan_quantized(model: nn.Module, scheme: QuantScheme, index: dict[str, tuple[str, tuple[int, ...], str]],
                   checkpoint_target: Any) -> dict[str, dict[Shard, str]]:
    """Layer (module name) -> {shard: checkpoint module} of every quantized checkpoint
    module the model keeps, or ValueError naming one it cannot keep packed.
    `checkpoint_target(model, name)` is the loader's name mapping."""
    modules = dict(model.named_modules())
    plan: dict[str, dict[Shard, str]] = {}
    for prefix in quantized_prefixes(scheme, index):
        _check_not_converted(scheme, prefix)
        target = checkpoint_target(model, prefix + ".weight")
        if target is None:
            continue  # a tensor the model does not keep (a tied LM head)
        param, shard = target
        name = param.rpartition(".")[0]
        if isinstance(modules.get(name), ExpertWeights):
            continue  # plan_quantized_experts'
        _check_packable(modules.get(name), prefix, scheme)
        plan.setdefault(name, {})[shard] = prefix
    for name, shards in plan.items():
        parts = tuple(modules[name].shards("weight"))
        if set(shards) != {None} and set(shards) != set(parts):
            dense = sorted(str(p) for p in set(parts) - set(shards))
            raise ValueError(f"{next(iter(shards.values()))} is quantized ({scheme.label}) but parts {dense} of "
                             f"its fused projection are not: mixing dense and quantized parts is not implemented; "
                             f"{DEQUANTIZE_HINT}")
    return plan


def _check_packable(layer: nn.Module | None, prefix: str, scheme: QuantScheme) -> None:
    if not isinstance(layer, (LinearBase, ParallelLMHead)):
        raise ValueError(f"{prefix} is quantized ({scheme.label}), but llmd's {type(layer).__name__} takes no "
                         f"packed weight; {DEQUANTIZE_HINT}")


def _check_not_converted(scheme: QuantScheme, prefix: str) -> None:
    """A module the config keeps dense must be dense in the files (entries match a
    module's name exactly, as a suffix of whole names, or as compressed-tensors'
    "re:" regular expressions)."""
    for entry in scheme.not_converted:
        pattern = entry.removeprefix("re:")
        hit = (re.fullmatch(pattern, prefix) is not None if entry.startswith("re:")
               else prefix == entry or prefix.endswith("." + entry))
        if hit:
            raise ValueError(f"{prefix} is quantized in the checkpoint, but its quantization_config keeps "
                             f"{entry!r} dense: the checkpoint contradicts its config")


def plan_quantized_experts(model: nn.Module, scheme: QuantScheme, index: dict[str, tuple[str, tuple[int, ...], str]],
                           checkpoint_target: Any, device_type: str) -> dict[str, str]:
    """Checkpoint module -> the GGUF type it is held in, for every quantized expert, each
    MoE layer told to keep its experts packed in that type (module doc); ValueError
    naming an expert that cannot be."""
    modules = dict(model.named_modules())
    found: dict[str, tuple[ExpertWeights, str]] = {}
    for prefix in quantized_prefixes(scheme, index):
        target = checkpoint_target(model, prefix + ".weight")
        module, _, attr = target[0].rpartition(".") if target is not None else ("", "", "")
        if isinstance(modules.get(module), ExpertWeights):
            found[prefix] = (modules[module], attr)
    if not found:
        return {}
    parts = expert_parts(model, found, checkpoint_target) if getattr(scheme, "act_order", False) else {}
    where, why = _experts_not_packed(scheme, device_type, [layer for layer, _ in found.values()], parts)
    where = where or next(iter(found))
    if why is not None:
        raise ValueError(f"{where} is quantized ({scheme.label}): {why}; {DEQUANTIZE_HINT}")
    if isinstance(scheme, FP8Scheme):
        return _plan_fp8_experts(scheme, found)
    quant = scheme.block_type
    for prefix, (layer, attr) in found.items():
        if layer.packed_columns(attr) % BLOCK:
            raise ValueError(f"{prefix} is quantized ({scheme.label}): its rows of {layer.packed_columns(attr)} "
                             f"weights are not a whole number of {BLOCK}-weight blocks; {DEQUANTIZE_HINT}")
        if attr not in layer.packed_types:
            layer.use_packed(quant, attr)
            layer.quant = scheme.label
    for layer, _ in found.values():
        if scheme.act_order and not layer.ordered:
            layer.use_input_orders()
    return {prefix: quant for prefix in found}


def _plan_fp8_experts(scheme: FP8Scheme, found: dict[str, tuple[ExpertWeights, str]]) -> dict[str, str]:
    """FP8 experts kept as e4m3 bytes and a scale per row and block of columns (one group
    a row for a tensor's or a row's scale)."""
    for prefix, (layer, attr) in found.items():
        cols = layer.packed_columns(attr)
        if scheme.block is not None and cols % scheme.block[1]:
            raise ValueError(f"{prefix} is quantized ({scheme.label}): its rows of {cols} weights are not whole "
                             f"{scheme.block[1]}-column blocks; {DEQUANTIZE_HINT}")
        if attr not in layer.packed_types:
            layer.use_fp8(attr, 1 if scheme.block is None else cols // scheme.block[1])
    return {prefix: FP8 for prefix in found}


def _experts_not_packed(scheme: QuantScheme, device_type: str, layers: list[ExpertWeights],
                        parts: Parts) -> tuple[str | None, str | None]:
    """(the checkpoint module, why its experts cannot stay packed), or (None, None)."""
    if device_type not in ("cpu", "cuda"):
        return None, (f"llmd keeps quantized experts packed on CPU and CUDA only (no packed MoE kernel for "
                      f"{device_type})")
    split = any(layer.world_size > 1 for layer in layers)
    down = split_down_without_its_expert(parts) if getattr(scheme, "act_order", False) and split else None
    if down is not None:  # (its columns split as whole blocks where its intermediate dimension is reordered)
        return down, ("a GPTQ act-order (desc_act) down projection is split by input columns (tensor_parallel_size "
                      "> 1) only beside its expert's quantized gate and up projections (expert_sources.py)")
    return None, None


def apply_plan(model: nn.Module, scheme: QuantScheme, plan: dict[str, dict[Shard, str]],
               index: dict[str, tuple[str, tuple[int, ...], str]] | None = None) -> None:
    """Give every planned layer its quantized weights (quant_linear.use_quantized); with
    the files' `index`, GPTQ act-order gated MLPs in their intermediate order."""
    for name, shards in plan.items():
        use_quantized(model.get_submodule(name), scheme, shards)
    if index is not None and getattr(scheme, "act_order", False):
        _order_intermediate_dims(model, plan, index)


def _order_intermediate_dims(model: nn.Module, plan: dict[str, dict[Shard, str]],
                             index: dict[str, tuple[str, tuple[int, ...], str]]) -> None:
    """Each gated MLP whose gate/up and down projections are all GPTQ act-order, with no
    bias on gate/up, its groups whole blocks and this rank's share of its intermediate
    dimension whole blocks: that dimension put in the order down's columns sort into by
    group (expert_sources.py's module doc, for a dense MLP: down then takes x as it
    comes, and under TP a rank's share of it needs no padding)."""
    mlps = [(name, m) for name, m in model.named_modules() if isinstance(m, GatedMLP)]
    with _tensors(index) as get:
        for name, mlp in mlps:
            gate_up, down = plan.get(f"{name}.gate_up_proj"), plan.get(f"{name}.down_proj")
            share = mlp.down_proj.columns
            if gate_up is None or down is None or mlp.gate_up_proj.bias is not None or share[0] % BLOCK \
                    or share[1] % BLOCK or f"{down[None]}.g_idx" not in index:
                continue
            order = intermediate_order(get(f"{down[None]}.g_idx"))
            if order is not None:
                mlp.gate_up_proj.quant_method.follow_intermediate_order(mlp.gate_up_proj, order, share)
                mlp.down_proj.quant_method.follow_intermediate_order(mlp.down_proj, order, share)


def finalize_quantized(model: nn.Module, dtype: torch.dtype, device: torch.device,
                       int8_activations: bool = False) -> int:
    """After the load: every quantized layer's pieces packed, and its matmul attached (on
    CUDA the Triton kernels, quant/cuda_matmul.py; on CPU the C++ kernels when they can
    be built, else the torch paths; `int8_activations`: gguf_quant.x16_passes); returns how
    many."""
    layers = [m for m in model.modules() if getattr(m, "quant_method", None) is not None]
    if not layers:
        return 0
    if device.type == "cuda":
        from llmd.gpu.layers.quant.cuda_matmul import cuda_quantized_matmul

        for layer in layers:
            finalize(layer)
            layer.kernel = cuda_quantized_matmul(layer)
        return len(layers)
    from llmd.gpu.layers.cpu.cpu_kernels import fp8_ops, gguf_ops
    from llmd.gpu.layers.gguf_quant import x16_passes

    gguf, fp8 = gguf_ops(), fp8_ops()
    passes = x16_passes(gguf, int8_activations) if gguf is not None and gguf.x16 else 0
    for layer in layers:
        finalize(layer)
        layer.kernel = quantized_matmul(layer, gguf, passes, fp8)
    return len(layers)


@contextlib.contextmanager
def _tensors(index: dict[str, tuple[str, tuple[int, ...], str]]) -> Iterator[Any]:
    """name -> tensor, reading from whichever file holds it (each opened once)."""
    with contextlib.ExitStack() as stack:
        files = {file: stack.enter_context(safe_open(file, framework="pt", device="cpu"))
                 for file in {entry[2] for entry in index.values()}}
        yield lambda name: files[index[name][2]].get_tensor(name)


def dequantized_module(scheme: QuantScheme, prefix: str, get: Any, has: Any, columns: int) -> torch.Tensor:
    """The float32 weight [out, in] of a quantized checkpoint module (`get(name)` reads a
    tensor, `has(name)` says whether the checkpoint has it; `columns`: its input size)."""
    if isinstance(scheme, FP8Scheme):
        return fp8_rows(get(f"{prefix}.weight"), get(f"{prefix}.{scheme.scale_name}"), scheme.block, 0, 0,
                        prefix).dequantize()
    return _int_groups(scheme, prefix, get, has, columns).dequantize()


def _int_groups(scheme: QuantScheme, prefix: str, get: Any, has: Any, columns: int) -> IntGroups:
    """An AWQ / GPTQ checkpoint module's codes, zero points and scales (int_groups)."""
    parts = (get(f"{prefix}.qweight"), get(f"{prefix}.qzeros"), get(f"{prefix}.scales"))
    group = scheme.group_size if scheme.group_size > 0 else columns
    if scheme.method == "awq":
        return awq_groups(*parts, group)
    g_idx = get(f"{prefix}.g_idx") if has(f"{prefix}.g_idx") else None
    return gptq_groups(*parts, g_idx, scheme.bits, group, scheme.zeros_minus_one)


def expert_blocks(scheme: QuantScheme, prefix: str, get: Any, has: Any, columns: int, quant: str,
                  reorder: tuple[str, torch.Tensor] | None = None) -> PackedSource:
    """A quantized expert's weight as the GGUF blocks of type `quant` its layer keeps
    (plan_quantized_experts), exactly, or (FP8) its bytes and scales; `reorder`: its rows,
    or its columns, in its expert's intermediate order (expert_sources); ValueError naming
    the module if it cannot be."""
    if isinstance(scheme, FP8Scheme):
        rows = fp8_rows(get(f"{prefix}.weight"), get(f"{prefix}.{scheme.scale_name}"), scheme.block, 0, 0, prefix)
        return FP8Source(FP8, rows.bytes.numpy(), tuple(rows.bytes.shape), rows.scales)
    groups = _int_groups(scheme, prefix, get, has, columns)
    groups.check_shape(groups.codes.shape[0], columns, prefix)
    groups, order = (groups.sorted_by_group() if reorder is None  # (expert_sources.intermediate_orders)
                     else groups.sorted_in(*reorder, (0, reorder[1].numel()), prefix))
    if order is not None and order.numel() != columns:  # an expert's rows are as wide as every other's
        raise ValueError(f"{prefix}: its g_idx groups are not whole {BLOCK}-column blocks; {DEQUANTIZE_HINT}")
    held, rows = groups.gguf_rows(prefix, q5=quant == "Q5_0")
    if held != quant:
        raise ValueError(f"{prefix}: its zero points make its blocks {held}, not {quant} (quantization_config's sym "
                         f"says every zero point is {1 << (scheme.bits - 1)}); {DEQUANTIZE_HINT}")
    return OrderedPackedSource(quant, rows.numpy(), (rows.shape[0], columns), order)


def without_empty_biases(weights: Iterator[tuple[str, Any]], model: nn.Module, scheme: QuantScheme,
                         index: dict[str, tuple[str, tuple[int, ...], str]],
                         checkpoint_target: Any) -> Iterator[tuple[str, Any]]:
    """The checkpoint's tensors less the all-zero `bias` of quantized modules whose layer
    has none (some GPTQ tools save one for every linear layer); a non-zero one is left
    for the loader to refuse as unexpected."""
    prefixes = set(quantized_prefixes(scheme, index))
    params = dict(model.named_parameters())
    for name, source in weights:
        if name.endswith(".bias") and name.removesuffix(".bias") in prefixes:
            target = checkpoint_target(model, name)
            if target is not None and target[0] not in params and not bool(source[...].any()):
                continue
        yield name, source


def quantized_weights(weights: Iterator[tuple[str, Any]], model: nn.Module, scheme: QuantScheme,
                      index: dict[str, tuple[str, tuple[int, ...], str]], checkpoint_target: Any, dequantize: bool,
                      experts: dict[str, str]) -> Iterator[tuple[str, Any]]:
    """A quantized checkpoint's tensors as the loader takes them: all-zero biases of
    quantized modules left out (without_empty_biases); with `dequantize` every quantized
    module dense (iter_dequantized); else each quantized expert (`experts`, from
    plan_quantized_experts) as its GGUF blocks, read one expert at a time."""
    weights = without_empty_biases(weights, model, scheme, index, checkpoint_target)
    if dequantize:
        yield from iter_dequantized(weights, scheme, index)
        return
    names = {f"{p}.{n}" for p in experts for n in scheme.checkpoint_names}
    for name, source in weights:
        if name not in names:
            yield name, source
    with _tensors(index) as get:
        reorder = intermediate_orders(model, scheme, experts, checkpoint_target, get, index.__contains__)
        for prefix, quant in experts.items():
            yield f"{prefix}.weight", expert_blocks(scheme, prefix, get, index.__contains__,
                                                    _input_columns(scheme, index, prefix), quant, reorder.get(prefix))


def iter_dequantized(weights: Iterator[tuple[str, Any]], scheme: QuantScheme,
                     index: dict[str, tuple[str, tuple[int, ...], str]]) -> Iterator[tuple[str, Any]]:
    """The checkpoint's tensors with every quantized module's replaced by its dense
    `weight` (float32), read one module at a time (`dequantize=True`)."""
    prefixes = quantized_prefixes(scheme, index)
    packed = {f"{p}.{n}" for p in prefixes for n in scheme.checkpoint_names}
    for name, source in weights:
        if name not in packed:
            yield name, source
    with _tensors(index) as get:
        for prefix in prefixes:
            columns = _input_columns(scheme, index, prefix)
            yield f"{prefix}.weight", dequantized_module(scheme, prefix, get, index.__contains__, columns)


def _input_columns(scheme: QuantScheme, index: dict[str, tuple[str, tuple[int, ...], str]], prefix: str) -> int:
    shape = index[f"{prefix}.{'weight' if isinstance(scheme, FP8Scheme) else 'qweight'}"][1]
    if isinstance(scheme, FP8Scheme):
        return shape[1]
    return shape[0] if scheme.method == "awq" else shape[0] * 32 // scheme.bits
