"""The CPU fast paths against their references: the C++ paged decode kernel
(cpu_kernels) against TorchAttention's gather-and-GEMM decode over sliding windows,
soft-caps, GQA groups, head and block sizes, block orders, batch sizes and every cache
dtype (float32, bfloat16, float16, fp8, int8); oneDNN-packed
linears (cpu_linear) against F.linear; and a model loaded on CPU takes both. The
kernel's tests skip when it cannot be built here (no C++ compiler or ninja); the
engine-level equality with transformers runs through the same path in
test_engine_vs_hf.py and test_models.py."""
from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from llmd.gpu.layers.attention import AttentionMetadata, GatherWorkspace, TorchAttention, set_decode_rows
from triton_attention_cases import attend
from llmd.gpu.layers.cpu.cpu_kernels import CPU_KERNELS_ENV, attach_cpu_kernels, paged_decode_op
from llmd.gpu.layers.kv_quant import KVScales, kv_cache_format, quantize
from llmd.gpu.layers.linear import LinearBase, ParallelLMHead
from llmd.gpu.layers.cpu.cpu_linear import (PackedLinearForward, checkpoint_weight, pack_linears, packing_supported,
                                           unpack_linears)
from llmd.gpu.models.loader import load_model

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def decode_kernel():
    op = paged_decode_op()
    if op is None:
        pytest.skip("llmd's CPU kernels cannot be built here (no C++ compiler or ninja)")
    return op


def _decode_case(seed: int, dtype: torch.dtype, batch: int, heads: int, kv_heads: int, head_dim: int,
                 block_size: int, max_len: int, shuffle: bool, seq_lens: list[int] | None = None):
    """A cache with `batch` requests' blocks (in order, or shuffled as after churn), their
    query rows and the decode metadata the runner would build; contexts `seq_lens`, else
    random up to max_len."""
    rng = random.Random(seed)
    if seq_lens is None:
        seq_lens = [rng.randint(1, max_len) for _ in range(batch)]
        seq_lens[0] = max_len  # one context that ends exactly where the longest does
        if batch > 1:
            seq_lens[1] = block_size  # one that fills its last block
    num_blocks = sum(-(-n // block_size) for n in seq_lens) + 3
    order = list(range(1, num_blocks))
    if shuffle:
        rng.shuffle(order)
    tables, used = [], 0
    for n in seq_lens:
        count = -(-n // block_size)
        tables.append(order[used:used + count])
        used += count
    gen = torch.Generator().manual_seed(seed)
    cache = torch.randn(2, kv_heads, num_blocks, block_size, head_dim, generator=gen).to(dtype)
    q = torch.randn(batch, heads, head_dim, generator=gen).to(dtype)
    md = AttentionMetadata(slot_mapping=torch.zeros(0, dtype=torch.int64), num_decodes=batch,
                           decode_block_table=None, decode_seq_lens=None, prefills=[], workspace=GatherWorkspace())
    set_decode_rows(md, tables, seq_lens, CPU)
    return q, cache, md


CASES = [  # heads, kv_heads, head_dim, block_size, max_len, window, softcap, shuffle
    (8, 4, 64, 16, 70, None, None, False),
    (8, 8, 64, 16, 33, None, None, True),  # no GQA
    (8, 1, 32, 8, 50, None, None, True),  # one kv head for all
    (6, 2, 80, 16, 90, 7, None, True),  # head size off the vector width, window
    (4, 2, 24, 4, 30, 1, 5.0, False),  # window of one token, soft-cap
    (8, 2, 64, 32, 100, 200, 30.0, True),  # window longer than every context
    (2, 2, 16, 1, 12, None, None, True),  # one token per block
]


@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size,max_len,window,softcap,shuffle", CASES)
def test_paged_decode_kernel_equals_the_torch_decode(decode_kernel, heads, kv_heads, head_dim, block_size, max_len,
                                                     window, softcap, shuffle):
    q, cache, md = _decode_case(0, torch.float32, 5, heads, kv_heads, head_dim, block_size, max_len, shuffle)
    attn = TorchAttention(heads, kv_heads, head_dim, head_dim ** -0.5, window, softcap)
    TorchAttention.metadata_builder([attn], cache.shape[3], CPU).build(md)  # its window's decode mask
    expected = attn._decode(q, cache, md)
    got = decode_kernel(q, cache, md.decode_block_table, md.decode_seq_lens, attn.scale, softcap or 0.0, window or 0)
    torch.testing.assert_close(got, expected, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 40])  # 40: rows off the 32-wide half-precision vector
def test_paged_decode_kernel_in_half_precision_is_float32_attention_rounded(decode_kernel, dtype, head_dim):
    """Half-precision caches: the kernel widens each row and keeps scores, softmax and
    sums in float32, so it matches float32 attention over the same values to the output's
    rounding."""
    q, cache, md = _decode_case(1, dtype, 6, 8, 2, head_dim, 16, 120, True)
    attn = TorchAttention(8, 2, head_dim, head_dim ** -0.5, 40, None)
    TorchAttention.metadata_builder([attn], cache.shape[3], CPU).build(md)  # its window's decode mask
    expected = attn._decode(q.float(), cache.float(), md)
    got = decode_kernel(q, cache, md.decode_block_table, md.decode_seq_lens, attn.scale, 0.0, 40)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), expected, atol=1e-2, rtol=1e-2)


# The kernel's tile math is compiled per row width (head_dim / vector width) and reads
# rows in tiles of 16 positions (8 with AVX2): the shapes of the models it serves and the
# paths it takes. Context lengths are random (most not a multiple of 16; one equals
# max_len, one block_size).
SHAPES = [  # heads, kv_heads, head_dim, block_size, max_len, window, softcap, batch
    (9, 3, 64, 16, 100, None, None, 32),  # SmolLM2-135M (group 3) at batch 32
    (4, 1, 256, 16, 70, None, None, 1),  # Gemma 3 270M (group 4, head 256) at batch 1
    (4, 1, 256, 16, 300, 37, 50.0, 3),  # its sliding layers: the window starts mid-block; soft-cap
    (8, 8, 128, 16, 47, None, None, 32),  # group 1, head 128
    (24, 3, 128, 32, 130, 45, None, 5),  # group 8, two tiles a block, the window starts mid-tile
    (16, 2, 64, 8, 90, None, 30.0, 4),  # blocks shorter than a tile: rows gathered from several
    (6, 2, 96, 16, 33, 20, None, 32),  # head 96: a width compiled for no model in particular
]
CACHE_DTYPES = ["float32", "bfloat16", "float16", "fp8", "int8"]


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size,max_len,window,softcap,batch", SHAPES)
def test_paged_decode_kernel_over_every_cache_dtype_and_shape(decode_kernel, cache_dtype, heads, kv_heads, head_dim,
                                                              block_size, max_len, window, softcap, batch):
    """Against TorchAttention's own decode (gather, dequantize, two GEMMs, softmax) on
    the same cache: float32 to float32's rounding; a quantized cache (float32 queries)
    through the torch dequantizer with the layer's scales; a half-precision cache to
    the output's rounding of float32 attention over its values."""
    fmt = kv_cache_format(cache_dtype) if cache_dtype in ("fp8", "int8") else None
    dtype = torch.float32 if fmt is not None else getattr(torch, cache_dtype)
    q, cache, md = _decode_case(11, dtype, batch, heads, kv_heads, head_dim, block_size, max_len, True)
    attn = TorchAttention(heads, kv_heads, head_dim, head_dim ** -0.5, window, softcap)
    TorchAttention.metadata_builder([attn], block_size, CPU).build(md)
    args = (md.decode_block_table, md.decode_seq_lens, attn.scale, softcap or 0.0, window or 0)
    if fmt is not None:
        attn.kv_scales = KVScales(0.03, 0.02)
        cache = torch.stack([quantize(cache[0], fmt, attn.kv_scales.k_inv), quantize(cache[1], fmt, attn.kv_scales.v_inv)])
        expected = attn._decode(q, cache, md)
        got = decode_kernel(q, cache, *args, attn.kv_scales.k, attn.kv_scales.v)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    elif dtype == torch.float32:
        torch.testing.assert_close(decode_kernel(q, cache, *args), attn._decode(q, cache, md), atol=2e-6, rtol=1e-5)
    else:
        got = decode_kernel(q, cache, *args)
        assert got.dtype == dtype
        torch.testing.assert_close(got.float(), attn._decode(q.float(), cache.float(), md), atol=1e-2, rtol=1e-2)


def test_paged_decode_kernel_splits_a_lopsided_batch_between_threads(decode_kernel):
    """The threads take runs of requests of about equal rows: one long context among
    one-token ones (a run of one request, runs of many, runs with none) decodes as the
    torch path does, with 2 and 4 threads."""
    seq_lens = [1] * 20 + [700] + [3] * 11
    q, cache, md = _decode_case(12, torch.float32, 32, 8, 2, 64, 16, 700, True, seq_lens)
    attn = TorchAttention(8, 2, 64, 0.125)
    TorchAttention.metadata_builder([attn], 16, CPU).build(md)
    expected = attn._decode(q, cache, md)
    threads = torch.get_num_threads()
    try:
        for n in (2, 4):
            torch.set_num_threads(n)
            got = decode_kernel(q, cache, md.decode_block_table, md.decode_seq_lens, 0.125, 0.0, 0)
            torch.testing.assert_close(got, expected, atol=2e-6, rtol=1e-5)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype,window,block_size,cache_format", [
    (torch.float32, 0, 16, None), (torch.float32, 601, 16, None), (torch.bfloat16, 0, 16, None),
    (torch.float32, 0, 1, None),  # rows gathered a block of one at a time
    (torch.float32, 300, 16, "int8"),  # a quantized cache, rows widened
])
def test_paged_decode_kernel_gives_a_long_context_the_same_bits_in_any_split(decode_kernel, dtype, window,
                                                                            block_size, cache_format):
    """Contexts longer than a chunk (256 rows) are softmaxed in chunks joined in order: a
    request alone (one kv head, its chunks shared by the threads), at 1, 2 and 4 threads,
    and the same request in a batch beside others, gets the same bits, and the torch
    decode's values (a window that starts mid-block: chunks from its first row)."""
    seq_lens = [3, 1000, 40, 700, 257]
    q, cache, md = _decode_case(13, dtype, len(seq_lens), 4, 1, 64, block_size, 1000, True, seq_lens)
    attn = TorchAttention(4, 1, 64, 0.125, window or None)
    TorchAttention.metadata_builder([attn], block_size, CPU).build(md)
    scales = ()
    if cache_format is not None:
        attn.kv_scales = KVScales(0.03, 0.02)
        cache = torch.stack([quantize(cache[0], kv_cache_format(cache_format), attn.kv_scales.k_inv),
                             quantize(cache[1], kv_cache_format(cache_format), attn.kv_scales.v_inv)])
        scales = (attn.kv_scales.k, attn.kv_scales.v)
        expected = attn._decode(q, cache, md)
    else:
        expected = attn._decode(q.float(), cache.float(), md)
    table, lens = md.decode_block_table, md.decode_seq_lens
    threads = torch.get_num_threads()
    try:
        outs = {}
        for n in (1, 2, 4):
            torch.set_num_threads(n)
            outs[n] = decode_kernel(q, cache, table, lens, 0.125, 0.0, window, *scales)
            for i in (1, 3, 4):  # alone: the threads share its chunks
                alone = decode_kernel(q[i:i + 1], cache, table[i:i + 1], lens[i:i + 1], 0.125, 0.0, window, *scales)
                assert torch.equal(alone[0], outs[n][i]), (n, i)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outs[1], outs[2]) and torch.equal(outs[1], outs[4])
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5 if cache_format else 2e-6
    torch.testing.assert_close(outs[1].float(), expected, atol=tol, rtol=tol * 5)


def test_torch_attention_decodes_through_the_kernel_it_was_given(decode_kernel):
    """The layer's own call (cache write, decode rows through the kernel) equals its
    torch path for the same step."""
    q, cache, md = _decode_case(2, torch.float32, 4, 8, 4, 32, 16, 60, True)
    md.slot_mapping = torch.tensor([7, 19, 33, 40], dtype=torch.int64)
    k = torch.randn(4, 4, 32)
    v = torch.randn(4, 4, 32)
    plain = TorchAttention(8, 4, 32, 32 ** -0.5)
    fast = TorchAttention(8, 4, 32, 32 ** -0.5)
    fast.decode_kernel = decode_kernel
    expected = attend(plain, q, k, v, cache.clone(), md)
    torch.testing.assert_close(attend(fast, q, k, v, cache.clone(), md), expected, atol=2e-6, rtol=1e-5)


def test_paged_decode_kernel_refuses_mismatched_inputs(decode_kernel):
    q, cache, md = _decode_case(3, torch.float32, 2, 4, 2, 16, 16, 20, False)
    with pytest.raises(RuntimeError, match="head sizes"):
        decode_kernel(q[..., :8].contiguous(), cache, md.decode_block_table, md.decode_seq_lens, 0.25, 0.0, 0)
    with pytest.raises(RuntimeError, match="int64"):
        decode_kernel(q, cache, md.decode_block_table.int(), md.decode_seq_lens, 0.25, 0.0, 0)
    # A context past its table's blocks, an empty one, a block the cache does not have:
    # refused by name, not read out of bounds.
    capacity = md.decode_block_table.shape[1] * cache.shape[3]
    for lens, table, name in [(md.decode_seq_lens + capacity, md.decode_block_table, r"seq_lens\[0\]"),
                              (md.decode_seq_lens * 0, md.decode_block_table, r"seq_lens\[0\]"),
                              (md.decode_seq_lens, md.decode_block_table + cache.shape[2], r"block_table\[0, 0\]")]:
        with pytest.raises(RuntimeError, match=name):
            decode_kernel(q, cache, table.contiguous(), lens.contiguous(), 0.25, 0.0, 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_equals_f_linear(dtype, bias):
    if not packing_supported(dtype):
        pytest.skip(f"oneDNN does not pack {dtype} linears on this CPU")
    torch.manual_seed(0)
    linear = nn.Linear(96, 200, bias=bias).to(dtype)
    model = nn.Sequential(linear)
    assert pack_linears(model) == 1
    assert isinstance(linear.forward, PackedLinearForward)
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    for rows in (1, 5, 64):
        x = torch.randn(rows, 96).to(dtype)
        torch.testing.assert_close(linear(x), F.linear(x, linear.weight, linear.bias), **tol)
    x3 = torch.randn(2, 3, 96).to(dtype)
    torch.testing.assert_close(linear(x3), F.linear(x3, linear.weight, linear.bias), **tol)
    assert linear(torch.zeros(0, 96, dtype=dtype)).shape == (0, 200)
    unpack_linears(model)
    assert "forward" not in linear.__dict__


def test_packed_linear_rows_do_not_depend_on_the_batch():
    """A row's output is the same whatever other rows share the call (decode rows give
    the same logits alone or batched)."""
    if not packing_supported(torch.float32):
        pytest.skip("oneDNN is not available")
    torch.manual_seed(1)
    linear = nn.Linear(256, 512, bias=False)
    pack_linears(linear)
    x = torch.randn(48, 256)
    full = linear(x)
    for rows in (1, 3, 17):
        assert torch.equal(linear(x[:rows]), full[:rows])


def test_a_packed_linear_sees_its_weight_change():
    """A weight replaced on the module, or written in place under no_grad, is packed again
    (the tests that mutate a loaded model's weights rely on it)."""
    torch.manual_seed(2)
    linear = nn.Linear(16, 8)
    pack_linears(linear)
    x = torch.randn(3, 16)
    linear(x)
    linear.weight = nn.Parameter(torch.randn(8, 16))
    torch.testing.assert_close(linear(x), F.linear(x, linear.weight, linear.bias))
    with torch.no_grad():
        linear.weight.mul_(-2)
        linear.bias.zero_()
    torch.testing.assert_close(linear(x), F.linear(x, linear.weight, linear.bias))


def test_pack_linears_leaves_subclasses_alone():
    class Sharded(nn.Linear):
        pass

    model = nn.Sequential(nn.Linear(8, 8), Sharded(8, 8))
    assert pack_linears(model) == (1 if packing_supported(torch.float32) else 0)
    assert "forward" not in model[1].__dict__


@pytest.mark.skipif(not packing_supported(torch.float32), reason="oneDNN packs nothing on this CPU")
@pytest.mark.parametrize("tied", [False, True])
def test_packed_model_linears_hold_their_weights_once(tiny_llama, tiny_llama_tied, tied):
    """A loaded CPU model's linears keep only oneDNN's layout (their `weight` emptied),
    from which checkpoint_weight gives the checkpoint's values back exactly; a tied LM
    head keeps the embedding's table, which lookups read; unpack_linears restores every
    plain weight and F.linear then gives the same logits."""
    from safetensors.torch import load_file

    path = tiny_llama_tied if tied else tiny_llama
    model = load_model(path, torch.float32, CPU, 128)
    saved = {k.removeprefix("model."): v for f in sorted(path.glob("*.safetensors")) for k, v in load_file(f).items()}
    layer = model.layers[0]
    q, k, v = (saved[f"layers.0.self_attn.{n}_proj.weight"] for n in "qkv")
    for module, expected in ((layer.self_attn.qkv_proj, torch.cat([q, k, v])),
                             (layer.mlp.down_proj, saved["layers.0.mlp.down_proj.weight"])):
        assert module.weight.numel() == 0 and module.kernel.released_shape == expected.shape
        assert torch.equal(checkpoint_weight(module), expected)
    head = model.lm_head
    if tied:
        assert head.weight is model.embed_tokens.weight and head.kernel.released_shape is None
        assert torch.equal(model.embed_tokens.weight, saved["embed_tokens.weight"])
    else:
        assert head.weight.numel() == 0 and torch.equal(checkpoint_weight(head), saved["lm_head.weight"])
    hidden = torch.randn(3, model.lm_head.in_features, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        packed_out = layer.mlp.down_proj(torch.randn(3, layer.mlp.down_proj.in_features,
                                                     generator=torch.Generator().manual_seed(1)))
        logits = model.lm_head(hidden)
        unpack_linears(model)
        assert layer.mlp.down_proj.kernel is None
        assert torch.equal(layer.mlp.down_proj.weight, saved["layers.0.mlp.down_proj.weight"])
        torch.testing.assert_close(model.lm_head(hidden), logits, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(layer.mlp.down_proj(torch.randn(3, layer.mlp.down_proj.in_features,
                                                                   generator=torch.Generator().manual_seed(1))),
                                   packed_out, rtol=1e-5, atol=1e-5)


def test_a_cpu_model_loads_with_packed_linears_and_the_decode_kernel(tiny_llama, monkeypatch):
    model = load_model(tiny_llama, torch.float32, CPU, 128)
    attn = [layer.self_attn.attn for layer in model.layers]
    linears = [m for m in model.modules() if isinstance(m, (LinearBase, ParallelLMHead))]
    assert len(linears) == 1 + 4 * len(model.layers)  # the LM head; each layer's qkv, o, gate_up, down
    if packing_supported(torch.float32):
        assert all(isinstance(m.kernel, PackedLinearForward) for m in linears)
    if paged_decode_op() is not None:
        assert all(a.decode_kernel is paged_decode_op() for a in attn)
    monkeypatch.setenv(CPU_KERNELS_ENV, "0")
    plain = load_model(tiny_llama, torch.float32, CPU, 128)
    assert all(layer.self_attn.attn.decode_kernel is None for layer in plain.layers)
    assert attach_cpu_kernels(plain) == 0
    monkeypatch.setenv(CPU_KERNELS_ENV, "maybe")
    with pytest.raises(ValueError, match=CPU_KERNELS_ENV):
        load_model(tiny_llama, torch.float32, CPU, 128)
