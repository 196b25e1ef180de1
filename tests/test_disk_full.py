"""A full disk, for real: the gateway's data dir on a small tmpfs mounted in a private mount namespace.

Publishes are acknowledged until the tmpfs is full, then refused (`E_MPUB_FAILED`, `E_PUB_FAILED … No
space left on device`); the log says so once; a filler file in the same mount is removed from
outside (`nsenter` into the gateway's namespace) and publishing works again by itself; every
acknowledged message is then delivered. Needs root and a kernel that lets it mount (CI runs as root).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from polymq.codecs import nsq_client
from tests.support.gateway import GatewayProcess, running_gateway
from tests.support.nsq_wire import Closed, RawClient

TMPFS_SIZE = 16 * 1024 * 1024  # small enough to fill in a second or two
FILLER_SIZE = 4 * 1024 * 1024  # what is freed again
BODY = 1000
BATCH = 100  # 100 kB an MPUB: the tmpfs takes about 120 of them
DEADLINE_S = 60.0
NO_SPACE = "No space left on device"


def _can_mount() -> str | None:
    """Why this machine cannot run the test, or None."""
    if os.geteuid() != 0:
        return "mounting a tmpfs needs root"
    if shutil.which("unshare") is None or shutil.which("nsenter") is None:
        return "needs unshare and nsenter (util-linux)"
    probe = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c",
                            "mount -t tmpfs -o size=1m tmpfs /mnt"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"cannot mount in a private mount namespace here: {probe.stderr.strip()}"
    return None


@pytest.fixture
def small_disk() -> Iterator[Path]:
    reason = _can_mount()
    if reason is not None:
        if os.environ.get("CI"):  # CI runs as root and can mount: not running the test there is a failure
            pytest.fail(f"the full-disk test must run in CI: {reason}")
        pytest.skip(reason)
    mount_point = Path(tempfile.mkdtemp(prefix="polymq-full-"))
    yield mount_point
    shutil.rmtree(mount_point, ignore_errors=True)  # the tmpfs went with the namespace


def full_disk_gateway(mount_point: Path) -> tuple[tuple[str, ...], Path]:
    """The prefix that mounts the tmpfs, writes the filler and execs the gateway (same PID); the data dir."""
    script = (f'mount -t tmpfs -o size={TMPFS_SIZE} tmpfs "$0" && head -c {FILLER_SIZE} /dev/zero > "$0/filler" '
              f'&& exec "$@"')
    prefix = ("unshare", "--mount", "--propagation", "private", "sh", "-c", script, str(mount_point))
    return prefix, mount_point / "data"


def publish_until_refused(gateway: GatewayProcess) -> set[bytes]:
    """MPUBs until one is refused; the bodies acknowledged."""
    acknowledged: set[bytes] = set()
    deadline = time.monotonic() + DEADLINE_S
    with RawClient(gateway.nsq_tcp, timeout=10) as producer:
        for batch in range(10_000):
            bodies = [b"%06d-%04d-" % (batch, index) + b"x" * (BODY - 12) for index in range(BATCH)]
            producer.send(nsq_client.mpub("t", bodies))
            frame = producer.read_frame()
            if frame.frame_type == 1:
                assert frame.data.startswith(b"E_MPUB_FAILED MPUB failed "), frame
                assert NO_SPACE.encode() in frame.data, frame
                producer.expect_closed()
                return acknowledged
            assert frame.data == b"OK", frame
            acknowledged.update(bodies)
            assert time.monotonic() < deadline
    raise AssertionError("the tmpfs never filled")


def test_a_full_disk_refuses_publishes_and_recovers_when_space_returns(small_disk: Path) -> None:
    prefix, data_dir = full_disk_gateway(small_disk)
    with running_gateway(data_dir=data_dir, prefix=prefix) as gateway:
        with RawClient(gateway.nsq_tcp) as setup:  # the channel, so that every message is kept for it
            setup.send(nsq_client.sub("t", "c"))
            setup.expect_response(b"OK")
        acknowledged = publish_until_refused(gateway)
        assert len(acknowledged) > 0

        # Every publish is refused while the store fails, with the error of its protocol.
        for _ in range(20):
            with RawClient(gateway.nsq_tcp) as producer:
                producer.send(nsq_client.pub("t", b"refused"))
                producer.expect_error(f"E_PUB_FAILED PUB failed {NO_SPACE}".encode())
                producer.expect_closed()
        gateway.wait_for_log(lambda line: f"storage write failed: {NO_SPACE}" in line)
        failed_lines = [line for line in gateway.log_lines if f"failed: {NO_SPACE}" in line and "storage" in line]
        assert len(failed_lines) == 1, failed_lines

        # Space comes back: the filler goes, from inside the gateway's mount namespace.
        subprocess.run(["nsenter", "-t", str(gateway.process.pid), "-m", "rm", str(small_disk / "filler")],
                       check=True)
        deadline = time.monotonic() + DEADLINE_S
        while True:
            with RawClient(gateway.nsq_tcp) as producer:
                producer.send(nsq_client.pub("t", b"after"))
                frame = producer.read_frame()
            if frame.frame_type == 0:
                assert frame.data == b"OK"
                acknowledged.add(b"after")
                break
            assert time.monotonic() < deadline, f"publishing did not resume: {frame}"
            time.sleep(0.05)  # the store retries every 200 ms; this only paces the polling
        gateway.wait_for_log(lambda line: "storage writes work again" in line)

        # Every acknowledged message is delivered.
        delivered: set[bytes] = set()
        with RawClient(gateway.nsq_tcp, timeout=10) as reader:
            reader.send(nsq_client.sub("t", "c"))
            reader.expect_response(b"OK")
            reader.send(nsq_client.rdy(2500))
            while not acknowledged <= delivered:
                try:
                    message = reader.read_message()
                except (TimeoutError, Closed) as error:
                    raise AssertionError(f"{len(acknowledged - delivered)} acknowledged messages never came") \
                        from error
                delivered.add(message.body)
                reader.send(nsq_client.fin(message.msg_id))
