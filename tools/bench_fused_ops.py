"""CUDA only: each fused layer op (llmd.gpu.layers.fused_ops_triton) against its unfused torch
reference (llmd.gpu.layers.fused_ops), and one decoder layer's decode step with fusion on and
off, in bf16 at TinyLlama-1.1B's shapes (hidden 2048, 32 heads, 4 kv heads, head_dim 64,
intermediate 5632).

    python -m llmd_tools.bench_fused_ops [--batch 1 32] [--context 512] [--iters 200]
        [--rounds 5] [--json]

Timing: torch.cuda.Event around `--iters` back-to-back calls, the unfused and fused
variants taking turns for `--rounds` rounds, the median round reported (µs per call).
Two tables: eager calls (each kernel launched from Python, as without CUDA graphs) and
the same call captured once in a CUDA graph and replayed (the decode path on CUDA, where
launch overhead is gone and what is left is kernel time and the gaps between kernels).
Beside each op its floor: the bytes it must move (fused: each input read once, each
output written once; the layer: its weights and its rows' KV context) over the device's
measured copy bandwidth. The layer rows also count the CUDA kernels of one call (torch
profiler).

On CPU it refuses: the kernels are made for CUDA (tests/test_fused_ops.py checks them
for correctness under Triton's interpreter).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
from collections.abc import Callable

import torch

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER = 2048, 32, 4, 64, 5632
BLOCK_SIZE = 16
DTYPE = torch.bfloat16
WARMUP = 10


def _graphed(fn: Callable[[], object]) -> Callable[[], None]:
    """fn captured once in a CUDA graph (after warm-up calls on a side stream, which also
    compile the Triton kernels); returns the graph's replay."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def _us_per_call(fn: Callable[[], object], iters: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / iters


def time_variants(variants: dict[str, Callable[[], object]], iters: int, rounds: int, graphs: bool
                  ) -> dict[str, float]:
    """Median µs per call of each variant over `rounds` rounds, the variants taking turns."""
    calls = {name: _graphed(fn) if graphs else fn for name, fn in variants.items()}
    for fn in calls.values():
        for _ in range(WARMUP):
            fn()
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(rounds):
        for name, fn in calls.items():
            times[name].append(_us_per_call(fn, iters))
    return {name: statistics.median(values) for name, values in times.items()}


def count_kernels(fn: Callable[[], object]) -> int:
    """CUDA kernels (and memcpy/memset) one eager call of fn launches."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for event in prof.events() if event.device_type == torch.autograd.DeviceType.CUDA)


def _norm(dim: int, device: torch.device):
    from llmd.gpu.layers.norms import RMSNorm

    norm = RMSNorm(dim, 1e-5).to(device, DTYPE)
    with torch.no_grad():
        norm.weight.normal_(1.0, 0.1)
    return norm


def op_cases(batch: int, device: torch.device) -> dict[str, tuple[dict[str, Callable[[], object]], int]]:
    """op name -> ({"unfused": call, "fused": call}, bytes the fused op moves)."""
    from llmd.gpu.layers import fused_ops_triton as kernels
    from llmd.gpu.layers.attention import new_kv_cache
    from llmd.gpu.layers.fused_ops import UNFUSED, FusedLayerOps, attention_inputs_reference

    fused = FusedLayerOps()
    e = torch.empty((), dtype=DTYPE).element_size()
    norm = _norm(HIDDEN, device)
    x, residual = (torch.randn(batch, HIDDEN, device=device, dtype=DTYPE) for _ in range(2))
    gate_up = torch.randn(batch, 2 * INTER, device=device, dtype=DTYPE)
    qkv_width = (HEADS + 2 * KV_HEADS) * HEAD_DIM
    qkv = torch.randn(batch, qkv_width, device=device, dtype=DTYPE)
    angles = torch.rand(batch, 1, HEAD_DIM, device=device) * 6.28
    cos, sin = angles.cos().to(DTYPE), angles.sin().to(DTYPE)
    cache = new_kv_cache(batch + 1, BLOCK_SIZE, KV_HEADS, HEAD_DIM, DTYPE, device)
    slots = torch.arange(batch, device=device) * BLOCK_SIZE
    q_norm, k_norm = _norm(HEAD_DIM, device), _norm(HEAD_DIM, device)
    qk = (q_norm.weight, k_norm.weight, q_norm.eps, False)
    qkv_bytes = 2 * batch * qkv_width * e
    return {
        "residual add + RMSNorm": ({"unfused": lambda: UNFUSED.add_rms_norm(norm, x, residual),
                                    "fused": lambda: fused.add_rms_norm(norm, x, residual)},
                                   (4 * batch + 1) * HIDDEN * e),
        "RMSNorm": ({"unfused": lambda: UNFUSED.rms_norm(norm, x), "fused": lambda: fused.rms_norm(norm, x)},
                    (2 * batch + 1) * HIDDEN * e),
        "silu(gate) * up": ({"unfused": lambda: UNFUSED.act_and_mul(gate_up, "silu"),
                             "fused": lambda: fused.act_and_mul(gate_up, "silu")}, 3 * batch * INTER * e),
        "rotary + K/V write": ({"unfused": lambda: attention_inputs_reference(
                                    qkv, HEADS, KV_HEADS, HEAD_DIM, None, None, cos, sin, cache, slots),
                                "fused": lambda: kernels.qkv_rope_cache(
                                    qkv, HEADS, KV_HEADS, HEAD_DIM, cos, sin, cache, slots)}, qkv_bytes),
        "q/k norm + rotary + K/V write": ({"unfused": lambda: attention_inputs_reference(
                                               qkv, HEADS, KV_HEADS, HEAD_DIM, q_norm, k_norm, cos, sin, cache, slots),
                                           "fused": lambda: kernels.qkv_rope_cache(
                                               qkv, HEADS, KV_HEADS, HEAD_DIM, cos, sin, cache, slots, qk)},
                                          qkv_bytes),
    }


def layer_case(batch: int, context: int, device: torch.device) -> tuple[dict[str, Callable[[], object]], int]:
    """({"unfused": call, "fused": call}, bytes) of one Llama decoder layer's decode step
    over `batch` rows of `context` tokens each, Triton attention, the same weights."""
    from transformers import LlamaConfig

    from llmd.gpu.layers.attention import AttentionMetadata, new_kv_cache, set_decode_rows
    from llmd.gpu.layers.fused_ops import FUSED_OPS_ENV, layer_ops
    from llmd.gpu.layers.mlp import GatedMLP
    from llmd.gpu.models.architectures import ARCHITECTURES
    from llmd.gpu.models.decoder import DecoderLayer
    from llmd.gpu.layers.rotary import RotaryEmbedding

    config = LlamaConfig(hidden_size=HIDDEN, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                         head_dim=HEAD_DIM, intermediate_size=INTER, rms_norm_eps=1e-5, hidden_act="silu",
                         max_position_embeddings=max(4096, context))
    layers = {}
    saved = os.environ.get(FUSED_OPS_ENV)
    for name, setting in (("unfused", "0"), ("fused", "1")):
        os.environ[FUSED_OPS_ENV] = setting
        with torch.device(device):
            mlp = GatedMLP(HIDDEN, INTER, False, "silu", ops=layer_ops("triton"))
            layers[name] = DecoderLayer(ARCHITECTURES["LlamaForCausalLM"], config, mlp, None, "triton", None)
            layers[name] = layers[name].to(DTYPE).eval()
    if saved is None:
        del os.environ[FUSED_OPS_ENV]
    else:
        os.environ[FUSED_OPS_ENV] = saved
    layers["fused"].load_state_dict(layers["unfused"].state_dict())
    per_row = math.ceil(context / BLOCK_SIZE)
    tables = [list(range(b * per_row, (b + 1) * per_row)) for b in range(batch)]
    last = context - 1
    md = AttentionMetadata(slot_mapping=torch.tensor([t[last // BLOCK_SIZE] * BLOCK_SIZE + last % BLOCK_SIZE
                                                      for t in tables], device=device),
                           num_decodes=batch, decode_block_table=None, decode_seq_lens=None, prefills=[])
    set_decode_rows(md, tables, [context] * batch, device)
    layers["unfused"].self_attn.attn.metadata_builder([], BLOCK_SIZE, device).build(md)
    cache = new_kv_cache(batch * per_row, BLOCK_SIZE, KV_HEADS, HEAD_DIM, DTYPE, device)
    cos, sin = RotaryEmbedding(config, HEAD_DIM, config.max_position_embeddings).to(device).cos_sin(
        torch.full((batch,), last, device=device), DTYPE)
    hidden, residual = (torch.randn(batch, HIDDEN, device=device, dtype=DTYPE) for _ in range(2))
    weights = sum(p.numel() * p.element_size() for p in layers["unfused"].parameters())
    kv = batch * context * 2 * KV_HEADS * HEAD_DIM * DTYPE.itemsize

    def step(layer) -> Callable[[], object]:
        return lambda: layer(hidden, residual, cos, sin, cache, md)

    return {name: step(layer) for name, layer in layers.items()}, weights + kv


def run(args: argparse.Namespace) -> list[dict]:
    from llmd_tools.bench.roofline import device_bandwidth

    device = torch.device("cuda")
    bandwidth = device_bandwidth(device)
    rows = []
    with torch.no_grad():
        for batch in args.batch:
            cases = op_cases(batch, device)
            cases[f"decoder layer (context {args.context})"] = layer_case(batch, args.context, device)
            for name, (variants, moved) in cases.items():
                row = {"op": name, "batch": batch, "floor_us": moved / bandwidth * 1e6}
                for graphs in (False, True):
                    times = time_variants(variants, args.iters, args.rounds, graphs)
                    mode = "graph" if graphs else "eager"
                    row[f"{mode}_unfused_us"], row[f"{mode}_fused_us"] = times["unfused"], times["fused"]
                if name.startswith("decoder layer"):
                    row["kernels"] = {variant: count_kernels(fn) for variant, fn in variants.items()}
                rows.append(row)
    print(f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}, bf16, "
          f"measured copy bandwidth {bandwidth / 1e9:,.0f} GB/s")
    return rows


def print_table(rows: list[dict]) -> None:
    for mode in ("eager", "graph"):
        print(f"\n{mode} ({'Python launches' if mode == 'eager' else 'one CUDA graph replayed'}), µs per call:")
        print(f"{'op':<34}{'batch':>6}{'unfused':>10}{'fused':>10}{'speed-up':>10}{'floor':>9}  kernels")
        for row in rows:
            unfused, fused = row[f"{mode}_unfused_us"], row[f"{mode}_fused_us"]
            kernels = row.get("kernels")
            counts = f"{kernels['unfused']} -> {kernels['fused']}" if kernels else ""
            print(f"{row['op']:<34}{row['batch']:>6}{unfused:>10.1f}{fused:>10.1f}{unfused / fused:>9.2f}x"
                  f"{row['floor_us']:>9.1f}  {counts}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--context", type=int, default=512, help="tokens of context per row in the layer's step")
    ap.add_argument("--iters", type=int, default=200, help="calls per timed round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", action="store_true", help="print the rows as JSON after the tables")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench_fused_ops times the fused Triton kernels on a CUDA GPU and none is available here; "
                 "on CPU their correctness is checked by tests/test_fused_ops.py (Triton's interpreter)")
    rows = run(args)
    print_table(rows)
    if args.json:
        print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
