"""A blocking client of the gateway's stream endpoints (gateway/stream_http_api.py): what the
Spark data source calls on the driver and on the executors. One keep-alive HTTP connection,
reopened once if the gateway closed it; every failure is a `StreamClientError` naming the address."""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterable
from typing import Any
from urllib.parse import urlencode

from polymq.clients.tcp import split_address
from polymq.codecs import stream_rows

DEFAULT_TIMEOUT_S = 30.0


class StreamClientError(Exception):
    """The gateway is unreachable or refused: `code` is its error code (None when unreachable)."""

    def __init__(self, message: str, code: str | None = None, status: int | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.status = status


class StreamClient:
    def __init__(self, address: str, timeout: float = DEFAULT_TIMEOUT_S, *, token: str | None = None) -> None:
        try:
            self.host, self.port = split_address(address)
        except ValueError:
            raise StreamClientError(f"gateway address {address!r} is not HOST:PORT") from None
        self.address = address
        self.timeout = timeout
        # A gateway bound beyond loopback asks every stream request for its token (--admin-token).
        self._authorization = {"Authorization": f"Bearer {token}"} if token else {}
        self._connection: http.client.HTTPConnection | None = None

    def close(self) -> None:
        if self._connection is not None:
            self._connection.close()
            self._connection = None

    def __enter__(self) -> StreamClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- requests ------------------------------------------------------------------------------

    def request(self, method: str, path: str, params: Iterable[tuple[str, Any]] = (), body: bytes | None = None,
                content_type: str | None = None) -> bytes:
        target = f"{path}?{urlencode(list(params))}"
        headers = {"Content-Type": content_type} if content_type else {}
        headers.update(self._authorization)
        for attempt in (1, 2):
            if self._connection is None:
                self._connection = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
            try:
                self._connection.request(method, target, body=body, headers=headers)
                response = self._connection.getresponse()
                data = response.read()
            except (OSError, http.client.HTTPException) as error:
                self.close()
                # A kept-alive connection the gateway closed meanwhile fails at once: try a new one.
                if attempt == 1 and isinstance(error, http.client.RemoteDisconnected | ConnectionResetError
                                                      | BrokenPipeError):
                    continue
                raise StreamClientError(f"polymq gateway at {self.address}: {method} {path} failed: "
                                        f"{error or type(error).__name__}") from None
            if response.status != 200:
                raise _refusal(self.address, path, response.status, data)
            return data
        raise AssertionError("unreachable")

    def _json(self, method: str, path: str, params: Iterable[tuple[str, Any]]) -> dict[str, Any]:
        return json.loads(self.request(method, path, params))  # type: ignore[no-any-return]

    def open(self, stream: str, topics: Iterable[str]) -> dict[str, Any]:
        return self._json("POST", "/stream/open", [("stream", stream), *(("topic", topic) for topic in topics)])

    def offsets(self, stream: str, begin: int | None = None, rows: int | None = None) -> dict[str, Any]:
        params: list[tuple[str, Any]] = [("stream", stream)]
        if rows is not None:
            params.append(("rows", rows))
            if begin is not None:
                params.append(("from", begin))
        return self._json("GET", "/stream/offsets", params)

    def split(self, stream: str, begin: int, until: int, parts: int) -> list[int]:
        answer = self._json("GET", "/stream/split", [("stream", stream), ("from", begin), ("to", until),
                                                      ("parts", parts)])
        return [int(bound) for bound in answer["bounds"]]

    def read(self, stream: str, begin: int, until: int, limit: int | None = None) -> list[stream_rows.ReadRow]:
        """Every row of `[begin, until)`, in as many requests as the gateway's batch size takes."""
        rows: list[stream_rows.ReadRow] = []
        while begin < until:
            params: list[tuple[str, Any]] = [("stream", stream), ("from", begin), ("to", until)]
            if limit is not None:
                params.append(("limit", limit))
            batch = list(stream_rows.decode_read_rows(self.request("GET", "/stream/read", params)))
            if not batch:
                break
            rows += batch
            begin = batch[-1].position + 1
        return rows

    def read_batch(self, stream: str, begin: int, until: int, limit: int | None = None,
                   layout: str = "rows") -> bytes:
        """One read answer of `[begin, until)` (fewer rows when the gateway's batch is full), in
        `layout` (`rows` or `columns`, codecs/stream_rows.py)."""
        params: list[tuple[str, Any]] = [("stream", stream), ("from", begin), ("to", until), ("layout", layout)]
        if limit is not None:
            params.append(("limit", limit))
        return self.request("GET", "/stream/read", params)

    def publish(self, rows: list[bytes], topic: str | None = None, dedup: str | None = None,
                first: int = 0) -> dict[str, Any]:
        """Publish encoded rows (`stream_rows.encode_publish_row`) in one request; with `dedup`, row n
        is number `first + n` of that group and rows the group had are not published again."""
        params: list[tuple[str, Any]] = [("topic", topic)] if topic else []
        if dedup is not None:
            params += [("dedup", dedup), ("first", first)]
        return json.loads(self.request("POST", "/stream/publish", params, b"".join(rows),  # type: ignore[no-any-return]
                                       stream_rows.CONTENT_TYPE))

    def snapshot(self, queue: str) -> dict[str, Any]:
        """Take a snapshot of what `queue` (any queue) holds: `{"snapshot": id, "rows": n}`."""
        return self._json("POST", "/stream/snapshot", [("queue", queue)])

    def snapshot_rows(self, snapshot: str, begin: int, until: int, limit: int | None = None,
                      layout: str = "rows") -> bytes:
        """One read batch of rows `[begin, until)` of a snapshot (fewer when the batch is full)."""
        params: list[tuple[str, Any]] = [("snapshot", snapshot), ("from", begin), ("to", until), ("layout", layout)]
        if limit is not None:
            params.append(("limit", limit))
        return self.request("GET", "/stream/snapshot/read", params)

    def snapshot_close(self, snapshot: str) -> None:
        self.request("POST", "/stream/snapshot/close", [("snapshot", snapshot)])

    def commit(self, stream: str, until: int) -> dict[str, Any]:
        return self._json("POST", "/stream/commit", [("stream", stream), ("to", until)])


def _refusal(address: str, path: str, status: int, data: bytes) -> StreamClientError:
    try:
        answer = json.loads(data)
        code, reason = str(answer.get("message")), str(answer.get("reason", ""))
    except (ValueError, AttributeError):
        code, reason = None, data[:200].decode("utf-8", "replace")
    return StreamClientError(f"polymq gateway at {address}: {path} answered {status} {code}: {reason}".rstrip(": "),
                             code, status)
