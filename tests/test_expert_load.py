"""A mixture of experts' tokens per expert (measure/expert_load.py) and its router's
load-balancing loss (router_aux_loss_coef): counted once per training forward, the same under
every data-parallel strategy, and the loss's cells judged outside the gate."""

import pytest
import torch

from harness import equivalence, models
from harness.config import CellSpec, StrategySpec
from harness.measure import expert_load
from harness.predict import traced
from harness.suite_cell import suite_cell


def _moe(strategy: str = "single", checkpointing: str = "none", **options) -> CellSpec:
    return suite_cell("moe-tiny", StrategySpec(name=strategy, checkpointing=checkpointing), 2, **options)


def test_imbalance_is_the_most_loaded_expert_over_the_mean_averaged_over_layers():
    counts = torch.tensor([[[4, 4, 4, 4], [16, 0, 0, 0]], [[5, 3, 4, 4], [8, 8, 0, 0]]])
    assert expert_load.imbalance(counts).tolist() == [(1.0 + 4.0) / 2, (1.25 + 2.0) / 2]


@pytest.mark.parametrize("checkpointed", [False, True])
def test_each_training_forward_counts_once_and_nothing_else_does(checkpointed):
    built = models.build(models.get_preset("moe-tiny"))
    if checkpointed:
        from harness.features import checkpointing

        checkpointing.apply_checkpointing(built.module, built.block_type, "full", None)
    load = expert_load.ExpertLoad(expert_load.routers(built.module), steps=2, device=torch.device("cpu"))
    batch = built.make_batch(torch.Generator().manual_seed(0), 3)
    tokens = 3 * built.spec.required("seq_len")
    built.loss(built.module, batch).backward()  # a recompute in backward does not count again
    with torch.no_grad():
        built.loss(built.module, batch)  # an evaluation does not count
    record = load.to_record(summed_over_ranks=False)
    top_k, n_layers = built.spec.required("top_k"), built.spec.n_layers
    assert [sum(layer) for layer in record["tokens_per_expert"][0]] == [top_k * tokens] * n_layers
    assert record["tokens_per_expert"][1] == [[0] * built.spec.required("n_experts")] * n_layers
    assert record["dropped_tokens"] is None and "no capacity" in record["dropped_tokens_reason"]


def test_the_load_balancing_loss_is_gated_only_where_one_forward_sees_the_whole_batch():
    def aux_batch(cell):
        return equivalence._router_aux_loss_batch(cell)

    assert aux_batch(_moe()) is None
    single = _moe(router_aux_loss_coef=0.01)
    assert aux_batch(single) == single.global_batch == 4
    ddp = _moe("ddp", router_aux_loss_coef=0.01)
    assert aux_batch(ddp) == 2
    verdict = equivalence.check(ddp, [1.0] * ddp.steps, None)
    assert verdict["passed"] is None and "not gated" in verdict["reason"] and "2 samples" in verdict["reason"]
    accumulating = CellSpec(model="moe-tiny", strategy=StrategySpec(name="single", accumulation=2), world_size=1,
                            micro_batch=2, router_aux_loss_coef=0.01)
    assert aux_batch(accumulating) == 2


def test_the_option_is_refused_outside_a_mixture_of_experts_and_with_autoep():
    from harness import strategies

    with pytest.raises(ValueError, match="moe family"):
        CellSpec(model="gpt2-tiny", strategy=StrategySpec(name="ddp"), router_aux_loss_coef=0.01)
    with pytest.raises(ValueError, match="positive, finite"):
        _moe(router_aux_loss_coef=0.0)
    autoep = _moe("deepspeed_autoep", router_aux_loss_coef=0.01)
    assert "AutoEP replaces the routers" in strategies.incompatibility(autoep)


# Run in tests/conftest.py's shared_matrix: DDP with and without checkpointing, FSDP2, and DDP
# with the load-balancing loss.
MATRIX_CELLS = [_moe("ddp"), _moe("ddp", checkpointing="full"), _moe("fsdp_full"),
                _moe("ddp", router_aux_loss_coef=0.01)]


def test_every_data_parallel_strategy_routes_the_references_tokens(shared_matrix):
    """Two gloo ranks' counts summed are the one-process reference's, step by step, under DDP
    (with and without checkpointing) and FSDP2, each training the reference's model (experts no
    token was routed to on a rank still get a gradient, zeros: HF keeps each layer's experts in
    two 3-D parameters, so DDP needs no find_unused_parameters) and traced within ±10 % (the
    experts' grouped matmul in fp32: traced._grouped_mm_shape); with the load-balancing loss the
    DDP cell trains apart (ungated)."""
    cells, records = MATRIX_CELLS, shared_matrix.records
    reference = records[cells[0].reference().cell_id]["expert_load"]
    assert reference["summed_over_ranks"] and len(reference["imbalance"]) == cells[0].steps
    for cell in cells[:-1]:
        assert records[cell.cell_id]["equivalence"]["passed"]
        assert records[cell.cell_id]["expert_load"]["tokens_per_expert"] == reference["tokens_per_expert"]
    for cell in (cells[0], cells[2]):
        predicted = traced.trace(cell)
        assert predicted.get("peak_bytes"), predicted
        measured = records[cell.cell_id]["per_rank"][0]["peak_mem_bytes"]
        assert predicted["peak_bytes"] == pytest.approx(measured, rel=0.10)
    balanced = records[cells[-1].cell_id]
    assert balanced["status"] == "ok" and balanced["equivalence"]["passed"] is None
    assert balanced["expert_load"]["tokens_per_expert"] != reference["tokens_per_expert"]
