"""What the offline benchmarks (latency, throughput) share: the engine built from
command-line settings, a step counter, and the checks a workload passes before it runs."""
from __future__ import annotations

from typing import Any

from llmd import LLM, SamplingParams
from llmd_tools.bench.report import Env
from llmd_tools.bench.workloads import Req, longest


def load_llm(model: str | None, settings: dict[str, Any]) -> LLM:
    """The offline engine on `model` (default: the built-in demo model); settings left
    unset (None) keep the engine's defaults."""
    if not model:
        from llmd_tools.make_model import demo_model_path
        model = str(demo_model_path())
    return LLM(model=model, **{k: v for k, v in settings.items() if v is not None})


def vocab_size(llm: LLM) -> int:
    """Ids a prompt may use: the tokenizer's, within the model's logit width."""
    return min(len(llm.tokenizer), llm.engine.vocab_size)


def check_fits(llm: LLM, reqs: list[Req]) -> None:
    """The engine would silently cut a request that does not fit max_model_len; refuse."""
    need = longest(reqs)
    if need > llm.engine.max_model_len:
        raise ValueError(f"a request needs {need} tokens (prompt + output) but max_model_len is "
                         f"{llm.engine.max_model_len}: raise --max-model-len or shorten the workload")


def greedy(output_len: int) -> SamplingParams:
    """Exactly `output_len` tokens, greedy."""
    return SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)


def env_of(llm: LLM) -> Env:
    import torch

    device = llm.engine.device
    threads = torch.get_num_threads() if device.type == "cpu" else None
    return Env.here(str(device), str(llm.engine.dtype).removeprefix("torch."), threads)


class StepCounter:
    """Counts the engine's steps, and ticks `bar` once per finished request, by wrapping
    the engine's step() (LLM.generate drives it)."""

    def __init__(self, llm: LLM, bar=None) -> None:
        self.steps = 0
        inner = llm.engine.step

        def step():
            outputs = inner()
            self.steps += 1
            if bar is not None:
                bar.update(sum(1 for o in outputs if o.finished))
            return outputs

        llm.engine.step = step
