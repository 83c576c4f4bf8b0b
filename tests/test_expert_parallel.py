"""Expert parallel (deepspeed_autoep): the up-front checks, and real 2-rank runs (one
MatrixRun) gated against the single-process HF reference, with each rank's share of the
experts measured from its parameters and the token all-to-alls from the comm record."""

import re

import pytest

pytest.importorskip("deepspeed")

from harness import models, strategies
from harness.config import CellSpec, StrategySpec
from harness.markers import markers_of
from harness.strategies import expert_parallel

MOE = "moe-tiny"  # 2 MoE layers of 4 experts, top-2


def ep_cell(model: str = MOE, **options) -> CellSpec:
    world_size = options.pop("world_size", 2)
    return CellSpec(model=model, strategy=StrategySpec(name="deepspeed_autoep", **options), world_size=world_size)


# ---------------------------------------------------------------- without launching

def test_experts_that_do_not_divide_over_the_ranks_are_refused_up_front():
    with pytest.raises(ValueError, match="4 experts per layer must divide evenly"):
        ep_cell(world_size=3)
    assert ep_cell(world_size=4).world_size == 4


def test_a_dense_model_is_refused_and_the_cell_carries_the_ep_marker():
    why = strategies.incompatibility(ep_cell("llama-tiny"))
    assert why is not None and "mixture-of-experts" in why
    assert strategies.incompatibility(ep_cell()) is None
    assert {"ep", "deepspeed_autoep", "moe"} <= set(markers_of(ep_cell()))


def test_every_rank_is_one_expert_parallel_group_and_checkpointed_layers_still_match():
    config = expert_parallel.ds_config(ep_cell(world_size=4))["expert_parallel"]
    assert config["autoep_size"] == 4 and config["preset_model"] == "mixtral"
    pattern = re.compile(expert_parallel.MOE_LAYER_PATTERN)
    assert pattern.fullmatch("model.layers.1.mlp")
    assert pattern.fullmatch("model.layers.1._checkpoint_wrapped_module.mlp")
    assert not pattern.fullmatch("model.layers.1.self_attn")


# ---------------------------------------------------------------- real runs

def _bytes(params) -> int:
    return sum(p.numel() * p.element_size() for p in params)


MATRIX_CELLS = [ep_cell(), ep_cell(checkpointing="full")]  # run in tests/conftest.py's shared_matrix


def test_expert_parallel_trains_the_reference_model_with_half_the_experts_per_rank(shared_matrix):
    plain, checkpointed = MATRIX_CELLS
    assert plain.reference() == checkpointed.reference()
    records = shared_matrix.records

    hf = models.build(models.get_preset(MOE), seed=0).module
    all_bytes = _bytes(hf.parameters())
    expert_bytes = _bytes(p for layer in hf.model.layers for p in layer.mlp.experts.parameters())
    n_layers = len(hf.model.layers)
    # Per MoE block and step: the counts' exchange, the tokens out and back, both again in
    # the backward; checkpointing recomputes the forward's three.
    all_to_alls = {plain.cell_id: 5 * n_layers, checkpointed.cell_id: 8 * n_layers}

    for cell in (plain, checkpointed):
        record = records[cell.cell_id]
        assert record["status"] == "ok", record["reason"]
        assert record["equivalence"]["passed"], record["equivalence"]
        for rank in record["per_rank"]:
            layout = rank["engine"]["expert_layout"]
            assert (layout["local_experts_per_layer"], layout["experts_per_layer"]) == (2, 4)
            assert layout["expert_param_bytes"] == expert_bytes // 2
            assert layout["non_expert_param_bytes"] == all_bytes - expert_bytes
            # The memory tracker's parameters: the whole model less the other rank's experts.
            assert rank["mem_breakdown_bytes"]["params"] == all_bytes - expert_bytes // 2
        a2a = record["metrics"]["comm_by_op"]["all_to_all"]
        assert a2a["count"] == all_to_alls[cell.cell_id]
        # The harness's counter and DeepSpeed's comms_logger saw the same bytes on rank 0.
        logged = record["per_rank"][0]["engine"]["comms_logger_by_op"]["all_to_all_single"]
        assert (a2a["count"], a2a["bytes"]) == (logged["count"], logged["bytes"])
