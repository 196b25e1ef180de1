"""The compiled hot modules and the pure-Python switch (`polymq/__init__.py`).

`make test` runs the whole suite with the compiled modules (POLYMQ_EXPECT_COMPILED=1 asserts they
are the ones in use) and the engine, store, codec and session units once more on the pure-Python
sources (POLYMQ_PURE_PYTHON=1).
"""

from __future__ import annotations

import ast
import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

import polymq
from polymq.adapters import session
from polymq.core import engine
from polymq.native import zmq_loops

# One compiled module of each folder of HOT_MODULES: where each was loaded from.
WHERE = ("import polymq, polymq.core.engine as e, polymq.codecs.nsq as n, polymq.adapters.session as s, "
         "polymq.adapters.nsq.tcp as t, polymq.codecs.mqks as m, polymq.adapters.mqks.session as q; "
         "import polymq.adapters.zmq_pump as p, polymq.adapters.emqp.broker as b; "
         "print(polymq.COMPILED, e.__file__, n.__file__, s.__file__, t.__file__, m.__file__, q.__file__, p.__file__, "
         "b.__file__)")
BUILD = Path(polymq.__file__).resolve().parent / "tools" / "mypyc_build.py"


def test_the_expected_modules_are_in_use() -> None:
    if os.environ.get("POLYMQ_EXPECT_COMPILED"):
        assert polymq.COMPILED, "the compiled modules are not in use (did `python tools/mypyc_build.py` fail?)"
        assert engine.__file__ is not None and engine.__file__.endswith(".so")
        assert session.__file__ is not None and session.__file__.endswith(".so")
        assert zmq_loops.in_use(), "the ZeroMQ frame loops in C are not in use"
    if os.environ.get("POLYMQ_PURE_PYTHON"):
        assert not polymq.COMPILED
        assert not zmq_loops.in_use()
        assert engine.__file__ is not None and engine.__file__.endswith(".py")
        assert session.__file__ is not None and session.__file__.endswith(".py")


def test_pure_python_switch_loads_every_module_from_its_source() -> None:
    env = {**os.environ, "POLYMQ_PURE_PYTHON": "1"}
    out = subprocess.run([sys.executable, "-c", WHERE], env=env, capture_output=True, text=True, check=True).stdout
    compiled, *files = out.split()
    assert compiled == "False" and files and all(file.endswith(".py") for file in files)


@pytest.mark.skipif(not polymq._compiled_modules() or polymq._stale(polymq._compiled_modules()),
                    reason="no compiled modules in this checkout, or sources edited since (make test compiles first)")
def test_without_the_switch_the_compiled_modules_load() -> None:
    env = {key: value for key, value in os.environ.items() if key != "POLYMQ_PURE_PYTHON"}
    out = subprocess.run([sys.executable, "-c", WHERE], env=env, capture_output=True, text=True, check=True).stdout
    compiled, *files = out.split()
    assert compiled == "True" and files and all(file.endswith(".so") for file in files)


def test_the_compiled_folders_are_those_of_the_hot_modules() -> None:
    # polymq/__init__.py cannot import tools/: the two lists are kept alike by this test.
    build = _build_tool()
    assert build.compiled_folders() == polymq._COMPILED_FOLDERS
    # The hand-written C modules live in folders of their own: a `.so` without a `.py` beside it in
    # a compiled folder would make every compiled module stale.
    c_folders = {Path(source).parent.as_posix() for source in build.C_MODULES.values()}
    assert not c_folders & set(polymq._COMPILED_FOLDERS)
    assert {path.parent.relative_to(build.PACKAGE).as_posix() for path in build.compiled_files()
            if not path.name.startswith("compiled__mypyc")} <= set(polymq._COMPILED_FOLDERS) | c_folders


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


# Module-level names a test sets to another value (a store that rolls its segments every few records).
SET_BY_TESTS = {("core/disk_storage.py", "SEGMENT_BYTES")}


def test_the_compiled_modules_constants_are_final() -> None:
    """A constant of a compiled module that is not `Final` costs a module-dict lookup at every use
    (docs/performance.md, "The compiled hot modules")."""
    build = _build_tool()
    plain = []
    for module in build.HOT_MODULES:
        for node in ast.parse((build.PACKAGE / module).read_text(encoding="utf-8")).body:
            if isinstance(node, ast.Assign) and len(node.targets) == 1:
                target = node.targets[0]
            elif isinstance(node, ast.AnnAssign) and "Final" not in ast.unparse(node.annotation):
                target = node.target
            else:
                continue
            name = target.id if isinstance(target, ast.Name) else ""
            if name.lstrip("_").isupper() and (module, name) not in SET_BY_TESTS:
                plain.append(f"{module}: {name}")
    assert plain == []


def _build_tool() -> Any:
    """tools/mypyc_build.py as a module (tools/ is no package)."""
    spec = importlib.util.spec_from_file_location("mypyc_build", BUILD)
    assert spec is not None and spec.loader is not None
    build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build)
    return build
