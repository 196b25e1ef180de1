"""Sends requests with EventMQ 0.3.13's own client library (run inside .interop/eventmq).

    python client_driver.py <frontend host:port> '<json: {"requests": [{"tag", "queue", "reply", "seconds"}]}>'

Prints a JSON object: the msgid of each request, and the "dispatched" REPLYs the broker sent back
(the library never reads them; this driver does, from the same socket, for 1 s).
"""

from __future__ import annotations

import json
import sys
import time

import zmq
from eventmq.client.messages import send_request
from eventmq.sender import Sender


def main() -> None:
    address, spec = sys.argv[1], json.loads(sys.argv[2])
    sender = Sender()
    sender.connect(f"tcp://{address}")
    sent = []
    for request in spec["requests"]:
        job = ["run", {"path": "jobs", "callable": "record",
                       "args": [request["tag"], request.get("seconds", 0.0)]}]
        sent.append(send_request(sender, job, reply_requested=request.get("reply", False),
                                 queue=request["queue"]))
    dispatched = []
    deadline = time.monotonic() + spec.get("read_replies_s", 1.0)
    poller = zmq.Poller()
    poller.register(sender.zsocket, zmq.POLLIN)
    while (left := deadline - time.monotonic()) > 0:
        if poller.poll(int(left * 1000)):
            frames = sender.zsocket.recv_multipart()
            if frames[2] == b"REPLY":
                dispatched.append(frames[4].decode())
    print(json.dumps({"sent": sent, "dispatched": dispatched}))


if __name__ == "__main__":
    main()
