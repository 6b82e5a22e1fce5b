"""Quantize a dense Hugging Face checkpoint (a `make_model` fixture) into the layouts AWQ,
GPTQ and FP8 tools write, for tests and benchmarks: round-to-nearest, no calibration
(the layout is the point, not the accuracy).

    python -m llmd_tools.quantize_checkpoint --model DIR --out DIR --method awq [--group-size 128]
    python -m llmd_tools.quantize_checkpoint --model DIR --out DIR --method gptq --bits 8 --act-order
    python -m llmd_tools.quantize_checkpoint --model DIR --out DIR --method fp8 --fp8-style channel

Every linear layer of the decoder blocks is quantized (q/k/v/o, gate/up/down, Phi-3's
fused qkv / gate_up, MoE experts; not routers), the LM head with `--lm-head`, none of
the modules named in `--keep-dense` (written to the config's skip list). Other tensors
are stored in `--dense-dtype` (float16 for AWQ/GPTQ, bfloat16 for FP8, as such
checkpoints ship).

* `awq`: AutoAWQ's GEMM layout, asymmetric (a zero point per group);
* `gptq`: AutoGPTQ's layout, `--sym` (zero 2^(bits-1)) or asymmetric, `--act-order`
  (columns grouped in order of decreasing weight norm of the modules sharing the input,
  as GPTQ orders them by its Hessian; `--order-per-module`: each module its own order),
  v1 zero points (stored minus one) unless `--gptq-v2`;
* `fp8`, `--fp8-style`: `tensor` (vLLM/AutoFP8: `quant_method: fp8`, `weight_scale`
  per tensor, a static `input_scale`), `channel` (compressed-tensors float-quantized,
  per output channel, dynamic activations), `block` (HF fine-grained:
  `weight_block_size`, `weight_scale_inv` per block).

`--kv-scales NAMES` adds static per-layer K/V cache scales, as llm-compressor's and
vLLM's exporters write them: each layer's largest |k_proj| and |v_proj| output over a
calibration text (transformers on the dense model) over 448 (float8 e4m3), stored as
`layers.N.self_attn.k_scale` / `v_scale` (`self_attn`), `self_attn.k_proj.output_scale`
/ `v_proj.output_scale` (`output_scale`: compressed-tensors' older name) or one
`self_attn.kv_scale` of the larger (`kv_scale`: the deprecated single scale); with the
compressed-tensors layout the config declares them (`kv_cache_scheme`).
"""
from __future__ import annotations

import argparse
import json
import re
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
E4M3_MAX = 448.0
_LINEAR = re.compile(r"(.*\.layers\.\d+\..*(?:_proj|\.w[123]))\.weight$")


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint codes [..., n] -> int32 words [..., n * bits / 32], the first code in the lowest bits."""
    per = 32 // bits
    words = codes.to(torch.int64).unflatten(-1, (-1, per)) << (torch.arange(per) * bits)
    words = words.sum(-1)
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)


def _groups_of(cols: int, group: int, order: torch.Tensor | None) -> torch.Tensor:
    """g_idx: each input column's group (with an order: the columns in that order fill the groups)."""
    position = torch.arange(cols) if order is None else torch.argsort(order)
    return position // group


def int_quantize(w: torch.Tensor, bits: int, group: int, sym: bool, order: torch.Tensor | None):
    """(codes [out, in] uint8, zeros [out, groups], fp16 scales [out, groups], g_idx [in])."""
    g_idx = _groups_of(w.shape[1], group, order)
    groups = int(g_idx.max()) + 1
    top = 2 ** bits - 1
    one_hot = torch.nn.functional.one_hot(g_idx, groups).bool().t()  # [groups, in]
    big = torch.finfo(torch.float32).max
    wmax = torch.stack([torch.where(m, w, -big).amax(1) for m in one_hot], 1)
    wmin = torch.stack([torch.where(m, w, big).amin(1) for m in one_hot], 1)
    if sym:
        scales = (torch.maximum(wmax.abs(), wmin.abs()) * 2 / top).clamp(min=1e-5).half()
        zeros = torch.full_like(wmax, 2 ** (bits - 1)).to(torch.int32)
    else:
        wmax, wmin = wmax.clamp(min=0), wmin.clamp(max=0)
        scales = ((wmax - wmin) / top).clamp(min=1e-5).half()
        zeros = (-torch.round(wmin / scales.float())).clamp(0, top).to(torch.int32)
    s, z = scales.float()[:, g_idx], zeros[:, g_idx]
    codes = (torch.round(w / s) + z).clamp(0, top).to(torch.uint8)
    return codes, zeros, scales, g_idx


def awq_tensors(w: torch.Tensor, group: int) -> dict[str, torch.Tensor]:
    codes, zeros, scales, _ = int_quantize(w, 4, group, sym=False, order=None)
    order = torch.tensor(AWQ_ORDER)

    def interleaved(columns: torch.Tensor) -> torch.Tensor:  # [rows, out] -> AWQ words [rows, out / 8]
        return pack_codes(columns.unflatten(-1, (-1, 8))[..., order].flatten(-2), 4)
    return {"qweight": interleaved(codes.t()), "qzeros": interleaved(zeros.t()), "scales": scales.t().contiguous()}


def gptq_tensors(w: torch.Tensor, bits: int, group: int, sym: bool, order: torch.Tensor | None,
                 v1: bool) -> dict[str, torch.Tensor]:
    codes, zeros, scales, g_idx = int_quantize(w, bits, group, sym, order)
    stored = (zeros - int(v1)) & (2 ** bits - 1)
    return {"qweight": pack_codes(codes, bits).t().contiguous(),  # [in / pack, out]: input rows packed
            "qzeros": pack_codes(stored.t().contiguous(), bits), "scales": scales.t().contiguous(),
            "g_idx": g_idx.to(torch.int32)}


def fp8_tensors(w: torch.Tensor, style: str, block: tuple[int, int]) -> dict[str, torch.Tensor]:
    if style == "tensor":
        scale = (w.abs().amax() / E4M3_MAX).clamp(min=1e-12)
        q = (w / scale).to(torch.float8_e4m3fn)
        return {"weight": q, "weight_scale": scale.float().reshape(()), "input_scale": torch.tensor(0.02)}
    if style == "channel":
        scale = (w.abs().amax(1, keepdim=True) / E4M3_MAX).clamp(min=1e-12)
        return {"weight": (w / scale).to(torch.float8_e4m3fn), "weight_scale": scale.float()}
    rows, cols = block
    out, inp = w.shape
    nb_r, nb_c = -(-out // rows), -(-inp // cols)
    padded = torch.zeros(nb_r * rows, nb_c * cols)
    padded[:out, :inp] = w
    tiles = padded.view(nb_r, rows, nb_c, cols)
    scale = (tiles.abs().amax((1, 3)) / E4M3_MAX).clamp(min=1e-12)  # [nb_r, nb_c]
    q = (tiles / scale[:, None, :, None]).reshape(nb_r * rows, nb_c * cols)[:out, :inp]
    return {"weight": q.to(torch.float8_e4m3fn), "weight_scale_inv": scale.float()}


def input_orders(weights: dict[str, torch.Tensor], prefixes: list[str], per_module: bool) -> dict[str, torch.Tensor]:
    """GPTQ act-order: each module's input columns by decreasing norm over the modules
    that read the same input (q/k/v, gate/up: one order, as GPTQ's Hessian is theirs
    alike), or each module's own with `per_module`."""
    siblings: dict[str, list[str]] = {}
    for prefix in prefixes:
        shared = re.sub(r"\.(gate|up)_proj$", ".gate_up", re.sub(r"\.(q|k|v)_proj$", ".qkv", prefix))
        key = prefix if per_module else shared
        siblings.setdefault(key, []).append(prefix)
    orders = {}
    for members in siblings.values():
        norms = torch.cat([weights[m + ".weight"].float() for m in members]).norm(dim=0)
        order = torch.argsort(norms, descending=True, stable=True)
        orders.update({m: order for m in members})
    return orders


def quantized_prefixes(weights: dict[str, torch.Tensor], lm_head: bool, keep_dense: list[str]) -> list[str]:
    found = [m.group(1) for name in weights if (m := _LINEAR.fullmatch(name))]
    if lm_head and "lm_head.weight" in weights:
        found.append("lm_head")
    return [p for p in found if not any(p == k or p.endswith("." + k) for k in keep_dense)]


def quantization_config(args: argparse.Namespace) -> dict[str, Any]:
    skip = list(args.keep_dense) or None
    if args.method == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": args.group_size, "zero_point": True,
                "version": "gemm", "modules_to_not_convert": skip}
    if args.method == "gptq":
        return {"quant_method": "gptq", "bits": args.bits, "group_size": args.group_size, "desc_act": args.act_order,
                "sym": args.sym, "checkpoint_format": "gptq_v2" if args.gptq_v2 else "gptq", "static_groups": False,
                "true_sequential": True, "damp_percent": 0.01, "lm_head": args.lm_head}
    if args.fp8_style == "tensor":
        return {"quant_method": "fp8", "activation_scheme": "static", "ignored_layers": skip}
    if args.fp8_style == "block":
        return {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": list(args.block),
                "modules_to_not_convert": skip}
    weights = {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True, "dynamic": False,
               "group_size": None, "block_structure": None, "observer": "minmax"}
    acts = {"num_bits": 8, "type": "float", "strategy": "token", "symmetric": True, "dynamic": True}
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": acts,
                                          "output_activations": None}},
            "ignore": ["lm_head", *args.keep_dense] if not args.lm_head else list(args.keep_dense),
            "kv_cache_scheme": None if args.kv_scales is None else
            {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}}


KV_CALIBRATION_TEXT = "The quick brown fox jumps over the lazy dog. " * 8


@torch.no_grad()
def kv_scale_tensors(model: Path, naming: str) -> dict[str, torch.Tensor]:
    """Each layer's K/V cache scales (module doc), named as `naming` says."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    ids = AutoTokenizer.from_pretrained(model)(KV_CALIBRATION_TEXT, return_tensors="pt").input_ids
    amax: dict[str, float] = {}
    hooks = [module.register_forward_hook(lambda _m, _i, out, name=name: amax.__setitem__(name, out.abs().max().item()))
             for name, module in hf.named_modules() if re.search(r"self_attn\.[kv]_proj$", name)]
    hf(ids)
    for hook in hooks:
        hook.remove()
    out = {}
    for name, value in amax.items():
        layer, part = name.rsplit(".", 1)[0], name[-6]  # "...self_attn", "k" | "v"
        if naming == "self_attn":
            out[f"{layer}.{part}_scale"] = torch.tensor(value / E4M3_MAX)
        elif naming == "output_scale":
            out[f"{name}.output_scale"] = torch.tensor([value / E4M3_MAX])
        elif part == "k":  # kv_scale: the larger of the two
            out[f"{layer}.kv_scale"] = torch.tensor(max(value, amax[f"{layer}.v_proj"]) / E4M3_MAX)
    return out


def quantize_tensors(weights: dict[str, torch.Tensor], args: argparse.Namespace) -> dict[str, torch.Tensor]:
    prefixes = quantized_prefixes(weights, args.lm_head, args.keep_dense)
    orders = input_orders(weights, prefixes, args.order_per_module) if args.act_order else {}
    dense = getattr(torch, args.dense_dtype or ("bfloat16" if args.method == "fp8" else "float16"))
    out = {}
    for name, t in weights.items():
        prefix = name.removesuffix(".weight")
        if name.endswith(".weight") and prefix in prefixes:
            w = t.float()
            if args.method == "awq":
                parts = awq_tensors(w, args.group_size)
            elif args.method == "gptq":
                group = args.group_size if args.group_size > 0 else w.shape[1]
                parts = gptq_tensors(w, args.bits, group, args.sym, orders.get(prefix), v1=not args.gptq_v2)
            else:
                parts = fp8_tensors(w, args.fp8_style, tuple(args.block))
            out.update({f"{prefix}.{k}": v for k, v in parts.items()})
        else:
            out[name] = t.to(dense) if t.is_floating_point() else t
    return out


def quantize_checkpoint(model: str | Path, out: str | Path, args: argparse.Namespace) -> Path:
    """Write `model` quantized as `args` say (module doc) into `out`; returns `out`."""
    model, out = Path(model), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    weights: dict[str, torch.Tensor] = {}
    for file in sorted(model.glob("*.safetensors")):
        weights.update(load_file(str(file)))
    tensors = quantize_tensors(weights, args)
    if args.kv_scales is not None:
        tensors.update(kv_scale_tensors(model, args.kv_scales))
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    for file in model.iterdir():
        if file.is_file() and not file.name.endswith(".safetensors") and file.name != "config.json":
            shutil.copy(file, out / file.name)
    config = json.loads((model / "config.json").read_text())
    config["quantization_config"] = quantization_config(args)
    config["dtype"] = args.dense_dtype or ("bfloat16" if args.method == "fp8" else "float16")
    config.pop("torch_dtype", None)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", required=True, help="dense HF directory")
    p.add_argument("--out", required=True)
    p.add_argument("--method", choices=("awq", "gptq", "fp8"), required=True)
    p.add_argument("--bits", type=int, default=4, choices=(4, 8), help="gptq")
    p.add_argument("--group-size", type=int, default=128, help="awq / gptq (-1: per channel, gptq)")
    p.add_argument("--sym", action=argparse.BooleanOptionalAction, default=True, help="gptq")
    p.add_argument("--act-order", action="store_true", help="gptq desc_act")
    p.add_argument("--order-per-module", action="store_true", help="gptq act-order: an order per module")
    p.add_argument("--gptq-v2", action="store_true", help="gptq: zero points as they are (checkpoint_format gptq_v2)")
    p.add_argument("--fp8-style", choices=("tensor", "channel", "block"), default="tensor")
    p.add_argument("--block", type=int, nargs=2, default=(128, 128), help="fp8 block: rows, columns")
    p.add_argument("--lm-head", action="store_true", help="quantize the LM head too")
    p.add_argument("--keep-dense", nargs="*", default=[], help="module names left dense (the skip list)")
    p.add_argument("--dense-dtype", choices=("float16", "bfloat16", "float32"), default=None)
    p.add_argument("--kv-scales", choices=("self_attn", "output_scale", "kv_scale"), default=None,
                   help="add static per-layer K/V cache scales, named so")
    return p


def options(**overrides: Any) -> argparse.Namespace:
    """The CLI's defaults with `overrides` (keyword names as the flags', dashes as underscores)."""
    args = parser().parse_args(["--model", "-", "--out", "-", "--method", overrides.pop("method")])
    for key, value in overrides.items():
        if not hasattr(args, key):
            raise TypeError(f"unknown option {key!r}")
        setattr(args, key, value)
    return args


def main() -> None:
    args = parser().parse_args()
    print(quantize_checkpoint(args.model, args.out, args))


if __name__ == "__main__":
    main()
