"""The default suite on GPUs (harness/suites_gpu.py) for the GPU shapes users bring, built on
this CPU host from the predictors alone; the fit check that records ``does_not_fit`` instead
of launching; and ``list --device cuda`` showing a GPU node's matrix on a machine without one."""

import dataclasses
from collections import defaultdict

import pytest

from harness import cli, equivalence, suites
from harness.config import CellSpec, StrategySpec
from harness.distributed import DEVICE_ENV_VAR
from harness.predict import fit
from harness.results.store import RunStore
from harness.runner.matrix import MatrixRun, with_references
from harness.suites_gpu import LARGE_MODEL_GPU_BYTES, MAX_PER_RANK, GpuTarget
from launch_options import untraced

GIB = 2**30
# (GPUs, memory per GPU): one H200, a node of H100 80GB, a node of A100 40GB.
SHAPES = {"1x141GB": (1, 141 * 10**9), "8x80GiB": (8, 80 * GIB), "8x40GB": (8, 40 * 10**9)}


@pytest.fixture(scope="module", params=list(SHAPES))
def matrix(request):
    world_size, memory = SHAPES[request.param]
    gpu = GpuTarget(memory_bytes=memory)
    return world_size, gpu, suites.cells_of("default", world_size, gpu=gpu)


def test_the_models_follow_the_gpus(matrix):
    world_size, gpu, chosen = matrix
    names = {c.model_name for c in chosen}
    large = world_size >= 8 and gpu.memory_bytes >= LARGE_MODEL_GPU_BYTES
    assert names == {"gpt2-124m", "llama-1b"} | ({"llama3-8b"} if large else set())
    lengths = {c.model_name: c.model_spec.seq_len for c in chosen}
    assert lengths["gpt2-124m"] == 1024  # its position table's length
    assert lengths["llama-1b"] == 2048 and lengths.get("llama3-8b", 2048) == 2048
    # One-process strategies (the reference, DataParallel) take the whole batch at world size 1.
    assert all(c.world_size == world_size or c.strategy.name in ("single", "dataparallel") for c in chosen)
    precisions = {c.strategy.precision for c in chosen}
    assert precisions == {"bf16", "fp32", "fp16"}


def test_one_gpu_measures_what_one_gpu_chooses_among_and_several_every_engine(matrix):
    world_size, _, chosen = matrix
    names = {c.strategy.name for c in chosen}
    if world_size == 1:
        assert names == {"single", "fsdp_full", "deepspeed_zero3"}
        assert {c.strategy.offload for c in chosen} == {"none", "params", "optimizer", "optimizer_params"}
        assert {c.strategy.checkpointing for c in chosen} == {"none", "full", "selective"}
        return
    assert {"ddp", "zero1", "fsdp_full", "fsdp_grad_op", "fsdp1_full", "deepspeed_zero1", "deepspeed_zero2",
            "deepspeed_zero3", "fairscale_oss", "fairscale_sdp", "fairscale_fsdp", "tp", "tp_fsdp"} <= names
    assert any(c.strategy.pipelined for c in chosen)
    assert {c.strategy.compression for c in chosen} >= {"bf16", "powersgd"}
    assert any(c.strategy.accumulation > 1 for c in chosen)


def test_every_cell_of_a_model_trains_its_references_global_batch_at_the_largest_micro_batch_that_fits(matrix):
    world_size, gpu, chosen = matrix
    by_model = defaultdict(set)
    for cell in chosen:
        by_model[cell.model_name].add(cell.global_batch)
        assert cell.reference().micro_batch == cell.global_batch
        checked = fit.check(cell, gpu.memory_bytes)
        assert checked is not None
        if not checked.fits:
            assert cell.micro_batch == 1, cell.cell_id  # nothing smaller to try
            continue
        # The rule applied again to the cell's template (no accumulation, or the 4 a variant asks
        # for) gives the cell back: no larger micro-batch fits.
        templates = [dataclasses.replace(cell, micro_batch=1,
                                         strategy=dataclasses.replace(cell.strategy, accumulation=a))
                     for a in ((1,) if cell.strategy.pipelined else (1, 4))]
        assert cell in [fit.sized(t, cell.global_batch, lambda c: fit.check(c, gpu.memory_bytes).fits)
                        for t in templates], cell.cell_id
    for model, batches in by_model.items():
        assert len(batches) == 1, (model, batches)
        [batch] = batches
        assert world_size <= batch <= MAX_PER_RANK * world_size and batch & (batch - 1) == 0


def test_the_global_batch_is_the_largest_whose_reference_fits_one_gpu(matrix):
    world_size, gpu, chosen = matrix
    for model in {c.model_name for c in chosen}:
        cell = next(c for c in chosen if c.model_name == model)
        reference = cell.reference()
        reference_fits = fit.check(reference, gpu.memory_bytes).fits
        if cell.global_batch < MAX_PER_RANK * world_size:
            doubled = CellSpec(model=reference.model, strategy=reference.strategy, seq_len=reference.seq_len,
                               micro_batch=2 * reference.micro_batch, world_size=1, steps=reference.steps)
            assert not fit.check(doubled, gpu.memory_bytes).fits, model
        # Where no reference fits one GPU (llama3-8b's 16 bytes of states per parameter on 80 GB;
        # llama-1b with 8 samples of 2048 tokens on 40 GB) one sample per rank, ungated.
        assert reference_fits or cell.global_batch == world_size, model
        if model == "gpt2-124m" or (model == "llama-1b" and gpu.memory_bytes >= LARGE_MODEL_GPU_BYTES):
            assert reference_fits, model
        if model == "llama3-8b":
            assert not reference_fits


def test_8_gpus_of_80gb_train_llama3_8b_only_where_sharded(matrix):
    _, gpu, chosen = matrix
    large = [c for c in chosen if c.model_name == "llama3-8b"]
    if not large:
        pytest.skip("llama3-8b needs 8 GPUs of 80 GB")
    verdicts = {c.strategy.name: fit.check(c, gpu.memory_bytes).fits for c in large if c.strategy.offload == "none"
                and c.strategy.checkpointing == "none"}
    assert not verdicts["ddp"] and not verdicts["zero1"]  # a whole replica of 8B parameters' states
    assert verdicts["fsdp_full"] and verdicts["deepspeed_zero3"]


def test_cells_predicted_not_to_fit_are_recorded_and_not_launched(tmp_path):
    cell = CellSpec(model="gpt2-tiny", strategy=StrategySpec(name="ddp"))
    store = RunStore(tmp_path / "results", "run")
    run = MatrixRun([cell], store, untraced(), device_type="cpu", device_name=None, progress=print,
                    fit_memory_bytes=1 * 2**20)
    assert run.launch_rounds() == [[]]
    records = run.run()
    assert {r["status"] for r in records.values()} == {"does_not_fit"}
    record = records[cell.cell_id]
    assert record["fit"]["predicted_peak_bytes"] > record["fit"]["usable_bytes"] == int(0.9 * 2**20)
    assert record["fit"]["available_bytes"] == 2**20 and record["fit"]["fits"] is False
    assert "--launch-anyway" in record["reason"] and "GiB per rank" in record["reason"]
    anyway = MatrixRun([cell], RunStore(tmp_path / "results", "anyway"), untraced(), device_type="cpu",
                       device_name=None, progress=print, fit_memory_bytes=2**20, launch_anyway=True)
    assert [c.cell_id for c in anyway.launch_rounds()[0]] == [c.cell_id for c in with_references([cell])]


def test_a_cell_whose_reference_does_not_fit_is_measured_but_not_gated():
    cell = CellSpec(model="gpt2-tiny", strategy=StrategySpec(name="fsdp_full"))
    verdict = equivalence.check(cell, [1.0, 0.9], {"status": "does_not_fit", "reason": "predicted 9 GiB"})
    assert verdict["passed"] is None and verdict["reason"].startswith("not gated: the reference does not fit")
    assert equivalence.check(cell, [1.0], {"status": "oom", "reason": ""})["passed"] is False


def test_list_shows_a_gpu_nodes_matrix_on_a_host_without_gpus(capsys, monkeypatch):
    monkeypatch.setenv(DEVICE_ENV_VAR, "cpu")  # --device sets it for the process; restored after
    assert cli.main(["list", "--device", "cuda", "--gpus", "8", "--gpu-mem", "80GiB"]) == 0
    lines = capsys.readouterr().out.splitlines()
    ddp_8b = next(line for line in lines if line.startswith("llama3-8b/ddp/bf16/ckpt_none/"))
    assert "does_not_fit: not launched" in ddp_8b
    fsdp_1b = next(line for line in lines if line.startswith("llama-1b/fsdp_full/bf16/ckpt_none/mb"))
    assert "GiB per rank: fits]" in fsdp_1b
    assert any("(reference, added to gate the selection)" in line for line in lines)
    summary = lines[-1]
    assert "cells predicted to fit 80.0 GiB per GPU" in summary
    assert "min on NVIDIA H100 80GB HBM3 (assumed: 40% MFU, 300 GB/s bus bandwidth)" in summary
    assert _minutes(summary) > 0
    # Without --gpu-mem there is no GPU to size for: one line, exit 2.
    assert cli.main(["list", "--device", "cuda", "--gpus", "8"]) == 2
    stderr = capsys.readouterr().err
    assert len(stderr.strip().splitlines()) == 1, stderr


def _one_gpu_calibration(device_type: str, matmul_flops_per_s: float) -> dict:
    """What harness.calibration writes for one device: its compute rates, no sweep."""
    rates = {"matmul_flops_per_s": dict.fromkeys(("fp32", "bf16", "fp16"), matmul_flops_per_s),
             "memory_bytes_per_s": [[1, 2.7e12]], "op_s": dict.fromkeys(("fp32", "bf16", "fp16"), 0.0)}
    return {"device_type": device_type, "world_size": 1, "rows": [], "no_sweep": "one rank",
            "compute_rates": {"concurrent": rates, "alone": rates, "world_size": 1,
                              "device_name": "NVIDIA H100 80GB HBM3"}}


def _minutes(summary: str) -> int:
    return int(summary.split("rough wall time ")[1].split(" min")[0])


def _rough_minutes(capsys, argv: list[str]) -> tuple[int, str]:
    assert cli.main(argv) == 0
    summary = capsys.readouterr().out.splitlines()[-1]
    return _minutes(summary), summary


def test_list_times_a_gpu_matrix_at_a_runs_calibration(tmp_path, capsys, monkeypatch):
    """list --calibration: a one-GPU run's measured rates price the node's rough wall time in
    place of the datasheet's 40 % MFU (its collectives stay assumed: it timed none)."""
    import json

    monkeypatch.setenv(DEVICE_ENV_VAR, "cpu")
    target = ["list", "--device", "cuda", "--gpus", "8", "--gpu-mem", "80GiB", "-k", "llama3-8b"]
    datasheet, _ = _rough_minutes(capsys, target)
    fast, slow, on_cpu = (tmp_path / "fast.json", tmp_path / "slow.json", tmp_path / "cpu.json")
    fast.write_text(json.dumps(_one_gpu_calibration("cuda", 4e15)))  # matmuls faster than any H100
    slow.write_text(json.dumps(_one_gpu_calibration("cuda", 4e12)))  # a hundredth of the datasheet's 40 %
    on_cpu.write_text(json.dumps(_one_gpu_calibration("cpu", 1e11)))
    quick, summary = _rough_minutes(capsys, [*target, "--calibration", str(fast)])
    assert f"min on NVIDIA H100 80GB HBM3, measured by {fast}; collectives assumed" in summary
    sluggish, _ = _rough_minutes(capsys, [*target, "--calibration", str(slow)])
    # Each cell's 30 s start is most of a fast GPU's minutes: the slow one's steps show.
    assert quick <= datasheet < sluggish, (quick, datasheet, sluggish)
    # A CPU's rates cannot time a GPU node, and a CPU listing has no rough time: one line, exit 2.
    for argv, why in (([*target, "--calibration", str(on_cpu)], "it measured a cpu host, not a GPU"),
                      (["list", "--device", "cpu", "--calibration", str(fast)],
                       "--calibration prices a GPU target's rough wall time")):
        assert cli.main(argv) == 2
        assert why in capsys.readouterr().err
