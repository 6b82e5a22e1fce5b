"""Several models by name (issue 29), without a model: the settings' [models.NAME]
tables as the registry reads them (engine settings over the top-level ones, aliases,
keep_alive, the default model), how a request's `model` is resolved, the memory
budget's decisions (what fits, who is evicted), and the estimate of a model's memory
from its files."""
from __future__ import annotations

import json
import math
from pathlib import Path

import msgspec
import pytest

from llmd.config import EngineConfig
from llmd.daemon_config import load_settings, model_registry
from llmd.pool.budget import MemoryBudget, Resident, place
from llmd.pool.estimate import estimate_need, loaded_need, read_shape
from llmd.pool.registry import UnknownModel
from llmd_client.durations import FOREVER, describe_duration, parse_duration

TOML = """
model = "/srv/models/base"
max_model_len = 512
served_model_name = ["base", "b"]

[models.coder]
path = "/srv/models/coder"
aliases = ["c", "qwen-coder"]
keep_alive = "10m"
max_model_len = 1024
distributed_executor_backend = "mp"
tool_call_parser = "hermes"

[models."qwen3:8b"]
path = "/srv/models/q.gguf"
"""


def registry_of(tmp_path: Path, text: str, **overrides):
    path = tmp_path / "llmd.toml"
    path.write_text(text)
    daemon, engine = load_settings(str(path), overrides)
    return model_registry(daemon, engine)


def test_tables_inherit_the_top_level_engine_settings_and_override_their_own(tmp_path):
    registry = registry_of(tmp_path, TOML)
    base, coder, q = (registry.resolve(n) for n in ("base", "coder", "qwen3:8b"))
    assert base.default and base.names == ("base", "b") and base.path == "/srv/models/base"
    assert base.keep_alive_s == FOREVER  # the default model stays, as a one-model daemon always did
    assert coder.engine.max_model_len == 1024 and coder.engine.distributed_executor_backend == "mp"
    assert coder.path == "/srv/models/coder" and coder.keep_alive_s == 600 and coder.tool_call_parser == "hermes"
    assert q.engine.max_model_len == 512 and q.engine.distributed_executor_backend == "uni"
    assert q.keep_alive_s == 300  # a table's model without keep_alive: 5 minutes, as Ollama's default
    assert [s.name for s in registry.listed()] == ["base", "coder", "qwen3:8b"] and not registry.single_model


def test_the_command_line_is_the_tables_default_but_a_table_wins(tmp_path):
    registry = registry_of(tmp_path, TOML, max_model_len=256, max_num_seqs=7)
    assert registry.resolve(None).engine.max_model_len == 256
    assert registry.resolve("qwen3:8b").engine.max_model_len == 256
    assert registry.resolve("coder").engine.max_model_len == 1024
    assert registry.resolve("coder").engine.max_num_seqs == 7


def test_a_top_level_keep_alive_applies_to_every_model_without_its_own(tmp_path):
    registry = registry_of(tmp_path, "keep_alive = \"90s\"\n" + TOML)
    assert registry.resolve(None).keep_alive_s == 90 and registry.resolve("qwen3:8b").keep_alive_s == 90
    assert registry.resolve("coder").keep_alive_s == 600


def test_names_resolve_with_aliases_and_ollamas_latest_tag(tmp_path):
    registry = registry_of(tmp_path, TOML)
    for requested, name in [(None, "base"), ("", "base"), ("b", "base"), ("b:latest", "base"), ("c", "coder"),
                            ("qwen-coder:latest", "coder"), ("qwen3:8b", "qwen3:8b")]:
        assert registry.resolve(requested).name == name, requested
    for unknown in ("coder2", "qwen3", "/srv/models/coder", "C"):
        with pytest.raises(UnknownModel) as info:
            registry.resolve(unknown)
        assert str(info.value).startswith("model: ") and "base, coder, qwen3:8b" in str(info.value)
        assert unknown not in str(info.value).replace("qwen3:8b", "").replace("coder,", "")


def test_without_a_model_the_default_is_the_built_in_one(tmp_path):
    registry = registry_of(tmp_path, "")
    assert registry.default.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and registry.default.path == ""
    assert registry.single_model


@pytest.mark.parametrize("table, message", [
    ('[models.x]\nmax_model_len = 5\n', "models.x.path is required"),
    ('[models.x]\npath = "/m"\nmodel = "/m"\n', "give the model's directory or GGUF file as path"),
    ('[models.x]\npath = "/m"\nmax_num_seq = 5\n', "models.x: unknown setting(s): max_num_seq"),
    ('[models.x]\npath = "/m"\nblock_size = 3\n', "models.x: block_size must be a power of two"),
    ('[models.x]\npath = "/m"\nkeep_alive = "soon"\n', "models.x.keep_alive must be a number of seconds"),
    ('[models.x]\npath = "/m"\naliases = "y"\n', "models.x.aliases must be a list of names"),
    ('[models.x]\npath = "/m"\ntool_call_parser = "xml"\n', "models.x.tool_call_parser must be one of"),
    ('[models.x]\npath = "/m"\naliases = ["base"]\n', "model name 'base' is given twice"),
    ('[models.base]\npath = "/m"\n', "model name 'base' is given twice"),
    ('[models."/abs"]\npath = "/m"\n', "models./abs: model names must be printable"),
    ('[models.x]\npath = "/m"\naliases = [" y"]\n', "models.x.aliases: model names must be printable"),
    ('keep_alive = "x"\n', "keep_alive must be a number of seconds"),
    ('model_memory_budget_bytes = { gpu = 5 }\n', 'model_memory_budget_bytes keys must be "cpu", "cuda"'),
    ('model_memory_budget_bytes = { cpu = 0 }\n', "invalid setting"),
    ('max_loaded_models = 0\n', "invalid setting"),
])
def test_bad_tables_are_refused_naming_the_table_and_key(tmp_path, table, message):
    with pytest.raises(ValueError) as info:
        registry_of(tmp_path, 'model = "/srv/base"\nserved_model_name = "base"\n' + table)
    assert message in str(info.value)


def test_paths_are_served_only_where_the_operator_allows_them(tmp_path, tiny_llama):
    closed = registry_of(tmp_path, TOML)
    with pytest.raises(UnknownModel):
        closed.resolve(str(tiny_llama))
    registry = registry_of(tmp_path, TOML + "\n", allow_model_paths=True)
    spec = registry.resolve(str(tiny_llama) + "/")
    assert spec.ad_hoc and spec.name == str(tiny_llama) and spec.path == str(tiny_llama)
    assert spec.engine.max_model_len == 512 and spec.keep_alive_s == 300  # the top-level settings
    assert registry.resolve(str(tiny_llama)) is spec and not registry.single_model
    for not_a_model in (str(tmp_path), str(tmp_path / "llmd.toml"), "/no/such/dir", "relative/path"):
        with pytest.raises(UnknownModel):
            registry.resolve(not_a_model)
    registry.forget(spec.name)
    assert registry.resolve(str(tiny_llama)) is not spec


def test_durations_as_ollama_reads_them_and_as_people_read_them():
    assert parse_duration("1h30m") == 5400 and parse_duration(-1) == FOREVER and parse_duration("0") == 0
    for bad in ("", "5d", True, "x" * 100, float("nan"), [1]):
        with pytest.raises(ValueError, match="^keep_alive must be"):
            parse_duration(bad)
    assert [describe_duration(s) for s in (FOREVER, 0, 1.5, 90, 3600, 5430)] == \
        ["for ever", "0 s", "1.5 s", "1m30s", "1h", "1h30m30s"]


# -- the budget ---------------------------------------------------------------------

GIB = 1 << 30
MIB = 1 << 20


def resident(name: str, gib: float, *, busy: bool = False, last_used: float = 0.0, evictable: bool = True,
             device: str = "cpu") -> Resident:
    return Resident(name, {device: int(gib * GIB)}, evictable=evictable, busy=busy, last_used=last_used)


def test_a_model_that_fits_loads_beside_the_others():
    budget = MemoryBudget(max_loaded_models=3, bytes_per_device={"cpu": 10 * GIB})
    assert place({"cpu": 4 * GIB}, [resident("a", 3), resident("b", 3)], budget).fits
    assert place({"cuda:0": 40 * GIB}, [resident("a", 9)], budget).fits  # no budget for the GPU


def test_idle_models_are_evicted_least_recently_used_first():
    budget = MemoryBudget(bytes_per_device={"cpu": 10 * GIB})
    residents = [resident("new", 3, last_used=30), resident("old", 3, last_used=10), resident("mid", 3, last_used=20)]
    got = place({"cpu": 4 * GIB}, residents, budget)
    assert not got.fits and got.evict_now == ("old",) and got.evict_when_idle == ()
    got = place({"cpu": 7 * GIB}, residents, budget)
    assert got.evict_now == ("old", "mid")


def test_idle_models_go_before_busy_ones_and_busy_ones_go_once_idle():
    budget = MemoryBudget(max_loaded_models=2)
    residents = [resident("busy-old", 1, busy=True, last_used=1), resident("idle-new", 1, last_used=9)]
    assert place({"cpu": GIB}, residents, budget).evict_now == ("idle-new",)
    one = MemoryBudget(max_loaded_models=1)
    got = place({"cpu": GIB}, [resident("busy", 1, busy=True)], one)
    assert not got.fits and got.evict_now == () and got.evict_when_idle == ("busy",)


def test_only_models_that_free_what_is_short_are_evicted():
    budget = MemoryBudget(bytes_per_device={"cuda": 20 * GIB})
    residents = [resident("cpu-model", 8, last_used=0), resident("gpu-model", 15, last_used=5, device="cuda:0"),
                 resident("other-gpu", 15, last_used=1, device="cuda:1")]
    got = place({"cuda:0": 10 * GIB}, residents, budget)
    assert got.evict_now == ("gpu-model",)


def test_a_model_that_cannot_fit_even_alone_is_refused_with_the_figures():
    budget = MemoryBudget(bytes_per_device={"cpu": 2 * GIB})
    got = place({"cpu": 3 * GIB}, [resident("a", 1)], budget)
    assert not got.fits and got.never is not None and got.evict_now == ()
    assert "3072 MiB on cpu" in got.never and "2048 MiB" in got.never


def test_loading_models_are_never_evicted_the_load_waits():
    budget = MemoryBudget(max_loaded_models=1)
    got = place({"cpu": GIB}, [resident("loading", 1, evictable=False)], budget)
    assert got == type(got)(fits=False)


def test_no_budget_means_everything_fits():
    assert place({"cpu": 10**15}, [resident("a", 100)] * 20, MemoryBudget()).fits


# -- the estimate -------------------------------------------------------------------

def _weights(engine: EngineConfig, shape, device: str = "cpu") -> int:
    """The weights part of an estimate (its KV pool set to one byte)."""
    engine = msgspec.structs.replace(engine, kv_cache_memory_bytes=1, num_gpu_blocks_override=None)
    return sum(estimate_need(engine, shape, device, available_ram=0).values()) - engine.tensor_parallel_size


def test_the_estimate_is_the_weights_plus_the_kv_setting(tiny_llama):
    shape = read_shape(str(tiny_llama))
    config = json.loads((tiny_llama / "config.json").read_text())
    size = sum(f.stat().st_size for f in tiny_llama.glob("*.safetensors"))
    kv_heads = config.get("num_key_value_heads") or config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    per_token = 2 * config["num_hidden_layers"] * kv_heads * head_dim * 4  # float32 on CPU
    engine = EngineConfig(model=str(tiny_llama), num_gpu_blocks_override=128, block_size=16)
    assert shape.weights_bytes == size and shape.num_params * 4 < size  # the file's header and metadata beside
    weights = _weights(engine, shape)
    # float32 on CPU: every weight once (the linear ones in oneDNN's layout instead of the checkpoint's)
    assert weights == shape.num_params * 4
    assert estimate_need(engine, shape, "cpu", available_ram=0) == {"cpu": weights + 128 * 16 * per_token}
    for kv in ("fp8", "int8"):  # one byte per element (kv_cache_dtype)
        engine = EngineConfig(model=str(tiny_llama), num_gpu_blocks_override=128, block_size=16, kv_cache_dtype=kv)
        assert estimate_need(engine, shape, "cpu", available_ram=0) == {"cpu": weights + 128 * 16 * per_token // 4}
    engine = EngineConfig(model=str(tiny_llama), kv_cache_memory_bytes=GIB, tensor_parallel_size=2)
    assert estimate_need(engine, shape, "cuda", available_ram=0) == \
        {"cuda:0": shape.num_params + GIB // 2, "cuda:1": shape.num_params + GIB // 2}  # bf16 on CUDA, no copies
    default = estimate_need(EngineConfig(model=str(tiny_llama)), shape, "cpu", available_ram=GIB)
    assert weights < default["cpu"] <= weights + GIB // 4  # a share of the free RAM, as the engine sizes it
    cuda = estimate_need(EngineConfig(model=str(tiny_llama)), shape, "cuda", available_ram=0, device_total=80 * GIB)
    assert cuda == {"cuda:0": int(0.9 * 80 * GIB)}  # profiled at load: gpu_memory_utilization of the GPU
    assert loaded_need("cuda:0", 4, 6, 2) == {"cuda:0": 5, "cuda:1": 5} and loaded_need("cpu", 4, 6, 1) == {"cpu": 10}


def _held(path, **kw) -> tuple[int, EngineConfig]:
    """What the loaded model holds on CPU (every weight storage and oneDNN's copies, not
    its buffers: rotary tables), and the engine settings it was loaded with."""
    import torch

    from llmd.gpu.models.loader import load_model
    from llmd.gpu.worker.memory_profile import weight_storage
    from llmd.pool.estimate import run_dtype

    engine = EngineConfig(model=str(path), **kw)
    dtype = getattr(torch, run_dtype(engine, "cpu", read_shape(str(path)).checkpoint_dtype))
    model = load_model(path, dtype, torch.device("cpu"), 128, dequantize=engine.dequantize)
    buffers = sum(b.untyped_storage().nbytes() for b in model.buffers())
    return sum(weight_storage(model).values()) - buffers, engine


def test_the_estimate_is_what_the_loaded_model_holds(tmp_path, tiny_llama, tiny_llama_tied):
    """Against the loaded model: a float32 checkpoint exactly (the linear weights once,
    in oneDNN's layout; a tied LM head's copy beside the embedding), an AWQ / GPTQ / FP8
    one within 5% packed (their scales widen on CPU, a GPTQ's act-order indices go: 3.0%
    for GPTQ here) and exactly dequantized. (GGUF files: tests/test_gguf_packed.py.)"""
    from llmd_tools.make_model import build_model
    from llmd_tools.quantize_checkpoint import options, quantize_checkpoint

    for path in (tiny_llama, tiny_llama_tied):
        held, engine = _held(path)
        assert _weights(engine, read_shape(str(path))) == held, path.name
    # The tiny llama with whole 32-column groups in every linear layer's input.
    source = build_model(tmp_path / "dense", "llama", "tiny", intermediate_size=192)
    for method in ("awq", "gptq", "fp8"):
        checkpoint = quantize_checkpoint(source, tmp_path / method, options(method=method, group_size=32))
        shape = read_shape(str(checkpoint))
        held, engine = _held(checkpoint)
        assert _weights(engine, shape) == pytest.approx(held, rel=0.05), method
        held, engine = _held(checkpoint, dequantize=True)
        assert _weights(engine, shape) == held, method


def test_a_gguf_estimate_reads_its_header(tmp_path, tiny_llama):
    """A GGUF file's shape comes from its header: packed on CPU and CUDA on one rank (its
    Q8_0 tensors as stored, its F32 ones at the run dtype: float32 on CPU, a linear one
    in oneDNN's layout, bfloat16 on CUDA), dequantized when asked or split by tensor parallelism. (tests/test_gguf_packed:
    the estimate against what a loaded model holds, types held as others included.)"""
    import gguf

    from gguf_fixtures import write_gguf

    path = tmp_path / "tiny.gguf"
    write_gguf(tiny_llama, path, gguf.GGMLQuantizationType.Q8_0)
    hf, packed = read_shape(str(tiny_llama)), read_shape(str(path))
    assert packed.gguf and packed.kv_elements_per_token == hf.kv_elements_per_token
    assert packed.weights_bytes == path.stat().st_size < hf.weights_bytes
    tensors = gguf.GGUFReader(path).tensors
    q8_bytes = sum(int(t.n_bytes) for t in tensors if t.tensor_type.name == "Q8_0")
    f32 = sum(int(t.n_elements) for t in tensors if t.tensor_type.name == "F32")
    # rows of 172 weights, which no Q8_0 block fits, stay F32 (the MLP's down projection)
    f32_linear = sum(int(t.n_elements) for t in tensors if t.tensor_type.name == "F32" and len(t.shape) == 2)
    assert q8_bytes and f32_linear and {t.tensor_type.name for t in tensors} == {"Q8_0", "F32"}
    engine = EngineConfig(model=str(path), kv_cache_memory_bytes=1000)
    assert estimate_need(engine, packed, "cpu", available_ram=0) == {"cpu": q8_bytes + 4 * f32 + 1000}
    dequantized = estimate_need(msgspec.structs.replace(engine, dequantize=True), packed, "cpu", available_ram=0)
    assert dequantized["cpu"] == packed.num_params * 4 + 1000  # untied: every weight once
    assert estimate_need(engine, packed, "cuda", available_ram=0) == {"cuda:0": q8_bytes + 2 * f32 + 1000}
    tp2 = estimate_need(msgspec.structs.replace(engine, tensor_parallel_size=2), packed, "cuda", available_ram=0)
    assert tp2 == {f"cuda:{r}": (q8_bytes + 2 * f32) // 2 + 500 for r in (0, 1)}  # packed shares, each rank half


def test_a_packed_checkpoints_estimate_counts_its_weights_not_its_words(tmp_path):
    """An AWQ checkpoint's num_params counts the weights its words stand for: as many as
    the dense checkpoint it was made from has (counted by safetensors itself), not its
    4-bit words, scales and zero points; its quantized part stays packed on CUDA too."""
    from safetensors import safe_open

    from llmd_tools.make_model import build_model
    from llmd_tools.quantize_checkpoint import options, quantize_checkpoint

    # The tiny llama with whole 32-column groups in every linear layer's input.
    source = build_model(tmp_path / "dense", "llama", "tiny", intermediate_size=192)
    awq = quantize_checkpoint(source, tmp_path / "awq", options(method="awq", group_size=32))
    dense = 0
    for file in source.glob("*.safetensors"):
        with safe_open(str(file), framework="numpy") as f:
            dense += sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())
    shape = read_shape(str(awq))
    size = sum(f.stat().st_size for f in awq.glob("*.safetensors"))
    assert shape.quantized and shape.num_params == dense and shape.weights_bytes == size
    engine = EngineConfig(model=str(awq), kv_cache_memory_bytes=1000)
    dequantized = estimate_need(msgspec.structs.replace(engine, dequantize=True), shape, "cuda", available_ram=0)
    assert dequantized == {"cuda:0": dense * 2 + 1000}  # bfloat16 on CUDA
    packed = estimate_need(engine, shape, "cuda", available_ram=0)["cuda:0"]
    assert size // 2 < packed - 1000 < dequantized["cuda:0"] - 1000  # the embedding and LM head at bf16


# -- how llmctl shows them ----------------------------------------------------------

def test_llmctl_ps_and_status_show_each_models_state_memory_and_expiry():
    import time

    from llmd_client.protocol import ModelStatus, StatusReply
    from llmd_client.status_view import format_models, format_status

    now = time.time()
    models = [ModelStatus(name="base", default=True, state="serving", device="cpu", memory_bytes=300 * MIB,
                          memory_estimated=False, num_running=2, num_waiting=1),
              ModelStatus(name="coder", state="loading", load_progress=0.42, load_phase="weights",
                          memory_bytes=4 * GIB, num_waiting=3),
              ModelStatus(name="small", state="serving", device="cpu", memory_bytes=10 * MIB, memory_estimated=False,
                          keep_alive_s=300.0, expires_at=now + 299.5),
              ModelStatus(name="big", state="failed", error="the model needs 9 GiB"),
              ModelStatus(name="idle", state="unloaded", task="embed"),
              ModelStatus(name="napper", state="asleep", sleep_level=2, device="cpu", idle_action="sleep"),
              ModelStatus(name="nods", state="serving", device="cpu", keep_alive_s=60.0, idle_action="sleep")]
    rows = format_models(models).splitlines()
    assert rows[0].split() == ["NAME", "TASK", "STATE", "MEMORY", "DEVICE", "REQUESTS", "UNTIL"]
    assert "base (default)" in rows[1] and "300.0 MiB" in rows[1] and "2 running, 1 waiting" in rows[1]
    assert rows[1].rstrip().endswith("forever")
    assert "loading (42%: weights)" in rows[2] and "~4.0 GiB" in rows[2]  # an estimate
    assert "(in 4m 5" in rows[3]
    assert "failed: the model needs 9 GiB" in rows[4] and rows[5].split()[1:4] == ["embed", "unloaded", "-"]
    assert rows[1].split()[2] == "generate" and "asleep (level 2)" in rows[6] and rows[6].rstrip().endswith("-")
    assert rows[7].rstrip().endswith("1m after its requests, then asleep")
    status = StatusReply(model="base", server_version="0", uptime_s=1, device="cpu", dtype="float32", num_running=2,
                         num_waiting=1, requests=[], kv_blocks_total=8, kv_blocks_used=0, kv_usage=0.0,
                         prefix_cache_hit_rate=0.0, generation_tokens_per_s=0.0, prompt_tokens_total=0,
                         generation_tokens_total=0, requests_finished_total=0, rss_bytes=1, cpu_percent=0.0,
                         models=models)
    shown = format_status(status)
    assert shown.startswith("model        base") and "\nNAME " in shown and "coder" in shown
    alone = format_status(StatusReply(**{**{f: getattr(status, f) for f in StatusReply.__struct_fields__},
                                         "models": models[:1], "engine_state": "unloaded"}))
    assert "NAME" not in alone and "engine       unloaded (a request loads it again)" in alone
    asleep = format_status(StatusReply(**{**{f: getattr(status, f) for f in StatusReply.__struct_fields__},
                                          "models": [ModelStatus(name="base", default=True, state="asleep",
                                                                 sleep_level=2)], "engine_state": "asleep"}))
    assert "engine       asleep (level 2): a request wakes it" in asleep
