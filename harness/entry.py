"""How every process of the harness starts and ends: ``python -m harness.entry MODULE ARGS...``
runs ``MODULE.main()`` with ARGS as its command line, as ``python -m MODULE ARGS...`` would,
with what it imports made with the cyclic garbage collector paused and then frozen.

torchrun starts each rank this way (harness.runner.worker, harness.calibration), the traced
predictor its subprocesses (harness.predict.traced), and the ``shardbench`` command and
``python -m harness`` the CLI (``shardbench`` below). Their imports (torch, transformers, the
engines) make ~200-400k objects that live as long as the process, and the collector, running
as they are made, scanned them over and over (importing the worker and a transformers model:
3.8 s on this project's CPU host, 2.7 s with the collector paused). Once imported they go to
gc's permanent generation (``gc.freeze``), as the worker's do between cells, so no later
collection scans them; the worker and the tracer read their cells, which imports the
strategies' files and transformers, the same way (``collector_paused``). A process that
returns from ``main`` freezes again before it exits: interpreter shutdown's collections over
what is still alive took 1.3 s after the CLI's run, 0.2 s frozen. A tiny cell and its
reference, run by the CLI (two launches), took a median 18.8 s here against 21.1 s before
(six runs each, alternated), and 17.0 s once the cells were read with the collector paused
against 18.0 s.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import signal
import sys
from collections.abc import Iterator


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Imports inside without gc's collections; what they made frozen after them."""
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        gc.enable()


def shardbench() -> None:
    """The ``shardbench`` command and ``python -m harness``: the CLI (harness/cli.py), run as
    every process of the harness is."""
    # A listing piped into `head` ends quietly when the reader has had enough, as other Unix tools do.
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    run("harness.cli")


def run(module_name: str) -> None:
    """Import ``module_name`` (collector paused), run its ``main()`` and exit with what it returns."""
    with collector_paused():
        module = importlib.import_module(module_name)
    code = module.main()
    gc.freeze()
    sys.exit(code)


if __name__ == "__main__":
    if len(sys.argv) < 2:
        print("usage: python -m harness.entry MODULE [ARGS...]", file=sys.stderr)
        sys.exit(2)
    # The module's parser sees its own command line, as under ``python -m MODULE``.
    name, sys.argv = sys.argv[1], sys.argv[1:]
    run(name)
