"""NSQ TLS upgrade (tls_v1, --tls-required, with deflate/snappy) and AUTH against an auth HTTP server.

Real `polymq serve` processes on 127.0.0.1, raw sockets, exact frames (docs/protocols/nsq.md).
The certificates come from a throwaway CA made with the `openssl` command line; the auth server
is a `http.server` thread inside the test that records every query it receives.
"""

from __future__ import annotations

import json
import socket
import ssl
import subprocess
import threading
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import attrs
import pytest

from polymq.codecs import nsq_client as nc

from support.gateway import GatewayProcess, running_gateway
from support.nsq_wire import Closed, RawClient

# -- certificates ---------------------------------------------------------------------------------


@attrs.frozen
class Certs:
    ca: Path
    cert: Path
    key: Path


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=30)


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    """A throwaway CA and a server certificate for localhost / 127.0.0.1 signed by it."""
    d = tmp_path_factory.mktemp("tls")
    (d / "ca.ext").write_text(
        "basicConstraints=critical,CA:TRUE\nkeyUsage=critical,keyCertSign,cRLSign\n"
        "subjectKeyIdentifier=hash\n"
    )
    (d / "server.ext").write_text(
        "basicConstraints=critical,CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\n"
        "extendedKeyUsage=serverAuth\nsubjectAltName=DNS:localhost,IP:127.0.0.1\n"
        "authorityKeyIdentifier=keyid\nsubjectKeyIdentifier=hash\n"
    )
    ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    _openssl("req", "-new", *ec, "-keyout", "ca.key", "-out", "ca.csr", "-subj", "/CN=polymq test CA", cwd=d)
    _openssl("x509", "-req", "-in", "ca.csr", "-signkey", "ca.key", "-days", "2", "-extfile", "ca.ext",
             "-out", "ca.pem", cwd=d)
    _openssl("req", "-new", *ec, "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=localhost", cwd=d)
    _openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
             "-days", "2", "-extfile", "server.ext", "-out", "server.pem", cwd=d)
    return Certs(d / "ca.pem", d / "server.pem", d / "server.key")


@pytest.fixture(scope="module")
def client_tls(certs: Certs) -> ssl.SSLContext:
    """Verifies the gateway's certificate against the throwaway CA (hostname check included)."""
    return ssl.create_default_context(cafile=str(certs.ca))


def _tls_args(certs: Certs) -> tuple[str, ...]:
    return ("--tls-cert", str(certs.cert), "--tls-key", str(certs.key))


@pytest.fixture(scope="module")
def tls_gateway(certs: Certs) -> Iterator[GatewayProcess]:
    with running_gateway(*_tls_args(certs)) as gw:
        yield gw


@pytest.fixture(scope="module")
def tls_required_gateway(certs: Certs) -> Iterator[GatewayProcess]:
    with running_gateway(*_tls_args(certs), "--tls-required") as gw:
        yield gw


def _default_reply(**changes: Any) -> dict[str, Any]:
    """nsqd's feature-negotiation reply with default flags (docs/protocols/nsq.md), then `changes`."""
    reply = {"max_rdy_count": 2500, "version": "1.3.0", "max_msg_timeout": 900000, "msg_timeout": 60000,
             "tls_v1": False, "deflate": False, "deflate_level": 6, "max_deflate_level": 6, "snappy": False,
             "sample_rate": 0, "auth_required": False, "output_buffer_size": 16384, "output_buffer_timeout": 250}
    reply.update(changes)
    return reply


def _tls_client(gw: GatewayProcess, context: ssl.SSLContext, **identify: Any) -> tuple[RawClient, dict[str, Any]]:
    conn = RawClient(gw.nsq_tcp)
    reply = conn.identify(tls_v1=True, **identify)
    conn.start_tls(context)
    return conn, reply


# -- TLS ------------------------------------------------------------------------------------------


def test_tls_upgrade_then_pub_and_sub(tls_gateway: GatewayProcess, client_tls: ssl.SSLContext) -> None:
    producer = RawClient(tls_gateway.nsq_tcp)
    reply = producer.identify(tls_v1=True)
    assert reply == _default_reply(tls_v1=True)
    producer.start_tls(client_tls)  # handshake, then `OK` inside TLS
    assert isinstance(producer.sock, ssl.SSLSocket)
    assert producer.sock.version() is not None
    with producer:
        producer.send(nc.pub("tls_topic", b"secret payload"))
        producer.expect_response(b"OK")
        producer.send(nc.mpub("tls_topic", [b"m1", b"m2"]))
        producer.expect_response(b"OK")

        consumer, _ = _tls_client(tls_gateway, client_tls)
        with consumer:
            consumer.send(nc.sub("tls_topic", "ch"))
            consumer.expect_response(b"OK")
            consumer.send(nc.rdy(10))
            bodies = [consumer.read_message().body for _ in range(3)]
            assert bodies == [b"secret payload", b"m1", b"m2"]


def test_tls_not_offered_without_a_certificate(gateway: GatewayProcess) -> None:
    with RawClient(gateway.nsq_tcp) as conn:
        assert conn.identify(tls_v1=True)["tls_v1"] is False
        # No handshake: the connection carries on in plain text.
        conn.send(nc.pub("plain", b"x"))
        conn.expect_response(b"OK")


def test_tls_not_started_when_client_does_not_ask(tls_gateway: GatewayProcess) -> None:
    with RawClient(tls_gateway.nsq_tcp) as conn:
        assert conn.identify()["tls_v1"] is False
        conn.send(nc.pub("plain_on_tls_gw", b"x"))
        conn.expect_response(b"OK")


@pytest.mark.parametrize("kind", ["deflate", "snappy"])
def test_tls_then_compression(tls_gateway: GatewayProcess, client_tls: ssl.SSLContext, kind: str) -> None:
    topic = f"tls_{kind}"
    producer = RawClient(tls_gateway.nsq_tcp)
    reply = producer.identify(tls_v1=True, **{kind: True})
    assert reply["tls_v1"] is True
    assert reply[kind] is True
    # Order (docs/protocols/nsq.md): TLS handshake, plain `OK` inside TLS, then the compressed `OK`.
    producer.start_tls(client_tls)
    producer.start_compression(kind)
    if kind == "deflate":
        assert producer.compressed_received.endswith(b"\x00\x00\xff\xff")  # raw DEFLATE, sync-flushed
    else:
        assert producer.compressed_received.startswith(b"\xff\x06\x00\x00sNaPpY")
    body = b"compressible " * 200
    with producer:
        producer.send(nc.pub(topic, body))
        producer.expect_response(b"OK")
        consumer = RawClient(tls_gateway.nsq_tcp)
        consumer.identify(tls_v1=True, **{kind: True})
        consumer.start_tls(client_tls)
        consumer.start_compression(kind)
        with consumer:
            consumer.send(nc.sub(topic, "ch"))
            consumer.expect_response(b"OK")
            consumer.send(nc.rdy(1))
            message = consumer.read_message()
            assert (message.body, message.attempts) == (body, 1)
            consumer.send(nc.fin(message.msg_id))
            consumer.send(nc.nop())
            consumer.expect_nothing(0.2)  # FIN succeeded: no error frame
            # The whole stream really was compressed: far fewer bytes than the body.
            assert len(consumer.compressed_received) < len(body) // 4


@pytest.mark.parametrize("command", [nc.pub("t", b"x"), nc.sub("t", "c"), nc.nop(), nc.auth(b"s")])
def test_tls_required_refuses_commands_before_tls(tls_required_gateway: GatewayProcess, command: bytes) -> None:
    name = command.split(b"\n")[0].split(b" ")[0]
    with RawClient(tls_required_gateway.nsq_tcp) as conn:
        conn.send(command)
        conn.expect_error(b"E_INVALID cannot " + name + b" in current state (TLS required)")
        conn.expect_closed()


def test_tls_required_refuses_after_identify_without_tls(tls_required_gateway: GatewayProcess) -> None:
    with RawClient(tls_required_gateway.nsq_tcp) as conn:
        assert conn.identify()["tls_v1"] is False
        conn.send(nc.pub("t", b"x"))
        conn.expect_error(b"E_INVALID cannot PUB in current state (TLS required)")
        conn.expect_closed()


def test_tls_required_allows_everything_after_tls(
    tls_required_gateway: GatewayProcess, client_tls: ssl.SSLContext
) -> None:
    conn, reply = _tls_client(tls_required_gateway, client_tls)
    assert reply["tls_v1"] is True
    with conn:
        conn.send(nc.pub("after_tls", b"hello"))
        conn.expect_response(b"OK")
        conn.send(nc.sub("after_tls", "ch") + nc.rdy(1))
        conn.expect_response(b"OK")
        assert conn.read_message().body == b"hello"


# -- AUTH -----------------------------------------------------------------------------------------


class AuthServer:
    """nsqd-style auth HTTP server: `GET /auth?...&secret=S` → the reply configured for S."""

    def __init__(self) -> None:
        self.replies: dict[str, tuple[int, dict[str, Any]]] = {}
        self.requests: list[str] = []  # request targets, in order
        self.lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                query = urllib.parse.parse_qs(urllib.parse.urlsplit(self.path).query, keep_blank_values=True)
                secret = query.get("secret", [""])[0]
                with server.lock:
                    server.requests.append(self.path)
                    status, body = server.replies.get(secret, (403, {"message": "unknown secret"}))
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.address = f"127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def queries_for(self, secret: str) -> list[str]:
        needle = "secret=" + urllib.parse.quote_plus(secret) + "&"
        with self.lock:
            return [path for path in self.requests if needle in path]


@pytest.fixture(scope="module")
def auth_server() -> Iterator[AuthServer]:
    server = AuthServer()
    server.thread.start()
    try:
        yield server
    finally:
        server.httpd.shutdown()
        server.httpd.server_close()


@pytest.fixture(scope="module")
def auth_gateway(auth_server: AuthServer) -> Iterator[GatewayProcess]:
    with running_gateway("--auth-http-address", auth_server.address) as gw:
        yield gw


def _grant(*authorizations: dict[str, Any], ttl: int = 3600, identity: str = "alice") -> tuple[int, dict[str, Any]]:
    return 200, {"ttl": ttl, "identity": identity, "identity_url": f"https://id.example/{identity}",
                 "authorizations": list(authorizations)}


PUBLISH_ALLOWED = {"topic": "^allowed", "channels": [".*"], "permissions": ["publish"]}
SUBSCRIBE_OK_CHANNEL = {"topic": "^allowed", "channels": ["^ch-ok$"], "permissions": ["subscribe"]}


def _authed(gw: GatewayProcess, secret: str) -> RawClient:
    conn = RawClient(gw.nsq_tcp)
    assert conn.identify()["auth_required"] is True
    conn.send(nc.auth(secret.encode()))
    frame = conn.read_frame()
    assert frame.is_response, frame
    return conn


def test_identify_says_auth_required(auth_gateway: GatewayProcess) -> None:
    with RawClient(auth_gateway.nsq_tcp) as conn:
        assert conn.identify() == _default_reply(auth_required=True)


@pytest.mark.parametrize(
    ("command", "name"),
    [(nc.pub("allowed", b"x"), "PUB"), (nc.mpub("allowed", [b"x"]), "MPUB"), (nc.dpub("allowed", 10, b"x"), "DPUB"),
     (nc.sub("allowed", "ch-ok"), "SUB")],
)
def test_commands_before_auth_are_fatal(auth_gateway: GatewayProcess, command: bytes, name: str) -> None:
    with RawClient(auth_gateway.nsq_tcp) as conn:
        conn.send(command)
        conn.expect_error(f"E_AUTH_FIRST AUTH required before {name}".encode())
        conn.expect_closed()


def test_auth_reply_and_query(auth_gateway: GatewayProcess, auth_server: AuthServer) -> None:
    secret = "good token/1"
    auth_server.replies[secret] = _grant(PUBLISH_ALLOWED, SUBSCRIBE_OK_CHANNEL)
    with RawClient(auth_gateway.nsq_tcp) as conn:
        conn.identify()
        conn.send(nc.auth(secret.encode()))
        conn.expect_response(
            b'{"identity":"alice","identity_url":"https://id.example/alice","permission_count":2}'
        )
        # Go's url.Values.Encode: sorted keys, QueryEscape (space → +, / → %2F).
        assert auth_server.queries_for(secret) == [
            "/auth?common_name=&remote_ip=127.0.0.1&secret=good+token%2F1&tls=false"
        ]
        conn.send(nc.pub("allowed", b"x"))
        conn.expect_response(b"OK")
        assert len(auth_server.queries_for(secret)) == 1  # cached for the ttl


def test_auth_allows_and_denies_publish(auth_gateway: GatewayProcess, auth_server: AuthServer) -> None:
    auth_server.replies["pub"] = _grant(PUBLISH_ALLOWED)
    with _authed(auth_gateway, "pub") as conn:
        conn.send(nc.pub("allowed_topic", b"x"))
        conn.expect_response(b"OK")
        conn.send(nc.mpub("allowed_topic", [b"a", b"b"]))
        conn.expect_response(b"OK")
        conn.send(nc.dpub("allowed_topic", 10, b"x"))
        conn.expect_response(b"OK")
        conn.send(nc.pub("denied", b"x"))
        conn.expect_error(b'E_UNAUTHORIZED AUTH failed for PUB on "denied" ""')
        conn.expect_closed()
    with _authed(auth_gateway, "pub") as conn:
        conn.send(nc.mpub("denied", [b"x"]))
        conn.expect_error(b'E_UNAUTHORIZED AUTH failed for MPUB on "denied" ""')
        conn.expect_closed()
    with _authed(auth_gateway, "pub") as conn:
        # Publish permission does not grant subscribe.
        conn.send(nc.sub("allowed_topic", "ch-ok"))
        conn.expect_error(b'E_UNAUTHORIZED AUTH failed for SUB on "allowed_topic" "ch-ok"')
        conn.expect_closed()


def test_auth_subscribe_by_channel_regex(auth_gateway: GatewayProcess, auth_server: AuthServer) -> None:
    auth_server.replies["sub"] = _grant(SUBSCRIBE_OK_CHANNEL)
    with _authed(auth_gateway, "sub") as conn:
        conn.send(nc.sub("allowed_sub", "ch-no"))
        conn.expect_error(b'E_UNAUTHORIZED AUTH failed for SUB on "allowed_sub" "ch-no"')
        conn.expect_closed()
    with _authed(auth_gateway, "sub") as conn:
        conn.send(nc.sub("denied", "ch-ok"))
        conn.expect_error(b'E_UNAUTHORIZED AUTH failed for SUB on "denied" "ch-ok"')
        conn.expect_closed()
    with _authed(auth_gateway, "sub") as conn:
        conn.send(nc.pub("allowed_sub", b"x"))  # subscribe permission does not grant publish
        conn.expect_error(b'E_UNAUTHORIZED AUTH failed for PUB on "allowed_sub" ""')
        conn.expect_closed()
    auth_server.replies["both"] = _grant(PUBLISH_ALLOWED, SUBSCRIBE_OK_CHANNEL)
    with _authed(auth_gateway, "both") as producer, _authed(auth_gateway, "sub") as consumer:
        consumer.send(nc.sub("allowed_sub", "ch-ok"))
        consumer.expect_response(b"OK")
        consumer.send(nc.rdy(1))
        producer.send(nc.pub("allowed_sub", b"authorized delivery"))
        producer.expect_response(b"OK")
        assert consumer.read_message().body == b"authorized delivery"


def test_auth_twice_is_fatal(auth_gateway: GatewayProcess, auth_server: AuthServer) -> None:
    auth_server.replies["twice"] = _grant(PUBLISH_ALLOWED)
    with _authed(auth_gateway, "twice") as conn:
        conn.send(nc.auth(b"twice"))
        conn.expect_error(b"E_INVALID AUTH already set")
        conn.expect_closed()
    assert len(auth_server.queries_for("twice")) == 1


def test_auth_without_authorizations(auth_gateway: GatewayProcess, auth_server: AuthServer) -> None:
    auth_server.replies["empty"] = _grant()
    with RawClient(auth_gateway.nsq_tcp) as conn:
        conn.send(nc.auth(b"empty"))
        conn.expect_error(b"E_UNAUTHORIZED AUTH no authorizations found")
        conn.expect_closed()


@pytest.mark.parametrize(
    "reply",
    [(500, {"message": "boom"}), (403, {"message": "nope"}), (200, {"ttl": 0, "authorizations": [PUBLISH_ALLOWED]}),
     (200, {"identity": "no ttl"})],
    ids=["500", "403", "ttl0", "no-ttl"],
)
def test_auth_server_error_is_auth_failed(
    auth_gateway: GatewayProcess, auth_server: AuthServer, reply: tuple[int, dict[str, Any]]
) -> None:
    secret = f"err-{reply[0]}-{len(reply[1])}-{id(reply)}"
    auth_server.replies[secret] = reply
    with RawClient(auth_gateway.nsq_tcp) as conn:
        conn.send(nc.auth(secret.encode()))
        conn.expect_error(b"E_AUTH_FAILED AUTH failed")
        conn.expect_closed()
    assert len(auth_server.queries_for(secret)) == 1


def test_auth_server_down_is_auth_failed() -> None:
    with socket.socket() as placeholder:
        placeholder.bind(("127.0.0.1", 0))
        port = placeholder.getsockname()[1]
    # Nothing listens on `port` any more: connection refused.
    with running_gateway("--auth-http-address", f"127.0.0.1:{port}") as gw, RawClient(gw.nsq_tcp) as conn:
        conn.send(nc.auth(b"anything"))
        conn.expect_error(b"E_AUTH_FAILED AUTH failed")
        conn.expect_closed()
        with RawClient(gw.nsq_tcp) as again:  # the gateway is fine
            again.send(nc.identify({}))
            again.expect_response(b"OK")


CACHED_TTL_S = 3


def test_auth_ttl_expiry_requeries(auth_gateway: GatewayProcess, auth_server: AuthServer) -> None:
    import time

    secret = "short-lived"
    auth_server.replies[secret] = _grant(PUBLISH_ALLOWED, ttl=1)
    with _authed(auth_gateway, secret) as conn:
        conn.send(nc.pub("allowed_ttl", b"1"))
        conn.expect_response(b"OK")
        assert len(auth_server.queries_for(secret)) == 1
        time.sleep(1.15)
        # Granted again, for longer than a loaded machine takes to the next PUB.
        auth_server.replies[secret] = _grant(PUBLISH_ALLOWED, ttl=CACHED_TTL_S)
        conn.send(nc.pub("allowed_ttl", b"2"))
        conn.expect_response(b"OK")
        assert len(auth_server.queries_for(secret)) == 2  # expired: asked again
        # The server now withdraws the grant; the next expiry picks that up.
        auth_server.replies[secret] = _grant({"topic": "^other$", "channels": [".*"], "permissions": ["publish"]},
                                             ttl=1)
        conn.send(nc.pub("allowed_ttl", b"3"))
        conn.expect_response(b"OK")  # still cached
        time.sleep(CACHED_TTL_S + 0.15)
        conn.send(nc.pub("allowed_ttl", b"4"))
        conn.expect_error(b'E_UNAUTHORIZED AUTH failed for PUB on "allowed_ttl" ""')
        conn.expect_closed()
        assert len(auth_server.queries_for(secret)) == 3


def test_auth_ttl_expiry_with_server_failing(auth_gateway: GatewayProcess, auth_server: AuthServer) -> None:
    import time

    secret = "short-then-500"
    auth_server.replies[secret] = _grant(PUBLISH_ALLOWED, ttl=1)
    with _authed(auth_gateway, secret) as conn:
        auth_server.replies[secret] = (500, {"message": "down"})
        time.sleep(1.15)
        conn.send(nc.pub("allowed_ttl2", b"x"))
        conn.expect_error(b"E_AUTH_FAILED AUTH failed")
        conn.expect_closed()


def test_auth_disabled(gateway: GatewayProcess) -> None:
    with RawClient(gateway.nsq_tcp) as conn:
        assert conn.identify()["auth_required"] is False
        conn.send(nc.auth(b"secret"))
        conn.expect_error(b"E_AUTH_DISABLED AUTH disabled")
        conn.expect_closed()


def test_auth_after_tls_reports_tls_true(certs: Certs, client_tls: ssl.SSLContext, auth_server: AuthServer) -> None:
    auth_server.replies["over-tls"] = _grant(PUBLISH_ALLOWED)
    with running_gateway(*_tls_args(certs), "--auth-http-address", auth_server.address) as gw:
        conn, reply = _tls_client(gw, client_tls)
        assert (reply["tls_v1"], reply["auth_required"]) == (True, True)
        with conn:
            conn.send(nc.auth(b"over-tls"))
            conn.expect_response(
                b'{"identity":"alice","identity_url":"https://id.example/alice","permission_count":1}'
            )
            conn.send(nc.pub("allowed_tls", b"x"))
            conn.expect_response(b"OK")
    assert auth_server.queries_for("over-tls") == [
        "/auth?common_name=&remote_ip=127.0.0.1&secret=over-tls&tls=true"
    ]


def test_closed_helper_sanity(gateway: GatewayProcess) -> None:
    """The raw client reports a server close as `Closed` (what the other tests rely on)."""
    with RawClient(gateway.nsq_tcp, magic=False) as conn:
        conn.send(b"XXXX")
        conn.expect_error(b"E_BAD_PROTOCOL")
        with pytest.raises(Closed):
            conn.read_frame(1.0)


def _http_post(gw: GatewayProcess, target: str, body: bytes) -> tuple[int, bytes]:
    request = urllib.request.Request(f"http://{gw.nsq_http}{target}", data=body, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=3.0) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def test_http_publish_refused_when_auth_is_on(auth_gateway: GatewayProcess, gateway: GatewayProcess) -> None:
    # nsqd lets HTTP publishes bypass AUTH (docs/protocols/nsq.md); polymq refuses them.
    refused = (403, b'{"message":"UNAUTHORIZED"}')
    assert _http_post(auth_gateway, "/pub?topic=allowed_http", b"x") == refused
    assert _http_post(auth_gateway, "/mpub?topic=allowed_http", b"a\nb") == refused
    assert _http_post(auth_gateway, "/pub?topic=allowed_http&defer=10", b"x") == refused
    # Without auth the same requests are accepted.
    assert _http_post(gateway, "/pub?topic=open_http", b"x") == (200, b"OK")
    assert _http_post(gateway, "/mpub?topic=open_http", b"a\nb") == (200, b"OK")


def test_a_fatal_command_error_follows_the_answers_to_earlier_publishes(gateway: GatewayProcess) -> None:
    # nsqd answers one command at a time: the OK of a DPUB still being stored comes before the fatal
    # E_AUTH_DISABLED of the AUTH right behind it (found by the flood test, seed 1006).
    with RawClient(gateway.nsq_tcp) as conn:
        conn.send(nc.dpub("fatal_order", 2800, b"d") + nc.pub("fatal_order", b"p") + nc.auth(b"secret")
                  + nc.pub("fatal_order", b"never"))
        frames = []
        with pytest.raises(Closed):
            while True:
                frames.append(conn.read_frame())
    assert [(f.frame_type, f.data) for f in frames] == [(0, b"OK"), (0, b"OK"), (1, b"E_AUTH_DISABLED AUTH disabled")]
