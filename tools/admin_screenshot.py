"""Takes docs/images/admin-page.png: a gateway with a little traffic, its admin page in headless chromium.

Run by hand after a change to the page: `.venv/bin/python tools/admin_screenshot.py [PNG]`. It
starts `polymq serve --in-memory` on free loopback ports, publishes over PHPMQ and the nsqd HTTP
API while an NSQ channel reads, lets the page poll for a while so its charts have rates, saves
the screenshot and stops the gateway by its PID.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from selenium import webdriver
from selenium.webdriver.chrome.options import Options
from selenium.webdriver.chrome.service import Service

from polymq.codecs import nsq_client, phpmq

ROOT = Path(__file__).resolve().parent.parent
# Seconds of traffic before the picture: the page polls every 2 s, so the charts get a few dozen points.
TRAFFIC_S = 40
WIDTH = 1280  # pixels: a laptop's screen
PORT_FLAGS = ("--nsq-tcp-port", "--nsq-http-port", "--mqks-port", "--phpmq-port", "--phpmq-console-port",
              "--pzq-receive-port", "--pzq-send-port", "--pzq-monitor-port", "--emqp-backend-port",
              "--emqp-frontend-port", "--emqp-admin-port", "--emqp-pubsub-in-port", "--emqp-pubsub-out-port",
              "--admin-port")
LISTENING = re.compile(r" listening (\S+) (\S+):(\d+)$")


def start_gateway(*extra: str) -> tuple[subprocess.Popen[str], dict[str, tuple[str, int]]]:
    # PHPMQ deliveries not acknowledged in 0.3 s come back, and a second return is a dead letter.
    args = [sys.executable, "-m", "polymq", "serve", "--in-memory", "--phpmq-ack-timeout", "300",
            "--phpmq-max-attempts", "1", *extra]
    for flag in PORT_FLAGS:
        args += [flag, "0"]
    process = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    addresses: dict[str, tuple[str, int]] = {}
    assert process.stdout is not None
    for line in process.stdout:
        found = LISTENING.search(line.rstrip())
        if found:
            addresses[found.group(1)] = (found.group(2), int(found.group(3)))
        if line.rstrip().endswith(" ready"):
            return process, addresses
    raise SystemExit("the gateway did not start")


@contextlib.contextmanager
def running_gateway(*extra: str) -> Iterator[dict[str, tuple[str, int]]]:
    """`start_gateway`'s addresses while it runs; stopped by its PID afterwards."""
    process, addresses = start_gateway(*extra)
    try:
        yield addresses
    finally:
        os.kill(process.pid, signal.SIGTERM)
        process.wait(30)


@contextlib.contextmanager
def chromium(height: int) -> Iterator[webdriver.Chrome]:
    """Debian's chromium, headless, WIDTH x `height` pixels; quit afterwards."""
    options = Options()
    options.binary_location = shutil.which("chromium") or "chromium"
    for argument in ("--headless=new", "--no-sandbox", "--disable-gpu", f"--window-size={WIDTH},{height}",
                     "--hide-scrollbars"):
        options.add_argument(argument)
    browser = webdriver.Chrome(service=Service(shutil.which("chromedriver") or "chromedriver"), options=options)
    try:
        yield browser
    finally:
        browser.quit()


def main() -> None:
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "docs" / "images" / "admin-page.png"
    with running_gateway() as addresses:
        nsq_host, nsq_http = addresses["nsq-http"]
        with socket.create_connection(addresses["phpmq"]) as php, \
                socket.create_connection(addresses["phpmq"]) as worker, \
                socket.create_connection(addresses["nsq-tcp"]) as nsq, \
                socket.create_connection(addresses["nsq-tcp"]) as audit:
            php.sendall(phpmq.send(b"orders", b"first"))
            time.sleep(0.5)  # the topic is PHPMQ's: its first publish comes before the NSQ subscription
            nsq.sendall(nsq_client.magic() + nsq_client.sub("orders", "billing"))
            audit.sendall(nsq_client.magic() + nsq_client.sub("payments", "audit") + nsq_client.rdy(5))
            php.sendall(b"".join(phpmq.send(b"jobs", f"job {number}".encode()) for number in range(7)))
            worker.sendall(phpmq.consume(b"jobs", 10))  # takes them all and never acknowledges: dead letters
            admin = "http://{}:{}".format(*addresses["http"])
            time.sleep(0.5)
            urllib.request.urlopen(f"{admin}/api/queue/pause?queue=payments/audit", data=b"", timeout=10).read()
            with chromium(1000) as browser:
                browser.get(f"{admin}/")
                started = time.monotonic()
                resized = False
                while (second := time.monotonic() - started) < TRAFFIC_S:
                    for number in range(int(40 + 25 * math.sin(second / 4))):
                        php.sendall(phpmq.send(b"orders", f"order {number}".encode()))
                    urllib.request.urlopen(f"http://{nsq_host}:{nsq_http}/mpub?topic=payments",
                                           data=b"\n".join([b"payment"] * 12), timeout=10).read()
                    if not resized and second > TRAFFIC_S - 5:
                        # The whole page in one picture, drawn again at that size by the next polls.
                        height = browser.execute_script("return document.body.scrollHeight")
                        browser.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", {
                            "width": WIDTH, "height": height + 16, "deviceScaleFactor": 1, "mobile": False})
                        resized = True
                    time.sleep(0.5)
                target.parent.mkdir(parents=True, exist_ok=True)
                browser.save_screenshot(str(target))
    print(f"wrote {target}")


if __name__ == "__main__":
    main()
