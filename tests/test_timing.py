"""The step clock (harness/measure/timing.py) on two real gloo ranks: every rank starts a
timed step together, so a rank held up between steps is not counted again in the other's
step."""

import json
import os
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from harness.measure import timing

WORK_S = 0.02  # each rank's own work in a step, before the step's collective
HELD_S = 0.3  # how long rank 0 is held up between steps, outside the clock


def _worker(rank: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    samples: list[float] = []
    for _ in range(4):
        with timing.timed(torch.device("cpu"), samples):
            time.sleep(WORK_S)
            dist.all_reduce(torch.ones(4))
        if rank == 0:
            time.sleep(HELD_S)  # the harness's bookkeeping, another process taking the core
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(samples, f)
    dist.destroy_process_group()


def test_a_rank_held_up_between_steps_is_not_counted_in_the_others_step(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_worker, args=(port, str(tmp_path)), nprocs=2)
    rank0, rank1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    # Without the barrier rank 1 would wait out rank 0's HELD_S at every step's all-reduce
    # after the first: its steps would read WORK_S + HELD_S.
    for samples in (rank0, rank1):
        assert all(WORK_S <= seconds < WORK_S + HELD_S / 2 for seconds in samples), samples
