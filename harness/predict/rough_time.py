"""Step times on GPUs no run has measured: the step-time predictor (harness/predict/step_time.py)
priced at datasheet rates instead of a run's calibration. What ``plan`` ranks by and what
``list`` adds up for a GPU target, written down before anything runs.

The rates, each an assumption stated here (``assumed``):
- matmuls at ``ASSUMED_MFU`` of the GPU's dense datasheet peak (measure/flops.py): the model
  FLOPs fraction well-tuned dense training reaches on H100 (torchtitan's Llama-3 8B: 38-42 %),
  standing in for every kernel of forward and backward;
- memory traffic (the optimizer step's, and the activations' in the analytic work) at
  ``ASSUMED_HBM_FRACTION`` of the GPU's datasheet memory bandwidth (H100 SXM: 3.35 TB/s);
- each collective call at ``ASSUMED_LATENCY_S`` plus its bytes at ``ASSUMED_BUS_BW`` bus
  bandwidth (nccl-tests' convention: algbw = busbw ÷ the op's bus factor); over several
  nodes, what crosses them at the lower of that and a node's network bandwidth
  (``ASSUMED_INTER_NODE_BW``, or plan's ``--inter-node-bw``): a ring over the nodes crosses
  each node's links once per channel, its channels spread over the node's NICs, so its bus
  bandwidth is bounded by the node's NICs together (step_time._job_call_seconds says which
  collectives cross);
- no per-op cost: kernels are launched ahead of the GPU, asynchronously.
Per cell, ``CELL_START_S`` (the model built and sharded, the warm-up's first-step compiles
and allocations) on top of its steps. A GPU that measure/flops.py does not know is priced as
``ASSUMED_GPU``. The bus bandwidth stays the H100 node's whatever the GPU: it is the fabric's
(an A100's NVLink is slower, a PCIe part without NVSwitch much slower), which a run's
calibration measures (``--calibration``); the plan's header states the figure it assumed.

A run's own calibration replaces them (``measured``; ``plan --calibration``, ``list
--calibration``): its launch
measured the same quantities on the user's device (harness/calibration.py), the matmul rate
as an efficiency of the GPU's datasheet peak among them (measure/compute_rate.py). A one-GPU
run's launch times no collective: on CUDA its plan keeps the assumed collectives, saying so.
"""

from __future__ import annotations

from dataclasses import dataclass

from harness.config import CellSpec
from harness.measure import flops
from harness.measure.comm import busbw_factor
from harness.predict import analytic, step_time

ASSUMED_MFU = 0.4
ASSUMED_BUS_BW = 300e9  # B/s: NVLink all-reduce bus bandwidth of an 8×H100 SXM node, below nccl-tests' ~450
ASSUMED_HBM_FRACTION = 0.8  # of the datasheet memory bandwidth, sustained
ASSUMED_LATENCY_S = 20e-6  # one NCCL collective's fixed cost within a node
# B/s a node sends (and receives) to the others: 8 InfiniBand NICs of 400 Gb/s (50 GB/s), one a
# GPU, as a DGX H100's ConnectX-7s; above ASSUMED_BUS_BW, so on such a fabric NVLink's bound stands.
ASSUMED_INTER_NODE_BW = 8 * 50e9
CELL_START_S = 30.0
ASSUMED_GPU = "NVIDIA H100 80GB HBM3"  # whose peak is used where the target GPU is not named
_PRECISIONS = ("fp32", "bf16", "fp16")
_SIZES = tuple(2**k for k in range(10, 41, 2))  # 1 KiB .. 1 TiB


@dataclass(frozen=True, kw_only=True)
class Rates:
    """What a plan prices steps at: a calibration in run.json's ``environment.bandwidth``
    form, the device type it describes, the GPU whose datasheet peak an MFU is taken against
    (None: no MFU), and where the rates come from, in words."""

    calibration: dict
    device_type: str
    gpu_name: str | None
    source: str


def assumed(gpu_name: str | None = None, world_size: int = 2, nodes: int = 1,
            inter_node_bytes_per_s: float | None = None) -> Rates:
    """The module docstring's assumptions, for ``world_size`` GPUs of ``gpu_name`` on
    ``nodes`` nodes, each sending ``inter_node_bytes_per_s`` to the others (None:
    ``ASSUMED_INTER_NODE_BW``)."""
    known = gpu_name if gpu_name in flops.PEAK_DENSE_FLOPS else ASSUMED_GPU
    rates = {"matmul_flops_per_s": {p: (flops.peak_flops(known, flops.compute_precision(p, "high")) or 0.0)
                                    * ASSUMED_MFU for p in _PRECISIONS},
             "memory_bytes_per_s": [[1, ASSUMED_HBM_FRACTION * flops.PEAK_MEMORY_BYTES_PER_S[known]]],
             "op_s": dict.fromkeys(_PRECISIONS, 0.0)}
    calibration = {"world_size": max(world_size, 2), "rows": _assumed_rows(max(world_size, 2)),
                   "compute_rates": {"concurrent": rates, "alone": rates, "world_size": max(world_size, 2)}}
    stands_in = f" for {gpu_name}, whose peaks are not listed" if gpu_name and gpu_name != known else ""
    rates_text = f"{ASSUMED_MFU:.0%} MFU, {ASSUMED_BUS_BW / 1e9:.0f} GB/s bus bandwidth"
    if nodes > 1:
        network = inter_node_bytes_per_s or ASSUMED_INTER_NODE_BW
        bus = min(network, ASSUMED_BUS_BW)  # a ring over the nodes: the slower of its links
        calibration["across_nodes"] = across_nodes(bus, world_size)
        rates_text += (f" within a node, {bus / 1e9:.3g} GB/s across nodes"
                       f" ({_network_text(network, inter_node_bytes_per_s is not None)})")
    return Rates(calibration=calibration, device_type="cuda", gpu_name=known,
                 source=f"{known} (assumed{stands_in}: {rates_text})")


def across_nodes(bus_bytes_per_s: float, world_size: int) -> dict:
    """A sweep across nodes of ``world_size`` ranks, as run.json's
    ``environment.bandwidth_across_nodes`` holds one, at ``bus_bytes_per_s`` bus bandwidth."""
    return {"world_size": world_size, "rows": _assumed_rows(world_size, bus_bytes_per_s)}


def _network_text(network: float, given: bool) -> str:
    what = f"a node's network {network / 1e9:.3g} GB/s"
    return what + (" by --inter-node-bw" if given else ": 8 × 400 Gb/s NICs assumed, --inter-node-bw states yours")


def measured(calibration: dict, run: str, swept_across_nodes: dict | None = None,
             inter_node_bytes_per_s: float | None = None) -> Rates:
    """A run's calibration (``environment.bandwidth``; ``run`` names it), with the run's sweep
    across nodes where it ran on several (``environment.bandwidth_across_nodes``) or, where
    not, collectives across nodes at ``inter_node_bytes_per_s`` bus bandwidth where given
    (plan's --inter-node-bw); ValueError where it measured no compute rates, or where both
    would price what crosses nodes."""
    rates = calibration.get("compute_rates")
    if not rates:
        why = calibration.get("error") or calibration.get("skipped") or "no compute_rates in it"
        raise ValueError(f"{run} measured no compute rates: {why.splitlines()[0]}")
    device_type = calibration.get("device_type", "cpu")
    device = rates.get("device_name") or f"this {device_type} host"
    efficiency = rates.get("matmul_efficiency", {}).get("bf16")
    source = f"{device}, measured by {run}" + (f" (bf16 matmuls at {efficiency:.0%} of its datasheet peak)"
                                                 if efficiency else "")
    if not calibration.get("rows") and device_type == "cuda":
        # One GPU timed no collective; the others' rates are still this device's own.
        calibration = {**calibration, "rows": _assumed_rows(2), "world_size": 2}
        source += (f"; collectives assumed ({ASSUMED_BUS_BW / 1e9:.0f} GB/s bus bandwidth):"
                   f" {calibration.get('no_sweep', 'it timed none')}")
    if swept_across_nodes and "rows" in swept_across_nodes:
        if inter_node_bytes_per_s is not None:
            raise ValueError(f"{run} swept its collectives across {swept_across_nodes.get('nnodes', 'its')} nodes:"
                             " its own sweep prices what crosses nodes; drop --inter-node-bw")
        calibration = {**calibration, "across_nodes": swept_across_nodes}
        source += f"; across nodes at its sweep of {swept_across_nodes.get('scope', 'several nodes')}"
    elif inter_node_bytes_per_s is not None:
        calibration = {**calibration, "across_nodes": across_nodes(inter_node_bytes_per_s, calibration["world_size"])}
        source += f"; across nodes at {inter_node_bytes_per_s / 1e9:.3g} GB/s (--inter-node-bw)"
    return Rates(calibration=calibration, device_type=device_type, gpu_name=rates.get("device_name"), source=source)


def _assumed_rows(ranks: int, bus_bytes_per_s: float = ASSUMED_BUS_BW) -> list[dict]:
    return [{"op": op, "bytes": size, "time_s": ASSUMED_LATENCY_S + size * busbw_factor(op, ranks) / bus_bytes_per_s}
            for op in ("all_reduce", "all_gather", "reduce_scatter") for size in _SIZES]


def step_seconds(cell: CellSpec, rates: Rates, predicted: dict | None = None, work: dict | None = None,
                 nodes: int = 1) -> dict:
    """The cell's predicted step at ``rates`` (step_time.predict's entry) on ``nodes`` nodes,
    from its analytic prediction (``predicted``, computed here when not given) and ``work``
    where it has some beside it (predict/plan_work.py's stand-in)."""
    predicted = predicted if predicted is not None else analytic.predict(cell)
    return step_time.predict(cell, predicted, work or {"unavailable": "planned, not traced"}, rates.calibration,
                             rates.device_type, nodes)


def cell_seconds(cell: CellSpec, rates: Rates) -> float | None:
    """The cell's rough wall time at ``rates``, its steps and its start; None where the step
    has no prediction (a model the analytic predictor does not describe)."""
    step = step_seconds(cell, rates)
    return CELL_START_S + cell.steps * step["step_time_s"] if "step_time_s" in step else None
