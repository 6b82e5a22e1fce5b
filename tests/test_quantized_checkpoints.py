"""AWQ, GPTQ and FP8 safetensors checkpoints load packed and compute what their weights
mean: llmd's greedy tokens and logprobs on the quantized checkpoint equal HF
transformers' on the dequantized weights (fp32), the dequantization written from each
format's layout in tests/quant_reference.py; for the FP8 layouts transformers reads
itself (HF's fine-grained FP8, and compressed-tensors' through its own package), on the
quantized checkpoint directly. The checkpoints are written by
llmd_tools.quantize_checkpoint from random-weight fixtures: AWQ (llama, qwen2 with q/k/v
bias, Phi-3 with its fused q/k/v and gate/up), GPTQ 4-bit symmetric v1, 4-bit asymmetric
v2 with act-order (an order per module), 8-bit act-order with a quantized LM head, FP8
per tensor, per channel and per block. The memory account shows the packed storage
close to the files' size; modules the config keeps dense stay dense; `dequantize=True`
loads the same checkpoint dense; what llmd cannot keep packed is refused by name."""
from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from hf_ref import check_logprobs_close, engine_result, hf_greedy, hf_model
from llmd import LLM
from llmd.gpu.layers.gguf_quant import dequantize as gguf_dequantize
from llmd.gpu.layers.gguf_quant import part_weight
from llmd.gpu.layers.quant.fp8 import dequantize as fp8_dequantize
from llmd.gpu.layers.quant.quant_linear import finalize
from llmd.gpu.layers.quant.scheme import quant_scheme
from llmd.gpu.models.decoder import CausalLM
from llmd.gpu.models.loader import checkpoint_target, iter_safetensors, load_hf_config, load_weights
from llmd.gpu.models.quant_plan import apply_plan, plan_quantized, resolve_scheme, safetensors_index
from tiny_models import tiny_models
from llmd_tools.quantize_checkpoint import options, quantize_checkpoint
from quant_reference import write_dequantized
from test_engine_vs_hf import TEXTS
from test_gguf import GREEDY, MAX_TOKENS

# Held to transformers' float32 on the dequantized weights at float32's tolerance: the
# packed products at float32's precision (conftest.float32_products).
pytestmark = pytest.mark.usefixtures("float32_products")

SETTINGS = dict(device="cpu", dtype="float32", num_gpu_blocks_override=64, max_model_len=256)
# Dense fixtures whose linear layers' input sizes are whole 32- and 64-column groups.
DENSE = {
    "llama": dict(arch="llama", intermediate_size=192),
    "qwen2": dict(arch="qwen2", intermediate_size=192),
    "qwen3": dict(arch="qwen3", intermediate_size=192),
    "phi3": dict(arch="phi3", intermediate_size=192),
    # an odd vocabulary: under TP=2 the last rank's LM head holds a padding row
    "llama-odd-vocab": dict(arch="llama", intermediate_size=192, vocab_size=1025),
    "qwen3-moe": dict(arch="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                      intermediate_size=192, mlp_only_layers=[1]),
}
CASES = {
    "awq-llama-g32": ("llama", dict(method="awq", group_size=32)),
    "awq-qwen2-g64": ("qwen2", dict(method="awq", group_size=64)),
    "awq-phi3-fused": ("phi3", dict(method="awq", group_size=32)),
    "gptq4-sym-v1": ("llama", dict(method="gptq", group_size=32)),
    "gptq4-asym-v2-act-order": ("llama", dict(method="gptq", group_size=32, sym=False, gptq_v2=True, act_order=True,
                                              order_per_module=True)),
    "gptq8-act-order-lm-head": ("llama", dict(method="gptq", bits=8, group_size=64, act_order=True, lm_head=True)),
    "fp8-tensor": ("llama", dict(method="fp8", fp8_style="tensor")),
    "fp8-channel-qwen3": ("qwen3", dict(method="fp8", fp8_style="channel")),
    "fp8-block": ("llama", dict(method="fp8", fp8_style="block", block=(32, 32))),
    "fp8-channel-lm-head-odd-vocab": ("llama-odd-vocab", dict(method="fp8", fp8_style="channel", lm_head=True)),
}
LABELS = {"awq": "awq-int4", "fp8": "fp8-e4m3"}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("quantized")
    dense = tiny_models(root, DENSE, prefix="dense-")

    @functools.cache
    def get(case: str, **extra) -> Path:
        base, opts = CASES[case] if case in CASES else (case, {})
        tag = case + "".join(f"-{k}={v}" for k, v in sorted(extra.items()))
        return quantize_checkpoint(dense(base), root / tag, options(**{**opts, **extra}))

    get.dense = dense
    return get


def _compare(reference: str, llm: LLM, name: str) -> None:
    _, tokenizer = hf_model(reference)
    prompts = [tokenizer(t).input_ids for t in TEXTS[:2]]
    for i, (prompt, out) in enumerate(zip(prompts, llm.generate(prompts, GREEDY))):
        compared = check_logprobs_close(hf_greedy(reference, prompt, MAX_TOKENS), engine_result(out), f"{name} #{i}",
                                        atol=1e-3)
        assert compared >= MAX_TOKENS // 2, f"{name} #{i}: diverged at token {compared}"


def _label(path: Path) -> str:
    qc = json.loads((path / "config.json").read_text())["quantization_config"]
    return LABELS.get(qc["quant_method"], f"{qc['quant_method']}-int{qc.get('bits')}") \
        if qc["quant_method"] != "compressed-tensors" else "fp8-e4m3"


def _quantized_layers(llm: LLM) -> dict[str, str]:
    model = llm.engine.executor.runner.model
    return {name: m.quant for name, m in model.named_modules() if getattr(m, "quant", None)}


@pytest.mark.parametrize("case", list(CASES))
def test_a_quantized_checkpoint_computes_what_its_dequantized_weights_do(checkpoints, tmp_path, case):
    path = checkpoints(case)
    llm = LLM(model=str(path), **SETTINGS)
    try:
        layers = _quantized_layers(llm)
        assert set(layers.values()) == {_label(path)}
        assert len(layers) == 4 * 3 + ("lm-head" in case)  # qkv, o, gate_up, down of 3 layers (+ LM head)
        _compare(str(write_dequantized(path, tmp_path / "dense")), llm, case)
    finally:
        llm.engine.shutdown()


@pytest.mark.parametrize("case", ["fp8-block", "fp8-channel-qwen3"])
def test_transformers_reads_the_fp8_checkpoint_itself_as_llmd_does(checkpoints, tmp_path, case):
    """transformers dequantizes HF's fine-grained FP8 on CPU itself, and compressed-tensors'
    float-quantized through the compressed-tensors package: the format owners' readers."""
    path = checkpoints(case)
    reference = path
    if "channel" in case:
        pytest.importorskip("compressed_tensors")
        reference = _weights_only(path, tmp_path / "weights-only")
    llm = LLM(model=str(path), **SETTINGS)
    try:
        _compare(str(reference), llm, case)
    finally:
        llm.engine.shutdown()


def _weights_only(path: Path, out: Path) -> Path:
    """The checkpoint without its activation scheme: compressed-tensors would quantize
    the activations too (per token, W8A8), where llmd runs W8A16."""
    shutil.copytree(path, out)
    config = json.loads((out / "config.json").read_text())
    for group in config["quantization_config"]["config_groups"].values():
        group["input_activations"] = None
    (out / "config.json").write_text(json.dumps(config))
    return out


def _quantized_file_bytes(path: Path) -> int:
    """Bytes of the file's quantized tensors (codes, zero points, scales, g_idx)."""
    total = 0
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        for name in f.keys():
            t = f.get_slice(name)
            if t.get_dtype() in ("I32", "F8_E4M3") or name.endswith((".scales", ".weight_scale", ".weight_scale_inv")):
                numel = 1
                for d in t.get_shape():
                    numel *= d
                total += numel * {"I32": 4, "F8_E4M3": 1, "F16": 2, "F32": 4, "BF16": 2}[t.get_dtype()]
    return total


@pytest.mark.parametrize("case,low,high", [("awq-llama-g32", 1.0, 1.25), ("gptq4-sym-v1", 0.85, 1.0),
                                           ("fp8-tensor", 1.0, 1.1)])
def test_the_memory_account_shows_the_packed_storage(checkpoints, case, low, high):
    path = checkpoints(case)
    packed, dense = LLM(model=str(path), **SETTINGS), LLM(model=str(path), dequantize=True, **SETTINGS)
    try:
        weights, dense_weights = packed.engine.memory().weights, dense.engine.memory().weights
        in_file = _quantized_file_bytes(path)
        label = _label(path)
        # AWQ's groups of 32 become Q5_0 blocks (one more bit a code), GPTQ's symmetric
        # ones Q4_0 (g_idx not kept), FP8 its bytes and a float32 scale per row (5 % of
        # these 64- and 192-column rows, 0.2 % of a 2048-column one).
        assert low * in_file <= weights[label] <= high * in_file, (weights, in_file)
        assert label not in dense_weights and _quantized_layers(dense) == {}
        # float32 holds 4 bytes a weight (once: oneDNN's layout), the packed label at most
        # 1.1 (FP8): the dense model holds at least 4 / 1.1 - 1 > 2.6 times the label more
        assert sum(dense_weights.values()) > sum(weights.values()) + 2.6 * weights[label]
    finally:
        packed.engine.shutdown()
        dense.engine.shutdown()


def _edited(path: Path, out: Path, config_edit=None, tensor_edit=None) -> Path:
    """A copy of a checkpoint with its quantization_config and / or tensors changed."""
    shutil.copytree(path, out)
    if config_edit is not None:
        config = json.loads((out / "config.json").read_text())
        config_edit(config["quantization_config"])
        (out / "config.json").write_text(json.dumps(config))
    if tensor_edit is not None:
        tensors = load_file(str(out / "model.safetensors"))
        tensor_edit(tensors)
        save_file(tensors, str(out / "model.safetensors"))
    return out


def test_modules_the_config_keeps_dense_stay_dense(checkpoints, tmp_path):
    path = checkpoints("awq-llama-g32", keep_dense=("layers.1.mlp.down_proj",))
    assert json.loads((path / "config.json").read_text())["quantization_config"]["modules_to_not_convert"] == \
        ["layers.1.mlp.down_proj"]
    llm = LLM(model=str(path), **SETTINGS)
    try:
        layers = _quantized_layers(llm)
        assert "layers.1.mlp.down_proj" not in layers and "layers.0.mlp.down_proj" in layers and len(layers) == 11
        model = llm.engine.executor.runner.model
        assert model.layers[1].mlp.down_proj.weight.dtype == torch.float32
        _compare(str(write_dequantized(path, tmp_path / "dense")), llm, "awq, one layer dense")
    finally:
        llm.engine.shutdown()


def uneven_groups(tensors: dict) -> None:
    """Every g_idx's first column of group 0 moved to group 1: groups of 31 and 33 columns
    (the codes read through another group's scale and zero point: a valid checkpoint)."""
    for name in [n for n in tensors if n.endswith(".g_idx")]:
        g_idx = tensors[name].clone()
        g_idx[int(torch.nonzero(g_idx == 0)[0])] = 1
        tensors[name] = g_idx


def test_act_order_groups_that_are_not_whole_blocks_compute_their_dequantized_weights(checkpoints, tmp_path):
    """GPTQ act-order groups of 31 and 33 columns (refused before): each group's run padded
    with zero weights computes what transformers does on the dequantized weights."""
    path = _edited(checkpoints("gptq4-asym-v2-act-order"), tmp_path / "uneven", None, uneven_groups)
    llm = LLM(model=str(path), **SETTINGS)
    try:
        _compare(str(write_dequantized(path, tmp_path / "dense")), llm, "uneven act-order groups")
    finally:
        llm.engine.shutdown()


def _e5m2(tensors: dict) -> None:
    name = "model.layers.0.mlp.up_proj.weight"
    tensors[name] = tensors[name].float().to(torch.float8_e5m2)


def _biases(value: float):
    def edit(tensors: dict) -> None:
        for name in [n for n in tensors if n.endswith(".qweight")]:
            tensors[name.replace(".qweight", ".bias")] = torch.full((tensors[name].shape[1],), value).half()
    return edit


def test_empty_biases_some_gptq_tools_save_are_skipped(checkpoints, tmp_path):
    path = _edited(checkpoints("gptq4-sym-v1"), tmp_path / "zero-biases", tensor_edit=_biases(0.0))
    llm = LLM(model=str(path), **SETTINGS)
    try:
        _compare(str(write_dequantized(path, tmp_path / "dense")), llm, "gptq with zero biases")
    finally:
        llm.engine.shutdown()


LOAD_REFUSALS = [
    ("a bias the model does not have", "gptq4-sym-v1", {}, None, _biases(0.5),
     r"unexpected weight 'model\.layers\.0\.\S+_proj\.bias' in checkpoint"),
    ("a fused projection with a dense part", "awq-llama-g32", dict(keep_dense=("layers.0.self_attn.q_proj",)), None,
     None, r"model\.layers\.0\.self_attn\.[kv]_proj is quantized \(awq-int4\) but parts \['q'\] of its fused "
           r"projection are not"),
    ("a module the config keeps dense, quantized in the file", "awq-llama-g32", {},
     lambda qc: qc.update(modules_to_not_convert=["layers.0.mlp.down_proj"]), None,
     r"model\.layers\.0\.mlp\.down_proj is quantized in the checkpoint, but its quantization_config keeps "
     r"'layers\.0\.mlp\.down_proj' dense"),
    ("a group size the files do not have", "awq-llama-g32", {}, lambda qc: qc.update(group_size=64), None,
     r"weight 'model\.layers\.0\.mlp\.down_proj\.qzeros' has 6 rows of groups, but 192 input columns in groups "
     r"of 64 \(quantization_config\.group_size\) make 3"),
    ("FP8 e5m2 weights", "fp8-tensor", {}, None, _e5m2,
     r"tensor 'model\.layers\.0\.mlp\.up_proj\.weight' is F8_E5M2: not implemented by llmd"),
]


@pytest.mark.parametrize("what,case,extra,config_edit,tensor_edit,message", LOAD_REFUSALS,
                         ids=[r[0] for r in LOAD_REFUSALS])
def test_what_cannot_stay_packed_is_refused_by_name(checkpoints, tmp_path, what, case, extra, config_edit,
                                                    tensor_edit, message):
    path = checkpoints(case, **extra)
    if config_edit or tensor_edit:
        path = _edited(path, tmp_path / "edited", config_edit, tensor_edit)
    with pytest.raises(ValueError, match=message):
        LLM(model=str(path), **SETTINGS)


def test_a_quantized_checkpoint_runs_packed_on_cpu_and_cuda_only(checkpoints, monkeypatch):
    """CUDA takes it packed (the Triton kernels) when triton is installed; any other
    device, or CUDA without triton, needs dequantize=True, said by name."""
    import importlib.util

    from llmd.engine_setup import _check_quantized_device

    config = load_hf_config(checkpoints("gptq4-sym-v1"))
    _check_quantized_device(config, "m", torch.device("cuda"), dequantize=False)
    _check_quantized_device(config, "m", torch.device("cpu"), dequantize=False)
    with pytest.raises(ValueError, match=r"is a gptq-int4 checkpoint: llmd runs it packed on cpu and cuda only \(no mps "
                                         r"kernel\); dequantize=True \(--dequantize\) loads it dense on mps"):
        _check_quantized_device(config, "m", torch.device("mps"), dequantize=False)
    _check_quantized_device(config, "m", torch.device("mps"), dequantize=True)
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "triton" else real_find_spec(name, *a))
    with pytest.raises(ValueError, match=r"gptq-int4 checkpoint: its CUDA kernels need the triton package"):
        _check_quantized_device(config, "m", torch.device("cuda"), dequantize=False)
    _check_quantized_device(config, "m", torch.device("cuda"), dequantize=True)


def test_tensor_parallel_ranks_keep_their_packed_shares(checkpoints, tmp_path):
    """TP=2 splits every packed projection as the dense ones (groups of 64 fall whole on
    each rank; a quantized LM head by vocabulary rows, the last rank's padding row zero;
    GPTQ act-order's o/down columns, any number of each group's a rank, sorted by group
    and padded to whole blocks with every group's scales) and computes what transformers
    does on the dequantized weights."""
    for i, path in enumerate((checkpoints("awq-llama-g32", group_size=64),
                              checkpoints("fp8-channel-lm-head-odd-vocab"),  # (refused before: packed head)
                              checkpoints("gptq4-asym-v2-act-order"))):  # (refused before: act-order columns)
        llm = LLM(model=str(path), tensor_parallel_size=2, **SETTINGS)
        try:
            _compare(str(write_dequantized(path, tmp_path / f"dense-{i}")), llm, f"{path.name} tp=2")
        finally:
            llm.engine.shutdown()


@pytest.mark.parametrize("uneven", [False, True], ids=["whole-groups", "uneven-groups"])
def test_the_pool_estimate_counts_act_order_padding_under_tensor_parallelism(checkpoints, tmp_path, uneven):
    """Each rank's run of an act-order group's columns (o_proj's share; down_proj's where
    its groups are not whole blocks, else its MLP follows their order and pads nothing)
    is padded to whole blocks with zero weights: the pool's estimate at TP=2..4 adds what
    the loader's own padding (IntGroups.sorted_by_group on each rank's share, then its
    blocks) adds over those layers, and the most one rank adds to a GPU's share."""
    from safetensors.torch import load_file

    from llmd.config import EngineConfig
    from llmd.gpu.layers.gguf_quant import FORMATS
    from llmd.gpu.layers.quant.int_groups import IntGroups, gptq_groups
    from llmd.gpu.layers.tp import split_share
    from llmd.pool.estimate import estimate_need, read_shape

    path = checkpoints("gptq4-asym-v2-act-order")
    if uneven:
        path = _edited(path, tmp_path / "uneven", None, uneven_groups)
    tensors = load_file(str(path / "model.safetensors"))
    padded = [n for n in tensors if n.endswith("o_proj.g_idx")
              or (n.endswith("down_proj.g_idx") and bool((torch.bincount(tensors[n].long()) % 32).any()))]
    assert any("down_proj" in n for n in padded) == uneven
    shape = read_shape(str(path))
    single = estimate_need(EngineConfig(model=str(path), kv_cache_memory_bytes=1), shape, "cpu", available_ram=0)
    for tp in (2, 3, 4):
        ranks = [0] * tp
        for name in padded:
            prefix = name.removesuffix("g_idx")
            whole = gptq_groups(*(tensors[prefix + t] for t in ("qweight", "qzeros", "scales", "g_idx")), 4, 32, False)
            # uneven groups pad the whole layer too: the estimate counts from its bytes unpadded
            quant = whole.sorted_by_group()[0].gguf_rows("layer")[0]
            size = whole.codes.numel() // 32 * FORMATS[quant].block_bytes
            for rank in range(tp):
                a, b = split_share(whole.codes.shape[1], rank, tp, 32 if "down_proj" in name else 1)
                share = IntGroups(whole.codes[:, a:b], whole.zeros, whole.scales, whole.group_of[a:b], 4, True)
                ranks[rank] += _held_bytes(share) - size * (b - a) // whole.codes.shape[1]
        assert shape.padding(tp) == (sum(ranks), max(ranks)) and sum(ranks) > 0, tp
        engine = EngineConfig(model=str(path), tensor_parallel_size=tp, kv_cache_memory_bytes=1)
        assert estimate_need(engine, shape, "cpu", available_ram=0) == {"cpu": single["cpu"] + sum(ranks)}


def _held_bytes(groups) -> int:
    """The packed bytes a GPTQ layer's columns are held in, sorted by group and padded."""
    return groups.sorted_by_group()[0].gguf_rows("layer")[1].numel()


def test_the_http_faces_describe_a_quantized_checkpoint(checkpoints):
    """Ollama's quantization_level names the scheme, and the parameter count counts every
    packed weight once (eight per AWQ word), not the words, zero points and scales."""
    from types import SimpleNamespace

    from llmd.http.context import describe_model
    from llmd.gpu.models.loader import load_tokenizer

    dense = checkpoints.dense("llama")
    engine = lambda path: SimpleNamespace(model_dir=str(path), max_model_len=256, tokenizer=load_tokenizer(path),
                                          dtype=torch.float32)
    want = describe_model(engine(dense)).num_params
    for case, label in (("awq-llama-g32", "awq-int4"), ("gptq8-act-order-lm-head", "gptq-int8"),
                        ("fp8-block", "fp8-e4m3")):
        served = describe_model(engine(checkpoints(case)))
        assert (served.quantization, served.num_params) == (label, want)


def test_llmctl_status_shows_the_packed_storage(checkpoints, tmp_path_factory):
    """The daemon's memory split (llmctl status, its worker process's weights) names the
    packed storage beside the dense tensors."""
    import subprocess

    from daemon_util import Daemon
    from test_daemon_clients import LLMCTL

    path = checkpoints("gptq4-sym-v1")
    daemon = Daemon(str(path), tmp_path_factory.mktemp("sock") / "q.sock", "--distributed-executor-backend",
                    "mp").wait_ready()
    try:
        status = subprocess.run([LLMCTL, "--socket", daemon.sock, "status", "--json"], capture_output=True,
                                text=True, timeout=60)
        weights = json.loads(status.stdout)["memory"]["weights"]
        assert 0.85 * _quantized_file_bytes(path) <= weights["gptq-int4"] <= _quantized_file_bytes(path)
        shown = subprocess.run([LLMCTL, "--socket", daemon.sock, "status"], capture_output=True, text=True,
                               timeout=60).stdout
        assert "gptq-int4" in shown, shown
    finally:
        assert daemon.stop() == 0, daemon.stderr()


def _rank_model(path: Path, rank: int, dequantize: bool = False) -> CausalLM:
    """Rank `rank` of 2's shard of a checkpoint, loaded by the loader's own steps (no
    process group: loading needs none), quantized layers finalized without kernels."""
    config = load_hf_config(path)
    scheme = quant_scheme(config)
    with torch.device("meta"):
        model = CausalLM(config, 64, tp_rank=rank, tp_size=2)
    index = safetensors_index(path)
    if scheme is not None:
        scheme = resolve_scheme(scheme, index)
        apply_plan(model, scheme, plan_quantized(model, scheme, index, checkpoint_target), index)
    model = model.to_empty(device="cpu")
    load_weights(model, iter_safetensors(path))
    for layer in model.modules():
        if getattr(layer, "quant_method", None) is not None:
            finalize(layer)
    return model


def _dense_weight(layer) -> torch.Tensor:
    """A finalized quantized layer's weight [out, in], read back from its packed storage."""
    if layer.quant == "fp8-e4m3":
        return fp8_dequantize(layer.weight, layer.weight_scales)
    parts = []
    for order, unit in layer.int_units:
        cols = layer.in_features if order is None else getattr(layer, order).numel()  # act-order: padded groups
        rows = torch.cat([gguf_dequantize(part_weight(layer.weight, p, cols), p.quant, cols) for p in unit])
        if order is not None:  # each input column where the order first takes it (the padding's weights: 0)
            taken = getattr(layer, order).tolist()
            first = {column: position for position, column in reversed(list(enumerate(taken)))}
            rows = rows[:, [first[column] for column in range(layer.in_features)]]
        parts.append(rows)
    return torch.cat(parts)


SHARD_CASES = [("awq-llama-g32", {}), ("awq-phi3-fused", {}), ("gptq4-sym-v1", {}),
               ("gptq4-sym-v1", dict(bits=8, group_size=64)), ("gptq4-asym-v2-act-order", dict(act_order=False)),
               ("gptq4-asym-v2-act-order", {}),
               ("fp8-tensor", {}), ("fp8-channel-qwen3", {}), ("fp8-block", {}),
               ("gptq4-sym-v1", dict(lm_head=True)), ("fp8-channel-lm-head-odd-vocab", {})]


@pytest.mark.parametrize("case,extra", SHARD_CASES, ids=[c + "".join(f"-{k}={v}" for k, v in e.items())
                                                         for c, e in SHARD_CASES])
def test_each_rank_keeps_the_packed_share_the_dense_layer_keeps(checkpoints, tmp_path, case, extra):
    """Column- and row-parallel projections, checkpoint-fused ones (Phi-3), FP8 blocks
    that straddle a rank's rows (k and v: 16 rows a rank, blocks of 32), a quantized LM
    head (its padding row under an odd vocabulary zero), GPTQ act-order columns split
    between the ranks (o_proj's: each group's share padded to whole blocks; an MLP's
    intermediate dimension in the order down's columns sort into, read from its g_idx
    here): every rank's packed layers hold exactly the share of the dequantized weight
    that the dense layers of the same rank load (an MLP's in that order)."""
    path = checkpoints(case, **extra)
    dense = write_dequantized(path, tmp_path / "dense")
    references = [_rank_model(dense, rank) for rank in (0, 1)]
    orders = _down_orders(path) if case == "gptq4-asym-v2-act-order" and not extra else {}
    for rank in (0, 1):
        packed = _rank_model(path, rank)
        layers = {name: m for name, m in packed.named_modules() if getattr(m, "quant", None)}
        assert len(layers) == 12 + ("lm_head" in extra or "lm-head" in case)
        for name, layer in layers.items():
            assert torch.equal(_dense_weight(layer), _reference_weight(references, rank, name, orders)), (rank, name)
        padded = [name for name, layer in layers.items() for order, _ in getattr(layer, "int_units", ())
                  if order is not None and getattr(layer, order).numel() > layer.in_features]
        assert bool(padded) == bool(orders) and all(".o_proj" in n for n in padded), padded  # o_proj's shares


def _down_orders(path: Path) -> dict[str, torch.Tensor]:
    """MLP -> the order its down projection's columns sort into by group (stably)."""
    from safetensors.torch import load_file

    tensors = load_file(str(path / "model.safetensors"))
    return {n.removeprefix("model.").removesuffix(".down_proj.g_idx"): torch.argsort(t.long(), stable=True)
            for n, t in tensors.items() if n.endswith(".down_proj.g_idx")}


def _reference_weight(references: list, rank: int, name: str, orders: dict[str, torch.Tensor]) -> torch.Tensor:
    """The dense rank's weight of layer `name`; for an MLP in its intermediate order, that
    rank's share of the order: gate's and up's rows, down's columns, of the whole."""
    mlp, _, projection = name.rpartition(".")
    if mlp not in orders:
        return references[rank].get_submodule(name).weight
    a, b = references[rank].get_submodule(f"{mlp}.down_proj").columns
    mine = orders[mlp][a:b]
    shares = [r.get_submodule(name).weight for r in references]
    if projection == "down_proj":
        return torch.cat(shares, dim=1)[:, mine]
    gate, up = (torch.cat([s.chunk(2)[i] for s in shares]) for i in (0, 1))
    return torch.cat([gate[mine], up[mine]])
