"""The cases tests/test_moe.py checks for moe_align_triton's one-launch work list: its
three tensors equal, integer for integer, those of moe_align's torch ops (the path every
CPU run and large batch takes) on the same routing — one token, experts that get no
pair, every pair to one expert, an expert count that is not a power of two, chunks of
pairs with a tail, row blocks of 16 and 64, int32 ids.

Run in a fresh process, in Triton's interpreter on CPU or compiled on a GPU (kernel_runs.py):

    TRITON_INTERPRET=1 python tests/moe_align_cases.py [CASE ...] [--device cuda]

prints one JSON line per case: {"case", "equal", "sizes"} or {"case", "error"}.
Importing this module (for the case names) does not import triton.
"""
from __future__ import annotations

import json
import sys
import traceback

import torch

# name -> (tokens, top_k, experts, block size, load: relative chance per expert or None, ids dtype)
CASES = {
    "one-token-top8": (1, 8, 64, 16, None, torch.int64),
    "skewed-empty-experts": (37, 2, 8, 16, (8.0, 0.0, 1.0, 4.0, 0.0, 0.0, 0.5, 0.0), torch.int64),
    "one-expert-takes-all": (21, 1, 8, 16, (0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0), torch.int64),
    "odd-experts-int32": (13, 3, 5, 16, None, torch.int32),
    "chunk-tail-block-64": (45, 4, 60, 64, None, torch.int64),
    "decode-32-top8-128-experts": (32, 8, 128, 16, None, torch.int64),
}


def routing(tokens: int, top_k: int, experts: int, load, dtype, device: torch.device) -> torch.Tensor:
    """[tokens, top_k] distinct experts a token, drawn by `load` (uniform where None)."""
    gen = torch.Generator().manual_seed(tokens * 1000 + experts)
    weights = torch.tensor(load if load is not None else [1.0] * experts)
    picks = [torch.multinomial(weights, top_k, replacement=False, generator=gen) for _ in range(tokens)]
    return torch.stack(picks).to(dtype).to(device)


def run(name: str, device: torch.device) -> dict:
    from llmd.gpu.layers.moe_align import moe_align_block_size

    tokens, top_k, experts, block, load, dtype = CASES[name]
    ids = routing(tokens, top_k, experts, load, dtype, device)
    want = moe_align_block_size(ids.long(), block, experts, use_triton=False)
    got = moe_align_block_size(ids, block, experts, use_triton=True)
    equal = all(g.dtype == w.dtype and torch.equal(g.cpu(), w.cpu()) for g, w in zip(got, want))
    return {"case": name, "equal": equal, "sizes": [g.numel() for g in got]}


def main(args: list[str]) -> None:
    from kernel_runs import script_device

    device = script_device(args)
    for name in args or list(CASES):
        try:
            print(json.dumps(run(name, device)), flush=True)
        except Exception:  # noqa: BLE001 - reported per case, the test fails on it
            print(json.dumps({"case": name, "error": traceback.format_exc()[-3000:]}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
