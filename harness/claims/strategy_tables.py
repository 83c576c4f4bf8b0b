"""The claims' per-strategy facts, in one place: which ZeRO stage each strategy holds at the
optimizer step and moves per step, with the claim's title and formula text. (To be read from
the strategies' own declarations once they carry them; harness/strategies/.)"""

from __future__ import annotations

# strategy -> (ZeRO stage it holds at the optimizer step, title, formula with its bytes):
# the model_states/<strategy> claims (ZeRO §3.1, §5, Table 1).
MODEL_STATES = {
    "ddp": (0, "DDP holds every model state on every rank",
            "4Ψ params + 4Ψ grads + 8Ψ AdamW moments + 4Ψ DDP gradient bucket (fp32: no master copy)"),
    "zero1": (1, "torch ZeroRedundancyOptimizer (ZeRO-1) shards the optimizer state",
              "4Ψ + 4Ψ + 8Ψ/N_d + 4Ψ DDP bucket"),
    "fsdp_grad_op": (3, "FSDP2 SHARD_GRAD_OP (the ZeRO-2 idea) holds ZeRO-3's layout at the optimizer"
                        " step: it reshards parameters after backward",
                     "(4 + 4 + 8)·Ψ/N_d"),
    "fsdp_full": (3, "FSDP2 FULL_SHARD (ZeRO-3) shards parameters, gradients and optimizer state",
                  "(4 + 4 + 8)·Ψ/N_d"),
    "deepspeed_zero1": (1, "DeepSpeed ZeRO-1 shards the optimizer state (and, as DeepSpeed does, the"
                           " reduced gradients)",
                        "4Ψ params + 4Ψ/N_d grads + (4 + 8)·Ψ/N_d fp32 master + moments"),
    "deepspeed_zero2": (2, "DeepSpeed ZeRO-2 shards optimizer state and gradients",
                        "4Ψ params + 4Ψ/N_d grads + (4 + 8)·Ψ/N_d fp32 master + moments"),
    "deepspeed_zero3": (3, "DeepSpeed ZeRO-3 shards parameters, gradients and optimizer state",
                        "(4 + 4 + 4 + 8)·Ψ/N_d: params, grads, fp32 master, moments; + the reduce bucket"
                        " it keeps between steps, min(Ψ, 5e8)·4"),
}

# strategy -> (ZeRO stage, title): the comm_volume/<strategy> claims (ZeRO §7, FSDP §3.2.1).
COMM_VOLUME = {
    "zero1": (1, "torch ZeRO-1 (ZeroRedundancyOptimizer over DDP) moves what DDP moves"),
    "fsdp_grad_op": (2, "FSDP2 SHARD_GRAD_OP (ZeRO-2) moves what DDP moves"),
    "deepspeed_zero1": (1, "DeepSpeed ZeRO-1 moves what DDP moves"),
    "deepspeed_zero2": (2, "DeepSpeed ZeRO-2 moves what DDP moves"),
    "fsdp_full": (3, "FSDP2 FULL_SHARD (ZeRO-3) moves 1.5× DDP's bytes"),
    "deepspeed_zero3": (3, "DeepSpeed ZeRO-3 moves 1.5× DDP's bytes"),
}

