"""Engine behaviour beyond greedy equality: seeds, n > 1, stops, streaming text,
sampling filters checked against the raw distribution, validation, abort."""
from __future__ import annotations

import math

import msgspec
import pytest

from llmd import LLM, SamplingParams
from llmd_tools.make_model import fixture_path

TEXT = "def parse(path):\n    with open(path) as f:\n        return json.load(f)\n"


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(model=str(fixture_path("tiny-llama")), num_gpu_blocks_override=256, max_model_len=256)


def assert_clean(llm: LLM) -> None:
    kv = llm.engine.kv_cache_manager
    kv.check_integrity()
    kv.assert_all_free()
    assert not llm.engine.has_unfinished_requests()


def test_seeded_sampling_same_in_any_batch(llm):
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=20, ignore_eos=True)
    noise = SamplingParams(temperature=1.2, max_tokens=25, ignore_eos=True)
    alone = llm.generate([TEXT], seeded)[0].outputs[0].token_ids
    batch = llm.generate(["a", "import os", TEXT, "x = 1"], [noise, noise, seeded, noise])
    assert batch[2].outputs[0].token_ids == alone
    first = llm.generate([TEXT, "zz"], [seeded, noise])[0].outputs[0].token_ids
    assert first == alone
    other = llm.generate([TEXT], msgspec.structs.replace(seeded, seed=99))[0].outputs[0].token_ids
    assert other != alone
    assert_clean(llm)


def test_seeded_sampling_survives_preemption():
    path = str(fixture_path("tiny-llama"))
    roomy = LLM(model=path, num_gpu_blocks_override=256, max_model_len=160)
    tight = LLM(model=path, num_gpu_blocks_override=10, max_model_len=160)
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=40, ignore_eos=True) for s in range(6)]
    prompts = [TEXT * 2, "import sys", TEXT, "class A:", "for x in y:", TEXT[:30]]
    ref = [o.outputs[0].token_ids for o in roomy.generate(prompts, params)]
    got = [o.outputs[0].token_ids for o in tight.generate(prompts, params)]
    assert tight.engine.get_stats()["num_preemptions"] > 0
    assert got == ref
    assert_clean(tight)


def test_n_samples_share_prompt_blocks(llm):
    prompt = TEXT * 2  # several full blocks
    before = llm.engine.get_stats()["prefix_cache_hits"]
    out = llm.generate([prompt], SamplingParams(n=4, temperature=1.0, seed=5, max_tokens=12, ignore_eos=True))[0]
    assert len(out.outputs) == 4
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1  # distinct samples
    num_prompt_blocks = (len(out.prompt_token_ids) - 1) // 16
    hits = llm.engine.get_stats()["prefix_cache_hits"] - before
    assert hits >= 3 * num_prompt_blocks * 16  # three siblings reuse the first one's blocks
    again = llm.generate([prompt], SamplingParams(n=4, temperature=1.0, seed=5, max_tokens=12, ignore_eos=True))[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]
    assert_clean(llm)


def test_stop_string_spanning_tokens(llm):
    tok = llm.tokenizer
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    full = llm.generate([TEXT], greedy)[0].outputs[0]
    # Pick a stop string that straddles a token boundary in the middle of the output.
    pieces = [tok.decode(full.token_ids[:i]) for i in range(len(full.token_ids) + 1)]
    boundary = len(pieces[10])
    stop = full.text[boundary - 2:boundary + 2]
    assert len(stop) == 4 and stop in full.text
    out = llm.generate([TEXT], msgspec.structs.replace(greedy, stop=[stop]))[0].outputs[0]
    cut = full.text.index(stop)
    assert out.text == full.text[:cut]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    inc = llm.generate([TEXT], msgspec.structs.replace(greedy, stop=[stop], include_stop_str_in_output=True))[0]
    assert inc.outputs[0].text == full.text[:cut + len(stop)]
    assert_clean(llm)


def test_stop_token_ids_and_lengths(llm):
    greedy = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    full = llm.generate([TEXT], greedy)[0].outputs[0]
    stop_id = full.token_ids[7]
    first = full.token_ids.index(stop_id)
    out = llm.generate([TEXT], msgspec.structs.replace(greedy, stop_token_ids=[stop_id]))[0].outputs[0]
    assert out.token_ids == full.token_ids[:first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id
    short = llm.generate([TEXT], msgspec.structs.replace(greedy, max_tokens=5))[0].outputs[0]
    assert short.token_ids == full.token_ids[:5] and short.finish_reason == "length"
    # max_tokens=None runs to max_model_len.
    prompt = llm.tokenizer(TEXT).input_ids
    capped = llm.generate([prompt], msgspec.structs.replace(greedy, max_tokens=None))[0].outputs[0]
    assert len(prompt) + len(capped.token_ids) == 256 and capped.finish_reason == "length"
    assert_clean(llm)


@pytest.mark.parametrize("prompt", ["日本語のテキスト🎉", "emoji 👨‍👩‍👧 and café", "中文"])
def test_streamed_text_equals_full_decode(llm, prompt):
    engine = llm.engine
    params = SamplingParams(temperature=1.3, seed=3, max_tokens=48, ignore_eos=True)
    engine.add_request("s", prompt, params)
    streamed = []
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            streamed.append(out.outputs[0].new_text)
            final = out
    completion = final.outputs[0]
    assert "".join(streamed) == completion.text
    assert completion.text == llm.tokenizer.decode(completion.token_ids, skip_special_tokens=True)
    assert_clean(llm)


def _probs(position) -> dict[int, float]:
    return {t: math.exp(lp.logprob) for t, lp in position.items()}


def test_top_k_never_samples_outside_top_k(llm):
    params = SamplingParams(temperature=1.5, top_k=3, max_tokens=30, ignore_eos=True, logprobs=5, seed=0)
    outs = llm.generate([TEXT, "import", "x"], params)
    ranks = [pos[t].rank for o in outs for t, pos in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)]
    assert max(ranks) <= 3 and len(set(ranks)) > 1
    assert_clean(llm)


def test_top_p_never_samples_outside_nucleus(llm):
    top_p = 0.6
    params = SamplingParams(temperature=1.0, top_p=top_p, max_tokens=30, ignore_eos=True, logprobs=20, seed=1)
    outs = llm.generate([TEXT, "import", "x"], params)
    for o in outs:
        for token, pos in zip(o.outputs[0].token_ids, o.outputs[0].logprobs):
            rank = pos[token].rank
            assert rank <= 20
            probs = sorted(_probs(pos).values(), reverse=True)
            # Mass strictly above the sampled token must be below top_p (else it was cut).
            assert sum(probs[:rank - 1]) < top_p + 1e-5
    assert_clean(llm)


def test_min_p_never_samples_below_threshold(llm):
    min_p = 0.2
    params = SamplingParams(temperature=1.0, min_p=min_p, max_tokens=30, ignore_eos=True, logprobs=1, seed=2)
    outs = llm.generate([TEXT, "import", "x"], params)
    for o in outs:
        for token, pos in zip(o.outputs[0].token_ids, o.outputs[0].logprobs):
            probs = _probs(pos)
            top = max(probs.values())
            assert probs[token] >= min_p * top - 1e-6
    assert_clean(llm)


@pytest.mark.parametrize("kwargs, field", [
    ({"temperature": -0.5}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"top_k": -3}, "top_k"),
    ({"min_p": 2.0}, "min_p"),
    ({"n": 0}, "n"),
    ({"logprobs": 50}, "logprobs"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
])
def test_invalid_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)
    with pytest.raises(msgspec.ValidationError, match=field):
        msgspec.json.decode(msgspec.json.encode(kwargs), type=SamplingParams)


def test_unknown_fields_rejected():
    with pytest.raises(TypeError):
        SamplingParams(temprature=0.5)
    with pytest.raises(msgspec.ValidationError, match="temprature"):
        msgspec.json.decode(b'{"temprature": 0.5}', type=SamplingParams)
    with pytest.raises(ValueError, match="max_num_seqz"):
        LLM(model=str(fixture_path("tiny-llama")), max_num_seqz=4)


def test_bad_prompts_rejected_and_engine_keeps_serving(llm):
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]], greedy)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([[5] * 256], greedy)
    with pytest.raises(ValueError, match="token ids"):
        llm.generate([[5, 10**6]], greedy)
    out = llm.generate(["hello"], greedy)[0]
    assert len(out.outputs[0].token_ids) == 4
    assert_clean(llm)


def test_abort_frees_blocks_and_leaves_others_untouched(llm):
    engine = llm.engine
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    solo = llm.generate([TEXT], greedy)[0].outputs[0].token_ids
    engine.add_request("keep", TEXT, greedy)
    engine.add_request("drop", TEXT * 3, greedy)
    for _ in range(3):
        engine.step()
    aborted = engine.abort_request("drop")
    assert aborted[0].outputs[0].finish_reason == "abort"
    result = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id == "keep"
            result = out
    assert result.outputs[0].token_ids == solo
    assert_clean(llm)


def test_logprobs_over_engine_limit_rejected():
    small = LLM(model=str(fixture_path("tiny-llama")), num_gpu_blocks_override=64, max_model_len=128,
                max_logprobs=5)
    with pytest.raises(ValueError, match="logprobs must be <= max_logprobs"):
        small.generate(["x"], SamplingParams(logprobs=6))
    with pytest.raises(ValueError, match="prompt_logprobs must be <= max_logprobs"):
        small.generate(["x"], SamplingParams(prompt_logprobs=6))
    assert small.generate(["x"], SamplingParams(logprobs=5, max_tokens=2))[0].outputs[0].logprobs
    assert_clean(small)


def test_cpu_threads_setting_limits_torch_threads():
    import subprocess
    import sys

    code = ("import torch\nfrom llmd import LLM, SamplingParams\n"
            f"llm = LLM(model={str(fixture_path('tiny-llama'))!r}, num_gpu_blocks_override=32, max_model_len=128,"
            " cpu_threads=1)\n"
            "assert torch.get_num_threads() == 1, torch.get_num_threads()\n"
            "print(len(llm.generate(['x'], SamplingParams(max_tokens=3))[0].outputs[0].token_ids))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "3"
    with pytest.raises(ValueError, match="cpu_threads"):
        LLM(model=str(fixture_path("tiny-llama")), cpu_threads=0)


def test_chat_is_generate_on_the_chat_templates_tokens(llm):
    """vLLM's LLM.chat: one conversation or several, each rendered as transformers'
    apply_chat_template renders it (no second BOS), then generated as `generate` does."""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(fixture_path("tiny-llama")))
    first = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "def add(a, b):"}]
    second = [{"role": "user", "content": [{"type": "text", "text": "import "}, {"type": "text", "text": "os"}]}]
    params = SamplingParams(temperature=0, max_tokens=8)

    def rendered(messages, **template):
        text = hf.apply_chat_template(messages, tokenize=False, **template)
        return text, hf(text, add_special_tokens=False).input_ids

    as_text = [{"role": "user", "content": "import os"}]
    expected = [rendered(first, add_generation_prompt=True), rendered(as_text, add_generation_prompt=True)]
    reference = llm.generate([ids for _, ids in expected], params)
    outputs = llm.chat([first, second], params)
    assert [o.prompt for o in outputs] == [text for text, _ in expected]
    assert [o.prompt_token_ids for o in outputs] == [ids for _, ids in expected]
    assert [o.outputs[0].text for o in outputs] == [r.outputs[0].text for r in reference]
    (single,) = llm.chat(first, params)
    assert single.outputs[0].token_ids == reference[0].outputs[0].token_ids
    prefill = first + [{"role": "assistant", "content": "return a"}]
    (continued,) = llm.chat(prefill, params, add_generation_prompt=False, continue_final_message=True)
    assert continued.prompt == rendered(prefill, continue_final_message=True)[0]
    assert continued.prompt.endswith("return a")
    with pytest.raises(ValueError, match="messages"):
        llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], params)
    assert_clean(llm)
