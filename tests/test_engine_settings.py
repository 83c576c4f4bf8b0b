"""Each engine's bucket and wrapping settings reach the record's per-rank ``engine`` (README
"Engine settings"): the strategies' own prepare on gpt2-tiny in a one-rank gloo group. The
2-rank values (FairScale SDP's buckets, DeepSpeed's sizes) are checked in test_fairscale.py and
test_deepspeed.py."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

from harness import models, strategies
from harness.config import CellSpec, StrategySpec
from harness.distributed import DistEnv


@pytest.fixture
def env() -> Iterator[DistEnv]:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield DistEnv(rank=0, world_size=1, nnodes=1, device=torch.device("cpu"), backend="gloo")
    finally:
        dist.destroy_process_group()


def _engine(strategy: str, env: DistEnv, **options) -> dict:
    cell = CellSpec(model="gpt2-tiny", strategy=StrategySpec(name=strategy, **options))
    built = models.build(cell.model_spec, seed=0)
    return strategies.get(strategy).prepare(built.module, built.block_type, cell, env).engine_report()


def test_ddp_keeps_torchs_buckets_but_for_powersgd_on_gloo(env):
    assert _engine("ddp", env) == {"name": "torch_ddp", "bucket_cap_mb": 25.0, "first_bucket_smaller": True,
                                   "gradient_as_bucket_view": False}
    # The cell's own knobs, where it sets them.
    set_by_cell = _engine("ddp", env, bucket_cap_mb=0.5, gradient_as_bucket_view=True)
    assert set_by_cell == {"name": "torch_ddp", "bucket_cap_mb": 0.5, "first_bucket_smaller": False,
                           "gradient_as_bucket_view": True}  # 0.5 MiB: a whole number of bytes
    assert _engine("zero1", env)["bucket_cap_mb"] == 25.0  # ZeroRedundancyOptimizer over the same DDP
    # One bucket of the model's size: 134,912 fp32 elements are 0.51 MiB, rounded up, plus one.
    assert _engine("ddp", env, compression="powersgd") == {"name": "torch_ddp", "bucket_cap_mb": 2.0,
                                                           "first_bucket_smaller": False,
                                                           "gradient_as_bucket_view": False}


def test_fsdp_wraps_each_block_then_the_root(env):
    unit = "each GPT2Block, then the root"
    assert _engine("fsdp_full", env) == {"name": "fsdp2", "wrap_unit": unit, "units": 3,  # 2 blocks + root
                                         "prefetch": "implicit (the next unit)"}
    assert _engine("fsdp_full", env, prefetch=2)["prefetch"] == 2
    assert _engine("fsdp1_full", env) == {"name": "fsdp1", "wrap_unit": unit, "units": 3,
                                          "backward_prefetch": "BACKWARD_PRE", "forward_prefetch": False,
                                          "limit_all_gathers": True}
