"""The detokenizer actor: incremental text, stop strings (which it reports back to the
scheduler) and the Output messages streamed to each request's connection; an embedding
request's one Output carries its vector."""
from __future__ import annotations

import time

from llmd.actors.messages import RegisterRequest, RequestEvent, RequestsAborted, StepTokens, StopSamples
from llmd.actors.runtime import Actor
from llmd.detokenizer.output_processor import OutputProcessor
from llmd.outputs import CompletionOutput, EmbeddingRequestOutput, RequestOutput
from llmd_client.protocol import Output, TokenLogprob, Usage, wire_logprob


class DetokenizerActor(Actor):
    name = "detokenizer"

    def __init__(self, tokenizer, metrics: Actor) -> None:
        super().__init__()
        self.processor = OutputProcessor(tokenizer)
        self.metrics = metrics
        self.scheduler: Actor | None = None  # set by the server once both exist
        self.sinks: dict[str, object] = {}
        self._first_token_seen: set[str] = set()

    async def handle(self, message: object) -> None:
        match message:
            case RegisterRequest(request_id=rid, prompt_token_ids=ids, params=params, child_ids=kids, sink=sink):
                self.processor.add_request(rid, None, ids, params, kids)
                self.sinks[rid] = sink
            case StepTokens(updates=updates, num_cached=num_cached):
                outputs, stopped = self.processor.process(updates, num_cached)
                if stopped:
                    self.scheduler.send(StopSamples(stopped))
                now = time.monotonic()
                for out in outputs:
                    self._emit(out, now)
            case RequestsAborted(request_ids=ids, reason=reason, error=error):
                now = time.monotonic()
                for rid in ids:
                    out = self.processor.abort(rid, reason, error)
                    if out is not None:
                        self._emit(out, now)
            case _:
                raise TypeError(f"detokenizer actor got {type(message).__name__}")

    def _emit(self, out: RequestOutput | EmbeddingRequestOutput, now: float) -> None:
        rid = out.request_id
        sink = self.sinks.get(rid)
        if sink is None:
            return
        if isinstance(out, EmbeddingRequestOutput):
            self._emit_embedding(out, sink, now)
            return
        if rid not in self._first_token_seen and any(c.token_ids for c in out.outputs):
            self._first_token_seen.add(rid)
            self.metrics.send(RequestEvent(rid, "first_token", now))
        messages = []
        for completion in out.outputs:
            message = self._sample_message(sink, completion)
            if message is not None:
                messages.append(message)
        if out.finished:
            completion_tokens = sum(len(c.token_ids) for c in out.outputs)
            usage = Usage(prompt_tokens=len(out.prompt_token_ids), completion_tokens=completion_tokens,
                          cached_tokens=out.num_cached_tokens)
            if not messages:  # every sample had already reported; usage still goes out last
                messages.append(Output(id=sink.client_id, index=out.outputs[-1].index,
                                       finish_reason=out.outputs[-1].finish_reason,
                                       stop_reason=out.outputs[-1].stop_reason))
            messages[-1].usage = usage
            if out.prompt_logprobs is not None:
                messages[-1].prompt_logprobs = _prompt_logprobs(out.prompt_logprobs)
            reasons = {c.finish_reason for c in out.outputs}
            self.metrics.send(RequestEvent(rid, "finished", now, prompt_tokens=len(out.prompt_token_ids),
                                           completion_tokens=completion_tokens,
                                           cached_tokens=out.num_cached_tokens,
                                           finish_reason="abort" if "abort" in reasons else out.outputs[0].finish_reason))
            del self.sinks[rid]
            self._first_token_seen.discard(rid)
            sink.finished()
        for message in messages:
            sink.send(message)

    def _emit_embedding(self, out: EmbeddingRequestOutput, sink, now: float) -> None:
        """An embedding request's only output: the vector (or why there is none), its
        prompt tokens as usage; the metrics count it as a prompt that produced no tokens."""
        rid = out.request_id
        usage = Usage(prompt_tokens=len(out.prompt_token_ids), completion_tokens=0)
        message = Output(id=sink.client_id, finish_reason=out.finish_reason, error=out.error, usage=usage,
                         embedding=out.outputs.embedding if out.finish_reason == "stop" else None)
        self.metrics.send(RequestEvent(rid, "finished", now, prompt_tokens=usage.prompt_tokens,
                                       finish_reason=out.finish_reason))
        del self.sinks[rid]
        sink.finished()
        sink.send(message)

    @staticmethod
    def _sample_message(sink, completion: CompletionOutput) -> Output | None:
        newly_finished = completion.finished and completion.index not in sink.finished_samples
        if newly_finished:
            sink.finished_samples.add(completion.index)
        if sink.stream:
            if not (completion.new_text or completion.new_token_ids or newly_finished):
                return None
            text, token_ids = completion.new_text, completion.new_token_ids
            positions = completion.logprobs[len(completion.logprobs) - len(token_ids):] \
                if completion.logprobs is not None and token_ids else None
        else:
            if not newly_finished:
                return None
            text, token_ids = completion.text, completion.token_ids
            positions = completion.logprobs
        logprobs = None
        if positions is not None:
            logprobs = [[TokenLogprob(t, wire_logprob(lp.logprob), lp.rank) for t, lp in pos.items()]
                        for pos in positions]
        return Output(id=sink.client_id, index=completion.index, text=text, token_ids=list(token_ids),
                      logprobs=logprobs,
                      finish_reason=completion.finish_reason if newly_finished else None,
                      stop_reason=completion.stop_reason if newly_finished else None,
                      error=completion.error if newly_finished else None)


def _prompt_logprobs(positions: list) -> list[list[TokenLogprob]]:
    """Each position's entry, the prompt's own token first (the engine's dicts hold it
    first), position 0 empty."""
    out = []
    for position in positions:
        if position is None:
            out.append([])
        else:
            out.append([TokenLogprob(t, wire_logprob(lp.logprob), lp.rank) for t, lp in position.items()])
    return out
