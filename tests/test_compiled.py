"""The compiled hot modules and the pure-Python switch (`polymq/__init__.py`).

`make test` runs the whole suite with the compiled modules (POLYMQ_EXPECT_COMPILED=1 asserts they
are the ones in use) and the engine, store and codec units once more on the pure-Python sources
(POLYMQ_PURE_PYTHON=1).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import polymq
from polymq.core import engine

# One module of each compiled folder: the engine, the NSQ codec, the ZeroMQ pump, the eMQP broker.
WHERE = ("import polymq, polymq.core.engine as e, polymq.codecs.nsq as n, polymq.adapters.zmq_pump as p, "
         "polymq.adapters.emqp.broker as b; print(polymq.COMPILED, e.__file__, n.__file__, p.__file__, b.__file__)")


def test_the_expected_modules_are_in_use() -> None:
    if os.environ.get("POLYMQ_EXPECT_COMPILED"):
        assert polymq.COMPILED, "the compiled modules are not in use (did `python tools/mypyc_build.py` fail?)"
        assert engine.__file__ is not None and engine.__file__.endswith(".so")
    if os.environ.get("POLYMQ_PURE_PYTHON"):
        assert not polymq.COMPILED
        assert engine.__file__ is not None and engine.__file__.endswith(".py")


def test_pure_python_switch_loads_every_module_from_its_source() -> None:
    env = {**os.environ, "POLYMQ_PURE_PYTHON": "1"}
    out = subprocess.run([sys.executable, "-c", WHERE], env=env, capture_output=True, text=True, check=True).stdout
    compiled, *files = out.split()
    assert compiled == "False" and all(file.endswith(".py") for file in files), files


@pytest.mark.skipif(not polymq._compiled_modules() or polymq._stale(polymq._compiled_modules()),
                    reason="no compiled modules in this checkout, or sources edited since (make test compiles first)")
def test_without_the_switch_the_compiled_modules_load() -> None:
    env = {key: value for key, value in os.environ.items() if key != "POLYMQ_PURE_PYTHON"}
    out = subprocess.run([sys.executable, "-c", WHERE], env=env, capture_output=True, text=True, check=True).stdout
    compiled, *files = out.split()
    assert compiled == "True" and all(file.endswith(".so") for file in files), files


def test_every_compiled_module_is_in_a_folder_the_switch_counts() -> None:
    """A compiled module outside `_COMPILED_FOLDERS` would load even when stale or switched off."""
    sys.path.insert(0, str(Path(polymq.__file__).parent / "tools"))
    try:
        import mypyc_build
    finally:
        sys.path.pop(0)
    folders = {str(Path(module).parent) for module in mypyc_build.HOT_MODULES}
    assert folders <= set(polymq._COMPILED_FOLDERS)


def test_a_source_newer_than_its_compiled_module_is_stale(tmp_path: Path) -> None:
    source, library = tmp_path / "engine.py", tmp_path / "engine.cpython-311-x86_64-linux-gnu.so"
    source.write_text("")
    library.write_bytes(b"")
    past = time.time() - 10
    os.utime(source, (past, past))
    assert not polymq._stale([library])
    os.utime(source, None)  # edited after the compile
    assert polymq._stale([library])
    source.unlink()
    assert polymq._stale([library])
