"""The megatron and cp strategies on a CPU-only host: why they are unsupported here (each
reason checked against the library where it can be), the cells and layouts they refuse, and
the HF -> Megatron weight copy (per tensor-parallel rank and per pipeline stage), with
Megatron's pipeline schedule, that lets the megatron cell keep the one HF reference."""

import contextlib
import importlib.util
import json
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from harness import markers, strategies, suites
from harness.config import CellSpec, StrategySpec
from harness.models import sources
from harness.strategies import context_parallel, megatron
from model_configs import write  # tests/ is on sys.path (rootdir conftest, prepend import mode)

HAVE_MEGATRON = (importlib.util.find_spec("megatron") is not None
                 and importlib.util.find_spec("megatron.core") is not None)


def cell(strategy: str, model: str = "llama-tiny", precision: str = "fp32", checkpointing: str = "none",
         attention: str = "sdpa", world_size: int = 2, **strategy_options) -> CellSpec:
    return CellSpec(model=model, strategy=StrategySpec(name=strategy, precision=precision, checkpointing=checkpointing,
                                                       **strategy_options),
                    attention=attention, world_size=world_size)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init_gloo(rank: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)


# --- megatron ---------------------------------------------------------------------------

def test_megatron_is_unsupported_without_megatron_core_and_says_how_to_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name.split(".")[0] == "megatron" else real(name, *a))
    why = strategies.unsupported_reason(cell("megatron", attention="eager"), "cuda")
    assert why == "megatron-core is not installed: pip install megatron-core"


def test_megatron_is_unsupported_on_cpu_and_runs_on_cuda_when_installed(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: object() if name.split(".")[0] == "megatron" else real(name, *a))
    c = cell("megatron", attention="eager")
    assert strategies.unsupported_reason(c, "cpu") == megatron.CPU_REASON
    assert strategies.unsupported_reason(c, "cuda") is None


@pytest.mark.parametrize("options, refusal", [
    (dict(precision="bf16"), "precision=bf16: Megatron's bf16 recipe"),
    (dict(precision="fp16"), "precision=fp16: Megatron's fp16 needs its own loss scaler"),
    (dict(checkpointing="selective"), "checkpointing=selective: Megatron's selective recompute"),
    (dict(model="bert-tiny"), "model bert-tiny: Megatron's GPTModel is built here for the gpt2 and llama layouts"),
    (dict(attention="sdpa"), "attention=sdpa: Megatron-core's local layer spec computes attention unfused"),
    (dict(world_size=3, tp_degree=3), "n_heads=4 is not divisible by the tensor-parallel size tp_degree=3"),
    (dict(world_size=4, tp_degree=4), "n_kv_heads=2 is not divisible by the tensor-parallel size tp_degree=4"),
    (dict(model="gpt2-124m", world_size=5, tp_degree=1, pp_degree=5),
     "model gpt2-124m: its 12 layers do not split evenly into pp_degree=5 stages"),
])
def test_megatron_refuses_what_it_cannot_express(options, refusal):
    why = strategies.incompatibility(cell("megatron", **{"attention": "eager", **options}))
    assert why is not None and refusal in why


@pytest.mark.parametrize("strategy, attention, engine", [("megatron", "eager", "GPTModel as built here"),
                                                         ("cp", "sdpa", "the ring attention")])
def test_a_sliding_window_the_sequence_passes_is_refused_where_the_engine_attends_to_all(
        tmp_path, strategy, attention, engine):
    spec = sources.resolve(str(write(tmp_path, "mistral", sliding_window=4)))
    cells = [CellSpec(model=spec, strategy=StrategySpec(name=strategy), attention=attention, seq_len=seq)
             for seq in (16, 4)]
    why = [strategies.incompatibility(c) for c in cells]
    assert why[0] is not None and f"4-token sliding window, which 16 tokens pass; {engine}" in why[0]
    assert why[1] is None  # 4 tokens see their whole context through a 4-token window


@pytest.mark.parametrize("model", ["gpt2-tiny", "llama-tiny"])
def test_megatron_accepts_the_tiny_decoders_with_eager_attention(model):
    assert strategies.incompatibility(cell("megatron", model=model, attention="eager")) is None
    assert strategies.incompatibility(cell("megatron", model=model, attention="eager", checkpointing="full")) is None


@pytest.mark.parametrize("layout, world_size, error", [
    (dict(), 3, "world_size=3 with megatron tp_degree=2 × pp_degree=1: the world size must be a multiple of"
                " tp_degree × pp_degree (2, 4, ...)"),
    (dict(tp_degree=2, pp_degree=2), 2, "world_size=2 with megatron tp_degree=2 × pp_degree=2"),
    (dict(tp_degree=2, pp_degree=2), 6, "world_size=6 with megatron tp_degree=2 × pp_degree=2"),
    (dict(tp_degree=1, pp_degree=4), 4, "pp_degree=4 with model gpt2-tiny: more pipeline stages than its 2 layers"),
    (dict(tp_degree=0), 2, "tp_degree=0: must be a positive integer"),
    (dict(pp_degree=0), 2, "pp_degree=0: must be a positive integer"),
    (dict(pp_microbatches=4), 2, "pp_microbatches=4: applies to the pipeline strategies (pp_1f1b, pp_gpipe,"
                                 " pp_interleaved_1f1b) and megatron with pp_degree > 1 only"),
    (dict(tp_degree=1, pp_degree=2, accumulation=2), 2, "accumulation=2 with megatron: a pipeline accumulates"),
])
def test_megatron_layouts_that_do_not_fit_are_refused_in_one_line(layout, world_size, error):
    with pytest.raises(ValueError) as refused:
        cell("megatron", model="gpt2-tiny", attention="eager", world_size=world_size, **layout)
    assert error in str(refused.value) and "\n" not in str(refused.value)


@pytest.mark.parametrize("name, option", [("ddp", "pp_degree"), ("tp", "tp_degree"), ("pp_1f1b", "pp_degree")])
def test_layout_options_are_refused_where_they_change_nothing(name, option):
    with pytest.raises(ValueError, match=f"{option}=2: applies to strateg"):
        StrategySpec(name=name, **{option: 2})


@pytest.mark.parametrize("layout, world_size, data_parallel, global_batch", [
    (dict(), 2, 1, 2),  # tensor parallel over both ranks (the default, as before)
    (dict(), 4, 2, 4),  # tp2 × 2 data-parallel groups
    (dict(tp_degree=1, pp_degree=2), 2, 1, 2 * 4),  # one pipeline of 4 micro-batches
    (dict(tp_degree=2, pp_degree=2), 4, 1, 2 * 4),
    (dict(tp_degree=2, pp_degree=2, pp_microbatches=2), 8, 2, 2 * 2 * 2),
    (dict(tp_degree=1, accumulation=2), 2, 2, 2 * 2 * 2),  # plain DDP of GPTModel, accumulating
])
def test_megatron_data_parallel_size_and_global_batch_follow_the_layout(layout, world_size, data_parallel,
                                                                         global_batch):
    c = cell("megatron", model="gpt2-tiny", attention="eager", world_size=world_size, **layout)
    assert c.strategy.data_parallel_size(world_size) == data_parallel
    assert c.global_batch == global_batch
    assert c.reference().micro_batch == global_batch
    assert CellSpec.from_dict(c.to_dict()) == c


def test_megatron_cell_ids_show_the_layout():
    def cell_id(world_size, **layout):
        return cell("megatron", model="gpt2-tiny", attention="eager", world_size=world_size, **layout).cell_id

    assert cell_id(2) == "gpt2-tiny/megatron/fp32/ckpt_none/tp2/pp1/attn_eager/mb2/ws2/seed0"
    assert (cell_id(2, tp_degree=1, pp_degree=2)
            == "gpt2-tiny/megatron/fp32/ckpt_none/tp1/pp2/pmb4/attn_eager/mb2/ws2/seed0")
    ids = [cell_id(4), cell_id(4, tp_degree=1), cell_id(4, pp_degree=2), cell_id(4, pp_degree=2, pp_microbatches=8),
           cell_id(4, tp_degree=1, pp_degree=2)]
    assert len(set(ids)) == len(ids)


def _run_without_cuda() -> None:
    """Stand-ins for megatron-core's CUDA-only pieces of a forward (module docstring of
    harness/strategies/megatron.py), so that the copied weights can be checked on the CPU.
    Only in this test's child processes: the strategy itself refuses the CPU."""
    from megatron.core import tensor_parallel
    from megatron.core.fusions import fused_softmax
    from megatron.core.pipeline_parallel import schedules

    class NoRngTracker:
        def fork(self, *args, **kwargs):
            return contextlib.nullcontext()

    torch.cuda.current_device = lambda: "cpu"  # GlobalMemoryBuffer's attention buffer, p2p receive buffers
    tensor_parallel.get_cuda_rng_tracker = lambda *args, **kwargs: NoRngTracker()
    fused_softmax.get_default_causal_mask = lambda sq: torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)
    torch.Tensor.cuda = lambda self, *args, **kwargs: self  # the last stage's copy of tied embeddings
    torch.cuda.synchronize = lambda *args, **kwargs: None  # after batched p2p (batch_p2p_sync)

    class TorchWithCpuZeros:  # the schedule's token counter, made with device="cuda"
        def __getattr__(self, name):
            return getattr(torch, name)

        @staticmethod
        def zeros(*args, device=None, **kwargs):
            return torch.zeros(*args, **kwargs)

    schedules.torch = TorchWithCpuZeros()


MODELS = ("gpt2-tiny", "llama-tiny")


def _built(name: str):
    from harness import models

    return models.build(models.get_preset(name), seed=0, attention="eager")


def _batch(built):
    return built.make_batch(torch.Generator().manual_seed(0), 2)


def _tensor_parallel_losses(rank: int) -> dict[str, float]:
    """Layout tp2 × pp1: each rank's loss of the whole batch through its half of the model."""
    from megatron.core import parallel_state

    megatron.use_layout(2, 1)
    losses = {}
    for name in MODELS:
        built = _built(name)
        config = megatron.transformer_config(built.spec, built.module.config, tp_size=2)
        gpt = megatron.build_gpt_model(built.spec, built.module.config, config)
        megatron.copy_hf_weights(built.module, gpt, built.spec, tp_rank=parallel_state.get_tensor_model_parallel_rank(),
                                 tp_size=2)
        losses[name] = built.loss(megatron.MegatronCausalLM(gpt), _batch(built)).item()
    return losses


def _pipeline_losses(rank: int) -> dict:
    """Layout tp1 × pp2: stage 0 embeds and runs layer 0, sends its activations with Megatron's
    p2p to stage 1, which runs layer 1, the head and the loss (the strategy's forward_step)."""
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

    megatron.use_layout(1, 2)
    out = {"losses": {}, "layers": {}}
    for name in MODELS:
        built = _built(name)
        config = megatron.transformer_config(built.spec, built.module.config, tp_size=1, pp_size=2)
        gpt = megatron.build_gpt_model(built.spec, built.module.config, config)
        megatron.copy_hf_weights(built.module, gpt, built.spec, tp_rank=0, tp_size=1)
        out["layers"][name] = [layer.layer_number for layer in gpt.decoder.layers]
        batch = _batch(built)
        p2p = P2PCommunicator(pp_group=parallel_state.get_pipeline_model_parallel_group(), config=config)
        first, last = parallel_state.is_pipeline_first_stage(), parallel_state.is_pipeline_last_stage()
        seq, rows = batch["input_ids"].shape[1], batch["input_ids"].shape[0]
        gpt.set_input_tensor(p2p.recv_forward((seq, rows, built.spec.hidden), is_first_stage=first))
        output, loss_func = megatron.forward_step(iter([(batch["input_ids"], batch["labels"])]), gpt)
        p2p.send_forward(output, is_last_stage=last)
        if last:
            loss, reported = loss_func(output)
            out["losses"][name] = [loss.item(), reported["loss"].item()]
    return out


def _scheduled_step(rank: int) -> dict:
    """Layout tp1 × pp2, the strategy's step through Megatron's 1F1B schedule (2 micro-batches
    of 2 samples, activations and their gradients sent by its p2p): the last stage's loss and
    each stage's gradient of its layer's MLP output weight. (Without Megatron's DDP, whose
    reductions are CUDA-only: with one data-parallel rank they have nothing to add.)"""
    from megatron.core import parallel_state

    megatron.use_layout(1, 2)
    built = _built("llama-tiny")
    config = megatron.transformer_config(built.spec, built.module.config, tp_size=1, pp_size=2)
    gpt = megatron.build_gpt_model(built.spec, built.module.config, config)
    megatron.copy_hf_weights(built.module, gpt, built.spec, tp_rank=0, tp_size=1)
    c = cell("megatron", attention="eager", tp_degree=1, pp_degree=2, pp_microbatches=2)
    step = megatron._PipelineStep(gpt, c, holds_loss=parallel_state.is_pipeline_last_stage())
    loss = step(built.make_batch(torch.Generator().manual_seed(0), 4))
    (layer,) = gpt.decoder.layers
    return {"loss": None if loss is None else loss.item(), "fc2_grad": layer.mlp.linear_fc2.weight.grad.tolist()}


def _megatron_worker(rank: int, port: int, out_dir: str) -> None:
    _init_gloo(rank, port)
    from megatron.core import parallel_state

    _run_without_cuda()
    result = {"tp": _tensor_parallel_losses(rank)}
    tp_group = parallel_state.get_tensor_model_parallel_group()
    megatron.use_layout(2, 1)  # the same layout: the groups stay
    result["same_layout_kept_groups"] = parallel_state.get_tensor_model_parallel_group() is tp_group
    result["pp"] = _pipeline_losses(rank)
    result["schedule"] = _scheduled_step(rank)
    result["pp_sizes"] = [parallel_state.get_tensor_model_parallel_world_size(),
                          parallel_state.get_pipeline_model_parallel_world_size(),
                          parallel_state.get_data_parallel_world_size()]
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def megatron_ranks(tmp_path_factory):
    """Both layouts in one pair of processes, tp2 × pp1 then tp1 × pp2, as a worker that runs
    cells of both would."""
    out = tmp_path_factory.mktemp("megatron")
    mp.spawn(_megatron_worker, args=(_free_port(), str(out)), nprocs=2)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def _hf_loss(name: str) -> float:
    built = _built(name)
    return built.loss(built.module, _batch(built)).item()


@pytest.mark.skipif(not HAVE_MEGATRON, reason="megatron-core is an optional extra: pip install megatron-core")
@pytest.mark.parametrize("name", MODELS)
def test_weights_copied_into_a_tensor_parallel_gpt_model_give_the_hf_loss(megatron_ranks, name):
    reference = _hf_loss(name)
    for rank in megatron_ranks:  # each rank holds half of every split weight: the slices must fit together
        assert rank["tp"][name] == pytest.approx(reference, rel=1e-6)


@pytest.mark.skipif(not HAVE_MEGATRON, reason="megatron-core is an optional extra: pip install megatron-core")
@pytest.mark.parametrize("name", MODELS)
def test_weights_copied_into_pipeline_stages_give_the_hf_loss(megatron_ranks, name):
    first, last = (rank["pp"] for rank in megatron_ranks)
    assert (first["layers"][name], last["layers"][name]) == ([1], [2])  # one layer per stage, in order
    assert name not in first["losses"]  # the loss is the last stage's
    loss, reported = last["losses"][name]
    assert loss == pytest.approx(_hf_loss(name), rel=1e-6)
    assert reported == loss


@pytest.mark.skipif(not HAVE_MEGATRON, reason="megatron-core is an optional extra: pip install megatron-core")
def test_a_worker_keeps_the_process_groups_of_its_layout_and_remakes_them_for_another(megatron_ranks):
    for rank in megatron_ranks:
        assert rank["same_layout_kept_groups"] is True
        assert rank["pp_sizes"] == [1, 2, 1]


# --- cp ---------------------------------------------------------------------------------

def test_cp_is_unsupported_on_cpu_only():
    c = cell("cp")
    assert strategies.unsupported_reason(c, "cpu") == context_parallel.CPU_REASON
    assert strategies.unsupported_reason(c, "cuda") is None


def _cpu_ring_attention_worker(rank: int, port: int, out_dir: str) -> None:
    _init_gloo(rank, port)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel as torch_context_parallel

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 8, 4, generator=generator) for _ in range(3))
    try:
        with torch_context_parallel(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2]):
            torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        error = ""
    except NotImplementedError as e:
        error = str(e)
    with open(os.path.join(out_dir, f"rank{rank}.txt"), "w") as f:
        f.write(error)
    dist.destroy_process_group()


def test_cpu_sdpa_has_no_ring_attention_as_the_reason_says(tmp_path):
    """If torch learns CPU context parallel, this fails: then make cp run on the CPU."""
    mp.spawn(_cpu_ring_attention_worker, args=(_free_port(), str(tmp_path)), nprocs=2)
    for r in range(2):
        error = (tmp_path / f"rank{r}.txt").read_text()
        assert "aten._scaled_dot_product_flash_attention_for_cpu.default does not have a sharding strategy" in error
    assert "_scaled_dot_product_flash_attention_for_cpu" in context_parallel.CPU_REASON


@pytest.mark.parametrize("options, refusal", [
    (dict(model="gpt2-tiny"), "model gpt2-tiny: context parallel is wired for the llama layout only"),
    (dict(attention="eager"), "attention=eager: context parallel replaces SDPA"),
    (dict(world_size=3), "seq_len=32 must be divisible by 2 x world_size = 6"),
    (dict(precision="fp16"), "precision=fp16: fp16 needs the GradScaler"),
])
def test_cp_refuses_what_it_cannot_express(options, refusal):
    why = strategies.incompatibility(cell("cp", **options))
    assert why is not None and refusal in why


def test_cp_accepts_llama_with_sdpa():
    assert strategies.incompatibility(cell("cp")) is None
    assert strategies.incompatibility(cell("cp", precision="bf16", checkpointing="full")) is None


def test_cp_targets_are_shifted_on_the_whole_sequence():
    ids = torch.tensor([[5, 6, 7, 8]])
    assert context_parallel._shifted_targets(ids).tolist() == [[6, 7, 8, context_parallel.IGNORE_INDEX]]


@pytest.mark.parametrize("layout, world_size, families", [
    (dict(), 2, {"tp"}),
    (dict(tp_degree=1, pp_degree=2), 2, {"pp"}),
    (dict(tp_degree=2, pp_degree=2), 4, {"tp", "pp"}),
    (dict(tp_degree=1), 2, set()),  # DDP of GPTModel: neither
])
def test_megatron_markers_follow_its_layout(layout, world_size, families):
    c = cell("megatron", model="gpt2-tiny", attention="eager", world_size=world_size, **layout)
    assert set(markers.markers_of(c)) & {"tp", "pp"} == families


@pytest.mark.parametrize("world_size, layouts", [
    (2, {(2, 1), (1, 2)}),
    (3, set()),  # no layout of 2-rank groups fits
    (4, {(2, 1), (2, 2)}),
    (6, {(2, 1), (1, 2)}),  # a two-stage pipeline of single ranks: 6 does not divide by tp2 × pp2
])
def test_default_suite_has_the_megatron_layouts_its_world_size_forms(world_size, layouts):
    cells = [c for c in suites.cells_of("default", world_size) if c.strategy.name == "megatron"]
    assert {(c.strategy.tp_degree, c.strategy.pp_degree) for c in cells} == layouts
    assert all(c.reference().cell_id in {r.cell_id for r in suites.cells_of("default", world_size)} for c in cells)


@pytest.mark.skipif(not HAVE_MEGATRON, reason="megatron-core is an optional extra: pip install megatron-core")
def test_the_pipeline_schedule_step_gives_the_hf_loss_and_gradients(megatron_ranks):
    built = _built("llama-tiny")
    loss = built.loss(built.module, built.make_batch(torch.Generator().manual_seed(0), 4))
    loss.backward()
    first, last = (rank["schedule"] for rank in megatron_ranks)
    assert first["loss"] is None and last["loss"] == pytest.approx(loss.item(), rel=1e-6)
    for stage, layer in zip((first, last), built.module.model.layers):
        torch.testing.assert_close(torch.tensor(stage["fc2_grad"]), layer.mlp.down_proj.weight.grad,
                                   rtol=1e-5, atol=1e-7)
