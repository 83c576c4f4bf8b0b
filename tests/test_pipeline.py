"""Pipeline parallelism (harness/strategies/pipeline.py): the hand-written split, the refused
combinations, and real 2-rank runs of the three schedules against the reference."""

import dataclasses

import pytest
import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

from harness import models, strategies
from harness.config import CellSpec, StrategySpec
from harness.features import checkpointing
from harness.models import sources
from harness.strategies import pipeline
from model_configs import write  # tests/ is on sys.path (rootdir conftest, prepend import mode)


def test_blocks_are_split_evenly_and_the_middle_stages_take_the_extra_ones():
    assert pipeline.stage_blocks(12, 4) == [range(0, 3), range(3, 6), range(6, 9), range(9, 12)]
    assert pipeline.stage_blocks(3, 2) == [range(0, 2), range(2, 3)]
    # 2 blocks over 4 virtual stages: the first stage only embeds, the last only runs the head.
    assert pipeline.stage_blocks(2, 4) == [range(0, 0), range(0, 1), range(1, 2), range(2, 2)]
    assert pipeline.stage_blocks(16, 6) == [range(0, 2), range(2, 5), range(5, 8), range(8, 11),
                                            range(11, 14), range(14, 16)]


def test_a_ranks_blocks_are_its_stages_and_the_busiest_middle_rank_prices_the_others():
    assert pipeline.rank_blocks("pp_1f1b", 2, 4) == [0, 1, 1, 0]
    assert pipeline.rank_blocks("pp_gpipe", 5, 4) == [1, 2, 1, 1]
    # Interleaved: rank r holds stages r and r + 4 of stage_blocks(12, 8) = [1, 2, 2, 2, 2, 1, 1, 1].
    assert pipeline.rank_blocks("pp_interleaved_1f1b", 12, 4) == [3, 3, 3, 3]
    assert pipeline.busiest_middle_rank("pp_gpipe", 12, 8) == 1
    assert pipeline.busiest_middle_rank("pp_gpipe", 5, 4) == 1
    assert pipeline.busiest_middle_rank("pp_gpipe", 12, 2) is None  # no rank between the first and the last
    work = {rank: {"ops": rank} for rank in (0, 2, 5, 7)}
    assert pipeline.other_ranks_work(8, work) == {"last_rank_work": {"ops": 7},
                                                  "middle_rank_work": {"rank": 2, "work": {"ops": 2}}}
    assert pipeline.other_ranks_work(2, {0: {"ops": 0}, 1: {"ops": 1}}) == {"last_rank_work": {"ops": 1}}


def _param_names(model) -> dict[int, str]:
    """Each parameter under its first name (a tied weight: the token table's)."""
    return {id(p): name for name, p in model.named_parameters()}


@pytest.mark.parametrize("model_name, first_only, last_only", [
    ("gpt2-tiny", {"transformer.wte.weight", "transformer.wpe.weight"},
     {"transformer.ln_f.weight", "transformer.ln_f.bias"}),
    ("llama-tiny", {"model.embed_tokens.weight"}, {"model.norm.weight", "lm_head.weight"}),
])
@pytest.mark.parametrize("n_stages", [2, 4])
def test_every_parameter_is_on_exactly_one_stage_but_a_tied_embedding(model_name, first_only, last_only, n_stages):
    built = models.build(models.get_preset(model_name))
    model = built.module
    names = _param_names(model)
    stages = [pipeline.build_stage(model, models.get_preset(model_name).layout, i, n_stages) for i in range(n_stages)]
    held = [{names[id(p)] for p in stage.parameters()} for stage in stages]

    tied = {"transformer.wte.weight"} if model_name == "gpt2-tiny" else set()
    assert first_only <= held[0] and last_only <= held[-1]
    assert tied <= held[-1]  # the LM head's weight: the token table's second use
    counts = {name: sum(name in h for h in held) for name in set(names.values())}
    assert {name for name, n in counts.items() if n != 1} == tied
    assert counts["transformer.wte.weight" if tied else "model.embed_tokens.weight"] == 1 + len(tied)
    blocks = [len(stage.blocks) for stage in stages]
    assert blocks == ([1, 1] if n_stages == 2 else [0, 1, 1, 0])


@pytest.mark.parametrize("changes", [{}, {"sliding_window": 4}], ids=["causal", "sliding_window4"])
def test_the_stages_one_after_another_compute_the_models_own_logits(tmp_path, changes):
    """Each stage masks its blocks as the model's own forward does: a Mistral whose 4-token
    sliding window the 16-token sequence passes would otherwise attend to the whole context."""
    spec = sources.resolve(str(write(tmp_path, "mistral", **changes)))
    built = models.build(dataclasses.replace(spec, seq_len=16))
    ids = built.make_batch(torch.Generator().manual_seed(0), 2)["input_ids"]
    stages = [pipeline.build_stage(built.module, "llama", i, 2) for i in range(2)]
    with torch.no_grad():
        torch.testing.assert_close(stages[1](stages[0](ids)), built.module(input_ids=ids).logits)


def test_the_split_keeps_the_checkpoint_wrapped_blocks():
    built = models.build(models.get_preset("llama-tiny"))
    checkpointing.apply_checkpointing(built.module, built.block_type, "full")
    stages = [pipeline.build_stage(built.module, "llama", i, 2) for i in range(2)]
    assert all(isinstance(block, CheckpointWrapper) for stage in stages for block in stage.blocks)


@pytest.mark.parametrize("cell, message", [
    (CellSpec(model="llama-tiny", strategy=StrategySpec(name="pp_interleaved_1f1b"), world_size=4),
     "pp_interleaved_1f1b with model=llama-tiny at world_size=4: 2 blocks cannot fill 8 stages (stages [3, 4, 5, 6]"),
    (CellSpec(model="llama-tiny", strategy=StrategySpec(name="pp_1f1b", pp_microbatches=1)),
     "pp_1f1b with pp_microbatches=1: Schedule1F1B needs at least one micro-batch per stage (2)"),
    (CellSpec(model="bert-tiny", strategy=StrategySpec(name="pp_gpipe")),
     "pp_gpipe with model=bert-tiny: the pipeline split is written for the causal-LM layouts"),
    (CellSpec(model="gpt2-tiny", strategy=StrategySpec(name="pp_gpipe", precision="fp16")),
     "pp_gpipe with precision=fp16: fp16 needs a GradScaler whose scale"),
])
def test_combinations_the_split_or_the_schedule_cannot_run_are_refused(cell, message):
    assert strategies.incompatibility(cell).startswith(message)


def test_a_2_layer_model_runs_interleaved_on_2_ranks_and_gpipe_on_4():
    for cell in (CellSpec(model="gpt2-tiny", strategy=StrategySpec(name="pp_interleaved_1f1b")),
                 CellSpec(model="llama-tiny", strategy=StrategySpec(name="pp_gpipe"), world_size=4)):
        assert strategies.incompatibility(cell) is None


SCHEDULES = [CellSpec(model="llama-tiny", strategy=StrategySpec(name=name))
             for name in ("pp_gpipe", "pp_1f1b", "pp_interleaved_1f1b")]
TIED = CellSpec(model="gpt2-tiny", strategy=StrategySpec(name="pp_interleaved_1f1b"))
TRACED_MATRIX_CELLS = [*SCHEDULES, TIED]  # run, traced, in tests/conftest.py's shared_traced_matrix


def test_the_three_schedules_train_the_reference_model_and_1f1b_holds_fewer_activations(shared_traced_matrix):
    cells, tied, records = SCHEDULES, TIED, shared_traced_matrix.records
    for cell in [*cells, tied]:
        record = records[cell.cell_id]
        assert record["status"] == "ok", record["reason"]
        assert record["equivalence"]["passed"], record["equivalence"]
        # Traced on the first and the last rank, with the neighbours' metadata answered from
        # rank 0's (harness/predict/traced.py): the heavier rank's peak, as the record's.
        traced = record["predicted"]["traced"]
        assert "peak_bytes" in traced, traced
        heaviest = max(rank["peak_mem_bytes"] for rank in record["per_rank"])
        assert traced["peak_bytes"] == pytest.approx(heaviest, rel=0.05)
        # Each traced rank's work, for the step-time predictor's timeline: the last rank's
        # holds the LM head's matmuls and the loss, more FLOPs than rank 0's embedding stage.
        assert traced["last_rank_work"]["matmul_flops"] > traced["work"]["matmul_flops"] > 0
    gpipe, one_f_one_b = (records[c.cell_id]["per_rank"] for c in cells[:2])
    # GPipe holds every micro-batch's activations at its peak; 1F1B at most (stages - rank).
    for rank in (0, 1):
        assert (gpipe[rank]["mem_breakdown_bytes"]["activations"]
                > 1.5 * one_f_one_b[rank]["mem_breakdown_bytes"]["activations"])
