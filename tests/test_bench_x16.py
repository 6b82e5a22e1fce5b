"""tools/bench_x16.py --stream: the 1B fixture's layer set (the shapes and types of
llama.cpp's Q4_K_M mix for Llama 3.2 1B) and a run of it, at tiny shapes, that times every
ISA this CPU runs at every pass count beside torch.sum."""
from __future__ import annotations

import pytest

from llmd.gpu.layers.cpu.cpu_kernels import gguf_ops
from llmd.gpu.layers.gguf_formats import FORMATS
from llmd_tools import bench_x16


def test_the_layer_set_is_the_1b_q4_k_m_mix():
    shapes = bench_x16.stream_shapes(16)
    assert len(shapes) == 16 * 7 + 1 and shapes[-1] == ("Q6_K", 128256, 2048)
    assert sum(n * k for _, n, k in shapes) == 1_235_814_400 - 2048 * 33  # every parameter but the 33 norms
    q6k = [(n, k) for quant, n, k in shapes if quant == "Q6_K"]
    assert len(q6k) == 8 * 2 + 1  # attn_v and ffn_down of every other layer, and the LM head
    size = sum(n * k // FORMATS[q].block * FORMATS[q].block_bytes for q, n, k in shapes)
    assert 760 << 20 < size < 766 << 20  # the 763 MiB the benchmark streams


def test_a_stream_run_times_every_isa_and_pass_count(monkeypatch, capsys):
    ops = gguf_ops()
    if ops is None or not ops.x16:
        pytest.skip("no x16 product here")
    monkeypatch.setattr(bench_x16, "stream_shapes", lambda layers: [("Q4_K", 32, 256), ("Q6_K", 16, 512)] * layers)
    assert bench_x16.main(["--stream", "--layers", "2", "--rounds", "1", "--passes", "1", "2", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert "torch.sum" in out
    for isa in ops.x16_isas:
        for passes in (1, 2):
            assert f"{isa} {passes}p 1 rows" in out
