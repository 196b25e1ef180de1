"""The stream endpoints of a real gateway (gateway/stream_http_api.py): a stream bound to a topic
gets what NSQ and the HTTP API publish, ranges read again give the same rows, commit, positions
across a restart, and the errors a reader sees."""

from __future__ import annotations

import http.client
import json
import socket
import struct
import time
from pathlib import Path

import pytest

from polymq.clients.stream import StreamClient, StreamClientError
from polymq.codecs import stream_rows

from support.gateway import running_gateway
from support.nsq_wire import RawClient


def http_pub(address: str, topic: str, body: bytes) -> None:
    host, port = address.rsplit(":", 1)
    connection = http.client.HTTPConnection(host, int(port), timeout=5)
    connection.request("POST", f"/pub?topic={topic}", body=body)
    assert connection.getresponse().read() == b"OK"
    connection.close()


def test_a_stream_reads_what_was_published_again_until_committed_and_after_a_restart(tmp_path: Path) -> None:
    with running_gateway(data_dir=tmp_path) as gateway, StreamClient(gateway.http) as client:
        opened = client.open("spark-orders", ["orders"])
        assert opened == {"stream": "spark-orders", "topics": ["orders"], "start": 0, "end": 0, "committed": 0}
        with RawClient(gateway.nsq_tcp) as nsq:
            nsq.send(b"PUB orders\n" + len(b"by nsq").to_bytes(4, "big") + b"by nsq")
            nsq.expect_response()
        http_pub(gateway.nsq_http, "orders", b"by http")
        offsets = client.offsets("spark-orders")
        assert offsets["start"] == 0 and offsets["end"] >= 2
        rows = client.read("spark-orders", 0, offsets["end"])
        assert [(row.topic, row.body, row.attempts, row.headers, row.origin) for row in rows] == [
            ("orders", b"by nsq", 0, b"", "nsq"), ("orders", b"by http", 0, b"", "nsq")]
        assert rows[0].position < rows[1].position < offsets["end"]
        assert client.read("spark-orders", 0, offsets["end"]) == rows  # again: the same rows
        assert client.offsets("spark-orders", 0, rows=1)["end"] == rows[1].position
        limited = client.offsets("spark-orders", rows[1].position, rows=5)  # what the range holds, counted
        assert (limited["end"], limited["rows"]) == (offsets["end"], 1)
        assert client.split("spark-orders", 0, offsets["end"], 2) == [0, rows[1].position, offsets["end"]]
        committed = client.commit("spark-orders", rows[1].position)
        assert committed["finished"] == 1 and committed["committed"] == rows[1].position
        with pytest.raises(StreamClientError) as gone:
            client.read("spark-orders", 0, offsets["end"])
        assert gone.value.status == 410 and gone.value.code == "OFFSET_GONE"
        assert gateway.http in str(gone.value)
    with running_gateway(data_dir=tmp_path) as gateway, StreamClient(gateway.http) as client:
        after = client.offsets("spark-orders")
        assert after["committed"] == rows[1].position and after["start"] == rows[1].position
        assert client.read("spark-orders", after["start"], after["end"]) == rows[1:]
        client.commit("spark-orders", after["end"])
        http_pub(gateway.nsq_http, "orders", b"new")
        newest = client.offsets("spark-orders")
        fresh = client.read("spark-orders", newest["start"], newest["end"])
        assert [row.body for row in fresh] == [b"new"] and fresh[0].position >= after["end"]


def test_the_read_batch_is_the_documented_bytes(tmp_path: Path) -> None:
    with running_gateway("--in-memory", data_dir=tmp_path) as gateway, StreamClient(gateway.http) as client:
        client.open("s", ["t"])
        http_pub(gateway.nsq_http, "t", b"hello")
        raw = client.request("GET", "/stream/read", [("stream", "s"), ("from", 0), ("to", 1)])
        position, message_id, timestamp_ns, *lengths = stream_rows.READ_HEAD.unpack_from(raw)
        assert (position, lengths) == (0, [0, 1, 0, 5, 3]) and message_id > 0 and timestamp_ns > 0
        assert raw[stream_rows.READ_HEAD.size:] == b"t" + b"nsq" + b"hello"  # /pub is the nsqd API: NSQ


def _as_rows(buffers: stream_rows.ColumnBuffers) -> list[stream_rows.ReadRow]:
    count = buffers.rows
    body_at = struct.unpack(f"<{count + 1}i", buffers.body_offsets)
    headers_at = struct.unpack(f"<{count + 1}i", buffers.headers_offsets)
    columns = zip(struct.unpack(f"<{count}q", buffers.positions), struct.unpack(f"<{count}Q", buffers.ids),
                  struct.unpack(f"<{count}q", buffers.timestamps_ns), struct.unpack(f"<{count}i", buffers.attempts),
                  struct.unpack(f"<{count}H", buffers.topic_numbers), bytes(buffers.origin_numbers), strict=True)
    return [stream_rows.ReadRow(position, message_id, stamp, attempts, buffers.topics[topic].decode(),
                                bytes(buffers.headers[headers_at[n]:headers_at[n + 1]]),
                                bytes(buffers.bodies[body_at[n]:body_at[n + 1]]),
                                buffers.origins[origin - 1].decode() if origin else "")
            for n, (position, message_id, stamp, attempts, topic, origin) in enumerate(columns)]


def test_the_column_layout_answers_the_same_rows(tmp_path: Path) -> None:
    with running_gateway("--in-memory", data_dir=tmp_path) as gateway, StreamClient(gateway.http) as client:
        client.open("s", ["t", "u"])
        http_pub(gateway.nsq_http, "t", b"by nsq")
        client.publish([stream_rows.encode_publish_row(b"by spark", headers={"k": "v"}),
                        stream_rows.encode_publish_row(b"\x00\xff", topic="u")], "t")
        end = client.offsets("s")["end"]
        rows = client.read("s", 0, end)
        assert [(row.topic, row.body, row.headers, row.origin) for row in rows] == [
            ("t", b"by nsq", b"", "nsq"), ("t", b"by spark", b'{"k":"v"}', "http"), ("u", b"\x00\xff", b"", "http")]
        columns = stream_rows.decode_read_column_buffers(client.read_batch("s", 0, end, layout="columns"))
        assert _as_rows(columns) == rows
        tail = stream_rows.decode_read_column_buffers(client.read_batch("s", rows[1].position, end, limit=1,
                                                                        layout="columns"))
        assert _as_rows(tail) == rows[1:2]
        taken = client.snapshot("s")
        snapshot = stream_rows.decode_read_column_buffers(client.snapshot_rows(taken["snapshot"], 0, 3,
                                                                               layout="columns"))
        assert [(row.position, row.body) for row in _as_rows(snapshot)] == [(n, row.body) for n, row in enumerate(rows)]
        with pytest.raises(StreamClientError) as bad:
            client.read_batch("s", 0, end, layout="arrow")
        assert bad.value.status == 400 and bad.value.code == "INVALID_ARG_LAYOUT"


def test_bad_requests_get_clear_answers(tmp_path: Path) -> None:
    with running_gateway("--in-memory", data_dir=tmp_path) as gateway, StreamClient(gateway.http) as client:
        with pytest.raises(StreamClientError) as missing:
            client.offsets("nope")
        assert missing.value.status == 404 and "no stream nope" in str(missing.value)
        with RawClient(gateway.nsq_tcp) as nsq:
            nsq.send(b"SUB t ch\n")  # an NSQ channel: a queue with consumers
            nsq.expect_response()
        with pytest.raises(StreamClientError) as taken:
            client.open("t/ch", ["t"])
        assert taken.value.status == 409 and "not a stream" in str(taken.value)
        for params, code in (([("stream", "")], "INVALID_STREAM"), ([], "MISSING_ARG_STREAM"),
                             ([("stream", "a\x01")], "INVALID_STREAM")):
            with pytest.raises(StreamClientError) as bad:
                client.request("POST", "/stream/open", params)
            assert bad.value.code == code
        client.open("s", ["t"])
        for params, code in (([("stream", "s"), ("from", "-1"), ("to", "2")], "INVALID_ARG_FROM"),
                             ([("stream", "s"), ("from", "x"), ("to", "2")], "INVALID_ARG_FROM"),
                             ([("stream", "s"), ("from", "0")], "MISSING_ARG_TO")):
            with pytest.raises(StreamClientError) as bad:
                client.request("GET", "/stream/read", params)
            assert bad.value.status == 400 and bad.value.code == code
    port = _closed_port()
    with pytest.raises(StreamClientError, match=f"gateway at 127.0.0.1:{port}: GET /stream/offsets failed"):
        StreamClient(f"127.0.0.1:{port}", timeout=2).offsets("s")


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_json_answers_are_compact(tmp_path: Path) -> None:
    with running_gateway("--in-memory", data_dir=tmp_path) as gateway, StreamClient(gateway.http) as client:
        raw = client.request("POST", "/stream/open", [("stream", "s"), ("topic", "a"), ("topic", "b")])
        assert raw == b'{"stream":"s","topics":["a","b"],"start":0,"end":0,"committed":0}'
        assert json.loads(raw)["topics"] == ["a", "b"]


def test_publish_rows_with_ids_headers_and_topics_and_a_replay_publishes_only_what_is_missing(
        tmp_path: Path) -> None:
    row = stream_rows.encode_publish_row
    with running_gateway(data_dir=tmp_path) as gateway, StreamClient(gateway.http) as client:
        client.open("s", ["out", "other"])
        answer = client.publish([row(b"a"), row(b"b", message_id="own", headers={"k": "v"}), row(b"c", topic="other")],
                                topic="out", dedup="w/0/0")
        assert answer == {"published": 3, "duplicates": 0}
        # The first try of the next batch stopped after 2 of its 4 rows; the replay sends all 4.
        assert client.publish([row(b"d"), row(b"e")], topic="out", dedup="w/1/0")["published"] == 2
    with running_gateway(data_dir=tmp_path) as gateway, StreamClient(gateway.http) as client:
        replay = [row(b"d"), row(b"e"), row(b"f"), row(b"g")]
        assert client.publish(replay, topic="out", dedup="w/1/0") == {"published": 2, "duplicates": 2}
        assert client.publish(replay[2:], topic="out", dedup="w/1/0", first=2) == {"published": 0, "duplicates": 2}
        assert client.publish([row(b"x")], topic="out")["published"] == 1  # no group: always published
        end = client.offsets("s")["end"]
        rows = client.read("s", 0, end)
        assert [(r.topic, r.body, json.loads(r.headers or b"{}")) for r in rows] == [
            ("out", b"a", {}), ("out", b"b", {"k": "v", "msg_id": "own"}), ("other", b"c", {}), ("out", b"d", {}),
            ("out", b"e", {}), ("out", b"f", {}), ("out", b"g", {}), ("out", b"x", {})]
        assert rows[-1].headers == rows[0].headers == b""  # no id, no headers: none stored


def test_bad_rows_are_refused_whole(tmp_path: Path) -> None:
    row = stream_rows.encode_publish_row
    with running_gateway("--in-memory", "--stream-max-row-size", "10", "--stream-max-batch-size", "100",
                         data_dir=tmp_path) as gateway, StreamClient(gateway.http) as client:
        client.open("s", ["t"])
        for rows, status, text in (
                ([row(b"ok"), stream_rows.PUBLISH_HEAD.pack(0, 0, 0, 0)], 400, "row 1: empty body"),
                ([row(b"x" * 11)], 400, "row 0: body of 11 bytes is over the limit of 10"),
                ([row(b"x" * 10)] * 5, 413, "a batch is at most 100 bytes"),
                ([row(b"x")], 400, "a row without a topic needs the topic parameter")):
            with pytest.raises(StreamClientError) as refused:
                client.publish(rows, topic=None if "without a topic" in text else "t")
            assert refused.value.status == status and text in str(refused.value)
        assert client.offsets("s")["end"] == 0  # nothing of a refused batch was published


def test_the_dedup_window_is_the_configured_one(tmp_path: Path) -> None:
    row = stream_rows.encode_publish_row
    # A window longer than a loaded machine takes between two requests.
    with running_gateway("--dedup-window", "3", data_dir=tmp_path) as gateway, \
            StreamClient(gateway.http) as client:
        assert client.publish([row(b"a")], topic="t", dedup="g")["published"] == 1
        assert client.publish([row(b"a")], topic="t", dedup="g")["duplicates"] == 1
        time.sleep(3.1)  # the window itself: three seconds
        assert client.publish([row(b"a")], topic="t", dedup="g")["published"] == 1


def test_every_message_keeps_the_protocol_it_came_in_by_across_a_restart(tmp_path: Path) -> None:
    import zmq

    from support.emqp_wire import Client
    from support.mqks_wire import MQKSWire
    from support.phpmq_wire import PHPMQWire
    from support.pzq_wire import Producer

    context = zmq.Context()
    try:
        with running_gateway("--pzq-queue", "origins", data_dir=tmp_path) as gateway, \
                StreamClient(gateway.http) as client:
            client.open("origins-stream", ["origins"])
            with RawClient(gateway.nsq_tcp) as nsq:
                nsq.send(b"PUB origins\n" + (3).to_bytes(4, "big") + b"nsq")
                nsq.expect_response()
            with MQKSWire(gateway.host_port("mqks")) as mqks:
                mqks.send(b"r1 publish origins mqks")
                mqks.barrier()
            with PHPMQWire(gateway.host_port("phpmq")) as php:
                php.publish("origins", b"phpmq")
                php.barrier()
            with Producer(context, gateway.addresses["pzq-receive"]) as pzq:
                assert pzq.produce(b"pzq")[1] == b"1"
            client.publish([stream_rows.encode_publish_row(b"http")], "origins")
            expected = {b"nsq": "nsq", b"mqks": "mqks", b"phpmq": "phpmq", b"pzq": "pzq", b"emqp": "emqp",
                        b"http": "http"}
            with Client(context, gateway.addresses["emqp-frontend"]) as emqp_client:
                emqp_client.request("origins", b"emqp")  # no answer for a request nobody serves yet: poll
                deadline = time.monotonic() + 5
                while len(rows := client.read("origins-stream", 0, client.offsets("origins-stream")["end"])) < 6:
                    assert time.monotonic() < deadline, [(row.body, row.origin) for row in rows]
                    time.sleep(0.01)
            assert {row.body: row.origin for row in rows} == expected
        with running_gateway("--pzq-queue", "origins", data_dir=tmp_path) as gateway, \
                StreamClient(gateway.http) as client:
            again = client.read("origins-stream", 0, client.offsets("origins-stream")["end"])
            assert {row.body: row.origin for row in again} == expected
    finally:
        context.term()


def test_a_snapshot_of_an_nsq_channel_reads_every_message_and_consumes_none(tmp_path: Path) -> None:
    with running_gateway("--mem-queue-size", "3", data_dir=tmp_path) as gateway, \
            StreamClient(gateway.http) as client:
        with RawClient(gateway.nsq_tcp) as consumer:
            consumer.send(b"SUB jobs work\n")
            consumer.expect_response()
            for number in range(8):
                http_pub(gateway.nsq_http, "jobs", b"job %d" % number)
            consumer.send(b"RDY 1\n")
            in_flight = consumer.read_message()
            taken = client.snapshot("jobs/work")
            assert taken["rows"] == 8 and taken["queue"] == "jobs/work"
            rows = list(stream_rows.decode_read_rows(client.snapshot_rows(taken["snapshot"], 0, 8)))
            assert [row.body for row in rows] == [b"job %d" % number for number in range(8)]
            assert [row.position for row in rows] == list(range(8)) and rows[0].attempts == 1
            assert [row.body for row in stream_rows.decode_read_rows(
                client.snapshot_rows(taken["snapshot"], 6, 100))] == [b"job 6", b"job 7"]
            client.snapshot_close(taken["snapshot"])
            with pytest.raises(StreamClientError) as gone:
                client.snapshot_rows(taken["snapshot"], 0, 8)
            assert gone.value.status == 410 and gone.value.code == "SNAPSHOT_GONE"
            consumer.send(b"FIN " + in_flight.msg_id + b"\nRDY 10\n")
            delivered = [consumer.read_message().body for _ in range(7)]
            assert delivered == [b"job %d" % number for number in range(1, 8)]  # none was taken
        with pytest.raises(StreamClientError, match="no stream or queue nope"):
            client.snapshot("nope")


def test_snapshots_read_back_from_disk_only_as_much_as_their_memory_allows(tmp_path: Path) -> None:
    """600 messages of 1,000 bytes on disk take about 0.75 MiB as a snapshot: one fits in 1 MiB,
    a second while the first is open does not, and once the first is closed it does."""
    with running_gateway("--mem-queue-size", "2", "--snapshot-memory", "1", data_dir=tmp_path) as gateway, \
            StreamClient(gateway.http) as client:
        host, port = gateway.nsq_http.rsplit(":", 1)
        connection = http.client.HTTPConnection(host, int(port), timeout=5)
        for create in ("/topic/create?topic=big", "/channel/create?topic=big&channel=work"):
            connection.request("POST", create)
            assert connection.getresponse().read() == b""
        bodies = [b"%04d" % number + b"x" * 996 for number in range(600)]
        connection.request("POST", "/mpub?topic=big", body=b"\n".join(bodies))
        assert connection.getresponse().read() == b"OK"
        connection.close()
        first = client.snapshot("big/work")
        assert first["rows"] == 600
        with pytest.raises(StreamClientError) as refused:
            client.snapshot("big/work")
        assert refused.value.status == 413 and refused.value.code == "SNAPSHOT_TOO_LARGE"
        assert "--snapshot-memory 1 MiB" in str(refused.value)
        rows = stream_rows.decode_read_rows(client.snapshot_rows(first["snapshot"], 0, 600))
        assert [row.body for row in rows] == bodies  # the open one reads whole
        client.snapshot_close(first["snapshot"])
        assert client.snapshot("big/work")["rows"] == 600
