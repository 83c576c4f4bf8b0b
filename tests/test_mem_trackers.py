"""measure/mem_trackers.py: the quick per-module peak statistics give torch's own numbers."""

import pytest
import torch
from torch import nn
from torch.distributed._tools.mem_tracker import MemTracker

from harness.measure import mem_trackers


def _model() -> nn.Module:
    torch.manual_seed(0)
    block = lambda: nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32), nn.LayerNorm(32))  # noqa: E731
    return nn.Sequential(nn.Linear(16, 32), block(), block(), nn.Linear(32, 8))


def _tracked_step(tracker_class: type[MemTracker]) -> tuple[dict, dict]:
    """The step's peak snapshot and every module's per-state peak snapshots under a tracker."""
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters())
    for _ in range(2):  # the optimizer's state exists before the tracked step, as in a cell's
        model(torch.randn(4, 16)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    tracker = tracker_class()
    tracker.track_external(model, optimizer)
    with tracker:
        model(torch.randn(4, 16)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    names = {module: name for name, module in model.named_modules()}
    modules = {names[module]: {str(state): [{str(dev): dict(snap) for dev, snap in s.items()} for s in snaps]
                               for state, snaps in stats.snapshots.items()}
               for module, stats in tracker.memory_tracking.items()}
    peak = {str(dev): {str(key): value for key, value in snap.items()}
            for dev, snap in tracker.get_tracker_snapshot("peak").items()}
    return peak, modules


def test_the_quick_statistics_are_torchs_to_the_byte():
    if not mem_trackers.quick_peak_stats_in_use():
        pytest.skip(f"torch {torch.__version__}'s _update_peak_stats is not the one the quick copy reproduces")
    quick, _ = mem_trackers._tracker_classes()
    assert quick._update_peak_stats is not MemTracker._update_peak_stats
    ours, theirs = _tracked_step(quick), _tracked_step(MemTracker)
    assert ours == theirs
    peak, modules = ours
    assert peak["cpu"]["Total"] > 0 and len(modules) == 13  # the root, its 4 children, the blocks' 4 each
    assert any(snaps for states in modules.values() for snaps in states.values())


def test_the_pinned_torch_gets_the_quick_statistics():
    # The copy is of torch 2.13's method: a torch that changed it keeps its own (slower) one,
    # and this test says the copy needs another look.
    if not torch.__version__.startswith("2.13."):
        pytest.skip(f"the copy is of torch 2.13's method; this is {torch.__version__}")
    assert mem_trackers.quick_peak_stats_in_use()
    for tracker in mem_trackers._tracker_classes():
        assert tracker._update_peak_stats is not MemTracker._update_peak_stats


def test_a_torch_whose_method_differs_keeps_its_own(monkeypatch):
    monkeypatch.setattr(mem_trackers, "_QUICK_FOR", "another torch's")
    mem_trackers._tracker_classes.cache_clear()
    try:
        for tracker in mem_trackers._tracker_classes():
            assert tracker._update_peak_stats is MemTracker._update_peak_stats
    finally:
        mem_trackers._tracker_classes.cache_clear()
