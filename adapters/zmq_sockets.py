"""The gateway's bound ZeroMQ sockets (PZQ's and eMQP's), made in one ZeroMQ context.

They are bound before the store opens, so a port that is taken fails the start-up before anything
else is made; a failure closes what was made and names the listener on the raised error.
"""

from __future__ import annotations

import attrs
import zmq

# ZeroMQ socket monitor events that change the set of connected peers.
PEER_CONNECTED = zmq.EVENT_ACCEPTED
PEER_GONE = zmq.EVENT_DISCONNECTED
# What a socket still tries to send after it is closed, in ms (the PZQ original's linger).
LINGER_MS = 1000


@attrs.frozen
class SocketSpec:
    kind: int  # zmq.ROUTER, zmq.DEALER, zmq.PUB
    port: int | None  # None: not made; 0: any free port
    max_message: int  # libzmq drops (and disconnects) a larger incoming message as it arrives
    mandatory: bool = False  # ROUTER_MANDATORY: a message waits at a full pipe, never silently dropped
    watch_peers: bool = False  # a monitor socket reports peers connecting and going
    host: str | None = None  # its own address instead of the gateway's --bind


@attrs.define
class ZmqSockets:
    context: zmq.Context
    sockets: dict[str, zmq.Socket] = attrs.Factory(dict)
    # Connection events of the sockets whose spec asked for them, set up before binding so that
    # no peer connects unseen.
    peer_events: dict[str, zmq.Socket] = attrs.Factory(dict)
    addresses: dict[str, str] = attrs.Factory(dict)  # name → host:port actually bound

    @classmethod
    def bind(cls, host: str, specs: dict[str, SocketSpec]) -> ZmqSockets:
        """Every socket whose port is not None. Raises zmq.ZMQError whose `listener` attribute
        names the socket that failed."""
        made = cls(zmq.Context())
        try:
            for name, spec in specs.items():
                if spec.port is not None:
                    made._bind_one(name, spec.host or host, spec)
        except BaseException:
            made.close()
            raise
        return made

    def _bind_one(self, name: str, host: str, spec: SocketSpec) -> None:
        sock = self.context.socket(spec.kind)
        self.sockets[name] = sock
        sock.setsockopt(zmq.LINGER, LINGER_MS)
        sock.setsockopt(zmq.MAXMSGSIZE, spec.max_message)
        if spec.mandatory:
            sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        if spec.watch_peers:
            self.peer_events[name] = sock.get_monitor_socket(PEER_CONNECTED | PEER_GONE)
        ipv6 = ":" in host
        endpoint = f"tcp://[{host}]" if ipv6 else f"tcp://{host}"
        try:
            if ipv6:
                sock.setsockopt(zmq.IPV6, 1)
            sock.bind(f"{endpoint}:{spec.port}" if spec.port else f"{endpoint}:*")
        except zmq.ZMQError as error:
            error.listener = name  # type: ignore[attr-defined]
            raise
        bound = sock.getsockopt(zmq.LAST_ENDPOINT).decode().removeprefix("tcp://")
        self.addresses[name] = bound.replace("[", "").replace("]", "") if bound.count(":") > 1 else bound

    def get(self, name: str) -> zmq.Socket | None:
        return self.sockets.get(name)

    def close(self) -> None:
        for name in self.peer_events:
            sock = self.sockets.get(name)
            if sock is not None and not sock.closed:
                sock.disable_monitor()
        for sock in (*self.sockets.values(), *self.peer_events.values()):
            if not sock.closed:
                sock.close(linger=0)
        if not self.context.closed:
            self.context.term()
