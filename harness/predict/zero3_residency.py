"""Which parameters DeepSpeed ZeRO-3 holds gathered when its forward ends: its parameter
coordinator's rules (deepspeed/runtime/zero/partitioned_param_coordinator.py) replayed over
the model's modules, the number the analytic peak needs at the start of backward; carried
on into backward, the most it holds in the last block's backward.

Once the first step has recorded the module order (every step after it, the memory step
included), the coordinator, for each module in turn:
- gathers the module's parameters that are not available;
- takes the module's own entries off its queue of (parameter, step of use) in trace order,
  then prefetches: it takes further entries off the queue until it has started gathering
  ``prefetch_bucket_size`` elements or the live budget (``max_live_parameters`` less what is
  gathered) runs out; an entry whose parameter is already available costs nothing and marks
  the parameter as fetched for that later step;
- releases the module's parameters when it has run, except the persistent ones, those marked
  fetched for a later step, and those a module within ``max_reuse_distance`` elements of the
  trace ahead uses again (the backward's modules are in the trace too, so the last blocks'
  parameters stay gathered into backward).

On the tiny models the whole step is within the reuse distance, so nothing is released; on
llama-1b 1.01B of its 1.24B parameters stay, on llama3-8b 1.02B of its 8.03B (1,020,264,448,
what DeepSpeed's coordinator counts in the traced step). The module order is
registration order (a block's norms, persistent at 10·h elements, are the only modules out of
run order); with checkpointing each block's recompute runs its forward again in backward.
"""

from __future__ import annotations

import collections
import functools
import math
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:  # a type only: importing it loads every model family and transformers
    from harness.models import ParamLayout


class Gathered(NamedTuple):
    """Elements of the non-persistent parameters gathered at two moments of the step."""

    # When the last module's forward has released what it releases, with those it released
    # whose gathered storage a view saved for backward still holds (``held``:
    # ParamLayout.saved_as_views of the blocks that keep their activations): the coordinator
    # no longer counts those as live, so they do not take from its budget.
    end_of_forward: int
    # The most while the last block's backward runs, its recompute included. Where forward
    # kept most parameters gathered, the prefetch passes every one of them in the queue at no
    # cost (partitioned_param_coordinator.py, fetch_sub_module: an available parameter is
    # popped without being counted) and reaches the far end of backward within the last
    # block's: once the head's backward has released enough to put the count under
    # ``max_live_parameters``, it gathers the first blocks' parameters again, and then the
    # tied token table (released after the head's backward, beyond the reuse distance of the
    # embedding's), whole, for its count is checked before each parameter rather than after
    # (llama-1b on 8 ranks, checkpointed: 1,179,123,712 of its 1,235,746,816 non-persistent
    # elements in block 15's backward, 1,002,962,944 when forward ends. The trace's
    # coordinator counts 1,218,969,600 there: its modules without parameters of their own (a
    # block, its attention and MLP, the checkpoint wrapper) fetch and so prefetch too, which
    # this replay, over the modules with parameters, leaves out).
    last_block_backward: int


# A plan prices each configuration at several micro-batches, accumulations and offloads, which
# the coordinator's residency does not depend on: one replay each (llama3-8b's plan on 64 GPUs
# asked for 128 replays, 2 of them distinct).
@functools.lru_cache(maxsize=256)
def replay(layout: ParamLayout, *, persistence_threshold: int, prefetch_bucket_size: int, max_live_parameters: int,
           max_reuse_distance: int, recompute: bool, held: frozenset[int] = frozenset()) -> Gathered:
    """The coordinator's rules (module docstring) replayed over forward and backward."""
    numel = [math.prod(shape) for shape in layout.shapes]
    persistent = {i for i, n in enumerate(numel) if n <= persistence_threshold}
    forward = [params for _, params in layout.modules]
    backward = _backward(layout, recompute)
    order = forward + [params for _, params in backward]
    # Each step's parameters as a set and their elements, once: the reuse-distance walk below
    # reads them for every later step within the distance (at llama3-8b's size, hundreds).
    order_sets = [frozenset(params) for params in order]
    order_numel = [sum(numel[p] for p in params) for params in order]
    last_block = max((block for block, _ in layout.modules), default=-1)
    queue = collections.deque((p, step) for step, params in enumerate(order) for p in sorted(set(params)))
    fetched_for: dict[int, float] = collections.defaultdict(lambda: -math.inf)
    available = set(persistent)  # gathered in the first step and never released
    live = retained = end_of_forward = most_in_last_block = 0
    for step, params in enumerate(order):
        live += sum(numel[p] for p in set(params) - available)
        available |= set(params)
        own = {p for p in params if fetched_for[p] < step}
        taken: set[int] = set()
        while queue and len(taken) < len(own):
            p, used_at = queue.popleft()
            fetched_for[p] = used_at
            taken.add(p)
        prefetching: set[int] = set()
        budget, started = min(max_live_parameters - live, prefetch_bucket_size), 0
        while queue and started < budget:
            p, used_at = queue.popleft()
            fetched_for[p] = max(fetched_for[p], used_at)
            if p not in available and p not in prefetching:
                prefetching.add(p)
                started += numel[p]
        live += started
        available |= prefetching
        if step >= len(forward) and backward[step - len(forward)][0] == last_block >= 0:
            most_in_last_block = max(most_in_last_block, live + retained)
        released = {p for p in params if p not in persistent and fetched_for[p] <= step + 1}
        traversed = 0
        for later in range(step + 1, len(order)):
            if traversed >= max_reuse_distance or not released:
                break
            released -= order_sets[later]
            traversed += order_numel[later]
        live -= sum(numel[p] for p in released & available)
        if step < len(forward):
            retained += sum(numel[p] for p in released & available & held)
        available -= released
        if step == len(forward) - 1:
            end_of_forward = live + retained
    return Gathered(end_of_forward=end_of_forward, last_block_backward=most_in_last_block)


def _backward(layout: ParamLayout, recompute: bool) -> list[tuple[int, tuple[int, ...]]]:
    """The modules' order in backward, as (block, parameters): the reverse of forward, each
    checkpointed block's forward run again (its recompute) before its own backward."""
    out: list[tuple[int, tuple[int, ...]]] = []
    for index, (block, params) in reversed(list(enumerate(layout.modules))):
        is_last_of_block = block >= 0 and (index + 1 == len(layout.modules) or layout.modules[index + 1][0] != block)
        if recompute and is_last_of_block:
            out += [(b, p) for b, p in layout.modules if b == block]
        out.append((block, params))
    return out
