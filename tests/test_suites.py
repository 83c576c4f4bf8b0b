import pytest

from harness import markers, strategies, suites
from harness.config import CellSpec, StrategySpec
from harness.models import sources

# Markers the default suite leaves to other suites: world sizes other than its own, the
# accumulation depths between 1 and 4, and tp_fsdp (a 2-D mesh: from 4 ranks on).
# factory: a model of the user's own code; tests/test_model_sources.py builds and checks one.
# The world sizes of larger runs, and axis values only other suites use.
NOT_IN_DEFAULT = {*(f"ws{n}" for n in markers.WORLD_SIZE_MARKERS if n > 2), "accum2", "accum8", "tp_fsdp", "factory"}


def test_default_suite_covers_every_axis_value():
    cells = suites.cells_of("default", 2)
    assert len(cells) >= 25
    seen = {m for c in cells for m in markers.markers_of(c)}
    expected = markers.CATALOGUE.keys() - NOT_IN_DEFAULT
    assert expected <= seen, f"axis values never exercised: {sorted(expected - seen)}"
    ranks = {c.strategy.powersgd_rank for c in cells if c.strategy.compression == "powersgd"}
    assert ranks == {1, 4}


@pytest.mark.parametrize("suite", list(suites.SUITES))
def test_every_suite_cell_has_registered_markers_and_is_compatible(suite):
    for c in suites.cells_of(suite, 2):
        assert set(markers.markers_of(c)) <= markers.CATALOGUE.keys()
        assert strategies.incompatibility(c) is None


def test_default_suite_at_four_ranks_has_the_2d_mesh():
    assert any(c.strategy.name == "tp_fsdp" for c in suites.cells_of("default", 4))


def test_suite_single_cells_are_the_references_of_the_distributed_ones():
    cells = suites.cells_of("default", 2)
    ids = {c.cell_id for c in cells}
    plain = [c for c in cells if c.strategy.accumulation == 1 and c.strategy.name != "single"]
    assert all(c.reference().cell_id in ids for c in plain)


def test_incompatible_combinations_are_refused_with_the_reason():
    pipeline_fp16 = CellSpec(model="gpt2-tiny", strategy=StrategySpec(name="pp_gpipe", precision="fp16"))
    assert ("pp_gpipe with precision=fp16: fp16 needs a GradScaler whose scale and overflow checks span every"
            " stage" in strategies.incompatibility(pipeline_fp16))
    compress_fsdp = CellSpec(model="gpt2-tiny", strategy=StrategySpec(name="fsdp_full", compression="fp16"))
    assert "compression=fp16" in strategies.incompatibility(compress_fsdp)
    offload_ddp = CellSpec(model="gpt2-tiny", strategy=StrategySpec(name="ddp", offload="params"))
    assert "offload=params" in strategies.incompatibility(offload_ddp)
    ddp_alone = CellSpec(model="gpt2-tiny", strategy=StrategySpec(name="ddp"), world_size=1)
    assert "world_size >= 2" in strategies.incompatibility(ddp_alone)


def test_hardware_limits_are_reasons_not_errors():
    bf16_hook = CellSpec(model="gpt2-tiny", strategy=StrategySpec(name="ddp", compression="bf16"))
    assert "CUDA" in strategies.unsupported_reason(bf16_hook, "cpu")
    assert strategies.unsupported_reason(bf16_hook, "cuda") is None
    fsdp1_offload = CellSpec(model="gpt2-tiny", strategy=StrategySpec(name="fsdp1_full", offload="params"))
    assert "accelerator" in strategies.unsupported_reason(fsdp1_offload, "cpu")


def test_unknown_suite_and_too_few_ranks():
    with pytest.raises(ValueError, match="unknown suite 'nightly': choose one of smoke, default, full, real, perf"):
        suites.cells_of("nightly", 2)
    with pytest.raises(ValueError, match="use 2 or more"):
        suites.cells_of("default", 1)


def test_marker_expressions_are_checked():
    cells = suites.cells_of("default", 2)
    markers.check_marker_expression("fsdp and bf16 and not ckpt_full or (zero1)", cells)
    with pytest.raises(ValueError, match=r"unknown marker.*zero4"):
        markers.check_marker_expression("zero4 and bf16")
    with pytest.raises(ValueError, match=r"-m 'fsdp and \(': not a valid expression at column 11"):
        markers.check_marker_expression("fsdp and (")
    # Known markers, but no cell of the suite has both.
    with pytest.raises(ValueError, match=r"-m 'tp and deepspeed' selects none of the suite's \d+ cells"):
        markers.check_marker_expression("tp and deepspeed", cells)
    with pytest.raises(ValueError, match=r"-k 'gpt2 or': not a valid expression"):
        markers.check_keyword_expression("gpt2 or")


def test_a_suite_file_is_the_product_of_its_tables(tmp_path):
    path = tmp_path / "mine.toml"
    path.write_text("[defaults]\nmodel = 'gpt2-tiny'\nmicro_batch = 3\n"
                    "[[cells]]\nstrategy = ['ddp', 'fsdp_full']\nprecision = ['fp32', 'bf16']\n"
                    "[[cells]]\nstrategy = 'single'\nmodel = 'llama-tiny'\n")
    cells = suites.cells_of(str(path), 4)
    assert [c.cell_id for c in cells] == [
        "gpt2-tiny/ddp/fp32/ckpt_none/mb3/ws4/seed0", "gpt2-tiny/ddp/bf16/ckpt_none/mb3/ws4/seed0",
        "gpt2-tiny/fsdp_full/fp32/ckpt_none/mb3/ws4/seed0", "gpt2-tiny/fsdp_full/bf16/ckpt_none/mb3/ws4/seed0",
        # the reference takes the whole global batch in one process, as in the built-in suites
        "llama-tiny/single/fp32/ckpt_none/mb12/ws1/seed0",
    ]


def test_the_example_suite_files_are_valid():
    cells = suites.cells_of(str(suites.SUITE_FILE_EXAMPLES / "fsdp_vs_zero3.toml"), 2)
    assert len(cells) == 16 and {c.strategy.name for c in cells} == {"fsdp_full", "deepspeed_zero3"}
    moe = suites.cells_of(str(suites.SUITE_FILE_EXAMPLES / "moe_aux_loss.toml"), 2)
    assert [(c.strategy.name, c.router_aux_loss_coef) for c in moe] == [("single", 0.01), ("ddp", 0.01),
                                                                         ("single", None)]
    assert {(c.steps, c.lr) for c in moe} == {(40, 0.01)}
    # The one-GPU checks, at the --gpus 1 their headers run them with.
    for name in ("device_check.toml", "device_check_memory.toml"):
        path = suites.SUITE_FILE_EXAMPLES / name
        assert "--gpus 1 --suite" in path.read_text()
        assert {c.world_size for c in suites.cells_of(str(path), 1)} == {1}


def test_a_suite_file_table_without_cells_is_refused(tmp_path):
    path = tmp_path / "empty.toml"
    path.write_text("description = 'nothing'\n")
    with pytest.raises(ValueError, match="no \\[\\[cells\\]\\] tables"):
        suites.cells_of(str(path), 2)


def test_the_real_suite_is_both_models_at_256_tokens_over_the_shardings_with_their_variants():
    cells = suites.cells_of("real", 2)
    assert {c.model_name for c in cells} == {"gpt2-124m", sources.config_model("llama-100m").name}
    assert {c.model_spec.seq_len for c in cells} == {suites.REAL_SEQ_LEN}
    plain = {c.strategy.name for c in cells if c.strategy.precision == "fp32" and c.strategy.checkpointing == "none"}
    assert plain == {"single", *suites.REAL_STRATEGIES}
    for variant in ({"checkpointing": "full"}, {"precision": "bf16"}):
        chosen = {c.strategy.name for c in cells if all(getattr(c.strategy, k) == v for k, v in variant.items())}
        assert chosen == set(suites.REAL_VARIANT_STRATEGIES), variant


def test_a_cpu_cell_too_slow_at_the_measured_rate_is_unsupported_with_the_arithmetic(monkeypatch):
    from harness.runner import timeouts

    rates = {"fp32": 30e9, "bf16": 0.9e9, "fp16": 0.9e9}  # this project's hosts: bf16 emulated
    monkeypatch.setattr(timeouts, "cpu_flops_per_s", lambda precision: rates[precision])
    real = {c.strategy.precision: c for c in suites.cells_of("real", 2) if c.strategy.name == "ddp"}
    assert timeouts.too_slow_reason(real["fp32"], "cpu") is None
    reason = timeouts.too_slow_reason(real["bf16"], "cpu")
    assert reason is not None and "0.9 GFLOP/s per thread, against 30.0 in fp32" in reason
    assert timeouts.too_slow_reason(real["bf16"], "cuda") is None
    tiny = CellSpec(model="gpt2-tiny", strategy=StrategySpec(name="ddp", precision="bf16"))
    assert timeouts.too_slow_reason(tiny, "cpu") is None

