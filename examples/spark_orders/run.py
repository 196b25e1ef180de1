"""The orders pipeline end to end, in one command (docs/spark.md):

    .venv/bin/python examples/spark_orders/run.py

It starts a gateway (its own ports and data directory), subscribes an MQKS consumer and an NSQ
consumer to the totals topic, opens the Spark job's stream, has a PHPMQ producer and an NSQ
producer publish orders, runs the Spark job (pipeline.py, local[2], until it has processed what is
there), and prints what each consumer received. The gateway is stopped at the end.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from datetime import UTC, datetime
from pathlib import Path

import trio

from polymq.clients.mqks import MQKSClient
from polymq.clients.stream import StreamClient
from polymq.codecs import nsq_client, phpmq

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from pipeline import LATENESS_S, ORDERS_STREAM, ORDERS_TOPIC, TOTALS_TOPIC  # noqa: E402

ORDERS_PER_PRODUCER = 60
# The orders' own times: one every 7 s from 12:00 for each producer, so 7 minutes of orders. The
# last minute stays open (no order comes 30 s after it), as it would until later orders arrive.
FIRST_ORDER = datetime(2026, 1, 5, 12, 0, tzinfo=UTC).timestamp()
SECONDS_APART = 7
WAIT_S = 180.0
LISTENING = re.compile(r" listening (\S+) (\S+):(\d+)$")


def order(source: str, number: int) -> bytes:
    return json.dumps({"order": f"{source}-{number}", "source": source, "sku": f"sku-{number % 5}",
                       "amount": 100 + number, "at": FIRST_ORDER + SECONDS_APART * number}).encode()


def start_gateway(data_dir: Path) -> tuple[subprocess.Popen[str], dict[str, tuple[str, int]]]:
    process = subprocess.Popen(
        [sys.executable, "-m", "polymq", "serve", "--data-dir", str(data_dir), "--nsq-tcp-port", "0",
         "--nsq-http-port", "0", "--admin-port", "0", "--mqks-port", "0", "--phpmq-port", "0",
         "--phpmq-console-port", "-1", "--no-pzq", "--no-emqp"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    addresses: dict[str, tuple[str, int]] = {}
    assert process.stdout is not None
    for line in process.stdout:
        found = LISTENING.search(line.rstrip())
        if found:
            addresses[found.group(1)] = (found.group(2), int(found.group(3)))
        if line.rstrip().endswith(" ready"):
            break
    else:
        raise SystemExit(f"the gateway did not start (exit {process.wait()})")
    # Keep reading its output, so it never blocks on a full pipe.
    threading.Thread(target=lambda: [None for _ in process.stdout], daemon=True).start()  # type: ignore[union-attr]
    return process, addresses


async def nsq_consumer(address: tuple[str, int], got: list[dict[str, object]], subscribed: trio.Event) -> None:
    stream = await trio.open_tcp_stream(*address)
    await stream.send_all(nsq_client.magic() + nsq_client.sub(TOTALS_TOPIC, "report") + nsq_client.rdy(100))
    reader = nsq_client.FrameReader()
    while True:
        data = await stream.receive_some()
        if not data:
            return
        reader.receive_data(data)
        for frame in reader.frames():
            if frame.is_response and frame.data == b"OK":
                subscribed.set()
            elif frame.is_response and frame.data == b"_heartbeat_":
                await stream.send_all(nsq_client.nop())
            elif frame.is_message:
                message = nsq_client.decode_message(frame.data)
                got.append(json.loads(message.body))
                await stream.send_all(nsq_client.fin(message.msg_id))


async def nsq_producer(address: tuple[str, int]) -> None:
    stream = await trio.open_tcp_stream(*address)
    await stream.send_all(nsq_client.magic())
    reader = nsq_client.FrameReader()
    for number in range(ORDERS_PER_PRODUCER):
        await stream.send_all(nsq_client.pub(ORDERS_TOPIC, order("nsq", number)))
        frames: list[nsq_client.Frame] = []
        while not frames:
            reader.receive_data(await stream.receive_some())
            frames = reader.frames()
        assert frames[0].data == b"OK", frames
    await stream.aclose()


async def phpmq_producer(address: tuple[str, int]) -> None:
    stream = await trio.open_tcp_stream(*address)
    # PHPMQ's 001 has no answer: the orders go out in one write; the stream's count says when they are in.
    await stream.send_all(b"".join(phpmq.send(ORDERS_TOPIC.encode(), order("phpmq", number))
                                   for number in range(ORDERS_PER_PRODUCER)))
    await stream.aclose()


def run_spark_job(http: str, checkpoint: Path) -> None:
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable, "SPARK_LOCAL_IP": "127.0.0.1"}
    subprocess.run([sys.executable, str(HERE / "pipeline.py"), "--gateway", http, "--checkpoint", str(checkpoint),
                    "--master", "local[2]", "--available-now"], env=env, check=True)


async def pipeline(addresses: dict[str, tuple[str, int]], work: Path) -> tuple[list[dict[str, object]], ...]:
    http = "{}:{}".format(*addresses["http"])
    from_mqks: list[dict[str, object]] = []
    from_nsq: list[dict[str, object]] = []
    async with trio.open_nursery() as nursery, MQKSClient(*addresses["mqks"]) as mqks:
        await mqks.consume("totals-report", [TOTALS_TOPIC], on_msg=lambda m: from_mqks.append(json.loads(m.body)),
                           confirm=True)
        subscribed = trio.Event()
        nursery.start_soon(nsq_consumer, addresses["nsq-tcp"], from_nsq, subscribed)
        await subscribed.wait()
        with StreamClient(http) as client:
            client.open(ORDERS_STREAM, [ORDERS_TOPIC])  # before the orders: the job's own copy of each
        print(f"publishing {ORDERS_PER_PRODUCER} orders over PHPMQ and {ORDERS_PER_PRODUCER} over NSQ")
        await phpmq_producer(addresses["phpmq"])
        await nsq_producer(addresses["nsq-tcp"])
        with StreamClient(http) as client:
            deadline = time.monotonic() + WAIT_S
            while len(client.read(ORDERS_STREAM, 0, client.offsets(ORDERS_STREAM)["end"])) < 2 * ORDERS_PER_PRODUCER:
                if time.monotonic() > deadline:
                    raise SystemExit("the orders did not all arrive")
                await trio.sleep(0.05)
        print("running the Spark job (local[2]) until it has processed every order")
        await trio.to_thread.run_sync(run_spark_job, http, work / "checkpoint")
        # The minutes that end before the newest order's time less the lateness allowed are closed.
        expected = (SECONDS_APART * (ORDERS_PER_PRODUCER - 1) - LATENESS_S) // 60
        with trio.move_on_after(WAIT_S):
            while len(from_mqks) < expected or len(from_nsq) < expected:
                await trio.sleep(0.05)
        nursery.cancel_scope.cancel()
    return from_mqks, from_nsq


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="polymq-orders-") as temporary:
        work = Path(temporary)
        gateway, addresses = start_gateway(work / "data")
        try:
            from_mqks, from_nsq = trio.run(pipeline, addresses, work)
        finally:
            os.kill(gateway.pid, signal.SIGTERM)
            gateway.wait(30)
    for name, got in (("MQKS consumer", from_mqks), ("NSQ consumer", from_nsq)):
        print(f"{name} received {len(got)} per-minute totals:")
        for totals in sorted(got, key=lambda item: str(item["minute"])):
            print(f"  {totals['minute']}  {totals['orders']:3} orders  amount {totals['amount']:6}  "
                  f"(PHPMQ {totals['from_phpmq']}, NSQ {totals['from_nsq']})")
    print(f"(the last minute's totals go out once an order {LATENESS_S} s after its end arrives)")
    if not from_mqks or sorted(map(str, from_mqks)) != sorted(map(str, from_nsq)):
        raise SystemExit("the consumers did not receive the same totals")


if __name__ == "__main__":
    main()
