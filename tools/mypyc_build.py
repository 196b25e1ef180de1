"""Compile the hot modules with mypyc, next to their sources: `python tools/mypyc_build.py`.

`make install` runs it. The modules are fully typed, so mypyc turns them into C extensions
without changing a line; the pure-Python sources stay the reference and are used whenever the
compiled ones are missing, older than their sources, or `POLYMQ_PURE_PYTHON=1` is set
(`polymq/__init__.py`). Measured with nsq's bench tools (docs/performance.md): consuming a
backlog +25-37 %, MPUB +10-30 %; a PUB round trip is mostly the loop, sockets and disk.

The build runs in a temporary folder outside the package (the repository root is the package),
where `polymq` is a link to it, so that mypyc names the modules `polymq.core.engine` and so on,
and the shared runtime it adds lands inside the package (`polymq/compiled__mypyc…so`), never as
a top-level module. `--clean` removes the compiled files.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from pathlib import Path

import click

import polymq

# The modules on the hot path of every protocol: framing of the busiest codec, the engine's queue
# operations, ids and clock, the store's records, commit and read-back, timers; the TCP session
# skeleton, its socket transport and its traffic counters, and the NSQ session on them (a PUB's
# answer and a delivery's frame); and eMQP's path: its codec, its broker and the ZeroMQ pump
# (PZQ's too). Their folders are `polymq._COMPILED_FOLDERS`.
HOT_MODULES = (
    "core/ids.py",
    "core/clock.py",
    "core/message.py",
    "core/records.py",
    "core/timers.py",
    "core/engine.py",
    "core/shared.py",
    "core/disk_io.py",
    "core/disk_storage.py",
    "codecs/nsq.py",
    "adapters/transport.py",
    "adapters/traffic.py",
    "adapters/host_loop.py",
    "adapters/session.py",
    "adapters/nsq/tcp.py",
    "codecs/mqks.py",
    "adapters/mqks/session.py",
    "codecs/emqp.py",
    "adapters/zmq_pump.py",
    "adapters/emqp/broker.py",
)
# Hand-written C beside them: ZeroMQ's frame loops (native/zmq_loops.py), built with
# gcc and Python's headers alone (libzmq is the copy pyzmq loads, found at run time).
C_MODULES = {"polymq.native.zmq_frames": "native/zmq_frames.c"}
GROUP = "polymq.compiled"
PACKAGE = Path(polymq.__file__).resolve().parent


def compiled_folders() -> tuple[str, ...]:
    """The folders of `HOT_MODULES`, in order, each once."""
    return tuple(dict.fromkeys(str(Path(module).parent) for module in HOT_MODULES))


def compiled_files() -> list[Path]:
    c_folders = dict.fromkeys(str(Path(source).parent) for source in C_MODULES.values())
    return [*PACKAGE.glob("compiled__mypyc*.so"),
            *(p for f in (*compiled_folders(), *c_folders) for p in (PACKAGE / f).glob("*.so"))]


def clean() -> None:
    for path in compiled_files():
        path.unlink()


def build() -> None:
    from mypyc.build import mypycify  # only needed here: mypy is a build dependency
    from setuptools import Extension, setup

    clean()
    previous = Path.cwd()
    with tempfile.TemporaryDirectory(prefix="polymq-mypyc-") as stage:
        (Path(stage) / "polymq").symlink_to(PACKAGE, target_is_directory=True)
        os.chdir(stage)
        try:
            modules = mypycify([f"polymq/{module}" for module in HOT_MODULES], group_name=GROUP, opt_level="3")
            modules += [Extension(name, [f"polymq/{source}"], libraries=["dl"],
                                  extra_compile_args=["-O2", "-Wall", "-Werror"])
                        for name, source in C_MODULES.items()]
            setup(name="polymq-compiled", ext_modules=modules,
                  script_args=["build_ext", "--inplace", "--build-temp", "temp", "--build-lib", "lib", "--quiet"])
        finally:
            os.chdir(previous)


@click.command()
@click.option("--clean", "remove", is_flag=True, help="Remove the compiled modules (pure Python again).")
def main(remove: bool) -> None:
    """Compile polymq's hot modules with mypyc (or remove them with --clean)."""
    if remove:
        clean()
        click.echo("compiled modules removed")
        return
    try:
        build()
    except (SystemExit, Exception) as error:
        with contextlib.suppress(Exception):
            clean()
        click.echo(f"polymq: compiling the hot modules failed ({error}); the pure-Python modules stay in use",
                   err=True)
        sys.exit(1)
    click.echo(f"compiled: {', '.join((*HOT_MODULES, *C_MODULES.values()))}")


if __name__ == "__main__":
    main()
