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

WHERE = ("import polymq, polymq.core.engine as e, polymq.codecs.nsq as n, polymq.codecs.mqks as m, "
         "polymq.adapters.mqks.session as s; print(polymq.COMPILED, e.__file__, n.__file__, m.__file__, s.__file__)")
ROOT = Path(polymq.__file__).resolve().parent


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
    assert compiled == "False"
    assert [Path(file).name for file in files] == ["engine.py", "nsq.py", "mqks.py", "session.py"]


@pytest.mark.skipif(not polymq._compiled_modules() or polymq._stale(polymq._compiled_modules()),
                    reason="no compiled modules in this checkout, or sources edited since (make test compiles first)")
def test_without_the_switch_the_compiled_modules_load() -> None:
    env = {key: value for key, value in os.environ.items() if key != "POLYMQ_PURE_PYTHON"}
    out = subprocess.run([sys.executable, "-c", WHERE], env=env, capture_output=True, text=True, check=True).stdout
    compiled, *files = out.split()
    assert compiled == "True" and all(file.endswith(".so") for file in files), files


def test_every_folder_with_a_hot_module_counts_for_the_switch() -> None:
    # A compiled module outside `_COMPILED_FOLDERS` would load even when stale or switched off.
    hot = subprocess.run([sys.executable, "-c", "import runpy; print(*runpy.run_path('tools/mypyc_build.py')"
                          "['HOT_MODULES'])"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    assert "adapters/mqks/session.py" in hot
    assert {str(Path(module).parent) for module in hot} <= set(polymq._COMPILED_FOLDERS)


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
