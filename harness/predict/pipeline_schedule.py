"""A pipeline step played out on a timeline: each rank runs its forwards and backwards in its
schedule's order, each waiting for its inputs (the previous stage's activations, the next
stage's gradients), and a hand-over between ranks takes one hop's time. The step is the
last rank's finish. The step-time predictor (predict/step_time.py) prices pipelines this way.

The orders are torch.distributed.pipelining's (the schedules the cells run,
strategies/pipeline.py), per rank r of p, m micro-batches, v stages a rank (stage s on rank
s mod p); the first two are loops in torch's code, written out here:
- gpipe (ScheduleGPipe): every forward, then every backward, in micro-batch order;
- 1f1b (Schedule1F1B): min(m, p − r) forwards, then a backward and a forward in turn until
  the forwards run out, then the remaining backwards;
- interleaved_1f1b (ScheduleInterleaved1F1B, Narayanan et al. 2021 §2.2.2): the schedule's
  own plan (``interleaved_1f1b_order``): micro-batches in rounds of p, forwards walking each
  round through the rank's stages in order and backwards in reverse, a warm-up of
  (v − 1)·p + 2·(p − 1 − r) forwards, then a forward and a backward in turn.

With no hop time the timeline's idle time is the papers' bubble, (p − 1)/m of the ideal step
for gpipe and 1f1b and (p − 1)/(v·m) interleaved (tests/test_pipeline_schedule.py checks it
over a grid). What it adds to the formula is the hand-overs: a hop on the critical path
delays the step, one that another micro-batch's work covers does not (gpipe exposes 2(p − 1)
of them; 1f1b, whose steady state waits on its neighbours' last action, more: on two ranks
one a micro-batch).

Not modelled: a rank's stages of unequal cost (each rank's actions cost alike), a send held
until its receiver is ready, and hand-overs that share a link.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Sequence
from typing import Literal, NamedTuple, cast

from harness.predict.formulas.pipeline import PIPELINE_SCHEDULES


class Action(NamedTuple):
    direction: Literal["forward", "backward"]
    stage: int
    microbatch: int


def rank_orders(schedule: str, ranks: int, microbatches: int, virtual_stages: int = 1) -> list[list[Action]]:
    """Each rank's actions in the order its schedule runs them (module docstring)."""
    return [rank_order(schedule, rank, ranks, microbatches, virtual_stages) for rank in range(ranks)]


def rank_order(schedule: str, rank: int, p: int, m: int, v: int = 1) -> list[Action]:
    """Rank ``rank`` of ``p``'s actions in one step, in order (module docstring)."""
    if schedule not in PIPELINE_SCHEDULES:
        raise ValueError(f"schedule={schedule!r}: choose one of {', '.join(PIPELINE_SCHEDULES)}")
    if (schedule == "interleaved_1f1b") != (v > 1):
        raise ValueError(f"schedule={schedule!r} with virtual_stages={v}: only the interleaved"
                         " schedule runs more than one stage a rank")
    if schedule == "gpipe":
        return ([Action("forward", rank, k) for k in range(m)]
                + [Action("backward", rank, k) for k in range(m)])
    if schedule == "1f1b":
        warmup = min(m, p - rank)
        order = [Action("forward", rank, k) for k in range(warmup)]
        for k in range(m):
            order.append(Action("backward", rank, k))
            if warmup + k < m:
                order.append(Action("forward", rank, warmup + k))
        return order
    return interleaved_1f1b_order(rank, p, m, v)


def interleaved_1f1b_order(rank: int, ranks: int, microbatches: int, virtual_stages: int) -> list[Action]:
    """The actions ``rank`` runs in one step of torch's ScheduleInterleaved1F1B, in order: the
    schedule's own plan (``_calculate_single_rank_operations``, which reads only these four
    sizes), not a copy of it. Its rounds (``max(1, m // p)``) make its warm-up differ from
    Megatron's when p does not divide m."""
    from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B, _ComputationType

    rounds = max(1, microbatches // ranks)  # as ScheduleInterleaved1F1B.__init__ sets them
    sizes = types.SimpleNamespace(n_local_stages=virtual_stages, pp_group_size=ranks, _n_microbatches=microbatches,
                                  microbatches_per_round=microbatches // rounds)
    # A stand-in for the schedule (self): the plan reads only these sizes of it.
    actions = ScheduleInterleaved1F1B._calculate_single_rank_operations(cast(ScheduleInterleaved1F1B, sizes), rank)
    # None: a slot the rank waits through; every computation names its micro-batch.
    return [Action("forward" if a.computation_type == _ComputationType.FORWARD else "backward",
                   a.stage_index, a.microbatch_index)
            for a in actions if a is not None and a.microbatch_index is not None]


def step_seconds(schedule: str, microbatches: int, virtual_stages: int,
                 action_s: Sequence[tuple[float, float]], hop_s: float | Callable[[int, int], float]) -> float:
    """When the last rank finishes its last action. ``action_s``: per rank, what one forward
    and one backward of one of its stages on one micro-batch take; a hand-over between ranks
    takes ``hop_s``, or ``hop_s(sender, receiver)`` where the links differ (a boundary
    between nodes)."""
    hop = hop_s if callable(hop_s) else lambda sender, receiver: hop_s
    ranks = len(action_s)
    orders = rank_orders(schedule, ranks, microbatches, virtual_stages)
    last_stage = ranks * virtual_stages - 1
    finished: dict[Action, float] = {}
    free = [0.0] * ranks
    position = [0] * ranks
    while any(position[r] < len(orders[r]) for r in range(ranks)):
        progressed = False
        for rank, order in enumerate(orders):
            forward_s, backward_s = action_s[rank]
            while position[rank] < len(order):
                action = order[position[rank]]
                inputs = _inputs(action, last_stage)
                if any(needed not in finished for needed in inputs):
                    break  # waits for another rank's action
                ready = [finished[needed] + (hop(needed.stage % ranks, rank) if needed.stage % ranks != rank else 0.0)
                         for needed in inputs]
                start = max([free[rank], *ready])
                free[rank] = finished[action] = start + (forward_s if action.direction == "forward" else backward_s)
                position[rank] += 1
                progressed = True
        if not progressed:
            raise RuntimeError(f"{schedule} on {ranks} ranks, {microbatches} micro-batches: the orders deadlock")
    return max(free)


def _inputs(action: Action, last_stage: int) -> list[Action]:
    """The actions whose outputs this one consumes."""
    if action.direction == "forward":
        return [Action("forward", action.stage - 1, action.microbatch)] if action.stage else []
    own_forward = Action("forward", action.stage, action.microbatch)
    if action.stage == last_stage:
        return [own_forward]
    return [own_forward, Action("backward", action.stage + 1, action.microbatch)]
