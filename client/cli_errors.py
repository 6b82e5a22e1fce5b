"""`llmctl`'s exit codes, and how its commands turn the errors they expect into one
line on stderr and an exit code (never a traceback).

Exit codes: 0 ok, 1 the daemon refused or failed the request, 2 usage error, 3 the
daemon is not running, 4 the request was aborted, 5 guided output cut short by
--max-tokens, 130 interrupted."""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import click

from llmd_client.errors import DaemonNotRunning, LlmdError

EXIT_REQUEST_ERROR = 1
EXIT_NOT_RUNNING = 3
EXIT_ABORTED = 4
EXIT_GUIDED_CUT = 5
EXIT_INTERRUPTED = 130


@contextmanager
def exit_codes(interrupted_line: list[bool] | None = None) -> Iterator[None]:
    """Turn expected failures into one line on stderr and an exit code, never a traceback.
    `interrupted_line[0]` says a streamed line is open on stdout (it gets its newline)."""
    ctx = click.get_current_context()
    try:
        yield
    except (LlmdError, KeyboardInterrupt) as exc:
        if interrupted_line and interrupted_line[0]:
            click.echo()
        if isinstance(exc, KeyboardInterrupt):
            ctx.exit(EXIT_INTERRUPTED)
        if isinstance(exc, DaemonNotRunning):
            click.echo(f"llmctl: {exc.message}", err=True)
            ctx.exit(EXIT_NOT_RUNNING)
        click.echo(f"llmctl: {exc.code}: {exc.message}", err=True)
        ctx.exit(EXIT_REQUEST_ERROR)
