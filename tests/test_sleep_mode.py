"""Sleep mode in the engine (issue 29): `sleep(level)` frees the KV cache and keeps
(level 1) or drops (level 2) the weights, `wake_up()` restores them (the decode graphs
built again over the new KV cache), and the model then answers exactly as Hugging Face
transformers does on the same weights; generating while asleep is refused. (In a worker
process, with its resident memory: test_multi_model.py and test_model_sleep.py.) The CUDA
path moves weights to pinned host memory with HostWeights: its in-place move is checked
here on a transformers model on the CPU (each weight emptied, tied weights still one
storage after the restore, the same logits), and on a packed GGUF given its CUDA
kernels (their views of the planes moved with the weights)."""
from __future__ import annotations

import pytest
import torch

from hf_ref import hf_greedy, hf_model
from llmd import LLM, SamplingParams
from llmd.gpu.worker.sleep_mode import HostWeights, module_tensors
from llmd_tools.make_model import fixture_path
from test_gguf_moe import hf_moe  # noqa: F401

PROMPT = "def fibonacci(n):"
MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


def reference(llm: LLM, path: str) -> list[int]:
    ids = llm.tokenizer(PROMPT)["input_ids"]
    return hf_greedy(path, ids, MAX_TOKENS)[0]


def tokens(llm: LLM) -> list[int]:
    return llm.generate([PROMPT], GREEDY)[0].outputs[0].token_ids


def test_host_weights_empty_every_weight_and_restore_it_in_place():
    model, tokenizer = hf_model(str(fixture_path("tiny-llama-tied")))
    model = type(model)(model.config).eval()  # a copy of our own: the cached reference stays untouched
    model.load_state_dict(hf_model(str(fixture_path("tiny-llama-tied")))[0].state_dict())
    ids = torch.tensor([tokenizer(PROMPT)["input_ids"]])
    with torch.inference_mode():
        before = model(ids).logits
    embed, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    assert embed.untyped_storage().data_ptr() == head.untyped_storage().data_ptr()  # tied
    held = sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in module_tensors([model])}.values())
    moved = HostWeights([model], pin=False)
    assert moved.nbytes == held  # the tied pair copied once
    assert all(t.numel() == 0 for t in module_tensors([model]))
    moved.restore(torch.device("cpu"))
    assert embed.untyped_storage().data_ptr() == head.untyped_storage().data_ptr() and embed.shape[0] > 0
    with torch.inference_mode():
        assert torch.equal(model(ids).logits, before)


def test_host_weights_move_the_packed_cuda_kernels_views_too(hf_moe, tmp_path, monkeypatch):  # noqa: F811
    """A packed GGUF's CUDA kernels (quant/cuda_matmul: the dense layers' TritonGGUFMatmul,
    the experts' TritonPackedExperts) keep views of their layers' planes: a level-1 sleep
    empties those too (else they would hold the device memory the sleep gives back), and
    the restore points them at the weights' new storage with the same bytes. Checked on
    the CPU (the kernels attached, not run; HostWeights moves the same way there)."""
    from gguf import GGMLQuantizationType as T
    from gguf_fixtures import write_gguf

    from llmd.gpu.layers.quant.cuda_matmul import attach_cuda_gguf_kernels
    from llmd.gpu.models.loader import load_model

    monkeypatch.setenv("LLMD_CPU_KERNELS", "0")  # the file's layout, which the planes are made from
    model = load_model(write_gguf(hf_moe("qwen3-moe"), tmp_path / "moe.gguf", T.Q8_0), torch.float32,
                       torch.device("cpu"), 128)
    attach_cuda_gguf_kernels(model, torch.float32)
    kernels = [v for m in model.modules() for v in vars(m).values() if hasattr(v, "held_tensors")]
    assert {type(k).__name__ for k in kernels} == {"TritonGGUFMatmul", "TritonPackedExperts"}
    views = [t for k in kernels for t in k.held_tensors()]
    before = [t.clone() for t in views]
    moved = HostWeights([model], pin=False)
    assert all(t.numel() == 0 for t in views)
    moved.restore(torch.device("cpu"))
    storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    assert all(t.untyped_storage().data_ptr() in storages for t in views)
    assert all(torch.equal(a, b) for a, b in zip(views, before))


@pytest.mark.parametrize("level", [1, 2])
def test_a_model_woken_from_sleep_answers_as_transformers_does(level):
    path = str(fixture_path("tiny-qwen2"))
    llm = LLM(model=path, max_model_len=128, num_gpu_blocks_override=32, enable_prefix_caching=True)
    expected = reference(llm, path)
    assert tokens(llm) == expected
    runner = llm.engine.executor.runner
    llm.sleep(level)
    assert llm.is_sleeping() and runner.kv_caches == [] and runner.sleep_level == level
    assert (runner.model is None) == (level == 2)
    memory = llm.engine.memory()
    assert memory.kv_cache == 0 and bool(memory.weights) == (level == 1)
    with pytest.raises(RuntimeError, match="asleep: call wake_up"):
        llm.generate([PROMPT], GREEDY)
    llm.wake_up()
    assert not llm.is_sleeping() and len(runner.kv_caches) > 0
    assert llm.engine.kv_cache_manager.num_free_blocks == 32  # nothing cached survives the sleep
    assert tokens(llm) == expected
    assert tokens(llm) == expected  # the second run may hit the prefix cache filled after the wake
    llm.engine.shutdown()


def test_the_decode_graphs_are_built_again_over_the_new_kv_cache():
    """On CPU the graph path runs emulated (test_cuda_graphs.py): after a wake the graphs
    read the new KV cache, and graph steps give transformers' tokens."""
    path = str(fixture_path("tiny-llama"))
    llm = LLM(model=path, max_model_len=128, num_gpu_blocks_override=32)
    runner = llm.engine.executor.runner
    runner.init_decode_graphs(emulate=True)
    expected = reference(llm, path)
    assert tokens(llm) == expected
    old = runner.decode_graphs
    llm.sleep(1)
    assert runner.decode_graphs is None
    llm.wake_up()
    graphs = runner.decode_graphs
    assert graphs is not None and graphs is not old and graphs.kv_caches is runner.kv_caches
    assert tokens(llm) == expected
    llm.engine.shutdown()


def test_sleep_is_refused_while_requests_run_and_for_unknown_levels():
    llm = LLM(model=str(fixture_path("tiny-llama")), max_model_len=128, num_gpu_blocks_override=16)
    with pytest.raises(ValueError, match="sleep level must be 1 or 2"):
        llm.sleep(3)
    llm.engine.add_request("r", PROMPT, GREEDY)
    with pytest.raises(RuntimeError, match="unfinished requests"):
        llm.sleep(1)
    llm.engine.abort_request("r")
    llm.sleep(1)
    llm.sleep(2)  # deeper: the weights go too
    assert llm.engine.sleep_level == 2
    llm.sleep(1)  # shallower than it is: stays at 2
    assert llm.engine.sleep_level == 2
    llm.engine.shutdown()


def test_a_quantized_kv_cache_keeps_its_scales_through_a_deep_sleep():
    """A level-2 wake loads a new model: the KV scales calibrated at the start are set on
    it again (not calibrated anew, not left unset), so it answers as before the sleep.
    Without them the int8 cache would be read with unit scales and answer differently."""
    llm = LLM(model=str(fixture_path("tiny-llama")), max_model_len=128, num_gpu_blocks_override=32,
              kv_cache_dtype="int8")
    before = tokens(llm)
    runner = llm.engine.executor.runner
    scales = runner.kv_scales
    llm.sleep(2)
    llm.wake_up()
    assert runner.kv_scales is scales
    assert tokens(llm) == before
    llm.engine.shutdown()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("packed", [False, True], ids=["dense", "packed-gguf"])
@pytest.mark.parametrize("level", [1, 2])
def test_on_cuda_a_sleep_gives_the_device_memory_back_and_the_wake_answers_as_before(level, packed, tmp_path):
    """The CUDA path itself: the KV cache and the weights (level 1: into pinned host
    memory; level 2: the whole model) leave the device and torch's cache is emptied, so
    another process could take the memory; after the wake (weights copied back or loaded
    again, decode graphs captured over the new cache) the tokens are those of before.
    Also for a GGUF kept packed (its Triton kernels' views of the planes move too)."""
    model = str(fixture_path("tiny-llama"))
    if packed:
        from gguf import GGMLQuantizationType as T
        from gguf_fixtures import write_gguf

        model = str(write_gguf(fixture_path("tiny-llama"), tmp_path / "tiny-llama.gguf", T.Q8_0))
    llm = LLM(model=model, device="cuda", dtype="float32", max_model_len=128,
              num_gpu_blocks_override=4096)  # a KV cache of its own segments (50 MB), which empty_cache returns
    runner = llm.engine.executor.runner
    before = tokens(llm)
    assert runner.decode_graphs is not None
    memory = llm.engine.memory()
    torch.cuda.synchronize()
    allocated, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    llm.sleep(level)
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() <= allocated - memory.kv_cache - sum(memory.weights.values())
    assert torch.cuda.memory_reserved() <= reserved - memory.kv_cache
    assert runner.decode_graphs is None
    llm.wake_up()
    assert runner.kv_caches and runner.kv_caches[0].device.type == "cuda"
    assert tokens(llm) == before
    assert runner.decode_graphs is not None
    llm.engine.shutdown()
