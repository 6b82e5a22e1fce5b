"""llmd reads a llama GGUF's metadata, and an HF llama directory's config.json, into its own
LeanLlamaConfig (llama_config.py), which must be transformers' LlamaConfig in all but its
imports: the same fields, defaults, dict and refusals from the same arguments, and a llama
model loaded with none of the ~700 modules LlamaConfig's module pulls in (nor sympy, which
torch's meta-tensor reference imports for `empty_like`)."""
from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest
from gguf import GGMLQuantizationType as T
from transformers import AutoConfig, LlamaConfig

from gguf_fixtures import write_gguf
from llmd.gpu.models.llama_config import LeanLlamaConfig
from llmd.gpu.models.loader import load_hf_config
from test_gguf import hf_dirs  # noqa: F401

# What LlamaConfig's module imports and llmd never needs (llama_config.py's doc).
HEAVY_MODULES = ("transformers.activations", "transformers.core_model_loading", "torch.distributed.tensor",
                 "sympy", "accelerate")

LLAMA_3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
ARGUMENTS = [
    {},
    dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
         num_key_value_heads=3, rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
         architectures=["LlamaForCausalLM"], rope_parameters={"rope_type": "default", "rope_theta": 100000.0}),
    dict(hidden_size=2048, num_attention_heads=32, num_key_value_heads=8, head_dim=64, eos_token_id=[128001, 128009],
         max_position_embeddings=131072, rope_parameters=LLAMA_3_ROPE, dtype="bfloat16"),
    # a config.json of before transformers 5: rope_theta and rope_scaling as fields of their own
    dict(hidden_size=256, num_attention_heads=4, rope_theta=10000.0, rope_scaling={"type": "linear", "factor": 2.0},
         torch_dtype="float16", attention_bias=True, mlp_bias=True, pad_token_id=0, initializer_range=0.5),
    # what an AWQ checkpoint's config.json adds
    dict(hidden_size=128, num_attention_heads=2, quantization_config={"quant_method": "awq", "bits": 4,
                                                                      "group_size": 32, "zero_point": True}),
]
REFUSED = [
    dict(hidden_size=60, num_attention_heads=7),
    dict(initializer_range=2.0),
    dict(initializer_range=-1),
    dict(vocab_size="many"),
    dict(rms_norm_eps=None),
]


def _fields(cls) -> dict[str, tuple]:
    return {f.name: (f.type, f.default, f.default_factory) for f in dataclasses.fields(cls)}


def test_the_fields_and_their_defaults_are_llamaconfigs():
    assert _fields(LeanLlamaConfig) == _fields(LlamaConfig)
    assert LeanLlamaConfig.model_type == LlamaConfig.model_type == "llama"


@pytest.mark.parametrize("arguments", ARGUMENTS, ids=range(len(ARGUMENTS)))
def test_the_same_arguments_make_the_same_config(arguments):
    ours, reference = LeanLlamaConfig(**arguments), LlamaConfig(**arguments)
    assert ours.to_dict() == reference.to_dict()
    assert ours.to_json_string() == reference.to_json_string()
    assert ours.head_dim == reference.head_dim and ours.num_key_value_heads == reference.num_key_value_heads


@pytest.mark.parametrize("arguments", REFUSED, ids=range(len(REFUSED)))
def test_what_llamaconfig_refuses_is_refused_alike(arguments):
    with pytest.raises(Exception) as reference:
        LlamaConfig(**arguments)
    with pytest.raises(type(reference.value)) as ours:
        LeanLlamaConfig(**arguments)
    assert str(ours.value) == str(reference.value)


def test_a_llama_gguf_config_is_the_llamaconfig_of_its_fields(hf_dirs, tmp_path):  # noqa: F811
    ours = load_hf_config(write_gguf(hf_dirs("llama3-rope"), tmp_path / "llama3.gguf"))
    assert isinstance(ours, LeanLlamaConfig)
    fields = {k: v for k, v in ours.to_dict().items() if k not in ("model_type", "transformers_version")}
    assert AutoConfig.for_model("llama", **fields).to_dict() == ours.to_dict()


def test_an_hf_llama_directory_gives_autoconfigs_config_and_autotokenizers_tokenizer(hf_dirs):  # noqa: F811
    """A llama directory's config is read into LeanLlamaConfig: the same dict as
    AutoConfig's (the directory's name included); its tokenizer, handed that config, is
    AutoTokenizer's own: the same class, vocabulary, special tokens and encodings."""
    from transformers import AutoTokenizer

    from llmd.gpu.models.loader import load_tokenizer

    for name in ("llama", "llama3-rope"):
        path = str(hf_dirs(name))
        ours, reference = load_hf_config(path), AutoConfig.from_pretrained(path, local_files_only=True)
        assert isinstance(ours, LeanLlamaConfig) and isinstance(reference, LlamaConfig)
        assert ours.to_dict() == reference.to_dict()
        ours, reference = load_tokenizer(path), AutoTokenizer.from_pretrained(path, local_files_only=True)
        assert type(ours) is type(reference) and ours.get_vocab() == reference.get_vocab()
        assert ours.all_special_tokens == reference.all_special_tokens
        text = "Hello, world: a test of 12 tokens <|eos|>"
        assert ours(text).input_ids == reference(text).input_ids


def test_a_llama_model_loads_without_what_llamaconfigs_module_imports(hf_dirs, tmp_path):  # noqa: F811
    """In a fresh interpreter, as the daemon starts: llama GGUFs (packed Q8_0, and F32 with
    llama 3's rope scaling) and an HF llama directory load with their tokenizers, and none
    of HEAVY_MODULES is imported; importing LlamaConfig itself there imports them (the
    check can fail)."""
    models = [str(write_gguf(hf_dirs("llama"), tmp_path / "llama-q8.gguf", T.Q8_0)),
              str(write_gguf(hf_dirs("llama3-rope"), tmp_path / "llama3-f32.gguf")), str(hf_dirs("llama3-rope"))]
    code = ("import json, sys, torch\n"
            "from llmd.gpu.models.loader import load_model, load_tokenizer\n"
            f"for path in {models!r}:\n"
            "    load_tokenizer(path)\n"
            "    load_model(path, torch.float32, torch.device('cpu'), 64)\n"
            f"loaded = [m for m in {HEAVY_MODULES!r} if m in sys.modules]\n"
            "from transformers import LlamaConfig\n"
            f"print(json.dumps([loaded, [m for m in {HEAVY_MODULES!r} if m in sys.modules]]))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    loaded, after_llamaconfig = json.loads(out.stdout.strip().splitlines()[-1])
    assert loaded == []
    assert after_llamaconfig == list(HEAVY_MODULES)
