"""The gateway's options: read from flags, `POLYMQ_*` variables and a TOML file.

Every option is declared once, as a `Setting` of a section: the gateway's own sections below, and
one section per protocol, whose settings its unit declares (adapters/protocol.py). From that one
declaration come its key in the config file (`[storage] fsync`), its flag (`--fsync`), its
environment variable named after the flag (`POLYMQ_FSYNC`), its help and its check. A flag wins
over a variable, a variable over the file, the file over the default. Every value, wherever it came
from, is checked by the same click type, and an error names the option, what was given and what
is expected, and where (the flag, the variable, or the file and line). `polymq config --show`
prints the effective config as TOML, each option with its help as a comment;
`polymq.example.toml` is that output for the defaults. See docs/operations.md.
"""

from __future__ import annotations

import re
import tomllib
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import attrs
import click
import tomli_w
from click.core import ParameterSource

from polymq.adapters.host_loop import DEFAULT_SPIN_S
from polymq.adapters.protocol import (
    DEFAULT_MAX_CLIENT_OUTPUT,
    DEFAULT_SLOW_CLIENT_GRACE_S,
    PORT,
    Setting,
    options_class,
)
from polymq.adapters.registry import protocols
from polymq.core.dedup import DEFAULT_WINDOW_S as DEFAULT_DEDUP_WINDOW_S
from polymq.core.disk_storage import MEM_QUEUE_SIZE, FsyncPolicy
from polymq.core.engine import OVERFLOW_DROP_OLDEST, OVERFLOW_REJECT
from polymq.core.trace import DEFAULT_RING_SIZE
from polymq.gateway.admin_access import MIN_TOKEN_LENGTH
from polymq.gateway.stream_http_api import DEFAULT_MAX_BATCH, DEFAULT_MAX_ROW, DEFAULT_SNAPSHOT_MEMORY
from polymq.gateway.tracing import DEFAULT_TRACE_TOPIC

# polymq binds loopback unless told otherwise (nsqd binds every interface).
DEFAULT_BIND = "127.0.0.1"
# The gateway's own HTTP listener (the Spark stream API): 4171 stays free for nsqadmin.
DEFAULT_HTTP_PORT = 4181
# Copies of a stream: JetStream's usual R3 (a majority survives one server's loss).
DEFAULT_JETSTREAM_REPLICAS = 3
# nsqd's default --msg-timeout.
DEFAULT_JETSTREAM_ACK_WAIT_S = 60.0
# A trace keeps enough of a body to tell messages apart and search them, never the body itself.
MAX_TRACE_BODY_PREFIX = 1024
ENV_PREFIX = "POLYMQ_"


class FsyncType(click.ParamType):
    name = "always|never|interval:MS"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> FsyncPolicy:
        if isinstance(value, FsyncPolicy):
            return value
        try:
            return FsyncPolicy.parse(str(value))
        except ValueError:
            self.fail(f"must be always, never or interval:MS (MS > 0), not {value!r}", param, ctx)


# The event loops `--loop` chooses from (gateway/serve.py).
LOOP_EPOLL = "epoll"
LOOP_TRIO = "trio"

# The gateway's own sections: "" is the top of the file.
GATEWAY_SECTIONS: dict[str, tuple[Setting, ...]] = {
    "": (
        Setting("bind", "--bind", click.STRING, DEFAULT_BIND, "Address every listener binds to (loopback by default)."),
        Setting("loop", "--loop", click.Choice([LOOP_EPOLL, LOOP_TRIO]), LOOP_EPOLL,
                "epoll: the TCP sessions' sockets stay registered with an epoll loop that owns the thread and "
                "answers each read at once, trio runs the rest as its guest; trio: everything on trio's loop."),
        Setting("loop_spin_us", "--loop-spin", click.IntRange(min=0, max=10_000), round(DEFAULT_SPIN_S * 1e6),
                "Microseconds the epoll loop keeps polling after serving sockets before it sleeps (0 = never): "
                "a client's next request often comes sooner than a sleep and a wake-up take."),
    ),
    "storage": (
        Setting("data_dir", "--data-dir", click.Path(file_okay=False, path_type=Path), Path("data"),
                "Where the embedded durable store keeps its files (created if missing; a relative path in a "
                "config file is relative to that file)."),
        Setting("fsync", "--fsync", FsyncType(), FsyncPolicy(),
                "always: acknowledge after fdatasync (group commit); interval:MS: acknowledge after the write, "
                "fdatasync every MS (an OS crash or power cut loses at most MS of acknowledged publishes); "
                "never: leave it to the OS (a process crash loses nothing, an OS crash may)."),
        Setting("mem_queue_size", "--mem-queue-size", click.IntRange(min=0), MEM_QUEUE_SIZE,
                "Messages per queue and topic kept in memory; the rest are read back from disk (nsqd's flag)."),
        Setting("dedup_window_s", "--dedup-window", click.FloatRange(min=1), DEFAULT_DEDUP_WINDOW_S,
                "Seconds a publishing writer's row groups are remembered (a Spark batch replayed later than this "
                "after its first try may publish its rows again); kept in the store."),
        Setting("snapshot_memory_mb", "--snapshot-memory", click.IntRange(min=1), DEFAULT_SNAPSHOT_MEMORY >> 20,
                "MiB the batch-read snapshots of queues held at once may take for the messages they read back "
                "from disk; a snapshot past it is refused (HTTP 413)."),
        Setting("in_memory", "--in-memory", click.BOOL, False,
                "Keep nothing on disk (benchmarks, throwaway tests): a restart starts empty."),
    ),
    "limits": (
        Setting("max_client_output", "--max-client-output", click.IntRange(min=0), DEFAULT_MAX_CLIENT_OUTPUT,
                "Bytes of output a TCP client may leave unread; past it for --slow-client-grace the client is "
                "disconnected with its protocol's error and what it held goes back to its queues (0 = no limit)."),
        Setting("slow_client_grace_ms", "--slow-client-grace", click.IntRange(min=1),
                int(DEFAULT_SLOW_CLIENT_GRACE_S * 1000),
                "How long a TCP client's unread output may stay past --max-client-output, in ms."),
        Setting("max_queue_depth", "--max-queue-depth", click.IntRange(min=0), 0,
                "Ready messages a queue may hold; past it --queue-overflow applies (0 = no limit)."),
        Setting("queue_overflow", "--queue-overflow", click.Choice([OVERFLOW_REJECT, OVERFLOW_DROP_OLDEST]),
                OVERFLOW_REJECT,
                "reject: a publish to a full queue is refused with its protocol's error; drop-oldest: it is "
                "taken and the queue's oldest ready messages are dropped."),
    ),
    "http": (
        Setting("port", "--admin-port", PORT, DEFAULT_HTTP_PORT,
                "The gateway's own HTTP listener (the admin page, /metrics, the Spark stream API) TCP port "
                "(0 = any free, -1 = off)."),
        Setting("bind", "--admin-bind", click.STRING, DEFAULT_BIND,
                "Address the gateway's own HTTP listener binds to, whatever --bind says (loopback by default); "
                "beyond loopback it needs --admin-token or --admin-token-file."),
        Setting("token", "--admin-token", click.STRING, None,
                f"Token the admin API and its actions ask for (`Authorization: Bearer TOKEN`, at least "
                f"{MIN_TOKEN_LENGTH} characters); needed when --admin-bind is beyond loopback. "
                "--admin-token-file keeps it out of the process list.", secret=True),
        Setting("token_file", "--admin-token-file", click.Path(dir_okay=False, path_type=Path), None,
                "A file whose first line is the token (as --admin-token), read at start-up."),
        Setting("max_row_size", "--stream-max-row-size", click.IntRange(min=1), DEFAULT_MAX_ROW,
                "Largest row a Spark job may publish through the stream API, in bytes (nsqd's --max-msg-size)."),
        Setting("max_batch_size", "--stream-max-batch-size", click.IntRange(min=1), DEFAULT_MAX_BATCH,
                "Largest batch of rows one stream publish may carry, in bytes (nsqd's --max-body-size)."),
    ),
    "jetstream": (
        Setting("servers", "--jetstream", click.STRING, (),
                "NATS servers of a JetStream cluster (nats://host:port, tls://host:port; several with commas or "
                "again): every protocol's topics and queues live there instead of the embedded store, shared by "
                "every polymq node pointed at the same cluster (docs/cluster.md).", multiple=True),
        Setting("replicas", "--jetstream-replicas", click.IntRange(min=1, max=5), DEFAULT_JETSTREAM_REPLICAS,
                "Copies of each topic's stream in the cluster (fewer when the cluster has fewer servers)."),
        Setting("ack_wait_s", "--jetstream-ack-wait", click.FloatRange(min=1), DEFAULT_JETSTREAM_ACK_WAIT_S,
                "Seconds after which a delivery a node never finished (the node died) is delivered again, "
                "by any node (nsqd's default msg_timeout)."),
        Setting("user", "--jetstream-user", click.STRING, None, "User name for the NATS servers."),
        Setting("password", "--jetstream-password", click.STRING, None, "Password for the NATS servers.",
                secret=True),
        Setting("token", "--jetstream-token", click.STRING, None, "Token for the NATS servers.", secret=True),
        Setting("tls_ca", "--jetstream-tls-ca", click.Path(dir_okay=False, path_type=Path), None,
                "CA certificates (PEM) the NATS servers' certificates are checked against; turns TLS on."),
        Setting("tls_cert", "--jetstream-tls-cert", click.Path(dir_okay=False, path_type=Path), None,
                "This node's client certificate (PEM) for servers that ask for one; turns TLS on."),
        Setting("tls_key", "--jetstream-tls-key", click.Path(dir_okay=False, path_type=Path), None,
                "The private key (PEM) of --jetstream-tls-cert."),
    ),
    "trace": (
        Setting("topics", "--trace", click.STRING, (),
                "Topics whose messages are traced from start-up: each one's life, across queues and protocols, on "
                "the admin page and on the trace topic (again for each topic; the admin page switches it too).",
                multiple=True),
        Setting("topic", "--trace-topic", click.STRING, DEFAULT_TRACE_TOPIC,
                "The topic every trace event is also published to, as one JSON message (read it with any "
                "protocol's client); never traced itself."),
        Setting("ring_size", "--trace-ring-size", click.IntRange(min=1), DEFAULT_RING_SIZE,
                "Events kept in memory per traced topic (and messages, at most as many); the oldest are dropped "
                "first and counted."),
        Setting("body_prefix", "--trace-body-prefix", click.IntRange(min=0, max=MAX_TRACE_BODY_PREFIX), 0,
                "Bytes of each traced message's body kept in its trace (searchable on the admin page); 0 keeps "
                "none."),
    ),
    "log": (
        Setting("level", "--log-level", click.Choice(["debug", "info", "warning", "error"]), "info",
                "Least severe log lines written."),
        Setting("format", "--log-format", click.Choice(["text", "json"]), "text",
                "text: one line per record for people; json: one JSON object per line for machines."),
    ),
}
# The data dir's key: `--in-memory` leaves it without use, so the two are not given together.
DATA_DIR_KEY = "storage.data_dir"
# The gateway's own HTTP listener, as the endpoints of protocols are named in log lines.
HTTP_LISTENER = "http"


@attrs.frozen
class Option:
    """One option of a section, as the command line, the variables and the file see it."""

    section: str  # "storage", a protocol's name, or "" for the top of the file
    setting: Setting

    @property
    def key(self) -> str:
        return f"{self.section}.{self.setting.name}" if self.section else self.setting.name

    @property
    def name(self) -> str:
        """The click parameter's name."""
        return self.key.replace(".", "__")

    @property
    def field(self) -> str:
        return self.setting.name

    @property
    def flag(self) -> str:
        return self.setting.flag

    @property
    def type(self) -> click.ParamType:
        return self.setting.type

    @property
    def default(self) -> Any:
        return self.setting.default

    @property
    def help(self) -> str:
        return self.setting.help

    @property
    def envvar(self) -> str:
        return ENV_PREFIX + self.flag.split("/")[0].removeprefix("--").replace("-", "_").upper()

    @property
    def is_switch(self) -> bool:
        return self.setting.is_switch

    @property
    def multiple(self) -> bool:
        return self.setting.multiple


def sections() -> dict[str, tuple[Setting, ...]]:
    """Every section, the gateway's and then each protocol's, in the order the file lists them."""
    found = {name: settings for name, settings in GATEWAY_SECTIONS.items() if name != "log"}
    for unit in protocols():
        if unit.name in GATEWAY_SECTIONS:
            raise click.UsageError(f"protocol {unit.name!r} takes the name of a section of the gateway's own")
        found[unit.name] = unit.all_settings
    found["log"] = GATEWAY_SECTIONS["log"]
    return found


def all_options() -> tuple[Option, ...]:
    options = tuple(Option(section, setting) for section, settings in sections().items() for setting in settings)
    seen: dict[str, Option] = {}
    for option in options:
        flag = option.flag.split("/")[0]
        if flag in seen:
            raise click.UsageError(f"{option.key} and {seen[flag].key} both use the flag {flag}")
        seen[flag] = option
    return options


OPTIONS = all_options()
OPTIONS_BY_KEY = {option.key: option for option in OPTIONS}
SECTION_CLASSES: dict[str, type] = {name: options_class(name, settings) for name, settings in sections().items()
                                    if name not in {unit.name for unit in protocols()}}
SECTION_CLASSES.update({unit.name: unit.options_class for unit in protocols()})


def _default_sections() -> dict[str, Any]:
    return {name: cls() for name, cls in SECTION_CLASSES.items()}


@attrs.frozen
class Config:
    """The effective options: one options object per section (attributes named as its settings)."""

    sections: Mapping[str, Any] = attrs.field(factory=_default_sections)
    # The dotted keys a flag, a variable or the config file set (the rest kept their defaults):
    # start-up refuses options that contradict each other only when both were asked for.
    given: frozenset[str] = frozenset()

    @property
    def bind(self) -> str:
        return str(self.sections[""].bind)

    @property
    def loop(self) -> str:
        return str(self.sections[""].loop)

    @property
    def loop_spin_s(self) -> float:
        return int(self.sections[""].loop_spin_us) / 1e6

    @property
    def storage(self) -> Any:
        return self.sections["storage"]

    @property
    def http(self) -> Any:
        return self.sections["http"]

    @property
    def limits(self) -> Any:
        return self.sections["limits"]

    @property
    def jetstream(self) -> Any:
        return self.sections["jetstream"]

    @property
    def trace(self) -> Any:
        return self.sections["trace"]

    @property
    def log(self) -> Any:
        return self.sections["log"]

    def protocol(self, name: str) -> Any:
        return self.sections[name]


class ConfigError(click.UsageError):
    """A bad option value from the config file (flags and variables get click's own errors)."""


# -- the config file ---------------------------------------------------------------------------


def _key_lines(text: str) -> dict[str, int]:
    """The line of each `key = …` of a TOML file, by dotted key (for error messages)."""
    lines: dict[str, int] = {}
    section = ""
    for number, line in enumerate(text.splitlines(), start=1):
        stripped = line.strip()
        header = re.fullmatch(r"\[\s*([A-Za-z0-9_.-]+)\s*\]\s*(#.*)?", stripped)
        if header:
            section = header.group(1)
            lines.setdefault(section, number)
            continue
        key = re.match(r"([A-Za-z0-9_-]+)\s*=", stripped)
        if key:
            lines.setdefault(f"{section}.{key.group(1)}" if section else key.group(1), number)
    return lines


def _where(path: Path, lines: Mapping[str, int], key: str) -> str:
    line = lines.get(key)
    return f"{path} line {line}" if line else str(path)


def read_file(path: Path) -> dict[str, tuple[Any, str]]:
    """The options a TOML file sets: dotted key → (checked value, where it was set)."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(f"cannot read config file {path}: {getattr(error, 'strerror', None) or error}") from None
    try:
        document = tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"{path}: not valid TOML: {error}") from None
    lines = _key_lines(text)
    flat: dict[str, Any] = {}
    section_names = set(SECTION_CLASSES) - {""}
    for name, value in document.items():
        if isinstance(value, dict) and name in section_names:
            flat.update({f"{name}.{key}": item for key, item in value.items()})
        elif name in section_names:
            raise ConfigError(f"{_where(path, lines, name)}: {name} is a section, not an option: write [{name}] "
                              "and its options on the lines below it")
        else:
            flat[name] = value
    found: dict[str, tuple[Any, str]] = {}
    for key, value in flat.items():
        where = _where(path, lines, key)
        option = OPTIONS_BY_KEY.get(key)
        if option is None:
            raise ConfigError(f"{where}: unknown option {key!r} (`polymq config --show` lists them)")
        if option.multiple:
            if not isinstance(value, list):
                raise ConfigError(f"{where}: {key} must be an array of values ([...]), not {value!r}")
            found[key] = (tuple(_checked(path, where, key, option, item) for item in value), where)
            continue
        if isinstance(value, dict | list):
            raise ConfigError(f"{where}: {key} must be a single value")
        found[key] = (_checked(path, where, key, option, value), where)
    return found


def _checked(path: Path, where: str, key: str, option: Option, value: Any) -> Any:
    """One value of the file, checked by the option's click type."""
    if isinstance(value, dict | list):
        raise ConfigError(f"{where}: {key} must hold single values, not {value!r}")
    if isinstance(option.type, click.Path) and isinstance(value, str) and not Path(value).is_absolute():
        value = str(path.parent / value)
    if option.is_switch and not isinstance(value, bool):
        raise ConfigError(f"{where}: {key} must be true or false, not {value!r}")
    try:
        return option.type.convert(value, None, None)
    except click.BadParameter as error:
        wanted = expected(option.type)
        if wanted is None:  # the type's own message says what it wants
            raise ConfigError(f"{where}: {key}: {error.message}") from None
        raise ConfigError(f"{where}: {key} = {value!r}: expected {wanted}") from None


class SourcedOption(click.Option):
    """An option whose error names where the bad value came from: the flag or the variable."""

    def get_error_hint(self, ctx: click.Context | None) -> str:
        flag = "/".join(f"'{opt}'" for opt in self.opts)
        if ctx is not None and self.name and ctx.get_parameter_source(self.name) is ParameterSource.ENVIRONMENT:
            return f"variable {self.envvar!s}"
        return flag


# -- from the command line to a Config ----------------------------------------------------------

F = TypeVar("F", bound=Callable[..., Any])


def click_options(function: F) -> F:
    """Adds `--config` and every option of the table to a click command."""
    for option in reversed(OPTIONS):
        flag = option.flag
        kwargs: dict[str, Any] = {"cls": SourcedOption, "envvar": option.envvar, "show_envvar": True,
                                  "help": option.help, "default": option.default}
        if "/" in flag:
            declarations = [flag]
        elif option.type is click.BOOL:
            declarations, kwargs["is_flag"] = [flag], True
        else:
            declarations = [flag]
            kwargs["type"] = option.type
            kwargs["show_default"] = option.default is not None and str(option.default)
            if option.multiple:
                # Given again for each value; click splits its variable at whitespace.
                kwargs["multiple"] = True
                kwargs["show_default"] = bool(option.default) and " ".join(map(str, option.default))
        function = click.option(*declarations, option.name, **kwargs)(function)
    return click.option(
        "--config", "config_file", type=click.Path(dir_okay=False, path_type=Path), envvar=ENV_PREFIX + "CONFIG",
        show_envvar=True, default=None, help="A TOML config file (`polymq config --show` prints one).",
    )(function)


def from_command_line(ctx: click.Context, values: Mapping[str, Any]) -> Config:
    """The effective config: a flag wins over a variable, a variable over the file, the file over the default."""
    from_file: dict[str, tuple[Any, str]] = {}
    config_file = values.get("config_file")
    if config_file is not None:
        from_file = read_file(config_file)
    chosen: dict[str, Any] = {}
    given: set[str] = set()
    for option in OPTIONS:
        source = ctx.get_parameter_source(option.name)
        value = values[option.name]
        if source in (ParameterSource.DEFAULT, None):
            if option.key in from_file:
                value = from_file[option.key][0]
                given.add(option.key)
        else:
            given.add(option.key)
        chosen[option.key] = value
    return build(chosen, frozenset(given))


def build(chosen: Mapping[str, Any], given: frozenset[str] = frozenset()) -> Config:
    """A Config from checked values by dotted key (missing keys keep their defaults); `given`: the
    keys a flag, a variable or the file set."""
    nested: dict[str, dict[str, Any]] = {name: {} for name in SECTION_CLASSES}
    for key, value in chosen.items():
        section, _, field = key.rpartition(".")
        nested[section][field] = value
    return Config({name: SECTION_CLASSES[name](**values) for name, values in nested.items()}, given)


def expected(kind: click.ParamType) -> str | None:
    """What one of click's types takes, in words (None for a type whose errors say it themselves)."""
    if isinstance(kind, click.IntRange | click.FloatRange):
        number = "a whole number" if isinstance(kind, click.IntRange) else "a number"
        if kind.min is not None and kind.max is not None:
            return f"{number} from {kind.min} to {kind.max}"
        if kind.min is not None:
            return f"{number} of at least {kind.min}"
        return number
    if isinstance(kind, click.Choice):
        return "one of " + ", ".join(map(str, kind.choices))
    if isinstance(kind, click.Path):
        return "a path"
    if kind is click.STRING:
        return "a text in quotes"
    return None


# -- printing a config --------------------------------------------------------------------------


def _wrap(text: str, width: int = 98) -> Iterable[str]:
    line = "#"
    for word in text.split():
        if len(line) + 1 + len(word) > width:
            yield line
            line = "#"
        line += " " + word
    yield line


def _unused(config: Config, option: Option) -> bool:
    """An option the rest of the config leaves without effect: printed as a comment, so that the
    printed file, read back, is not refused for contradicting itself."""
    return option.key == DATA_DIR_KEY and bool(config.storage.in_memory)


def to_toml(config: Config) -> str:
    """The config as TOML, every option with its help, flag and variable as a comment."""
    out = ["# polymq's configuration: `polymq serve --config FILE`. Flags and POLYMQ_* variables win over",
           "# this file. Printed by `polymq config --show`; every option is described in docs/operations.md."]
    for section, values in config.sections.items():
        out.append("")
        if section:
            out.append(f"[{section}]")
        for option in OPTIONS:
            if option.section != section:
                continue
            out.extend(_wrap(f"{option.help} ({option.flag.split('/')[0]}, {option.envvar})"))
            value = getattr(values, option.field)
            if isinstance(value, Path | FsyncPolicy):
                value = str(value)
            elif option.multiple:
                value = [str(item) if isinstance(item, Path) else item for item in value]
            if value is None:
                out.append(f"# {option.field} = (not set)")
            elif _unused(config, option):
                out.append(f"# {tomli_w.dumps({option.field: value}).rstrip()} (not used with in_memory)")
            elif option.setting.secret:
                out.append(f"# {option.field} = (set, not shown)")
            else:
                out.append(tomli_w.dumps({option.field: value}).rstrip("\n"))
    return "\n".join(out) + "\n"
