"""The ZeRO claims made of each strategy: the title and formula text of its model_states/ and
comm_volume/ claims. Which ZeRO stage a strategy is held to comes from its declaration
(harness/strategies/)."""

from __future__ import annotations

from harness import strategies


def zero_stage(strategy: str) -> int:
    """The ZeRO stage a strategy implements, whatever the engine; 0 for plain data parallelism."""
    idea = strategies.get(strategy).zero_idea
    return int(idea.removeprefix("zero")) if idea else 0


def stage_held_at_step(strategy: str) -> int:
    """The ZeRO stage whose layout a strategy holds when its optimizer step begins: its own,
    but for an engine that reshards its parameters after backward (FSDP2's SHARD_GRAD_OP,
    the ZeRO-2 idea), which holds ZeRO-3's."""
    return 3 if "params" in strategies.get(strategy).engine_model.sharded else zero_stage(strategy)


# strategy -> (title, formula with its bytes): the model_states/<strategy> claims (ZeRO §3.1,
# §5, Table 1), judged against the paper's formula for stage_held_at_step.
MODEL_STATES = {
    "ddp": ("DDP holds every model state on every rank",
            "4Ψ params + 4Ψ grads + 8Ψ AdamW moments + 4Ψ DDP gradient bucket (fp32: no master copy)"),
    "zero1": ("torch ZeroRedundancyOptimizer (ZeRO-1) shards the optimizer state",
              "4Ψ + 4Ψ + 8Ψ/N_d + 4Ψ DDP bucket"),
    "fsdp_grad_op": ("FSDP2 SHARD_GRAD_OP (the ZeRO-2 idea) holds ZeRO-3's layout at the optimizer"
                     " step: it reshards parameters after backward",
                     "(4 + 4 + 8)·Ψ/N_d"),
    "fsdp_full": ("FSDP2 FULL_SHARD (ZeRO-3) shards parameters, gradients and optimizer state",
                  "(4 + 4 + 8)·Ψ/N_d"),
    "deepspeed_zero1": ("DeepSpeed ZeRO-1 shards the optimizer state (and, as DeepSpeed does, the"
                        " reduced gradients)",
                        "4Ψ params + 4Ψ/N_d grads + (4 + 8)·Ψ/N_d fp32 master + moments"),
    "deepspeed_zero2": ("DeepSpeed ZeRO-2 shards optimizer state and gradients",
                        "4Ψ params + 4Ψ/N_d grads + (4 + 8)·Ψ/N_d fp32 master + moments"),
    "deepspeed_zero3": ("DeepSpeed ZeRO-3 shards parameters, gradients and optimizer state",
                        "(4 + 4 + 4 + 8)·Ψ/N_d: params, grads, fp32 master, moments; + the reduce bucket"
                        " it keeps between steps, h²·4 (reduce_bucket_size = h², hidden size h), and its"
                        " persistent parameters (≤ 10·h elements each) whole: 4·Ψ_persistent"),
}

# strategy -> title: the comm_volume/<strategy> claims (ZeRO §7, FSDP §3.2.1), judged against
# the paper's volume for zero_stage.
COMM_VOLUME = {
    "zero1": "torch ZeRO-1 (ZeroRedundancyOptimizer over DDP) moves what DDP moves",
    "fsdp_grad_op": "FSDP2 SHARD_GRAD_OP (ZeRO-2) moves what DDP moves",
    "deepspeed_zero1": "DeepSpeed ZeRO-1 moves what DDP moves",
    "deepspeed_zero2": "DeepSpeed ZeRO-2 moves what DDP moves",
    "fsdp_full": "FSDP2 FULL_SHARD (ZeRO-3) moves 1.5× DDP's bytes",
    "deepspeed_zero3": "DeepSpeed ZeRO-3 moves 1.5× DDP's bytes",
}

