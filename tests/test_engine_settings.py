"""Each engine's bucket and wrapping settings reach the record's per-rank ``engine`` (README
"Engine settings"): the strategies' own prepare on gpt2-tiny in a one-rank gloo group. The
2-rank values (FairScale SDP's buckets, DeepSpeed's sizes) are checked in test_fairscale.py and
test_deepspeed.py."""

from __future__ import annotations

import pytest
import torch

from harness import models, strategies, training
from harness.config import CellSpec, StrategySpec
from harness.distributed import DistEnv


def _engine(strategy: str, env: DistEnv, **options) -> dict:
    cell = CellSpec(model="gpt2-tiny", strategy=StrategySpec(name=strategy, **options))
    built = models.build(cell.model_spec, seed=0)
    return strategies.get(strategy).prepare(built.module, built.block_type, cell, env).engine_report()


def test_ddp_keeps_torchs_buckets_but_for_powersgd_on_gloo(one_rank_env):
    assert _engine("ddp", one_rank_env) == {"name": "torch_ddp", "bucket_cap_mb": 25.0, "first_bucket_smaller": True,
                                   "gradient_as_bucket_view": False}
    # The cell's own knobs, where it sets them.
    set_by_cell = _engine("ddp", one_rank_env, bucket_cap_mb=0.5, gradient_as_bucket_view=True)
    assert set_by_cell == {"name": "torch_ddp", "bucket_cap_mb": 0.5, "first_bucket_smaller": False,
                           "gradient_as_bucket_view": True}  # 0.5 MiB: a whole number of bytes
    assert _engine("zero1", one_rank_env)["bucket_cap_mb"] == 25.0  # ZeroRedundancyOptimizer over the same DDP
    # One bucket of the model's size: 134,912 fp32 elements are 0.51 MiB, rounded up, plus one.
    assert _engine("ddp", one_rank_env, compression="powersgd") == {"name": "torch_ddp", "bucket_cap_mb": 2.0,
                                                           "first_bucket_smaller": False,
                                                           "gradient_as_bucket_view": False}


def test_fsdp_wraps_each_block_then_the_root(one_rank_env):
    unit = "each GPT2Block, then the root"
    assert _engine("fsdp_full", one_rank_env) == {"name": "fsdp2", "wrap_unit": unit, "units": 3,  # 2 blocks + root
                                         "prefetch": "implicit (the next unit)"}
    assert _engine("fsdp_full", one_rank_env, prefetch=2)["prefetch"] == 2
    assert _engine("fsdp1_full", one_rank_env) == {"name": "fsdp1", "wrap_unit": unit, "units": 3,
                                          "backward_prefetch": "BACKWARD_PRE", "forward_prefetch": False,
                                          "limit_all_gathers": True}


@pytest.mark.parametrize("strategy", ["single", "fsdp_full"])
def test_fp32_blocks_compute_in_fp32_under_bf16(one_rank_env, strategy):
    """The listed block computes in fp32 and the others in bf16, by autocast switched off in
    it (single) or by FSDP2's per-module policy, whose report names it; its output goes on to
    the next block in that block's precision."""
    cell = CellSpec(model="llama-tiny", world_size=1, micro_batch=2,
                    strategy=StrategySpec(name=strategy, precision="bf16", fp32_blocks="0"))
    session = training.prepare_cell(cell, one_rank_env)
    blocks = [m for m in session.built.module.modules() if isinstance(m, session.built.block_type)]
    seen: dict[int, torch.dtype] = {}

    def note(i: int):
        def hook(module, args, out) -> None:
            seen[i] = out.dtype
        return hook

    for i, block in enumerate(blocks):
        block.mlp.down_proj.register_forward_hook(note(i))
    assert torch.isfinite(session.step(0))
    assert seen == {0: torch.float32, 1: torch.bfloat16}
    if strategy == "fsdp_full":
        assert session.prep.engine_report()["fp32_blocks"] == [0]


def test_fsdp2_offloads_the_listed_blocks_only(one_rank_env):
    cell = CellSpec(model="gpt2-tiny", world_size=1, strategy=StrategySpec(name="fsdp_full", offload_blocks="1"))
    built = models.build(cell.model_spec, seed=0)
    prep = strategies.get("fsdp_full").prepare(built.module, built.block_type, cell, one_rank_env)
    assert prep.engine_report()["offloaded_blocks"] == [1]
    policies = [type(block._get_fsdp_state()._fsdp_param_group.offload_policy).__name__
                for block in built.module.modules() if isinstance(block, built.block_type)]
    assert policies == ["OffloadPolicy", "CPUOffloadPolicy"]
