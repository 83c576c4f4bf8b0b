import os
import subprocess
import sys
from pathlib import Path

import pytest

from harness.distributed import DEVICE_ENV_VAR

REPO = Path(__file__).resolve().parents[1]

# The harness's own tests run gloo ranks on the CPU on every host, GPU hosts included (a
# one-GPU host could not place two ranks otherwise). GPU paths are checked by the device
# script, never by these tests.
os.environ[DEVICE_ENV_VAR] = "cpu"
# DeepSpeed would pick CUDA wherever a GPU is visible, for the imports tests make themselves.
os.environ["DS_ACCELERATOR"] = "cpu"


@pytest.fixture(scope="session")
def smoke_run(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """``python -m harness run --suite smoke`` end to end (trace, bandwidth sweep, report), once
    a session: its --out folder and the finished process. test_cli reads the whole run;
    test_reproduce reruns one of its cells. A run costs about 40 s here, so it is not repeated."""
    out = tmp_path_factory.mktemp("smoke")
    result = subprocess.run([sys.executable, "-m", "harness", "run", "--suite", "smoke", "--out", str(out)],
                            cwd=REPO, capture_output=True, text=True, timeout=900)
    return out, result
