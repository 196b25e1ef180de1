"""Which protocols the gateway serves: the built-in units, then any registered under the
entry-point group `polymq.protocols` by another installed package (docs/architecture.md)."""

from __future__ import annotations

import functools
import importlib
import importlib.metadata

from polymq.adapters.protocol import Protocol

# The units that come with polymq, in the order help texts and the config file list them.
BUILTIN_UNITS = ("polymq.adapters.nsq", "polymq.adapters.mqks", "polymq.adapters.phpmq",
                 "polymq.adapters.pzq", "polymq.adapters.emqp")
ENTRY_POINT_GROUP = "polymq.protocols"


class RegistryError(Exception):
    """A registered protocol that cannot be served: not a Protocol, or a name or flag taken."""


@functools.cache
def protocols() -> tuple[Protocol, ...]:
    found: list[Protocol] = [importlib.import_module(unit).PROTOCOL for unit in BUILTIN_UNITS]
    for entry_point in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        unit = entry_point.load()
        if not isinstance(unit, Protocol):
            raise RegistryError(f"entry point {entry_point.name} = {entry_point.value} is not a polymq Protocol")
        found.append(unit)
    names: set[str] = set()
    for unit in found:
        if unit.name in names:
            raise RegistryError(f"two protocols are named {unit.name!r}")
        names.add(unit.name)
    return tuple(found)
