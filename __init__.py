"""polymq: one gateway speaking NSQ V2, MQKS, PHPMQ, PZQ and eMQP over one shared queue engine.

The hot modules (the NSQ, MQKS and eMQP codecs, the NSQ and MQKS sessions, the TCP session
skeleton and its transport, the eMQP broker, the ZeroMQ pump, the engine, the store) may be
compiled with mypyc next to their sources (`python tools/mypyc_build.py`, run by `make install`);
the pure-Python sources are the same code and stay the reference. They are used instead when
`POLYMQ_PURE_PYTHON=1` is set, or when any compiled module is older than its source (an edit
since the last compile), so a stale build never runs. See docs/performance.md.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

__version__ = "0.1.0"

_ROOT = Path(__file__).resolve().parent
# Folders whose modules may be compiled (tools/mypyc_build.py: the folders of HOT_MODULES).
_COMPILED_FOLDERS = ("core", "codecs", "adapters", "adapters/nsq", "adapters/mqks", "adapters/emqp")


def _compiled_modules() -> list[Path]:
    return [path for folder in _COMPILED_FOLDERS for path in (_ROOT / folder).glob("*.so")]


def _stale(compiled: list[Path]) -> bool:
    for library in compiled:
        source = library.with_name(library.name.split(".", 1)[0] + ".py")
        if not source.exists() or source.stat().st_mtime > library.stat().st_mtime:
            return True
    return False


class _SourceOnly(importlib.abc.MetaPathFinder):
    """Finds polymq's submodules among the `.py` sources only, never a compiled `.so`."""

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if not fullname.startswith(__name__ + ".") or not path:
            return None
        for entry in path:
            finder = importlib.machinery.FileFinder(
                entry, (importlib.machinery.SourceFileLoader, importlib.machinery.SOURCE_SUFFIXES))
            spec = finder.find_spec(fullname, target)
            if spec is not None:
                return spec
        return None


def _choose() -> bool:
    compiled = _compiled_modules()
    if not compiled:
        return False
    if os.environ.get("POLYMQ_PURE_PYTHON") or _stale(compiled):
        sys.meta_path.insert(0, _SourceOnly())
        return False
    return True


# True when the compiled hot modules are in use.
COMPILED = _choose()
