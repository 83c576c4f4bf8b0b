"""The convergence verdict of a cell that trains on real data (``CellSpec.data``): its final
held-out loss against the fp32 one-process run's, within the spread that the seed alone makes.

The equivalence gate (harness/equivalence.py) asks whether a strategy trains the same model
as the reference of its own precision; this asks what the precision (or loss scaling) does
to training, over hundreds of steps. For a cell C:

- the fp32 references are the ``single`` fp32 cells with C's model, data, steps, global batch,
  optimizer and clipping, one per seed of ``SEEDS`` (C's own seed among them);
- the tolerance is their spread: the largest minus the smallest final held-out loss of the
  seeds (initialisation and data order both follow the seed);
- C is ``within`` when its final held-out loss differs from the fp32 reference of its own seed
  by no more than that; ``worse`` or ``better`` beyond it; None when a reference is missing.

A run without all the seeds' references (a ``-k`` selection) gets no verdict for its cells.

What trains (``cell``): a byte-level GPT-2 (``MODEL``) on the standard library's source, or the
small BatchNorm convnet (``VISION_MODEL``) on scikit-learn's digits (harness/data.py): ``STEPS``
steps of a global batch of ``GLOBAL_BATCH`` (two epochs of the 1,600 training sequences, 2.2 of
the 1,440 training images), the held-out loss every ``EVAL_EVERY`` steps: the convergence
suite (harness/suites.py) and the claims that read it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from harness.config import REFERENCE, CellSpec, StrategySpec
from harness.suite_cell import suite_cell

SEEDS = (0, 1, 2)
MODEL = "gpt2-bytes"
VISION_MODEL = "convnet-digits"
DATA_OF = {MODEL: "stdlib_bytes", VISION_MODEL: "digits"}
STEPS = 200
EVAL_EVERY = 25
GLOBAL_BATCH = 16


def cell(strategy: str, world_size: int, seed: int = 0, model: str = MODEL, **options: Any) -> CellSpec:
    """A convergence cell of ``model`` on ``world_size`` ranks (the reference takes the whole
    batch; ``accumulation`` cuts each rank's share into micro-steps)."""
    accumulation = options.get("accumulation", 1)
    if GLOBAL_BATCH % (world_size * accumulation):
        raise ValueError(f"the convergence cells' global batch of {GLOBAL_BATCH} does not split over {world_size}"
                         f" ranks × {accumulation} micro-steps")
    return suite_cell(model, StrategySpec(name=strategy, **options), world_size,
                      micro_batch=GLOBAL_BATCH // (world_size * accumulation), steps=STEPS, seed=seed,
                      data=DATA_OF[model], eval_every=EVAL_EVERY)


def final_held_out_loss(record: dict | None) -> float | None:
    """The held-out loss after the last step, where the record has one."""
    if not record or record.get("status") != "ok":
        return None
    points = (record.get("evaluation") or {}).get("held_out_loss") or []
    return points[-1][1] if points else None


def fp32_reference(cell: CellSpec, seed: int) -> CellSpec:
    """The one-process fp32 run of ``cell``'s training, with ``seed``."""
    s = cell.strategy
    return dataclasses.replace(
        cell.reference(), seed=seed,
        strategy=StrategySpec(name=REFERENCE, optimizer=s.optimizer, clip_grad_norm=s.clip_grad_norm))


def verdict(cell: CellSpec, record_of: Callable[[CellSpec], dict | None]) -> dict[str, Any] | None:
    """``cell``'s verdict (module docstring), or None for a cell without real data."""
    if cell.data == "synthetic":
        return None
    seeds = sorted({*SEEDS, cell.seed})
    references = {seed: final_held_out_loss(record_of(fp32_reference(cell, seed))) for seed in seeds}
    mine = final_held_out_loss(record_of(cell))
    base = {"final_held_out_loss": mine, "fp32_reference_cell_id": fp32_reference(cell, cell.seed).cell_id,
            "fp32_by_seed": references}
    measured = [loss for loss in references.values() if loss is not None]
    if mine is None or len(measured) < len(seeds):
        missing = [seed for seed, loss in references.items() if loss is None]
        why = "the cell has no held-out loss" if mine is None else f"no fp32 reference for seed(s) {missing}"
        return {**base, "tolerance": None, "difference": None, "verdict": None, "reason": why}
    tolerance = max(measured) - min(measured)
    own_seed = measured[seeds.index(cell.seed)]
    difference = mine - own_seed
    judged = "within" if abs(difference) <= tolerance else ("worse" if difference > 0 else "better")
    return {**base, "tolerance": tolerance, "difference": difference, "verdict": judged,
            "reason": (f"final held-out loss {mine:.4f} against fp32's {own_seed:.4f}"
                       f" ({difference:+.4f}; the {len(seeds)} fp32 seeds span {tolerance:.4f})")}
