"""Decode speed of a mixture-of-experts model: llmd on the MoE model, llmd on the dense
model with the same active parameters, and HF transformers `generate` on both, in one
process on the same prompts.

    python -m llmd_tools.bench_moe [--moe small-qwen3-moe] [--dense small-qwen3-active]
        [--dtype float32] [--batch 1 16] [--new-tokens 64] [--device cpu] [--json]

The default pair (llmd_tools.make_model): `small-qwen3-moe` is the small Qwen3 preset
with 8 experts of intermediate size 176 per layer, 2 per token; `small-qwen3-active` is
the small Qwen3 with a dense MLP of 352, i.e. the MoE model's active parameters (the
router aside). With a perfect MoE kernel the two decode at the same speed (at batch 1:
the same weight bytes read per token); the gap is the cost of routing. At larger batches
the MoE model reads more of its experts per step (the batch's tokens pick different
ones), so it is expected to fall behind.

Decode tok/s = batch x (N - 1) / (time of N new tokens - time of 1 new token): the
prompt's prefill and the first token cancel out, for llmd (LLM.generate) and HF
(`generate`, left-padded batches, min_new_tokens = max_new_tokens) alike.
"""
from __future__ import annotations

import argparse
import json
import os
import time

import psutil
import torch

from llmd import LLM, SamplingParams
from llmd_tools.bench.workloads import make_prompts
from llmd_tools.make_model import fixture_path

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
PROMPT_LEN = 32


def active_params(model_dir: str) -> tuple[int, int]:
    """(total, active per token) parameters of a checkpoint's config: a sparse layer
    runs top_k of its experts (the router and shared expert always)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        total = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
    if not experts:
        return total, total
    size = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
    per_expert = 3 * config.hidden_size * size
    skip = set(getattr(config, "mlp_only_layers", None) or [])
    step = getattr(config, "decoder_sparse_step", 1) or 1
    sparse = sum(1 for i in range(config.num_hidden_layers) if i not in skip and (i + 1) % step == 0)
    return total, total - sparse * (experts - config.num_experts_per_tok) * per_expert


def llmd_decode(model: str, dtype: str, device: str, prompts: list[list[int]], batch: int, new_tokens: int) -> dict:
    llm = LLM(model=model, dtype=dtype, device=device, max_num_seqs=batch, max_model_len=256,
              max_num_batched_tokens=max(512, PROMPT_LEN * batch), kv_cache_memory_bytes=1 << 28,
              enable_prefix_caching=False)
    # Warm-up at the batch's own size: its prefill and decode steps are the shapes timed,
    # so the kernels they pick (the Triton MoE kernel's tiles for that many token-expert
    # pairs) are compiled here, not inside timed(1) (on an H100 that compile made the
    # 1-token run outlast the 64-token one: a negative decode rate).
    llm.generate(prompts[:batch], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))

    def timed(tokens: int) -> float:
        params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
        start = time.perf_counter()
        for i in range(0, len(prompts), batch):
            outs = llm.generate(prompts[i:i + batch], params)
            assert all(len(o.outputs[0].token_ids) == tokens for o in outs)
        return time.perf_counter() - start

    return _decode_rate(timed(1), timed(new_tokens), len(prompts), new_tokens)


def hf_decode(model: str, dtype: str, device: str, prompts: list[list[int]], batch: int, new_tokens: int) -> dict:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=DTYPES[dtype]).to(device).eval()
    pad = hf.config.pad_token_id if hf.config.pad_token_id is not None else 0

    def timed(tokens: int) -> float:
        start = time.perf_counter()
        for i in range(0, len(prompts), batch):
            chunk = prompts[i:i + batch]
            width = max(len(p) for p in chunk)
            ids = torch.tensor([[pad] * (width - len(p)) + p for p in chunk], device=device)
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk], device=device)
            with torch.inference_mode():
                hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=tokens, min_new_tokens=tokens,
                            do_sample=False, pad_token_id=pad)
        return time.perf_counter() - start

    timed(2)  # warm-up
    return _decode_rate(timed(1), timed(new_tokens), len(prompts), new_tokens)


def _decode_rate(one: float, full: float, num_prompts: int, new_tokens: int) -> dict:
    decode_s = full - one
    return {"prefill_and_first_s": one, "total_s": full, "decode_tok_s": num_prompts * (new_tokens - 1) / decode_s}


def run(args: argparse.Namespace) -> dict:
    models = {role: name if os.path.isdir(name) else str(fixture_path(name))
              for role, name in (("moe", args.moe), ("dense", args.dense))}
    params = {role: active_params(path) for role, path in models.items()}
    meta = {"models": models, "params": params, "torch_threads": torch.get_num_threads(),
            "loadavg_before": os.getloadavg()[0], "cpu_percent_before": psutil.cpu_percent(interval=0.5)}
    rows = []
    for dtype in args.dtype:
        for batch in args.batch:
            prompts = make_prompts(max(batch, args.min_prompts), PROMPT_LEN, PROMPT_LEN, 1000, seed=0)
            row = {"dtype": dtype, "batch": batch, "prompts": len(prompts)}
            for role, path in models.items():
                row[f"llmd_{role}"] = llmd_decode(path, dtype, args.device, prompts, batch, args.new_tokens)
                if not args.no_hf:
                    row[f"hf_{role}"] = hf_decode(path, dtype, args.device, prompts, batch, args.new_tokens)
            rows.append(row)
    meta["loadavg_after"] = os.getloadavg()[0]
    return {"meta": meta, "rows": rows}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--moe", default="small-qwen3-moe", help="fixture name or model directory")
    ap.add_argument("--dense", default="small-qwen3-active", help="the dense model with the MoE's active parameters")
    ap.add_argument("--dtype", nargs="+", default=["float32"])
    ap.add_argument("--batch", nargs="+", type=int, default=[1, 16])
    ap.add_argument("--min-prompts", type=int, default=2, help="batch 1 runs this many prompts one at a time")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    result = run(args)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    meta = result["meta"]
    for role, (total, active) in meta["params"].items():
        print(f"{role:5}: {meta['models'][role]}  {total / 1e6:.1f}M params, {active / 1e6:.1f}M active per token")
    print(f"torch threads {meta['torch_threads']}; load avg {meta['loadavg_before']:.2f} before, "
          f"{meta['loadavg_after']:.2f} after; other CPU use before {meta['cpu_percent_before']:.0f}%")
    print(f"{'dtype':9} {'batch':>5} {'llmd MoE':>9} {'llmd dense':>10} {'HF MoE':>8} {'HF dense':>8} "
          f"{'MoE/dense':>9} {'llmd/HF MoE':>11}   (decode tok/s)")
    for r in result["rows"]:
        moe, dense = r["llmd_moe"]["decode_tok_s"], r["llmd_dense"]["decode_tok_s"]
        hf_moe = r.get("hf_moe", {}).get("decode_tok_s")
        hf_dense = r.get("hf_dense", {}).get("decode_tok_s")
        hf = f"{hf_moe:8.1f} {hf_dense:8.1f}" if hf_moe else f"{'-':>8} {'-':>8}"
        vs_hf = f"{moe / hf_moe:11.2f}" if hf_moe else f"{'-':>11}"
        print(f"{r['dtype']:9} {r['batch']:>5} {moe:9.1f} {dense:10.1f} {hf} {moe / dense:9.2f} {vs_hf}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
