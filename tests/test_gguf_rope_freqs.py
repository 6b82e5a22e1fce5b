"""Llama 3.x GGUFs: the per-frequency rope factors (`rope_freqs.weight`) that llama.cpp's
converter writes for llama3 rope scaling, applied as llama.cpp applies them (each inverse
frequency divided by its factor; daemon/gpu/models/gguf_rope.py).

The fixture `tiny-llama3-rope` (tools/make_gguf.py) is a random-weight tiny llama with
llama3 scaling (x8 from 64 original positions: of its 8 frequencies one kept, two
blended, five divided by 8) converted by llama.cpp's own converter (BF16) and quantized
by llama.cpp's quantizer (Q8_0). The reference is transformers on the HF directory the
files were converted from, which computes llama3 rope itself; for Q8_0, that model with
the file's weights as transformers' GGUF loader dequantizes them. Over a 200-token prompt
(far past the 64 original positions) and 24 greedy tokens llmd gives the reference's
tokens and logprobs, dense and packed (through the C++ batch-1 decode layers where the
CPU has them), and not the unscaled model's. llama.cpp itself, on the same file, picks
llmd's tokens and not the unscaled ones. For the real Llama 3.2 1B's parameters, the
factors the converter writes, read by llmd, give transformers' llama3 frequencies.
Skipped without llama-cpp-python (the optional `llamacpp` extra) or its converter
(LLMD_CONVERT_HF_TO_GGUF names the one in its sdist where its wheel has none)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("llama_cpp")

import gguf  # noqa: E402
from transformers import AutoModelForCausalLM, LlamaConfig  # noqa: E402
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding  # noqa: E402
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402

from gguf_fixtures import gguf_with  # noqa: E402
from hf_ref import check_logprobs_close, engine_result, hf_model, model_greedy  # noqa: E402
from llmd import LLM, SamplingParams  # noqa: E402
from llmd.gpu.layers.cpu.cpu_kernels import gguf_ops  # noqa: E402
from llmd.gpu.layers.rotary import RotaryEmbedding, inv_freqs, rope_parameters  # noqa: E402
from llmd.gpu.models.loader import load_hf_config  # noqa: E402
from llmd_tools import make_gguf, make_model  # noqa: E402
from test_cpu_decode_layers import Spy  # noqa: E402

try:
    make_gguf.converter_path()
except make_gguf.LlamaCppUnavailable as exc:  # a wheel without the converter, no LLMD_CONVERT_HF_TO_GGUF
    pytest.skip(str(exc), allow_module_level=True)

NAME = "tiny-llama3-rope"
MAX_TOKENS = 24
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=5)
# BOS, then 199 seeded ids past the tokenizer's five special tokens
PROMPT = [0, *np.random.default_rng(0).integers(5, 1024, 199).tolist()]
UNSCALED = {"rope_type": "default", "rope_theta": 10000.0}  # the fixture's rope without llama3's scaling
# meta-llama/Llama-3.2-1B's config.json
LLAMA_3_2_1B_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


@pytest.fixture(scope="module")
def files():
    """The fixture's BF16 and Q8_0 files, built once into the fixture cache (~10 s)."""
    return {q: make_gguf.gguf_fixture(NAME, q, threads=1) for q in make_gguf.GGUF_FIXTURES[NAME]["types"]}


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return make_gguf.build_hf_model(NAME, tmp_path_factory.mktemp("hf") / NAME)


def transformers_greedy(hf_dir, weights_from=None, **config_overrides) -> tuple[list[int], list[dict[int, float]]]:
    """transformers' greedy run over PROMPT of the HF directory's model (fp32), its
    weights replaced by those transformers' GGUF loader reads from `weights_from`, its
    config fields by `config_overrides`."""
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, **config_overrides).eval()
    if weights_from is not None:
        model.load_state_dict(hf_model(str(weights_from))[0].state_dict())
    return model_greedy(model, len(hf_model(str(hf_dir))[1]), PROMPT, MAX_TOKENS)


def test_the_converter_writes_llama3_scaling_as_rope_freqs(files, hf_dir):
    """As for the real Llama 3.x files: no rope scaling keys, a rope_freqs tensor (F32, one
    factor per rotated frequency, the three llama3 bands), which llmd reads as they are."""
    for path in files.values():
        reader = gguf.GGUFReader(path)
        assert not [k for k in reader.fields if ".rope.scaling" in k]
        (t,) = [t for t in reader.tensors if t.name == "rope_freqs.weight"]
        assert t.tensor_type == gguf.GGMLQuantizationType.F32
        factors = np.array(t.data, dtype=np.float64)
        assert factors.shape == (8,) and factors[0] == 1.0 and (factors[3:] == 8.0).all()
        assert (1.0 < factors[1:3]).all() and (factors[1:3] < 8.0).all()
        rope = load_hf_config(path).rope_parameters
        assert rope["rope_type"] == "longrope" and rope["attention_factor"] == 1.0
        assert rope["short_factor"] == rope["long_factor"] == factors.tolist()


@pytest.mark.usefixtures("float32_products")
@pytest.mark.parametrize("quant", ["BF16", "Q8_0"])
def test_llmd_runs_the_file_as_transformers_runs_the_hf_model(files, hf_dir, quant):
    """BF16: every weight dequantized at load, exactly the HF directory's bf16 weights.
    Q8_0: packed, the prompt prefilled in chunks of 64 tokens, then one request's decode
    steps (through the C++ layers where the CPU has the x16 kernels); the reference reads
    the file's weights."""
    path = files[quant]
    settings = dict(device="cpu", dtype="float32", num_gpu_blocks_override=64, max_model_len=256)
    if quant == "Q8_0":
        settings.update(max_num_seqs=1, max_num_batched_tokens=64, enable_prefix_caching=False)
    llm = LLM(model=str(path), **settings)
    model = llm.engine.executor.runner.model
    spy = Spy(model) if model.decode_layers is not None else None
    if quant == "Q8_0" and (gguf_ops() is not None and gguf_ops().x16):
        assert spy is not None, "the C++ decode layers should run this packed model"
    ours = engine_result(llm.generate([PROMPT], GREEDY)[0])
    if spy is not None:
        assert spy.calls == MAX_TOKENS - 1  # every decode step; the first token comes from the prefill
    reference = transformers_greedy(hf_dir, weights_from=path if quant == "Q8_0" else None)
    assert check_logprobs_close(reference, ours, f"{quant} vs transformers") == MAX_TOKENS
    with pytest.raises(AssertionError):  # the comparison fails without the scaling
        assert check_logprobs_close(transformers_greedy(hf_dir, rope_parameters=UNSCALED), ours,
                                    f"{quant} vs unscaled") >= MAX_TOKENS // 2


def test_llama_cpp_runs_the_file_as_llmd_does(files, hf_dir):
    """llama.cpp (through llama-cpp-python) on the BF16 file: its next-token choice at
    each prompt position is llmd's at nearly all of them (it rounds activations to bf16 for
    its BF16 matmuls, so not at all: 96% measured) and the unscaled model's at few (5%)."""
    from llama_cpp import Llama

    path = files["BF16"]
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    out = LLM(model=str(path), device="cpu", dtype="float32", num_gpu_blocks_override=64,
              max_model_len=256).generate([PROMPT], params)[0]
    ours = np.array([max(pos, key=lambda t: pos[t].logprob) for pos in out.prompt_logprobs[1:]])
    llama_cpp = Llama(model_path=str(path), n_ctx=256, logits_all=True, n_threads=1, verbose=False)
    try:
        llama_cpp.eval(PROMPT)
        theirs = np.array(llama_cpp.scores[:len(PROMPT) - 1]).argmax(-1)  # row i predicts token i + 1
    finally:
        llama_cpp.close()
    unscaled = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, rope_parameters=UNSCALED)
    with torch.inference_mode():
        unscaled_choice = unscaled(torch.tensor([PROMPT])).logits[0, :-1].argmax(-1).numpy()
    agreement, unscaled_agreement = (theirs == ours).mean(), (theirs == unscaled_choice).mean()
    assert agreement >= 0.85 and unscaled_agreement <= 0.25, (agreement, unscaled_agreement)


def test_llama_3_2_1b_frequencies_are_transformers_llama3(tmp_path):
    """The 1B benchmark fixture's recipe carries the real model's rope; the factors llama.cpp's
    converter computes from it, in a GGUF header as the converter writes the real 1B's and
    read by llmd, give transformers' llama3 inverse frequencies and cos/sin tables."""
    recipe = {k: v for k, v in make_gguf.GGUF_FIXTURES["llama3.2-1b"].items() if k != "types"}
    config, _ = make_model.resolve_config(recipe.pop("arch"), recipe.pop("preset"), **recipe)
    assert config.rope_parameters == LLAMA_3_2_1B_ROPE
    converter = make_gguf.load_converter()
    writer = object.__new__(make_gguf.converter_model_class(converter, "LlamaForCausalLM"))  # reads only the hparams
    writer.hparams = make_gguf.with_legacy_rope_keys(config.to_dict())
    # what newer converters' __init__ sets from the hparams (ModelBase in conversion/base.py)
    writer.rope_parameters = writer.hparams.get("rope_parameters", writer.hparams.get("rope_scaling")) or {}
    ((name, factors),) = writer.generate_extra_tensors()
    assert name == "rope_freqs.weight" and factors.shape == (32,)
    U32, F32 = gguf.GGUFValueType.UINT32, gguf.GGUFValueType.FLOAT32
    metadata = {"llama.context_length": (131072, U32), "llama.embedding_length": (2048, U32),
                "llama.block_count": (16, U32), "llama.feed_forward_length": (8192, U32),
                "llama.attention.head_count": (32, U32), "llama.attention.head_count_kv": (8, U32),
                "llama.attention.layer_norm_rms_epsilon": (1e-5, F32), "llama.rope.freq_base": (500000.0, F32),
                "llama.rope.dimension_count": (64, U32), "llama.attention.key_length": (64, U32),
                "llama.attention.value_length": (64, U32)}
    path = gguf_with(tmp_path / "llama3.2-1b-header.gguf", "llama", metadata,
                     {"rope_freqs.weight": factors.numpy(), "token_embd.weight": np.zeros((8, 2048), np.float32)})
    ours = load_hf_config(path)
    inv_freq, long_inv_freq, attention_factor = inv_freqs(rope_parameters(ours), 64, ours)
    reference_config = LlamaConfig(hidden_size=2048, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                                   max_position_embeddings=131072, rope_parameters=LLAMA_3_2_1B_ROPE)
    reference, reference_factor = ROPE_INIT_FUNCTIONS["llama3"](reference_config, torch.device("cpu"))
    torch.testing.assert_close(inv_freq, reference, rtol=1e-6, atol=0)
    torch.testing.assert_close(long_inv_freq, reference, rtol=1e-6, atol=0)
    assert attention_factor == reference_factor == 1.0
    positions = torch.tensor([0, 1, 100, 8191, 8192, 65535, 131071])
    cos, sin = RotaryEmbedding(ours, 64, 131072).cos_sin(positions, torch.float32)
    ref_cos, ref_sin = LlamaRotaryEmbedding(reference_config)(torch.zeros(1, dtype=torch.float32), positions[None])
    torch.testing.assert_close(cos[:, 0], ref_cos[0], rtol=0, atol=1e-4)
    torch.testing.assert_close(sin[:, 0], ref_sin[0], rtol=0, atol=1e-4)
    unscaled = LlamaConfig(hidden_size=2048, num_attention_heads=32, head_dim=64, max_position_embeddings=131072,
                           rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
    far_cos, _ = LlamaRotaryEmbedding(unscaled)(torch.zeros(1), positions[None])
    assert (far_cos[0, -1] - cos[-1, 0]).abs().max() > 0.5  # the scaling matters that far out
