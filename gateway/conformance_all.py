"""`polymq conformance all`: every protocol unit's conformance suite in one run (the suites'
shared runner does the work; this module only gathers the units' commands, naming none)."""

from __future__ import annotations

from polymq.adapters.protocol import load_command
from polymq.adapters.registry import protocols
from polymq.conformance.runner import combined_command

command = combined_command({unit.name: load_command(unit.conformance)
                            for unit in protocols() if unit.conformance is not None})
