"""Fault injection for the harness's own tests: make a named cell fail on purpose.

Below everything that honours a fault (the training step, a strategy), so none of them
imports the runner to learn what was asked.

Off unless ``SHARDBENCH_FAULT`` is set, as ``CELL_ID=FAULT[,CELL_ID=FAULT...]`` with FAULT:
- ``raise``: every rank raises before training (the cell is recorded ``failed``; the
  launch goes on with the next cell).
- ``crash``: the last rank exits at once with status 13, as a kill would end it (torchrun
  tears the launch down; the launcher records ``failed``, naming the rank, and relaunches
  the remaining cells).
- ``segfault``: the last rank dereferences a null pointer (SIGSEGV, as a native extension's
  bug would); the worker's faulthandler writes its Python stack first, which the record keeps.
- ``hang``: rank 0 sleeps forever, as in a collective that never completes (the launcher
  records ``timeout`` after --cell-timeout and kills every process of the launch).
- ``grads_set_to_none``: not an exception but a wrong computation: FairScale's
  ShardedDataParallel zeroes gradients the torch 2 default way (set to None), which it
  silently mishandles; the equivalence gate must fail the cell (tests/test_fairscale.py).
  Honoured by harness/strategies/fairscale.py; ignored by other strategies.
- ``leak``: every rank keeps a 1 MiB tensor (LEAK_BYTES_PER_STEP) from each timed step,
  as a leaking loop would; the record's memory_growth_bytes must show it (tests/test_gpu_path.py).
- ``hook_reference``: a forward hook on the model keeps every timed step's output (the
  logits and loss a hook holding a reference leaks); ``retained_graph``: every timed step's
  loss is kept with its graph retained (``backward(retain_graph=True)``), so each step's
  saved activations stay. Both must show in memory_growth_bytes, the second through the
  saved tensors of the graphs the live tensors hold (measure/memory.py) (tests/test_gpu_path.py).
- ``clip_before_unscale``: a wrong computation: an fp16 cell that clips its gradients while
  they are still multiplied by the loss scale, then unscales them (the order torch's AMP
  recipe warns against); the equivalence gate must fail the cell (tests/test_numerics.py).
  Honoured by harness/training.py where the cell clips.
- ``host_memory_low``: after the cell, the workers read the host's memory as short, as
  where earlier cells' memory was not handed back; they leave and the remaining cells run
  in a fresh launch (harness/runner/worker.py, ``host_memory_short``).
"""

from __future__ import annotations

import ctypes
import os
import time

from harness.distributed import DistEnv

ENV_VAR = "SHARDBENCH_FAULT"
GRADS_SET_TO_NONE = "grads_set_to_none"
LEAK = "leak"
HOST_MEMORY_LOW = "host_memory_low"
CLIP_BEFORE_UNSCALE = "clip_before_unscale"
HOOK_REFERENCE = "hook_reference"
RETAINED_GRAPH = "retained_graph"
FAULTS = ("raise", "crash", "segfault", "hang", GRADS_SET_TO_NONE, LEAK, HOST_MEMORY_LOW, CLIP_BEFORE_UNSCALE,
          HOOK_REFERENCE, RETAINED_GRAPH)
# What the "leak" fault keeps from every timed step.
LEAK_BYTES_PER_STEP = 2**20


class InjectedFault(RuntimeError):
    pass


def planned() -> dict[str, str]:
    spec = os.environ.get(ENV_VAR, "")
    plan = {}
    for item in filter(None, spec.split(",")):
        cell_id, _, fault = item.rpartition("=")
        if fault not in FAULTS or not cell_id:
            raise ValueError(f"{ENV_VAR}={spec!r}: expected CELL_ID=FAULT with FAULT in {', '.join(FAULTS)}")
        plan[cell_id] = fault
    return plan


def inject(cell_id: str, env: DistEnv) -> None:
    fault = planned().get(cell_id)
    if fault == "raise":
        raise InjectedFault(f"{ENV_VAR} asked cell {cell_id} to raise")
    if fault == "crash" and env.rank == env.world_size - 1:
        os._exit(13)
    if fault == "segfault" and env.rank == env.world_size - 1:
        ctypes.string_at(0)
    if fault == "hang" and env.rank == 0:
        while True:
            time.sleep(60)
