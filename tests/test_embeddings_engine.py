"""Embeddings from the offline engine (`LLM.embed`, `engine.add_request` with
PoolingParams) against Hugging Face transformers on the same weights: the fixture's
`model.model(ids).last_hidden_state` (after the final norm, what sentence-transformers
pools) pooled by the last token, the mean or the first token, then L2-normalized; fp32,
cosine >= 0.9999. Single prompts, batches, prompts longer than the step budget (chunked
prefill: MEAN adds its chunks up), batches beside decodes in flight, preemption, async
scheduling and a worker process; the prefix-cache rule per pooling type; Matryoshka
sizes; the sentence-transformers pooling config; bad input refused by name."""
from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from hf_ref import hf_greedy, hf_model
from llmd import LLM, PoolingParams, SamplingParams
from llmd.pooling_config import resolve_pooling
from llmd_tools.make_model import fixture_path

MAX_LEN = 256
BUDGET = 32  # max_num_batched_tokens: a longer prompt is computed in chunks
MATRYOSHKA = [16, 32]
PROMPTS = ["hello world", "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n" * 3,
           "The quick brown fox jumps over the lazy dog.", "a", "word " * 40]
MIN_COSINE = 0.9999


@pytest.fixture(scope="module")
def model() -> str:
    return str(fixture_path("tiny-llama"))


@pytest.fixture(scope="module")
def hf(model):
    return hf_model(model)[0]


@torch.inference_mode()
def reference(hf, token_ids: list[int], kind: str, *, normalize: bool = True, dimensions: int | None = None):
    """transformers' final hidden states of the prompt, pooled as sentence-transformers
    pools (lasttoken, mean_tokens, cls_token), cut and normalized as asked."""
    hidden = hf.model(torch.tensor([token_ids])).last_hidden_state[0].float()
    vector = {"LAST": hidden[-1], "MEAN": hidden.mean(dim=0), "CLS": hidden[0]}[kind]
    if dimensions is not None:
        vector = vector[:dimensions]
    return F.normalize(vector, dim=-1) if normalize else vector


def assert_close(got: list[float], expected: torch.Tensor, what: str) -> None:
    got_t = torch.tensor(got)
    assert got_t.shape == expected.shape, f"{what}: {got_t.shape} != {expected.shape}"
    cosine = F.cosine_similarity(got_t, expected, dim=0).item()
    assert cosine >= MIN_COSINE, f"{what}: cosine {cosine}"
    assert torch.allclose(got_t.norm(), expected.norm(), rtol=1e-4), f"{what}: norm {got_t.norm()} vs {expected.norm()}"


def engine_settings(**overrides) -> dict:
    return dict(dtype="float32", device="cpu", max_model_len=MAX_LEN, num_gpu_blocks_override=96,
                max_num_batched_tokens=BUDGET) | overrides


@pytest.fixture(scope="module", params=["LAST", "MEAN", "CLS"])
def pooled(request, model):
    llm = LLM(model=model, pooling_type=request.param, matryoshka_dimensions=MATRYOSHKA, **engine_settings())
    yield llm, request.param
    llm.engine.shutdown()


# -- against transformers ------------------------------------------------------------------

def test_single_and_batched_prompts_match_transformers(pooled, hf):
    llm, kind = pooled
    assert llm.engine.config.pooling_type == kind
    single = llm.embed(PROMPTS[1])[0]
    assert len(single.prompt_token_ids) > BUDGET  # computed in chunks
    assert single.finish_reason == "stop" and single.outputs.hidden_size == hf.config.hidden_size
    assert_close(single.outputs.embedding, reference(hf, single.prompt_token_ids, kind), f"{kind} single")
    batch = llm.embed(PROMPTS)
    assert [o.prompt_token_ids for o in batch][1] == single.prompt_token_ids
    for i, out in enumerate(batch):
        assert_close(out.outputs.embedding, reference(hf, out.prompt_token_ids, kind), f"{kind} batch[{i}]")
    ids = llm.embed([[5, 17, 301, 42, 8]])[0]  # token ids as the prompt
    assert_close(ids.outputs.embedding, reference(hf, [5, 17, 301, 42, 8], kind), f"{kind} token ids")


def test_embeddings_beside_decodes_in_flight(pooled, hf, model):
    """Embeddings batched into steps with a decode running: both are right (the decode
    against transformers' greedy run)."""
    llm, kind = pooled
    engine = llm.engine
    decode_prompt = [3, 14, 15, 92, 65]
    engine.add_request("decode", decode_prompt, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
    engine.step()
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"embed{i}", prompt, PoolingParams())
    finished, decode_running_at_end = {}, False
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        if len(finished) == len(PROMPTS) and not decode_running_at_end:
            decode_running_at_end = "decode" not in finished
    assert decode_running_at_end  # the embeddings ran while the decode was in flight
    for i in range(len(PROMPTS)):
        out = finished[f"embed{i}"]
        assert_close(out.outputs.embedding, reference(hf, out.prompt_token_ids, kind), f"{kind} embed{i}")
    expected, _ = hf_greedy(model, decode_prompt, 30)
    assert finished["decode"].outputs[0].token_ids == expected


def test_normalize_off_and_matryoshka_dimensions(pooled, hf):
    llm, kind = pooled
    raw, cut = llm.embed([PROMPTS[0], PROMPTS[0]], [PoolingParams(normalize=False), PoolingParams(dimensions=16)])
    assert_close(raw.outputs.embedding, reference(hf, raw.prompt_token_ids, kind, normalize=False), "raw")
    assert_close(cut.outputs.embedding, reference(hf, cut.prompt_token_ids, kind, dimensions=16), "dimensions")
    for bad in (24, 65):
        with pytest.raises(ValueError, match="^dimensions"):
            llm.embed(PROMPTS[0], PoolingParams(dimensions=bad))


def test_prefix_cache_only_where_the_pooling_allows_it(pooled, hf):
    """LAST reads only the last token's state, which a prefix-cache hit never covers:
    the second embedding of a prompt takes its cached prefix. MEAN and CLS read every
    position (or the first): they never look the cache up."""
    llm, kind = pooled
    stats = llm.engine.kv_cache_manager.prefix_cache_stats
    prompt = f"a prompt only this {kind} test embeds, " * 4
    first = llm.embed(prompt)[0]
    queries, hits = stats.queries, stats.hits
    second = llm.embed(prompt)[0]
    if kind == "LAST":
        assert stats.hits - hits >= 16
    else:
        assert (stats.queries, stats.hits) == (queries, hits)
    for out in (first, second):
        assert_close(out.outputs.embedding, reference(hf, out.prompt_token_ids, kind), f"{kind} cached")


def test_bad_input_is_refused_by_name(pooled, hf):
    llm, kind = pooled
    long_prompt = "word " * (MAX_LEN + 10)
    with pytest.raises(ValueError, match=r"^prompt has \d+ tokens, more than max_model_len \(256\)"):
        llm.embed(long_prompt)
    with pytest.raises(ValueError, match="^prompt is empty"):
        llm.embed([""])
    with pytest.raises(ValueError, match=r"^prompt token ids must be in \[0, 1024\)"):
        llm.embed([[1, 2, 5000]])
    cut = llm.embed(long_prompt, truncate=True)[0]
    assert len(cut.prompt_token_ids) == MAX_LEN
    assert cut.prompt_token_ids == hf_model(llm.engine.model_dir)[1](long_prompt).input_ids[:MAX_LEN]
    assert_close(cut.outputs.embedding, reference(hf, cut.prompt_token_ids, kind), f"{kind} truncated")
    assert not llm.engine.has_unfinished_requests()


# -- the scheduler's corner cases ------------------------------------------------------------

@pytest.mark.parametrize("settings", [
    # Two long prompts chunked side by side in a pool too small for both: one is preempted
    # (its blocks and pooled state dropped) and recomputed from its first token.
    dict(num_gpu_blocks_override=17, long_prefill_token_threshold=16),
    # The next step is scheduled while this one runs: a pooling request's last chunk
    # leaves no placeholder token behind.
    dict(async_scheduling=True),
], ids=["preemption", "async-scheduling"])
def test_mean_pooling_survives_preemption_and_async_scheduling(model, hf, settings):
    llm = LLM(model=model, pooling_type="MEAN", **engine_settings(**settings))
    try:
        prompts = [[(7 * i) % 1000 + 3 for i in range(220)], [(11 * i) % 1000 + 3 for i in range(230)]]
        engine = llm.engine
        engine.add_request("decode", [7, 8, 9], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
        outputs = llm.embed(prompts)
        for out in outputs:
            assert len(out.prompt_token_ids) > 13 * 16
            assert_close(out.outputs.embedding, reference(hf, out.prompt_token_ids, "MEAN"), str(settings))
        if "num_gpu_blocks_override" in settings:
            assert engine.scheduler.stats.num_preemptions_total > 0
    finally:
        llm.engine.shutdown()


def test_pooling_messages_cross_the_worker_process_boundary():
    """What a worker process is sent (a pooling request, the pooling type) and answers
    (the pooled states) survives the msgpack encoding the mp executor uses."""
    import dataclasses

    import msgspec

    from llmd.core.step_messages import CachedRequestData, NewRequestData, RunnerOutput, SchedulerOutput
    from llmd.gpu.worker.process import Execute, FromWorker, StepReply, ToWorker, WorkerInit
    from llmd.gpu.worker.runner_types import RunnerSettings

    new = NewRequestData("e", [1, 2, 3], [], None, [0], 0, pooling_params=PoolingParams(normalize=False, dimensions=8))
    step = SchedulerOutput([new], CachedRequestData([], [], []), {"e": 3}, 3, [])
    assert msgspec.msgpack.Decoder(ToWorker).decode(msgspec.msgpack.encode(Execute(step))).scheduler_output == step
    out = RunnerOutput(req_ids=["e"], sampled_token_ids=[[]], pooled={"e": [0.25, -1.5e-7, 3.0]})
    assert msgspec.msgpack.Decoder(FromWorker).decode(msgspec.msgpack.encode(StepReply(out))).output == out
    settings = RunnerSettings(block_size=16, max_model_len=64, valid_vocab_size=10, eos_token_id=None, seed=0,
                              pooling_type="MEAN")
    init = WorkerInit(0, 1, "m", "cpu", "float32", dataclasses.asdict(settings))
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(init), type=WorkerInit)
    assert RunnerSettings(**decoded.settings).pooling_type == "MEAN"


# -- how a model is served for embeddings ----------------------------------------------------

def sentence_transformers_dir(tmp_path: Path, model: str, pooling: dict, modules: list[str] = ()) -> Path:
    """The fixture as a sentence-transformers model: its files linked, plus modules.json
    and the Pooling module's config."""
    folder = tmp_path / "st-model"
    folder.mkdir(parents=True)
    for item in Path(model).iterdir():
        os.symlink(item, folder / item.name)
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 64, **pooling}))
    listed = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
              {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
              *({"idx": 2 + i, "name": str(2 + i), "path": f"{2 + i}_x", "type": f"sentence_transformers.models.{m}"}
                for i, m in enumerate(modules))]
    (folder / "modules.json").write_text(json.dumps(listed))
    return folder


def test_task_embed_with_a_sentence_transformers_config(tmp_path, model, hf):
    folder = sentence_transformers_dir(tmp_path, model, {"pooling_mode_mean_tokens": True,
                                                          "pooling_mode_cls_token": False}, ["Normalize"])
    llm = LLM(model=str(folder), task="embed", **engine_settings())
    try:
        assert llm.engine.config.pooling_type == "MEAN"  # from 1_Pooling/config.json
        out = llm.embed(PROMPTS[1])[0]
        assert_close(out.outputs.embedding, reference(hf, out.prompt_token_ids, "MEAN"), "sentence-transformers")
        with pytest.raises(ValueError, match="generation is off"):
            llm.generate("hello", SamplingParams(max_tokens=2))
        with pytest.raises(ValueError, match="^dimensions is not supported by this model"):
            llm.embed("hello", PoolingParams(dimensions=16))
    finally:
        llm.engine.shutdown()
    with pytest.raises(ValueError, match="Dense"):  # a projection llmd does not run
        LLM(model=str(sentence_transformers_dir(tmp_path / "dense", model, {"pooling_mode_lasttoken": True},
                                                ["Dense"])), task="embed", **engine_settings())


@pytest.mark.parametrize("pooling, error", [
    ({"pooling_mode_max_tokens": True}, "max_tokens"),
    ({"pooling_mode_mean_tokens": True, "pooling_mode_cls_token": True}, "exactly one"),
    ({"pooling_mode_lasttoken": True, "include_prompt": False}, "include_prompt"),
])
def test_sentence_transformers_pooling_llmd_cannot_run_is_refused(tmp_path, model, pooling, error):
    folder = sentence_transformers_dir(tmp_path, model, pooling)
    config = SimpleNamespace(hidden_size=64)
    with pytest.raises(ValueError, match=error):
        resolve_pooling(str(folder), config, None, None)
    assert resolve_pooling(str(folder), config, "CLS", None).pooling_type == "CLS"  # the setting overrides it


def test_matryoshka_declarations():
    folder = "/nonexistent"
    assert resolve_pooling(folder, SimpleNamespace(hidden_size=64), None, None).matryoshka_dimensions is None
    declared = resolve_pooling(folder, SimpleNamespace(hidden_size=64, matryoshka_dimensions=[32, 16, 64]), None, None)
    assert declared.matryoshka_dimensions == (16, 32, 64) and declared.pooling_type == "LAST"
    declared.check_dimensions(32)
    with pytest.raises(ValueError, match="one of the model's Matryoshka sizes"):
        declared.check_dimensions(48)
    any_size = resolve_pooling(folder, SimpleNamespace(hidden_size=64, is_matryoshka=True), None, None)
    any_size.check_dimensions(48)
    with pytest.raises(ValueError, match=r"in \[1, 64\]"):
        any_size.check_dimensions(65)
    with pytest.raises(ValueError, match="more than the model's embedding size"):
        resolve_pooling(folder, SimpleNamespace(hidden_size=64), None, [16, 128])
