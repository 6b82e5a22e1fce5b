"""Where a request's output ends: the token-level stops, checked as each sampled token is
appended (EOS, stop token ids, min_tokens and max_tokens, and for a guided request its
grammar). Stop strings need text and are the detokenizer's. No torch."""
from __future__ import annotations

from llmd.core.request import Request, RequestStatus


def append_sampled_tokens(request: Request, token_ids: list[int],
                          structured=None) -> tuple[list[int], RequestStatus | None, str | None]:
    """Append one step's sampled tokens (accepted drafts, then the sampled one) to the
    request, up to the first that ends it. Returns the tokens appended, the finished
    status if one did, and an error message for people if the grammar broke.
    `structured`: the StructuredOutputManager whose matchers follow guided requests."""
    new_tokens: list[int] = []
    status = None
    error = None
    for token in token_ids:
        request.append_output_token(token)
        new_tokens.append(token)
        if request.grammar is not None:
            status, error = _advance_grammar(structured, request, token)
            if status is not None:
                break
        status = check_stop(request, token)
        if status is not None:
            break
    return new_tokens, status, error


def _advance_grammar(structured, request: Request, token: int) -> tuple[RequestStatus | None, str | None]:
    """Feed the sampled token to the request's matcher. The output ends when the
    grammar does (its stop token accepted)."""
    if not structured.accept(request.grammar, token):
        # The mask allowed only what the grammar accepts; this is a bug, not bad input.
        return RequestStatus.FINISHED_ERROR, "internal error: the sampled token broke the grammar"
    if structured.is_terminated(request.grammar):
        if token in request.sampling_params.stop_token_ids:
            request.stop_reason = token
        return RequestStatus.FINISHED_STOPPED, None
    return None, None


def check_stop(request: Request, token: int) -> RequestStatus | None:
    """Whether `token`, just appended, ends the request: EOS (unless ignored) or a stop
    token id once min_tokens are out, or max_tokens reached."""
    params = request.sampling_params
    if request.num_output_tokens >= params.min_tokens:
        if token == request.eos_token_id and not params.ignore_eos:
            return RequestStatus.FINISHED_STOPPED
        if token in params.stop_token_ids:
            request.stop_reason = token
            return RequestStatus.FINISHED_STOPPED
    if request.num_output_tokens >= request.max_tokens:
        return RequestStatus.FINISHED_LENGTH
    return None
