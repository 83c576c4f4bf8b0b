"""The commands a user types: bad input is refused before anything runs; the smoke suite
runs end to end through pytest and leaves results, a summary and a report."""

import json
import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

from harness import cli, markers, strategies, suite_files
from harness.cli_catalogue import CATALOGUES
from harness.models.presets import PRESETS
from harness.predict import rough_time

REPO = Path(__file__).resolve().parents[1]


def shardbench(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "harness", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=600)


SUITE_FILES = {
    "not_toml.toml": "[[cells]\nmodel = 'gpt2-tiny'\n",
    "zero4.toml": "[[cells]]\nmodel = 'gpt2-tiny'\nstrategy = 'deepspeed_zero4'\n",
    "powersgd_fsdp.toml": ("[defaults]\nmodel = 'gpt2-tiny'\ncompression = 'powersgd'\n"
                           "[[cells]]\nstrategy = 'ddp'\n[[cells]]\nstrategy = 'fsdp_full'\n"),
    "typo.toml": "[[cells]]\nmodel = 'gpt2-tiny'\nstrategy = 'ddp'\nprecison = 'bf16'\n",
    "zero_batch.toml": "[[cells]]\nmodel = 'gpt2-tiny'\nstrategy = 'ddp'\nmicro_batch = 0\n",
    "ws3.toml": "[[cells]]\nmodel = 'gpt2-tiny'\nstrategy = 'ddp'\nworld_size = 3\n",
    "bool_batch.toml": "[[cells]]\nmodel = 'gpt2-tiny'\nstrategy = 'ddp'\nmicro_batch = true\n",
    "text_seed.toml": "[[cells]]\nmodel = 'gpt2-tiny'\nstrategy = 'ddp'\nseed = 'abc'\n",
    "float_seed.toml": "[[cells]]\nmodel = 'gpt2-tiny'\nstrategy = 'ddp'\nseed = 2.5\n",
    "text_lr.toml": "[[cells]]\nmodel = 'gpt2-tiny'\nstrategy = 'ddp'\nlr = 'fast'\n",
    "no_strategies.toml": "[[cells]]\nmodel = 'gpt2-tiny'\nstrategy = []\n",
    "huge_steps.toml": "[[cells]]\nmodel = 'gpt2-tiny'\nstrategy = 'ddp'\nsteps = 100000000\n",
    "planning_only.toml": "[[cells]]\nmodel = 'mixtral-8x7b'\nstrategy = 'ddp'\n",
    "ws1024.toml": "[[cells]]\nmodel = 'gpt2-tiny'\nstrategy = 'ddp'\nworld_size = 1024\n",
    "lr_zero.toml": "[[cells]]\nmodel = 'gpt2-tiny'\nstrategy = 'ddp'\nlr = 0\n",
    "lr_huge.toml": "[[cells]]\nmodel = 'gpt2-tiny'\nstrategy = 'ddp'\nlr = 1e9\n",
    "seed_negative.toml": "[[cells]]\nmodel = 'gpt2-tiny'\nstrategy = 'ddp'\nseed = -1\n",
    "warmup1.toml": "[[cells]]\nmodel = 'gpt2-tiny'\nstrategy = 'ddp'\nwarmup = 1\n",
    "fp8.toml": "[[cells]]\nmodel = 'gpt2-tiny'\nstrategy = 'ddp'\nprecision = 'fp8'\n",
    "every1.toml": "[[cells]]\nmodel = 'gpt2-tiny'\nstrategy = 'ddp'\ncheckpointing = 'full'\ncheckpoint_every = 1\n",
    "clip0.toml": "[[cells]]\nmodel = 'gpt2-tiny'\nstrategy = 'ddp'\nclip_grad_norm = 0\n",
    "bucket_negative.toml": "[[cells]]\nmodel = 'gpt2-tiny'\nstrategy = 'ddp'\nbucket_cap_mb = -1\n",
    "steps3.toml": "[[cells]]\nmodel = 'gpt2-tiny'\nstrategy = 'ddp'\nsteps = 3\n",
    "model42.toml": "[[cells]]\nmodel = 42\nstrategy = 'ddp'\n",
    "float_batch.toml": "[[cells]]\nmodel = 'gpt2-tiny'\nstrategy = 'ddp'\nmicro_batch = 2.0\n",
    "int_switch.toml": "[[cells]]\nmodel = 'gpt2-tiny'\nstrategy = 'ddp'\nexpandable_segments = 1\n",
    "text_eval.toml": "[[cells]]\nmodel = 'gpt2-tiny'\nstrategy = 'ddp'\neval_every = 'often'\n",
    "ws0.toml": "[[cells]]\nmodel = 'gpt2-tiny'\nstrategy = 'ddp'\nworld_size = 0\n",
    "lr_sweep.toml": "[[cells]]\nmodel = 'gpt2-tiny'\nstrategy = 'ddp'\nlr = [0.001, 0.01]\n",
    "bool_layers.toml": ("[[cells]]\nstrategy = 'ddp'\nmodel = { config = '"
                         f"{REPO / 'suites/configs/mistral-tiny.json'}', num_hidden_layers = true }}\n"),
    "deep.toml": ("[[cells]]\nstrategy = 'ddp'\nmodel = { config = '"
                  f"{REPO / 'suites/configs/mistral-tiny.json'}', num_hidden_layers = 100000000 }}\n"),
    # plan --calibration's: a JSON that is neither, and a run that measured no rates.
    "rates.json": '{"rows": []}',
    "unswept.json": '{"run_id": "r1", "environment": {"bandwidth": {"skipped": "--no-bandwidth"}}}',
    # 50 × 50 = 2,500 cells, over the default --max-cells.
    "too_many.toml": ("[[cells]]\nmodel = 'gpt2-tiny'\nstrategy = 'ddp'\n"
                      f"seed = {list(range(50))}\nmicro_batch = {list(range(1, 51))}\n"),
}


@pytest.mark.parametrize(
    "args, message",
    [
        (["run", "--suite", "nightly"], "unknown suite 'nightly': choose one of smoke, default, full, real, perf"),
        (["run", "-m", "zero4 and bf16"], "unknown marker(s) zero4 in -m 'zero4 and bf16': choose from"),
        (["run", "--gpus", "0"], "--gpus 0: must be a positive number"),
        (["run", "--gpus", "1"], "--gpus 1: the suites compare strategies across ranks; use 2 or more"),
        (["run", "--cell-timeout", "-5"], "--cell-timeout -5.0: must be a positive, finite number of seconds"),
        (["run", "--cell-timeout", "inf"], "--cell-timeout inf: must be a positive, finite number of seconds"),
        (["list", "-m", "fsdp3"], "unknown marker(s) fsdp3"),
        (["run", "-m", "fsdp and ("], "-m 'fsdp and (': not a valid expression at column 11"),
        (["run", "-m", "tp and deepspeed"], "-m 'tp and deepspeed' selects none of the suite's"),
        (["run", "-k", "gpt2 or"], "-k 'gpt2 or': not a valid expression"),
        (["list", "-k", "(ddp"], "-k '(ddp': not a valid expression"),
        (["run", "--suite", "smoke", "-k", "nosuchcell"], "-k 'nosuchcell' selects none of suite smoke's tests"),
        (["run", "--suite", "smoke", "-m", "claims"], "-m 'claims' selects none of suite smoke's tests"),
        (["report", "no-such-run"], "no run at"),
        (["compare", "run-a", "run-b", "--fail-on", "cpu:5%"], "--fail-on='cpu:5%': expected comma-separated KEY:N%"),
        (["compare", "run-a", "run-b"], "no run at"),
        (["accuracy", "no-such-run"], "no run at"),
        (["plan", "--model", "llama9", "--gpus", "8", "--gpu-mem", "80GiB"], "unknown model 'llama9'"),
        (["plan", "--model", "llama3-8b", "--gpus", "8", "--gpu-mem", "80XB"], "--gpu-mem '80XB': give a size"),
        (["plan", "--model", "llama3-8b", "--gpus", "12", "--nodes", "8", "--gpu-mem", "80GiB"],
         "--gpus 12 is not divisible by --nodes 8"),
        (["plan", "--model", "llama3-8b", "--gpus", "8", "--gpu-mem", "80GiB", "--precision", "fp8"],
         "--precision fp8: choose one of"),
        (["plan", "--model", "vit-base", "--gpus", "8", "--gpu-mem", "80GiB", "--seq", "512"],
         "--seq applies to text models"),
        (["plan", "--model", "llama3-8b", "--gpus", "0", "--gpu-mem", "80GiB"], "--gpus 0: must be at least 1"),
        (["plan", "--model", "llama3-8b", "--gpus", "8", "--gpu-mem", "80GiB", "--micro-batch", "0"],
         "--micro-batch 0: must be at least 1"),
        (["plan", "--model", "gpt2-124m", "--gpus", "100000000", "--gpu-mem", "80GiB"],
         "--gpus 100000000: must be at least 1 and at most 1,048,576"),
        (["plan", "--model", "gpt2-124m", "--gpus", "8", "--gpu-mem", "80GiB", "--seq", "0"],
         "--seq 0: must be at least 1"),
        (["plan", "--model", str(REPO / "suites/configs/mistral-tiny.json"), "--gpus", "8", "--gpu-mem", "80GiB",
          "--seq", "64"], "--seq: seq_len=64: model 'mistral-"),
        (["plan", "--model", "gpt2-124m", "--gpus", "8", "--gpu-mem", "inf"], "--gpu-mem 'inf': give a size"),
        (["plan", "--model", "gpt2-124m", "--gpus", "8", "--gpu-mem", "80GiB", "--host-mem", "2T"],
         "--host-mem '2T': give a size with its unit"),
        (["plan", "--model", "gpt2-124m", "--gpus", "8", "--gpu-mem", "80GiB", "--host-mem", "2048TiB"],
         "--host-mem '2048TiB': must be between 1 MiB and 1 PiB per node"),
        (["plan", "--model", "gpt2-124m", "--gpus", "1", "--gpu-mem", "80GiB", "--nodes", "2"],
         "--gpus 1 is not divisible by --nodes 2"),
        (["plan", "--model", str(REPO / "suites/configs/mamba-tiny.json"), "--gpus", "2", "--gpu-mem", "80GiB"],
         "--model: plan ranks configurations by their analytic peak, and none of mamba-"),
        (["run", "--nnodes", "0"], "--nnodes 0: must be 1 or more"),
        (["run", "--nnodes", "2", "--node-rank", "2", "--master-addr", "127.0.0.1"],
         "--node-rank 2: must be in [0, 2)"),
        (["run", "--nnodes", "2", "--node-rank", "0"], "--master-addr is required"),
        (["run", "--nnodes", "2", "--node-rank", "1", "--master-addr", "no such host"],
         "--master-addr 'no such host': not a host name or address this node can resolve"),
        (["run", "--nnodes", "2", "--node-rank", "0", "--master-addr", "127.0.0.1", "--master-port", "70000"],
         "--master-port 70000: must be in 1-65534"),
        (["run", "--resume", "no-such-run"], "no run at"),
        (["run", "--retry-failed"], "--retry-failed: only with --resume RUN_ID"),
        (["reproduce", "no-such-run", "gpt2-tiny/ddp/fp32/ckpt_none/mb2/ws2/seed0"], "no run at"),
        (["run", "--gpus", "two"], "run: argument --gpus: invalid int value: 'two'"),
        (["run", "--no-trce"], "unrecognized argument --no-trce: did you mean --no-trace?"),
        (["run", "--gpu", "2"], "ambiguous option: --gpu could match --gpus, --gpu-mem"),
        (["run", "--repeats", "2"], "unrecognized argument --repeats: did you mean --repeat?"),
        (["list", "--sute", "smoke"], "unrecognized argument --sute: did you mean --suite?"),
        (["plan", "--model", "gpt2-124m", "--gpus", "8", "--gpu-mem", "80GiB", "--precison", "bf16"],
         "unrecognized argument --precison: did you mean --precision?"),
        (["run", "--mem-cap-gib", "0"], "--mem-cap-gib 0.0: must be a positive number of GiB per rank"),
        (["run", "--mem-cap-gib", "inf"], "--mem-cap-gib inf: must be a positive number of GiB per rank, at most"),
        (["run", "--mem-cap-gib", "nan"], "--mem-cap-gib nan: must be a positive number of GiB per rank"),
        (["plan", "--model", "gpt2-124m", "--gpus", "1", "--gpu-mem", "80"],
         "--gpu-mem '80': give a size with its unit, such as 80GiB"),
        (["plan", "--model", "gpt2-124m", "--gpus", "1", "--gpu-mem", "1e30GiB"],
         "--gpu-mem '1e30GiB': must be between 1 MiB and 16 TiB per GPU"),
        (["plan", "--model", "gpt2-124m", "--gpus", "1", "--gpu-mem", "512KiB"],
         "--gpu-mem '512KiB': must be between 1 MiB and 16 TiB per GPU"),
        (["plan", "--model", "gpt2-124m", "--gpus", "8", "--gpu-mem", "80GiB", "--optimizer", "adam9"],
         "--optimizer adam9: choose one of adamw, adam8bit"),
        (["plan", "--model", "gpt2-124m", "--gpus", "8", "--gpu-mem", "80GiB", "--calibration", "{files}/nope"],
         "/nope: cannot read "),
        (["plan", "--model", "gpt2-124m", "--gpus", "8", "--gpu-mem", "80GiB", "--calibration", "{files}/rates.json"],
         "/rates.json: neither a run's run.json nor a calibration's JSON (no compute_rates)"),
        (["plan", "--model", "gpt2-124m", "--gpus", "8", "--gpu-mem", "80GiB", "--calibration",
          "{files}/unswept.json"], "/unswept.json (run r1) measured no compute rates: --no-bandwidth"),
        (["plan", "--model", "gpt2-124m", "--gpus", "8", "--gpu-mem", "80GiB", "--gpu", "H100"],
         "--gpu 'H100' names several GPUs: choose one of NVIDIA H100 80GB HBM3; NVIDIA H100 PCIe"),
        (["plan", "--model", "gpt2-124m", "--gpus", "8", "--gpu-mem", "24GiB", "--gpu", "RTX 4090"],
         "--gpu 'RTX 4090' names no GPU whose peaks are known: choose one of NVIDIA A100-SXM4-40GB;"),
        (["plan", "--model", "gpt2-124m", "--gpus", "8", "--gpu-mem", "80GiB", "--gpu", "H200", "--calibration",
          "{files}/rates.json"], "/rates.json's own device prices the steps; give one of them"),
        (["plan", "--model", "gpt2-124m", "--gpus", "8", "--gpu-mem", "80GiB", "--global-batch", "101"],
         "--global-batch 101 is not a multiple of 2 tensor-parallel groups of 4 GPUs: every GPU (or tensor-parallel"
         " group) takes the same number of samples each step"),
        (["plan", "--model", "gpt2-124m", "--gpus", "8", "--gpu-mem", "80GiB", "--global-batch", "48",
          "--micro-batch", "16"], "--global-batch 48 is not a multiple of 2 tensor-parallel groups of 4 GPUs ×"
                                  " --micro-batch 16:"),
        (["plan", "--model", "gpt2-124m", "--gpus", "3", "--gpu-mem", "80GiB", "--global-batch", "4"],
         "--global-batch 4 is not a multiple of 3 GPUs: every GPU (or tensor-parallel group)"),
        (["plan", "--model", "bert-base", "--gpus", "8", "--gpu-mem", "80GiB", "--global-batch", "4"],
         "--global-batch 4 is not a multiple of 8 GPUs: every GPU (or tensor-parallel group)"),
        (["plan", "--model", "gpt2-124m", "--gpus", "16", "--nodes", "2", "--gpu-mem", "80GiB", "--inter-node-bw",
          "400"], "--inter-node-bw '400': give a rate with its unit, such as 400Gbps, 3.2Tbps or 50GB/s"),
        (["plan", "--model", "gpt2-124m", "--gpus", "8", "--gpu-mem", "80GiB", "--inter-node-bw", "400Gbps"],
         "--inter-node-bw prices what crosses nodes: it applies to a plan over several --nodes"),
        (["run", "--mem-cap-gib", "80GB"], "argument --mem-cap-gib: invalid float value: '80GB'"),
        (["run", "--repeat", "0"], "--repeat 0: must be 1 or more trials per cell"),
        (["run", "--suite", "{files}/missing.toml"], "missing.toml: cannot read it ([Errno 2] No such file"),
        (["run", "--suite", "{files}/not_toml.toml"], "not_toml.toml: not valid TOML: Expected ']]'"),
        (["list", "--suite", "{files}/zero4.toml"], "zero4.toml, cells[0]: strategy='deepspeed_zero4': choose one of"
                                                    " single, ddp, dataparallel, zero1"),
        (["run", "--suite", "{files}/powersgd_fsdp.toml"], "cells[1]: gpt2-tiny/fsdp_full/fp32/ckpt_none/compress_"
                                                           "powersgd-r1/mb2/ws2/seed0 is not a valid combination"),
        (["run", "--suite", "{files}/typo.toml"], "cells[0]: unknown option(s) precison: choose from strategy, model"),
        (["run", "--suite", "{files}/zero_batch.toml"], "cells[0]: micro_batch=0: must be a positive integer"),
        (["list", "--suite", "{files}/bool_batch.toml"], "cells[0]: micro_batch=True: must be an integer"),
        (["list", "--suite", "{files}/text_seed.toml"], "cells[0]: seed='abc': must be an integer"),
        (["list", "--suite", "{files}/float_seed.toml"], "cells[0]: seed=2.5: must be an integer"),
        (["list", "--suite", "{files}/text_lr.toml"], "cells[0]: lr='fast': must be a number"),
        (["list", "--suite", "{files}/no_strategies.toml"], "cells[0]: strategy = []: an empty axis gives no cells"),
        (["run", "--suite", "{files}/no_strategies.toml"], "cells[0]: strategy = []: an empty axis gives no cells"),
        (["list", "--suite", "{files}/huge_steps.toml"], "cells[0]: steps=100000000: must be a positive integer,"
                                                         " at most 1,048,576"),
        (["list", "--suite", "{files}/ws3.toml"], "world_size 3: the suites form world sizes that are powers of two"),
        (["run", "--suite", "{files}/ws3.toml"], "world_size 3: the suites form world sizes that are powers of two"),
        (["list", "--suite", "{files}/planning_only.toml"], "cells[0]: model='mixtral-8x7b': planning only"),
        (["run", "--suite", "{files}/planning_only.toml"], "cells[0]: model='mixtral-8x7b': planning only"),
        (["run", "--gpus", "1024", "--device", "cpu"], "1024 CPU ranks on this node: more than 4 per core"),
        (["run", "--suite", "{files}/ws1024.toml", "--device", "cpu"], "1024 CPU ranks on this node: more than 4"),
        (["list", "--suite", "{files}/lr_zero.toml"], "cells[0]: lr=0: must be a positive number, at most 1000"),
        (["list", "--suite", "{files}/lr_huge.toml"], "cells[0]: lr=1000000000.0: must be a positive number"),
        (["list", "--suite", "{files}/seed_negative.toml"], "cells[0]: seed=-1: must be an integer from 0 to 2**63"),
        (["list", "--suite", "{files}/warmup1.toml"], "cells[0]: warmup=1: must be at least 2"),
        (["list", "--suite", "{files}/fp8.toml"], "cells[0]: precision='fp8': choose one of fp32, bf16, fp16"),
        (["list", "--suite", "{files}/every1.toml"], "cells[0]: checkpoint_every=1: must be an integer of 2 or more"),
        (["list", "--suite", "{files}/clip0.toml"], "cells[0]: clip_grad_norm=0: must be a positive, finite number"),
        (["list", "--suite", "{files}/bucket_negative.toml"], "cells[0]: bucket_cap_mb=-1: must be a positive"),
        (["list", "--suite", "{files}/steps3.toml"], "cells[0]: steps=3: need at least warmup + 2 probe steps"),
        (["list", "--suite", "{files}/model42.toml"], "cells[0]: model=42: a preset's name, a config.json path"),
        (["list", "--suite", "{files}/float_batch.toml"], "cells[0]: micro_batch=2.0: must be an integer"),
        (["list", "--suite", "{files}/int_switch.toml"], "cells[0]: expandable_segments=1: must be true or false"),
        (["list", "--suite", "{files}/text_eval.toml"], "cells[0]: eval_every='often': must be an integer or unset"),
        (["list", "--suite", "{files}/ws0.toml"], "cells[0]: world_size=0: must be a positive integer"),
        (["list", "--suite", "{files}/bool_layers.toml"], "transformers refuses the config: TypeError: Field"
                                                          " 'num_hidden_layers' expected int, got bool"),
        (["list", "--suite", "{files}/deep.toml"], "cells[0]: n_layers=100000000: at most 1,024"),
        (["run", "--suite", "{files}/lr_sweep.toml"], "differ (lr 0.001 and 0.01): a cell's id leaves lr, steps and"
                                                      " warmup out"),
        (["run", "--suite", "{files}/too_many.toml"], "too_many.toml lists 2,500 cells, more than --max-cells 2,000"),
        (["list", "--suite", "smoke", "--max-cells", "3"], "suite smoke has 5 cells, more than --max-cells 3"),
        (["run", "--max-cells", "0"], "--max-cells 0: must be 1 or more cells"),
        (["run", "--repeat", "100000000"], "--repeat 100000000: must be 1 or more trials per cell, at most"),
        (["run", "--gpus", "100000000"], "--gpus 100000000: must be a positive number of ranks per node, at most"),
        (["list", "widgets"], "list widgets: choose one of cells, models, strategies, options, markers"),
        (["compare", "run-a", "run-b", "--format", "pdf"], "compare: argument --format: invalid choice: 'pdf'"),
        (["run", "--device", "tpu"], "run: argument --device: invalid choice: 'tpu'"),
        (["run", "--gpus", "3", "--device", "cpu"], "world_size 3: the suites form world sizes"),
        (["run", "--suite", "{files}/ws3.toml", "--nnodes", "2", "--node-rank", "0", "--master-addr", "127.0.0.1"],
         "world_size 3 does not split over 2 nodes (every node runs world_size / nnodes ranks)"),
    ],
)
def test_bad_input_is_one_line_and_exit_2_with_nothing_launched(tmp_path, args, message, capsys):
    files = tmp_path / "suite-files"
    files.mkdir()
    for name, text in SUITE_FILES.items():
        (files / name).write_text(text)
    args = [arg.format(files=files) for arg in args]
    takes_out = args[0] not in ("list", "plan")
    out = tmp_path / "out"  # a refused run must not make it
    # In this process (a second each, not five): every input here fails before pytest starts.
    try:
        code = cli.main([*args, "--out", str(out)] if takes_out else args)
    except SystemExit as exited:  # argparse's own errors
        code = exited.code
    _assert_refused(code, capsys.readouterr().err, message, out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["suite-files"]  # and nothing else either


def _assert_refused(code: int, stderr: str, message: str, out: Path) -> None:
    """Exit 2, one line on stderr saying ``message``, ``out`` not made (or, where it was
    there before, nothing written in it)."""
    assert code == 2, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], stderr
    assert not lines[0].startswith("shardbench: error: shardbench:"), stderr  # the command's name, once
    assert not (out / "results").exists()


def test_list_shows_the_selection_and_the_references_it_needs(capsys):
    assert cli.main(["list", "-m", "fsdp and bf16"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-1] == "3 cells selected, 3 references added"
    assert all("bf16" in line for line in lines[:-1])


def test_smoke_suite_end_to_end(smoke_run, capsys):
    tmp_path, result = smoke_run
    out = result.stdout
    assert result.returncode == 0, out[-3000:] + result.stderr[-3000:]
    assert "[  1/6]" in out and "[  6/6]" in out  # a progress line per cell, the added reference included
    assert "shardbench summary" in out
    run_dir = (tmp_path / "results" / "latest").resolve()
    info = json.loads((run_dir / "run.json").read_text())
    assert info["suite"] == "smoke" and info["environment"]["versions"]["torch"]
    records = [json.loads(line) for line in (run_dir / "cells.jsonl").read_text().splitlines()]
    assert len(records) == 6
    statuses = {r["cell_id"]: r["status"] for r in records}
    assert statuses["gpt2-tiny/ddp/fp32/ckpt_none/compress_bf16/mb2/ws2/seed0"] == "unsupported"
    assert sum(s == "ok" for s in statuses.values()) == 5
    report = tmp_path / "reports" / run_dir.name / "index.html"
    html = report.read_text()
    assert all(r["cell_id"] in html for r in records)
    # The other commands in this process: a command's own start-up costs seconds here.
    assert cli.main(["report", "latest", "--out", str(tmp_path)]) == 0
    assert capsys.readouterr().out.strip() == str(report)
    # Predicted beside measured: both predictors in every measured record, ratios, the command.
    for r in records:
        assert r["predicted"]["analytic"]["model_state_bytes"] > 0
        if r["status"] == "ok":
            ratios = r["predicted"]["ratios"]
            assert ratios["traced_peak"]["within_target"], (r["cell_id"], ratios)
            assert ratios["analytic_model_states"]["within_target"], (r["cell_id"], ratios)
            assert ratios["analytic_peak"]["within_target"], (r["cell_id"], ratios)
    strict = cli.main(["accuracy", "--out", str(tmp_path), "--strict"])
    accuracy = capsys.readouterr().out
    assert "traced_peak: 5 of 5 cells within ±10%" in accuracy
    assert "analytic_peak: 5 of 5 cells within ±10%" in accuracy
    # Step times are priced at rates measured on this shared host: their run targets may miss,
    # and --strict says so by its exit status (the memory targets above are met).
    assert "step_time: " in accuracy and "median ratio" in accuracy
    step_time_met = "of cells within ±50%: met" in accuracy
    assert strict == (0 if step_time_met else 1), accuracy
    page = (tmp_path / "reports" / run_dir.name / "cells").glob("gpt2-tiny_ddp_fp32_ckpt_none_mb2*.html")
    cell_page = next(page).read_text()
    assert "Predicted beside measured" in cell_page and "peak (analytic)" in cell_page
    assert 'id="step-time"' in cell_page and "Predicted from the step's traced work" in cell_page


def test_plan_prints_every_candidate_and_a_recommendation(capsys):
    assert cli.main(["plan", "--model", "gpt2-1.5b", "--gpus", "8", "--gpu-mem", "40GB", "--format", "json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    configs = [row["config"] for row in plan["rows"]]
    assert "ddp/bf16/ckpt_none" in configs and "deepspeed_zero3/bf16/ckpt_full/offload_optimizer_params" in configs
    assert plan["recommended"] in configs and plan["recommendation"].startswith("Recommended:")
    best = next(row for row in plan["rows"] if row["config"] == plan["recommended"])
    assert best["fits"] and best["predicted"]["peak_bytes"] <= 40e9


def test_plan_prices_steps_at_a_runs_calibration(smoke_run, capsys):
    out, _ = smoke_run
    run = out / "results" / "latest"
    assert cli.main(["plan", "--model", "gpt2-tiny", "--gpus", "2", "--gpu-mem", "1GiB", "--micro-batch", "2",
                     "--precision", "fp32", "--calibration", str(run), "--format", "json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["rates"]["source"].startswith(f"this cpu host, measured by {run} (run ")
    assert plan["rates"]["device_type"] == "cpu" and all(row["step_time"]["step_time_s"] > 0 for row in plan["rows"])
    # Each configuration's work traced (gpt2-tiny's two blocks whole: predict/plan_work.py), none offloading
    # activations.
    assert all(row["step_time"]["work"].startswith("traced stand-in gpt2-tiny-2-blocks/") for row in plan["rows"])
    assert not any("ckpt_offload" in row["config"] for row in plan["rows"])
    # The smoke run measured two of these configurations: each is held beside its prediction.
    records = {r["cell_id"]: r for r in map(json.loads, (run / "cells.jsonl").read_text().splitlines())}
    beside = {row["config"]: row["measured_step_time_s"] for row in plan["rows"] if row["measured_step_time_s"]}
    assert beside == {f"{name}/fp32/ckpt_none": records[f"gpt2-tiny/{name}/fp32/ckpt_none/mb2/ws2/seed0"]["metrics"]
                      ["step_time_s"] for name in ("ddp", "fsdp_full")}
    assert plan["against_measured"]["count"] == 2


def test_plan_prices_the_gpu_it_is_given_at_its_datasheet_peaks(capsys):
    """--gpu names the GPU: an A100 SXM's dense bf16 peak is 312 TFLOP/s against an H100 SXM's
    989, its memory bandwidth 2.039 TB/s against 3.35, so a configuration's compute (matmuls
    and memory-bound work) takes between 3.35/2.039 and 989/312 as long, and its collectives
    (priced at the fabric's assumed bandwidth, not the GPU's) as long."""
    a100 = rough_time.assumed("NVIDIA A100-SXM4-80GB").calibration["compute_rates"]["alone"]
    assert a100["matmul_flops_per_s"]["bf16"] == rough_time.ASSUMED_MFU * 312e12
    assert a100["memory_bytes_per_s"] == [[1, rough_time.ASSUMED_HBM_FRACTION * 2.039e12]]
    times = {}
    for gpu in ("a100-sxm4-80gb", None):
        assert cli.main(["plan", "--model", "gpt2-124m", "--gpus", "8", "--gpu-mem", "80GiB", "--format", "json",
                         "--config", "ddp/bf16/ckpt_none"] + (["--gpu", gpu] if gpu else [])) == 0
        plan = json.loads(capsys.readouterr().out)
        assert plan["named"] == "ddp/bf16/ckpt_none"
        times[gpu] = next(row["step_time"] for row in plan["rows"] if row["config"] == plan["named"])
        assert plan["rates"]["source"].startswith("NVIDIA A100-SXM4-80GB (assumed" if gpu else
                                                  "NVIDIA H100 80GB HBM3 (assumed")
    assert 3.35 / 2.039 < times["a100-sxm4-80gb"]["compute_s"] / times[None]["compute_s"] < 989 / 312
    assert times["a100-sxm4-80gb"]["comm_s"] == pytest.approx(times[None]["comm_s"])


def test_plan_for_one_gpu_runs_the_model_whole_or_offloads_it(capsys):
    """One GPU: the single-process step, and the engines that offload at one rank (ZeRO-Offload's
    one-GPU case), which only a model too large for the GPU needs."""
    assert cli.main(["plan", "--model", "gpt2-124m", "--gpus", "1", "--gpu-mem", "80GiB", "--format", "json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    engines = {row["config"].split("/")[0] for row in plan["rows"] if not row["config"].startswith("single/")}
    assert engines == {"deepspeed_zero3", "fsdp_full", "fsdp_grad_op"}
    assert all("/offload_" in row["config"] for row in plan["rows"] if row["config"].split("/")[0] in engines)
    assert plan["recommended"].startswith("single/") and plan["recommendation"].startswith("Recommended:")
    assert cli.main(["plan", "--model", "llama3-8b", "--gpus", "1", "--gpu-mem", "80GiB", "--format", "json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    best = plan["recommended"]
    assert best.startswith("deepspeed_zero3/bf16/") and best.endswith("/offload_optimizer")


@pytest.mark.parametrize("args, message", [
    (["--gpus", "4"], "--gpus 4: this host has 2 visible GPU(s); use fewer, or --device cpu for CPU ranks"),
    (["--mem-cap-gib", "100"], "--mem-cap-gib 100.0: more than the 80.0 GiB of Fake GPU 80GB; give at most that"),
])
def test_bad_input_against_the_gpus_present(tmp_path, capsys, monkeypatch, args, message):
    """No GPU here: a host with two 80 GiB GPUs, as torch.cuda would describe it."""
    import types

    import torch

    from harness.distributed import DEVICE_ENV_VAR

    monkeypatch.delenv(DEVICE_ENV_VAR)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Fake GPU 80GB")
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device: types.SimpleNamespace(total_memory=80 * 2**30))
    _assert_refused(cli.main(["run", *args, "--out", str(tmp_path)]), capsys.readouterr().err, message, tmp_path)


@pytest.mark.parametrize("what", CATALOGUES)
def test_list_shows_everything_a_cell_can_be(what, capsys):
    assert cli.main(["list", what]) == 0
    out = capsys.readouterr().out
    named = {"models": list(PRESETS), "strategies": list(strategies.names()), "options": list(suite_files.OPTIONS),
             "markers": [m for m in {**markers.CATALOGUE, **markers.TEST_MARKERS} if not m.startswith("ws")]}[what]
    first_words = {line.split()[0].rstrip(":") for line in out.splitlines() if line.strip()}
    assert set(named) <= first_words, set(named) - first_words
    if what == "models":
        assert "mixtral-8x7b" in out and "planning only" in out


def test_the_version_and_the_help_say_what_they_should(capsys):
    with pytest.raises(SystemExit) as exited:
        cli.main(["--version"])
    assert exited.value.code == 0 and capsys.readouterr().out.strip() == f"shardbench {metadata.version('shardbench')}"
    with pytest.raises(SystemExit):
        cli.main(["run", "--help"])
    assert "go to pytest unchanged" in " ".join(capsys.readouterr().out.split())
    own = subprocess.run([str(REPO / "run_all.sh"), "--help"], capture_output=True, text=True, timeout=120)
    assert own.returncode == 0 and "--setup-only" in own.stdout and "usage: shardbench run" in own.stdout


def test_a_wheelhouse_that_is_not_there_is_refused_before_the_set_up_touches_anything(tmp_path):
    """SHARDBENCH_WHEELHOUSE (a node without a package index): a folder that does not exist
    is one line and exit 2, before the venv is made or changed."""
    missing = tmp_path / "wheels"
    refused = subprocess.run([str(REPO / "run_all.sh"), "--setup-only"], capture_output=True, text=True, timeout=60,
                             env={**os.environ, "SHARDBENCH_WHEELHOUSE": str(missing)})
    assert refused.returncode == 2 and refused.stdout == ""
    assert refused.stderr == f"shardbench: error: SHARDBENCH_WHEELHOUSE={missing}: no such folder\n"


@pytest.fixture
def read_only_folder(tmp_path):
    """A folder no one may write in: a read-only tmpfs as root (who may write anywhere else),
    a mode-555 folder otherwise."""
    folder = tmp_path / "ro"
    folder.mkdir()
    if os.geteuid() != 0:
        folder.chmod(0o555)
        yield folder
        folder.chmod(0o755)
        return
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(folder)]).returncode != 0:
        pytest.skip("root here cannot mount a tmpfs (a container without CAP_SYS_ADMIN)")
    yield folder
    subprocess.run(["umount", str(folder)], check=True)


def test_a_read_only_out_is_refused_before_anything_runs(read_only_folder, capsys):
    code = cli.main(["run", "--suite", "smoke", "--out", str(read_only_folder / "run")])
    _assert_refused(code, capsys.readouterr().err, f"--out {read_only_folder / 'run'}: {read_only_folder} is not"
                    " writable", read_only_folder / "run")
