import dataclasses

import pytest

from harness.config import CellSpec, StrategySpec


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
    ]
    assert len({c.cell_id for c in variants}) == len(variants)
    for c in variants:
        assert CellSpec.from_dict(c.to_dict()) == c


def test_specs_are_frozen():
    c = cell()
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.micro_batch = 3


def test_unknown_model_names_the_presets():
    with pytest.raises(ValueError, match="model='gpt3': choose one of .*gpt2-tiny"):
        cell(model="gpt3")


def test_powersgd_warms_up_past_its_first_compressed_step():
    powersgd = cell(strategy=StrategySpec(name="ddp", compression="powersgd"))
    assert powersgd.warmup == 3 and cell().warmup == 2  # the memory step is a steady one
    assert powersgd.reference().warmup == 2  # warm-up picks the measured steps, not the losses
    assert CellSpec.from_dict(powersgd.to_dict()) == powersgd
    with pytest.raises(ValueError, match=r"warmup=2: must be at least 3 \(PowerSGD compresses from step 2 on\)"):
        cell(strategy=StrategySpec(name="ddp", compression="powersgd"), warmup=2)
