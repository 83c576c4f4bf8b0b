"""The GPU path's measurements: CUDA allocator numbers and NVML, expandable segments, the
memory timeline (--memory-snapshot), the leak check and MFU. CUDA calls are faked where the
code only reads them; the CPU measurements run for real, one of them on 2 gloo ranks."""

import json

import pytest
import torch
from torch import nn

from harness import faults, training
from harness.config import CellSpec, StrategySpec
from harness.measure import flops, memory, summary
from harness.predict import rough_time, traced
from harness.report import figures, html
from harness.results.store import RunStore
from harness.runner.launcher import LaunchOptions, run_batch
from harness.runner.matrix import MatrixRun


def _model_and_optimizer():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 32))
    return model, torch.optim.AdamW(model.parameters(), fused=True)


def _step(model, opt):
    model(torch.randn(8, 64)).sum().backward()
    opt.step()
    opt.zero_grad()


# --- live bytes (the leak check's measure) -------------------------------------------------

def test_cpu_live_bytes_see_a_kept_tensor_once_and_not_a_freed_one():
    before = memory.live_bytes(torch.device("cpu"))
    kept = [torch.ones(2**20, dtype=torch.uint8)]
    kept.append(kept[0][:10])  # a view shares its storage: counted once
    held = memory.live_bytes(torch.device("cpu"))
    del kept
    after = memory.live_bytes(torch.device("cpu"))
    assert held - before == 2**20
    assert after == before


def test_cuda_live_bytes_are_the_allocators_count(monkeypatch):
    monkeypatch.setattr(torch.cuda, "memory_allocated",
                        lambda device=None: 12345 if device == torch.device("cuda", 1) else -1)
    assert memory.live_bytes(torch.device("cuda", 1)) == 12345


def test_growth_needs_two_measurements():
    assert training.growth([100, 4196]) == 4096
    assert training.growth([100]) is None


def test_growth_is_the_most_any_rank_grew_and_the_report_flags_it():
    ranks = [{"rank": 0, "memory_growth_bytes": -16640}, {"rank": 1, "memory_growth_bytes": 2**20}]
    assert summary.memory_growth(ranks) == 2**20
    assert summary.memory_growth([{"rank": 0, "memory_growth_bytes": None}]) is None
    leaking = html._row({"cell_id": "c", "status": "ok",
                         "metrics": {"peak_mem_bytes": 2**20, "memory_growth_bytes": 2**20}})
    assert "leak: +1,048,576 B" in leaking["cols"][0][0]
    freed = html._row({"cell_id": "c", "status": "ok", "metrics": {"peak_mem_bytes": 2**20, "memory_growth_bytes": -5}})
    assert "leak" not in freed["cols"][0][0]


# --- CUDA allocator numbers and NVML (faked device) -----------------------------------------

class _FakeCuda:
    def __init__(self, monkeypatch, nvml):
        for name in ("synchronize", "reset_peak_memory_stats", "reset_accumulated_memory_stats"):
            monkeypatch.setattr(torch.cuda, name, lambda device=None: None)
        monkeypatch.setattr(torch.cuda, "memory_stats", lambda device=None: {"num_alloc_retries": 1, "num_ooms": 0})
        monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 1000)
        monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: 2048)
        monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 600)
        monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 1024)
        monkeypatch.setattr(torch.cuda, "device_memory_used", nvml)


def _cuda_step(monkeypatch, nvml):
    model, opt = _model_and_optimizer()
    for _ in range(3):
        _step(model, opt)
    _FakeCuda(monkeypatch, nvml)
    with memory.track_step_memory(model, opt, fsdp2=False, device=torch.device("cuda", 0)) as probe:
        _step(model, opt)
    return probe.result().cuda


def test_cuda_numbers_hold_allocated_reserved_and_nvml(monkeypatch):
    cuda = _cuda_step(monkeypatch, lambda device=None: 3 * 2**30)
    assert cuda == {"max_allocated": 1000, "max_reserved": 2048, "fragmentation": 1048, "alloc_retries": 1,
                    "num_ooms": 0, "allocated": 600, "reserved": 1024, "nvml_used": 3 * 2**30, "nvml_reason": ""}


def test_without_nvidia_ml_py_nvml_is_none_with_the_reason(monkeypatch):
    def no_pynvml(device=None):
        raise ModuleNotFoundError("nvidia-ml-py does not seem to be installed or it can't be imported.")

    cuda = _cuda_step(monkeypatch, no_pynvml)
    assert cuda["nvml_used"] is None and "nvidia-ml-py" in cuda["nvml_reason"]
    assert cuda["max_allocated"] == 1000  # the rest is measured all the same


def test_expandable_segments_are_on_for_the_cell_only_and_off_after(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append("synchronize"))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", lambda s: calls.append(s))
    with training.allocator_settings("expandable_segments:True", torch.device("cuda", 0)):
        calls.append("cell")
    # The cache is emptied before the setting changes each way: a segment keeps its kind.
    assert calls == ["synchronize", "empty_cache", "expandable_segments:True", "cell",
                     "synchronize", "empty_cache", "expandable_segments:False"]
    calls.clear()
    with pytest.raises(RuntimeError), training.allocator_settings("expandable_segments:True", torch.device("cuda", 0)):
        raise RuntimeError("the cell failed")
    assert calls[-1] == "expandable_segments:False"  # a failed cell does not leave it on
    calls.clear()
    with training.allocator_settings("", torch.device("cuda", 0)):
        pass
    assert calls == []


def test_expandable_segments_in_use_reads_the_devices_segments(monkeypatch):
    segments = [{"device": 0, "is_expandable": False}, {"device": 1, "is_expandable": True}]
    monkeypatch.setattr(torch.cuda, "memory_snapshot", lambda: segments)
    assert training.expandable_segments_in_use(torch.device("cuda", 1))
    assert not training.expandable_segments_in_use(torch.device("cuda", 0))


# --- memory timeline -----------------------------------------------------------------------

def test_timeline_running_sum_reaches_the_trackers_peak():
    model, opt = _model_and_optimizer()
    for _ in range(3):
        _step(model, opt)
    with memory.track_step_memory(model, opt, fsdp2=False, device=torch.device("cpu"), timeline=True) as probe:
        _step(model, opt)
    mem = probe.result()
    held = figures.timeline_series(mem.timeline)
    totals = held[list(figures.MEM_CATEGORIES)].sum(axis=1)
    # The tracker samples its peak after each op; the timeline also sees what lives between.
    assert totals.max() >= mem.peak_bytes
    params = sum(p.nbytes for p in model.parameters())
    state = sum(t.nbytes for s in opt.state.values() for t in s.values())
    assert held["params"].iloc[-1] == params and held["grads"].iloc[-1] == 0  # zero_grad: set to None
    assert totals.iloc[-1] == params + state
    assert list(held["t"]) == sorted(held["t"])
    assert not mem.timeline_truncated


def test_no_timeline_unless_asked():
    model, opt = _model_and_optimizer()
    with memory.track_step_memory(model, opt, fsdp2=False, device=torch.device("cpu")) as probe:
        _step(model, opt)
    assert probe.result().timeline is None


# --- MFU -------------------------------------------------------------------------------------

def test_fp32_takes_the_tf32_peak_only_with_tf32_matmuls():
    assert flops.compute_precision("fp32", "highest") == "fp32"
    assert flops.compute_precision("fp32", "high") == "tf32"
    assert flops.compute_precision("bf16", "high") == "bf16"
    assert flops.peak_flops("NVIDIA H200", "tf32") == 494.5e12
    assert flops.peak_flops("NVIDIA H200", "bf16") == 989e12  # formulas.md: H200 SXM 989 dense
    assert flops.peak_flops("NVIDIA A100-SXM4-80GB", "bf16") == 312e12


def test_every_gpu_with_known_peaks_has_its_memory_bandwidth_and_a_name_a_user_can_type():
    assert flops.PEAK_MEMORY_BYTES_PER_S.keys() == flops.PEAK_DENSE_FLOPS.keys()
    assert flops.known_device("h200") == flops.known_device("NVIDIA H200") == "NVIDIA H200"
    assert flops.known_device("A100 80GB PCIe") == "NVIDIA A100 80GB PCIe"
    assert flops.known_device("a100-sxm4-40gb") == "NVIDIA A100-SXM4-40GB"
    with pytest.raises(ValueError, match="names several GPUs: choose one of NVIDIA A100-SXM4-40GB; "):
        flops.known_device("A100")
    with pytest.raises(ValueError, match="'A100 80GB' names several GPUs: choose one of NVIDIA A100-SXM4-80GB; "):
        flops.known_device("A100 80GB")  # SXM or PCIe: not the one whose name happens to contain it


def test_unknown_device_gets_one_warning_naming_it_and_no_mfu():
    assert flops.peak_flops("NVIDIA GeForce RTX 4090", "bf16") is None
    # A GPU matrix listed for it prices its steps at the assumed GPU's peaks, and says so.
    assert rough_time.assumed("NVIDIA GeForce RTX 4090").source.startswith(
        "NVIDIA H100 80GB HBM3 (assumed for NVIDIA GeForce RTX 4090, whose peaks are not listed: 40% MFU")
    assert "NVIDIA GeForce RTX 4090" in flops.no_peak_warning("cuda", "NVIDIA GeForce RTX 4090")
    assert flops.no_peak_warning("cuda", "NVIDIA H200") is None


def _gpt2(strategy="ddp"):
    return CellSpec(model="gpt2-tiny", strategy=StrategySpec(name=strategy))


def _per_rank(step_s):
    return {"rank": 0, "peak_mem_bytes": 1, "mem_breakdown_bytes": dict.fromkeys(memory.BREAKDOWN_KEYS, 0),
            "rss_peak_bytes": None, "step_times_s": [step_s] * 3, "flops_per_sample": 1e12,
            "tokens_per_sample": 128, "comm_by_op": {}}


def test_mfu_over_one_is_flagged_and_the_report_says_suspect():
    cell = _gpt2().reference()
    fast = summary.summarize(cell, [_per_rank(1e-3)], peak_flops_per_rank=1e12)
    assert fast["mfu"] > 1 and fast["mfu_suspect"]
    slow = summary.summarize(cell, [_per_rank(1e3)], peak_flops_per_rank=1e12)
    assert not slow["mfu_suspect"]
    row = html._row({"cell_id": cell.cell_id, "status": "ok", "metrics": fast})
    assert any("(suspect)" in display for display, _ in row["cols"])


# --- on 2 gloo ranks -------------------------------------------------------------------------

@pytest.fixture
def untraced(monkeypatch):
    """No FakeTensorMode trace before the cells: the predictions are not what these test."""
    monkeypatch.setattr(traced, "trace_cells", lambda cells, **_: {})


def _run(cells, tmp_path, snapshot=True):
    store = RunStore(tmp_path / "results", "run")
    lines = []
    options = LaunchOptions(memory_snapshot_dir=store.path / "memory" if snapshot else None,
                            profile_dir=store.path / "profiles" if snapshot else None)
    records = MatrixRun(cells, store, options, device_type="cpu", device_name=None, progress=lines.append).run()
    return store.path, records, lines


def test_memory_snapshot_timeline_leak_check_and_report_on_gloo(tmp_path, untraced):
    cell = _gpt2()
    run_dir, records, lines = _run([cell], tmp_path)
    record = records[cell.cell_id]
    assert record["status"] == "ok", record["reason"]
    # The one warning of the run: no known peak for this device, so no MFU.
    assert sum("no peak FLOP/s known" in line for line in lines) == 1 and record["metrics"]["mfu"] is None
    assert record["metrics"]["memory_growth_bytes"] <= 0  # DDP on gloo keeps nothing from step to step
    for p in record["per_rank"]:
        assert p["live_bytes_measure"] == "python_tensor_bytes" and p["memory_growth_steps"] == cell.timed_steps - 1
        assert p["memory_snapshot"] is None and "only on CUDA" in p["memory_snapshot_reason"]
        assert p["expandable_segments"] is None
        timeline = json.loads((run_dir / p["memory_timeline"]).read_text())
        assert timeline["rank"] == p["rank"] and timeline["cell_id"] == cell.cell_id
        totals = figures.timeline_series(timeline["events"])[list(figures.MEM_CATEGORIES)].sum(axis=1)
        assert totals.max() >= p["peak_mem_bytes"] > 0
        # --profile: the timed steps' profiler trace, Chrome trace JSON with the step's ops.
        trace = json.loads((run_dir / p["profile_trace"]).read_text())
        assert p["profile_trace"].startswith("profiles/gpt2-tiny_ddp")
        assert p["profile_trace"].endswith(f"/rank{p['rank']}.trace.json")
        assert any(event.get("name") == "aten::mm" for event in trace["traceEvents"])
        # Per module: DDP's wrapped GPT-2, embeddings, each block, the head; every peak sums
        # within the step's and the blocks hold the same parameters.
        modules = {m["module"]: m for m in p["module_memory"]}
        assert list(modules) == ["module.transformer.wte", "module.transformer.wpe", "module.transformer.drop",
                                 "module.transformer.h.0", "module.transformer.h.1", "module.transformer.ln_f",
                                 "module.lm_head"]
        blocks = [modules[f"module.transformer.h.{i}"] for i in (0, 1)]
        assert blocks[0]["params_bytes"] == blocks[1]["params_bytes"] > 0
        assert all(0 < sum(m["peak_backward_bytes"].values()) <= p["peak_mem_bytes"] for m in blocks)
    page = html.write_run_report(run_dir, tmp_path / "report")
    cell_pages = list((page.parent / "cells").glob("gpt2-tiny_ddp*.html"))
    text = cell_pages[0].read_text()
    assert "memory over the memory-tracked step" in text and "Held memory grew" not in text
    assert 'id="profile"' in text and "profiles/" in text and ">rank 1</a>" in text and "nsys profile" not in text
    assert 'id="module-memory"' in text and "module.transformer.h.1" in text and 'class="seg activations"' in text
    assert list((page.parent / "figures" / "cells").glob("memory-gpt2-tiny_ddp*.svg"))


@pytest.mark.skipif("leak" not in faults.FAULTS, reason="harness/faults.py has no 'leak' fault yet")
def test_injected_leaks_are_flagged(tmp_path, monkeypatch):
    """A kept tensor, a hook holding a reference to each output, and graphs kept with
    retain_graph (whose saved activations live in C++): each shows as memory growth."""
    leaking, clean = _gpt2(), _gpt2("zero1")
    hooked = CellSpec(model="llama-tiny", strategy=StrategySpec(name="ddp"))
    retained = CellSpec(model="bert-tiny", strategy=StrategySpec(name="ddp"))
    monkeypatch.setenv(faults.ENV_VAR, f"{leaking.cell_id}=leak,{hooked.cell_id}={faults.HOOK_REFERENCE},"
                                       f"{retained.cell_id}={faults.RETAINED_GRAPH}")
    outcomes = {}
    run_batch([leaking, clean, hooked, retained], LaunchOptions(), tmp_path,
              lambda o: outcomes.update({o.cell.cell_id: o}))
    kept = faults.LEAK_BYTES_PER_STEP * (leaking.timed_steps - 1)
    assert summary.memory_growth(outcomes[leaking.cell_id].per_rank) == kept  # exactly what was kept
    assert summary.memory_growth(outcomes[clean.cell_id].per_rank) <= 0  # same launch, no fault
    # The hook keeps each step's logits (b × s × vocab fp32) at least.
    logits = hooked.micro_batch * hooked.model_spec.seq_len * hooked.model_spec.vocab_size * 4
    assert summary.memory_growth(outcomes[hooked.cell_id].per_rank) >= logits * (hooked.timed_steps - 1)
    # A retained graph keeps far more than its loss: every activation its backward saved.
    assert summary.memory_growth(outcomes[retained.cell_id].per_rank) > 100_000 * (retained.timed_steps - 1)


def test_a_host_without_nvml_records_no_driver_and_why():
    from harness.measure import environment

    version, reason = environment.nvidia_driver()
    assert version is None and ("nvidia-ml-py" in reason or reason.startswith("NVML: "))


def test_the_interconnect_is_recorded_and_a_host_without_nvidia_smi_says_why(monkeypatch, tmp_path):
    """Runs on different fabrics are told apart (issue 19): the network links, the RDMA
    devices, and on CUDA nvidia-smi's topology matrix or why it is missing."""
    from harness.measure import environment
    from harness.report import html

    recorded = environment.collect(tmp_path)["interconnect"]
    assert all(nic["name"] != "lo" and nic["mtu"] > 0 for nic in recorded["network"])
    assert isinstance(recorded["rdma_devices"], list)
    monkeypatch.setattr(environment.shutil, "which", lambda name: None)
    assert environment.gpu_topology() == (None, "nvidia-smi is not on PATH")

    page = html.ENV.get_template("_env.html.j2").render(env=html._environment({"environment": {"interconnect": {
        "network": [{"name": "ib0", "speed_mbps": 200000, "mtu": 4092}], "rdma_devices": ["mlx5_0"],
        "gpu_topology": "\tGPU0\tGPU1\nGPU0\t X \tNV18"}}}))
    assert "ib0 (200000 Mb/s, MTU 4092)" in page and "mlx5_0" in page and "<pre>\tGPU0\tGPU1" in page


def test_allocator_settings_are_the_cells_and_torchs_defaults_after(monkeypatch):
    """max_split_size_mb and garbage_collection_threshold are set around the cell with its
    expandable segments (each call resets what it does not name); the threshold acts only under
    a memory fraction, which a cell without a memory cap gets whole."""
    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append("synchronize"))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", lambda s: calls.append(s))
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, d: calls.append(f"fraction {f}"))
    cell = CellSpec(model="gpt2-tiny", strategy=StrategySpec(name="ddp"), max_split_size_mb=128,
                    garbage_collection_threshold=0.8)
    assert cell.allocator_settings == "max_split_size_mb:128,garbage_collection_threshold:0.8"
    assert cell.reference().allocator_settings == ""
    with training.allocator_settings(cell.allocator_settings, torch.device("cuda", 0)):
        calls.append("cell")
    assert calls == ["synchronize", "empty_cache", cell.allocator_settings, "fraction 1.0", "cell",
                     "synchronize", "empty_cache", "expandable_segments:False"]
    calls.clear()
    with training.allocator_settings("max_split_size_mb:128,garbage_collection_threshold:0.8",
                                     torch.device("cuda", 0), fraction_set=True):
        pass
    assert "fraction 1.0" not in calls  # a memory cap's fraction stands
    split_only = CellSpec(model="gpt2-tiny", strategy=StrategySpec(name="ddp"), max_split_size_mb=256,
                          expandable_segments=True)
    assert split_only.allocator_settings == "expandable_segments:True,max_split_size_mb:256"


@pytest.mark.parametrize("when, calls_per_step", [("never", 0), ("step", 1), ("micro_step", 2)])
def test_empty_cache_after_every_step_or_micro_step(monkeypatch, tmp_path, when, calls_per_step):
    import torch.distributed as dist

    from harness.distributed import DistEnv

    calls = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append(1))
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        cell = CellSpec(model="gpt2-tiny", strategy=StrategySpec(name="single", accumulation=2), world_size=1,
                        empty_cache=when)
        session = training.prepare_cell(cell, DistEnv(rank=0, world_size=1, nnodes=1, device=torch.device("cpu"),
                                                      backend="gloo"))
        for i in range(2):
            session.step(i)
    finally:
        dist.destroy_process_group()
    assert len(calls) == 2 * calls_per_step


def test_activation_offload_wraps_every_block_and_is_unsupported_on_the_cpu():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import OffloadWrapper

    from harness import models, strategies
    from harness.features import checkpointing

    built = models.build(models.get_preset("gpt2-tiny"))
    checkpointing.apply_checkpointing(built.module, built.block_type, "offload")
    wrapped = [m for m in built.module.modules() if isinstance(m, OffloadWrapper)]
    assert len(wrapped) == built.spec.n_layers and all(isinstance(w._checkpoint_wrapped_module, built.block_type)
                                                       for w in wrapped)
    cell = CellSpec(model="gpt2-tiny", strategy=StrategySpec(name="ddp", checkpointing="offload"))
    assert cell.cell_id.startswith("gpt2-tiny/ddp/fp32/ckpt_offload/")
    assert strategies.unsupported_reason(cell, "cpu") == checkpointing.OFFLOAD_ON_CPU
    assert strategies.unsupported_reason(cell, "cuda") is None
    # Recompute-only strategies refuse it where the suite is built.
    pipeline = CellSpec(model="gpt2-tiny", strategy=StrategySpec(name="pp_gpipe", checkpointing="offload"))
    assert "checkpointing" in (strategies.incompatibility(pipeline) or "")
