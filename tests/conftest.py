import gc
import os
import subprocess
import sys
from collections.abc import Generator, Iterator
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
import torch.distributed as dist

from harness import faults
from harness.distributed import DEVICE_ENV_VAR, DistEnv
from harness.results.store import RunStore
from harness.runner.launcher import LaunchOptions
from harness.runner.matrix import MatrixRun
from launch_options import untraced

REPO = Path(__file__).resolve().parents[1]

# The harness's own tests run gloo ranks on the CPU on every host, GPU hosts included (a
# one-GPU host could not place two ranks otherwise). GPU paths are checked by the device
# script, never by these tests.
os.environ[DEVICE_ENV_VAR] = "cpu"
# DeepSpeed would pick CUDA wherever a GPU is visible, for the imports tests make themselves.
os.environ["DS_ACCELERATOR"] = "cpu"


_modules_frozen = [0]  # len(sys.modules) when this file last froze gc's objects


def pytest_configure(config: pytest.Config) -> None:
    """The test modules are imported with gc's collections paused, as every process of the
    harness imports its modules (harness/entry.py)."""
    gc.disable()


def pytest_collection_finish(session: pytest.Session) -> None:
    """What importing torch, transformers and the test modules made goes to gc's permanent
    generation, as the worker's does (runner/worker.py): the full collections the memory
    tracker makes around each step traced or run in this process then scan only what the
    tests made (a third of a second each otherwise; 133 of them took 44 s of the predictor's
    tests)."""
    gc.collect()
    gc.freeze()
    _modules_frozen[0] = len(sys.modules)
    gc.enable()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None, object, object]:
    """After a test that imported modules (an engine's first cell in this process: DeepSpeed,
    FairScale, bitsandbytes, networkx under torch's partitioner, ~1,300 modules over the
    predictor's tests), what is still alive goes to gc's permanent generation too, its garbage
    collected first: frozen at collection they were not, and every full collection after
    scanned them (0.16 s each against 0.02 s frozen; 98 of them took 16 s of
    tests/test_predict_analytic.py, 2.5 s frozen)."""
    done = yield
    if len(sys.modules) != _modules_frozen[0]:
        _modules_frozen[0] = len(sys.modules)
        gc.collect()
        gc.freeze()
    return done


def pytest_unconfigure(config: pytest.Config) -> None:
    """As harness/entry.py's processes end: interpreter shutdown's collections skip the frozen."""
    gc.freeze()


@pytest.fixture
def one_rank_env() -> Iterator[DistEnv]:
    """A gloo process group of this process alone, for the test's duration: what the
    strategies' prepare and the calibration's timings need in a test."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield DistEnv(rank=0, world_size=1, nnodes=1, device=torch.device("cpu"), backend="gloo")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="session")
def smoke_run(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """``python -m harness run --suite smoke`` end to end (trace, bandwidth sweep, report), once
    a session: its --out folder and the finished process. test_cli reads the whole run;
    test_reproduce reruns one of its cells; test_multinode holds two nodes' records of its
    cells against it. A run costs about 40 s here, so it is not repeated."""
    out = tmp_path_factory.mktemp("smoke")
    result = subprocess.run([sys.executable, "-m", "harness", "run", "--suite", "smoke", "--out", str(out)],
                            cwd=REPO, capture_output=True, text=True, timeout=900)
    return out, result


class SharedMatrix(NamedTuple):
    store_path: Path
    records: dict[str, dict]  # by cell id


def _shared_run(request: pytest.FixtureRequest, tmp_path_factory, cells_attribute: str,
                options: LaunchOptions) -> SharedMatrix:
    """One matrix run (2 gloo ranks) of the cells every selected test module lists in
    ``cells_attribute`` (a list, or a function of a folder for cells that need files), with
    the faults its ``MATRIX_FAULTS`` ({cell: fault}) name injected (harness/faults.py). Run
    apart, each module's cells would cost a launch for their references and another for
    themselves (and a traced run its tracer's start-up), seconds of imports each here; in one
    run they share them, and a cell two modules list runs once. Cells of one launch are
    isolated (tests/test_runs.py checks it), so a cell's record does not depend on its
    neighbours."""
    modules = list(dict.fromkeys(item.module for item in request.session.items if hasattr(item, "module")))
    listed = [getattr(module, cells_attribute) for module in modules if hasattr(module, cells_attribute)]
    cells = list(dict.fromkeys(cell for cells_of in listed for cell in (
        cells_of(tmp_path_factory.mktemp("cells")) if callable(cells_of) else cells_of)))
    injected = {cell.cell_id: fault for module in modules
                for cell, fault in getattr(module, "MATRIX_FAULTS", {}).items() if cell in cells}
    store = RunStore(tmp_path_factory.mktemp(cells_attribute.lower()) / "results", "run")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(faults.ENV_VAR, ",".join(f"{cell_id}={fault}" for cell_id, fault in injected.items()))
        records = MatrixRun(cells, store, options, device_type="cpu", device_name=None, progress=print).run()
    return SharedMatrix(store.path, records)


@pytest.fixture(scope="session")
def shared_matrix(request, tmp_path_factory) -> SharedMatrix:
    """The modules' ``MATRIX_CELLS``, run untraced (launch_options.py)."""
    return _shared_run(request, tmp_path_factory, "MATRIX_CELLS", untraced())


@pytest.fixture(scope="session")
def shared_traced_matrix(request, tmp_path_factory) -> SharedMatrix:
    """The modules' ``TRACED_MATRIX_CELLS``, traced first as every run is."""
    return _shared_run(request, tmp_path_factory, "TRACED_MATRIX_CELLS", LaunchOptions())
