"""llmd_client: the wire protocol shared with the daemon, and the clients.

Imports no torch and nothing from the daemon.
"""
from llmd_client.protocol import SamplingParams

__all__ = ["SamplingParams"]
