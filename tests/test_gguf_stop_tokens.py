"""The ids a GGUF model stops generating on besides EOS, as llama.cpp's vocabulary sets
them: the metadata's end-of-turn, end-of-message and FIM separator ids, and every token
whose text ends a turn, a message or a text in the chat formats llama.cpp knows
(`<end_of_turn>`, `<|end|>`, `<|eot_id|>`, `<|im_end|>`, `<|endoftext|>`, ...): converters
often write none of those ids (Gemma's and Phi-3's files name only EOS), so a chat would
run past the end of its turn."""
from __future__ import annotations

from pathlib import Path

import numpy as np

import gguf
from gguf_fixtures import write_gguf, written
from llmd import LLM, SamplingParams
from llmd.gpu.models.gguf_tokenizer import EOG_TEXTS
from llmd.gpu.models.loader import stop_token_ids
from tiny_models import tiny_models

VOCAB = ["<unk>", "<eos>", "a", "<end_of_turn>", "end_of_turn", "<|end|>", "<|END|>", "<|eot_id|>", "b",
         "<|im_end|>", "<|endoftext|>", "<|eom_id|>", "<|end_of_text|>", "<EOT>", "<end_of_utterance>", "<|fim_pad|>",
         "<|return|>", "c", "<|im_start|>"]
PROMPT = [5, 9, 200, 31, 17]


def _vocabulary_gguf(path: Path, **ids: int) -> Path:
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("gpt2")
    w.add_token_list(VOCAB)
    w.add_eos_token_id(1)
    for key, value in ids.items():
        w.add_uint32(f"tokenizer.ggml.{key}", value)
    w.add_tensor("token_embd.weight", np.zeros((len(VOCAB), 8), dtype=np.float32))
    return written(w, path)


def test_end_of_generation_tokens_by_text_and_by_id(tmp_path):
    by_text = {i for i, text in enumerate(VOCAB) if text in EOG_TEXTS}
    assert {VOCAB[i] for i in by_text} == {"<end_of_turn>", "<|end|>", "<|eot_id|>", "<|im_end|>", "<|endoftext|>",
                                           "<|eom_id|>", "<|end_of_text|>", "<EOT>", "<end_of_utterance>", "<|return|>"}
    assert stop_token_ids(_vocabulary_gguf(tmp_path / "text.gguf")) == by_text  # lookalikes are not ends
    named = _vocabulary_gguf(tmp_path / "ids.gguf", eot_token_id=2, fim_pad_token_id=15, fim_sep_token_id=17)
    assert stop_token_ids(named) == by_text | {2, 15, 17}


def test_a_request_ends_on_them_unless_it_ignores_eos(tmp_path):
    """The tiny llama's greedy run, then the same file naming one of its tokens a FIM
    separator: the run ends there (finish "stop"), and runs on with ignore_eos."""
    hf = tiny_models(tmp_path, {"llama": dict(arch="llama", llama3_rope=False, intermediate_size=192)})("llama")
    settings = dict(device="cpu", dtype="float32", num_gpu_blocks_override=32, max_model_len=128)
    greedy = SamplingParams(temperature=0, max_tokens=8)
    free = LLM(model=str(write_gguf(hf, tmp_path / "free.gguf")), **settings).generate([PROMPT], greedy)[0].outputs[0]
    k = next(i for i in range(1, 8) if free.token_ids[i] not in free.token_ids[:i])
    marked = write_gguf(hf, tmp_path / "marked.gguf", extra_metadata={
        "tokenizer.ggml.fim_sep_token_id": (free.token_ids[k], gguf.GGUFValueType.UINT32)})
    llm = LLM(model=str(marked), **settings)
    stopped, ignored = (out.outputs[0] for out in llm.generate(
        [PROMPT, PROMPT], [greedy, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)]))
    assert free.finish_reason == "length" and stopped.finish_reason == "stop"
    assert stopped.token_ids == free.token_ids[:k + 1] and ignored.token_ids == free.token_ids


def test_the_builtin_model_stops_where_llama_cpp_does(builtin_gguf):
    """SmolLM2's file names <|im_end|> its EOS; llama.cpp also ends on <|endoftext|> (id 0)."""
    assert stop_token_ids(builtin_gguf) == {0, 2}


def test_gemma3_stops_at_the_end_of_its_turn(gemma3_270m):
    """Gemma 3's file names <eos> its EOS and no end of turn: <end_of_turn> (106) by text."""
    assert stop_token_ids(gemma3_270m) == {106}
