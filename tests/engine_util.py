"""Helpers for tests that drive the step-wise engine directly."""
from __future__ import annotations


def drain(engine) -> dict:
    """Step until no request is left; the final RequestOutput of each, by request id."""
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    return finished
