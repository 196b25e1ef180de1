"""The admin page in a real browser (headless chromium): a real gateway, clients of two protocols,
the page read and an action taken through it, the gateway's state checked through nsqd's API."""

from __future__ import annotations

import json
import os
import socket
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from selenium.common.exceptions import NoSuchElementException, StaleElementReferenceException
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.support.ui import WebDriverWait

from polymq.clients import nsq as nsq_blocking
from polymq.codecs import nsq_client, phpmq

from support import nsq_wire
from support.browser import chromium
from support.gateway import GatewayProcess, running_gateway
from support.nats_cluster import NatsCluster, NatsServer
from support.nsq_wire import subscribed_socket

TOKEN = "page-test-token-0123456789"
# Long enough for a loaded 2-core machine; every wait ends as soon as its condition holds.
WAIT_S = 60
# A topic name that is HTML: the page must show it as text.
HOSTILE = '<img src=x onerror="document.body.dataset.pwned=1">'
# What the page shows for an event without a client (an en dash).
NO_CLIENT = "\u2013"
RETRIED = (StaleElementReferenceException, NoSuchElementException)  # the page redraws its tables every poll


def _state(gateway: GatewayProcess) -> dict[str, Any]:
    request = urllib.request.Request(f"http://{gateway.http}/api/state", headers={"Authorization": f"Bearer {TOKEN}"})
    with urllib.request.urlopen(request, timeout=10) as reply:
        return json.loads(reply.read())


def _until(what: str, condition: Callable[[], Any]) -> Any:
    deadline = time.monotonic() + WAIT_S
    while not (found := condition()):
        assert time.monotonic() < deadline, f"waited {WAIT_S} s for {what}"
        time.sleep(0.05)
    return found


def _nsq_channel(gateway: GatewayProcess, topic: str, channel: str) -> dict[str, Any] | None:
    host, port = gateway.host_port("nsq-http")
    with urllib.request.urlopen(f"http://{host}:{port}/stats?format=json&topic={topic}", timeout=10) as reply:
        stats = json.loads(reply.read())
    for found in stats["topics"]:
        for candidate in found["channels"]:
            if found["topic_name"] == topic and candidate["channel_name"] == channel:
                return candidate
    return None



def _bound(browser: WebDriver, topic: str) -> dict[str, str]:
    """The queues the page lists for `topic`, with the protocol it says made each."""
    items = browser.find_elements(By.CSS_SELECTOR, f'tr[data-topic="{topic}"] li[data-bound-queue]')
    return {item.get_attribute("data-bound-queue") or "": item.find_element(By.CSS_SELECTOR, ".badge").text
            for item in items}


def _click(browser: WebDriver, selector: str) -> None:
    def clicked(driver: WebDriver) -> bool:
        driver.find_element(By.CSS_SELECTOR, selector).click()
        return True

    WebDriverWait(browser, WAIT_S, ignored_exceptions=RETRIED).until(clicked)


def _text(browser: WebDriver, selector: str) -> str:
    return WebDriverWait(browser, WAIT_S, ignored_exceptions=RETRIED).until(
        lambda driver: driver.find_element(By.CSS_SELECTOR, selector).text)


def test_the_page_shows_protocols_side_by_side_and_pauses_a_channel(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    with running_gateway("--admin-token-file", str(token_file), data_dir=tmp_path / "data") as gateway, \
            socket.create_connection(gateway.host_port("phpmq"), timeout=10) as php:
        php.sendall(phpmq.send(b"orders", b"one") + phpmq.send(HOSTILE.encode(), b"x"))
        # PHPMQ publishes get no answer: the topic is PHPMQ's once the gateway shows it.
        _until("the PHPMQ publishes", lambda: {"orders", HOSTILE} <= {t["name"] for t in _state(gateway)["topics"]})
        with subscribed_socket(gateway.host_port("nsq-tcp"), "orders", "billing"), chromium() as browser:
            browser.get(f"http://{gateway.http}/")
            wait = WebDriverWait(browser, WAIT_S, ignored_exceptions=RETRIED)
            token_input = wait.until(lambda driver: driver.find_element(By.ID, "token-input"))
            wait.until(lambda driver: token_input.is_displayed())
            token_input.send_keys(TOKEN)
            browser.find_element(By.ID, "token-ok").click()

            # The topic PHPMQ made, its PHPMQ queue next to the NSQ channel reading it.
            wait.until(lambda driver: _bound(driver, "orders") == {"orders": "phpmq", "orders/billing": "nsq"})
            assert _text(browser, 'tr[data-topic="orders"] td:nth-child(2)') == "phpmq"
            assert _text(browser, 'tr[data-queue="orders/billing"] td:nth-child(2)') == "nsq"
            assert _text(browser, 'tr[data-queue="orders/billing"] td:nth-child(8)') == "1"  # its consumer
            wait.until(lambda driver: int(_text(driver, 'tr[data-protocol="phpmq"] td:nth-child(2)')) == 1)
            assert _text(browser, 'tr[data-protocol="nsq"] td:nth-child(2)') == "1"
            assert not browser.find_element(By.ID, "cluster").is_displayed()  # a node on its own

            # A name that is HTML is shown as it is, and nothing of it runs.
            names = [cell.text for cell in browser.find_elements(By.CSS_SELECTOR, "#topics td.name")]
            assert HOSTILE in names
            assert browser.find_elements(By.CSS_SELECTOR, "main img") == []
            assert browser.execute_script("return document.body.dataset.pwned") is None

            # Pause the NSQ channel through the page, confirming in its dialog.
            assert not _nsq_channel(gateway, "orders", "billing")["paused"]  # type: ignore[index]
            _click(browser, 'tr[data-queue="orders/billing"] button[data-action="pause"]')
            dialog = browser.find_element(By.ID, "confirm")
            wait.until(lambda driver: dialog.is_displayed())
            assert dialog.find_element(By.ID, "confirm-title").text == "Pause queue orders/billing?"
            browser.find_element(By.ID, "confirm-ok").click()
            _until("nsqd's /stats to say the channel is paused",
                   lambda: _nsq_channel(gateway, "orders", "billing")["paused"])  # type: ignore[index]
            wait.until(lambda driver: "paused" in _text(driver, 'tr[data-queue="orders/billing"] td:nth-child(4)'))
            assert [queue["paused"] for queue in _state(gateway)["queues"] if queue["name"] == "orders"] == [False]

            # Cancelling the confirmation does nothing.
            _click(browser, 'tr[data-queue="orders"] button[data-action="delete"]')
            wait.until(lambda driver: dialog.is_displayed())
            browser.find_element(By.ID, "confirm-cancel").click()
            wait.until(lambda driver: not dialog.is_displayed())
            assert "orders" in {queue["name"] for queue in _state(gateway)["queues"]}


def test_the_status_line_names_the_jetstream_server_and_the_node(tmp_path: Path, nats_server: NatsServer) -> None:
    """On a node whose queues live in JetStream, the page says so, with the server it talks to and its number."""
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    with running_gateway("--admin-token-file", str(token_file), "--jetstream", nats_server.url,
                         data_dir=tmp_path / "data") as gateway, chromium() as browser:
        node = _state(gateway)["backend"]["node"]
        browser.get(f"http://{gateway.http}/")
        wait = WebDriverWait(browser, WAIT_S, ignored_exceptions=RETRIED)
        token_input = wait.until(lambda driver: driver.find_element(By.ID, "token-input"))
        wait.until(lambda driver: token_input.is_displayed())
        token_input.send_keys(TOKEN)
        browser.find_element(By.ID, "token-ok").click()
        status = wait.until(lambda driver: "JetStream" in _text(driver, "#status") and _text(driver, "#status"))
        assert status.endswith(f" — queues in JetStream at {nats_server.url} (node {node})"), status
        assert status.startswith("updated ")


def test_a_nodes_page_shows_the_cluster_with_a_queue_read_through_both_nodes(
        tmp_path: Path, nats_cluster: NatsCluster) -> None:
    """Two nodes on the three-server cluster, a channel's consumers holding 2 messages on one node and 1 on the
    other, 10 published: the other node's page lists both nodes, the topic's stream with its leader and its two
    other replicas current, and the queue over both (7 ready, 3 in flight, 2 consumers, each node's part). Its
    picture (POLYMQ_SCREENSHOTS=DIR writes it there: docs/images)."""
    topic, channel = "orders", "billing"
    servers = ",".join(nats_cluster.urls)
    names = {server.name for server in nats_cluster.servers}
    with running_gateway("--jetstream", servers, data_dir=tmp_path / "one") as one, \
            running_gateway("--jetstream", servers, data_dir=tmp_path / "two") as two:
        request = urllib.request.Request(f"http://{one.nsq_http}/channel/create?topic={topic}&channel={channel}",
                                         method="POST")
        urllib.request.urlopen(urllib.request.Request(f"http://{one.nsq_http}/topic/create?topic={topic}",
                                                      method="POST"), timeout=10).close()
        urllib.request.urlopen(request, timeout=10).close()
        body = b"\n".join(b"order %d" % index for index in range(10))
        urllib.request.urlopen(urllib.request.Request(f"http://{one.nsq_http}/mpub?topic={topic}", data=body,
                                                      method="POST"), timeout=10).close()
        first = nsq_wire.holding(one.nsq_tcp, topic, channel, 2)
        second = nsq_wire.holding(two.nsq_tcp, topic, channel, 1)
        try:
            number_one, number_two = (_state(gateway)["backend"]["node"] for gateway in (one, two))
            with chromium() as browser:
                browser.get(f"http://{two.http}/")
                wait = WebDriverWait(browser, WAIT_S, ignored_exceptions=RETRIED)
                row = f'tr[data-cluster-queue="{topic}/{channel}"]'
                wait.until(lambda driver: [_text(driver, f"{row} td:nth-child({n})") for n in (3, 4, 5, 7)]
                           == ["7", "3", "0", "2"])
                assert _text(browser, f"{row} td:nth-child(2)") == topic
                stream = f'tr[data-stream="{topic}"]'  # led by one server, its replicas on the two others
                leader = wait.until(lambda driver: _text(driver, f"{stream} td:nth-child(2)") in names
                                    and _text(driver, f"{stream} td:nth-child(2)"))

                def replicas(driver: WebDriver) -> list[str]:
                    return sorted(item.text for item in driver.find_elements(By.CSS_SELECTOR,
                                                                               f"{stream} li[data-replica]"))

                wait.until(lambda driver: replicas(driver) == sorted(f"{name}: current (0)"
                                                                     for name in names - {leader}))
                assert _text(browser, f"{stream} td:nth-child(4)") == "10"
                assert _text(browser, "#cluster-server") in nats_cluster.urls
                parts = [item.text for item in browser.find_elements(By.CSS_SELECTOR, f"{row} li[data-part]")]
                assert sorted(parts) == sorted([f"node {number_one}: 1, 2, 0", f"node {number_two}: 1, 1, 0"]), parts
                listed = [row.get_attribute("data-node") for row in
                          browser.find_elements(By.CSS_SELECTOR, "#cluster-nodes tr[data-node]")]
                assert listed == [str(node) for node in sorted((number_one, number_two))]
                picture = browser.find_element(By.ID, "cluster").screenshot_as_png
                assert picture.startswith(b"\x89PNG")
                folder = os.environ.get("POLYMQ_SCREENSHOTS")
                if folder:
                    (Path(folder) / "admin-cluster.png").write_bytes(picture)
        finally:
            first.close()
            second.close()


def test_a_traced_message_s_timeline_across_protocols_and_a_topic_traced_through_the_page(tmp_path: Path) -> None:
    """Published over MQKS, read over NSQ and requeued, then finished: its timeline found by the NSQ id and
    the PHPMQ one; a topic whose name is HTML traced with its button, shown as text."""
    with running_gateway("--trace", "orders", data_dir=tmp_path / "data") as gateway, \
            nsq_blocking.Connection(gateway.nsq_tcp) as reader, \
            socket.create_connection(gateway.host_port("phpmq"), timeout=10) as php, \
            socket.create_connection(gateway.host_port("mqks"), timeout=10) as mqks:
        reader.send(nsq_client.identify({"client_id": "billing-worker"}))
        reader.wait_for_ok("IDENTIFY")
        reader.send(nsq_client.sub("orders", "billing"))
        reader.wait_for_ok("SUB")
        reader.send(nsq_client.rdy(1))
        mqks.sendall(b"order-7 publish orders order 7\n")
        php.sendall(phpmq.send(HOSTILE.encode(), b"x"))
        first = nsq_client.decode_message(reader.next_frame(WAIT_S).data)  # type: ignore[union-attr]
        reader.send(nsq_client.req(first.msg_id, 0))
        again = nsq_client.decode_message(reader.next_frame(WAIT_S).data)  # type: ignore[union-attr]
        reader.send(nsq_client.fin(again.msg_id))
        with chromium() as browser:
            browser.get(f"http://{gateway.http}/")
            wait = WebDriverWait(browser, WAIT_S, ignored_exceptions=RETRIED)
            # Listed among the topic's recent traced messages, by its NSQ id; its timeline a click away.
            _click(browser, '[data-trace-topic="orders"] tr[data-traced-message] button')
            message = wait.until(lambda driver: driver.find_element(By.CSS_SELECTOR, "#trace-found .timeline"))
            wait.until(lambda driver: len(driver.find_elements(By.CSS_SELECTOR, "#trace-found tr[data-event]")) == 6)
            rows = [[cell.text for cell in row.find_elements(By.TAG_NAME, "td")][1:6]
                    for row in browser.find_elements(By.CSS_SELECTOR, "#trace-found tr[data-event]")]
            peer = rows[0][3]
            assert rows == [
                ["published", "orders", "mqks", peer, ""],
                ["queued", "orders/billing", "", NO_CLIENT, ""],
                ["delivered", "orders/billing", "nsq", rows[2][3], "1"],
                ["requeued", "orders/billing", "nsq", rows[2][3], "1"],
                ["delivered", "orders/billing", "nsq", rows[2][3], "2"],
                ["finished", "orders/billing", "nsq", rows[2][3], "2"],
            ]
            assert peer.startswith("(127.0.0.1:") and rows[2][3].startswith("billing-worker (127.0.0.1:")
            assert message.find_element(By.CSS_SELECTOR, 'dd[data-id="nsq"]').text == first.msg_id.decode()
            assert message.find_element(By.CSS_SELECTOR, ".ok").text == "Every copy came to an end."

            # Found again by its PHPMQ id, typed into the search.
            phpmq_id = message.find_element(By.CSS_SELECTOR, 'dd[data-id="phpmq"]').text
            browser.execute_script("document.getElementById('trace-found').replaceChildren()")
            browser.find_element(By.ID, "trace-query").clear()
            browser.find_element(By.ID, "trace-query").send_keys(phpmq_id)
            browser.find_element(By.CSS_SELECTOR, "#trace-search button").click()
            wait.until(lambda driver: len(driver.find_elements(By.CSS_SELECTOR, "#trace-found tr[data-event]")) == 6)

            # Trace the topic whose name is HTML with its button; its name shows as text, nothing of it runs.
            def hostile(driver: WebDriver, selector: str) -> Any:
                """The element of `selector` inside the block whose data attribute is the HTML name (no CSS
                selector can quote it)."""
                return driver.execute_script(
                    "const [attribute, name, inner] = arguments;"
                    "const block = [...document.querySelectorAll(`[${attribute}]`)].find("
                    "  (node) => node.getAttribute(attribute) === name);"
                    "return block ? block.querySelector(inner) : null;",
                    selector.split(" ", 1)[0], HOSTILE, selector.split(" ", 1)[1])

            wait.until(lambda driver: hostile(driver, 'data-topic button[data-action="trace"]')).click()
            dialog = browser.find_element(By.ID, "confirm")
            wait.until(lambda driver: dialog.is_displayed())
            assert dialog.find_element(By.ID, "confirm-title").text == f"Trace topic {HOSTILE}?"
            browser.find_element(By.ID, "confirm-ok").click()
            wait.until(lambda driver: (cell := hostile(driver, "data-topic td:nth-child(3)")) and "traced" in cell.text)
            php.sendall(phpmq.send(HOSTILE.encode(), b"y"))
            heading = wait.until(lambda driver: hostile(driver, "data-trace-topic tr[data-traced-message]")
                                 and hostile(driver, "data-trace-topic h3"))
            assert HOSTILE in heading.text
            assert browser.find_elements(By.CSS_SELECTOR, "main img") == []
            assert browser.execute_script("return document.body.dataset.pwned") is None
