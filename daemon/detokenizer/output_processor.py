"""Turns per-step token updates into RequestOutputs: incremental text, stop strings,
logprobs, and the `n` samples of one request gathered under its id. A pooling request
(an embedding) has no text: its one update becomes an EmbeddingRequestOutput."""
from __future__ import annotations

from dataclasses import dataclass, field

from llmd.detokenizer.incremental import IncrementalDetokenizer
from llmd.core.step_messages import Logprobs, PromptLogprobs
from llmd.outputs import (CompletionOutput, EmbeddingOutput, EmbeddingRequestOutput, Logprob, PositionLogprobs,
                          RequestOutput)
from llmd.core.scheduler import RequestUpdate
from llmd_client.protocol import PoolingParams, SamplingParams


@dataclass
class _Sample:
    output: CompletionOutput
    detokenizer: IncrementalDetokenizer


@dataclass
class _RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    samples: dict[str, _Sample]  # child id -> sample
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    num_cached_tokens: int = 0
    touched: bool = False
    outputs: list[CompletionOutput] = field(default_factory=list)  # the samples' outputs, by index

    @property
    def finished(self) -> bool:
        for out in self.outputs:  # a loop, not all(...): this runs for every request every step
            if out.finish_reason is None:
                return False
        return True


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.requests: dict[str, _RequestState] = {}
        # Pooling requests: request id -> its prompt token ids (it is its own only child).
        self.pooling: dict[str, list[int]] = {}
        self.parent_of: dict[str, str] = {}

    def knows(self, request_id: str) -> bool:
        return request_id in self.requests or request_id in self.pooling

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    params: SamplingParams | PoolingParams, child_ids: list[str]) -> None:
        if isinstance(params, PoolingParams):
            self.pooling[request_id] = prompt_token_ids
            self.parent_of[request_id] = request_id
            return
        samples = {}
        for index, child_id in enumerate(child_ids):
            detok = IncrementalDetokenizer(
                self.tokenizer, prompt_token_ids,
                skip_special_tokens=params.skip_special_tokens,
                stop=list(params.stop),
                include_stop_str_in_output=params.include_stop_str_in_output,
            )
            out = CompletionOutput(index=index, logprobs=[] if params.logprobs is not None else None,
                                   cumulative_logprob=0.0 if params.logprobs is not None else None)
            samples[child_id] = _Sample(out, detok)
            self.parent_of[child_id] = request_id
        self.requests[request_id] = _RequestState(
            request_id, prompt, prompt_token_ids, params, samples,
            prompt_logprobs=[None] if params.prompt_logprobs is not None else None,
            outputs=[samples[c].output for c in child_ids])

    def child_ids(self, request_id: str) -> list[str]:
        if request_id in self.pooling:
            return [request_id]
        state = self.requests.get(request_id)
        return list(state.samples) if state else []

    def process(self, updates: list[RequestUpdate], num_cached: dict[str, int]
                ) -> tuple[list[RequestOutput | EmbeddingRequestOutput], list[str]]:
        """Returns the outputs of requests touched by this step, and the child ids that
        hit a stop string (the caller must finish them in the scheduler)."""
        stopped_by_string: list[str] = []
        touched: list[_RequestState] = []
        results: list[RequestOutput | EmbeddingRequestOutput] = []
        for update in updates:
            parent = self.parent_of.get(update.req_id)
            if parent is None:
                continue
            if parent in self.pooling:
                if update.finish_reason is not None:
                    results.append(self._end_pooling(parent, update.finish_reason, update.error, update.pooled))
                continue
            state = self.requests[parent]
            sample = state.samples[update.req_id]
            if not state.touched:
                # Only outputs touched this step are returned: clear their last deltas.
                state.touched = True
                touched.append(state)
                for other in state.samples.values():
                    other.output.new_text = ""
                    other.output.new_token_ids = []
            state.num_cached_tokens = max(state.num_cached_tokens, num_cached.get(update.req_id, 0))
            if update.prompt_logprobs is not None and state.prompt_logprobs is not None and sample.output.index == 0:
                self._add_prompt_logprobs(state, update.prompt_logprobs)
            if sample.output.finished:
                continue
            out = sample.output
            if update.new_token_ids:
                new_ids, stop_str = self._consume(sample.detokenizer, update, state.params)
                out.token_ids.extend(new_ids)
                out.new_token_ids = new_ids
                if update.logprobs is not None and out.logprobs is not None:
                    self._add_logprobs(out, update.logprobs, len(new_ids))
                if stop_str is not None:
                    out.finish_reason = "stop"
                    out.stop_reason = stop_str
                    stopped_by_string.append(update.req_id)
            if update.finish_reason is not None and out.finish_reason is None:
                out.finish_reason = update.finish_reason
                out.stop_reason = update.stop_reason
                out.error = update.error
            delta = sample.detokenizer.get_delta()
            if out.finished:
                delta += sample.detokenizer.finish()
                # Text that became final only at the end may still hold a stop string.
                stop_str = sample.detokenizer.stop_string
                if stop_str is not None and out.stop_reason != stop_str:
                    out.finish_reason, out.stop_reason = "stop", stop_str
            out.new_text = delta
            out.text += delta
        for state in touched:
            state.touched = False
            finished = state.finished
            results.append(self._make_output(state, finished))
            if finished:
                self._forget(state)
        return results, stopped_by_string

    @staticmethod
    def _consume(detokenizer, update: RequestUpdate, params: SamplingParams) -> tuple[list[int], str | None]:
        """Feed a step's tokens; with several (accepted speculative drafts), stop at the
        token that completes a stop string: nothing after a stop is emitted. A token stop
        (EOS, a stop id, a grammar's end) is kept but is not text, as in vLLM: with
        skip_special_tokens off a reply would otherwise end in "</s>"."""
        ids = update.new_token_ids
        if update.finish_reason == "stop" and not params.include_stop_str_in_output:
            new_ids, stop_str = OutputProcessor._feed(detokenizer, ids[:-1])
            return (new_ids, stop_str) if stop_str is not None else (new_ids + ids[-1:], None)
        return OutputProcessor._feed(detokenizer, ids)

    @staticmethod
    def _feed(detokenizer, token_ids: list[int]) -> tuple[list[int], str | None]:
        if len(token_ids) == 1:
            return list(token_ids), detokenizer.update(token_ids)
        for i, token in enumerate(token_ids):
            stop_str = detokenizer.update([token])
            if stop_str is not None:
                return list(token_ids[:i + 1]), stop_str
        return list(token_ids), None

    def _end_pooling(self, request_id: str, reason: str, error: str | None,
                     pooled: list[float] | None) -> EmbeddingRequestOutput:
        prompt_token_ids = self.pooling.pop(request_id)
        self.parent_of.pop(request_id, None)
        return EmbeddingRequestOutput(request_id, EmbeddingOutput(pooled if pooled is not None else []),
                                      prompt_token_ids, finish_reason=reason, error=error)

    def abort(self, request_id: str, reason: str = "abort", error: str | None = None
              ) -> RequestOutput | EmbeddingRequestOutput | None:
        """End a request from outside a step: its unfinished samples get `reason` (and,
        with reason "error", `error`, what went wrong)."""
        if request_id in self.pooling:
            return self._end_pooling(request_id, reason, error, None)
        state = self.requests.get(request_id)
        if state is None:
            return None
        for sample in state.samples.values():
            out = sample.output
            out.new_text = ""
            out.new_token_ids = []
            if not out.finished:
                out.finish_reason = reason
                out.error = error
                tail = sample.detokenizer.get_delta() + sample.detokenizer.finish()
                out.new_text = tail
                out.text += tail
        self._forget(state)
        return self._make_output(state, state.finished)

    def _forget(self, state: _RequestState) -> None:
        self.requests.pop(state.request_id, None)
        for child_id in state.samples:
            self.parent_of.pop(child_id, None)

    @staticmethod
    def _make_output(state: _RequestState, finished: bool) -> RequestOutput:
        return RequestOutput(
            request_id=state.request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            outputs=list(state.outputs),
            prompt_logprobs=state.prompt_logprobs,
            num_cached_tokens=state.num_cached_tokens,
            finished=finished,
        )

    def _position(self, ids: list[int], lps: list[float], rank: int) -> PositionLogprobs:
        decode = self.tokenizer.decode
        pos: PositionLogprobs = {ids[0]: Logprob(lps[0], rank, decode([ids[0]]))}
        for r, (tid, lp) in enumerate(zip(ids[1:], lps[1:]), start=1):
            if tid not in pos:
                pos[tid] = Logprob(lp, r, decode([tid]))
        return pos

    def _add_logprobs(self, out: CompletionOutput, lp: Logprobs, count: int) -> None:
        """The first `count` positions of `lp` (tokens past a stop string are dropped)."""
        for ids, lps, rank in zip(lp.token_ids[:count], lp.logprobs[:count], lp.ranks[:count]):
            out.logprobs.append(self._position(ids, lps, rank))
            out.cumulative_logprob += lps[0]

    def _add_prompt_logprobs(self, state: _RequestState, chunk: PromptLogprobs) -> None:
        entries = state.prompt_logprobs
        # Position i+1 of the prompt is predicted at position i; a recomputed prompt
        # (after preemption) overwrites what it sent before.
        for offset, (ids, lps, rank) in enumerate(zip(chunk.logprobs.token_ids, chunk.logprobs.logprobs,
                                                      chunk.logprobs.ranks)):
            index = chunk.start + 1 + offset
            entry = self._position(ids, lps, rank)
            if index < len(entries):
                entries[index] = entry
            else:
                entries.append(entry)
