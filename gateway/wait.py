"""`polymq wait`: return once a gateway serves, for scripts that start one in the background.

It asks the gateway's own HTTP listener for `/ping` (answered once every protocol's listeners are
bound and served) until it answers or the time is up; then one line says which. A gateway that
will not serve says so in its run file (gateway/run_file.py): its start-up failure line, or that it
is starting, which its process outlived. Such a record ends the wait at once with that line when
it was written after `wait` started; an older one only after START_GRACE_S, time enough for a
gateway started just before `wait` to have replaced it with its own.
"""

from __future__ import annotations

import http.client
import sys
import time

import click

from polymq.gateway import run_file
from polymq.gateway.config import DEFAULT_HTTP_PORT

# Between two tries: short against the second or so a gateway takes to start.
RETRY_S = 0.1
DEFAULT_TIMEOUT_S = 60.0
# How long a gateway takes from its start to its run file, at most: about half a second of imports
# here (`python -X importtime`), ten times that on a loaded machine.
START_GRACE_S = 5.0


class NotHttp(Exception):
    """Something listens at the address but does not answer HTTP (an NSQ or MQKS port given, say)."""


def ping(host: str, port: int, timeout: float) -> bool:
    connection = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        connection.request("GET", "/ping")
        return connection.getresponse().status == 200
    except OSError:
        return False
    except http.client.HTTPException as error:
        raise NotHttp(str(error)) from None
    finally:
        connection.close()


def why_not(record: run_file.Record | None, started_at: float, now: float) -> str | None:
    """What the run file says against waiting on: None while the gateway may still serve."""
    if record is None or (record.written_at < started_at and now < started_at + START_GRACE_S):
        return None
    if record.state == run_file.FAILED:
        return f"the gateway (pid {record.pid}) did not start: {record.error}"
    if record.state == run_file.STARTING and not run_file.running(record.pid):
        return f"the gateway (pid {record.pid}) exited before it served; its log says why"
    return None


def _answers(address: str, host: str, port: int, timeout: float) -> bool:
    try:
        return ping(host, port, timeout)
    except NotHttp:
        click.echo(f"polymq: {address} answers, but not over HTTP: give the gateway's own HTTP listener "
                   "(its --admin-port), not a protocol's port", err=True)
        sys.exit(1)


@click.command()
@click.option("--address", default=f"127.0.0.1:{DEFAULT_HTTP_PORT}", show_default=True,
              help="The gateway's own HTTP listener (its --admin-port), HOST:PORT.")
@click.option("--timeout", type=click.FloatRange(min=0), default=DEFAULT_TIMEOUT_S, show_default=True,
              help="Seconds to wait at most.")
def command(address: str, timeout: float) -> None:
    """Wait until a gateway serves (exit 0), or say why not (exit 1)."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise click.BadParameter(f"must be HOST:PORT, not {address!r}", param_hint="'--address'")
    started_at = run_file.process_started_at()
    deadline = time.monotonic() + timeout
    while not _answers(address, host, int(port), max(0.1, min(1.0, deadline - time.monotonic()))):
        reason = why_not(run_file.read(host, int(port)), started_at, time.time())
        if reason is not None:
            click.echo(f"polymq: {reason}", err=True)
            sys.exit(1)
        if time.monotonic() >= deadline:
            click.echo(f"polymq: no gateway answered at {address} within {timeout:g} s; start one with "
                       "`.venv/bin/polymq serve` (its log says why it did not start)", err=True)
            sys.exit(1)
        time.sleep(RETRY_S)
    click.echo(f"polymq: the gateway at {address} is ready")
