"""Clients of a test daemon's HTTP faces over its Unix socket (`<socket>-http.sock`): the
official openai SDK, plain httpx, the ollama package; `client`, `http` and `olla` as fixtures."""
from __future__ import annotations

import ollama
import openai
import pytest

try:
    import httpx2 as httpx  # what the installed openai SDK is built on
except ImportError:
    import httpx
import httpx as ollama_httpx  # what the ollama package is built on


def http_socket(protocol_socket: str) -> str:
    return protocol_socket.removesuffix(".sock") + "-http.sock"


def openai_client(sock: str) -> openai.OpenAI:
    return openai.OpenAI(base_url="http://localhost/v1", api_key="unused", max_retries=0,
                         http_client=httpx.Client(transport=httpx.HTTPTransport(uds=sock)))


def http_client(sock: str) -> httpx.Client:
    return httpx.Client(base_url="http://localhost", transport=httpx.HTTPTransport(uds=sock), timeout=60)


def ollama_client(sock: str) -> ollama.Client:
    return ollama.Client(host="http://localhost", transport=ollama_httpx.HTTPTransport(uds=sock))


# Module fixtures over a test module's own `daemon` fixture (its http_sock set): import them.
@pytest.fixture(scope="module")
def client(daemon) -> openai.OpenAI:
    return openai_client(daemon.http_sock)


@pytest.fixture(scope="module")
def http(daemon):
    with http_client(daemon.http_sock) as c:
        yield c


@pytest.fixture(scope="module")
def olla(daemon) -> ollama.Client:
    return ollama_client(daemon.http_sock)
