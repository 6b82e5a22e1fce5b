"""Per-layer scales of a quantized KV cache (kv_cache_dtype "fp8" or "int8", kv_quant),
fixed once per model before its cache is first written.

The scales come from a calibration forward at start-up: one prefill of
CALIBRATION_TOKENS fixed pseudo-random tokens (the same on every start and every TP
rank) into a throwaway cache in the model's dtype; each layer's largest |K| and |V| there
set its scales (kv_quant.calibrated_scale: twice that amax fits unclipped; fp8 never
below 1.0, vLLM's default). That is vLLM's `calculate_kv_scales` (the amax of a prefill)
done on a fixed input instead of the first request's:
- a block written with one scale cannot be read with another, so the scales must be
  known before any request writes a block, and stay;
- decode graphs (cuda_graphs) are captured with the scales as constants, before the
  first request;
- a request's output must not depend on which request happened to come first.
A value beyond the calibrated range is clamped to the format's largest (never wraps or
becomes NaN). A checkpoint that carries its own per-layer K/V scales
(models/checkpoint_kv_scales.py, `model.kv_amax`) is not calibrated: its scales are
used, converted to the chosen format (`kv_scales_for`).
"""
from __future__ import annotations

import logging

import torch

from llmd.gpu.layers.attention import AttentionLayer, AttentionMetadata, GatherWorkspace, new_model_kv_caches
from llmd.gpu.layers.attention_backends import metadata_builder
from llmd.gpu.layers.kv_quant import KVCacheFormat, KVScales, calibrated_scale

logger = logging.getLogger("llmd.kv_calibration")

CALIBRATION_TOKENS = 256
CALIBRATION_SEED = 0


def attention_layers(model: torch.nn.Module) -> list[AttentionLayer]:
    """The model's attention layers, in layer order (one per cache tensor)."""
    return [layer.self_attn.attn for layer in model.layers]


def set_kv_scales(model: torch.nn.Module, scales: list[KVScales]) -> None:
    layers = attention_layers(model)
    if len(scales) != len(layers):
        raise ValueError(f"{len(scales)} KV scales for a model of {len(layers)} layers")
    for layer, layer_scales in zip(layers, scales):
        layer.kv_scales = layer_scales


def kv_scales_for(model: torch.nn.Module, fmt: KVCacheFormat, **calibration) -> list[KVScales]:
    """Each layer's scales for a cache of format `fmt`: the checkpoint's own where it has
    them (each layer's amax at the format's largest value, as the checkpoint's exporter
    set it), else calibrate_kv_scales(model, fmt, **calibration)."""
    amax = getattr(model, "kv_amax", None)
    if amax is None:
        return calibrate_kv_scales(model, fmt, **calibration)
    scales = [KVScales(k / fmt.qmax, v / fmt.qmax) for k, v in zip(amax.k, amax.v)]
    logger.info("KV cache %s: the checkpoint's per-layer scales: k %.3g..%.3g, v %.3g..%.3g", fmt.name,
                min(s.k for s in scales), max(s.k for s in scales), min(s.v for s in scales), max(s.v for s in scales))
    return scales


@torch.inference_mode()
def calibrate_kv_scales(model: torch.nn.Module, fmt: KVCacheFormat, *, block_size: int, max_tokens: int,
                        vocab_size: int, dtype: torch.dtype, device: torch.device) -> list[KVScales]:
    """Each layer's scales for a cache of format `fmt`, from one prefill of up to
    CALIBRATION_TOKENS tokens (never more than `max_tokens`, the largest step the engine
    takes) drawn from the first `vocab_size` ids (module docstring). With tensor
    parallelism every rank calls it together (the forward has collectives) and gets the
    scales of its own heads."""
    n = max(1, min(CALIBRATION_TOKENS, max_tokens))
    num_blocks = -(-n // block_size)
    caches = new_model_kv_caches(model, num_blocks, block_size, dtype, device)
    md = AttentionMetadata(slot_mapping=torch.arange(n, device=device), num_decodes=0, decode_block_table=None,
                           decode_seq_lens=None, prefills=[(0, n, 0, torch.arange(num_blocks, device=device))],
                           workspace=GatherWorkspace())
    metadata_builder(model, block_size, device).build(md)
    generator = torch.Generator().manual_seed(CALIBRATION_SEED)
    ids = torch.randint(0, vocab_size, (n,), generator=generator).to(device)
    model(ids, torch.arange(n, device=device), caches, md)
    amax = torch.stack([torch.stack([c[0].abs().amax(), c[1].abs().amax()]).float() for c in caches]).tolist()
    scales = [KVScales(calibrated_scale(k, fmt), calibrated_scale(v, fmt)) for k, v in amax]
    ks, vs = [s.k for s in scales], [s.v for s in scales]
    logger.info("KV cache %s: per-layer scales from a %d-token calibration prefill: k %.3g..%.3g, v %.3g..%.3g",
                fmt.name, n, min(ks), max(ks), min(vs), max(vs))
    return scales
