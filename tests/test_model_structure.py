"""Model structure axes: the attention implementation (eager vs sdpa), MHA / GQA / MQA presets,
and the mixture-of-experts family."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from harness import markers
from harness.config import CellSpec, StrategySpec
from harness.measure.memory import track_step_memory
from harness.models import ModelSpec, analytic_n_params, build, flops_per_sample, get_preset, param_layout

FP32_BYTES = 4


class _OpNames(TorchDispatchMode):
    """Records the aten ops a forward dispatches: which attention kernel really ran."""

    def __init__(self) -> None:
        super().__init__()
        self.names: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


def _first_loss_and_ops(name: str, attention: str) -> tuple[str, float, set[str]]:
    built = build(get_preset(name), attention=attention)
    batch = built.make_batch(torch.Generator().manual_seed(0), 2)
    with torch.no_grad(), _OpNames() as ops:
        loss = built.loss(built.module, batch)
    return built.attn_implementation, loss.item(), ops.names


@pytest.mark.parametrize("name", ["gpt2-tiny", "llama-tiny", "moe-tiny"])
def test_attention_choice_changes_the_kernel_not_the_loss(name: str) -> None:
    eager_impl, eager_loss, eager_ops = _first_loss_and_ops(name, "eager")
    sdpa_impl, sdpa_loss, sdpa_ops = _first_loss_and_ops(name, "sdpa")
    assert (eager_impl, sdpa_impl) == ("eager", "sdpa")
    # CPU's fused kernel under sdpa; eager builds the softmax of the scores itself.
    assert "aten._scaled_dot_product_flash_attention_for_cpu" in sdpa_ops
    assert "aten._softmax" in eager_ops and not any("scaled_dot_product" in op for op in eager_ops)
    assert eager_loss == pytest.approx(sdpa_loss, rel=1e-6)


def eager_minus_sdpa_bytes_per_layer(spec: ModelSpec, micro_batch: int, compute_bytes: int) -> int:
    """Activation bytes one layer holds for backward under eager beyond sdpa.

    ``compute_bytes``: 4 in fp32, 2 under bf16 / fp16 autocast. Per layer, b = micro-batch,
    a heads, s tokens, d = head_dim, kv key/value heads, eager keeps
    - the softmax output, b*a*s*s in fp32 always (HF calls softmax with dtype=float32; its
      backward needs only its output), plus, under autocast, the copy cast back to the compute
      dtype that the matmul with V keeps (in fp32 that cast is a no-op: the same tensor);
      no dropout mask at p=0;
    - with fewer k/v heads than query heads, the k and v that repeat_kv expanded to all a
      heads: 2*b*s*d*(a - kv) elements beyond the kv-head k and v both keep;
    while sdpa (torch's fused kernel, GQA native) keeps instead the row log-sum-exp, b*a*s fp32.
    """
    b, a, s, d, kv = micro_batch, spec.n_heads, spec.seq_len, spec.head_dim, spec.kv_heads
    cast_copy = 0 if compute_bytes == FP32_BYTES else compute_bytes
    probabilities = (FP32_BYTES + cast_copy) * b * a * s * s
    expanded_kv = compute_bytes * 2 * b * s * d * (a - kv)
    logsumexp = FP32_BYTES * b * a * s
    return probabilities + expanded_kv - logsumexp


def _activation_bytes_of_a_step(name: str, attention: str, micro_batch: int, dtype: torch.dtype) -> int:
    built = build(get_preset(name), attention=attention)
    optimizer = torch.optim.AdamW(built.module.parameters())
    generator = torch.Generator().manual_seed(0)

    def step() -> None:
        with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
            loss = built.loss(built.module, built.make_batch(generator, micro_batch))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    step()  # the optimizer makes its state on its first step
    with track_step_memory(built.module, optimizer, fsdp2=False, device=torch.device("cpu")) as probe:
        step()
    return probe.result().breakdown_bytes["activations"]


@pytest.mark.parametrize(("name", "dtype"), [
    ("gpt2-tiny", torch.float32), ("llama-tiny", torch.float32), ("llama-tiny-mqa", torch.float32),
    ("llama-tiny", torch.bfloat16),
], ids=["gpt2-tiny-fp32", "llama-tiny-fp32", "llama-tiny-mqa-fp32", "llama-tiny-bf16"])
def test_eager_holds_the_attention_probabilities(name: str, dtype: torch.dtype) -> None:
    """Measured at micro-batch 2 (2 layers): gpt2-tiny 63,488 B, llama-tiny (GQA) 96,256 B,
    llama-tiny-mqa 112,640 B in fp32; llama-tiny 112,640 B under bf16 autocast."""
    spec, micro_batch = get_preset(name), 2
    measured = (_activation_bytes_of_a_step(name, "eager", micro_batch, dtype)
                - _activation_bytes_of_a_step(name, "sdpa", micro_batch, dtype))
    assert measured == spec.n_layers * eager_minus_sdpa_bytes_per_layer(spec, micro_batch, dtype.itemsize)


@pytest.mark.parametrize(("name", "kv_heads", "marker"), [
    ("llama-tiny-mha", 4, "mha"), ("llama-tiny", 2, "gqa"), ("llama-tiny-mqa", 1, "mqa"),
])
def test_key_value_heads_of_the_presets(name: str, kv_heads: int, marker: str) -> None:
    spec = get_preset(name)
    built = build(spec)
    attention = built.module.model.layers[0].self_attn
    h, d = spec.hidden, spec.head_dim
    assert spec.n_heads == 4 and spec.kv_heads == kv_heads
    assert attention.q_proj.weight.shape == (spec.n_heads * d, h)
    assert attention.k_proj.weight.shape == attention.v_proj.weight.shape == (kv_heads * d, h)
    assert built.n_params == analytic_n_params(spec)
    assert marker in markers.markers_of(CellSpec(model=name, strategy=StrategySpec(name="ddp")))


def test_fewer_kv_heads_cost_fewer_parameters_by_the_kv_projections() -> None:
    h, d = 64, 16
    counts = [analytic_n_params(get_preset(n)) for n in ("llama-tiny-mha", "llama-tiny", "llama-tiny-mqa")]
    # Each k/v head fewer: two h x d projections fewer, in each of the 2 layers.
    assert counts[0] - counts[1] == 2 * 2 * 2 * h * d
    assert counts[1] - counts[2] == 2 * 1 * 2 * h * d


@pytest.mark.parametrize(("change", "message"), [
    (dict(n_experts=None), "n_experts=None: family 'moe' needs it; set n_experts"),
    (dict(top_k=None), "top_k=None: family 'moe' needs it; set top_k"),
    (dict(top_k=5), "top_k=5 must be at most n_experts=4"),
    (dict(n_experts=0), "n_experts=0 must be a positive integer"),
])
def test_moe_spec_validation(change: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(get_preset("moe-tiny"), **change)


@pytest.mark.parametrize("field", ["n_experts", "top_k"])
def test_expert_sizes_are_refused_outside_moe(field: str) -> None:
    with pytest.raises(ValueError, match=f"{field}=2 does not apply to family 'llama'; leave it None"):
        dataclasses.replace(get_preset("llama-tiny"), **{field: 2})


def test_moe_tiny_builds_and_trains_one_step() -> None:
    spec = get_preset("moe-tiny")
    built = build(spec)
    layer = built.module.model.layers[0]
    assert isinstance(layer, built.block_type)
    E, h, f = spec.n_experts, spec.hidden, spec.ffn
    assert layer.mlp.gate.weight.shape == (E, h)
    assert layer.mlp.experts.gate_up_proj.shape == (E, 2 * f, h)
    assert layer.mlp.experts.down_proj.shape == (E, h, f)
    assert built.n_params == analytic_n_params(spec)

    optimizer = torch.optim.AdamW(built.module.parameters(), lr=1e-2)
    batch = built.make_batch(torch.Generator().manual_seed(0), 4)
    first = built.loss(built.module, batch)
    first.backward()
    # The router learns without an auxiliary loss: the routing weights that scale the
    # experts' outputs carry its gradient.
    assert all(layer.mlp.gate.weight.grad.abs().sum() > 0 for layer in built.module.model.layers)
    optimizer.step()
    with torch.no_grad():
        assert built.loss(built.module, batch) < first


def test_moe_flops_count_only_the_routed_experts() -> None:
    spec = get_preset("moe-tiny")
    dense = dataclasses.replace(spec, top_k=spec.n_experts)  # every token through every expert
    L, h, f, T = spec.n_layers, spec.hidden, spec.ffn, spec.seq_len
    idle_experts = spec.n_experts - spec.top_k
    assert analytic_n_params(spec) == analytic_n_params(dense)
    assert flops_per_sample(dense) - flops_per_sample(spec) == 6 * L * idle_experts * 3 * h * f * T


def test_mixtral_8x7b_is_planned_on_the_meta_device() -> None:
    spec = get_preset("mixtral-8x7b")
    layout = param_layout(spec)
    assert layout.numel == analytic_n_params(spec) == 46_702_792_704
    V, h, L = spec.vocab_size, spec.hidden, spec.n_layers
    assert layout.root_numel == 2 * V * h + h  # token table, untied LM head, final norm
    assert layout.block_numel == (layout.numel - layout.root_numel) // L
    # Active parameters, the token table included as Mistral counts them: 12.9B.
    T = spec.seq_len
    active_matmul = flops_per_sample(spec) / T / 6 - 2 * L * h * T
    assert active_matmul + V * h == 12_879_925_248


