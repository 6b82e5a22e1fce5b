"""On CPU a GatedMLP takes a prefill's rows in chunks whose gate/up output stays under
mlp.MLP_CHUNK_BYTES (below glibc's largest mmap threshold: a larger output is mapped and
faulted in afresh on every allocation). Chunked, the layer must compute what it computes
on all the rows at once: against down(silu(gate) * up) by hand in float64, and a packed
GGUF model's tokens and logprobs unchanged (its x16 products take each row on its own, so
exactly so)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as T

from gguf_fixtures import write_gguf
from llmd import LLM, SamplingParams
from llmd.gpu.layers import mlp as mlp_module
from llmd.gpu.layers.mlp import GatedMLP
from test_gguf import SETTINGS, hf_dirs  # noqa: F401


def _random_mlp(hidden: int, size: int, bias: bool) -> GatedMLP:
    torch.manual_seed(0)
    layer = GatedMLP(hidden, size, bias, "silu")
    for p in layer.parameters():
        p.data.normal_(0, 0.2)
    return layer


@pytest.mark.parametrize("bias", [False, True])
def test_a_chunked_mlp_computes_what_it_computes_on_all_rows(monkeypatch, bias):
    hidden, size = 32, 48
    layer = _random_mlp(hidden, size, bias)
    x = torch.randn(3, 7, hidden)  # 21 rows: four chunks of 5, and one
    w1, w2 = layer.gate_up_proj.weight.double(), layer.down_proj.weight.double()
    gate_up = F.linear(x.double(), w1, layer.gate_up_proj.bias.double() if bias else None)
    reference = F.linear(F.silu(gate_up[..., :size]) * gate_up[..., size:], w2,
                         layer.down_proj.bias.double() if bias else None)
    whole = layer(x)
    monkeypatch.setattr(mlp_module, "MLP_CHUNK_BYTES", 5 * 2 * size * 4)
    calls = []
    inner = layer._mlp
    monkeypatch.setattr(layer, "_mlp", lambda rows: calls.append(rows.shape[0]) or inner(rows))
    chunked = layer(x)
    assert calls == [5, 5, 5, 5, 1]
    assert chunked.shape == whole.shape == (3, 7, hidden)
    torch.testing.assert_close(chunked.double(), reference, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(chunked, whole, rtol=1e-6, atol=1e-6)
    calls.clear()
    torch.testing.assert_close(layer(x[:1, :5]), whole[:1, :5], rtol=1e-6, atol=1e-6)
    assert len(calls) == 1  # rows that fit a chunk: the layer as it was, in one call


def test_a_packed_model_gives_the_same_tokens_and_logprobs_chunked(hf_dirs, tmp_path, monkeypatch):  # noqa: F811
    """A prefill of 40 rows through the packed K-quant layers (x16 products, one row at a
    time within a tile) in chunks of 3 rows: the same tokens, logprobs equal to the bit."""
    path = write_gguf(hf_dirs("llama-256"), tmp_path / "llama-256.gguf", k_quant_types=(T.Q4_K, T.Q6_K))
    llm = LLM(str(path), **SETTINGS)
    mlp = llm.engine.executor.runner.model.layers[0].mlp
    prompts = [list(range(3, 43)), list(range(50, 71))]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=5)

    def run():
        return [(o.outputs[0].token_ids, [{t: lp.logprob for t, lp in pos.items()} for pos in o.outputs[0].logprobs])
                for o in llm.generate(prompts, params)]

    whole = run()
    monkeypatch.setattr(mlp_module, "MLP_CHUNK_BYTES", 3 * mlp.gate_up_proj.out_features * 4)
    calls = []
    inner = type(mlp)._mlp
    monkeypatch.setattr(type(mlp), "_mlp", lambda self, rows: calls.append(rows.shape[0]) or inner(self, rows))
    chunked = run()
    assert max(calls) == 3 and len(calls) > 2 * len(llm.engine.executor.runner.model.layers)
    assert chunked == whole
