"""The collective bandwidth sweep: for real on 2 gloo ranks (CPU sizes, 1 KiB .. 16 MiB), its
nccl-tests arithmetic, its table in the report's environment, and the compute rates the same
launch measures. The sweep read is the smoke suite's run's (tests/conftest.py): a run sweeps
before its cells, and a launch of its own would cost this module 20 s more. A one-rank launch,
which has no sweep and measures the compute rates alone, is the two-node test's node 0's
(tests/test_multinode.py)."""

import json
import os
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from harness import calibration
from harness.distributed import DistEnv
from harness.measure import bandwidth, compute_rate
from harness.measure.comm import busbw_factor
from harness.predict import step_time
from harness.report import html


@pytest.fixture(scope="module")
def swept(smoke_run):
    out, run = smoke_run
    assert run.returncode == 0, run.stdout[-3000:]
    bandwidth_info = json.loads((out / "results" / "latest" / "run.json").read_text())["environment"]["bandwidth"]
    assert bandwidth_info["scope"] == "2 rank(s) of one node"
    return bandwidth_info


def test_sweep_on_two_gloo_ranks_covers_every_collective_and_size(swept):
    assert "error" not in swept, swept.get("error")
    assert (swept["world_size"], swept["backend"], swept["device_type"]) == (2, "gloo", "cpu")
    measured = [(row["op"], row["bytes"]) for row in swept["rows"]]
    assert measured == [(op, size) for op in bandwidth.OPS for size in bandwidth.CPU_SIZES]
    assert all(row["time_s"] > 0 for row in swept["rows"])
    # One node: its point-to-point rows are within it.
    assert {row.get("scope") for row in swept["rows"] if row["op"] == "send_recv"} == {"intra_node"}


def test_point_to_point_pairs_within_a_node_and_across_nodes():
    def peers(rank, world_size, nnodes):
        env = DistEnv(rank=rank, world_size=world_size, nnodes=nnodes, device=torch.device("cpu"), backend="gloo")
        return bandwidth.p2p_peers(env)

    # 8 ranks on 2 nodes: rank 5 is node 1's second rank.
    assert peers(5, 8, 2) == {"intra_node": (6, 4), "inter_node": (1, 1)}
    assert peers(3, 8, 2) == {"intra_node": (0, 2), "inter_node": (7, 7)}
    assert peers(2, 6, 3) == {"intra_node": (3, 3), "inter_node": (4, 0)}
    assert peers(0, 2, 1) == {"intra_node": (1, 1)}  # one node: nothing crosses the network
    assert peers(1, 2, 2) == {"inter_node": (0, 0)}  # one rank a node: nothing within one


def test_bandwidths_follow_nccl_tests(swept):
    for row in swept["rows"]:
        algbw = row["bytes"] / row["time_s"] / 1e9
        assert row["algbw_gbps"] == pytest.approx(algbw)
        assert row["busbw_gbps"] == pytest.approx(algbw * busbw_factor(row["op"], 2))
    # With 2 ranks all-reduce moves as much per rank as it holds, all-gather and all-to-all
    # half of it; broadcast and send/recv their whole buffer.
    by_op = {row["op"]: row for row in swept["rows"] if row["bytes"] == 2**20}
    assert by_op["all_reduce"]["busbw_gbps"] == pytest.approx(by_op["all_reduce"]["algbw_gbps"])
    assert by_op["all_gather"]["busbw_gbps"] == pytest.approx(by_op["all_gather"]["algbw_gbps"] / 2)
    assert by_op["all_to_all"]["busbw_gbps"] == pytest.approx(by_op["all_to_all"]["algbw_gbps"] / 2)
    for op in ("broadcast", "send_recv"):
        assert by_op[op]["busbw_gbps"] == pytest.approx(by_op[op]["algbw_gbps"])


def test_sizes_are_whole_elements_per_rank():
    for nbytes, world_size, expected in ((1024, 2, 1024), (1000, 3, 996), (2**26, 8, 2**26)):
        _, size = bandwidth._collective("all_gather", nbytes, world_size, device=torch.device("cpu"))
        assert size == expected


def test_report_shows_the_sweep_or_why_there_is_none(swept):
    template = html.ENV.get_template("_env.html.j2")
    info = {"environment": {"bandwidth": {"scope": "2 rank(s) of one node", **swept}}}
    page = template.render(env=html._environment(info))
    assert page.count("<td class=\"l\">reduce_scatter</td>") == len(bandwidth.CPU_SIZES)
    assert page.count("<td class=\"l\">send_recv (intra-node)</td>") == len(bandwidth.CPU_SIZES)
    assert "1,048,576" in page and "2 rank(s) of one node" in page
    none = template.render(env=html._environment({"environment": {"bandwidth": {"error": "needs 2 ranks"}}}))
    assert "No sweep: needs 2 ranks" in none
    # The compute rates the same launch measured, and why there is no datasheet efficiency on a CPU.
    matmul = swept["compute_rates"]["concurrent"]["matmul_flops_per_s"]["fp32"]
    assert f"<dt>matmul fp32</dt><dd>{matmul / 1e9:.1f} GFLOP/s at 512²</dd>" in page
    assert "<dd>none: measure/flops.py has no dense datasheet peak for a cpu device</dd>" in page


def test_the_same_launch_measures_the_ranks_compute_rates(swept):
    """harness/measure/compute_rate.py: what the step-time predictor prices a step at."""
    rates = swept["compute_rates"]
    assert rates["world_size"] == 2 and min(rates["tiny_step_ops"].values()) > 100
    assert "no dense datasheet peak for a cpu device" in rates["no_datasheet_peak"]
    for scope in ("concurrent", "alone"):
        measured = rates[scope]
        assert set(measured["matmul_flops_per_s"]) == {"fp32", "bf16", "fp16"}
        # A 1-thread rank computes well over a GFLOP/s in fp32 and dispatches an op in well
        # under 1 ms; bf16 and fp16 only where the CPU has the instructions for them (about
        # 1.3 GFLOP/s alone on an AVX2-only host, less with two ranks on two cores).
        assert 1e9 < measured["matmul_flops_per_s"]["fp32"] < 1e14
        assert all(1e8 < f < 1e14 for f in measured["matmul_flops_per_s"].values())
        assert set(measured["op_s"]) == {"fp32", "bf16", "fp16"}
        assert all(1e-7 < seconds < 1e-3 for seconds in measured["op_s"].values())
        # A model's elementwise ops never move bytes faster than the STREAM add.
        # By op size: the tiny decoder's ops, then the wide one's, each no faster than STREAM;
        # the tiny ones, each allocating its output, well slower (timed in place: 4.0-6.7 in
        # four calibrations on this project's host), which the floor of 1 would hide.
        sizes = [size for size, _ in measured["memory_factor"]]
        assert len(sizes) == 2 and sizes == sorted(sizes)
        assert all(1.0 <= factor < 100 for _, factor in measured["memory_factor"])
        assert measured["memory_factor"][0][1] > 1.5
        # Matmuls by size: FLOPs a call ascending, the largest the headline rate.
        for name, curve in measured["matmul_flops_per_s_by_size"].items():
            assert [size for size, _ in curve] == sorted(size for size, _ in curve)
            assert curve[-1][1] == measured["matmul_flops_per_s"][name]
        # The kernel families by direction and FLOPs per unit, ascending, at each timed shape
        # (fp16's convolutions on the CPU at the first shape alone).
        for family, shapes in (("attention", rates["attention_shapes"]), ("convolution", rates["convolution_shapes"])):
            for name, curves in measured[f"{family}_flops_per_s_by_size"].items():
                timed = 1 if (family, name) == ("convolution", "fp16") else len(shapes)
                assert set(curves) == {"forward", "backward"}
                for curve in curves.values():
                    assert len(curve) == timed and [size for size, _ in curve] == sorted(size for size, _ in curve)
                    assert all(1e7 < rate < 1e14 for _, rate in curve)
        sizes = [size for size, _ in measured["topk_elements_per_s_by_size"]]
        assert sizes == list(compute_rate.TOPK_ELEMENTS["cpu"])
        # bitsandbytes' update ops, 8-bit and 32-bit, for Adam and LAMB: the 8-bit update costs
        # beyond its bytes for each element (its block-wise quantization: 20 ns here, a busy host
        # or not), and a call's cost is never negative.
        costs = measured["optimizer_op_s"]
        assert set(costs) == {f"optimizer_update_{kind}/{rule}" for kind in ("32bit", "8bit_blockwise")
                              for rule in ("adam", "lamb")}
        assert all(cost["call_s"] >= 0 and cost["element_s"] >= 0 for cost in costs.values())
        assert costs["optimizer_update_8bit_blockwise/adam"]["element_s"] > 2e-9
        working_sets = [size for size, _ in measured["memory_bytes_per_s"]]
        assert working_sets == sorted(working_sets) and working_sets[-1] > 2**25  # past the last-level cache
        assert all(rate > 1e8 for _, rate in measured["memory_bytes_per_s"])


def test_the_same_launch_times_each_engines_own_step(swept):
    """harness/calibration.py: llama-tiny's step under each strategy the run's cells use (the
    smoke suite's: DDP, FSDP2, ZeRO-1), and what the step-time predictor makes of it (an
    engine's overhead per op)."""
    engines = swept["compute_rates"]["engines"]
    assert set(engines) == {"ddp", "fsdp_full", "zero1"}
    ddp = engines["ddp"]
    assert ddp["cell_id"] == "llama-tiny/ddp/fp32/ckpt_none/mb2/ws2/seed0"
    assert 1e-4 < ddp["step_s"] < 5 and ddp["work"]["ops"] > 100
    # Its gradients' one bucket: every parameter's bytes, counted as the trace counts them.
    assert sum(n * calls for n, calls in ddp["work"]["collectives"]["all_reduce"]) == 4 * 188_736
    assert step_time.engine_overhead_per_op("ddp", swept) >= 0


def _pipeline_engine_step(rank: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    env = DistEnv(rank=rank, world_size=2, nnodes=1, device=torch.device("cpu"), backend="gloo")
    steps = calibration.engine_steps(env, ["pp_gpipe", "tp_fsdp", "tp"])
    if rank == 0:
        Path(out_dir, "steps.json").write_text(json.dumps(steps))
    dist.destroy_process_group()


def test_a_pipelines_engine_step_is_timed_with_its_last_ranks_work(tmp_path):
    """A pipeline's calibration step on two real gloo ranks: its time, rank 0's work and the
    last rank's, whose stage holds the LM head (more FLOPs than the embedding stage's)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_pipeline_engine_step, args=(port, str(tmp_path)), nprocs=2)
    steps = json.loads((tmp_path / "steps.json").read_text())
    # tp_fsdp needs two data-parallel groups: on 2 ranks its engine is timed at degree 1 (its
    # declared 2 ended the whole calibration once, and with it every cell's step time).
    assert steps["tp_fsdp"]["cell_id"] == "llama-tiny/tp_fsdp/fp32/ckpt_none/tp1/mb2/ws2/seed0"
    assert steps["tp_fsdp"]["step_s"] > 0
    gpipe = steps["pp_gpipe"]
    assert gpipe["cell_id"] == "llama-tiny/pp_gpipe/fp32/ckpt_none/pmb4/mb2/ws2/seed0"
    assert 1e-4 < gpipe["step_s"] < 5
    assert gpipe["last_rank_work"]["matmul_flops"] > gpipe["work"]["matmul_flops"] > 0
    assert gpipe["work"]["collectives"]["send"] and gpipe["last_rank_work"]["collectives"]["recv"]


def test_a_known_gpus_matmul_rate_is_recorded_as_its_datasheet_efficiency(monkeypatch):
    """What a plan prices a GPU at (predict/rough_time.py): the measured rate over the
    datasheet's dense peak, fp32 against TF32's where the process lets matmuls use it."""
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    measured = {"bf16": 494.5e12, "fp16": 593.4e12, "fp32": 33.5e12}
    efficiency = compute_rate.datasheet_efficiency(torch.device("cuda"), measured)
    assert efficiency["device_name"] == "NVIDIA H100 80GB HBM3"
    assert efficiency["matmul_efficiency"] == pytest.approx({"bf16": 0.5, "fp16": 0.6, "fp32": 0.5})
    monkeypatch.setattr(torch, "get_float32_matmul_precision", lambda: "high")
    tf32 = compute_rate.datasheet_efficiency(torch.device("cuda"), measured)
    assert tf32["matmul_efficiency"]["fp32"] == pytest.approx(33.5e12 / 494.5e12)
    rates = {"concurrent": {"matmul_flops_per_s": measured, "op_s": {},
                            "optimizer_op_s": {"optimizer_update_32bit/lamb": {"call_s": 5e-5, "element_s": 2e-9}}},
             "optimizer_op_unavailable": {"adam8bit": "RuntimeError: no kernel"}, "matmul_size": 8192, **efficiency}
    page = html.ENV.get_template("_env.html.j2").render(
        env=html._environment({"environment": {"bandwidth": {"error": "one GPU", "compute_rates": rates}}}))
    assert ("<dt>matmul bf16</dt><dd>494500.0 GFLOP/s at 8192², 50 % of the NVIDIA H100 80GB HBM3's dense"
            " datasheet peak</dd>") in page
    # bitsandbytes' update ops beside them, and why one was not timed.
    assert ("<dt>optimizer_update_32bit/lamb</dt><dd>50.0 µs a call, 2.00 ns an element beyond its bytes</dd>"
            in page)
    assert "<dt>adam8bit's update</dt><dd>not timed: RuntimeError: no kernel</dd>" in page
    assert compute_rate.datasheet_efficiency(torch.device("cpu"), measured) == {
        "device_name": None, "no_datasheet_peak": "measure/flops.py has no dense datasheet peak for a cpu device"}
