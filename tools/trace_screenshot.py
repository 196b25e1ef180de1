"""Takes docs/images/trace-timeline.png: a traced message's timeline on the admin page.

Run by hand after a change to the page: `.venv/bin/python tools/trace_screenshot.py [PNG]`. It starts
`polymq serve --in-memory --trace orders` on free loopback ports (tools/admin_screenshot.py's start),
publishes one order over MQKS to an NSQ channel whose reader lets the first delivery time out, requeues
the second and finishes the third, while a PHPMQ queue of the topic keeps its copy; then finds the
message on the page by its NSQ id, saves the picture of the tracing section and stops the gateway by
its PID.
"""

from __future__ import annotations

import json
import socket
import sys
import time
from pathlib import Path

from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

from polymq.clients import nsq
from polymq.codecs import nsq_client, phpmq

sys.path.insert(0, str(Path(__file__).resolve().parent))
from admin_screenshot import ROOT, chromium, running_gateway

# The shortest msg_timeout an NSQ client may ask for (nsqd's rule): the first delivery times out.
MSG_TIMEOUT_MS = 1000
WAIT_S = 30


def _message(reader: nsq.Connection) -> nsq_client.Message:
    frame = reader.next_frame(WAIT_S)
    assert frame is not None and frame.is_message
    return nsq_client.decode_message(frame.data)


def main() -> None:
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "docs" / "images" / "trace-timeline.png"
    with running_gateway("--trace", "orders") as addresses, socket.create_connection(addresses["phpmq"]) as php, \
                socket.create_connection(addresses["mqks"]) as mqks, nsq.Connection(addresses["nsq-tcp"]) as reader:
        php.sendall(phpmq.consume(b"orders", 0))  # PHPMQ's queue `orders`: keeps its copy, reads none
        reader.send(nsq_client.identify({"client_id": "billing-worker", "msg_timeout": MSG_TIMEOUT_MS}))
        reader.wait_for_ok("IDENTIFY")
        reader.send(nsq_client.sub("orders", "billing"))
        reader.wait_for_ok("SUB")
        reader.send(nsq_client.rdy(1))
        time.sleep(0.5)  # PHPMQ's consume is handled: its queue is bound
        mqks.sendall(b"order-1042 publish orders " + json.dumps({"order": 1042}).encode() + b"\n")
        first = _message(reader)
        second = _message(reader)  # the first timed out
        reader.send(nsq_client.req(second.msg_id, 500))
        third = _message(reader)
        reader.send(nsq_client.fin(third.msg_id))
        admin = "http://{}:{}".format(*addresses["http"])
        with chromium(2000) as browser:
            browser.get(f"{admin}/")
            query = browser.find_element(By.ID, "trace-query")
            query.send_keys(first.msg_id.decode())
            browser.find_element(By.CSS_SELECTOR, "#trace-search button").click()
            WebDriverWait(browser, WAIT_S).until(
                lambda driver: len(driver.find_elements(By.CSS_SELECTOR, "#trace-found tr[data-event]")) == 9)
            time.sleep(2.5)  # one more poll: the recent list shows the finished copy
            target.parent.mkdir(parents=True, exist_ok=True)
            browser.find_element(By.ID, "tracing").screenshot(str(target))
    print(f"wrote {target}")


if __name__ == "__main__":
    main()
