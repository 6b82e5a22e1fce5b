"""A checkpoint's own per-layer K/V cache scales (models/checkpoint_kv_scales.py): read
under each name the exporters write, used for a quantized cache instead of the
calibration (converted to the chosen format), left alone with a float cache, and refused
by name when the config or the tensors are not what llmd implements. The reference for
what the cache stores is torch's own float8 e4m3 rounding of the K/V a float cache holds,
divided by the scale read from the file with safetensors."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from llmd import LLM, SamplingParams
from llmd.gpu.layers.quant.scheme import config_scheme
from llmd_tools.make_model import build_model
from llmd_tools.quantize_checkpoint import options, quantize_checkpoint

SETTINGS = dict(device="cpu", dtype="float32", num_gpu_blocks_override=64, max_model_len=256)
PROMPT = [5, 9, 77, 3, 12, 40, 41, 42, 100, 7] * 4
QMAX = {"fp8": 448.0, "int8": 127.0}
# (--kv-scales naming, FP8 layout): compressed-tensors declares the scales in its config
# (kv_cache_scheme); vLLM's fp8 layout carries them without a word in the config.
CASES = {"self_attn": "channel", "output_scale": "tensor", "kv_scale": "channel"}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("kv-scales")
    dense = build_model(root / "dense", "llama", "tiny", intermediate_size=192)
    made: dict[str, Path] = {}

    def get(naming: str) -> Path:
        if naming not in made:
            made[naming] = quantize_checkpoint(dense, root / naming,
                                               options(method="fp8", fp8_style=CASES[naming], kv_scales=naming))
        return made[naming]

    return get


def file_scales(path: Path) -> list[tuple[float, float]]:
    """Each layer's (k, v) scale as the file stores it, whatever the naming."""
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        values = {name: f.get_tensor(name).item() for name in f.keys()
                  if name.endswith(("k_scale", "v_scale", "kv_scale", "output_scale"))}
    layers = json.loads((path / "config.json").read_text())["num_hidden_layers"]
    out = []
    for i in range(layers):
        p = f"model.layers.{i}.self_attn"
        if f"{p}.kv_scale" in values:
            out.append((values[f"{p}.kv_scale"],) * 2)
        else:
            out.append(tuple(values.get(f"{p}.{x}_scale", values.get(f"{p}.{x}_proj.output_scale")) for x in "kv"))
    assert all(None not in pair for pair in out), values
    return out


def run(path: Path, kv: str) -> LLM:
    llm = LLM(model=str(path), kv_cache_dtype=kv, **SETTINGS)
    llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=1))
    return llm


@pytest.mark.parametrize("kv", ["fp8", "int8"])
@pytest.mark.parametrize("naming", list(CASES))
def test_a_quantized_cache_takes_the_checkpoints_scales(checkpoint, naming, kv):
    path = checkpoint(naming)
    engine = run(path, kv).engine
    runner = engine.executor.runner
    assert engine.kv_cache_scales == "checkpoint"  # what llmctl status shows beside the format
    expected = [x * 448.0 / QMAX[kv] for pair in file_scales(path) for x in pair]
    got = [x for s in runner.kv_scales for x in (s.k, s.v)]
    assert got == pytest.approx(expected, rel=1e-6)
    assert len(set(got[::2])) > 1  # the layers' own, not one value for all


def test_a_worker_process_reports_where_its_scales_come_from(checkpoint):
    """With the model in a worker process the engine learns the scales' source from it."""
    llm = LLM(model=str(checkpoint("self_attn")), kv_cache_dtype="fp8", distributed_executor_backend="mp", **SETTINGS)
    try:
        assert llm.engine.kv_cache_scales == "checkpoint" and llm.engine.executor.worker_pids()
    finally:
        llm.engine.shutdown()


def test_the_cache_stores_k_and_v_rounded_at_the_checkpoints_scales(checkpoint):
    """Every byte of layer 0's fp8 cache (whose K and V no earlier layer's rounding
    touches) is torch's e4m3 of what a float32 cache holds there over the file's scale."""
    path = checkpoint("self_attn")
    dense = run(path, "auto").engine.executor.runner.kv_caches[0].clone()
    stored = run(path, "fp8").engine.executor.runner.kv_caches[0]
    assert dense.count_nonzero() > 0
    for i, scale in enumerate(file_scales(path)[0]):
        expected = (dense[i] / torch.tensor(scale, dtype=torch.float32)).clamp(-448, 448).to(torch.float8_e4m3fn)
        assert torch.equal(stored[i], expected.view(torch.uint8)), "KV"[i]


def test_a_float_cache_leaves_the_scales_alone(checkpoint):
    path = checkpoint("self_attn")
    engine = run(path, "auto").engine
    runner = engine.executor.runner
    assert runner.kv_scales is None and runner.model.kv_amax is not None and engine.kv_cache_scales == ""
    assert all(layer.self_attn.attn.kv_scales.k == 1.0 for layer in runner.model.layers)


def _edited(path: Path, out: Path, drop: tuple[str, ...] = (), value: tuple[str, torch.Tensor] | None = None,
            kv_cache_scheme: object = "keep") -> Path:
    out.mkdir()
    for file in path.iterdir():
        if file.name not in ("model.safetensors", "config.json"):
            (out / file.name).write_bytes(file.read_bytes())
    tensors = {k: v for k, v in load_file(str(path / "model.safetensors")).items() if not k.endswith(drop or ("-",))}
    if value is not None:
        tensors[value[0]] = value[1]
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    if kv_cache_scheme != "keep":
        config["quantization_config"]["kv_cache_scheme"] = kv_cache_scheme
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.mark.parametrize("edit, message", [
    (dict(drop=("k_scale", "v_scale")), "declares static K/V cache scales, but the checkpoint has no"),
    (dict(drop=("layers.1.self_attn.v_scale",)), "not 'layers.1.self_attn.v_scale' (1 missing)"),
    (dict(value=("model.layers.0.self_attn.k_scale", torch.tensor(0.0))), "'model.layers.0.self_attn.k_scale' is 0.0"),
    (dict(value=("model.layers.0.self_attn.k_scale", torch.tensor(float("nan")))), "is nan"),
    (dict(value=("model.layers.0.self_attn.k_scale", torch.ones(2))), "has 2 values"),
    (dict(value=("model.layers.9.self_attn.k_scale", torch.tensor(0.1))), "scale for layer 9 in a checkpoint of"),
    (dict(kv_cache_scheme={"num_bits": 8, "type": "float", "strategy": "attn_head", "dynamic": False,
                           "symmetric": True}), "kv_cache_scheme.strategy='attn_head' is not implemented"),
])
def test_scales_llmd_cannot_use_are_refused_by_name(checkpoint, tmp_path, edit, message):
    broken = _edited(checkpoint("self_attn"), tmp_path / "broken", **edit)
    with pytest.raises(Exception, match=re.escape(message)):
        LLM(model=str(broken), **SETTINGS)


def test_a_query_scale_is_read_past(checkpoint, tmp_path):
    """FP8 attention's query scales (llm-compressor writes them beside K/V's): queries
    stay in the model's dtype, the logits are those of the checkpoint without them."""
    path = _edited(checkpoint("self_attn"), tmp_path / "with-q",
                   value=("model.layers.1.self_attn.q_scale", torch.tensor(0.01)))
    params = SamplingParams(temperature=0, max_tokens=4, logprobs=3, ignore_eos=True)
    outs = [LLM(model=str(p), kv_cache_dtype="fp8", **SETTINGS).generate([PROMPT], params)[0].outputs[0]
            for p in (path, checkpoint("self_attn"))]
    assert outs[0].token_ids == outs[1].token_ids and outs[0].logprobs == outs[1].logprobs


def test_the_same_scales_without_the_config_saying_so_are_still_read(checkpoint, tmp_path):
    path = _edited(checkpoint("self_attn"), tmp_path / "undeclared", kv_cache_scheme=None)
    runner = run(path, "fp8").engine.executor.runner
    got = [x for s in runner.kv_scales for x in (s.k, s.v)]
    assert got == pytest.approx([x for pair in file_scales(path) for x in pair], rel=1e-6)


@pytest.mark.parametrize("scheme, qmax", [
    ({"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}, 448.0),
    ({"num_bits": 8, "type": "int", "strategy": "tensor", "dynamic": False, "symmetric": True}, 127.0),
    (None, None),
])
def test_kv_cache_scheme_gives_the_scales_format(scheme, qmax):
    assert _scheme(scheme).kv_qmax == qmax


@pytest.mark.parametrize("field, value", [("num_bits", 4), ("dynamic", True), ("symmetric", False),
                                          ("strategy", "channel"), ("type", "mx")])
def test_a_kv_cache_scheme_llmd_does_not_implement_is_refused_by_field(field, value):
    scheme = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True, field: value}
    with pytest.raises(ValueError, match=rf"quantization_config\.kv_cache_scheme\.{field}={value!r}"):
        _scheme(scheme)


def _scheme(kv_cache_scheme):
    weights = {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True, "dynamic": False}
    return config_scheme({"quantization_config": {
        "quant_method": "compressed-tensors", "format": "float-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}},
        "kv_cache_scheme": kv_cache_scheme}})
