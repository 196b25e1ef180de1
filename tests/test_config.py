"""One config: flags, POLYMQ_* variables and a TOML file, `polymq config --show`, and the log lines."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import tomllib
from pathlib import Path

import polymq.adapters.nsq as nsq_unit
from polymq.codecs import nsq_client
from polymq.gateway.config import OPTIONS, Config, build, to_toml

from support.gateway import running_gateway

ROOT = Path(__file__).resolve().parent.parent
CLEAN_ENV = {key: value for key, value in os.environ.items() if not key.startswith("POLYMQ_")}


def _polymq(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "polymq", *args], capture_output=True, text=True, timeout=30,
                          env={**CLEAN_ENV, **(env or {})}, cwd=cwd)


def _shown(*args: str, env: dict[str, str] | None = None) -> dict[str, object]:
    result = _polymq("config", "--show", *args, env=env)
    assert result.returncode == 0, result.stderr
    return tomllib.loads(result.stdout)


def test_a_flag_wins_over_a_variable_which_wins_over_the_file(tmp_path: Path) -> None:
    config = tmp_path / "polymq.toml"
    config.write_text('[mqks]\nport = 1111\n[storage]\nfsync = "never"\n')
    assert _shown("--config", str(config))["mqks"] == {**_shown()["mqks"], "port": 1111}
    assert _shown("--config", str(config), env={"POLYMQ_MQKS_PORT": "2222"})["mqks"]["port"] == 2222  # type: ignore[index]
    flagged = _shown("--config", str(config), "--mqks-port", "3333", env={"POLYMQ_MQKS_PORT": "2222"})
    assert flagged["mqks"]["port"] == 3333  # type: ignore[index]
    assert flagged["storage"]["fsync"] == "never"  # type: ignore[index]


def test_the_config_file_can_be_named_by_a_variable(tmp_path: Path) -> None:
    config = tmp_path / "polymq.toml"
    config.write_text('bind = "127.0.0.2"\n')
    assert _shown(env={"POLYMQ_CONFIG": str(config)})["bind"] == "127.0.0.2"


def test_a_relative_path_in_the_file_is_relative_to_the_file(tmp_path: Path) -> None:
    config = tmp_path / "etc" / "polymq.toml"
    config.parent.mkdir()
    config.write_text('[storage]\ndata_dir = "queues"\n')
    assert _shown("--config", str(config))["storage"]["data_dir"] == str(tmp_path / "etc" / "queues")  # type: ignore[index]


def test_show_prints_toml_that_reads_back_to_the_same_config(tmp_path: Path) -> None:
    first = _polymq("config", "--show", "--data-dir", str(tmp_path / "queues"), "--fsync", "interval:20",
                    "--no-mqks", "--log-format", "json",
                    "--auth-http-address", "127.0.0.1:4181")
    assert first.returncode == 0, first.stderr
    config = tmp_path / "polymq.toml"
    config.write_text(first.stdout)
    again = _polymq("config", "--show", "--config", str(config))
    assert again.stdout == first.stdout
    shown = tomllib.loads(first.stdout)
    assert shown["storage"]["fsync"] == "interval:20" and shown["mqks"]["enabled"] is False
    assert shown["nsq"]["auth_http_address"] == "127.0.0.1:4181"


def test_show_with_in_memory_leaves_the_data_dir_out_so_that_it_reads_back(tmp_path: Path) -> None:
    first = _polymq("config", "--show", "--in-memory")
    assert first.returncode == 0, first.stderr
    assert '# data_dir = "data" (not used with in_memory)' in first.stdout.splitlines()
    config = tmp_path / "polymq.toml"
    config.write_text(first.stdout)
    assert "data_dir" not in tomllib.loads(first.stdout)["storage"]  # type: ignore[operator]
    assert _polymq("config", "--show", "--config", str(config)).stdout == first.stdout


def test_every_option_is_in_the_toml_with_its_flag_and_variable_and_in_the_docs() -> None:
    text = to_toml(Config())
    operations = (ROOT / "docs" / "operations.md").read_text()
    for option in OPTIONS:
        flag = option.flag.split("/")[0]
        assert re.search(rf"^#? ?{option.field} = ", text, re.MULTILINE), option.key
        assert f"({flag}, {option.envvar})" in text.replace("\n# ", " ")
        assert f"`{flag}" in operations and f"`{option.envvar}`" in operations, option.key


def test_every_option_set_by_its_variable_reaches_the_config() -> None:
    shown = _shown(env={"POLYMQ_BIND": "127.0.0.3", "POLYMQ_IN_MEMORY": "1", "POLYMQ_MSG_TIMEOUT": "5000",
                        "POLYMQ_NSQ": "0", "POLYMQ_MQKS_KEEP_UNCONSUMED": "true", "POLYMQ_LOG_LEVEL": "debug"})
    assert shown["bind"] == "127.0.0.3"
    assert shown["storage"]["in_memory"] is True  # type: ignore[index]
    assert shown["nsq"]["msg_timeout_ms"] == 5000 and shown["nsq"]["enabled"] is False  # type: ignore[index]
    assert shown["mqks"]["keep_unconsumed"] is True  # type: ignore[index]
    assert shown["log"]["level"] == "debug"  # type: ignore[index]


def test_the_example_config_is_the_default_config() -> None:
    example = (ROOT / "polymq.example.toml").read_text()
    assert example == _polymq("config", "--show").stdout
    assert build({}) == Config()


def test_nsq_limits_come_from_the_config() -> None:
    options = build({"nsq.max_rdy_count": 100, "nsq.snappy": False, "nsq.auth_http_address": "h:1"}).protocol("nsq")
    limits = nsq_unit.limits(options)
    assert limits.max_rdy_count == 100 and not limits.snappy_enabled and limits.auth_enabled


def test_a_protocol_is_turned_off_and_another_moved_by_the_config_file(tmp_path: Path) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        free_port = probe.getsockname()[1]
    config = tmp_path / "polymq.toml"
    config.write_text("[mqks]\nenabled = false\n[phpmq]\nenabled = false\n[pzq]\nenabled = false\n"
                      "[emqp]\nenabled = false\n"
                      f"[nsq]\nhttp_port = {free_port}\n")
    # running_gateway passes every port as a flag; only the file's switches and unset ports count.
    with running_gateway("--config", str(config), "--nsq-http-port", str(free_port)) as gateway:
        assert set(gateway.addresses) == {"nsq-tcp", "nsq-http", "http"}  # the gateway's own stays on
        assert gateway.addresses["nsq-http"] == f"127.0.0.1:{free_port}"


TEXT_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3} (DEBUG|INFO|WARNING|ERROR)\s+([a-z_]+)\s+(\S.*)$")


def _serve_and_stop(tmp_path: Path, *args: str) -> list[str]:
    """Runs the gateway, holds one message in flight, stops it by SIGTERM: every line it printed."""
    process = subprocess.Popen(
        [sys.executable, "-m", "polymq", "serve", "--data-dir", str(tmp_path / "data"), "--nsq-tcp-port", "0",
         "--nsq-http-port", "0", "--mqks-port", "0", "--phpmq-port", "0",
         "--phpmq-console-port", "0", "--no-pzq", "--no-emqp", "--admin-port", "0", *args],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=CLEAN_ENV)
    assert process.stdout is not None
    lines: list[str] = []
    address = None
    for line in process.stdout:
        lines.append(line.rstrip("\n"))
        if found := re.search(r"listening nsq-tcp (\S+):(\d+)", line):
            address = (found.group(1), int(found.group(2)))
        if re.search(r"\bready\b", line):
            break
    assert address is not None, lines
    try:
        with socket.create_connection(address, timeout=5) as client:
            client.sendall(nsq_client.magic() + nsq_client.pub("logs", b"one") + nsq_client.pub("logs", b"two")
                           + nsq_client.sub("logs", "c") + nsq_client.rdy(1))
            reader = nsq_client.FrameReader()
            frames: list[nsq_client.Frame] = []
            while len(frames) < 4:  # OK, OK, OK, the message
                reader.receive_data(client.recv(65536))
                frames += reader.frames()
            os.kill(process.pid, signal.SIGTERM)
            rest, _ = process.communicate(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 0
    return lines + rest.splitlines()


def test_text_logs_one_format_for_every_line_with_the_start_and_stop_facts(tmp_path: Path) -> None:
    lines = _serve_and_stop(tmp_path)
    parsed = [TEXT_LINE.match(line) for line in lines]
    assert all(parsed), [line for line, match in zip(lines, parsed, strict=True) if not match]
    messages = [(match.group(2), match.group(3)) for match in parsed if match]
    data_dir = tmp_path / "data"
    start = f"storage {data_dir}, fsync always (fdatasync in a thread): restored 0 topics"
    assert any(component == "gateway" and message.startswith(start) for component, message in messages)
    assert any(component == "http" and "Running on http://127.0.0.1:" in message
               for component, message in messages)  # hypercorn's own line, in the same format
    assert messages[-1] == ("gateway", "stopped: 1 in-flight messages returned to their queues; 2 messages in 1 "
                                       f"topics and 1 queues written and synced in {data_dir}")


def test_json_logs_one_object_per_line(tmp_path: Path) -> None:
    lines = _serve_and_stop(tmp_path, "--log-format", "json")
    entries = [json.loads(line) for line in lines]
    assert all(set(entry) == {"time", "level", "component", "message"} for entry in entries)
    assert {"listening", "ready", "stopped"} <= {entry["message"].split()[0].rstrip(":") for entry in entries}


def test_a_repeatable_option_from_flags_a_variable_and_a_file_array(tmp_path: Path) -> None:
    assert _shown()["nsq"]["lookupd_tcp_addresses"] == []  # type: ignore[index]
    flagged = _shown("--lookupd-tcp-address", "127.0.0.1:4160", "--lookupd-tcp-address", "lookupd2:4160")
    assert flagged["nsq"]["lookupd_tcp_addresses"] == ["127.0.0.1:4160", "lookupd2:4160"]  # type: ignore[index]
    variable = _shown(env={"POLYMQ_LOOKUPD_TCP_ADDRESS": " a:4160  b:4161 "})  # click splits at whitespace
    assert variable["nsq"]["lookupd_tcp_addresses"] == ["a:4160", "b:4161"]  # type: ignore[index]
    config = tmp_path / "polymq.toml"
    config.write_text('[nsq]\nlookupd_tcp_addresses = ["c:4160", "d:4160"]\n')
    assert _shown("--config", str(config))["nsq"]["lookupd_tcp_addresses"] == ["c:4160", "d:4160"]  # type: ignore[index]
    # The flag wins over the variable, which wins over the file, whole lists and not merged.
    both = _shown("--config", str(config), env={"POLYMQ_LOOKUPD_TCP_ADDRESS": "e:4160"})
    assert both["nsq"]["lookupd_tcp_addresses"] == ["e:4160"]  # type: ignore[index]
    assert _shown("--config", str(config), "--lookupd-tcp-address", "f:1",
                  env={"POLYMQ_LOOKUPD_TCP_ADDRESS": "e:4160"})["nsq"]["lookupd_tcp_addresses"] == ["f:1"]  # type: ignore[index]
    # What --show prints reads back to the same list.
    shown = _polymq("config", "--show", "--lookupd-tcp-address", "g:4160", "--lookupd-tcp-address", "h:4160")
    config.write_text(shown.stdout)
    again = tomllib.loads(_polymq("config", "--show", "--config", str(config)).stdout)
    assert again["nsq"] == tomllib.loads(shown.stdout)["nsq"]
    assert again["nsq"]["lookupd_tcp_addresses"] == ["g:4160", "h:4160"]


def test_a_repeatable_option_checks_every_value_wherever_it_came_from(tmp_path: Path) -> None:
    flag = _polymq("config", "--show", "--lookupd-tcp-address", "a:4160", "--lookupd-tcp-address", "nohost")
    assert flag.returncode == 2 and "'--lookupd-tcp-address': must be host:port, not 'nohost'" in flag.stderr
    variable = _polymq("config", "--show", env={"POLYMQ_LOOKUPD_TCP_ADDRESS": "a:4160 b:99999"})
    assert variable.returncode == 2
    assert "variable POLYMQ_LOOKUPD_TCP_ADDRESS: must be host:port, not 'b:99999'" in variable.stderr
    config = tmp_path / "polymq.toml"
    config.write_text('[nsq]\nlookupd_tcp_addresses = "a:4160"\n')
    single = _polymq("config", "--show", "--config", str(config))
    assert single.returncode == 2
    wanted = f"{config} line 2: nsq.lookupd_tcp_addresses must be an array of values ([...]), not 'a:4160'"
    assert wanted in single.stderr
    config.write_text('[nsq]\nlookupd_tcp_addresses = ["a:4160", 4160]\n')
    item = _polymq("config", "--show", "--config", str(config))
    assert item.returncode == 2 and "nsq.lookupd_tcp_addresses: must be host:port, not '4160'" in item.stderr
    config.write_text('[nsq]\nlookupd_tcp_addresses = [["a:4160"]]\n')
    nested = _polymq("config", "--show", "--config", str(config))
    assert nested.returncode == 2 and "must hold single values" in nested.stderr


def test_lookupd_registration_needs_the_ports_it_registers(tmp_path: Path) -> None:
    result = _polymq("serve", "--in-memory", "--nsq-http-port", "-1", "--lookupd-tcp-address", "127.0.0.1:4160",
                     "--no-mqks", "--no-phpmq", "--no-pzq", "--no-emqp", "--admin-port", "-1", "--nsq-tcp-port", "0")
    assert result.returncode == 1
    assert "--nsq-http-port is -1 (off): turn it on, or name the port to register with --broadcast-http-port" \
        in result.stdout + result.stderr
