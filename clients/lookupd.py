"""Which polymq gateways a cluster has, as nsqlookupd knows them (docs/cluster.md, docs/spark.md).

nsqlookupd lists nodes by their NSQ HTTP address (`broadcast_address:http_port`); each node's
nsqd `/info` names its own HTTP listener (`polymq_http_address`, the stream API). A node whose
listener is bound to a loopback or wildcard address is reached at its broadcast host instead, on
the same port. A node that is not polymq (a plain nsqd in the same cluster) has no such key and is
left out.
"""

from __future__ import annotations

import ipaddress
import json
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterable
from typing import Any

# How long one lookupd or node answer may take.
TIMEOUT_S = 10.0
INFO_KEY = "polymq_http_address"


class DiscoveryError(Exception):
    """No lookupd answered, or one answered with something that is not lookupd's JSON."""


def _get(address: str, path: str, timeout: float) -> Any:
    with urllib.request.urlopen(f"http://{address}{path}", timeout=timeout) as reply:
        return json.load(reply)


def _producers(lookupd: str, topic: str | None, timeout: float) -> list[dict[str, Any]]:
    path = "/nodes" if topic is None else "/lookup?" + urllib.parse.urlencode({"topic": topic})
    try:
        answer = _get(lookupd, path, timeout)
    except urllib.error.HTTPError as error:
        if error.code == 404:  # TOPIC_NOT_FOUND: no node has it (yet)
            return []
        raise
    producers = answer.get("producers") if isinstance(answer, dict) else None
    if not isinstance(producers, list):
        raise DiscoveryError(f"lookupd {lookupd} answered {path} without a producers list")
    return producers


def _is_local(host: str) -> bool:
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return host == "localhost"
    return address.is_loopback or address.is_unspecified


def gateway_of(producer: dict[str, Any], timeout: float = TIMEOUT_S) -> str | None:
    """The stream API address of a node lookupd lists, or None when it is not a polymq gateway."""
    host = str(producer.get("broadcast_address", ""))
    node = f"{host}:{producer.get('http_port')}"
    info = _get(node, "/info", timeout)
    address = info.get(INFO_KEY) if isinstance(info, dict) else None
    if not isinstance(address, str) or ":" not in address:
        return None
    own_host, _, port = address.rpartition(":")
    return f"{host}:{port}" if _is_local(own_host) and not _is_local(host) else address


def gateways(lookupds: Iterable[str], topics: Iterable[str] = (), timeout: float = TIMEOUT_S) -> list[str]:
    """The polymq gateways that hold any of `topics` (every node when none is given), sorted; the
    first lookupd that answers is enough, as NSQ's clients take them."""
    wanted = list(topics) or [None]
    errors = []
    for lookupd in lookupds:
        try:
            producers = [producer for topic in wanted for producer in _producers(lookupd, topic, timeout)]
        except (OSError, ValueError, DiscoveryError) as error:
            errors.append(f"{lookupd}: {error}")
            continue
        found: set[str] = set()
        for producer in producers:
            try:
                address = gateway_of(producer, timeout)
            except (OSError, ValueError) as error:
                raise DiscoveryError(f"node {producer.get('broadcast_address')}:{producer.get('http_port')}, "
                                     f"listed by lookupd {lookupd}, did not answer /info: {error}") from None
            if address is not None:
                found.add(address)
        return sorted(found)
    raise DiscoveryError("no lookupd answered: " + "; ".join(errors))
