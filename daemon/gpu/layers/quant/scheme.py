"""What a Hugging Face checkpoint's `quantization_config` asks for, checked before any
weight is read: an `IntGroupScheme` (AWQ, GPTQ: integer codes in groups of input
columns with a scale and a zero point each), an `FP8Scheme` (float8 e4m3 weights with
per-tensor, per-channel or block scales: HF's and vLLM's `fp8`, compressed-tensors'
`float-quantized`), or a ValueError naming the field and the value llmd does not
implement. Which modules a checkpoint quantizes is read from its tensors
(models/quant_plan.py); the config says how. Pure logic: no torch."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, NoReturn

METHODS = ("awq", "gptq", "fp8", "compressed-tensors")
GROUP_MULTIPLE = 32  # group sizes the packed kernels take (one GGUF block of 32 columns)


@dataclass(frozen=True)
class IntGroupScheme:
    """AWQ (GEMM packing) or GPTQ: `bits`-bit codes, one scale and zero point per
    `group_size` input columns (-1: one group per row, GPTQ's per-channel)."""

    method: str  # "awq" | "gptq"
    bits: int
    group_size: int
    zeros_minus_one: bool  # GPTQ's v1 checkpoints store each zero point minus one
    act_order: bool  # GPTQ desc_act: g_idx gives each input column's group
    not_converted: tuple[str, ...]  # modules the config keeps dense (the file decides; checked against it)
    symmetric: bool = False  # GPTQ sym: every zero point 2^(bits - 1)

    @property
    def label(self) -> str:
        """How the weights are named in the memory account (llmctl status)."""
        return f"{self.method}-int{self.bits}"

    @property
    def checkpoint_names(self) -> tuple[str, ...]:
        return ("qweight", "qzeros", "scales", "g_idx") if self.method == "gptq" else ("qweight", "qzeros", "scales")

    @property
    def block_type(self) -> str:
        """The GGUF blocks its weights are held as where the file cannot say otherwise (a
        MoE layer's experts, the pool's estimate): Q8_0 for 8 bits, else Q4_0 where every
        zero point is 2^(bits - 1) (sym), Q5_0 where they vary."""
        return "Q8_0" if self.bits == 8 else "Q4_0" if self.symmetric else "Q5_0"

    @property
    def required_names(self) -> tuple[str, ...]:
        return ("qweight", "qzeros", "scales", "g_idx") if self.act_order else ("qweight", "qzeros", "scales")


@dataclass(frozen=True)
class FP8Scheme:
    """float8 e4m3 weights times a float32 scale: per tensor, per output channel, or per
    `block` (output rows, input columns) tile; activations stay in the model's dtype
    (W8A16: a static `input_scale` is read and not applied)."""

    method: str  # "fp8" | "compressed-tensors"
    block: tuple[int, int] | None
    scale_name: str  # "weight_scale" (vLLM, compressed-tensors) or "weight_scale_inv" (HF fine-grained)
    not_converted: tuple[str, ...]
    # compressed-tensors' kv_cache_scheme: the largest magnitude of the format its static
    # per-layer K/V scales were taken for (448: float8 e4m3, 127: int8); None: none declared
    kv_qmax: float | None = None
    label = "fp8-e4m3"

    @property
    def checkpoint_names(self) -> tuple[str, ...]:
        return ("weight", self.scale_name, "input_scale")

    @property
    def required_names(self) -> tuple[str, ...]:
        return ("weight", self.scale_name)


QuantScheme = IntGroupScheme | FP8Scheme
# A quantized module's tensors beside its weight: zero points, scales, column groups.
_NOT_WEIGHTS = ("qzeros", "scales", "g_idx", "weight_scale", "weight_scale_inv", "input_scale")


def weights_per_element(name: str, scheme: QuantScheme | None) -> int:
    """Model weights one element of checkpoint tensor `name` stands for: 32 / bits for an
    AWQ/GPTQ `qweight` word, none for a quantized module's zero points, scales and column
    groups, one otherwise (what a listing or a memory estimate counts as parameters)."""
    if scheme is None:
        return 1
    leaf = name.rpartition(".")[2]
    if leaf == "qweight":
        return 32 // scheme.bits
    return 0 if leaf in _NOT_WEIGHTS else 1


def config_scheme(config: Mapping[str, Any]) -> QuantScheme | None:
    """quant_scheme of a config.json read as a dict (no transformers config needed)."""
    return quant_scheme(SimpleNamespace(quantization_config=config.get("quantization_config"),
                                        compression_config=config.get("compression_config")))


def _refuse(field: str, value: Any, why: str) -> NoReturn:
    raise ValueError(f"quantization_config.{field}={value!r} {why}")


def quant_scheme(config: Any) -> QuantScheme | None:
    """The scheme of a transformers config (None: not quantized), or ValueError naming
    the quantization_config field llmd does not implement."""
    # compressed-tensors' older checkpoints call it compression_config
    qc = getattr(config, "quantization_config", None) or getattr(config, "compression_config", None)
    if qc is None:
        return None
    if not isinstance(qc, Mapping):
        qc = qc.to_dict() if hasattr(qc, "to_dict") else vars(qc)
    method = qc.get("quant_method")
    if method == "awq":
        return _awq(qc)
    if method == "gptq":
        return _gptq(qc)
    if method == "fp8":
        return _hf_fp8(qc)
    if method == "compressed-tensors":
        return _compressed_tensors(qc)
    _refuse("quant_method", method, f"is not implemented by llmd (implemented: {', '.join(METHODS)}; "
                                    "GGUF files load too)")


def _names(value: Any, field: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str) or not isinstance(value, Sequence) or not all(isinstance(v, str) for v in value):
        _refuse(field, value, "must be a list of module names")
    return tuple(value)


def _group_size(qc: Mapping[str, Any], field: str, per_channel_ok: bool) -> int:
    group = qc.get(field)
    if per_channel_ok and group == -1:
        return -1
    if isinstance(group, bool) or not isinstance(group, int) or group <= 0 or group % GROUP_MULTIPLE:
        allowed = "-1 (per channel) or " if per_channel_ok else ""
        _refuse(field, group, f"is not implemented by llmd (implemented: {allowed}a positive multiple of "
                              f"{GROUP_MULTIPLE}, e.g. 32, 64, 128)")
    return group


def _awq(qc: Mapping[str, Any]) -> IntGroupScheme:
    bits = qc.get("bits", qc.get("w_bit"))
    if bits != 4:
        _refuse("bits", bits, "is not implemented by llmd for awq (implemented: 4)")
    version = qc.get("version", "gemm")
    if not isinstance(version, str) or version.lower() != "gemm":
        _refuse("version", version, "is not implemented by llmd for awq (implemented: gemm, AutoAWQ's "
                                    "GEMM packing; other versions pack the codes differently)")
    if qc.get("zero_point", True) is not True:
        _refuse("zero_point", qc.get("zero_point"), "is not implemented by llmd for awq (implemented: true)")
    group = _group_size(qc, "group_size" if "group_size" in qc else "q_group_size", per_channel_ok=False)
    return IntGroupScheme("awq", 4, group, zeros_minus_one=False, act_order=False,
                          not_converted=_names(qc.get("modules_to_not_convert"), "modules_to_not_convert"))


# GPTQ fields that change how the weights are laid out or computed, with what llmd reads.
_GPTQ_FORMATS = ("gptq", "gptq_v2")


def _gptq(qc: Mapping[str, Any]) -> IntGroupScheme:
    bits = qc.get("bits")
    if bits not in (4, 8) or isinstance(bits, bool):
        _refuse("bits", bits, "is not implemented by llmd for gptq (implemented: 4, 8)")
    fmt = qc.get("checkpoint_format", qc.get("format", "gptq"))
    if fmt not in _GPTQ_FORMATS:
        _refuse("checkpoint_format", fmt, f"is not implemented by llmd (implemented: {', '.join(_GPTQ_FORMATS)})")
    if qc.get("dynamic"):
        _refuse("dynamic", qc.get("dynamic"), "(per-module bits or group sizes) is not implemented by llmd")
    if qc.get("pack_dtype", "int32") not in ("int32", "torch.int32"):
        _refuse("pack_dtype", qc.get("pack_dtype"), "is not implemented by llmd (implemented: int32)")
    sym = qc.get("sym", True)
    if bits == 8 and sym is not True:
        _refuse("sym", sym, "is not implemented by llmd for 8-bit gptq: its zero points need 9-bit codes "
                            "(implemented: true; dequantize=True loads it dense)")
    desc_act = qc.get("desc_act", False)
    if not isinstance(desc_act, bool):
        _refuse("desc_act", desc_act, "must be true or false")
    return IntGroupScheme("gptq", bits, _group_size(qc, "group_size", per_channel_ok=True),
                          zeros_minus_one=fmt == "gptq", act_order=desc_act,
                          not_converted=_names(qc.get("modules_to_not_convert"), "modules_to_not_convert"),
                          symmetric=sym is True)


def _hf_fp8(qc: Mapping[str, Any]) -> FP8Scheme:
    """HF's fine-grained FP8 (`weight_block_size`, scales `weight_scale_inv`) and vLLM's
    / AutoFP8's per-tensor FP8 (no block size, scales `weight_scale`)."""
    scheme = qc.get("activation_scheme", "dynamic")
    if scheme not in ("dynamic", "static"):
        _refuse("activation_scheme", scheme, "is not implemented by llmd (implemented: dynamic, static)")
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        _refuse("fmt", fmt, "is not implemented by llmd for fp8 (implemented: e4m3)")
    if qc.get("scale_fmt", "float") != "float":
        _refuse("scale_fmt", qc.get("scale_fmt"), "is not implemented by llmd for fp8 (implemented: float)")
    block = qc.get("weight_block_size")
    if block is not None:
        block = _block(block, "weight_block_size")
    skip = qc.get("modules_to_not_convert", qc.get("ignored_layers"))
    return FP8Scheme("fp8", block, "weight_scale_inv" if block is not None else "weight_scale",
                     _names(skip, "modules_to_not_convert"))


def _block(block: Any, field: str) -> tuple[int, int]:
    if (not isinstance(block, Sequence) or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        _refuse(field, block, "must be two positive ints (output rows, input columns)")
    if block[1] % 16:
        _refuse(field, block, "is not implemented by llmd (the input block must be a multiple of 16)")
    return int(block[0]), int(block[1])


def _compressed_tensors(qc: Mapping[str, Any]) -> FP8Scheme:
    fmt = qc.get("format")
    if fmt not in ("float-quantized", "naive-quantized"):  # naive: the same float8 tensors, an older name
        _refuse("format", fmt, "is not implemented by llmd for compressed-tensors (implemented: float-quantized, "
                               "naive-quantized with float weights)")
    for field in ("sparsity_config", "transform_config"):
        if qc.get(field):
            _refuse(field, qc.get(field), "is not implemented by llmd")
    groups = qc.get("config_groups")
    if not isinstance(groups, Mapping) or not groups:
        _refuse("config_groups", groups, "must name at least one quantization scheme")
    blocks = {_ct_group(name, group) for name, group in groups.items()}
    if len(blocks) > 1:
        _refuse("config_groups", sorted(groups), "mix block-wise and other FP8 weight strategies: not implemented "
                                                 "by llmd")
    return FP8Scheme("compressed-tensors", blocks.pop(), "weight_scale", _names(qc.get("ignore"), "ignore"),
                     _kv_cache_scheme(qc.get("kv_cache_scheme")))


# kv_cache_scheme's type -> the largest magnitude of the format its scales were taken for.
KV_SCHEME_QMAX = {"float": 448.0, "int": 127.0}


def _kv_cache_scheme(kv: Any) -> float | None:
    """The format's largest magnitude for a kv_cache_scheme of static, symmetric, 8-bit
    per-tensor K/V scales (one k_scale and v_scale a layer, which the checkpoint
    carries: models/checkpoint_kv_scales.py); None when there is none."""
    if not kv:
        return None
    if not isinstance(kv, Mapping):
        _refuse("kv_cache_scheme", kv, "must be a mapping")
    wanted = {"num_bits": 8, "strategy": "tensor", "dynamic": False, "symmetric": True}
    for key, value in wanted.items():
        if kv.get(key, value) != value:
            _refuse(f"kv_cache_scheme.{key}", kv.get(key), f"is not implemented by llmd (implemented: static, "
                                                           f"symmetric 8-bit scales per tensor: {key}={value!r})")
    if kv.get("type", "float") not in KV_SCHEME_QMAX:
        _refuse("kv_cache_scheme.type", kv.get("type"), "is not implemented by llmd (implemented: float, int)")
    return KV_SCHEME_QMAX[kv.get("type", "float")]


def _ct_group(name: str, group: Any) -> tuple[int, int] | None:
    """One config group's weight block (None: per tensor or per channel), after checking
    it is an FP8 scheme llmd runs."""
    where = f"config_groups.{name}"
    if not isinstance(group, Mapping):
        _refuse(where, group, "must be a mapping")
    weights = group.get("weights")
    if not isinstance(weights, Mapping):
        _refuse(f"{where}.weights", weights, "must describe the weights' quantization")
    for field, want in (("type", "float"), ("num_bits", 8), ("symmetric", True), ("dynamic", False)):
        if weights.get(field, want) != want:
            _refuse(f"{where}.weights.{field}", weights.get(field), f"is not implemented by llmd (implemented: {want})")
    strategy = weights.get("strategy")
    if strategy not in ("tensor", "channel", "block"):
        _refuse(f"{where}.weights.strategy", strategy, "is not implemented by llmd (implemented: tensor, channel, "
                                                       "block)")
    if group.get("output_activations"):
        _refuse(f"{where}.output_activations", group.get("output_activations"), "is not implemented by llmd")
    acts = group.get("input_activations")
    if acts and (acts.get("type") != "float" or acts.get("num_bits") != 8):
        _refuse(f"{where}.input_activations", {k: acts.get(k) for k in ("type", "num_bits")},
                "is not implemented by llmd (implemented: none, or float 8-bit, run as W8A16)")
    return _block(weights.get("block_structure"), f"{where}.weights.block_structure") if strategy == "block" else None
