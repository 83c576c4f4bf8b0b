"""The run page's selection guide: which configuration to take for a memory budget, from the
measurements (seed course A, chapter 29: choosing among the techniques).

Per model and world size, the configurations on the memory/throughput Pareto front (no
other cell of that model and world size holds less memory per rank *and* moves more tokens
a second), taken from ``ok`` cells that train the reference's model (the equivalence gate
passed, or the reference itself): a cell that fails the gate is never recommended. Each
front cell is a guide row, "with at most X per rank, take Y (Z tokens/s)": the fastest cell
whose peak fits X.

For the real-size presets (models.REAL_SIZE_PRESETS) ``plan``'s answer to the same question
stands beside each row: its recommendation for that model, world size, micro-batch,
sequence length, precision and optimizer with X usable per GPU (harness/predict/plan.py;
its step times are a GPU's datasheet rates, so its choice is what to compare, not its
tokens/s).
"""

from __future__ import annotations

import pandas as pd

from harness import models
from harness.config import CellSpec
from harness.predict import fit, plan
from harness.report.figures import MIB, pareto_front


def _trains_the_reference_model(record: dict) -> bool:
    eq = record.get("equivalence")
    return eq is None or bool(eq.get("passed"))


def _budget(n_bytes: float) -> str:
    return f"{n_bytes / 2**30:.2f} GiB" if n_bytes >= 2**30 else f"{n_bytes / MIB:.1f} MiB"


def _plan_choice(record: dict, budget_bytes: float) -> dict:
    """plan's recommendation for the record's model and sizes with ``budget_bytes`` usable."""
    cell = CellSpec.from_dict(record["cell"])
    s = cell.strategy
    request = plan.PlanRequest(model=cell.model_spec, gpus=cell.world_size,
                               gpu_mem_bytes=budget_bytes / fit.USABLE_FRACTION, micro_batch=cell.micro_batch,
                               seq=cell.seq_len, precision=s.precision, optimizer=s.optimizer)
    result = plan.plan(request)
    best = result["recommended"]
    if best is None:  # say how far off plan's smallest configuration is
        least = min(result["rows"], key=lambda row: row["predicted"]["peak_bytes"])
        return {"config": f"nothing fits; the least: {plan.config_label(least['cell'])}",
                "peak": _budget(least["predicted"]["peak_bytes"])}
    return {"config": plan.config_label(best["cell"]), "peak": _budget(best["predicted"]["peak_bytes"])}


def selection_guide(records: list[dict]) -> list[dict]:
    """[{model, world_size, rows: [{budget, cell_id, label, tokens_per_s, peak, plan}]}] per
    model and world size with a measured front, rows by growing budget."""
    rows = [{"cell_id": r["cell_id"], "model": (r.get("model") or {}).get("name") or "?",
             "world_size": r.get("world_size"), "peak_mib": r["metrics"]["peak_mem_bytes"] / MIB,
             "tokens_per_s": r["metrics"].get("tokens_per_s"), "record": r}
            for r in records
            if r.get("status") == "ok" and (r.get("metrics") or {}).get("peak_mem_bytes")
            and _trains_the_reference_model(r)]
    if not rows:
        return []
    df = pd.DataFrame(rows)
    guide = []
    for (model, _), group in sorted(df.groupby(["model", "world_size"]), key=lambda kv: str(kv[0])):
        front = pareto_front(group)
        if front.empty:
            continue
        real = model in models.REAL_SIZE_PRESETS
        guide.append({"model": model, "world_size": group["world_size"].iloc[0], "real_size": real, "rows": [{
            "budget": _budget(row["peak_mib"] * MIB), "cell_id": row["cell_id"],
            "label": row["cell_id"].removeprefix(f"{model}/"), "tokens_per_s": f"{row['tokens_per_s']:,.0f}",
            "plan": _plan_choice(row["record"], row["peak_mib"] * MIB) if real else None,
        } for _, row in front.iterrows()]})
    return guide
