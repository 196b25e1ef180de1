"""Sends requests with EventMQ 0.3.13's own client library (run inside .interop/eventmq).

    python client_driver.py <frontend host:port> '<json spec>'

The spec: {"requests": [{"tag", "queue", "reply", "seconds", "gate"}], "schedules": [{"tag", "queue",
"interval" or "cron", "headers", "unschedule"}]}; requests go through `send_request`, schedules
through `schedule` (both jobs.record with the tag). Prints a JSON object: the msgid of each
request and schedule, and the "dispatched" REPLYs the broker sent back (the library never reads
them; this driver does, from the same socket, for `read_replies_s`, 1 s by default).
"""

from __future__ import annotations

import json
import sys
import time

import zmq
from eventmq.client.messages import schedule, send_request
from eventmq.sender import Sender

# How long the requests queued at the end may take to leave: far above a loopback connection's
# handshake, below the tests' own deadlines.
SEND_LINGER_MS = 10_000


def main() -> None:
    address, spec = sys.argv[1], json.loads(sys.argv[2])
    sender = Sender()
    sender.connect(f"tcp://{address}")
    sent = []
    for request in spec.get("requests", []):
        job = ["run", {"path": "jobs", "callable": "record",
                       "args": [request["tag"], request.get("seconds", 0.0), request.get("gate", "")]}]
        sent.append(send_request(sender, job, reply_requested=request.get("reply", False),
                                 queue=request["queue"]))
    scheduled = []
    for job in spec.get("schedules", []):
        scheduled.append(schedule(sender, "jobs.record", interval_secs=job.get("interval"), cron=job.get("cron"),
                                  args=(job["tag"],), headers=tuple(job.get("headers", ())), queue=job["queue"],
                                  unschedule=job.get("unschedule", False)))
    dispatched = []
    deadline = time.monotonic() + spec.get("read_replies_s", 1.0)
    poller = zmq.Poller()
    poller.register(sender.zsocket, zmq.POLLIN)
    while (left := deadline - time.monotonic()) > 0:
        if poller.poll(int(left * 1000)):
            frames = sender.zsocket.recv_multipart()
            if frames[2] == b"REPLY":
                dispatched.append(frames[4].decode())
    # Hand every request to TCP before exiting: pyzmq leaves a context alone at interpreter exit, so
    # what its I/O thread had not written yet (the connection's handshake may still be under way)
    # would be lost with the process.
    sender.zsocket.close(linger=SEND_LINGER_MS)
    sender.zcontext.term()
    print(json.dumps({"sent": sent, "scheduled": scheduled, "dispatched": dispatched}))


if __name__ == "__main__":
    main()
