import dataclasses
import re

import pytest

from harness import markers, strategies
from harness.config import CellSpec, StrategySpec, block_list_text, parse_block_list


def cell(**kw) -> CellSpec:
    kw.setdefault("strategy", StrategySpec(name="ddp"))
    kw.setdefault("model", "gpt2-tiny")
    return CellSpec(**kw)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"name": "zero4"}, "strategy='zero4': choose one of single, ddp"),
        ({"name": "ddp", "precision": "fp8"}, "precision='fp8': choose one of fp32, bf16, fp16"),
        ({"name": "ddp", "checkpointing": "some"}, "checkpointing='some'"),
        ({"name": "ddp", "accumulation": 0}, "accumulation=0: must be a positive integer"),
        ({"name": "ddp", "powersgd_rank": -1}, "powersgd_rank=-1"),
        ({"name": "ddp", "powersgd_rank": 4}, "powersgd_rank=4: applies to compression=powersgd only"),
        ({"name": "fsdp1_full", "hsdp_mesh": "fsdp_default"}, "applies to strategy=fsdp1_hybrid only"),
        ({"name": "tp", "tp_degree": 2}, "tp_degree=2: applies to strategies tp_fsdp and megatron only"),
        ({"name": "tp_fsdp", "tp_degree": 0}, "tp_degree=0: must be a positive integer"),
        ({"name": "ddp", "pp_microbatches": 4}, "pp_microbatches=4: applies to the pipeline strategies"),
        ({"name": "pp_1f1b", "pp_microbatches": -1}, "pp_microbatches=-1: must be a positive integer"),
    ],
)
def test_strategy_spec_rejects_bad_values_naming_the_choices(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        StrategySpec(**kwargs)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"micro_batch": 0}, "micro_batch=0"),
        ({"world_size": -2}, "world_size=-2"),
        ({"warmup": 1}, "warmup=1: must be at least 2"),
        ({"steps": 5}, "steps=5: need at least"),
        ({"lr": 0.0}, "lr=0.0"),
        ({"strategy": StrategySpec(name="single"), "world_size": 2}, "world_size must be 1"),
        ({"attention": "flash2"}, "attention='flash2': choose one of sdpa, eager, flash"),
        ({"model": "mlp-tiny", "attention": "eager"}, "model mlp-tiny has no attention"),
        ({"attention": "flash"}, "flash-attn computes in fp16 or bf16 only"),
        ({"expandable_segments": "yes"}, "expandable_segments='yes': must be true or false"),
        ({"max_split_size_mb": 20}, "torch refuses 20 MiB and below"),
        ({"garbage_collection_threshold": 1.0}, "must lie between 0 and 1"),
        ({"empty_cache": "always"}, "empty_cache='always': choose one of never, step, micro_step"),
        ({"empty_cache": "micro_step"}, "a step is one micro-step"),
        ({"router_aux_loss_coef": 0.01}, "the option applies to the moe family's router"),
        ({"model": "moe-tiny", "router_aux_loss_coef": -1.0}, "must be a positive, finite number"),
        ({"strategy": StrategySpec(name="tp_fsdp"), "world_size": 2}, "the world size must be a multiple of tp_degree"),
        ({"strategy": StrategySpec(name="tp_fsdp", tp_degree=2), "world_size": 6 - 1}, "world_size=5 with tp_fsdp"),
        ({"strategy": StrategySpec(name="pp_gpipe", accumulation=2)}, "set pp_microbatches instead"),
    ],
)
def test_cell_spec_rejects_bad_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        cell(**kwargs)


def test_reference_takes_the_whole_global_batch_in_one_process():
    c = cell(strategy=StrategySpec(name="fsdp_full", precision="bf16", checkpointing="full", accumulation=4),
             micro_batch=2, world_size=2)
    ref = c.reference()
    assert (ref.world_size, ref.micro_batch, ref.global_batch) == (1, 16, 16)
    assert ref.strategy == StrategySpec(name="single", precision="bf16")
    assert (ref.model, ref.seed, ref.steps, ref.warmup) == (c.model, c.seed, c.steps, c.warmup)
    assert ref.reference() == ref


def test_cell_ids_differ_for_every_option_and_round_trip():
    variants = [
        cell(),
        cell(micro_batch=4),
        cell(seed=1),
        cell(world_size=4),
        cell(strategy=StrategySpec(name="ddp", compression="powersgd", powersgd_rank=1)),
        cell(strategy=StrategySpec(name="ddp", compression="powersgd", powersgd_rank=4)),
        cell(strategy=StrategySpec(name="ddp", accumulation=4)),
        cell(strategy=StrategySpec(name="fsdp1_hybrid")),
        cell(strategy=StrategySpec(name="fsdp1_hybrid", hsdp_mesh="fsdp_default")),
        cell(strategy=StrategySpec(name="fsdp_full", offload="params")),
        cell(attention="eager"),
        cell(expandable_segments=True),
        cell(max_split_size_mb=128),
        cell(garbage_collection_threshold=0.8),
        cell(empty_cache="step"),
        cell(strategy=StrategySpec(name="ddp", accumulation=2), empty_cache="micro_step"),
        cell(model="moe-tiny"),
        cell(model="moe-tiny", router_aux_loss_coef=0.01),
        cell(strategy=StrategySpec(name="tp_fsdp"), world_size=4),
        cell(strategy=StrategySpec(name="tp_fsdp", tp_degree=4), world_size=8),
        cell(strategy=StrategySpec(name="pp_1f1b")),
        cell(strategy=StrategySpec(name="pp_1f1b", pp_microbatches=8)),
    ]
    assert len({c.cell_id for c in variants}) == len(variants)
    for c in variants:
        assert CellSpec.from_dict(c.to_dict()) == c


def test_specs_are_frozen():
    c = cell()
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.micro_batch = 3


def test_unknown_model_names_the_presets():
    with pytest.raises(ValueError, match=r"model='gpt3': choose one of .*gpt2-tiny"):
        cell(model="gpt3")


def test_powersgd_warms_up_past_its_first_compressed_step():
    powersgd = cell(strategy=StrategySpec(name="ddp", compression="powersgd"))
    assert powersgd.warmup == 3 and cell().warmup == 2  # the memory step is a steady one
    assert powersgd.reference().warmup == 2  # warm-up picks the measured steps, not the losses
    assert CellSpec.from_dict(powersgd.to_dict()) == powersgd
    with pytest.raises(ValueError, match=r"warmup=2: must be at least 3 \(PowerSGD compresses from step 2 on\)"):
        cell(strategy=StrategySpec(name="ddp", compression="powersgd"), warmup=2)


@pytest.mark.parametrize("strategy, world_size, global_batch", [
    (StrategySpec(name="ddp", accumulation=2), 4, 2 * 4 * 2),
    (StrategySpec(name="tp"), 4, 2),  # every rank takes the same samples
    (StrategySpec(name="tp_fsdp"), 8, 2 * 4),  # 4 data-parallel groups of 2 tensor-parallel ranks
    (StrategySpec(name="pp_gpipe", pp_microbatches=8), 2, 2 * 8),  # the pipeline's micro-batches
])
def test_global_batch_counts_data_parallel_groups_and_pipeline_micro_batches(strategy, world_size, global_batch):
    c = cell(strategy=strategy, world_size=world_size)
    assert c.global_batch == global_batch
    assert c.reference().micro_batch == global_batch


def test_options_that_apply_resolve_to_their_defaults_and_round_trip():
    tp_fsdp = StrategySpec(name="tp_fsdp")
    pipeline = StrategySpec(name="pp_interleaved_1f1b")
    assert (tp_fsdp.tp_degree, tp_fsdp.pp_microbatches) == (2, None)
    assert (pipeline.tp_degree, pipeline.pp_microbatches) == (None, 4)
    eager = cell(strategy=pipeline, attention="eager", expandable_segments=True)
    assert eager.reference().attention == "eager"  # the same maths as its reference
    assert eager.reference().expandable_segments is False  # an allocator setting is not maths
    assert CellSpec.from_dict(eager.to_dict()) == eager


@pytest.mark.parametrize("options, message", [
    ({"bucket_cap_mb": 0}, "bucket_cap_mb=0: must be a positive number of MiB, at most 1,048,576"),
    ({"bucket_cap_mb": float("inf")}, "bucket_cap_mb=inf: must be a positive number of MiB"),
    ({"bucket_cap_mb": True}, "bucket_cap_mb=True: must be a number or unset"),
    ({"gradient_as_bucket_view": 1}, "gradient_as_bucket_view=1: must be true or false"),
    ({"overlap_comm": "yes"}, "overlap_comm='yes': must be true or false or unset"),
    ({"prefetch": 0}, "prefetch=0: must be a positive integer"),
    ({"local_sgd_period": 1}, "local_sgd_period=1: must be an integer of 2 or more"),
    ({"local_sgd_period": 4, "compression": "topk"}, "both are DDP communication hooks, and DDP takes one"),
    ({"checkpoint_every": 2}, "checkpoint_every=2: applies with checkpointing full or selective"),
    ({"checkpointing": "full", "checkpoint_every": 1}, "checkpoint_every=1: must be an integer of 2 or more"),
])
def test_overlap_and_local_sgd_options_are_checked(options, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        StrategySpec(name="ddp", **options)


def test_a_block_list_is_spelled_one_way():
    """Indices and first-last ranges in any order name one set of blocks: one cell, one id."""
    assert parse_block_list("fp32_blocks", " 5, 0-2,1 ") == (0, 1, 2, 5)
    assert block_list_text([7, 0, 1, 2, 5, 6]) == "0-2,5-7"
    a, b = (StrategySpec(name="ddp", precision="bf16", fp32_blocks=t) for t in ("1,0", "0-1"))
    assert a == b and a.fp32_blocks == "0-1"
    cell = CellSpec(model="gpt2-bytes", strategy=StrategySpec(name="ddp", checkpointing="full",
                                                              checkpoint_blocks="3,0"))
    assert cell.cell_id.startswith("gpt2-bytes/ddp/fp32/ckpt_full-blocks0+3/")
    assert cell.strategy.blocks("checkpoint_blocks", 4) == {0, 3}
    assert StrategySpec(name="ddp", checkpointing="full", checkpoint_every=3).blocks("checkpoint_blocks", 4) == {0, 3}
    assert StrategySpec(name="ddp", checkpointing="full").blocks("checkpoint_blocks", 4) == {0, 1, 2, 3}
    assert StrategySpec(name="ddp").blocks("checkpoint_blocks", 4) == frozenset()
    fp32 = CellSpec(model="llama-tiny", strategy=StrategySpec(name="fsdp_full", precision="bf16", fp32_blocks="0"))
    assert fp32.reference().strategy.fp32_blocks == "0"  # the same maths: its reference keeps it too
    assert "fp32_blocks" in markers.markers_of(fp32) and "ckpt_partial" in markers.markers_of(cell)
    # Megatron recomputes every layer of its own model: a subset would be a silent no-op.
    megatron = CellSpec(model="gpt2-tiny", attention="eager", strategy=StrategySpec(
        name="megatron", checkpointing="full", checkpoint_every=2))
    assert "no subset of blocks is wired" in strategies.incompatibility(megatron)


@pytest.mark.parametrize("options, message", [
    ({"precision": "bf16", "fp32_blocks": "0-x"}, "fp32_blocks='0-x': must list block indices from 0, separated by"),
    ({"precision": "bf16", "fp32_blocks": "2-1"}, "fp32_blocks='2-1': must list block indices"),
    ({"fp32_blocks": "0"}, "fp32_blocks='0': applies with precision bf16 or fp16"),
    ({"checkpoint_blocks": "0"}, "checkpoint_blocks='0': applies with checkpointing full or selective"),
    ({"checkpointing": "full", "checkpoint_every": 2, "checkpoint_blocks": "0"},
     "checkpoint_every=2 and checkpoint_blocks='0': choose one way"),
    ({"offload": "params", "offload_blocks": "1"}, "offload_blocks='1' with offload='params': offload applies to"),
])
def test_block_lists_are_checked(options, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        StrategySpec(name="ddp", **options)


@pytest.mark.parametrize("strategy, options, message", [
    ("fsdp_full", {"bucket_cap_mb": 1.0},
     "fsdp_full with bucket_cap_mb=1.0: an option of ddp, fairscale_oss, zero1 only"),
    ("ddp", {"prefetch": 2}, "ddp with prefetch=2: an option of fsdp_full, fsdp_grad_op, fsdp_hybrid only"),
    ("ddp", {"overlap_comm": True}, "ddp with overlap_comm=True: an option of deepspeed_zero1"),
    ("fsdp_full", {"local_sgd_period": 4}, "fsdp_full with local_sgd_period=4: local SGD is wired for DDP only"),
])
def test_overlap_options_apply_to_the_engines_that_have_them(strategy, options, message):
    cell = CellSpec(model="gpt2-tiny", strategy=StrategySpec(name=strategy, **options))
    assert message in strategies.incompatibility(cell)


@pytest.mark.parametrize("strategy, options, message", [
    ("ddp", {"offload_blocks": "1"}, "ddp with offload_blocks='1': an option of fsdp_full, fsdp_grad_op, fsdp_hybrid"),
    ("deepspeed_zero3", {"precision": "bf16", "fp32_blocks": "0"},
     "deepspeed_zero3 with fp32_blocks='0': an option of ddp, fsdp_full, fsdp_grad_op, fsdp_hybrid, single, zero1"),
])
def test_per_block_options_apply_to_the_engines_that_have_them(strategy, options, message):
    cell = CellSpec(model="gpt2-tiny", strategy=StrategySpec(name=strategy, **options))
    assert message in strategies.incompatibility(cell)
    beyond = {option: "2" if option.endswith("_blocks") else value for option, value in options.items()}
    with pytest.raises(ValueError, match=re.escape("model gpt2-tiny has 2 blocks (0-1); 2 is not one of them")):
        CellSpec(model="gpt2-tiny", strategy=StrategySpec(name=strategy, **beyond))
    # The engine default leaves the cell id as it was; a set knob names itself.
    assert CellSpec(model="gpt2-tiny", strategy=StrategySpec(name="ddp", bucket_cap_mb=0.5)).cell_id == (
        "gpt2-tiny/ddp/fp32/ckpt_none/bucket0.5/mb2/ws2/seed0")
