"""vLLM's `POST /tokenize` and `POST /detokenize`, which clients use to count and cut
prompts with the served model's own tokenizer (lm-evaluation-harness, token budgeting
in agents): a prompt or chat messages in, token ids, their count and max_model_len out;
token ids in, text out. Errors are OpenAI's error object, as vLLM answers them.

A text longer than max_model_len is tokenized all the same (vLLM refuses it): counting a
document is how a client learns it does not fit, and the body's size bounds the work."""
from __future__ import annotations

from typing import Any

import msgspec
from aiohttp import web

from llmd.actors.error_text import safe_message
from llmd.http.context import MODEL_LEASE, decode_body, served_model
from llmd.http.errors import ApiError
from llmd.http.openai_chat import ChatMessageIn, chat_messages
from llmd.http.streams import json_response
from llmd_client.protocol import ChatMessage


class TokenizeRequest(msgspec.Struct, kw_only=True):
    """vLLM's TokenizeCompletionRequest (prompt) and TokenizeChatRequest (messages) in one."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessageIn] | None = None
    # Default: True for a prompt (BOS as a completion would get it), False for messages
    # (the chat template writes its own).
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool = False


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    tokens: list[int]


async def tokenize(request: web.Request) -> web.Response:
    body = await decode_body(request, TokenizeRequest)
    served = await served_model(request, body.model)
    processor = request[MODEL_LEASE].model.input_processor
    if (body.prompt is None) == (body.messages is None):
        raise ApiError(400, "send either prompt or messages", param="prompt" if body.prompt is None else "messages",
                       code="invalid_params")
    try:
        if body.prompt is not None:
            add_special = True if body.add_special_tokens is None else body.add_special_tokens
            tokens = await request.app["intake"].tokenize(processor, body.prompt, add_special_tokens=add_special)
        else:
            tokens = await request.app["intake"].tokenize(
                processor, [ChatMessage(**m) for m in chat_messages(body.messages)], add_special_tokens=bool(body.add_special_tokens),
                add_generation_prompt=body.add_generation_prompt, continue_final_message=body.continue_final_message)
    except ValueError as exc:
        message = safe_message(exc)
        raise ApiError(400, message, param="prompt" if body.prompt is not None else "messages",
                       code="invalid_params") from None
    reply: dict[str, Any] = {"count": len(tokens), "max_model_len": served.max_model_len, "tokens": tokens,
                             "token_strs": None}
    if body.return_token_strs:
        reply["token_strs"] = served.tokenizer.convert_ids_to_tokens(tokens)
    return json_response(reply)


async def detokenize(request: web.Request) -> web.Response:
    body = await decode_body(request, DetokenizeRequest)
    served = await served_model(request, body.model)
    known = len(served.tokenizer)
    if any(not 0 <= t < known for t in body.tokens):
        raise ApiError(400, f"tokens must be token ids in [0, {known}) (the tokenizer's vocabulary)",
                       param="tokens", code="invalid_params")
    prompt = await request.app["intake"].in_tokenizer_pool(len(body.tokens), served.tokenizer.decode, body.tokens)
    return json_response({"prompt": prompt})


ROUTES = [("POST", "/tokenize", tokenize), ("POST", "/detokenize", detokenize)]
