"""Which parameters DeepSpeed ZeRO-3 holds gathered when its forward ends: its parameter
coordinator's rules (deepspeed/runtime/zero/partitioned_param_coordinator.py) replayed over
the model's modules, the number the analytic peak needs at the start of backward.

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
import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # a type only: importing it loads every model family and transformers
    from harness.models import ParamLayout


def gathered_at_end_of_forward(layout: ParamLayout, *, persistence_threshold: int, prefetch_bucket_size: int,
                               max_live_parameters: int, max_reuse_distance: int, recompute: bool,
                               held: frozenset[int] = frozenset()) -> int:
    """Elements of the non-persistent parameters gathered when the last module's forward has
    released what it releases, and of those it released whose gathered storage a view saved
    for backward still holds (``held``: ParamLayout.saved_as_views of the blocks that keep
    their activations). The coordinator no longer counts those as live, so they do not
    take from its budget."""
    numel = [math.prod(shape) for shape in layout.shapes]
    persistent = {i for i, n in enumerate(numel) if n <= persistence_threshold}
    forward = [params for _, params in layout.modules]
    order = forward + _backward(layout, recompute)
    queue = collections.deque((p, step) for step, params in enumerate(order) for p in sorted(set(params)))
    fetched_for: dict[int, float] = collections.defaultdict(lambda: -math.inf)
    available = set(persistent)  # gathered in the first step and never released
    live = retained = 0
    for step, params in enumerate(forward):
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
        released = {p for p in params if p not in persistent and fetched_for[p] <= step + 1}
        traversed = 0
        for later in order[step + 1:]:
            if traversed >= max_reuse_distance:
                break
            released -= set(later)
            traversed += sum(numel[p] for p in later)
        live -= sum(numel[p] for p in released & available)
        retained += sum(numel[p] for p in released & available & held)
        available -= released
    return live + retained


def _backward(layout: ParamLayout, recompute: bool) -> list[tuple[int, ...]]:
    """The modules' order in backward: the reverse of forward, each checkpointed block's
    forward run again (its recompute) before its own backward."""
    out: list[tuple[int, ...]] = []
    for index, (block, params) in reversed(list(enumerate(layout.modules))):
        is_last_of_block = block >= 0 and (index + 1 == len(layout.modules) or layout.modules[index + 1][0] != block)
        if recompute and is_last_of_block:
            out += [p for b, p in layout.modules if b == block]
        out.append(params)
    return out
