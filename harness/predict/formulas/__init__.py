"""The papers' formulas on plain numbers, each function citing its paper: no torch, no
transformers, nothing else of the harness (harness/predict/analytic.py applies them to a cell).

Ψ = parameter count, N_d = data-parallel (sharding) degree, K = optimizer bytes per parameter;
the published figures they are checked against: ../shared/reference/formulas.md.
"""

from __future__ import annotations

from .activations import activation_bytes_per_layer
from .compression import POWERSGD_MIN_COMPRESSION_RATE, powersgd_elements
from .context_parallel import context_parallel_kv_bytes
from .expert_parallel import (
    expert_parallel_all_to_all_bytes,
    expert_parallel_local_params,
    expert_parallel_most_received_rows,
    moe_params,
)
from .flops import model_flops_per_step
from .megatron import megatron_model_states, megatron_optimizer_comm_bytes, megatron_tp_all_reduce_bytes
from .optimizers import (
    adafactor_state_bytes,
    adamw_state_bytes,
    blockwise_8bit_state_bytes,
    lamb_state_bytes,
    sgd_momentum_state_bytes,
)
from .pipeline import (
    PIPELINE_SCHEDULES,
    PipelinePeak,
    pipeline_bubble_fraction,
    pipeline_first_stage_layer_activations,
    pipeline_p2p_bytes,
    pipeline_peak,
)
from .tensor_parallel import tp_all_reduce_bytes, tp_model_states
from .zero import FP32_ADAM, ModelStates, comm_volume, zero_comm_elements, zero_model_states

__all__ = [
    "FP32_ADAM",
    "PIPELINE_SCHEDULES",
    "POWERSGD_MIN_COMPRESSION_RATE",
    "ModelStates",
    "PipelinePeak",
    "activation_bytes_per_layer",
    "adafactor_state_bytes",
    "adamw_state_bytes",
    "blockwise_8bit_state_bytes",
    "comm_volume",
    "context_parallel_kv_bytes",
    "expert_parallel_all_to_all_bytes",
    "expert_parallel_local_params",
    "expert_parallel_most_received_rows",
    "lamb_state_bytes",
    "megatron_model_states",
    "megatron_optimizer_comm_bytes",
    "megatron_tp_all_reduce_bytes",
    "model_flops_per_step",
    "moe_params",
    "pipeline_bubble_fraction",
    "pipeline_first_stage_layer_activations",
    "pipeline_p2p_bytes",
    "pipeline_peak",
    "powersgd_elements",
    "sgd_momentum_state_bytes",
    "tp_all_reduce_bytes",
    "tp_model_states",
    "zero_comm_elements",
    "zero_model_states",
]
