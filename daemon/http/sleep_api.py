"""vLLM's sleep-mode routes on the OpenAI face: `POST /sleep?level=1|2`, `POST /wake_up`
and `GET /is_sleeping`, for the default model or the one `?model=NAME` names (vLLM
serves one model; llmd's extra parameter picks among several). Sleep waits for the
model's requests and answers once it is asleep; wake answers once it serves (a model
that is not loaded is loaded). They answer the model's state as JSON (vLLM answers an
empty 200; its clients read only the status). Behind the same authentication as every
route (a bearer key on TCP); errors are OpenAI's error object naming the parameter."""
from __future__ import annotations

from typing import Any

from aiohttp import web

from llmd.http.context import resolve_model
from llmd.http.errors import ApiError
from llmd.http.streams import json_response
from llmd.pool.slot import ModelSlot, ModelUnavailable


def _state(slot: ModelSlot) -> dict[str, Any]:
    view = slot.view()
    return {"model": view.name, "state": view.state, "sleep_level": view.sleep_level,
            "is_sleeping": view.state in ("sleeping", "asleep")}


def _level(request: web.Request) -> int:
    text = request.query.get("level", "1")
    if text not in ("1", "2"):
        raise ApiError(400, "level must be 1 (free the KV cache, keep the weights in host memory) or 2 "
                            "(drop the weights too)", param="level", code="invalid_params")
    return int(text)


async def sleep(request: web.Request) -> web.Response:
    """Put the model to sleep once its requests are done."""
    level = _level(request)
    spec = resolve_model(request, request.query.get("model"))
    pool = request.app["models"]
    return json_response(_state(await pool.sleep(spec, level)))


async def wake_up(request: web.Request) -> web.Response:
    """Wake the model (or load it); a 503 when it cannot be made to serve."""
    spec = resolve_model(request, request.query.get("model"))
    try:
        slot = await request.app["models"].load(spec)
    except ModelUnavailable as exc:
        raise ApiError(503, str(exc), param="model", code=exc.code) from None
    return json_response(_state(slot))


async def is_sleeping(request: web.Request) -> web.Response:
    """`{"is_sleeping": true}` while the model sleeps (vLLM's answer), with its state."""
    spec = resolve_model(request, request.query.get("model"))
    return json_response(_state(request.app["models"].slot(spec)))


ROUTES = [("POST", "/sleep", sleep), ("POST", "/wake_up", wake_up), ("GET", "/is_sleeping", is_sleeping)]
