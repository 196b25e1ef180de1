"""The protocol interface: what a protocol unit tells the gateway, so that the gateway names none.

A unit (a package of `polymq.adapters`, or any module registered under the entry-point group
`polymq.protocols`) exports one `Protocol`:

- its name: the config file's section, the `--NAME/--no-NAME` switch, the `POLYMQ_NAME` variable;
- its settings, declared once: the section's keys, the flags and the `POLYMQ_*` variables, their
  help, defaults and validation are all made from them (`gateway/config.py`);
- its endpoints: TCP listeners and ZeroMQ sockets, bound by the gateway before the store opens,
  each at the port one of its settings holds;
- `check`, run before anything is bound (a certificate that does not load fails the start-up);
- `start`, which takes the engine, the protocol's options and its bound endpoints and returns a
  service with `run` and `stop`;
- its conformance and bench commands as "module:attribute", imported only when asked for;
- `shown_id`: the id its clients are shown for a message (a traced message's events carry every
  protocol's, so that a client's log line of any protocol finds it: core/trace.py).

The gateway binds, starts, logs and stops every protocol the same way; a new protocol is a codec,
a unit and its docs page.
"""

from __future__ import annotations

import importlib
import socket
from collections.abc import Callable, Mapping
from typing import Any
from typing import Protocol as TypingProtocol

import attrs
import click
import trio

from polymq.adapters.traffic import Traffic
from polymq.adapters.zmq_sockets import SocketSpec, ZmqSockets
from polymq.core.engine import Engine
from polymq.core.message import Message

# A listener's port: 0 lets the OS choose a free one, -1 turns the listener off.
PORT = click.IntRange(min=-1, max=65535)


@attrs.frozen
class Setting:
    """One option of a protocol (or of the gateway): its key, flag, type, default and help."""

    name: str  # the key in the config section and the attribute of the options
    flag: str  # "--nsq-tcp-port", or "--deflate/--no-deflate" for a switch
    type: click.ParamType
    default: Any
    help: str
    # Repeatable: the flag may be given again, the value is a tuple of values of `type` (a TOML array,
    # a POLYMQ_* variable of values separated by spaces); the default is then a tuple too.
    multiple: bool = False
    # A secret (a token): `polymq config --show` says it is set, never what it is.
    secret: bool = False

    @property
    def is_switch(self) -> bool:
        return "/" in self.flag or self.type is click.BOOL


@attrs.frozen
class Endpoint:
    """A TCP listener, or a ZeroMQ socket when `zmq` says how to make it from the options."""

    name: str  # "nsq-tcp", "pzq-send": in the `listening` log line and in start-up errors
    port: str  # the setting that holds its port (0: any free, -1: off)
    host: str | None = None  # the setting that holds its own address (else the gateway's --bind)
    zmq: Callable[[Any], SocketSpec] | None = None


class ServiceError(Exception):
    """A protocol cannot start as configured (`check`, `start`): the message says what to fix."""


# A connection's unsent output past which, held for the grace, its client is disconnected: 4 times the
# 8 MiB at which the session stops reading it (adapters/session.py), and 10 s, a third of nsqd's default
# heartbeat interval (its write deadline): long enough for a client that reads, only slowly.
DEFAULT_MAX_CLIENT_OUTPUT = 32 * 1024 * 1024
DEFAULT_SLOW_CLIENT_GRACE_S = 10.0


@attrs.frozen
class OutputLimit:
    """The bound on each TCP connection's unsent output (0 bytes: none), the gateway's --max-client-output."""

    max_bytes: int = DEFAULT_MAX_CLIENT_OUTPUT
    grace_s: float = DEFAULT_SLOW_CLIENT_GRACE_S


@attrs.frozen
class GatewayInfo:
    """What a protocol may need to know of the process around it."""

    bind: str  # the address listeners bind to by default
    http_address: str | None  # host:port of the gateway's own HTTP listener (None: off)
    stop: Callable[[], None]  # stop the whole gateway cleanly (as a SIGTERM would)
    output_limit: OutputLimit = OutputLimit()


@attrs.frozen
class Context:
    """What `start` gets: the engine, the protocol's options and what the gateway bound for it."""

    engine: Engine
    options: Any
    listeners: Mapping[str, socket.socket]  # by endpoint name: bound and listening
    zmq: ZmqSockets | None  # its bound ZeroMQ sockets (None: it has none, or all are off)
    checked: Any  # what `check` returned
    gateway: GatewayInfo


class Service(TypingProtocol):
    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve until cancelled; `task_status.started()` once every endpoint serves."""

    async def stop(self) -> None:
        """Refuse new clients, end the sessions (what they held goes back to the queues); `run` may
        then be cancelled."""

    def connections(self) -> int:
        """Clients connected now (for the log line at stop)."""

    def traffic(self) -> Traffic:
        """What its clients sent and got so far (for the metrics)."""

    # A service may also have `peers() -> list[tuple[str, str]]`: (its listener's address, the
    # client's) for each client connected now (TCP services do: adapters/session.py); the admin page
    # lists them. Not a member here, so that a unit without it still is a Service.


@attrs.frozen
class Protocol:
    name: str  # the config section, the --NAME/--no-NAME switch
    title: str  # "NSQ V2 (TCP and the nsqd HTTP API)": in help texts
    settings: tuple[Setting, ...]
    start: Callable[[Context], Service]
    endpoints: tuple[Endpoint, ...] = ()
    check: Callable[[Any], Any] | None = None
    conformance: str | None = None  # "module:attribute" of a click command, loaded only when asked for
    bench: str | None = None  # likewise
    # The id its clients see for a message (NSQ's 16 hex digits, an MQKS msg_id, …): for traces only.
    shown_id: Callable[[Message], str] | None = None
    options_class: type = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        object.__setattr__(self, "options_class", options_class(self.name, self.all_settings))

    @property
    def enabled(self) -> Setting:
        """The switch every protocol has: turned off, it binds and starts nothing."""
        return Setting("enabled", f"--{self.name}/--no-{self.name}", click.BOOL, True, f"Serve {self.title}.")

    @property
    def all_settings(self) -> tuple[Setting, ...]:
        return (self.enabled, *self.settings)

    def defaults(self) -> Any:
        return self.options_class()

    def socket_specs(self, options: Any, ports: Mapping[str, int]) -> dict[str, SocketSpec]:
        """The ZeroMQ sockets of the endpoints named in `ports`, at those ports (0: any free)."""
        return {endpoint.name: attrs.evolve(endpoint.zmq(options), port=ports[endpoint.name])
                for endpoint in self.endpoints if endpoint.zmq is not None and endpoint.name in ports}

    def setting(self, name: str) -> Setting:
        for setting in self.all_settings:
            if setting.name == name:
                return setting
        raise KeyError(name)


def options_class(section: str, settings: tuple[Setting, ...]) -> type:
    """A frozen attrs class with one attribute per setting, defaulting to the setting's default."""
    name = "".join(part.capitalize() for part in (section or "gateway").replace("-", "_").split("_")) + "Options"
    return attrs.make_class(name, {setting.name: attrs.field(default=setting.default) for setting in settings},
                            frozen=True, slots=True)


def load_command(target: str) -> click.Command:
    """A unit's conformance or bench command from its "module:attribute"."""
    module, _, attribute = target.partition(":")
    command = getattr(importlib.import_module(module), attribute)
    assert isinstance(command, click.Command), target
    return command


class ServersService:
    """A service made of servers that each have `async run()` and `shutdown()` (the ZeroMQ
    protocols, whose sockets the gateway bound and closes)."""

    def __init__(self, *servers: Any) -> None:
        self.servers = servers

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            for server in self.servers:
                nursery.start_soon(server.run)
            task_status.started()

    async def stop(self) -> None:
        for server in self.servers:
            server.shutdown()  # what their consumers held goes back to the queues; their sockets close

    def connections(self) -> int:
        return 0  # ZeroMQ hides its peers' connections from the application

    def traffic(self) -> Traffic:
        total = Traffic()
        for server in self.servers:
            for pump in getattr(server, "pumps", {}).values():
                total.messages_in += pump.received
                total.messages_out += pump.sent
            counted = getattr(server, "traffic", None)  # a server counts its errors there
            if isinstance(counted, Traffic):
                total.add(counted)
        return total
