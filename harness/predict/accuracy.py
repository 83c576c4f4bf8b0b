"""Predicted beside measured: the ``predicted`` entry of a cell record and its ratios.

The comparisons, each predicted ÷ measured, and the targets they are held to:

- ``traced_peak``: the traced step peak (harness/predict/traced.py) against the measured
  peak per rank (metrics.peak_mem_bytes, the max over ranks): ±10 %.
- ``analytic_peak``: the analytic whole peak (what ``plan`` and the fit check decide by)
  against the same measured peak: ±10 %.
- ``analytic_model_states``: the analytic model states (params + grads + optimizer + the
  engine's gradient buffers, harness/predict/analytic.py) against everything a rank held
  when its optimizer step began (metrics.at_optimizer_step_bytes: activations are freed by
  then, so what remains is model state and the engine's buffers): ±10 %.
- ``analytic_activations``: the analytic activations of one micro-batch (the layers', the
  head's and the logits, with autocast's weight copies: what the start of backward holds)
  against the activations held at the measured peak (metrics.mem_breakdown_bytes), where
  that peak is the start of backward: activations held and no gradient yet, which the
  trackers show only for engines whose gradients are torch's own ``.grad``, made in
  backward (the reference, DDP, torch ZeRO-1, FairScale OSS, tensor parallel; no
  accumulation). FSDP and DeepSpeed keep gradients where the trackers label them "other"
  or not at all, so their peak's moment cannot be read from the breakdown; they, and a
  cell whose peak falls elsewhere (the optimizer step, a checkpointed block's recompute),
  have no activation ratio: ±10 %.
- ``analytic_comm``: the analytic bytes per step against the counted bytes
  (metrics.comm_bytes_per_step): ±10 %.
- ``step_time``: the predicted step time (harness/predict/step_time.py) against the measured
  median (metrics.step_time_s): a cell within ±50 %, and over a run the median cell within
  ±20 % (``STEP_TIME_MEDIAN_TOLERANCE``) with 90 % of cells within ±50 %.

A ratio outside its target names the category (or collective) that is furthest off, so a
reader sees where the model and the measurement part ways. The known reasons are listed in
README "Predicted beside measured".
"""

from __future__ import annotations

import statistics

from harness import strategies
from harness.config import CellSpec
from harness.predict import analytic, step_time
from harness.results import trials

TOLERANCE = 0.10
STEP_TIME_TOLERANCE = 0.50
STEP_TIME_MEDIAN_TOLERANCE = 0.20
STEP_TIME_SHARE = 0.90  # of cells within STEP_TIME_TOLERANCE
TARGETS = ("traced_peak", "analytic_peak", "analytic_model_states", "analytic_activations", "analytic_comm",
           "step_time")


def tolerance(target: str) -> float:
    return STEP_TIME_TOLERANCE if target == "step_time" else TOLERANCE


def prediction(cell: CellSpec, traced: dict | None, device_type: str, calibration: dict | None,
               nodes: int = 1) -> dict:
    """The record's ``predicted`` entry before any measurement: both memory predictors, the
    analytic one for the ranks' ``device_type``, and the step time priced at the run's
    ``calibration`` (run.json's ``environment.bandwidth``, which holds the compute rates too)
    for the cell's ranks on ``nodes`` nodes."""
    analytic = _analytic(cell, device_type)
    traced = traced if traced is not None else {"unavailable": "not traced in this run"}
    try:
        step = step_time.predict(cell, analytic, traced, calibration, device_type, nodes)
    except Exception as error:  # as for the analytic model: the record must still be written
        step = {"unavailable": f"the step-time model failed: {type(error).__name__}: {error}"}
    return {"analytic": analytic, "traced": traced, "step_time": step, "step_time_s": step.get("step_time_s")}


def _analytic(cell: CellSpec, device_type: str) -> dict:
    """The analytic prediction; one that raises is recorded as unavailable, with the error,
    because the measured record it belongs to must still be written."""
    try:
        return analytic.predict(cell, device_type=device_type)
    except Exception as error:  # any bug in a formula, for any cell
        return {"unavailable": f"the analytic model failed: {type(error).__name__}: {error}"}


def _furthest(predicted: dict[str, float], measured: dict[str, float]) -> str:
    keys = set(predicted) | set(measured)
    key = max(keys, key=lambda k: abs(predicted.get(k, 0) - measured.get(k, 0)))
    return f"{key}: predicted {predicted.get(key, 0):,.0f} B, measured {measured.get(key, 0):,.0f} B"


def _comparison(predicted_total: float, measured_total: float | None, predicted: dict, measured: dict) -> dict | None:
    if measured_total is None:
        return None
    if measured_total == 0:
        ratio = 1.0 if predicted_total == 0 else None
    else:
        ratio = predicted_total / measured_total
    within = ratio is not None and abs(ratio - 1) <= TOLERANCE
    return {"ratio": ratio, "within_target": within,
            "off": None if within else _furthest(predicted, measured)}


def _step_time_comparison(step: dict, metrics: dict) -> dict | None:
    """Predicted ÷ measured step time; where off, the predicted parts beside the measured
    communication time (metrics.comm_time_s_per_step, the profiled comm step's)."""
    measured = metrics.get("step_time_s")
    if "step_time_s" not in step or not measured:
        return None
    ratio = step["step_time_s"] / measured
    within = abs(ratio - 1) <= STEP_TIME_TOLERANCE
    off = None if within else (
        f"predicted {step['step_time_s'] * 1e3:.1f} ms (compute {step['compute_s'] * 1e3:.1f}, exposed comm"
        f" {step['exposed_comm_s'] * 1e3:.1f}, work {step['work']}), measured {measured * 1e3:.1f} ms"
        f" (comm {metrics.get('comm_time_s_per_step', 0) * 1e3:.1f})")
    return {"ratio": ratio, "within_target": within, "off": off}


def compare(predicted: dict, metrics: dict, cell: CellSpec) -> dict:
    """Ratios of a measured cell: {target: {ratio, within_target, off} | None}.

    None where a side is missing (no trace for this strategy, no analytic model for it
    (``{"unavailable": reason}``), no state snapshot)."""
    a, traced = predicted["analytic"], predicted["traced"]
    out: dict[str, dict | None] = dict.fromkeys(TARGETS)
    out["step_time"] = _step_time_comparison(predicted.get("step_time") or {}, metrics)
    if "peak_bytes" in traced:
        out["traced_peak"] = _comparison(traced["peak_bytes"], metrics["peak_mem_bytes"],
                                         traced["breakdown_bytes"], metrics["mem_breakdown_bytes"])
    if "unavailable" in a:
        return out
    out["analytic_peak"] = _comparison(a["peak_bytes"], metrics["peak_mem_bytes"],
                                       a["peak_breakdown_bytes"], metrics["mem_breakdown_bytes"])
    held = metrics.get("at_optimizer_step_bytes")
    if held:
        states = a["model_states_bytes"]
        # What is held beyond params, grads and optimizer state is the engines' buffers.
        measured = {k: held[k] for k in ("params", "grads", "optimizer")}
        measured["buffers"] = held["other"] + held["activations"]
        out["analytic_model_states"] = _comparison(a["model_state_bytes"], sum(held.values()), states, measured)
    at_peak = metrics["mem_breakdown_bytes"]
    if at_peak.get("activations") and not at_peak.get("grads") and _gradients_are_torchs(cell):
        kept = start_of_backward_activations(a)
        out["analytic_activations"] = _comparison(kept, at_peak["activations"], {"activations": kept},
                                                  {"activations": at_peak["activations"]})
    counted = {op: v["bytes"] for op, v in metrics["comm_by_op"].items()}
    # Calls counted without their bytes (measure/comm.py "unsized") leave nothing to compare.
    unsized = any(v.get("unsized") for v in metrics["comm_by_op"].values())
    out["analytic_comm"] = None if unsized else _comparison(a["comm_bytes_per_step"], metrics["comm_bytes_per_step"],
                                                            a["comm_bytes_by_op"], counted)
    return out


def start_of_backward_activations(analytic: dict) -> float:
    """The analytic activations held at the start of backward: the layers', the head's and
    the logits, with autocast's weight copies (``analytic_activations``' prediction)."""
    acts = analytic["activation_bytes"]
    return acts["layers"] + acts["logits"] + analytic.get("transient_bytes", {}).get("autocast_copies", 0.0)


def _gradients_are_torchs(cell: CellSpec) -> bool:
    """Whether the cell's gradients are torch's own ``.grad``, none before backward (module
    docstring, ``analytic_activations``)."""
    engine = strategies.get(cell.strategy.name).engine_model
    return (engine.analytic in ("data_parallel", "tensor_parallel") and "grads" not in engine.sharded
            and not engine.fp32_master_partition and engine.grads_between_steps == "freed"
            and engine.comm != "reduce_to_owner" and cell.strategy.accumulation == 1)


def measured_value(target: str, metrics: dict) -> float | None:
    """What ``target``'s prediction is held against (module docstring), from a record's
    metrics: the predicted value is this times the stored ratio."""
    if target in ("traced_peak", "analytic_peak"):
        return metrics.get("peak_mem_bytes")
    if target == "analytic_model_states":
        held = metrics.get("at_optimizer_step_bytes")
        return float(sum(held.values())) if held else None
    if target == "analytic_activations":
        return (metrics.get("mem_breakdown_bytes") or {}).get("activations")
    if target == "analytic_comm":
        return metrics.get("comm_bytes_per_step")
    if target == "step_time":
        return metrics.get("step_time_s")
    raise ValueError(f"target={target!r}: choose one of {', '.join(TARGETS)}")


def measured_cells(records: list[dict]) -> list[dict]:
    """The cells of a run (load_records, every trial) that have ratios: ok, their shown
    trial's (harness/results/trials.py); a cell with a trial not ok is not measured."""
    return [r for r in trials.aggregate(records) if r["status"] == "ok" and (r.get("predicted") or {}).get("ratios")]


def summary(measured: list[dict]) -> list[dict]:
    """Per target over ``measured`` (measured_cells): {target, tolerance, compared: [(record,
    comparison)], missed, worst: (record, comparison) | None, median, met}. A target no cell
    was compared on is met (nothing missed it) with ``worst`` None."""
    out = []
    for t in TARGETS:
        compared = [(r, c) for r in measured if (c := r["predicted"]["ratios"].get(t)) and c["ratio"] is not None]
        missed = [(r, c) for r, c in compared if not c["within_target"]]
        median = statistics.median(c["ratio"] for _, c in compared) if compared else None
        met = not missed
        if t == "step_time" and compared:
            assert median is not None
            met = (abs(median - 1) <= STEP_TIME_MEDIAN_TOLERANCE
                   and len(compared) - len(missed) >= STEP_TIME_SHARE * len(compared))
        out.append({"target": t, "tolerance": tolerance(t), "compared": compared, "missed": missed,
                    "worst": max(compared, key=lambda rc: abs(rc[1]["ratio"] - 1)) if compared else None,
                    "median": median, "met": met})
    return out


def report(records: list[dict]) -> tuple[str, bool]:
    """Every measured cell's ratios, then per target the worst ratio and how many cells met
    it. Returns the text and whether every available ratio met its target. ``records``: a
    run's (load_records), every trial (``measured_cells``)."""
    measured = measured_cells(records)
    lines = [f"{'cell':<66} " + " ".join(f"{t:>22}" for t in TARGETS)]
    for r in measured:
        ratios = r["predicted"]["ratios"]
        shown = []
        for t in TARGETS:
            c = ratios.get(t)
            shown.append("-" if c is None or c["ratio"] is None
                         else f"{c['ratio']:.3f}{'' if c['within_target'] else ' MISS'}")
        lines.append(f"{r['cell_id']:<66} " + " ".join(f"{v:>22}" for v in shown))
    lines.append("")
    targets = summary(measured)
    for s in targets:
        t, compared, missed = s["target"], s["compared"], s["missed"]
        if not compared:
            lines.append(f"{t}: no cell compared")
            continue
        worst_record, worst = s["worst"]
        lines.append(f"{t}: {len(compared) - len(missed)} of {len(compared)} cells within ±{s['tolerance']:.0%};"
                     f" worst {worst['ratio']:.3f} ({worst_record['cell_id']})")
        if t == "step_time":
            lines.append(f"  median ratio {s['median']:.3f} (target ±{STEP_TIME_MEDIAN_TOLERANCE:.0%}), and"
                         f" {STEP_TIME_SHARE:.0%} of cells within ±{STEP_TIME_TOLERANCE:.0%}:"
                         f" {'met' if s['met'] else 'MISSED'}")
        for r, c in missed:
            lines.append(f"  MISS {r['cell_id']}: ratio {c['ratio']:.3f}; furthest off: {c['off']}")
    all_met = all(s["met"] for s in targets)
    for r in measured:
        if "unavailable" in r["predicted"]["analytic"]:
            lines.append(f"skipped (analytic) {r['cell_id']}: {r['predicted']['analytic']['unavailable']}")
    return "\n".join(lines), all_met
