"""One format for every log line of the gateway: timestamp, level, component, message.

`text` is for people (`2026-11-24 10:00:00.123 INFO    storage  restored …`), `json` one object
per line for machines (`{"time": …, "level": …, "component": …, "message": …}`). The component
is the logger's name below `polymq` (a protocol's, `storage`, `http` — hypercorn's lines are
logged there too); the gateway's own lines say `gateway`. See docs/operations.md.
"""

from __future__ import annotations

import json
import logging
import re
import sys
import time
from typing import Any

ROOT = "polymq"
# The widest component name, so that messages line up in the text format.
COMPONENT_WIDTH = 8


def component(name: str) -> str:
    if name == ROOT:
        return "gateway"
    return name.removeprefix(ROOT + ".")


# What a client chooses (identities, names, bodies) reaches log lines: every control character
# (C0, DEL, C1) and the Unicode line and paragraph separators is written as an escape, so a value
# can neither start a forged line, nor make `grep` call the log binary, nor drive a terminal.
_UNPRINTABLE = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def _escape(match: re.Match[str]) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def message(record: logging.LogRecord) -> str:
    """The record's message with every unprintable character escaped, whoever wrote it."""
    return _UNPRINTABLE.sub(_escape, record.getMessage())


def _timestamp(record: logging.LogRecord) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(record.created)) + f".{int(record.msecs):03d}"


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line = (f"{_timestamp(record)} {record.levelname:<7} {component(record.name):<{COMPONENT_WIDTH}} "
                f"{message(record)}")
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


class JSONFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": _timestamp(record),
            "level": record.levelname,
            "component": component(record.name),
            "message": message(record),
        }
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


def configure(level: str, log_format: str) -> None:
    """Every record of the process (polymq's, hypercorn's, any library's) goes to stderr in one format."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JSONFormatter() if log_format == "json" else TextFormatter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
