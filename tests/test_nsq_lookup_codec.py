"""The nsqd → nsqlookupd codec: the bytes nsqd 1.3.0 writes, the responses it reads."""

from __future__ import annotations

import json
import struct

import pytest

from polymq.codecs import nsq_lookup


def test_commands_are_written_as_go_nsq_writes_them() -> None:
    assert nsq_lookup.MAGIC_V1 == b"  V1"
    assert nsq_lookup.register("t") == b"REGISTER t\n"
    assert nsq_lookup.register("t", "c#ephemeral") == b"REGISTER t c#ephemeral\n"
    assert nsq_lookup.unregister("t") == b"UNREGISTER t\n"
    assert nsq_lookup.unregister("t", "c") == b"UNREGISTER t c\n"
    assert nsq_lookup.ping() == b"PING\n"


def test_identify_carries_nsqds_json_body_with_its_size() -> None:
    sent = nsq_lookup.identify("node<1>", 4150, 4151, "1.3.0", "host&1")
    assert sent.startswith(b"IDENTIFY\n")
    (size,) = struct.unpack(">i", sent[9:13])
    body = sent[13:]
    assert size == len(body)
    # json.Marshal of nsqd's map: sorted keys, no spaces, HTML characters escaped.
    assert body == (b'{"broadcast_address":"node\\u003c1\\u003e","hostname":"host\\u00261","http_port":4151,'
                    b'"tcp_port":4150,"version":"1.3.0"}')
    assert json.loads(body)["broadcast_address"] == "node<1>"


def test_responses_are_cut_from_any_split_of_the_stream() -> None:
    stream = b"".join(struct.pack(">i", len(data)) + data for data in (b"OK", b'{"tcp_port":4160}', b"", b"OK"))
    for cut in range(len(stream) + 1):
        reader = nsq_lookup.ResponseReader(1024)
        got = reader.receive_data(stream[:cut]) + reader.receive_data(stream[cut:])
        assert got == [b"OK", b'{"tcp_port":4160}', b"", b"OK"]


def test_a_response_over_the_limit_is_refused_before_it_is_read() -> None:
    reader = nsq_lookup.ResponseReader(10)
    with pytest.raises(nsq_lookup.LookupProtocolError, match="greater than limit"):
        reader.receive_data(struct.pack(">i", 11))
    with pytest.raises(nsq_lookup.LookupProtocolError):
        nsq_lookup.ResponseReader(10).receive_data(struct.pack(">i", -1))
    assert nsq_lookup.is_error(b"E_BAD_TOPIC REGISTER topic name 'x y' is not valid")
    assert not nsq_lookup.is_error(b"OK")
