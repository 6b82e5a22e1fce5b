"""The independent reference for quantized safetensors checkpoints: each format's
dequantization written here from its published layout (AutoAWQ's GEMM packing,
AutoGPTQ's, FP8 e4m3 with torch's own float8 conversion), sharing no code with llmd,
and a dense checkpoint of the dequantized weights that HF transformers runs.

AWQ (AutoAWQ `WQLinear_GEMM.from_linear`): `qweight[k, j]` holds in bits 4i..4i+3 the
code of input row k, output column 8j + [0, 2, 4, 6, 1, 3, 5, 7][i]; `qzeros` likewise
per group; w = (q - z) * s. GPTQ (AutoGPTQ `QuantLinear.pack`): `qweight[r, n]` holds in
bits b*i.. the code of input row r * (32 / b) + i; `qzeros[g, j]` the zero of output
column j * (32 / b) + i; v1 checkpoints store z - 1; w = (q - z[g_idx]) * s[g_idx].
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

AWQ_PACK_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def awq_dense(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group: int) -> torch.Tensor:
    """[out, in] float32."""
    words = qweight.long()
    rows, out = words.shape[0], words.shape[1] * 8
    codes = torch.empty(rows, out, dtype=torch.long)
    zeros = torch.empty(qzeros.shape[0], out, dtype=torch.long)
    for i, column in enumerate(AWQ_PACK_ORDER):
        codes[:, column::8] = (words >> (4 * i)) & 0xF
        zeros[:, column::8] = (qzeros.long() >> (4 * i)) & 0xF
    g = torch.arange(rows) // group
    return ((codes - zeros[g]).double() * scales.double()[g]).float().t()


def gptq_dense(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor | None,
               bits: int, v1: bool, group: int) -> torch.Tensor:
    """[out, in] float32."""
    per, mask = 32 // bits, (1 << bits) - 1
    rows, out = qweight.shape[0] * per, qweight.shape[1]
    codes = torch.empty(rows, out, dtype=torch.long)
    zeros = torch.empty(qzeros.shape[0], out, dtype=torch.long)
    for i in range(per):
        codes[i::per] = (qweight.long() >> (bits * i)) & mask
        zeros[:, i::per] = (qzeros.long() >> (bits * i)) & mask
    if v1:
        zeros += 1
    g = torch.arange(rows) // group if g_idx is None else g_idx.long()
    return ((codes - zeros[g]).double() * scales.double()[g]).float().t()


def fp8_dense(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None) -> torch.Tensor:
    """[out, in] float32: torch's float8 conversion times the tensor's, row's or block's scale."""
    w = weight.to(torch.float32)
    scale = scale.float()
    if block is None:
        return w * (scale.reshape(-1, 1) if scale.numel() > 1 else scale.reshape(()))
    rows, cols = block
    full = scale.repeat_interleave(rows, 0)[:w.shape[0]].repeat_interleave(cols, 1)[:, :w.shape[1]]
    return w * full


def dequantized_tensors(tensors: dict[str, torch.Tensor], qc: dict) -> dict[str, torch.Tensor]:
    """A quantized checkpoint's tensors with every quantized module's replaced by its dense weight."""
    method = qc["quant_method"]
    dense, skip = {}, set()
    for name in tensors:
        if method in ("awq", "gptq") and name.endswith(".qweight"):
            p = name.removesuffix(".qweight")
            if method == "awq":
                w = awq_dense(tensors[name], tensors[p + ".qzeros"], tensors[p + ".scales"], qc["group_size"])
            else:
                columns = tensors[name].shape[0] * 32 // qc["bits"]
                group = qc["group_size"] if qc["group_size"] > 0 else columns
                w = gptq_dense(tensors[name], tensors[p + ".qzeros"], tensors[p + ".scales"], tensors.get(p + ".g_idx"),
                               qc["bits"], qc.get("checkpoint_format", "gptq") == "gptq", group)
            dense[p + ".weight"] = w
            skip |= {p + s for s in (".qweight", ".qzeros", ".scales", ".g_idx")}
        elif tensors[name].dtype == torch.float8_e4m3fn:
            p = name.removesuffix(".weight")
            scale_name = next(n for n in (".weight_scale", ".weight_scale_inv") if p + n in tensors)
            block = qc.get("weight_block_size")
            dense[name] = fp8_dense(tensors[name], tensors[p + scale_name], tuple(block) if block else None)
            skip |= {p + s for s in (".weight", ".weight_scale", ".weight_scale_inv", ".input_scale")}
    dense.update({n: t for n, t in tensors.items() if n not in skip and n not in dense})
    return dense


def write_dequantized(quantized: Path, out: Path) -> Path:
    """A dense checkpoint of `quantized`'s dequantized weights (float32), for transformers."""
    out.mkdir(parents=True, exist_ok=True)
    config = json.loads((quantized / "config.json").read_text())
    qc = config.pop("quantization_config")
    config["dtype"] = "float32"
    tensors = load_file(str(quantized / "model.safetensors"))
    dense = {n: (t.float() if t.is_floating_point() else t).contiguous() for n, t in dequantized_tensors(tensors, qc).items()}
    save_file(dense, str(out / "model.safetensors"), metadata={"format": "pt"})
    for file in quantized.iterdir():
        if file.is_file() and file.name not in ("config.json", "model.safetensors"):
            shutil.copy(file, out / file.name)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out
