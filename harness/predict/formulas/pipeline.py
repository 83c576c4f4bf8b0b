"""Pipeline parallelism: bubble, activations in flight, stage-to-stage transfers (GPipe,
Huang et al. 2019; 1F1B and interleaved 1F1B, Narayanan et al. 2021)."""

from __future__ import annotations

from typing import NamedTuple

PIPELINE_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")


def pipeline_bubble_fraction(stages: int, microbatches: int, virtual_stages: int = 1) -> float:
    """The share of a pipeline step each rank idles, (p−1)/(v·m + p−1).

    GPipe (Huang et al. 2019) and 1F1B (PipeDream-Flush; Narayanan et al. 2021, §2.2.1) idle
    (p−1)·(t_f + t_b) in a step of m·(t_f + t_b) work: bubble ÷ ideal = (p−1)/m, a fraction
    (p−1)/(m+p−1) of the step. The interleaved schedule with v model chunks per rank
    (Narayanan et al. 2021, §2.2.2) divides the bubble by v: (p−1)/(v·m) of the ideal time,
    (p−1)/(v·m + p−1) of the step."""
    if min(stages, microbatches, virtual_stages) < 1:
        raise ValueError(f"stages={stages}, microbatches={microbatches}, virtual_stages={virtual_stages}:"
                         " each must be at least 1")
    return (stages - 1) / (virtual_stages * microbatches + stages - 1)


def pipeline_first_stage_layer_activations(schedule: str, layers: int, stages: int, microbatches: int,
                                           virtual_stages: int = 1) -> float:
    """Activations the first stage holds at its peak, in units of one layer's activations for
    one micro-batch (multiply by ``activation_bytes_per_layer``).

    - gpipe: every micro-batch's forward runs before any backward: m·L/p (Huang et al. 2019);
    - 1f1b: at most p micro-batches in flight on the first stage: min(p, m)·L/p, i.e. L layers'
      worth whatever p (Narayanan et al. 2021 §2.2.1; Korthikanti et al. 2022 §4.2.3);
    - interleaved_1f1b: Megatron's schedule runs (p−1)·2 + (v−1)·p warm-up chunk forwards on
      rank 0, and one more in steady state, each chunk L/(p·v) layers: with m ≥ p that is
      L·(1 + (p−1)/(p·v)), Korthikanti et al. 2022 §4.2.3's interleaving factor."""
    if schedule not in PIPELINE_SCHEDULES:
        raise ValueError(f"schedule={schedule!r}: choose one of {', '.join(PIPELINE_SCHEDULES)}")
    p, m, v = stages, microbatches, virtual_stages
    if schedule == "gpipe":
        return m * layers / p
    if schedule == "1f1b":
        return min(p, m) * layers / p
    in_flight_chunks = min(2 * (p - 1) + (v - 1) * p + 1, m * v)
    return in_flight_chunks * layers / (p * v)


def pipeline_p2p_bytes(batch: int, seq: int, hidden: int, microbatches: int, *, neighbours: int,
                       value_bytes: float = 4) -> float:
    """Bytes a stage sends (and as many it receives) per step: each micro-batch's b·s·h
    activation forward and its gradient backward, over each of its ``neighbours`` (1 for the
    first and last stage, 2 between) (Huang et al. 2019; Narayanan et al. 2021 §3)."""
    return microbatches * batch * seq * hidden * value_bytes * neighbours


class PipelinePeak(NamedTuple):
    """A rank's highest moment along its schedule (``pipeline_peak``), in bytes."""

    activations: float  # the micro-batches in flight then, each stage's bytes for one
    recompute: float  # a checkpointed block made again beside them
    loss: float  # the loss's gradients
    grads: float  # the gradients that exist then


def pipeline_peak(order: list[tuple[int, bool]], bytes_per_microbatch: dict[int, float], *,
                  grads: dict[int, float] | None = None, loss_stage: int | None = None, loss: float = 0.0,
                  head: float = 0.0, head_grads: float = 0.0,
                  recompute: dict[int, float] | None = None) -> PipelinePeak:
    """The moment a rank holds most while running ``order`` ((stage, forward) actions), the
    largest sum of its fields:

    - a forward on a stage keeps that micro-batch's activations (``bytes_per_microbatch``)
      until its backward frees them: the micro-batches in flight of Narayanan et al. 2021,
      §2.2, counted along any order;
    - a stage's gradients (``grads[stage]``) exist from its first backward on, since zero_grad
      leaves none between steps: GPipe's peak, every micro-batch in flight, comes before any;
    - a backward of ``loss_stage`` starts by holding the loss's gradients (``loss``) beside its
      micro-batch's activations; once its head's backward is done, that micro-batch's ``head``
      bytes and the loss's gradients are freed and the head's own gradients (``head_grads``)
      made, and a stage with checkpointed blocks recomputes its last block
      (``recompute[stage]`` bytes) beside what is left."""
    in_flight = dict.fromkeys(bytes_per_microbatch, 0)
    stage_grads, recomputed = grads or {}, recompute or {}
    backward_run: set[int] = set()

    def existing(*, head_made: bool = False) -> float:
        return sum(stage_grads.get(s, 0.0) for s in backward_run) + (head_grads if head_made else 0.0)

    peak = PipelinePeak(0.0, 0.0, 0.0, 0.0)
    for stage, forward in order:
        if forward:
            in_flight[stage] += 1
        kept = sum(count * bytes_per_microbatch[s] for s, count in in_flight.items())
        if forward:
            moments = [PipelinePeak(kept, 0.0, 0.0, existing())]
        else:  # its start, then its head done and its last block recomputed; then it frees its micro-batch
            last = stage == loss_stage
            moments = [PipelinePeak(kept, 0.0, loss if last else 0.0, existing()),
                       PipelinePeak(kept - (head if last else 0.0), recomputed.get(stage, 0.0), 0.0,
                                    existing(head_made=last and stage not in backward_run))]
            in_flight[stage] -= 1
            backward_run.add(stage)
        peak = max(peak, *moments, key=sum)
    return peak
