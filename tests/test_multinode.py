"""Several nodes on one machine: two node launchers on 127.0.0.1 with one rank each against
one node with two ranks (same cells ok, same losses bitwise, same peak memory but for frees
on gloo's threads), node 0's own calibration a one-rank one (no sweep, the compute rates),
node 1 running node 0's plan and writing nothing under results/, the two
resuming a run that lost a record, a world of one refused with the reason in the record, and
a follower refusing node 0's plan when their harness code differs."""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness import calibration
from harness.cli import main as cli_main
from harness.config import CellSpec, RunOptions, StrategySpec
from harness.predict import analytic, step_time, traced
from harness.results.store import RunStore, load_records
from harness.runner import launcher, node_spec, nodes
from harness.runner.launcher import LaunchOptions
from harness.runner.matrix import MatrixRun

REPO = Path(__file__).resolve().parents[1]
# No trace: predictions are not what is compared, and node 1 would wait for node 0's.
SELECT = ["--suite", "smoke", "--device", "cpu", "-k", "gpt2-tiny and (ddp or fsdp_full) and fp32 and compress_none",
          "--cell-timeout", "120", "--no-trace"]


def _free_port() -> int:
    """A free port whose successor is free too (node 0 serves its plan there)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 1))
                return port
            except OSError:
                continue


def _harness_run(args: list[str], log: Path) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    with log.open("w") as out:
        return subprocess.Popen([sys.executable, "-m", "harness", "run", *args], cwd=REPO, env=env,
                                stdout=out, stderr=subprocess.STDOUT)


def _two_nodes(multi: list[str], tmp_path: Path, node0_args: list[str], node1_args: list[str], name: str):
    """Node 1 first (it waits for node 0's plan, then at each rendezvous), then node 0."""
    node1 = _harness_run([*multi, "--node-rank", "1", "--out", str(tmp_path / "n1"), *node1_args],
                         tmp_path / f"{name}-n1.log")
    node0 = _harness_run([*multi, "--node-rank", "0", "--out", str(tmp_path / "n0"), *node0_args],
                         tmp_path / f"{name}-n0.log")
    return node0, node1


def _finish(processes, tmp_path: Path, name: str) -> dict[str, str]:
    try:
        codes = [p.wait(timeout=300) for p in processes]
    finally:
        for p in processes:  # a launcher left waiting (for a plan, at a rendezvous) must not outlive the test
            p.kill()
    logs = {node: (tmp_path / f"{name}-{node}.log").read_text() for node in ("n0", "n1")}
    assert codes == [0, 0], logs
    return logs


def _records(run_dir: Path) -> dict[str, dict]:
    return {r["cell_id"]: r for r in load_records(run_dir)}


def test_two_nodes_of_one_rank_match_one_node_of_two(tmp_path, smoke_run):
    port = _free_port()
    multi = ["--gpus", "1", "--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(port)]
    # Node 1 is given no selection and no memory cap: it runs what node 0's plan says, with
    # node 0's cap (a collective check in every rank: a follower without it would hang).
    logs = _finish(_two_nodes(multi, tmp_path, [*SELECT, "--mem-cap-gib", "8"], ["--device", "cpu"], "run"),
                   tmp_path, "run")
    # One node of two ranks: the same cells in the smoke suite's run (tests/conftest.py).
    smoke_out, smoke = smoke_run
    assert smoke.returncode == 0, smoke.stdout[-3000:]

    (n0_run,) = [p for p in (tmp_path / "n0" / "results").iterdir() if not p.is_symlink()]
    two_nodes = _records(n0_run)
    one_node = {cell_id: r for cell_id, r in _records(smoke_out / "results" / "latest").items() if cell_id in two_nodes}
    assert sorted(two_nodes) == sorted(one_node) and len(two_nodes) == 3
    for cell_id, record in two_nodes.items():
        other = one_node[cell_id]
        assert record["status"] == other["status"] == "ok", (cell_id, record["reason"])
        assert record["losses"] == other["losses"], cell_id  # bitwise: fp32 on the CPU
        # Identical, but for buffers freed on gloo's worker threads (memory.py "Frees on another
        # thread"): a late one moves the peak by at most what the step freed that way.
        play = max(r["metrics"].get("async_freed_bytes", 0) for r in (record, other))
        moved = abs(record["metrics"]["peak_mem_bytes"] - other["metrics"]["peak_mem_bytes"])
        assert moved <= play, (cell_id, moved, play)
        if record["equivalence"] is not None:
            assert record["equivalence"]["passed"]
    assert (tmp_path / "n0" / "results").is_dir()
    # Node 1 ran its rank of both distributed cells, wrote no run, and kept its launch logs.
    assert not (tmp_path / "n1" / "results").exists() and not (tmp_path / "n1" / "reports").exists()
    assert list((tmp_path / "n1" / "node-launches").glob("node1-*/ws2/launch-001/log.txt"))
    assert "2 ok, 0 not ok" in logs["n1"], logs["n1"]
    assert '"nnodes": 2' in (n0_run / "run.json").read_text()
    # Both nodes swept together first: one rank a node, so every point-to-point pair crosses.
    environment = json.loads((n0_run / "run.json").read_text())["environment"]
    across = environment["bandwidth_across_nodes"]
    assert "error" not in across, across.get("error")
    assert across["scope"] == "2 rank(s) on 2 nodes" and across["nnodes"] == 2
    assert {row.get("scope") for row in across["rows"] if row["op"] == "send_recv"} == {"inter_node"}
    assert "bandwidth sweep across the nodes: done" in logs["n1"], logs["n1"]
    # Node 0's own calibration ran on its one rank, as a one-GPU run's does (the device check):
    # no peer to sweep with, and its compute rates and engines' steps still price a cell's step.
    own = environment["bandwidth"]
    assert own["rows"] == [] and own["no_sweep"] == calibration.ONE_RANK_NO_SWEEP
    assert own["compute_rates"]["world_size"] == 1
    assert own["compute_rates"]["alone"] == own["compute_rates"]["concurrent"]  # one rank: timed once
    engines = own["compute_rates"]["engines"]  # an engine one rank cannot run says why
    assert engines["fsdp_full"]["step_s"] > 0 and engines["ddp"]["unavailable"] == "ddp needs world_size >= 2, got 1"
    single = CellSpec(model="gpt2-tiny", strategy=StrategySpec(name="single"), world_size=1)
    predicted = step_time.predict(single, analytic.predict(single, device_type="cpu"),
                                  traced.trace(single, stand_in=False), own, "cpu")
    assert 0 < predicted["step_time_s"] == predicted["compute_s"] and predicted["comm_s"] == 0
    # The cells spanning the nodes: their collectives priced at the sweep across them.
    for record in two_nodes.values():
        if record["cell"]["world_size"] == 2:
            assert record["predicted"]["step_time"]["comm_s"] > 0, record["predicted"]["step_time"]
    page = (tmp_path / "n0" / "reports" / n0_run.name / "index.html").read_text()
    assert f"No sweep: {calibration.ONE_RANK_NO_SWEEP}" in page

    # A run that lost a cell (as if killed before it was recorded): both nodes resume it, and
    # only that cell runs again, on both nodes.
    lost = "gpt2-tiny/fsdp_full/fp32/ckpt_none/mb2/ws2/seed0"
    lines = (n0_run / "cells.jsonl").read_text().splitlines(keepends=True)
    (n0_run / "cells.jsonl").write_text("".join(line for line in lines if lost not in line))
    resume = ["--resume", n0_run.name, "--no-trace"]  # a resume traces its cells unless told not to
    logs = _finish(_two_nodes(multi, tmp_path, resume, resume, "resume"), tmp_path, "resume")
    assert "1 cell runs that span the nodes" in logs["n1"] and "1 ok, 0 not ok" in logs["n1"], logs["n1"]
    resumed = _records(n0_run)
    assert sorted(resumed) == sorted(two_nodes)
    assert resumed[lost]["status"] == "ok" and resumed[lost]["equivalence"]["passed"]
    assert resumed[lost]["losses"] == two_nodes[lost]["losses"]  # bitwise: the same cell, run again


def test_a_world_of_one_is_refused_with_the_reason_recorded(tmp_path, monkeypatch):
    """Node 0 of two launched --standalone (as if each node ran on its own): its single rank
    must refuse the ws2 cell, not run it as a job of one."""
    standalone = launcher.torchrun_args
    monkeypatch.setattr(launcher, "torchrun_args", lambda world_size, *rest: standalone(1))
    monkeypatch.setattr(traced, "trace_cells", lambda cells, **_: {})  # predictions are not the point
    cell = CellSpec(model="gpt2-tiny", strategy=StrategySpec(name="ddp"), micro_batch=2, world_size=2)
    spec = node_spec.NodeSpec(nnodes=2, node_rank=0, master_addr="127.0.0.1", master_port=_free_port())
    store = RunStore(tmp_path, "refused")
    MatrixRun([cell], store, LaunchOptions(run=RunOptions(cell_timeout_s=120), nodes=spec), device_type="cpu",
              device_name=None, progress=print).run()
    records = {r["cell_id"]: r for r in load_records(store.path)}
    assert records[cell.reference().cell_id]["status"] == "ok"  # the reference runs on node 0 alone
    refused = records[cell.cell_id]
    assert refused["status"] == "failed"
    assert "joined a world of 1 rank(s) on 1 node(s), but the cells need 2 rank(s) on 2 node(s)" in refused["reason"]


def test_torchrun_arguments():
    assert launcher.torchrun_args(2) == ["--standalone", "--nproc-per-node", "2"]
    spec = node_spec.NodeSpec(nnodes=2, node_rank=1, master_addr="n01", master_port=1234)
    assert launcher.torchrun_args(1, spec)[0] == "--standalone"  # references: node 0 alone
    args = launcher.torchrun_args(8, spec, "shardbench-ws8-1", 600)
    assert args[:4] == ["--nnodes", "2", "--nproc-per-node", "4"]
    assert args[4:6] == ["--rdzv-backend", "c10d"] and "n01:1234" in args and "shardbench-ws8-1" in args
    assert "is_host=false,read_timeout=600,join_timeout=600" in args


@pytest.mark.parametrize("nodelist, host", [
    ("node[01-04]", "node01"), ("node[3,5-7],gpu1", "node3"), ("a1,b2", "a1"), ("solo", "solo"),
    ("rack1-n[007-008]", "rack1-n007"),
])
def test_first_host_of_a_slurm_node_list(nodelist, host, monkeypatch):
    monkeypatch.setenv("PATH", "")  # the parser, not scontrol
    assert nodes.first_host(nodelist) == host


def test_slurm_variables():
    env = {"SLURM_NNODES": "4", "SLURM_NODEID": "2", "SLURM_JOB_NODELIST": "gpu[12-15]",
           "SLURM_NTASKS_PER_NODE": "1", "MASTER_PORT": "4242"}
    spec = nodes.resolve(nnodes=None, node_rank=None, master_addr=None, master_port=None, environ=env)
    assert spec == node_spec.NodeSpec(nnodes=4, node_rank=2, master_addr="gpu12", master_port=4242)
    # Options win over SLURM; --nnodes 1 is one node whatever the allocation.
    one = nodes.resolve(nnodes=1, node_rank=None, master_addr=None, master_port=None, environ=env)
    assert one == node_spec.SINGLE_NODE
    alone = nodes.resolve(nnodes=None, node_rank=None, master_addr=None, master_port=None, environ={})
    assert alone == node_spec.SINGLE_NODE
    with pytest.raises(ValueError, match="one launcher per node"):
        nodes.resolve(nnodes=None, node_rank=None, master_addr=None, master_port=None,
                      environ={**env, "SLURM_NTASKS_PER_NODE": "8(x4)"})


@pytest.mark.parametrize("argv, message", [
    (["--nnodes", "0"], "--nnodes 0: must be 1 or more"),
    (["--nnodes", "2", "--node-rank", "2", "--master-addr", "a"], "--node-rank 2: must be in [0, 2)"),
    (["--nnodes", "2"], "--master-addr is required"),
    (["--nnodes", "2", "--master-addr", "a", "--master-port", "0"], "--master-port 0: must be in 1-65534"),
])
def test_node_options_are_checked_before_anything_launches(argv, message, capsys, monkeypatch):
    monkeypatch.setenv("SHARDBENCH_DEVICE", "cpu")  # the cli sets it; restored after
    for name in [k for k in os.environ if k.startswith("SLURM_")]:
        monkeypatch.delenv(name)
    assert cli_main(["run", "--suite", "smoke", "--device", "cpu", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_a_follower_takes_node_0s_plan_and_refuses_other_code():
    spec = node_spec.NodeSpec(nnodes=2, node_rank=0, master_addr="127.0.0.1", master_port=_free_port())
    cells = [CellSpec(model="gpt2-tiny", strategy=StrategySpec(name=name), micro_batch=2, world_size=2)
             for name in ("ddp", "fsdp_full")]
    plan = nodes.Plan(run_id="r1", rounds=[cells, cells[1:]], cell_timeout_s=90.0, mem_cap_bytes=2**30)
    server = nodes.PlanServer(spec)
    with pytest.raises(ValueError, match="cannot serve the run plan on port"):
        nodes.PlanServer(spec)  # the port is taken (by `server`), refused when made
    server.publish(plan, code_hash="abc")
    follower = dataclasses.replace(spec, node_rank=1)
    assert nodes.fetch_plan(follower, "abc", wait_s=10) == plan
    assert server.refusal() is None
    with pytest.raises(ValueError, match="node 0 runs harness code abc, this node xyz"):
        nodes.fetch_plan(follower, "xyz", wait_s=10)
    # Node 0 learns it, in its own terms.
    assert server.refusal() == ("node 1 refused the run: it runs harness code xyz, node 0 abc (check out the same"
                                " shardbench commit on every node)")
    server.close()
    nodes.PlanServer(spec).close()  # the port is free again


def test_a_follower_without_node_0_gives_up_with_the_reason():
    spec = node_spec.NodeSpec(nnodes=2, node_rank=1, master_addr="127.0.0.1", master_port=_free_port())
    with pytest.raises(ValueError, match=r"no run plan from node 0 at 127\.0\.0\.1:\d+ within 2 s"):
        nodes.fetch_plan(spec, "abc", wait_s=2)


def test_a_refusal_ends_node_0s_launches_that_span_the_nodes(tmp_path):
    """A follower that refused never joins: node 0 records the spanning cells `failed` with its
    reason, ending the launch that waits at the rendezvous and starting none after it."""
    spec = node_spec.NodeSpec(nnodes=2, node_rank=0, master_addr="127.0.0.1", master_port=_free_port())
    waiting, later = (CellSpec(model="gpt2-tiny", strategy=StrategySpec(name=name), micro_batch=2, world_size=2)
                      for name in ("ddp", "fsdp_full"))
    reason = "node 1 refused the run: it runs harness code xyz, node 0 abc"
    refused_at = time.monotonic() + 5  # node 0's torchrun is waiting at the rendezvous by then
    options = LaunchOptions(run=RunOptions(cell_timeout_s=120), nodes=spec,
                            follower_refusal=lambda: reason if time.monotonic() > refused_at else None)
    outcomes = []
    launcher.run_batch([waiting], options, tmp_path / "waiting", outcomes.append)
    launcher.run_batch([later], options, tmp_path / "later", outcomes.append)
    assert [(o.cell, o.status, o.reason) for o in outcomes] == [(waiting, "failed", reason), (later, "failed", reason)]
    assert outcomes[0].wall_s < 60  # not the cell timeout (120 s)
    assert (tmp_path / "waiting" / "launch-001" / "log.txt").exists()  # it had been launched, and was ended
    assert not (tmp_path / "later" / "launch-001").exists()  # never launched
