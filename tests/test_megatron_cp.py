"""The megatron and cp strategies on a CPU-only host: why they are unsupported here (each
reason checked against the library where it can be), the cells they refuse, and the
HF -> Megatron weight copy that lets the megatron cell keep the one HF reference."""

import contextlib
import importlib.util
import json
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from harness import strategies
from harness.config import CellSpec, StrategySpec
from harness.strategies import context_parallel, megatron

HAVE_MEGATRON = importlib.util.find_spec("megatron") is not None and importlib.util.find_spec("megatron.core") is not None


def cell(strategy: str, model: str = "llama-tiny", precision: str = "fp32", checkpointing: str = "none",
         attention: str = "sdpa", world_size: int = 2) -> CellSpec:
    return CellSpec(model=model, strategy=StrategySpec(name=strategy, precision=precision, checkpointing=checkpointing),
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
    (dict(model="bert-tiny"), "model bert-tiny: Megatron's GPTModel is built here for gpt2, llama only"),
    (dict(attention="sdpa"), "attention=sdpa: Megatron-core's local layer spec computes attention unfused"),
    (dict(world_size=3), "n_heads=4 is not divisible by the tensor-parallel size 3"),
])
def test_megatron_refuses_what_it_cannot_express(options, refusal):
    why = strategies.incompatibility(cell("megatron", **{"attention": "eager", **options}))
    assert why is not None and refusal in why


@pytest.mark.parametrize("model", ["gpt2-tiny", "llama-tiny"])
def test_megatron_accepts_the_tiny_decoders_with_eager_attention(model):
    assert strategies.incompatibility(cell("megatron", model=model, attention="eager")) is None
    assert strategies.incompatibility(cell("megatron", model=model, attention="eager", checkpointing="full")) is None


def _run_without_cuda() -> None:
    """Stand-ins for megatron-core's three CUDA-only pieces of a forward (module docstring of
    harness/strategies/megatron.py), so that the copied weights can be checked on the CPU.
    Only in this test's child processes: the strategy itself refuses the CPU."""
    from megatron.core import tensor_parallel
    from megatron.core.fusions import fused_softmax

    class NoRngTracker:
        def fork(self, *args, **kwargs):
            return contextlib.nullcontext()

    torch.cuda.current_device = lambda: "cpu"  # GlobalMemoryBuffer's attention buffer
    tensor_parallel.get_cuda_rng_tracker = lambda *args, **kwargs: NoRngTracker()
    fused_softmax.get_default_causal_mask = lambda sq: torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)


def _megatron_loss_worker(rank: int, port: int, out_dir: str) -> None:
    _init_gloo(rank, port)
    from megatron.core import parallel_state

    from harness import models

    _run_without_cuda()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    losses = {}
    for name in ("gpt2-tiny", "llama-tiny"):
        built = models.build(models.get_preset(name), seed=0, attention="eager")
        config = megatron.transformer_config(built.spec, built.module.config, tp_size=2)
        gpt = megatron.build_gpt_model(built.spec, built.module.config, config)
        megatron.copy_hf_weights(built.module, gpt, built.spec, tp_rank=rank, tp_size=2)
        batch = built.make_batch(torch.Generator().manual_seed(0), 2)
        losses[name] = built.loss(megatron.MegatronCausalLM(gpt), batch).item()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(losses, f)
    dist.destroy_process_group()


@pytest.mark.skipif(not HAVE_MEGATRON, reason="megatron-core is an optional extra: pip install megatron-core")
def test_weights_copied_into_a_tensor_parallel_gpt_model_give_the_hf_loss(tmp_path):
    from harness import models

    mp.spawn(_megatron_loss_worker, args=(_free_port(), str(tmp_path)), nprocs=2)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for name in ("gpt2-tiny", "llama-tiny"):
        built = models.build(models.get_preset(name), seed=0, attention="eager")
        reference = built.loss(built.module, built.make_batch(torch.Generator().manual_seed(0), 2)).item()
        for rank in ranks:  # each rank holds half of every split weight: the slices must fit together
            assert rank[name] == pytest.approx(reference, rel=1e-6)


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
    (dict(model="gpt2-tiny"), "model gpt2-tiny: context parallel is wired for the llama family only"),
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
