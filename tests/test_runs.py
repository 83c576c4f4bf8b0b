"""Real multi-process runs (2 gloo ranks under torchrun): the gate, isolation between cells
of one launch, faults recorded as results, and a hung cell ended at its scaled limit."""

from pathlib import Path

import psutil
import pytest

from harness import faults
from harness.config import CellSpec, StrategySpec
from harness.results.store import RunStore, load_records
from harness.runner import launcher, timeouts
from harness.runner.launcher import LaunchOptions, run_batch
from harness.runner.matrix import MatrixRun
from launch_options import untraced


def gpt2(strategy: str, **options) -> CellSpec:
    return CellSpec(model="gpt2-tiny", strategy=StrategySpec(name=strategy, **options))


def run_matrix(cells, tmp_path: Path, recorded=None, **run_options) -> dict[str, dict]:
    store = RunStore(tmp_path / "results", "run")
    return MatrixRun(cells, store, untraced(**run_options), device_type="cpu", device_name=None,
                     progress=print, recorded=recorded).run()


# In the run tests/conftest.py's shared_matrix makes of every module's MATRIX_CELLS: a DDP
# cell, hybrid-shard FSDP with and without its mesh, and a smaller model's DDP cell (the
# memory cap's two sizes).
DDP = gpt2("ddp")
HYBRID = gpt2("fsdp1_hybrid")
HYBRID_WITHOUT_MESH = gpt2("fsdp1_hybrid", hsdp_mesh="fsdp_default")
SMALL = CellSpec(model="mlp-tiny", strategy=StrategySpec(name="ddp"))
MATRIX_CELLS = [DDP, HYBRID, HYBRID_WITHOUT_MESH, SMALL]


def test_gate_fails_hybrid_shard_without_a_mesh_and_passes_it_with_one(shared_matrix):
    records = shared_matrix.records
    assert records[HYBRID.cell_id]["equivalence"]["passed"]
    bad = records[HYBRID_WITHOUT_MESH.cell_id]["equivalence"]
    assert records[HYBRID_WITHOUT_MESH.cell_id]["status"] == "ok"  # it runs, measures, and trains the wrong model
    assert not bad["passed"] and bad["max_rel_loss_diff"] > 10 * bad["tolerance"]
    assert bad["reference_cell_id"] == HYBRID.reference().cell_id


def _worker_processes(launch_dir: Path) -> list[psutil.Process]:
    """Workers of launches under ``launch_dir`` (their --cells file lives there): other runs
    on the same host are not this test's business."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = proc.info["cmdline"] or []
        if "harness.runner.worker" in cmdline and any(str(launch_dir) in arg for arg in cmdline):
            found.append(proc)
    return found


def test_cells_of_one_launch_are_isolated_and_faults_are_recorded(tmp_path, monkeypatch):
    first = gpt2("ddp")
    raising = gpt2("zero1")
    crashing = CellSpec(model="llama-tiny", strategy=StrategySpec(name="ddp"))
    after_crash = CellSpec(model="bert-tiny", strategy=StrategySpec(name="ddp"))
    hanging = CellSpec(model="mlp-tiny", strategy=StrategySpec(name="ddp"))
    after_hang = CellSpec(model="vit-tiny", strategy=StrategySpec(name="ddp"))
    after_restart = CellSpec(model="llama-tiny", strategy=StrategySpec(name="fsdp_full"))
    monkeypatch.setenv(faults.ENV_VAR, f"{raising.cell_id}=raise,{crashing.cell_id}=segfault,{hanging.cell_id}=hang,"
                                       f"{after_hang.cell_id}={faults.HOST_MEMORY_LOW}")
    outcomes = []
    # Launches: the first three cells (the raise ends it), the next two (the crash), a cell and
    # the hang, the cell after it (the host short of memory), the last.
    batch = [first, gpt2("fsdp_full"), raising, first, crashing, after_crash, hanging, after_hang, after_restart]
    # Each cell's default limit, scaled to it (runner/timeouts.py), the hanging cell's with
    # the start-up allowance cut from minutes to 6 s: the hang, second in its launch (its
    # processes started, its imports done), costs the 6 s and its compute allowance, where a
    # cell of mlp-tiny ends in well under a second. The others keep theirs: on a busy host a
    # launch's first cell can take longer than 15 s to start.
    scaled = timeouts.for_cell

    def for_cell(cell: CellSpec, *args) -> timeouts.CellTimeout:
        with monkeypatch.context() as patch:
            if cell == hanging:
                patch.setattr(timeouts, "START_UP_S", 6.0)
            return scaled(cell, *args)

    monkeypatch.setattr(timeouts, "for_cell", for_cell)
    run_batch(batch, LaunchOptions(), tmp_path, outcomes.append)

    by_order = [(o.cell.cell_id, o.status) for o in outcomes]
    assert by_order == [
        (first.cell_id, "ok"), (gpt2("fsdp_full").cell_id, "ok"), (raising.cell_id, "failed"),
        (first.cell_id, "ok"), (crashing.cell_id, "failed"), (after_crash.cell_id, "ok"),
        (hanging.cell_id, "timeout"), (after_hang.cell_id, "ok"), (after_restart.cell_id, "ok"),
    ]
    # The same cell first and after three others in one process group: no memory carried over.
    peaks = [[r["peak_mem_bytes"] for r in o.per_rank] for o in outcomes if o.cell == first]
    assert peaks[0] == peaks[1]
    assert "InjectedFault" in outcomes[2].reason and "rank 0" in outcomes[2].reason
    # The rank that died, how, and its own Python stack (faulthandler), not torchrun's.
    assert outcomes[4].reason.startswith("rank 1 was killed by SIGSEGV, the first rank to fail")
    assert "Fatal Python error: Segmentation fault" in outcomes[4].reason and "faults.py" in outcomes[4].reason
    assert "no result after 6 s (the limit: 6 s start-up + 20 × " in outcomes[6].reason, outcomes[6].reason
    # A host short of memory after a good cell: the workers leave, the next cell gets fresh ones.
    launches = sorted(tmp_path.glob("launch-*"))
    assert [d.name for d in launches] == [f"launch-{n:03d}" for n in range(1, 6)]
    restarts = [line for line in (launches[3] / "stream.jsonl").read_text().splitlines() if '"restart"' in line]
    assert len(restarts) == 1 and f"available after {after_hang.cell_id}" in restarts[0]
    assert _worker_processes(tmp_path) == [], "a launch left worker processes behind"


def test_a_resumed_runs_launches_go_beside_the_first_sessions(tmp_path, monkeypatch):
    """A resume launches into the same launches/ws2: its folders continue the numbering, so
    the first session's logs (a failed cell's reason points there) are kept; the rendezvous
    id counts the call's own launches, as a follower node's fresh folders do."""
    (tmp_path / "launch-001").mkdir()
    (tmp_path / "launch-002").mkdir()
    launched = []

    def launch_once(cells, options, workdir, on_outcome, rdzv_id):
        launched.append((workdir.name, rdzv_id))
        return cells[1:]  # settles one cell a launch, as a crash does

    monkeypatch.setattr(launcher, "_launch_once", launch_once)
    run_batch([gpt2("ddp"), gpt2("fsdp_full")], LaunchOptions(), tmp_path, lambda outcome: None)
    rendezvous = f"shardbench-{tmp_path.name}"
    assert launched == [("launch-003", f"{rendezvous}-1"), ("launch-004", f"{rendezvous}-2")]


def test_records_reach_the_store_as_cells_end(shared_matrix):
    records = load_records(shared_matrix.store_path)
    # One record a cell, in the order the cells ended (those not launched, unsupported here,
    # before any): the references' launch first.
    ids = [r["cell_id"] for r in records]
    assert sorted(ids) == sorted(shared_matrix.records) and len(set(ids)) == len(ids)
    world_sizes = [r["cell"]["world_size"] for r in records if r["status"] != "unsupported"]
    assert world_sizes == sorted(world_sizes) and DDP.reference().cell_id in ids
    ok = records[ids.index(DDP.cell_id)]
    metrics = ok["metrics"]
    assert metrics["peak_mem_bytes"] == max(r["peak_mem_bytes"] for r in ok["per_rank"])
    assert metrics["peak_mem_bytes"] == sum(metrics["mem_breakdown_bytes"].values())
    assert metrics["mem_breakdown_bytes"]["params"] == ok["model"]["n_params"] * 4  # fp32 replica per rank
    assert metrics["comm_by_op"]["all_reduce"]["bytes"] == ok["model"]["n_params"] * 4  # DDP: all gradients
    assert len(ok["losses"]) == DDP.steps and len(ok["per_rank"]) == 2
    assert len(ok["per_rank"][0]["step_times_s"]) == DDP.timed_steps
    assert metrics["tokens_per_s"] == pytest.approx(metrics["samples_per_s"] * 32)


def test_a_cell_over_the_memory_cap_records_oom_with_its_peak_and_the_next_cell_is_unaffected(tmp_path, shared_matrix):
    uncapped = shared_matrix.records
    small, big = SMALL, DDP
    small_peak, big_peak = (uncapped[c.cell_id]["metrics"]["peak_mem_bytes"] for c in (small, big))
    assert small_peak < big_peak
    cap = (small_peak + big_peak) // 2
    # Their references' records kept from the shared run, as a resume keeps them: one launch
    # for the cell over the cap, one for the cell after it.
    references = {(c.reference().cell_id, 0): uncapped[c.reference().cell_id] for c in (small, big)}
    records = run_matrix([big, small], tmp_path, recorded=references, mem_cap_gib=cap / 2**30)

    over, after = records[big.cell_id], records[small.cell_id]
    assert (over["status"], after["status"]) == ("oom", "ok")
    assert over["metrics"] == {"peak_mem_bytes": big_peak}  # the peak it reached, to the byte (fp32 on CPU)
    assert f"({cap:,} B per rank)" in over["reason"] and f"peaked at {big_peak:,} B" in over["reason"]
    assert after["metrics"]["peak_mem_bytes"] == small_peak and after["equivalence"]["passed"]
    assert [p.name for p in (tmp_path / "results" / "run" / "launches").iterdir()] == ["ws2"]
    assert _worker_processes(tmp_path) == []
