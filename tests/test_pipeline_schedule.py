"""A pipeline step played out on a timeline (harness/predict/pipeline_schedule.py): torch's
orders, the papers' bubble without hops, and the hops its critical path exposes."""

import pytest

from harness.predict import formulas, pipeline_schedule
from harness.predict.pipeline_schedule import Action

FORWARD_S, BACKWARD_S = 1.0, 2.0


def _grid():
    for ranks in (2, 3, 4, 8):
        for schedule, virtual in (("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("interleaved_1f1b", 3)):
            counts = (ranks, 2 * ranks, 4 * ranks) if virtual > 1 else (1, 2, 3, ranks, 4 * ranks)
            for microbatches in counts:
                yield schedule, ranks, microbatches, virtual


@pytest.mark.parametrize("schedule, ranks, microbatches, virtual", list(_grid()))
def test_without_hops_the_idle_time_is_the_papers_bubble(schedule, ranks, microbatches, virtual):
    step = pipeline_schedule.step_seconds(schedule, microbatches, virtual,
                                          [(FORWARD_S / virtual, BACKWARD_S / virtual)] * ranks, hop_s=0.0)
    ideal = microbatches * (FORWARD_S + BACKWARD_S)
    bubble = formulas.pipeline_bubble_fraction(ranks, microbatches, virtual)
    assert step == pytest.approx(ideal / (1 - bubble))


@pytest.mark.parametrize("schedule, ranks, microbatches, virtual", list(_grid()))
def test_every_rank_runs_each_of_its_stages_micro_batches_once_each_way(schedule, ranks, microbatches, virtual):
    for rank, order in enumerate(pipeline_schedule.rank_orders(schedule, ranks, microbatches, virtual)):
        stages = range(rank, ranks * virtual, ranks)
        assert sorted(order) == sorted(Action(direction, stage, k) for direction in ("backward", "forward")
                                       for stage in stages for k in range(microbatches))
        assert all(order.index(Action("forward", a.stage, a.microbatch)) < i
                   for i, a in enumerate(order) if a.direction == "backward")


def test_1f1b_warms_up_with_a_forward_per_stage_after_it_then_alternates():
    # torch's Schedule1F1B: min(m, p − rank) forwards first.
    first, last = pipeline_schedule.rank_orders("1f1b", ranks=2, microbatches=4)
    assert [(a.direction[0], a.microbatch) for a in first] == [
        ("f", 0), ("f", 1), ("b", 0), ("f", 2), ("b", 1), ("f", 3), ("b", 2), ("b", 3)]
    assert [(a.direction[0], a.microbatch) for a in last] == [
        ("f", 0), ("b", 0), ("f", 1), ("b", 1), ("f", 2), ("b", 2), ("f", 3), ("b", 3)]


@pytest.mark.parametrize("ranks, microbatches", [(2, 4), (4, 8), (8, 16)])
def test_gpipe_exposes_one_hop_per_boundary_each_way(ranks, microbatches):
    # Hops shorter than a forward: the first micro-batch's hand-overs lie on the critical
    # path, every later one is covered by the next micro-batch's work.
    hop = 0.1
    timed, idle = (pipeline_schedule.step_seconds("gpipe", microbatches, 1, [(FORWARD_S, BACKWARD_S)] * ranks, h)
                   for h in (hop, 0.0))
    assert timed - idle == pytest.approx(2 * (ranks - 1) * hop)


def test_1f1b_exposes_more_hops_than_gpipe_its_steady_state_waits_on_its_neighbours():
    hop, steps = 0.1, {}
    for schedule in ("gpipe", "1f1b"):
        timed, idle = (pipeline_schedule.step_seconds(schedule, 8, 1, [(FORWARD_S, BACKWARD_S)] * 2, h)
                       for h in (hop, 0.0))
        steps[schedule] = (timed - idle) / hop
    assert steps == pytest.approx({"gpipe": 2, "1f1b": 8})


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_a_slower_last_stage_sets_the_pace(schedule):
    # The last stage (the LM head and the loss) three times rank 0's: after the first
    # micro-batch reaches it, it works without pause, and rank 0's first forward and last
    # backward bracket its m micro-batches.
    microbatches, slow = 4, 3.0
    step = pipeline_schedule.step_seconds(schedule, microbatches, 1,
                                          [(FORWARD_S, BACKWARD_S), (slow * FORWARD_S, slow * BACKWARD_S)], 0.0)
    assert step == pytest.approx(FORWARD_S + microbatches * slow * (FORWARD_S + BACKWARD_S) + BACKWARD_S)


def test_a_schedule_it_does_not_know_or_stages_it_cannot_run_are_refused():
    with pytest.raises(ValueError, match="zero_bubble"):
        pipeline_schedule.rank_orders("zero_bubble", 2, 4)
    with pytest.raises(ValueError, match="only the interleaved"):
        pipeline_schedule.rank_orders("1f1b", 2, 4, virtual_stages=2)
