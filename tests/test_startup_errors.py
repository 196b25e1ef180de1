"""Start-up failures of the real `polymq serve`: one clear line, the right exit status, nothing left behind."""

from __future__ import annotations

import os
import pwd
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from support.gateway import running_gateway

# Every listener on a free port: only the case under test may fail.
TCP_FREE_PORTS = ("--nsq-tcp-port", "0", "--nsq-http-port", "0", "--mqks-port", "0", "--phpmq-port", "0",
                  "--phpmq-console-port", "0")
FREE_PORTS = (*TCP_FREE_PORTS, "--no-pzq", "--no-emqp")


def _serve(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "polymq", "serve", *args], capture_output=True, text=True,
                          timeout=30, env={**os.environ, **(env or {})})


def _error_lines(result: subprocess.CompletedProcess[str]) -> list[str]:
    return [line for line in result.stderr.splitlines() if " ERROR " in line]


def _no_traceback(result: subprocess.CompletedProcess[str]) -> None:
    assert "Traceback" not in result.stderr + result.stdout
    assert len(result.stderr.splitlines()) <= 3, result.stderr


def test_a_port_in_use_names_the_listener_and_address_and_creates_no_data_dir(tmp_path: Path) -> None:
    data_dir = tmp_path / "fresh" / "data"
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = _serve("--data-dir", str(data_dir), "--nsq-tcp-port", "0", "--nsq-http-port", "0",
                        "--mqks-port", str(port))
    assert result.returncode == 1
    _no_traceback(result)
    [line] = _error_lines(result)
    assert line.endswith(f"gateway  cannot listen for mqks on 127.0.0.1:{port}: address already in use; "
                         "stop the process using it, or choose another port with --mqks-port (-1 turns mqks off)")
    assert not (tmp_path / "fresh").exists()


@pytest.mark.parametrize(("listener", "flag", "others"), [
    ("pzq-send", "--pzq-send-port", ("--pzq-receive-port", "0", "--pzq-monitor-port", "0", "--no-emqp")),
    ("emqp-backend", "--emqp-backend-port", ("--no-pzq", "--emqp-frontend-port", "0", "--emqp-admin-port", "0")),
])
def test_a_zeromq_port_in_use_names_the_socket_and_leaves_nothing_bound(
        tmp_path: Path, listener: str, flag: str, others: tuple[str, ...]) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = _serve("--data-dir", str(tmp_path / "data"), *TCP_FREE_PORTS, *others, flag, str(port))
    assert result.returncode == 1
    _no_traceback(result)
    [line] = _error_lines(result)
    assert line.endswith(f"gateway  cannot listen for {listener} on 127.0.0.1:{port}: address already in use; "
                         f"stop the process using it, or choose another port with {flag} "
                         f"(-1 turns {listener} off)")
    assert not (tmp_path / "data").exists()


def test_a_data_dir_in_use_names_the_path_and_the_pid_holding_it(tmp_path: Path) -> None:
    with running_gateway(data_dir=tmp_path) as first:
        result = _serve("--data-dir", str(tmp_path), *FREE_PORTS)
        assert result.returncode == 1
        _no_traceback(result)
        [line] = _error_lines(result)
        assert line.endswith(f"data dir {tmp_path} is in use by another polymq process (pid {first.process.pid}); "
                             "stop it, or give this gateway another --data-dir")
        assert first.process.poll() is None  # the first gateway is untouched


def test_an_unusable_data_dir_names_the_path_and_why() -> None:
    result = _serve("--data-dir", "/proc/forbidden", *FREE_PORTS)
    assert result.returncode == 1
    _no_traceback(result)
    [line] = _error_lines(result)
    assert "cannot use data dir /proc/forbidden: /proc/forbidden: " in line
    assert line.endswith("; choose a writable folder with --data-dir")


def _as_a_user_without_privileges() -> tuple[str, ...]:
    """The command prefix that runs the gateway as `nobody` when the tests run as root (whose
    CAP_DAC_OVERRIDE writes anywhere); nothing when they run as another user already."""
    if os.geteuid() != 0:
        return ()
    nobody = pwd.getpwnam("nobody")
    if shutil.which("setpriv"):
        return ("setpriv", f"--reuid={nobody.pw_uid}", f"--regid={nobody.pw_gid}", "--clear-groups")
    if shutil.which("runuser"):
        return ("runuser", "-u", "nobody", "--")
    # Both are util-linux's, an essential package of Debian: missing, the test must say so, not pass by.
    pytest.fail("neither setpriv nor runuser (util-linux) to run the gateway as a user without privileges")


@pytest.fixture
def shared_folder() -> Iterator[Path]:
    """A folder every user may enter (pytest's own are the test user's alone), removed afterwards."""
    folder = Path(tempfile.mkdtemp(prefix="polymq-test-"))
    folder.chmod(0o755)
    yield folder
    for path in (folder, *folder.rglob("*")):
        path.chmod(stat.S_IRWXU)  # what the test closed, opened again to remove it
    shutil.rmtree(folder)


def _serve_without_privileges(data_dir: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*_as_a_user_without_privileges(), sys.executable, "-m", "polymq", "serve", "--data-dir",
                           str(data_dir), *FREE_PORTS], capture_output=True, text=True, timeout=30, cwd="/")


def test_a_data_dir_in_a_folder_the_user_may_not_enter_names_the_path(shared_folder: Path) -> None:
    closed = shared_folder / "closed"
    closed.mkdir(mode=0)
    result = _serve_without_privileges(closed / "data")
    assert result.returncode == 1, result.stderr
    _no_traceback(result)
    [line] = _error_lines(result)
    assert line.endswith(f"gateway  cannot use data dir {closed / 'data'}: {closed / 'data'}: permission denied; "
                         "choose a writable folder with --data-dir")


@pytest.mark.parametrize("left", ["meta.log", "t1"])
def test_a_data_dir_holding_what_the_user_may_not_write_names_it_and_touches_nothing(
        shared_folder: Path, left: str) -> None:
    """A data dir an earlier gateway of another user (root, say) left: its files and folders."""
    data_dir = shared_folder / "data"
    data_dir.mkdir()
    data_dir.chmod(0o777)
    if left == "t1":
        (data_dir / left).mkdir(mode=0o555)
    else:
        (data_dir / left).write_bytes(b"")
        (data_dir / left).chmod(0o444)
    result = _serve_without_privileges(data_dir)
    assert result.returncode == 1, result.stderr
    _no_traceback(result)
    [line] = _error_lines(result)
    assert line.endswith(f"gateway  cannot use data dir {data_dir}: {data_dir / left}: permission denied; "
                         "choose a writable folder with --data-dir")
    assert sorted(path.name for path in data_dir.iterdir()) == [left]  # no LOCK taken, nothing written


def test_a_data_dir_under_a_file_is_refused_with_the_reason(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    result = _serve("--data-dir", str(tmp_path / "file" / "data"), *FREE_PORTS)
    assert result.returncode == 1
    _no_traceback(result)
    [line] = _error_lines(result)
    assert f"cannot use data dir {tmp_path / 'file' / 'data'}: {tmp_path / 'file' / 'data'}: not a directory" in line


def test_a_file_as_data_dir_is_a_usage_error(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    result = _serve("--data-dir", str(tmp_path / "file"), *FREE_PORTS)
    assert result.returncode == 2
    assert result.stderr.splitlines()[-1] == (
        f"Error: Invalid value for '--data-dir': Directory '{tmp_path / 'file'}' is a file.")


def test_debug_adds_the_traceback() -> None:
    result = _serve("--data-dir", "/proc/forbidden", "--debug", *FREE_PORTS)
    assert result.returncode == 1
    assert "Traceback" in result.stderr and "StartupError" in result.stderr


def test_tls_required_without_a_certificate_is_a_start_up_error(tmp_path: Path) -> None:
    result = _serve("--data-dir", str(tmp_path / "d"), "--tls-required", *FREE_PORTS)
    assert result.returncode == 1
    _no_traceback(result)
    [line] = _error_lines(result)
    assert line.endswith("--tls-required needs a certificate: give --tls-cert (and --tls-key)")
    assert not (tmp_path / "d").exists()


@pytest.mark.parametrize("given", ["flags", "variables", "config file"])
def test_in_memory_and_a_data_dir_contradict_each_other_however_they_are_given(tmp_path: Path, given: str) -> None:
    data_dir = tmp_path / "data"
    args: tuple[str, ...] = ("--in-memory", "--data-dir", str(data_dir))
    env: dict[str, str] = {}
    if given == "variables":
        args, env = (), {"POLYMQ_IN_MEMORY": "1", "POLYMQ_DATA_DIR": str(data_dir)}
    elif given == "config file":
        config = tmp_path / "polymq.toml"
        config.write_text('[storage]\ndata_dir = "data"\nin_memory = true\n')
        args = ("--config", str(config))
    result = _serve(*args, *FREE_PORTS, env=env)
    assert result.returncode == 1
    _no_traceback(result)
    [line] = _error_lines(result)
    assert line.endswith("gateway  --in-memory and --data-dir contradict each other: --in-memory keeps nothing on "
                         "disk; give one of them")
    assert not data_dir.exists()


def test_a_bad_flag_value_is_a_usage_error_naming_the_flag() -> None:
    result = _serve("--fsync=sometimes")
    assert result.returncode == 2
    assert result.stderr.splitlines()[-1] == (
        "Error: Invalid value for '--fsync': must be always, never or interval:MS (MS > 0), not 'sometimes'")


def test_a_bad_variable_is_a_usage_error_naming_the_variable() -> None:
    result = _serve(env={"POLYMQ_NSQ_TCP_PORT": "70000"})
    assert result.returncode == 2
    assert result.stderr.splitlines()[-1].startswith("Error: Invalid value for variable POLYMQ_NSQ_TCP_PORT: 70000")


def test_a_bad_config_value_names_the_file_and_line(tmp_path: Path) -> None:
    config = tmp_path / "polymq.toml"
    config.write_text('bind = "127.0.0.1"\n\n[storage]\nfsync = "sometimes"\n')
    result = _serve("--config", str(config))
    assert result.returncode == 2
    assert result.stderr.splitlines()[-1] == (
        f"Error: {config} line 4: storage.fsync: must be always, never or interval:MS (MS > 0), not 'sometimes'")


def test_a_wrong_type_in_the_config_file_says_what_was_given_and_what_is_expected(tmp_path: Path) -> None:
    config = tmp_path / "polymq.toml"
    config.write_text('[nsq]\ntcp_port = "abc"\n')
    result = _serve("--config", str(config))
    assert result.returncode == 2
    assert result.stderr.splitlines()[-1] == (
        f"Error: {config} line 2: nsq.tcp_port = 'abc': expected a whole number from -1 to 65535")


def test_a_section_given_a_value_is_named_as_a_section(tmp_path: Path) -> None:
    config = tmp_path / "polymq.toml"
    config.write_text("nsq = 5\n")
    result = _serve("--config", str(config))
    assert result.returncode == 2
    assert result.stderr.splitlines()[-1] == (
        f"Error: {config} line 1: nsq is a section, not an option: write [nsq] and its options on the lines below it")


def test_an_unknown_config_key_names_the_file_and_line(tmp_path: Path) -> None:
    config = tmp_path / "polymq.toml"
    config.write_text("[nsq]\ntcp_prot = 4150\n")
    result = _serve("--config", str(config))
    assert result.returncode == 2
    assert result.stderr.splitlines()[-1] == (
        f"Error: {config} line 2: unknown option 'nsq.tcp_prot' (`polymq config --show` lists them)")


def test_a_config_file_that_is_not_toml_is_named(tmp_path: Path) -> None:
    config = tmp_path / "polymq.toml"
    config.write_text("[nsq\n")
    result = _serve("--config", str(config))
    assert result.returncode == 2
    assert result.stderr.splitlines()[-1].startswith(f"Error: {config}: not valid TOML: ")


def test_a_missing_config_file_is_named(tmp_path: Path) -> None:
    result = _serve("--config", str(tmp_path / "missing.toml"))
    assert result.returncode == 2
    assert result.stderr.splitlines()[-1] == (
        f"Error: cannot read config file {tmp_path / 'missing.toml'}: No such file or directory")


@pytest.mark.parametrize(("listener", "flag", "others"), [
    ("mqks", "--mqks-port", ("--nsq-tcp-port", "0", "--nsq-http-port", "0", "--no-pzq", "--no-emqp")),
    ("emqp-backend", "--emqp-backend-port", (*TCP_FREE_PORTS, "--no-pzq", "--emqp-frontend-port", "0",
                                             "--emqp-admin-port", "0")),
])
def test_a_port_held_by_an_outgoing_connection_says_so_and_names_the_reserved_ports_setting(
        tmp_path: Path, listener: str, flag: str, others: tuple[str, ...]) -> None:
    """As when an outgoing connection of another program was given the port as its ephemeral port."""
    with socket.socket() as server, socket.socket() as outgoing:
        server.bind(("127.0.0.1", 0))
        server.listen()
        outgoing.bind(("127.0.0.1", 0))  # its local port, which the gateway is then told to listen on
        outgoing.connect(server.getsockname())
        port = outgoing.getsockname()[1]
        result = _serve("--data-dir", str(tmp_path / "data"), *others, flag, str(port))
    assert result.returncode == 1
    _no_traceback(result)
    [line] = _error_lines(result)
    assert line.endswith(f"gateway  cannot listen for {listener} on 127.0.0.1:{port}: address already in use; "
                         "no server listens there: a connection holds it (an outgoing connection given it as its "
                         "ephemeral port); reserve polymq's ports with the sysctl net.ipv4.ip_local_reserved_ports "
                         f"(docs/operations.md), or choose another port with {flag}")
