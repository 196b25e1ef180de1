"""Where a session's connection errors end it quietly: the `except*` mypyc does not compile.

`adapters/session.py` is compiled (docs/performance.md); its `run` awaits the session's tasks
through `until_connection_ends`, which stays a plain Python module. Once per connection, never
per message.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import trio


async def until_connection_ends(tasks: Callable[[], Awaitable[None]], log: logging.Logger, peer: str) -> None:
    """Run `tasks`; a connection that broke, closed or missed a deadline ends them without an error."""
    try:
        await tasks()
    # `except*`: the nursery wraps its tasks' errors in an ExceptionGroup (trio's strict groups).
    # OSError covers ssl.SSLError; TooSlowError is a deadline of a command that waited.
    except* (trio.BrokenResourceError, trio.ClosedResourceError, trio.TooSlowError, OSError) as group:
        log.debug("%s: connection ended: %r", peer, group.exceptions)
