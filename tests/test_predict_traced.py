"""The traced memory predictor (harness/predict/traced.py) against the harness's real step,
its sharding arithmetic, and how it fails: refused cells, a cell that raises, a subprocess
that dies or hangs. All on the CPU; about 20 s."""

import dataclasses
import json
import math
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

import model_configs
from harness import models, strategies, training
from harness.config import CellSpec, StrategySpec
from harness.distributed import DistEnv
from harness.measure.memory import BREAKDOWN_KEYS
from harness.models import sources
from harness.predict import analytic, traced


def _cell(strategy: str, world_size: int, model: str = "gpt2-tiny", **options) -> CellSpec:
    return CellSpec(model=model, strategy=StrategySpec(name=strategy, **options),
                    micro_batch=2 if world_size > 1 else 4, world_size=world_size)


def _assert_prediction(result: dict) -> None:
    assert set(result) == {"peak_bytes", "breakdown_bytes", "tracker", "work"}, result
    assert result["work"]["ops"] > 0 and result["work"]["matmul_flops"] > 0
    assert tuple(result["breakdown_bytes"]) == BREAKDOWN_KEYS
    assert sum(result["breakdown_bytes"].values()) == result["peak_bytes"] > 0


@pytest.mark.parametrize("cell", [
    _cell("single", 1),
    # Real data: traced on synthetic batches of its shapes (the loader's tensors are real).
    dataclasses.replace(_cell("single", 1, model="gpt2-bytes"), data="stdlib_bytes"),
    # bitsandbytes' LAMB hands its op a tensor where the schema takes a float (its weight norm).
    _cell("single", 1, optimizer="lamb"),
], ids=lambda c: c.cell_id)
def test_single_equals_the_workers_real_step(cell):
    """The same cell run for real by training.run_cell (one gloo rank in this process) and
    traced under FakeTensorMode: the same peak, byte for byte, in every category."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        env = DistEnv(rank=0, world_size=1, nnodes=1, device=torch.device("cpu"), backend="gloo")
        measured = training.run_cell(cell, env)
    finally:
        dist.destroy_process_group()
    predicted = traced.trace(cell)
    _assert_prediction(predicted)
    assert predicted["tracker"] == measured["memory_tracker"] == "MemTracker"
    assert predicted["breakdown_bytes"] == measured["mem_breakdown_bytes"]
    assert predicted["peak_bytes"] == measured["peak_mem_bytes"]


def test_fsdp2_full_shards_the_optimizer_state_by_the_world_size():
    single = traced.trace(_cell("single", 1))
    ws2, ws4 = traced.trace(_cell("fsdp_full", 2)), traced.trace(_cell("fsdp_full", 4))
    for result in (single, ws2, ws4):
        _assert_prediction(result)
    assert ws2["tracker"] == ws4["tracker"] == "FSDPMemTracker"
    # AdamW: exp_avg and exp_avg_sq per (sharded) parameter, plus a 4-byte step count per
    # parameter tensor, unsharded. gpt2-tiny's dim-0 sizes divide by 4: exact shards.
    n_tensors = 2 + 2 * 12 + 2  # embeddings, 2 blocks of 12 tensors, final norm
    state = single["breakdown_bytes"]["optimizer"] - 4 * n_tensors
    assert state == 2 * single["breakdown_bytes"]["params"]
    assert ws2["breakdown_bytes"]["optimizer"] - 4 * n_tensors == state / 2
    assert ws4["breakdown_bytes"]["optimizer"] - 4 * n_tensors == state / 4
    # Parameters at the peak: rank 0's shards plus the gathered unit being computed.
    params = [r["breakdown_bytes"]["params"] for r in (single, ws2, ws4)]
    assert params[2] < params[1] and params[2] < params[0]
    assert single["peak_bytes"] > ws2["peak_bytes"] > ws4["peak_bytes"]


@pytest.mark.parametrize("strategy", ["ddp", "fsdp_full", "deepspeed_zero3"])
def test_work_only_is_the_tracked_steps_work_without_the_tracker(strategy):
    """plan --calibration's trace (work_only): rank 0's step without the memory tracker
    dispatches what the tracked step did. FSDP2's AdamW steps DTensors, whose ops the fake mode
    hands back to DTensor: counted once, not again as the local ops they become (counted twice,
    the step read 1.2 times the ops it dispatches)."""
    cell = _cell(strategy, 2)
    work_only = traced.trace(cell, work_only=True)
    assert set(work_only) == {"work"}
    assert work_only["work"] == traced.trace(cell)["work"]


@pytest.mark.parametrize("cell", [_cell("tp", 2), dataclasses.replace(_cell("tp_fsdp", 4, tp_degree=2), micro_batch=1)],
                         ids=lambda c: c.cell_id)
def test_work_only_counts_the_waits_the_tracker_answers_itself(cell):
    """torch's memory trackers answer ``_c10d_functional.wait_tensor`` themselves under fake
    tensors, so the tracked step misses the wait on each functional collective that the real
    step dispatches (and dispatched_work.Counting counts there): tensor parallelism's
    all-reduces, one op each. Without the tracker they are counted; nothing else differs."""
    work_only, tracked = traced.trace(cell, work_only=True)["work"], traced.trace(cell)["work"]
    all_reduces = sum(calls for _, calls in tracked["collectives"]["all_reduce"])
    assert all_reduces > 0 and work_only["ops"] == tracked["ops"] + all_reduces
    differing = ("ops", "memory_bytes")
    assert {k: v for k, v in work_only.items() if k not in differing} == {
        k: v for k, v in tracked.items() if k not in differing}


# Cells whose ranks hold different amounts (traced.traced_ranks), run for real in
# tests/conftest.py's shared_matrix; test_deepspeed.py and test_fairscale.py list them too.
UNEVEN_RANKS = [_cell("deepspeed_zero2", 2, optimizer="adamw8bit"), _cell("fairscale_sdp", 2)]
MATRIX_CELLS = UNEVEN_RANKS


@pytest.mark.parametrize("cell", UNEVEN_RANKS, ids=lambda c: c.cell_id)
def test_where_another_rank_holds_more_its_peak_is_the_prediction(cell, shared_matrix):
    """DeepSpeed ZeRO-2's last rank allocates its gradient partition while the activations
    are held; FairScale's rank 1 holds the larger share of whole optimizer tensors. The trace
    follows that rank beside rank 0 and predicts the record's peak (the max over ranks) to
    the byte, where rank 0's alone was 0.90 and 0.993 of it."""
    record = shared_matrix.records[cell.cell_id]
    per_rank = [rank["peak_mem_bytes"] for rank in record["per_rank"]]
    assert per_rank[1] > per_rank[0]  # the case this is about
    assert traced.traced_ranks(cell) == [0, 1]
    predicted = traced.trace(cell)
    _assert_prediction(predicted)
    assert predicted["peak_bytes"] == record["metrics"]["peak_mem_bytes"] == max(per_rank)
    assert predicted["breakdown_bytes"] == record["per_rank"][1]["mem_breakdown_bytes"]


def test_the_ranks_traced_follow_the_engines_partition():
    assert traced.traced_ranks(_cell("ddp", 4)) == [0]
    assert traced.traced_ranks(_cell("deepspeed_zero3", 4)) == [0]
    assert traced.traced_ranks(_cell("deepspeed_zero2", 4)) == [0, 3]
    # FairScale OSS deals whole tensors in the model's order: at 8 ranks gpt2-tiny's token
    # table and position table go to ranks 0 and 1, and rank 0's is the larger share.
    assert traced.traced_ranks(_cell("fairscale_oss", 8)) == [0]
    assert traced.traced_ranks(_cell("fairscale_oss", 2)) == [0, 1]
    assert traced.traced_ranks(_cell("pp_gpipe", 2, model="llama-tiny")) == [0, 1]
    # llama-tiny's 2 blocks over 4 stages: [0, 1, 1, 0]. Under 1F1B rank 1's block holds 3
    # micro-batches in flight, twice what rank 0's embedding and rank 3's head hold.
    assert traced.traced_ranks(_cell("pp_1f1b", 4, model="llama-tiny", pp_microbatches=8)) == [0, 1, 3]
    # gpt2-124m's last rank holds a copy of the tied token table (38.6M of its 124.4M
    # parameters) with its AdamW state and is the heaviest; a middle rank is traced besides,
    # whose work prices the middle ranks' steps (step_time).
    gpipe = dataclasses.replace(_cell("pp_gpipe", 4, model="gpt2-124m", pp_microbatches=4), seq_len=64)
    per_rank = analytic.predict(gpipe, device_type="cpu")["per_rank_peak_bytes"]
    assert max(range(4), key=per_rank.__getitem__) == 3
    assert traced.traced_ranks(gpipe) == [0, 1, 3]


@pytest.mark.parametrize("cell, reason", [
    (_cell("fsdp1_full", 2, offload="params"), "pins host memory"),
    (_cell("ddp", 2, compression="bf16"), "bf16_compress_hook"),
    (_cell("zero1", 1), "not a valid cell: zero1 needs world_size >= 2"),
], ids=["fsdp1-offload", "bf16-hook", "invalid"])
def test_refused_cells_are_unavailable_with_the_reason(cell, reason):
    result = traced.trace(cell)
    assert set(result) == {"unavailable"} and reason in result["unavailable"]
    assert not dist.is_initialized()


@pytest.mark.parametrize("cell, reason, stand_in", [
    (_cell("deepspeed_zero2", 2, offload="optimizer"), "DeepSpeedCPUAdam",
     "gpt2-tiny/deepspeed_zero2/fp32/ckpt_none/mb2/ws2/seed0"),
    (_cell("deepspeed_zero3", 2, offload="optimizer_params"), "DeepSpeedCPUAdam",
     "gpt2-tiny/deepspeed_zero3/fp32/ckpt_none/offload_params/mb2/ws2/seed0"),
    (CellSpec(model="moe-tiny", strategy=StrategySpec(name="deepspeed_autoep"), world_size=2),
     "the routing's counts", "moe-tiny/deepspeed_zero1/fp32/ckpt_none/mb2/ws2/seed0"),
], ids=["deepspeed-cpu-adam", "deepspeed-cpu-adam-zero3", "autoep"])
def test_refused_cells_with_a_stand_in_keep_its_work_not_its_peak(cell, reason, stand_in):
    """The peak stays unavailable (the stand-in's is another cell's); its dispatched work is
    what the step-time predictor prices."""
    result = traced.trace(cell)
    assert set(result) == {"unavailable", "stand_in"} and reason in result["unavailable"]
    assert result["stand_in"]["cell_id"] == stand_in
    assert result["stand_in"]["work"]["ops"] > 0 and result["stand_in"]["work"]["matmul_flops"] > 0
    assert not dist.is_initialized()


def test_trace_cells_traces_a_stand_in_once_beside_the_cells():
    offloaded, stand_in = _cell("deepspeed_zero2", 2, offload="optimizer"), _cell("deepspeed_zero2", 2)
    results = traced.trace_cells([offloaded, stand_in])
    assert set(results) == {offloaded.cell_id, stand_in.cell_id}
    assert results[offloaded.cell_id]["stand_in"] == {"cell_id": stand_in.cell_id, "strategy": "deepspeed_zero2",
                                                      "work": results[stand_in.cell_id]["work"]}


def test_a_cell_that_raises_while_tracing_is_unavailable(monkeypatch):
    def broken_prepare(*args, **kwargs):
        raise RuntimeError("no kernel for this\nsecond line")

    # The registry holds each declaration, and the declaration its prepare.
    broken = dataclasses.replace(strategies.get("single"), prepare=broken_prepare)
    monkeypatch.setitem(strategies._declarations(), "single", broken)
    result = traced.trace(_cell("single", 1))
    assert set(result) == {"unavailable"}
    assert result["unavailable"].startswith("tracing failed: RuntimeError: no kernel for this (at ")
    assert "\n" not in result["unavailable"]
    assert not dist.is_initialized()  # the fake group is gone; the next trace can start


def test_trace_refuses_a_process_with_a_process_group(one_rank_env):
    with pytest.raises(RuntimeError, match="use trace_cells"):
        traced.trace(_cell("single", 1))


def test_trace_cells_runs_in_a_subprocess_and_goes_on_after_a_bad_cell(monkeypatch):
    good, bad = _cell("ddp", 2), _cell("fsdp1_full", 2, offload="params")
    monkeypatch.setattr(traced, "PROGRESS_EVERY_S", 0.1)
    seen: list[tuple[int, int]] = []
    results = traced.trace_cells([bad, good], progress=lambda done, total: seen.append((done, total)))
    assert set(results) == {good.cell_id, bad.cell_id}
    # Progress while the subprocesses start and trace: counts that only grow, of both cells.
    assert seen and {total for _, total in seen} == {2} and [d for d, _ in seen] == sorted(d for d, _ in seen)
    assert "unavailable" in results[bad.cell_id]
    _assert_prediction(results[good.cell_id])
    # DDP: a full replica, and its gradient bucket (the size of the gradients) in "other".
    breakdown = results[good.cell_id]["breakdown_bytes"]
    assert breakdown["other"] >= breakdown["params"] > 0
    assert not dist.is_initialized()  # this process never joined the fake group


def test_trace_cells_survives_a_subprocess_that_dies_or_hangs(monkeypatch):
    cells = [_cell("single", 1), _cell("ddp", 2)]
    monkeypatch.setattr(sys, "executable", "/bin/false")
    results = traced.trace_cells(cells)
    died = "trace subprocess exited with status 1: (no output)"
    assert all(r["unavailable"].startswith(died) for r in results.values())
    assert results[cells[0].cell_id]["unavailable"].endswith("(while tracing this cell)")
    monkeypatch.undo()
    results = traced.trace_cells(cells, timeout_s=0.05)
    assert set(results) == {c.cell_id for c in cells}
    assert all("timeout" in r["unavailable"] for r in results.values())


def test_trace_cells_shares_the_cells_among_a_subprocess_per_core(monkeypatch):
    cells = [_cell("single", 1), _cell("ddp", 2), _cell("fsdp_full", 2)]
    shares = []

    def fake(share, timeout_s, done, slot, kernels, work_only):
        shares.append([c.cell_id for c in share])
        return {c.cell_id: {"peak_bytes": len(shares)} for c in share}

    monkeypatch.setattr(traced, "_trace_in_subprocess", fake)
    monkeypatch.setattr(traced.os, "cpu_count", lambda: 2)
    results = traced.trace_cells(cells)
    assert sorted(shares) == sorted([[cells[0].cell_id, cells[2].cell_id], [cells[1].cell_id]])
    assert list(results) == [c.cell_id for c in cells]  # in the order given
    monkeypatch.setattr(traced.os, "cpu_count", lambda: 64)
    shares.clear()
    traced.trace_cells(cells)
    assert len(shares) == len(cells)  # never more subprocesses than cells (nor than MAX_TRACE_PROCESSES)


def test_cli_reports_a_spec_that_is_no_cell(tmp_path):
    refused = _cell("deepspeed_zero3", 2, offload="optimizer")
    specs = [{"model": "gpt2-huge", "strategy": {"name": "ddp"}}, refused.to_dict()]
    (tmp_path / "cells.json").write_text(json.dumps(specs))
    subprocess.run([sys.executable, "-m", "harness.predict.traced", "--cells", str(tmp_path / "cells.json"),
                    "--out", str(tmp_path / "out.json")], check=True, capture_output=True, timeout=120)
    out = json.loads((tmp_path / "out.json").read_text())
    assert out["cells[0]"]["unavailable"].startswith("not a cell: ValueError: model='gpt2-huge'")
    assert "DeepSpeedCPUAdam" in out[refused.cell_id]["unavailable"]


def test_bitsandbytes_cpu_update_is_traced_op_by_op():
    """bitsandbytes' CPU 8-bit update is Python around its (de)quantize ops: the trace runs
    it, so the step's work counts its ~40 ops per tensor (one fake answer would be one op)."""
    import bitsandbytes as bnb

    from harness.measure.dispatched_work import DispatchedWork

    mode = traced._fake_world_mode()
    with mode:
        weight = torch.nn.Parameter(torch.randn(1024, 64))
        optimizer = bnb.optim.AdamW8bit([weight], min_8bit_size=0)
        weight.grad = torch.randn(1024, 64)
        optimizer.step()  # makes the quantized states
        mode.work = DispatchedWork()
        optimizer.step()
    assert mode.work.ops >= 30


def test_cudas_attention_kernels_keep_no_scores_where_the_cpus_math_kernel_does(tmp_path):
    """DeepSeek-V3's latent attention has query heads wider than its value heads (24 against
    16): the CPU's SDPA runs its math kernel, which keeps every layer's fp32 scores; CUDA's
    memory-efficient kernel (``kernels="cuda"``, as `plan --traced` traces) keeps its output
    and log-sum-exp instead. Each trace is held against the analytic peak for its device."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "deepseek_v3", **model_configs._DECODER,
                                **model_configs.PREDICTED_TEXT_MODELS["deepseek_v3"]}))
    spec = sources.resolve(str(path))
    cells = [CellSpec(model=spec, strategy=StrategySpec(name="single", precision="bf16"), world_size=1, micro_batch=4),
             CellSpec(model=spec, strategy=StrategySpec(name="fsdp_full"), world_size=2, micro_batch=4)]
    # In this process (trace_cells' subprocesses would double the test's time for the same peaks).
    scores = 4 * spec.n_heads * spec.tokens_per_sample ** 2 * 4  # one layer's fp32 scores, 4 samples
    for cell in cells:
        peaks = {kernels: traced.trace(cell, kernels=kernels)["peak_bytes"] for kernels in traced.KERNELS}
        assert peaks["cpu"] - peaks["cuda"] >= scores, cell.cell_id
        for kernels, peak in peaks.items():
            predicted = analytic.predict(cell, device_type=kernels)["peak_bytes"]
            assert predicted / peak == pytest.approx(1, abs=0.05), kernels
    with pytest.raises(ValueError, match="kernels='tpu': choose cpu or cuda"):
        traced.trace_cells(cells, kernels="tpu")


def test_cudas_adam_steps_every_tensor_at_once():
    """torch's Adam takes its multi-tensor path for CUDA tensors: its out-of-place sqrt(v̂) + ε
    is one fp32 copy of every parameter at once, where the CPU's one-tensor-at-a-time path
    holds two copies of the largest tensor. For DDP on a short sequence the step is the peak,
    and each trace is the analytic peak for its device."""
    cell = CellSpec(model="gpt2-tiny", strategy=StrategySpec(name="ddp"), micro_batch=1, seq_len=8)
    layout = models.param_layout(cell.model_spec)
    cpu, cuda = (traced.trace(cell, kernels=kernels)["peak_bytes"] for kernels in traced.KERNELS)
    largest = max(math.prod(shape) for shape in layout.shapes)
    assert cuda - cpu == pytest.approx(4 * layout.numel - 2 * 4 * largest, rel=0.01)
    for kernels, peak in zip(traced.KERNELS, (cpu, cuda), strict=True):
        assert analytic.predict(cell, device_type=kernels)["peak_bytes"] == pytest.approx(peak, rel=0.01), kernels
