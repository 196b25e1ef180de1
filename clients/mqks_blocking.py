"""A blocking MQKS client that speaks exact lines: requests are the codec's
(`polymq.codecs.mqks_client`), response lines come back one at a time within a deadline.

`barrier()` is how a caller proves that nothing more came: it sends a ping with a fresh id and
returns every line that arrived before its answer (the server answers one connection in order).
The trio client with the original library's reconnects is `polymq.clients.mqks`.

    with Connection(("127.0.0.1", 25000)) as conn:
        conn.request("p1", "ping", "hello")
        line = conn.next_line()              # b"p1 ok hello"; None when nothing came in time
"""

from __future__ import annotations

import collections
import itertools
import secrets
import time

from polymq.clients import tcp
from polymq.codecs import mqks_client as codec

DEFAULT_TIMEOUT_S = 3.0
BARRIER_DATA = "barrier"
_barriers = itertools.count(1)


class NotAResponse(codec.ResponseError):
    """A line that is not a response at all (`line`)."""

    def __init__(self, line: bytes) -> None:
        super().__init__(f"not a response: {line[:80]!r}")
        self.line = line


class Connection(tcp.Connection):
    def __init__(self, address: tuple[str, int] | str, timeout: float = DEFAULT_TIMEOUT_S) -> None:
        super().__init__(address, timeout)
        self._reader = codec.LineReader()
        self._lines: collections.deque[bytes] = collections.deque()

    def request(self, request_id: str, action: str, data: str | bytes, *, confirm: bool = False) -> str:
        """Send one request line; returns it as text without its `\\n` (for messages)."""
        line = codec.request(request_id, action, data, confirm=confirm)
        self.send(line)
        return line[:-1].decode(errors="replace")

    def read_lines(self, deadline: float) -> bool:
        """One read into the line buffer; False when the deadline passed first. Raises tcp.Closed,
        and codec.ResponseError for a line longer than any response."""
        data = self.receive(deadline)
        if data is None:
            return False
        self._lines.extend(self._reader.feed(data))
        return True

    def buffered(self) -> bytes | None:
        """The next line already read, if any (no read)."""
        return self._lines.popleft() if self._lines else None

    def unread(self, lines: list[bytes]) -> None:
        """Put lines back in front of what is still unread, in their order."""
        self._lines.extendleft(reversed(lines))

    def next_line(self, timeout: float | None = None) -> bytes | None:
        """The next line (without `\\n`) within `timeout` (the connection's when not given), or None."""
        deadline = self.deadline(timeout)
        while not self._lines:
            if not self.read_lines(deadline):
                return None
        return self._lines.popleft()

    def read_until_closed(self, timeout: float | None = None) -> tuple[list[bytes], bool]:
        """Every line until the server closes (True) or `timeout` passes (False)."""
        deadline = self.deadline(timeout)
        lines: list[bytes] = []
        try:
            while (line := self.next_line(max(0.0, deadline - time.monotonic()))) is not None:
                lines.append(line)
        except tcp.Closed:
            return lines, True
        return lines, False

    @staticmethod
    def barrier_id() -> str:
        """A fresh request id for `barrier`."""
        return f"barrier{next(_barriers)}-{secrets.token_hex(3)}"

    @staticmethod
    def pong(request_id: str) -> bytes:
        """The answer to the ping of `barrier(request_id)`."""
        return f"{request_id} ok {BARRIER_DATA}".encode()

    def barrier(self, request_id: str | None = None) -> list[bytes]:
        """Every line that came before the answer to a ping sent now. Raises TimeoutError when the
        answer does not come within the timeout, NotAResponse for a line that is not a response at
        all (no point waiting for the answer then)."""
        request_id = request_id or self.barrier_id()
        self.request(request_id, "ping", BARRIER_DATA)
        pong = self.pong(request_id)
        deadline = self.deadline()
        before: list[bytes] = []
        while (line := self.next_line(max(0.0, deadline - time.monotonic()))) != pong:
            if line is None:
                raise TimeoutError(f"nothing within {self.timeout} s")
            try:
                codec.parse_response(line)
            except codec.ResponseError:
                raise NotAResponse(line) from None
            before.append(line)
        return before
