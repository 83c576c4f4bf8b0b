"""harness.models: seeded builds, seeded batches, split-equivalent losses, parameter counts, FLOPs."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from harness.models import (
    PRESETS,
    REAL_SIZE_PRESETS,
    ModelSpec,
    analytic_n_params,
    build,
    flops_per_sample,
    get_preset,
)

TINY = [name for name in PRESETS if name not in REAL_SIZE_PRESETS]


def state_equal(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.parametrize("name", TINY)
def test_build_is_seeded_and_leaves_global_rng_alone(name: str) -> None:
    spec = get_preset(name)
    before = torch.random.get_rng_state()
    first = build(spec, seed=1)
    assert torch.equal(torch.random.get_rng_state(), before)
    assert state_equal(first.module, build(spec, seed=1).module)
    assert not state_equal(first.module, build(spec, seed=2).module)


@pytest.mark.parametrize("name", TINY)
def test_make_batch_depends_on_generator_only(name: str) -> None:
    built = build(get_preset(name))
    first = built.make_batch(torch.Generator().manual_seed(7), 4)
    torch.rand(100)  # the global RNG moves; the batch must not
    again = built.make_batch(torch.Generator().manual_seed(7), 4)
    other = built.make_batch(torch.Generator().manual_seed(8), 4)
    assert first.keys() == again.keys()
    for key in first:
        assert first[key].shape[0] == 4
        assert torch.equal(first[key], again[key])
    assert any(not torch.equal(first[k], other[k]) for k in first)


@pytest.mark.parametrize("name", TINY)
def test_whole_batch_loss_is_mean_of_half_batch_losses(name: str) -> None:
    """What data-parallel equivalence rests on: the global batch sliced across 2 ranks."""
    built = build(get_preset(name))
    batch = built.make_batch(torch.Generator().manual_seed(0), 4)

    def whole_and_halves() -> tuple[torch.Tensor, torch.Tensor]:
        with torch.no_grad():
            halves = [built.loss(built.module, {k: v[r * 2:(r + 1) * 2] for k, v in batch.items()})
                      for r in range(2)]
            return built.loss(built.module, batch), torch.stack(halves).mean()

    if built.spec.has_batch_norm:
        # BatchNorm normalises each half by its own statistics: a different function in
        # training (measure/batch_norm.py), the same one under the running statistics.
        assert not torch.allclose(*whole_and_halves(), rtol=1e-6, atol=0)
        built.module.eval()
    torch.testing.assert_close(*whole_and_halves(), rtol=1e-6, atol=0)


def test_bert_masks_the_same_number_of_positions_in_every_sample() -> None:
    built = build(get_preset("bert-tiny"))
    labels = built.make_batch(torch.Generator().manual_seed(0), 8)["labels"]
    assert (labels != -100).sum(dim=1).tolist() == [round(0.15 * 32)] * 8


@pytest.mark.parametrize("name", TINY)
def test_backward_reaches_every_parameter(name: str) -> None:
    built = build(get_preset(name))
    built.loss(built.module, built.make_batch(torch.Generator().manual_seed(0), 2)).backward()
    assert all(p.grad is not None for p in built.module.parameters())


@pytest.mark.parametrize("name", TINY)
def test_block_type_and_counts(name: str) -> None:
    spec = get_preset(name)
    built = build(spec)
    assert sum(isinstance(m, built.block_type) for m in built.module.modules()) == spec.n_layers
    assert built.n_params == analytic_n_params(spec)
    assert built.flops_per_sample > 0


@pytest.mark.parametrize("name", REAL_SIZE_PRESETS)
def test_real_presets_are_sized_without_building(name: str) -> None:
    expected = {"gpt2-124m": 124_439_808, "llama-1b": 1_235_814_400, "llama3-8b": 8_030_261_248,
                "mixtral-8x7b": 46_702_792_704}
    n = analytic_n_params(PRESETS[name])
    assert n == expected.get(name, n) and n > 50_000_000


def test_gpt2_tiny_flops_by_hand() -> None:
    L, h, T, V = 2, 64, 32, 512
    block = 4 * h + (h * 3 * h + 3 * h) + (h * h + h) + (h * 4 * h + 4 * h) + (4 * h * h + h)
    n_body = L * block + 2 * h  # + final LayerNorm
    assert build(get_preset("gpt2-tiny")).n_params == n_body + V * h + T * h  # head tied: once
    n = n_body + V * h  # the tied LM head is a V x h matmul; the table lookups are out
    expected = (6 * n + 12 * L * h * T) * T  # H*Q = h
    assert build(get_preset("gpt2-tiny")).flops_per_sample == expected


def test_gpt2_124m_flops_include_the_tied_head() -> None:
    spec = get_preset("gpt2-124m")
    L, h, T, V = 12, 768, 1024, 50257
    tables = V * h + T * h  # token and position lookups
    n = analytic_n_params(spec) - tables + V * h
    assert flops_per_sample(spec) == (6 * n + 12 * L * h * T) * T


@pytest.mark.parametrize("name", ["llama-tiny", "llama-1b", "llama3-8b"])
def test_tied_and_untied_head_have_the_same_flops(name: str) -> None:
    spec = get_preset(name)
    tied = dataclasses.replace(spec, tie_embeddings=True)
    untied = dataclasses.replace(spec, tie_embeddings=False)
    V, h = spec.vocab_size, spec.hidden
    assert analytic_n_params(untied) - analytic_n_params(tied) == V * h
    assert flops_per_sample(tied) == flops_per_sample(untied)


def test_tied_llama_tiny_builds_to_its_analytic_count() -> None:
    spec = dataclasses.replace(get_preset("llama-tiny"), tie_embeddings=True)
    built = build(spec)
    assert built.n_params == analytic_n_params(spec)
    assert built.flops_per_sample == build(get_preset("llama-tiny")).flops_per_sample


def test_llama_tiny_flops_by_hand() -> None:
    spec = get_preset("llama-tiny")
    L, h, T, V, f, kv = 2, 64, 32, 512, spec.ffn, 2 * 16  # 2 kv heads of head_dim 16
    block = 2 * h + 2 * h * h + 2 * h * kv + 3 * h * f
    n = L * block + h + V * h  # + final RMSNorm and the (untied) LM head; token table out
    assert analytic_n_params(spec) == n + V * h
    assert flops_per_sample(spec) == (6 * n + 12 * L * h * T) * T


def test_bert_flops_include_the_tied_decoder() -> None:
    spec = get_preset("bert-tiny")
    L, h, T, V = 2, 64, 32, 512
    tables = (V + T + 2) * h  # token, position, segment lookups
    n = analytic_n_params(spec) - tables + V * h
    assert flops_per_sample(spec) == (6 * n + 12 * L * h * T) * T


@pytest.mark.parametrize("name", ["vit-tiny", "mlp-tiny"])
def test_models_without_lm_head_unchanged(name: str) -> None:
    spec = get_preset(name)
    h, t = spec.hidden, spec.tokens_per_sample
    tables = (h + t * h) if spec.family == "vit" else 0  # class token and position table
    n = analytic_n_params(spec) - tables
    attention = 12 * spec.n_layers * (spec.n_heads or 0) * spec.head_dim * t
    assert flops_per_sample(spec) == (6 * n + attention) * t


def test_tokens_per_sample() -> None:
    assert build(get_preset("vit-tiny")).tokens_per_sample == (32 // 8) ** 2 + 1
    assert build(get_preset("mlp-tiny")).tokens_per_sample == 1
    assert build(get_preset("gpt2-tiny")).tokens_per_sample == 32


def test_get_preset_lists_names() -> None:
    with pytest.raises(ValueError, match=r"unknown model 'gpt3': choose one of .*gpt2-124m"):
        get_preset("gpt3")


def test_spec_is_plain_data() -> None:
    spec = get_preset("llama-1b")
    assert ModelSpec(**dataclasses.asdict(spec)) == spec


@pytest.mark.parametrize(("change", "message"), [
    (dict(hidden=100, n_heads=3), "hidden=100 must be divisible by n_heads=3"),
    (dict(n_layers=0), "n_layers=0 must be a positive integer"),
    (dict(seq_len=None), "seq_len=None: family 'gpt2' needs it"),
    (dict(image_size=32), "image_size=32 does not apply to family 'gpt2'"),
    (dict(family="t5"), "family='t5': choose one of gpt2, llama"),
])
def test_spec_validation(change: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(get_preset("gpt2-tiny"), **change)


def test_llama_kv_heads_must_divide_heads() -> None:
    with pytest.raises(ValueError, match="n_heads=4 must be divisible by n_kv_heads=3"):
        dataclasses.replace(get_preset("llama-tiny"), n_kv_heads=3)
