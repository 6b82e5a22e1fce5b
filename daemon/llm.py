"""Offline batch API, shaped like vLLM's: `LLM(model=...).generate(prompts, params)`."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from llmd.config import load_engine_config
from llmd.engine import LLMEngine
from llmd.outputs import RequestOutput
from llmd_client.protocol import SamplingParams

Prompt = str | list[int]


class LLM:
    def __init__(self, model: str = "", **settings: Any) -> None:
        self.config = load_engine_config(model=model, **settings)
        self.engine = LLMEngine(self.config)
        self.tokenizer = self.engine.tokenizer

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 *, priority: Sequence[int] | None = None) -> list[RequestOutput]:
        """One RequestOutput per prompt, in order. A prompt is text or a list of token ids."""
        prompt_list = _as_prompt_list(prompts)
        if sampling_params is None:
            params_list = [SamplingParams()] * len(prompt_list)
        elif isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompt_list)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompt_list):
                raise ValueError(f"got {len(params_list)} sampling params for {len(prompt_list)} prompts")
        engine = self.engine
        ids = []
        try:
            for i, (prompt, params) in enumerate(zip(prompt_list, params_list)):
                prio = priority[i] if priority is not None else 0
                ids.append(engine.add_request(None, prompt, params, priority=prio))
        except Exception:
            engine.abort_request(ids)
            raise
        finished: dict[str, RequestOutput] = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    finished[out.request_id] = out
        return [finished[i] for i in ids]


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # one tokenized prompt
    return prompts
