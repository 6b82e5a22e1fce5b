"""Logprobs as OpenAI's APIs write them: a completion's parallel lists (tokens,
token_logprobs, top_logprobs, text_offset; with echo, the prompt's positions first) and
a chat message's content entries (token, logprob, bytes, top_logprobs)."""
from __future__ import annotations

from typing import Any

from llmd.http.context import ServedModel
from llmd_client.protocol import TokenLogprob


def top_k(position: list[TokenLogprob], k: int) -> list[TokenLogprob]:
    """The k most likely tokens at a position, best first. A position lists the chosen
    token first, then the top-k the engine computed (the chosen one only once, so it is
    among them when it ranked in the top k)."""
    ranked = [t for t in position if t.rank is not None and 1 <= t.rank <= k]
    return sorted(ranked, key=lambda t: t.rank)


class LogprobsWriter:
    """OpenAI's completion logprobs (tokens, token_logprobs, top_logprobs, text_offset)
    for a run of positions, keeping the text offset across a stream's chunks."""

    def __init__(self, served: ServedModel, k: int, offset: int) -> None:
        self.served = served
        self.k = k
        self.offset = offset

    def __call__(self, positions: list[list[TokenLogprob]]) -> dict[str, list]:
        text = self.served.token_text
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for pos in positions:
            token = text(pos[0].token_id)
            out["tokens"].append(token)
            out["token_logprobs"].append(pos[0].logprob)
            out["top_logprobs"].append({text(t.token_id): t.logprob for t in top_k(pos, self.k)})
            out["text_offset"].append(self.offset)
            self.offset += len(token)
        return out


def with_prompt(served: ServedModel, prompt_ids: list[int], prompt_logprobs: list[list[TokenLogprob]],
                generated: dict[str, list], k: int) -> dict[str, list]:
    """Echo with logprobs: the prompt's tokens lead, the first with no logprob (nothing
    predicts it), and the generated tokens' text offsets move past them."""
    tokens = [served.token_text(t) for t in prompt_ids]
    offsets = [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
    shift = sum(len(t) for t in tokens) - (generated["text_offset"][0] if generated["text_offset"] else 0)
    return {"tokens": tokens + generated["tokens"],
            "token_logprobs": [pos[0].logprob if pos else None for pos in prompt_logprobs] + generated["token_logprobs"],
            "top_logprobs": [{served.token_text(t.token_id): t.logprob for t in top_k(pos, k)} if pos else None
                             for pos in prompt_logprobs] + generated["top_logprobs"],
            "text_offset": offsets + [o + shift for o in generated["text_offset"]]}


def chat_logprobs(served: ServedModel, positions: list[list[TokenLogprob]], k: int) -> dict[str, list]:
    def entry(t: TokenLogprob) -> dict[str, Any]:
        token = served.token_text(t.token_id)
        return {"token": token, "logprob": t.logprob, "bytes": served.token_bytes(t.token_id)}
    return {"content": [{**entry(pos[0]), "top_logprobs": [entry(t) for t in top_k(pos, k)]} for pos in positions]}
