"""Who may use the admin API and its actions (docs/operations.md, "The admin page").

Bound beyond loopback, the gateway's listener is open to the network, so a token is required:
start-up fails without one. With a token, every `/api/...`, `/metrics` and `/stream/...` request
must carry it as `Authorization: Bearer TOKEN` (401 without it, 403 with another one); `/ping` stays
open. Without a token the listener is on loopback, and the API still refuses what a web page
elsewhere could make a browser send: a request whose Host is not a loopback name (a page whose own
name was pointed at 127.0.0.1) and an action posted from another origin.
"""

from __future__ import annotations

import hmac
import ipaddress
import re
from pathlib import Path
from urllib.parse import urlsplit

import attrs

from polymq.adapters.http import JSON_TYPE, Request, Response, go_json

# The shortest token taken: 16 random characters are far past guessing over HTTP (`openssl rand
# -hex 16` gives 32).
MIN_TOKEN_LENGTH = 16
# What a token may hold: visible ASCII, as an HTTP header value carries it unchanged.
TOKEN_CHARACTERS = re.compile(r"[!-~]+")
LOOPBACK_NAMES = frozenset({"localhost", "localhost."})


class AccessError(Exception):
    """The admin listener's access cannot be set up as configured: the message names the option."""


def is_loopback(host: str) -> bool:
    """An address (or `localhost`) only this machine reaches; a host name is not taken on trust."""
    host = host.strip().removeprefix("[").removesuffix("]").lower()
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def read_token(token: str | None, token_file: Path | None) -> str | None:
    """The token from `--admin-token` or the first line of `--admin-token-file`, checked."""
    if token is not None and token_file is not None:
        raise AccessError("give --admin-token or --admin-token-file, not both")
    option = "--admin-token"
    if token_file is not None:
        option = f"--admin-token-file {token_file}"
        try:
            lines = token_file.read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as error:
            why = getattr(error, "strerror", None) or str(error)
            raise AccessError(f"cannot read {option}: {why.lower()}") from None
        token = lines[0].strip() if lines else ""
    if token is None:
        return None
    if not TOKEN_CHARACTERS.fullmatch(token):
        raise AccessError(f"{option}: the token must be visible ASCII characters without spaces")
    if len(token) < MIN_TOKEN_LENGTH:
        raise AccessError(f"{option}: the token must have at least {MIN_TOKEN_LENGTH} characters "
                          "(`openssl rand -hex 16` makes one)")
    return token


def _refusal(status: int, code: str, reason: str, headers: tuple[tuple[str, str], ...] = ()) -> Response:
    return Response(status, go_json({"message": code, "reason": reason}), JSON_TYPE, headers)


def _host_name(host: bytes) -> str:
    """The name of a Host header's `name:port`, `[v6]:port` or `name`."""
    text = host.decode("latin-1")
    return urlsplit(f"//{text}").hostname or ""


@attrs.frozen(slots=True)
class AdminAccess:
    token: str | None  # None: loopback only, no token asked for

    @classmethod
    def configured(cls, bind: str, token: str | None, token_file: Path | None) -> AdminAccess:
        found = read_token(token, token_file)
        if found is None and not is_loopback(bind):
            raise AccessError(f"--admin-bind {bind} is beyond loopback: give --admin-token-file (or --admin-token) "
                              "so that the admin API and its actions ask for a token")
        return cls(found)

    def describe(self, address: str) -> str:
        """The start-up line saying how the admin page and its API are guarded."""
        if self.token is not None:
            return (f"admin page http://{address}/: the API and its actions, /metrics and the stream API ask for the "
                    "token (Authorization: Bearer)")
        return (f"admin page http://{address}/: the API and its actions are open to this machine's users "
                "without a token (loopback only; --admin-token-file sets one)")

    def token_refused(self, request: Request, what: str = "the admin API") -> Response | None:
        """Why `request` is refused for lack of the token (401) or with another one (403); None when it
        carries the token, or when none is required (loopback without --admin-token)."""
        if self.token is None:
            return None
        scheme, _, given = (request.header(b"authorization") or b"").decode("latin-1").partition(" ")
        if scheme.lower() != "bearer" or not given.strip():
            return _refusal(401, "UNAUTHORIZED", f"{what} asks for its token: Authorization: Bearer TOKEN",
                            (("WWW-Authenticate", 'Bearer realm="polymq"'),))
        if not hmac.compare_digest(given.strip().encode("latin-1"), self.token.encode("ascii")):
            return _refusal(403, "FORBIDDEN", f"the token is not the one {what} asks for"
                            if what != "the admin API" else "the token is not the admin API's")
        return None

    def refused(self, request: Request) -> Response | None:
        """Why `request` to the admin API is refused, or None when it may go on."""
        if self.token is not None:
            return self.token_refused(request)
        host = request.header(b"host") or b""
        if not is_loopback(_host_name(host)):
            return _refusal(403, "FORBIDDEN", "without --admin-token the admin API answers only requests to a "
                                              "loopback address or localhost")
        origin = request.header(b"origin")
        if request.method != "GET" and origin is not None and urlsplit(origin.decode("latin-1")).netloc.encode(
                "latin-1") != host:
            return _refusal(403, "FORBIDDEN", "an action is taken only from the admin page itself")
        return None
