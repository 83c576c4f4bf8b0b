"""Nothing lost: a run terminated (SIGTERM), interrupted (SIGINT, as Ctrl-C) or killed
(SIGKILL to its whole process group) keeps every finished cell and leaves no process behind,
and ``run --resume`` runs only the cells without a record, into the same cells.jsonl."""

import json
import os
import resource
import signal
import subprocess
import sys
import time
from contextlib import suppress
from pathlib import Path

import psutil
import pytest

from harness import cli, suites
from harness.results.store import load_records
from harness.runner import resume
from harness.runner.matrix import with_references
from harness.runner.session import EXIT_NOT_WRITTEN

REPO = Path(__file__).resolve().parents[1]
SMOKE_CELLS = {c.cell_id for c in with_references(suites.cells_of("smoke", 2))}
START_TIMEOUT_S = 240  # the first cells on a busy 2-core host
QUICK = ("--no-trace", "--no-bandwidth")


def shardbench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "harness", *args], cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "SHARDBENCH_DEVICE": "cpu"}, timeout=600)


def complete_lines(path: Path) -> int:
    try:
        return path.read_bytes().count(b"\n")
    except FileNotFoundError:
        return 0


def start_run(out: Path, log: Path, *selection: str) -> subprocess.Popen:
    with log.open("w") as f:
        # A session of its own: the driver, torchrun and its workers share one process group.
        # The trace and the bandwidth sweep are not what is tested: skipped, to reach the cells sooner.
        return subprocess.Popen([sys.executable, "-m", "harness", "run", *selection, *QUICK, "--out", str(out)],
                                cwd=REPO, stdout=f, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "SHARDBENCH_DEVICE": "cpu"})


def wait_for_records(proc: subprocess.Popen, out: Path, n: int, log: Path) -> Path:
    """The run folder, once its cells.jsonl holds ``n`` complete records (the run still going)."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        runs = [p for p in (out / "results").glob("*") if p.is_dir() and not p.is_symlink()]
        if runs and complete_lines(runs[0] / "cells.jsonl") >= n:
            assert proc.poll() is None, f"the run ended before it could be interrupted:\n{log.read_text()[-2000:]}"
            return runs[0].resolve()
        assert proc.poll() is None, f"the run ended early:\n{log.read_text()[-2000:]}"
        time.sleep(0.05)
    raise AssertionError(f"no {n} records after {START_TIMEOUT_S} s:\n{log.read_text()[-2000:]}")


def processes_of(run_dir: Path, timeout_s: float = 15) -> list[str]:
    """Command lines still mentioning the run's folder (torchrun, workers, tracer) once the
    dying ones had ``timeout_s`` to go."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = []
        for proc in psutil.process_iter(["cmdline", "status"]):
            cmdline = " ".join(proc.info["cmdline"] or [])
            if str(run_dir) in cmdline and proc.info["status"] != psutil.STATUS_ZOMBIE:
                found.append(cmdline)
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.2)


def cleanup(proc: subprocess.Popen) -> None:
    with suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def test_a_terminated_then_killed_run_resumes_into_the_same_run_with_one_record_per_cell(tmp_path):
    """SIGTERM to the driver alone (a scheduler's; SIGINT goes through the same handler, which
    test_signals_in_the_driver_raise_keyboard_interrupt checks): it ends its launches itself,
    keeps its cells, exits 128 + 15 and prints the way on. Then its resume is killed with
    SIGKILL to its whole process group (nothing can clean up), and a second resume finishes
    the run: every cell once, in the same cells.jsonl."""
    log = tmp_path / "first.log"
    proc = start_run(tmp_path, log, "--suite", "smoke")
    try:
        run_dir = wait_for_records(proc, tmp_path, 2, log)
        before = (run_dir / "cells.jsonl").read_bytes()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=120)
    finally:
        cleanup(proc)
    assert code == 128 + signal.SIGTERM, log.read_text()[-3000:]
    assert processes_of(run_dir) == []
    assert (run_dir / "cells.jsonl").read_bytes().startswith(before)
    terminated = len(load_records(run_dir))
    assert terminated >= 2
    assert f"--resume {run_dir.name}" in log.read_text()  # the way on, printed

    log = tmp_path / "resumed.log"
    proc = start_run(tmp_path, log, "--resume", "latest")
    try:
        wait_for_records(proc, tmp_path, terminated + 1, log)
        os.killpg(proc.pid, signal.SIGKILL)  # the driver, torchrun and every worker at once
        proc.wait()
    finally:
        cleanup(proc)
    assert processes_of(run_dir) == []
    cells = run_dir / "cells.jsonl"
    before = cells.read_bytes()
    kept = len(load_records(run_dir))
    assert terminated < kept < len(SMOKE_CELLS)

    resumed = shardbench("run", *QUICK, "--resume", "latest", "--out", str(tmp_path))
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert f"{kept} of {len(SMOKE_CELLS)} cells recorded and kept" in resumed.stdout
    after = cells.read_bytes()
    assert after.startswith(before)  # the records written before the kill, byte for byte
    ids = [json.loads(line)["cell_id"] for line in after.decode().splitlines() if line.endswith("}")]
    assert sorted(ids) == sorted(SMOKE_CELLS)  # each cell exactly once: nothing re-run, nothing missing
    info = json.loads((run_dir / "run.json").read_text())
    assert [r["command"][r["command"].index("--resume") + 1] for r in info["resumes"]] == ["latest", "latest"]
    assert sorted(p.name for p in (tmp_path / "results").iterdir()) == sorted(["latest", run_dir.name])  # no new run
    records = {r["cell_id"]: r for r in load_records(run_dir)}
    gated = [r for r in records.values() if r["equivalence"] is not None]
    assert gated and all(r["equivalence"]["passed"] for r in gated)  # read the recorded references
    assert (tmp_path / "reports" / run_dir.name / "index.html").exists()


def test_signals_in_the_driver_raise_keyboard_interrupt(monkeypatch):
    """SIGTERM and SIGINT alike: the driver's handler raises KeyboardInterrupt (so every
    launch's ``finally`` ends its processes) and keeps the signal for the 128 + N exit status."""
    from harness.runner.resume import Interrupted

    installed: dict[int, object] = {}
    monkeypatch.setattr(signal, "signal", lambda sig, handler: installed.__setitem__(sig, handler))
    monkeypatch.setattr(Interrupted, "signum", None)
    Interrupted.install()
    assert set(installed) == {signal.SIGTERM, signal.SIGINT}
    for sig, handler in installed.items():
        with pytest.raises(KeyboardInterrupt, match=signal.Signals(sig).name):
            handler(sig, None)
        assert Interrupted.signum == sig


def fake_run(tmp_path: Path, **info) -> Path:
    run_dir = tmp_path / "results" / "run-a"
    run_dir.mkdir(parents=True)
    (run_dir / "run.json").write_text(json.dumps({
        "run_id": "run-a", "suite": "smoke", "marker_expression": "", "keyword_expression": "", "world_size": 2,
        "device": {"type": "cpu", "name": None}, **info}))
    return run_dir


@pytest.mark.parametrize("args, message", [
    (["--resume", "run-zzz"], "no run at"),
    (["--resume", "run-a", "--suite", "default"],
     "cannot resume run-a with --suite 'default': it ran with --suite 'smoke'"),
    (["--resume", "run-a", "-m", "ddp"], "with -m 'ddp'"),
    (["--resume", "run-a", "-k", "llama"], "with -k 'llama'"),
    (["--resume", "run-a", "--gpus", "4"], "with --gpus 4"),
    (["--retry-failed"], "--retry-failed: only with --resume"),
], ids=["unknown", "suite", "marker", "keyword", "world-size", "retry-alone"])
def test_resume_refuses_another_selection_in_one_line_and_launches_nothing(tmp_path, args, message, capsys):
    run_dir = fake_run(tmp_path)
    assert cli.main(["run", *args, "--out", str(tmp_path)]) == 2
    stderr = capsys.readouterr().err
    assert message in stderr and len(stderr.strip().splitlines()) == 1, stderr
    assert not (run_dir / "cells.jsonl").exists() and "resumes" not in json.loads((run_dir / "run.json").read_text())


def test_resume_of_a_run_without_run_json_is_refused_in_one_line(tmp_path, capsys):
    run_dir = tmp_path / "results" / "run-b"
    run_dir.mkdir(parents=True)
    (run_dir / "cells.jsonl").write_text("")
    assert cli.main(["run", "--resume", "run-b", "--out", str(tmp_path)]) == 2
    stderr = capsys.readouterr().err
    assert len(stderr.strip().splitlines()) == 1, stderr
    assert "cannot resume" in stderr and "original selection is unknown" in stderr
    assert (run_dir / "cells.jsonl").read_text() == ""


@pytest.mark.parametrize("retry_failed, kept", [
    (False, [("a", 0), ("b", 0), ("c", 0), ("d", 0), ("e", 0), ("a", 1), ("c", 1)]),
    (True, [("a", 0), ("b", 0), ("a", 1)]),
])
def test_finished_outcomes_are_kept_and_failures_rerun_only_when_asked(retry_failed, kept):
    records = [{"cell_id": c, "trial": 0, "status": s} for c, s in
               zip("abcde", ("ok", "unsupported", "failed", "timeout", "oom"))]
    records += [{"cell_id": "a", "trial": 1, "status": "ok"}, {"cell_id": "c", "trial": 1, "status": "failed"}]
    assert list(resume.kept_records(records, retry_failed=retry_failed)) == kept


def test_a_run_keeps_its_repeat_on_resume_and_another_is_refused(tmp_path):
    run_dir = fake_run(tmp_path)
    assert resume.original_selection(run_dir)["repeat"] == 1  # a run.json from before --repeat: each cell once
    info = json.loads((run_dir / "run.json").read_text())
    (run_dir / "run.json").write_text(json.dumps({**info, "repeat": 3}))
    original = resume.original_selection(run_dir)
    resume.check_same_selection(run_dir, original, {"repeat": 3})
    with pytest.raises(ValueError, match=r"^cannot resume run-a with --repeat 2: it ran with --repeat 3; resume"
                                         r" without --repeat, or start a new run$"):
        resume.check_same_selection(run_dir, original, {"repeat": 2})


def test_a_run_over_two_nodes_is_resumed_on_two_and_ranks_per_node_named_as_given(tmp_path):
    run_dir = fake_run(tmp_path)
    info = json.loads((run_dir / "run.json").read_text())
    (run_dir / "run.json").write_text(json.dumps({**info, "world_size": 4, "nodes": {"nnodes": 2}}))
    original = resume.original_selection(run_dir)
    resume.check_same_selection(run_dir, original, {"nnodes": 2, "world_size": 4})
    # The node count first: with one node, any --gpus would name a different world size.
    with pytest.raises(ValueError, match=r"^cannot resume run-a on 1 node\(s\): it ran on 2; start as many nodes"):
        resume.check_same_selection(run_dir, original, {"nnodes": 1, "world_size": 2})
    with pytest.raises(ValueError, match="with --gpus 1: it ran with --gpus 2;"):  # per node, as typed
        resume.check_same_selection(run_dir, original, {"nnodes": 2, "world_size": 2})


def _file_size_limit(limit: int):
    """For the child: no file it writes may grow past ``limit`` bytes; a write that would gets
    EFBIG (SIGXFSZ ignored), as a full disk gives ENOSPC: a results file that cannot be written."""
    def apply() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    return apply


def test_a_run_that_cannot_write_its_results_stops_in_one_line_and_resumes_once_it_can(tmp_path):
    # Two one-process cells (a record is ~8 KB): the first record fits under 12,000 bytes, the
    # second is cut by the limit mid-write.
    suite = tmp_path / "two.toml"
    suite.write_text("[[cells]]\nmodel = 'gpt2-tiny'\nstrategy = 'single'\nseed = [0, 1]\n")
    args = ["run", "--suite", str(suite), *QUICK, "--out", str(tmp_path)]
    stopped = subprocess.run([sys.executable, "-m", "harness", *args], cwd=REPO, capture_output=True, text=True,
                             env={**os.environ, "SHARDBENCH_DEVICE": "cpu"}, timeout=600,
                             preexec_fn=_file_size_limit(12_000))
    run_dir = (tmp_path / "results" / "latest").resolve()
    cells = run_dir / "cells.jsonl"
    said = [line for line in stopped.stdout.splitlines() if "shardbench: error:" in line]
    assert stopped.returncode == EXIT_NOT_WRITTEN, stopped.stdout[-3000:] + stopped.stderr[-3000:]
    assert len(said) == 1 and f"cannot write {cells}: File too large" in said[0], stopped.stdout[-3000:]
    assert "1 of 2 cells recorded; run the rest with ./run_all.sh --resume" in said[0]
    text = cells.read_text()
    assert text.endswith("}\n") and text.count("\n") == 1  # the cut second record removed, the first whole
    assert len(load_records(run_dir)) == 1

    # The results can be written again, the report cannot (a file where its folder goes).
    (tmp_path / "reports").write_text("")
    resumed = shardbench("run", *QUICK, "--resume", "latest", "--out", str(tmp_path))
    assert resumed.returncode == EXIT_NOT_WRITTEN, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert cells.read_text().startswith(text) and len(load_records(run_dir)) == 2
    said = [line for line in resumed.stdout.splitlines() if line.startswith("report:")]
    assert len(said) == 1 and "not written" in said[0] and "the results are complete" in said[0], said
    (tmp_path / "reports").unlink()
    assert cli.main(["report", "latest", "--out", str(tmp_path)]) == 0
    assert (tmp_path / "reports" / run_dir.name / "index.html").exists()
