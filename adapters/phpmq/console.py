"""The PHPMQ maintenance console (TCP 9101): the original's text commands over telnet-style lines.

`help [command]`, `clear`, `monitor` (every queue, redrawn every second until `q`), `search
<text>`, `show <queue>` (one queue, redrawn until `q`), `flush <queue>`, `flushall`, `quit` /
`exit`. Where the original lets anyone who reaches its port delete every queue, polymq listens on
loopback unless told otherwise (`--phpmq-console-bind`), asks for a `yes` before `flush` and
`flushall`, and can refuse them altogether (`--no-phpmq-console-destructive`). The queues are the
engine's: those of every protocol. See docs/protocols/phpmq.md.
"""

from __future__ import annotations

import datetime
import logging
from collections.abc import Callable

from polymq.adapters.session import Listener, StreamSession
from polymq.adapters.transport import Transport
from polymq.core.engine import Engine, Queue
from polymq.core.timers import Timer

log = logging.getLogger("polymq.phpmq")

# A console line longer than this is not a command: it is dropped with an error (bounded memory).
MAX_LINE = 4096
# Live views (`monitor`, `show`) redraw this often.
REFRESH_S = 1.0
# Queues a `monitor` screen lists (the busiest first); `search` finds the others.
MONITOR_ROWS = 40
CLEAR_SCREEN = b"\x1b[2J\x1b[H"
PROMPT = b"phpmq> "
BANNER = "polymq PHPMQ maintenance console. Type `help` for the commands."

HELP = {
    "help": "help [command]   describe the commands, or one of them",
    "clear": "clear            clear the screen",
    "monitor": "monitor          every queue, redrawn every second (type q to leave)",
    "search": "search <text>    the queues whose names contain <text>",
    "show": "show <queue>     one queue, redrawn every second (type q to leave)",
    "flush": "flush <queue>    delete every message of <queue> (asks for confirmation)",
    "flushall": "flushall         delete every message of every queue, of every protocol (asks for confirmation)",
    "quit": "quit | exit      close the console",
}


class ConsoleServer(Listener):
    log = log

    def __init__(self, engine: Engine, *, destructive: bool = True) -> None:
        super().__init__()
        self.engine = engine
        self.destructive = destructive

    def new_session(self, transport: Transport) -> ConsoleSession:
        return ConsoleSession(self, transport)


def _counts(queue: Queue) -> tuple[int, int, int, int, int]:
    return queue.depth, len(queue.in_flight), len(queue.consumers), queue.expired_count, queue.dead_letter_count


class ConsoleSession(StreamSession):
    log = log

    def __init__(self, server: ConsoleServer, transport: Transport) -> None:
        super().__init__(server.engine, transport)
        self.server = server
        self._buffer = b""
        self._dropping = False  # inside an overlong line: skip to its end
        self._confirm: Callable[[], str] | None = None  # what a `yes` now does
        self._view: Callable[[], str] | None = None  # the live view being redrawn
        self._timer: Timer | None = None
        self.send(f"{BANNER}\r\n".encode() + PROMPT)

    def closed(self) -> None:
        self._stop_view()

    def handle(self, data: bytes) -> None:
        self._buffer += data
        while self._stopping is None:
            end = self._buffer.find(b"\n")
            if end < 0:
                if len(self._buffer) > MAX_LINE:
                    self._buffer = b""
                    self._dropping = True
                return
            line, self._buffer = self._buffer[:end], self._buffer[end + 1:]
            if self._dropping or len(line) > MAX_LINE:
                self._dropping = False
                self._say(f"a line longer than {MAX_LINE} bytes is not a command")
                continue
            self._line(line.decode("utf-8", "replace").strip())

    def _say(self, text: str, *, prompt: bool = True) -> None:
        body = text.replace("\n", "\r\n") + "\r\n" if text else ""
        self.send(body.encode() + (PROMPT if prompt else b""))

    def _line(self, line: str) -> None:
        if self._view is not None:
            if line.lower() == "q":
                self._stop_view()
                self._say("")
            return  # a live view takes only `q`
        confirm, self._confirm = self._confirm, None
        if confirm is not None:
            self._say(confirm() if line.lower() == "yes" else "not done (type yes to confirm)")
            return
        command, _, argument = line.partition(" ")
        command, argument = command.lower(), argument.strip()
        if not command:
            self._say("")
        elif command in ("quit", "exit"):
            self._say("bye", prompt=False)
            self.stop("quit")
        elif command == "help":
            self._say(self._help(argument))
        elif command == "clear":
            self.send(CLEAR_SCREEN + PROMPT)
        elif command == "monitor":
            self._start_view(self._monitor)
        elif command == "show" and argument:
            if self.engine.queue(argument) is None:
                self._say(f"no queue {argument!r} (search finds queues by a part of their name)")
            else:
                self._start_view(lambda: self._show(argument))
        elif command == "search" and argument:
            self._say(self._search(argument))
        elif command in ("flush", "flushall"):
            self._ask_flush(command, argument)
        else:
            self._say(f"unknown command or missing argument: {line!r}; type help")

    # -- commands ------------------------------------------------------------------------------

    def _help(self, topic: str) -> str:
        if topic:
            entry = HELP.get("quit" if topic in ("quit", "exit") else topic)
            return entry or f"no command {topic!r}; type help"
        return "Commands:\n" + "\n".join(f"  {text}" for text in HELP.values())

    def _search(self, text: str) -> str:
        found = sorted(name for name in self.engine.queues if text in name)
        if not found:
            return f"no queue name contains {text!r}"
        return "\n".join(f"{name}  ({self.engine.queues[name].depth} ready)" for name in found)

    def _monitor(self) -> str:
        queues = list(self.engine.queues.values())
        totals = [sum(values) for values in zip(*(_counts(q) for q in queues), strict=True)] if queues else [0] * 5
        lines = [f"polymq PHPMQ console - {datetime.datetime.now().replace(microsecond=0).isoformat(' ')}",
                 f"queues: {len(queues)}, ready: {totals[0]}, in flight: {totals[1]}, consumers: {totals[2]}, "
                 f"expired: {totals[3]}, dead letters: {totals[4]}", "",
                 f"{'queue':<40} {'ready':>9} {'in flight':>9} {'consumers':>9} {'expired':>9} {'dead':>9}"]
        for queue in sorted(queues, key=lambda q: (-q.depth, q.name))[:MONITOR_ROWS]:
            ready, in_flight, consumers, expired, dead = _counts(queue)
            lines.append(f"{queue.name[:40]:<40} {ready:>9} {in_flight:>9} {consumers:>9} {expired:>9} {dead:>9}")
        if len(queues) > MONITOR_ROWS:
            lines.append(f"... and {len(queues) - MONITOR_ROWS} more (search finds them)")
        lines += ["", "type q to leave"]
        return "\n".join(lines)

    def _show(self, name: str) -> str:
        queue = self.engine.queue(name)
        if queue is None:
            return f"queue {name!r} is gone\n\ntype q to leave"
        return "\n".join([
            f"queue {name}",
            f"  bound to topics: {', '.join(queue.topics) or '-'}",
            f"  ready: {queue.depth} ({queue.spilled} on disk only)",
            f"  in flight: {len(queue.in_flight)}",
            f"  deferred: {queue.deferred_count}",
            f"  consumers: {len(queue.consumers)}",
            f"  messages so far: {queue.message_count}",
            f"  requeued: {queue.requeue_count}, timed out: {queue.timeout_count}",
            f"  expired: {queue.expired_count}, dead letters: {queue.dead_letter_count}",
            f"  paused: {'yes' if queue.paused else 'no'}",
            "", "type q to leave",
        ])

    def _ask_flush(self, command: str, name: str) -> None:
        if not self.server.destructive:
            self._say(f"{command} is turned off on this gateway (--phpmq-console-destructive)")
            return
        if command == "flush":
            queue = self.engine.queue(name) if name else None
            if queue is None:
                self._say(f"no queue {name!r}" if name else "flush needs a queue name")
                return
            held = queue.depth + len(queue.in_flight) + queue.deferred_count
            self._confirm = lambda: self._flush_queues([name])
            self._say(f"flush {name}: delete its {held} messages? Type yes to confirm.")
            return
        names = list(self.engine.queues)
        held = sum(q.depth + len(q.in_flight) + q.deferred_count for q in self.engine.queues.values())
        self._confirm = lambda: self._flush_queues(names)
        self._say(f"flushall: delete the {held} messages of all {len(names)} queues, of every protocol? "
                  "Type yes to confirm.")

    def _flush_queues(self, names: list[str]) -> str:
        deleted = 0
        for name in names:
            queue = self.engine.queue(name)
            if queue is not None:
                deleted += queue.depth + len(queue.in_flight) + queue.deferred_count
                queue.empty()
        log.warning("%s: console flushed %d messages of %s", self.peer, deleted,
                    names[0] if len(names) == 1 else f"{len(names)} queues")
        return f"flushed: {deleted} messages deleted"

    # -- live views ----------------------------------------------------------------------------

    def _start_view(self, view: Callable[[], str]) -> None:
        self._view = view
        self._redraw()

    def _redraw(self) -> None:
        self._timer = None
        if self._view is None or self._closed:
            return
        self.send(CLEAR_SCREEN + self._view().replace("\n", "\r\n").encode() + b"\r\n")
        self._timer = self.engine.timers.schedule(self.engine.clock.now() + REFRESH_S, self._redraw)

    def _stop_view(self) -> None:
        self._view = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
