"""Input preparation per decode step (issue 26): the host work between the scheduler's
diff arriving at the worker and the forward starting — the diff applied to the worker's
batch, the step's rows (ids, positions, slots, block tables, context lengths) as device
tensors, and the sampling metadata of the rows that sample. No model runs: the work is
the same whatever the model, and the forward would drown it.

A steady decode: `batch` requests of `context` tokens each (their blocks allocated as a
scheduler would), every step one token more per request, a new block every block_size
steps. Median and p90 over `steps` steps, per batch size, in milliseconds.

    python -m llmd_tools.bench_input_prep [--batch 1 64 256] [--context 1024] [--penalties] [--mask]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from llmd.core.step_messages import CachedRequestData, NewRequestData, SchedulerOutput
from llmd.gpu.layers.attention import GatherWorkspace, MetadataBuilder, TorchMetadataBuilder
from llmd.gpu.sample.sampler import Sampler
from llmd.gpu.worker.input_batch import InputBatch
from llmd.gpu.worker.runner_types import RunnerSettings
from llmd.gpu.worker.sampling_step import SamplingStep
from llmd_client.protocol import SamplingParams

VOCAB = 32000


def _params(penalties: bool) -> SamplingParams:
    if penalties:
        return SamplingParams(temperature=0.8, top_p=0.95, repetition_penalty=1.1, frequency_penalty=0.2,
                              max_tokens=100_000)
    return SamplingParams(temperature=0.8, top_p=0.95, max_tokens=100_000)


def _prepare(batch: InputBatch, sampling: SamplingStep, so: SchedulerOutput, device: torch.device) -> list:
    """What a worker does with one decode step's diff before the forward (CPU: the
    eager path; a CUDA graph step stages the same host rows) and before sampling (the
    sampling metadata). Returns the rows that sample."""
    batch.apply(so)
    rows = batch.prepare(so, None)
    batch.eager_inputs(rows)
    sampling._metadata(so, rows.decodes, device)
    return rows.decodes


def measure(num_reqs: int, context: int, steps: int, block_size: int, penalties: bool,
            device: torch.device, decode_mask: bool = False) -> list[float]:
    """Seconds of input preparation for each of `steps` steady decode steps."""
    # CPU: the C++ decode kernel reads no mask (where it cannot be built, the gather path
    # would need one: --mask measures that).
    batch = InputBatch(block_size, device, GatherWorkspace(),
                       TorchMetadataBuilder(block_size, True, set()) if decode_mask else MetadataBuilder())
    settings = RunnerSettings(block_size=block_size, max_model_len=context + steps + block_size,
                              valid_vocab_size=VOCAB, eos_token_id=None, seed=0)
    sampling = SamplingStep(None, Sampler(seed=0), settings, None)
    params = _params(penalties)
    next_block = 0
    blocks: dict[str, list[int]] = {}
    new = []
    for i in range(num_reqs):
        n = (context + steps + block_size) // block_size
        req_id = f"r{i}"
        blocks[req_id] = list(range(next_block, next_block + n))
        next_block += n
        held = (context + block_size - 1) // block_size
        new.append(NewRequestData(req_id, [(7 * i + j) % VOCAB for j in range(context)], [], params,
                                  blocks[req_id][:held], context - 1))
    ids = [f"r{i}" for i in range(num_reqs)]
    so = SchedulerOutput(new, CachedRequestData([], [], []), {r: 1 for r in ids}, num_reqs, [])
    times = []
    for step in range(steps + 1):  # step 0: the prefill's last token, untimed
        start = time.perf_counter()
        reqs = _prepare(batch, sampling, so, device)
        times.append(time.perf_counter() - start)
        # Sampling (not timed): a token per row, on the device and in the worker's copy.
        tokens = [(step * 31 + i) % VOCAB for i in range(num_reqs)]
        sampling._last.sampled = torch.tensor(tokens, device=device)
        for req, token in zip(reqs, tokens):
            req.token_ids.append(token)
        length = context + step  # tokens computed after this step
        new_blocks = [[blocks[r][length // block_size]] if length % block_size == 0 else [] for r in ids]
        so = SchedulerOutput([], CachedRequestData(ids, new_blocks, [length] * num_reqs), {r: 1 for r in ids},
                             num_reqs, [])
    return times[1:]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--context", type=int, default=1024, help="tokens per request before the first step")
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--penalties", action="store_true", help="rows with repetition/frequency penalties")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--mask", action="store_true", help="build the decode mask (torch attention's gather path)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    device = torch.device(args.device)
    print(f"input preparation per decode step: context {args.context}, block_size {args.block_size}, "
          f"{'penalties' if args.penalties else 'no penalties'}, {'with' if args.mask else 'no'} decode mask, "
          f"{args.device}, {args.steps} steps")
    print(f"{'batch':>6} {'median ms':>10} {'p90 ms':>8}")
    for num_reqs in args.batch:
        times = sorted(measure(num_reqs, args.context, args.steps, args.block_size, args.penalties, device,
                               args.mask))
        print(f"{num_reqs:>6} {1e3 * statistics.median(times):>10.3f} {1e3 * times[int(0.9 * len(times))]:>8.3f}")


if __name__ == "__main__":
    main()
