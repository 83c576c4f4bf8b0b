"""Named model specs: tiny ones that train a step on a CPU core in milliseconds, real ones for GPUs."""

from __future__ import annotations

from typing import TypedDict

from .spec import ModelSpec


class _TextSizes(TypedDict):
    n_layers: int
    hidden: int
    n_heads: int
    seq_len: int
    vocab_size: int


_TINY_TEXT = _TextSizes(n_layers=2, hidden=64, n_heads=4, seq_len=32, vocab_size=512)

# Tiny: for tests and CPU smoke runs.
_TINY_SPECS = [
    ModelSpec(name="gpt2-tiny", family="gpt2", **_TINY_TEXT),
    ModelSpec(name="llama-tiny", family="llama", n_kv_heads=2, **_TINY_TEXT),  # GQA
    ModelSpec(name="llama-tiny-mha", family="llama", n_kv_heads=4, **_TINY_TEXT),  # a k/v head per query head
    ModelSpec(name="llama-tiny-mqa", family="llama", n_kv_heads=1, **_TINY_TEXT),  # one k/v head for all
    ModelSpec(name="moe-tiny", family="moe", n_kv_heads=2, n_experts=4, top_k=2, ffn_hidden=64,
              **_TINY_TEXT),
    ModelSpec(name="bert-tiny", family="bert", **_TINY_TEXT),
    ModelSpec(name="vit-tiny", family="vit", n_layers=2, hidden=64, n_heads=4,
              image_size=32, patch_size=8, num_classes=10),
    ModelSpec(name="mlp-tiny", family="mlp", n_layers=2, hidden=64, num_classes=10),
    # For scikit-learn's 8×8 digits (data=digits): three 32-channel convolutions with
    # BatchNorm, 19k parameters; what BatchNorm under DDP, SyncBatchNorm and accumulation is
    # measured on (the convergence suite).
    ModelSpec(name="convnet-digits", family="convnet", n_layers=3, hidden=32, image_size=8, num_classes=10),
    # Byte-level GPT-2 for the convergence suite's real text (data=stdlib_bytes): 0.47M
    # parameters and 32-byte contexts, sized so that fp16, which a CPU without fp16 units runs
    # about 8x slower than fp32 (0.53 s a step of 16 × 64 bytes on one core), trains 200 steps
    # within the suite's budget.
    ModelSpec(name="gpt2-bytes", family="gpt2", n_layers=4, hidden=96, n_heads=4, seq_len=32, vocab_size=256),
]
# Real sizes: for GPUs and planning.
_REAL_SPECS = [
    ModelSpec(name="gpt2-124m", family="gpt2", n_layers=12, hidden=768, n_heads=12,
              seq_len=1024, vocab_size=50257),
    ModelSpec(name="gpt2-1.5b", family="gpt2", n_layers=48, hidden=1600, n_heads=25,
              seq_len=1024, vocab_size=50257),
    ModelSpec(name="llama-1b", family="llama", n_layers=16, hidden=2048, n_heads=32, n_kv_heads=8,
              ffn_hidden=8192, seq_len=2048, vocab_size=128256, tie_embeddings=True),  # Llama-3.2-1B
    ModelSpec(name="llama3-8b", family="llama", n_layers=32, hidden=4096, n_heads=32, n_kv_heads=8,
              ffn_hidden=14336, seq_len=8192, vocab_size=128256),
    # Mixtral-8x7B-v0.1's sizes (46.7B parameters, 12.9B active); its context is 32768 tokens,
    # planned here at 4096 per sample. Planning only (meta device): never built for real in tests.
    ModelSpec(name="mixtral-8x7b", family="moe", n_layers=32, hidden=4096, n_heads=32, n_kv_heads=8,
              ffn_hidden=14336, seq_len=4096, vocab_size=32000, n_experts=8, top_k=2),
    ModelSpec(name="bert-base", family="bert", n_layers=12, hidden=768, n_heads=12,
              seq_len=512, vocab_size=30522),
    ModelSpec(name="vit-base", family="vit", n_layers=12, hidden=768, n_heads=12,
              image_size=224, patch_size=16, num_classes=1000),
]
PRESETS: dict[str, ModelSpec] = {spec.name: spec for spec in _TINY_SPECS + _REAL_SPECS}
# Presets `plan` predicts but no suite builds, with why (a suite listing one is refused).
PLANNING_ONLY: dict[str, str] = {
    "mixtral-8x7b": "46.7B parameters, built on the meta device for `plan` only",
}
# What plan's predictions are for, and what the report sets them beside.
REAL_SIZE_PRESETS: tuple[str, ...] = tuple(spec.name for spec in _REAL_SPECS)


def get_preset(name: str) -> ModelSpec:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}: choose one of {', '.join(PRESETS)}") from None
