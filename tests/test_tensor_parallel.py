"""Tensor parallelism (tp, tp_fsdp): what the plans split, what is refused, and real runs
through the runner (gloo ranks under torchrun) that must train the reference's model."""


import dataclasses
import json

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

import model_configs  # tests/ is on sys.path (rootdir conftest, prepend import mode)
from harness import distributed, models, strategies
from harness.config import CellSpec, StrategySpec
from harness.distributed import DistEnv
from harness.models import sources
from harness.predict import analytic_parallel
from harness.strategies import tensor_parallel

STEPS = 6  # the fewest a cell accepts: 2 warm-up, 2 probes, 2 timed


def tp_cell(model: str, name: str = "tp", world_size: int = 2, micro_batch: int = 2, seq_len: int | None = None,
            **options) -> CellSpec:
    return CellSpec(model=model, strategy=StrategySpec(name=name, **options), world_size=world_size,
                    micro_batch=micro_batch, steps=STEPS, seq_len=seq_len)


# --- the plans, in one process --------------------------------------------------------------

def test_fused_qkv_is_reordered_so_each_rank_chunk_holds_its_own_heads_of_q_k_v():
    hidden, degree = 4, 2
    c_attn = nn.Linear(hidden, 3 * hidden)
    with torch.no_grad():  # row i holds i everywhere: rows 0-3 are q, 4-7 k, 8-11 v
        c_attn.weight.copy_(torch.arange(3 * hidden).float()[:, None].expand(-1, hidden))
        c_attn.bias.copy_(torch.arange(3 * hidden).float())
    tensor_parallel._rank_major_qkv(c_attn, degree)
    rank_chunks = c_attn.bias.detach().chunk(degree)  # what ColwiseParallel's Shard(0) gives each rank
    assert rank_chunks[0].tolist() == [0, 1, 4, 5, 8, 9]  # q, k, v of heads 0..n/2
    assert rank_chunks[1].tolist() == [2, 3, 6, 7, 10, 11]
    assert torch.equal(c_attn.weight[:, 0], c_attn.bias)


@pytest.fixture
def fake_world_of_two():
    """This process as rank 0 of a fake 2-rank group: collectives do nothing, so shapes are
    real and values are not. Torn down so later tests (traces) find no process group."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    distributed.mesh.cache_clear()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        yield DistEnv(rank=0, world_size=2, nnodes=1, device=torch.device("cpu"), backend="gloo")
    finally:
        distributed.mesh.cache_clear()
        dist.destroy_process_group()


def _local_shapes(model: nn.Module) -> dict[str, tuple[int, ...]]:
    return {name: tuple(p.to_local().shape) for name, p in model.named_parameters() if isinstance(p, DTensor)}


def _prepared(model_name: str, env: DistEnv, **options):
    built = models.build(models.get_preset(model_name))
    cell = tp_cell(model_name, **options)
    return built, tensor_parallel.prepare(built.module, built.block_type, cell, env)


def test_gpt2_plan_splits_the_block_matmuls_and_leaves_the_rest_whole(fake_world_of_two):
    built, prep = _prepared("gpt2-tiny", fake_world_of_two)  # hidden 64, 4 heads, MLP 256
    shapes = _local_shapes(prep.model)
    assert shapes["transformer.h.0.attn.c_attn.weight"] == (96, 64)  # colwise: 3*64/2 output features
    assert shapes["transformer.h.0.attn.c_attn.bias"] == (96,)
    assert shapes["transformer.h.0.attn.c_proj.weight"] == (64, 32)  # rowwise: 64/2 input features
    assert shapes["transformer.h.0.attn.c_proj.bias"] == (64,)  # added once, after the all-reduce
    assert shapes["transformer.h.1.mlp.c_fc.weight"] == (128, 64)
    assert shapes["transformer.h.1.mlp.c_proj.weight"] == (64, 128)
    assert len(shapes) == 2 * 8  # the 8 tensors of 4 matmuls per block, nothing outside the blocks
    attn = prep.model.transformer.h[0].attn
    assert (attn.num_heads, attn.split_size) == (2, 32)  # this rank's heads and q/k/v width
    batch = built.make_batch(torch.Generator().manual_seed(0), 2)
    logits = prep.model(input_ids=batch["input_ids"]).logits  # heads viewed from the local shards
    assert logits.shape == (2, 32, 512)


def test_llama_plan_splits_grouped_query_attention_by_whole_kv_heads(fake_world_of_two):
    _, prep = _prepared("llama-tiny", fake_world_of_two)  # 4 heads, 2 kv heads of 16, MLP 256
    shapes = _local_shapes(prep.model)
    assert shapes["model.layers.0.self_attn.q_proj.weight"] == (32, 64)  # 2 of 4 heads
    assert shapes["model.layers.0.self_attn.k_proj.weight"] == (16, 64)  # 1 of 2 kv heads
    assert shapes["model.layers.0.self_attn.v_proj.weight"] == (16, 64)
    assert shapes["model.layers.0.self_attn.o_proj.weight"] == (64, 32)
    assert shapes["model.layers.1.mlp.gate_proj.weight"] == (128, 64)
    assert shapes["model.layers.1.mlp.down_proj.weight"] == (64, 128)
    assert len(shapes) == 2 * 7
    # Split and replicated parameters in separate groups: foreach/fused AdamW take one kind per call.
    groups = [{isinstance(p, DTensor) for p in g["params"]} for g in prep.optimizer.param_groups]
    assert groups == [{True}, {False}]


def test_sequence_and_loss_parallel_split_the_norms_inputs_and_the_vocabulary(fake_world_of_two):
    """GPT-2 ties its head to its token table: split by vocabulary, the pair stays one
    parameter (two would train apart); the norms' weights become replicated DTensors, which
    the sequence slices' partial gradients are reduced into."""
    built, prep = _prepared("gpt2-tiny", fake_world_of_two, sequence_parallel=True, loss_parallel=True)
    model = prep.model
    assert model.lm_head.weight is model.transformer.wte.weight
    assert model.lm_head.weight.placements == (Shard(0),)
    assert _local_shapes(model)["transformer.wte.weight"] == (256, 64)  # 512 tokens, the first 256 here
    for norm in (model.transformer.h[0].ln_1, model.transformer.h[1].ln_2, model.transformer.ln_f):
        assert norm.weight.placements == (Replicate(),)
    assert not isinstance(model.transformer.wpe.weight, DTensor)  # positions stay whole
    batch = built.make_batch(torch.Generator().manual_seed(0), 2)
    with prep.loss_context():
        output = model(**batch)
    assert output.logits.placements == (Shard(2),) and output.logits.to_local().shape == (2, 32, 256)
    assert type(output.loss) is torch.Tensor  # the training loop adds plain tensors


# --- refused cells --------------------------------------------------------------------------

@pytest.mark.parametrize("cell, message", [
    (tp_cell("bert-tiny"), "tp with model=bert-tiny: no tensor-parallel plan for its layout"),
    (tp_cell("gpt2-tiny", world_size=3),
     "tp with model=gpt2-tiny: n_heads=4 does not split over tensor-parallel degree 3"),
    (tp_cell("llama-tiny", world_size=4),
     "tp with model=llama-tiny: n_kv_heads=2 does not split over tensor-parallel degree 4"),
    (tp_cell("gpt2-tiny", "tp_fsdp", world_size=6, tp_degree=3),
     "tp_fsdp with model=gpt2-tiny: n_heads=4 does not split"),
    (tp_cell("gpt2-tiny", precision="fp16"), "got mixed torch.Tensor and DTensor"),
    (tp_cell("gpt2-tiny", optimizer="adafactor"), "tp with optimizer=adafactor"),
    (tp_cell("gpt2-tiny", seq_len=33, sequence_parallel=True),
     "tp with sequence_parallel with seq_len=33: the sequence does not split over tensor-parallel degree 2"),
    (tp_cell("gpt2-tiny", "ddp", sequence_parallel=True),
     "ddp with sequence_parallel=True: an option of tp, tp_fsdp only"),
    (tp_cell("llama-tiny", "fsdp_full", loss_parallel=True),
     "fsdp_full with loss_parallel=True: an option of tp, tp_fsdp only"),
])
def test_cells_without_a_plan_or_an_even_split_are_refused_with_the_reason(cell, message):
    assert message in strategies.incompatibility(cell)


def _config_model(tmp_path, model_type: str):
    path = tmp_path / model_type / "config.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"model_type": model_type, **model_configs._DECODER,
                                **model_configs.PREDICTED_TEXT_MODELS[model_type]}))
    return sources.resolve(str(path))


def test_sequence_parallel_is_refused_where_a_block_has_norms_the_plan_does_not_split(tmp_path):
    """Gemma2 norms each sublayer's output too: unsplit, such a norm would run on a slice of
    the sequence with whole weights, each rank's gradient its slice's alone."""
    cell = CellSpec(model=_config_model(tmp_path, "gemma2"), strategy=StrategySpec(name="tp", sequence_parallel=True),
                    micro_batch=2, steps=STEPS, attention="eager")
    assert strategies.incompatibility(cell).endswith(
        "its blocks' norms (input_layernorm, post_attention_layernorm, pre_feedforward_layernorm,"
        " post_feedforward_layernorm) are not the llama plan's (input_layernorm, post_attention_layernorm)")
    assert strategies.incompatibility(dataclasses.replace(cell, strategy=StrategySpec(name="tp"))) is None


@pytest.mark.parametrize("model_type", ["olmo2", "stablelm"])
def test_query_and_key_norms_a_split_by_heads_would_cut_are_refused(tmp_path, model_type):
    """OLMo2's norms span every head, StableLM's are a module a head; Qwen3's, one norm of a
    head's channels each, are split with the heads (test_model_configs_run.py trains it)."""
    for name, world_size in (("tp", 2), ("tp_fsdp", 4)):
        cell = CellSpec(model=_config_model(tmp_path / name, model_type), strategy=StrategySpec(name=name),
                        world_size=world_size, micro_batch=2, steps=STEPS)
        assert "its attention's query and key norms are not one norm each of a head's channels" in (
            strategies.incompatibility(cell))
    qwen3 = CellSpec(model=_config_model(tmp_path, "qwen3"), strategy=StrategySpec(name="tp"), micro_batch=2,
                     steps=STEPS)
    assert strategies.incompatibility(qwen3) is None


def test_tiny_models_at_their_tested_degrees_are_accepted():
    for cell in (tp_cell("gpt2-tiny"), tp_cell("llama-tiny", precision="bf16", checkpointing="full"),
                 tp_cell("gpt2-tiny", "tp_fsdp", world_size=4)):
        assert strategies.incompatibility(cell) is None


# --- real runs ------------------------------------------------------------------------------

GPT2_TP, LLAMA_TP = tp_cell("gpt2-tiny"), tp_cell("llama-tiny")
# One sample per data-parallel group: a global batch of 2, so it shares GPT2_TP's reference.
GPT2_TP_FSDP = tp_cell("gpt2-tiny", "tp_fsdp", world_size=4, micro_batch=1)
# The all-reduce widths and the recompute's extra all-reduce (analytic_parallel._tp_comm).
GPT2_TP_BF16, GPT2_TP_CKPT = tp_cell("gpt2-tiny", precision="bf16"), tp_cell("gpt2-tiny", checkpointing="full")


# torchtitan's plan options: LLaMA's untied head and table split by vocabulary; tp_fsdp's
# collectives in bf16, the compute dtype FSDP casts to.
LLAMA_TP_SP = tp_cell("llama-tiny", sequence_parallel=True, loss_parallel=True)
GPT2_TP_FSDP_SP = tp_cell("gpt2-tiny", "tp_fsdp", world_size=4, micro_batch=1, precision="bf16",
                          sequence_parallel=True, loss_parallel=True)


# Run, traced first as every run is, in tests/conftest.py's shared_traced_matrix: the tp cells
# at 2 ranks and tp_fsdp at 4, with their references.
TRACED_MATRIX_CELLS = [GPT2_TP, LLAMA_TP, GPT2_TP_FSDP, GPT2_TP_BF16, GPT2_TP_CKPT, LLAMA_TP_SP, GPT2_TP_FSDP_SP]


@pytest.fixture(scope="module")
def records(shared_traced_matrix) -> dict[str, dict]:
    return shared_traced_matrix.records


@pytest.mark.parametrize("cell", [GPT2_TP, LLAMA_TP, GPT2_TP_FSDP, LLAMA_TP_SP, GPT2_TP_FSDP_SP],
                         ids=lambda c: c.cell_id)
def test_a_tensor_parallel_cell_trains_the_reference_model(records, cell):
    record = records[cell.cell_id]
    assert record["status"] == "ok", record["reason"]
    assert record["equivalence"]["passed"], record["equivalence"]


def _split_numel(model_name: str) -> int:
    """Elements of the tensors the plans split (every block matmul's weight, and the bias of
    the column-parallel ones), counted on an unsplit build."""
    column = {"c_attn", "c_fc", "q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"}
    row = {"c_proj", "o_proj", "down_proj"}
    total = 0
    for name, p in models.build(models.get_preset(model_name)).module.named_parameters():
        layer, kind = name.split(".")[-2:]
        if layer in column or (layer in row and kind == "weight"):
            total += p.numel()
    return total


@pytest.mark.parametrize("cell", [GPT2_TP, LLAMA_TP], ids=lambda c: c.cell_id)
def test_each_tp_rank_holds_half_the_split_weights_and_all_of_the_rest(records, cell):
    record = records[cell.cell_id]
    every_param = 4 * record["model"]["n_params"]  # fp32
    assert records[cell.reference().cell_id]["metrics"]["mem_breakdown_bytes"]["params"] == every_param
    split = 4 * _split_numel(cell.model)
    for rank in record["per_rank"]:  # the tracker counts each DTensor's local shard
        assert rank["mem_breakdown_bytes"]["params"] == split // 2 + (every_param - split)


def test_tp_communicates_two_all_reduces_per_block_each_way(records):
    record = records[GPT2_TP.cell_id]
    comm = record["metrics"]["comm_by_op"]
    # Forward: each row-parallel output; backward: the input gradient of attention and MLP.
    assert set(comm) == {"all_reduce"} and comm["all_reduce"]["count"] == 4 * 2
    activation_bytes = 4 * GPT2_TP.micro_batch * 32 * 64  # fp32 (batch, seq, hidden)
    assert comm["all_reduce"]["bytes"] == 8 * activation_bytes


def test_tp_fsdp_moves_the_analytic_bytes_its_root_gathered_once(records):
    """Tensor parallel's all-reduces in each group of 2, FSDP2's gathers and reduce-scatters
    over the 2 groups, as analytic_parallel._tp_comm counts them: every block gathered in
    forward and again in backward, the root (fully_shard's default for it) once (counted
    twice, the prediction was 1.138 of the measured all-gather)."""
    record = records[GPT2_TP_FSDP.cell_id]
    measured = {kind: c["bytes"] for kind, c in record["metrics"]["comm_by_op"].items()}
    predicted = record["predicted"]["analytic"]["comm_bytes_by_op"]
    assert set(measured) == {"all_reduce", "all_gather", "reduce_scatter"}
    assert measured == {kind: pytest.approx(predicted[kind]) for kind in measured}


@pytest.mark.parametrize("cell", [GPT2_TP, LLAMA_TP_SP], ids=lambda c: c.cell_id)
def test_the_trace_predicts_a_tp_cell_peak_to_the_byte_but_for_frees_on_gloos_threads(records, cell):
    """With loss_parallel too: DTensor's global-shape propagation of the split cross-entropy
    kept out of the traced step (harness/predict/traced.py)."""
    record = records[cell.cell_id]
    rank0 = record["per_rank"][0]
    # A buffer DTensor's collectives free on a gloo worker thread may be freed late, after the
    # step's peak (measure/memory.py "Frees on another thread"): on a busy host rank 0 once
    # measured 16,384 B over the trace, the 16,384 B it freed that way.
    moved = abs(rank0["peak_mem_bytes"] - record["predicted"]["traced"]["peak_bytes"])
    assert moved <= rank0["async_freed_bytes"], (moved, rank0["async_freed_bytes"])


@pytest.mark.parametrize("cell, expected", [(GPT2_TP_BF16, 98_304), (GPT2_TP_CKPT, 163_840)],
                         ids=["bf16", "ckpt_full"])
def test_tp_all_reduce_bytes_follow_autocast_widths_and_the_recompute(records, cell, expected):
    # bf16: forward all-reduces in bf16, backward ones fp32 (the blocks' inputs stay fp32 under
    # autocast); full checkpointing: the recompute repeats the attention's forward all-reduce.
    record = records[cell.cell_id]
    assert record["status"] == "ok" and record["equivalence"]["passed"], record["reason"]
    assert record["metrics"]["comm_by_op"]["all_reduce"]["bytes"] == expected
    assert record["predicted"]["analytic"]["comm_bytes_per_step"] == expected


@pytest.mark.parametrize("cell", [LLAMA_TP_SP, GPT2_TP_FSDP_SP], ids=lambda c: c.cell_id)
def test_sequence_and_loss_parallel_move_the_analytic_bytes_in_the_analytic_calls(records, cell):
    """Each all-reduce of activations becomes a reduce-scatter and an all-gather; the norms'
    partial gradients are all-reduced once each, the embedding's output and the split loss's
    three per-token statistics once a micro-step (analytic_parallel._tp_activation_collectives):
    to the byte, and for tp (no FSDP calls beside them) to the call."""
    comm = records[cell.cell_id]["metrics"]["comm_by_op"]
    predicted = records[cell.cell_id]["predicted"]["analytic"]["comm_bytes_by_op"]
    assert {kind: c["bytes"] for kind, c in comm.items()} == {kind: pytest.approx(predicted[kind]) for kind in comm}
    if cell.strategy.name == "tp":
        calls = {kind: sum(n for _, n in analytic_parallel.tp_activation_calls(cell, kind)) for kind in comm}
        assert {kind: c["count"] for kind, c in comm.items()} == calls
        assert calls == {"all_reduce": 5 + 1 + 3, "all_gather": 10, "reduce_scatter": 9}


def test_a_vocabulary_parallel_rank_holds_its_slice_of_the_untied_table_and_its_gradient(records):
    """llama-tiny's token table and head (512 × 64 each) split over 2 ranks: the embedding's
    backward computes the whole table's gradient on each rank, which the strategy cuts to the
    rank's slice as it is accumulated (it held 131,072 B for a 65,536 B slice before)."""
    held = records[LLAMA_TP_SP.cell_id]["per_rank"][0]["at_optimizer_step_bytes"]
    predicted = records[LLAMA_TP_SP.cell_id]["predicted"]["analytic"]["model_states_bytes"]
    unsplit = records[LLAMA_TP.cell_id]["per_rank"][0]["at_optimizer_step_bytes"]
    assert held["params"] == held["grads"] == predicted["params"] == unsplit["params"] - 2 * 512 * 64 * 4 // 2
