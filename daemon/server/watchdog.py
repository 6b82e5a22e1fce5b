"""systemd's watchdog, fed only while the engine makes progress: a daemon whose model
step hangs is restarted by the service manager even though its event loop still
answers every client."""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from llmd.server import sd_notify

logger = logging.getLogger("llmd.server")


async def feed_watchdog(making_progress: Callable[[float], bool]) -> None:
    """Feed systemd's watchdog while the engine makes progress (idle counts; a step
    stuck past its deadline does not), so a daemon whose model step hangs is restarted
    even though its event loop still answers."""
    interval = sd_notify.watchdog_interval()
    if not interval:
        return
    stuck = False
    while True:  # watchdog_interval() is already half of WatchdogSec
        if making_progress(time.monotonic()):
            sd_notify.watchdog()
            stuck = False
        elif not stuck:
            stuck = True
            logger.error("an engine step is stuck past its deadline: no longer feeding the systemd watchdog")
        await asyncio.sleep(interval)
