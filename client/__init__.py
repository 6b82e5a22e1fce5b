"""llmd_client: the wire protocol shared with the daemon, and the clients.

Imports no torch and nothing from the daemon.

    from llmd_client import Client
    print(Client().generate("Hello", max_tokens=16).text)
"""
from llmd_client.async_client import AsyncClient, AsyncStream
from llmd_client.client import Client, Stream
from llmd_client.errors import (ClientTimeout, ConnectionLost, DaemonNotRunning, LlmdError, ProtocolError,
                                RequestError)
from llmd_client.protocol import ChatMessage, GuidedDecodingParams, PoolingParams, SamplingParams, StatusReply, Usage
from llmd_client.results import Completion, Delta, Embedding, Result
from llmd_client.socket_path import default_socket_path

__all__ = [
    "AsyncClient", "AsyncStream", "ChatMessage", "Client", "ClientTimeout", "Completion", "ConnectionLost",
    "DaemonNotRunning", "Delta", "Embedding", "GuidedDecodingParams", "LlmdError", "PoolingParams", "ProtocolError",
    "RequestError", "Result", "SamplingParams",
    "StatusReply", "Stream", "Usage", "default_socket_path",
]
