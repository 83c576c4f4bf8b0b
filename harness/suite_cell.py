"""How a suite lists a cell: ``world_size`` ranks of ``micro_batch`` samples each, and the
one-process strategies (the reference ``single``, ``dataparallel``) taking the whole global
batch. The built-in suites
(harness/suites.py), suite files (harness/suite_files.py) and the claims (harness/claims/)
all list their cells through it, so each of them reaches the same cell ids."""

from __future__ import annotations

from harness import strategies
from harness.config import CellSpec, StrategySpec
from harness.models.presets import PLANNING_ONLY
from harness.models.spec import ModelSpec

MICRO_BATCH = 2


def suite_cell(model: str | ModelSpec, strategy: StrategySpec, world_size: int, micro_batch: int = MICRO_BATCH,
               **cell_options) -> CellSpec:
    """A cell as a suite lists it: ``world_size`` ranks of ``micro_batch`` samples each."""
    if isinstance(model, str) and model in PLANNING_ONLY:
        raise ValueError(f"model={model!r}: planning only ({PLANNING_ONLY[model]}); `python -m harness plan --model"
                         f" {model} ...` predicts it, `python -m harness list models` shows the models a cell takes")
    if strategies.get(strategy.name).capabilities.max_world_size == 1:
        # One process takes the whole global batch: the reference (listed in a suite, it is the
        # very cell the distributed cells are gated against) and DataParallel, beside it.
        micro_batch, world_size = micro_batch * world_size, 1
    return CellSpec(model=model, strategy=strategy, micro_batch=micro_batch, world_size=world_size, **cell_options)
