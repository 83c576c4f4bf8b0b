"""The optimizer axis (harness/features/optimizers.py), in one process: each optimizer builds
and steps, 8-bit state is smaller than AdamW's, and the strategies refuse what does not
compose with the reason observed."""

from __future__ import annotations

import warnings

import pytest
import torch

from harness import strategies
from harness.config import CellSpec, StrategySpec
from harness.features import optimizers


def _params() -> list[torch.nn.Parameter]:
    torch.manual_seed(0)
    # One matrix large enough for 8-bit state (bitsandbytes keeps tensors under 4096
    # elements in 32-bit), one small vector.
    return [torch.nn.Parameter(torch.randn(128, 64)), torch.nn.Parameter(torch.randn(64))]


def _step(optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter]) -> None:
    loss = sum((p**2).sum() for p in params)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def _state_bytes(optimizer: torch.optim.Optimizer) -> int:
    return sum(t.numel() * t.element_size() for state in optimizer.state.values()
               for t in state.values() if torch.is_tensor(t))


@pytest.mark.parametrize("name", ["adamw", "adam8bit", "adamw8bit", "adafactor", "sgd"])
def test_each_optimizer_builds_and_steps(name):
    params = _params()
    before = [p.detach().clone() for p in params]
    optimizer = optimizers.make(params, name, lr=1e-2)
    cls, kwargs = optimizers.optimizer_class_and_kwargs(name, 1e-2)
    assert isinstance(optimizer, cls) and kwargs == {"lr": 1e-2, **({"momentum": 0.9} if name == "sgd" else {})}
    _step(optimizer, params)
    assert all(not torch.equal(p, b) for p, b in zip(params, before)), f"{name} did not update"
    assert all(torch.isfinite(p).all() for p in params)


def test_unknown_optimizer_is_refused_with_the_choices():
    with pytest.raises(ValueError, match="adafactor"):
        optimizers.optimizer_class_and_kwargs("lion", 1e-3)


def test_8bit_adafactor_and_sgd_state_is_smaller_than_adamw():
    sizes = {}
    for name in ("adamw", "adam8bit", "adafactor", "sgd"):
        params = _params()
        optimizer = optimizers.make(params, name, 1e-3)
        _step(optimizer, params)
        sizes[name] = _state_bytes(optimizer)
    param_bytes = sum(p.numel() * p.element_size() for p in _params())
    assert sizes["adamw"] >= 2 * param_bytes
    # uint8 codes for both moments of the matrix (2 bytes/param vs 8), plus absmax and qmaps.
    assert sizes["adam8bit"] < 0.5 * sizes["adamw"]
    assert sizes["adafactor"] < 0.25 * sizes["adamw"]
    assert sizes["sgd"] == param_bytes  # one momentum buffer per parameter, no step counter


def test_paged_optimizer_falls_back_on_cpu_and_the_cell_says_so():
    params = _params()
    optimizer = optimizers.make(params, "paged_adamw8bit", 1e-3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _step(optimizer, params)
    # If bitsandbytes ever pages on CPU (or stops saying it does not), revisit PAGED_ON_CPU.
    assert any("Paged optimizers are not supported on CPU" in str(w.message) for w in caught)
    cell = CellSpec(model="gpt2-tiny", strategy=StrategySpec(name="ddp", optimizer="paged_adamw8bit"))
    assert "falls back to the non-paged optimizer" in strategies.unsupported_reason(cell, "cpu")
    assert strategies.unsupported_reason(cell, "cuda") is None


def _refusal(strategy: str, optimizer: str, **kw) -> str | None:
    world = 1 if strategy == "single" else 2
    return strategies.incompatibility(
        CellSpec(model="gpt2-tiny", world_size=world, strategy=StrategySpec(name=strategy, optimizer=optimizer, **kw)))


@pytest.mark.parametrize("strategy", ["single", "ddp", "zero1", "fairscale_oss", "fairscale_sdp"])
@pytest.mark.parametrize("optimizer", optimizers.NAMES)
def test_replicated_and_per_tensor_sharded_strategies_take_every_optimizer(strategy, optimizer):
    assert _refusal(strategy, optimizer) is None


@pytest.mark.parametrize("strategy", ["fsdp_full", "fsdp_grad_op", "fsdp_hybrid"])
@pytest.mark.parametrize("optimizer", ["adam8bit", "adamw8bit", "paged_adamw8bit"])
def test_fsdp2_refuses_8bit_optimizers(strategy, optimizer):
    assert "do not take DTensor parameters" in _refusal(strategy, optimizer)


def test_fsdp2_refuses_adafactor():
    assert "Sharding propagation failed" in _refusal("fsdp_full", "adafactor")


@pytest.mark.parametrize("strategy", ["fsdp1_full", "fsdp1_no_shard", "fairscale_fsdp"])
def test_flat_parameter_strategies_take_8bit_but_refuse_adafactor(strategy):
    assert _refusal(strategy, "adamw8bit") is None
    assert "unfactored second moment" in _refusal(strategy, "adafactor")


def test_fairscale_takes_fp16_and_sdp_needs_cuda_for_its_sharded_scaler():
    sdp = CellSpec(model="gpt2-tiny", strategy=StrategySpec(name="fairscale_sdp", precision="fp16"))
    assert strategies.incompatibility(sdp) is None
    assert "ShardedGradScaler" in strategies.unsupported_reason(sdp, "cpu")
    assert strategies.unsupported_reason(sdp, "cuda") is None
    assert strategies.incompatibility(
        CellSpec(model="gpt2-tiny", strategy=StrategySpec(name="fairscale_oss", precision="fp16"))) is None


def test_quantized_optimizers_get_their_stated_tolerance():
    from harness import equivalence

    def tol(**kw):
        return equivalence.tolerance(CellSpec(model="gpt2-tiny", strategy=StrategySpec(name="fsdp1_full", **kw)))

    assert tol(optimizer="adam8bit") == equivalence.TOLERANCE_QUANTIZED_OPTIMIZER
    assert tol(optimizer="adafactor") == equivalence.TOLERANCE_FP32  # not quantized
    assert tol(optimizer="adam8bit", precision="bf16") == equivalence.TOLERANCE_LOW_PRECISION
    # Still far below what a wrong strategy costs (unsynchronised ranks: 2e-3).
    assert equivalence.TOLERANCE_QUANTIZED_OPTIMIZER * 10 < 2e-3


def test_the_optimizer_in_backward_updates_as_one_step_would_and_frees_every_gradient():
    """features/optimizer_in_backward.py: each parameter stepped in its post-accumulate hook
    (one AdamW over all of them) gives, bitwise, what one step after backward gives, and no
    gradient is left when backward returns."""
    from harness.features import optimizer_in_backward

    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))

    plain, fused = model(), model()
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    loop, real = optimizer_in_backward.in_backward(fused.parameters(), lambda ps: torch.optim.AdamW(ps, lr=1e-2))
    for step in range(3):
        x = torch.randn(5, 8, generator=torch.Generator().manual_seed(step))
        plain(x).square().sum().backward()
        plain_opt.step()
        plain_opt.zero_grad()
        fused(x).square().sum().backward()
        assert all(p.grad is None for p in fused.parameters())
        loop.step()  # nothing left to do
    assert all(torch.equal(a, b) for a, b in zip(plain.parameters(), fused.parameters()))
    assert loop.state is real.state and len(real.state) == 4  # the real state, for the memory tracker


@pytest.mark.skipif(torch.accelerator.is_available(), reason="the CPU-only case")
def test_ddps_optimizer_in_backward_needs_an_accelerator_as_the_unsupported_reason_says():
    """DDP's optimizer-in-backward hook ends backward by waiting on
    torch.accelerator.current_stream(); on a host without an accelerator that raises, which
    the DDP cell's unsupported reason quotes (a harness run of the cell fails with it)."""
    from harness.features import optimizer_in_backward

    with pytest.raises(RuntimeError) as raised:
        torch.accelerator.current_stream()
    assert str(raised.value).rstrip(".") in optimizer_in_backward.ON_CPU


@pytest.mark.parametrize("name", ["lamb", "lamb8bit"])
def test_lamb_state_is_its_formula_and_sharding_engines_refuse_it(name):
    """bitsandbytes' LAMB state after a step against formulas.lamb_state_bytes (the moments,
    8-bit block-wise for the large tensors under lamb8bit, and a norm per tensor); the engines
    that hand the optimizer shards refuse it, naming the trust ratio."""
    from harness import strategies
    from harness.config import CellSpec, StrategySpec
    from harness.features import optimizers
    from harness.predict.formulas import lamb_state_bytes

    model = torch.nn.Sequential(torch.nn.Linear(128, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    optimizer = optimizers.make(model.parameters(), name, 1e-3)
    model(torch.randn(4, 128)).sum().backward()
    optimizer.step()
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for state in optimizer.state.values() for t in state.values() if isinstance(t, torch.Tensor)}
    shapes = [tuple(p.shape) for p in model.parameters()]
    assert sum(storages.values()) == lamb_state_bytes(shapes, eight_bit=name == "lamb8bit")
    for strategy in ("fsdp_full", "fsdp1_full", "deepspeed_zero2"):
        cell = CellSpec(model="gpt2-tiny", strategy=StrategySpec(name=strategy, optimizer=name))
        why = strategies.incompatibility(cell)
        assert why is not None and "optimizer" in why, (strategy, why)
    assert "trust ratio" in strategies.incompatibility(
        CellSpec(model="gpt2-tiny", strategy=StrategySpec(name="deepspeed_zero2", optimizer=name)))


def test_deepspeeds_fused_lamb_is_refused_on_the_cpu_with_what_loading_it_raises():
    from harness.predict.analytic_data_parallel import optimizer_state_bytes

    with pytest.raises(ValueError) as raised:
        optimizers.make(_params(), "fused_lamb", 1e-3)
    assert f"'{raised.value}'" in optimizers.FUSED_LAMB_ON_CPU
    cell = CellSpec(model="gpt2-tiny", strategy=StrategySpec(name="ddp", optimizer="fused_lamb"))
    assert strategies.unsupported_reason(cell, "cpu").endswith(optimizers.FUSED_LAMB_ON_CPU)
    assert strategies.unsupported_reason(cell, "cuda") is None
    # Its state (deepspeed/ops/lamb/fused_lamb.py): exp_avg and exp_avg_sq like each parameter,
    # the step count a Python int; no per-tensor norm as bitsandbytes keeps.
    assert optimizer_state_bytes([(64, 128), (64,)], "fused_lamb") == 8 * (64 * 128 + 64)
    assert "trust ratio" in strategies.incompatibility(
        CellSpec(model="gpt2-tiny", strategy=StrategySpec(name="deepspeed_zero2", optimizer="fused_lamb")))
