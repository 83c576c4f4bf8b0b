"""Expert parallel (deepspeed_autoep): DeepSpeed's AutoEP splits each mixture-of-experts
block's experts over the ranks; everything else is data parallel.

What is split: AutoEP (deepspeed.module_inject.auto_ep, in DeepSpeed 0.19.8) replaces every
MoE block of transformers' MixtralForCausalLM (its ``mixtral`` preset) with an
``AutoEPMoELayer``, copying the HF weights in as it does: the router's weight whole on every
rank, and of the experts' 3-D ``gate_up_proj`` / ``down_proj`` only this rank's
n_experts / world_size consecutive experts (rank r holds experts [r·E/W, (r+1)·E/W)). The
expert-parallel group is every rank (``autoep_size`` = world size), so each expert lives on
one rank. Each rank takes its own samples. The engine (ZeRO stage 0: plain all-reduce)
reduces gradients in two groups: the non-expert parameters (attention, norms, embeddings,
router, head) averaged over all ranks; the expert parameters over their expert-data-parallel
group (here the rank alone) and divided by the data-parallel size
(engine._reduce_expert_gradients), since an expert's gradient already sums the tokens every
rank sent it.

One MoE block's forward: the router runs on this rank's tokens; an all-to-all exchanges the
per-expert token counts, a second (variable-sized ``all_to_all_single``) sends each
(token, chosen expert) row to the rank holding that expert; the local experts run as one
grouped matmul; a third all-to-all brings the outputs back, which are weighted and summed per
token. The backward runs the two token all-to-alls in reverse. All show in the harness's
communication record as ``all_to_all`` (c10d ``alltoall_base_``): 5 per MoE block and step,
3 more where activation checkpointing recomputes the block.

Routing, the same maths as Mixtral's (TokenChoiceTopKRouter in deepspeed/moe/ep_router.py
against MixtralTopKRouter): softmax of the router logits in fp32, top-k, the k weights
renormalised to sum to 1 (AutoEP adds 1e-20 to the denominator), each expert's output scaled
by its weight after the expert (score_apply "post"). So the one-process HF model of the cell
stays the reference, and the equivalence gate compares as for any data-parallel strategy.

What differs from DeepSpeed's older ``deepspeed.moe.layer.MoE`` (GShard's TopKGate), and why
that one is not used: it has a capacity (tokens beyond an expert's capacity are dropped
unless drop_tokens=False, and dispatch is padded to capacity) and always returns GShard's
load-balancing loss for the caller to add. AutoEP is dropless (every routed token reaches its
expert; the token all-to-alls have variable sizes) and adds no auxiliary loss
(load_balance_coeff unset; this build refuses any other value). The harness's MoE model
trains without Mixtral's load-balancing loss by default too (harness/models/moe.py); a cell
that asks for it (``router_aux_loss_coef``) is refused here: AutoEP replaces the routers whose
logits transformers collects for that loss, and no run has shown what it does then.

Two adaptations, both to what the installed versions do:
- ``moe_layer_pattern`` overrides the preset's ``model\\.layers\\.\\d+\\.mlp`` (matched with
  fullmatch) to also match a decoder layer the harness's activation checkpointing has
  wrapped (``model.layers.<i>._checkpoint_wrapped_module.mlp``).
- transformers' output-capture registry: converting a Mixtral model, AutoEP re-targets HF's
  router-logit recorders and calls ``_CAN_RECORD_REGISTRY.get(str(cls), default)``
  (deepspeed/module_inject/auto_ep_presets/base.py, _install_instance_transformers_output_recorders),
  but transformers 5.24's registry is a dict subclass whose ``get(model)`` takes a model and
  no default (transformers/utils/output_capturing.py), so deepspeed.initialize raises
  "TypeError: _CanRecordRegistry.get() takes 2 positional arguments but 3 were given".
  During the conversion only, a string key is looked up as the plain dict key it is
  (``_registry_lookup_by_class_name``).

Features: fp32 (bf16 is not wired: DeepSpeed's bf16 at stage 0 is its BF16_Optimizer, whose
fp32 master copies the memory probe is not yet shown to count); activation checkpointing and
gradient accumulation (DeepSpeed's own, as deepspeed_zero.py) pass the gate.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch import nn

from harness.features import optimizers
from harness.strategies import deepspeed_zero
from harness.strategies.base import RECOMPUTE_CHECKPOINTING, Capabilities, EngineModel, Prepared, Strategy

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from harness.config import CellSpec
    from harness.distributed import DistEnv

CAPABILITIES = Capabilities(
    precisions=frozenset({"fp32"}),
    checkpointing=RECOMPUTE_CHECKPOINTING,
    clipping=False,
    notes={
        "clip_grad_norm": ("DeepSpeed's gradient_clipping with AutoEP reduces the expert parameters' norms"
                           " over their own groups; not measured against the gate: not wired"),
        "bf16": ("DeepSpeed's bf16 at ZeRO stage 0 steps through its BF16_Optimizer, whose fp32 master"
                 " copies the memory probe is not shown to count yet: not wired"),
        "fp16": "DeepSpeed's fp16 loss scaler with AutoEP is not measured against the gate: not wired",
    },
)


# The mixtral preset's pattern (model\.layers\.\d+\.mlp), also where the harness's
# activation checkpointing has wrapped each decoder layer (features/checkpointing.py).
MOE_LAYER_PATTERN = r"model\.layers\.\d+\.(_checkpoint_wrapped_module\.)?mlp"


def unsupported_reason(cell: CellSpec, device_type: str) -> str | None:
    """DeepSpeed without AutoEP (looked up as a file: importing DeepSpeed takes seconds)."""
    found = importlib.util.find_spec("deepspeed")
    if found is None:
        return "DeepSpeed is not installed: pip install deepspeed (AutoEP is in 0.19.8)"
    if found.origin is None:  # a namespace package: an installed DeepSpeed has its __init__.py
        raise RuntimeError("deepspeed is importable only as a namespace package (no deepspeed/__init__.py):"
                           " reinstall it: pip install deepspeed")
    if not (Path(found.origin).parent / "module_inject" / "auto_ep.py").exists():
        return (f"DeepSpeed {importlib.metadata.version('deepspeed')} has no AutoEP"
                " (deepspeed.module_inject.auto_ep): install a release that has it (0.19.8 does)")
    return None


def combination_problem(cell: CellSpec) -> str | None:
    if cell.model_spec.layout != "mixtral":
        return (f"model {cell.model_name}: expert parallel needs a mixture-of-experts model of the mixtral layout"
                " (harness/models/spec.py, Layout)")
    if cell.router_aux_loss_coef is not None:
        return (f"router_aux_loss_coef={cell.router_aux_loss_coef!r}: AutoEP replaces the routers whose logits"
                " transformers' load-balancing loss reads (and its own takes no coefficient in this build)")
    return None


def ds_config(cell: CellSpec) -> dict[str, Any]:
    """The DeepSpeed config of an expert-parallel cell (module docstring)."""
    return {
        "train_micro_batch_size_per_gpu": cell.micro_batch,
        "gradient_accumulation_steps": cell.strategy.accumulation,
        "train_batch_size": cell.global_batch,
        "gradient_clipping": 0.0,
        "zero_optimization": {"stage": 0},
        "expert_parallel": {
            "enabled": True,
            "autoep_size": cell.world_size,
            "preset_model": "mixtral",
            "moe_layer_pattern": MOE_LAYER_PATTERN,
            "use_grouped_mm": True,
        },
        "comms_logger": {"enabled": True, "prof_all": True, "verbose": False, "debug": False},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def _expert_layers(module: nn.Module) -> list[Any]:  # DeepSpeed's AutoEPMoELayer (untyped)
    from deepspeed.module_inject.auto_ep_layer import AutoEPMoELayer

    return [m for m in module.modules() if isinstance(m, AutoEPMoELayer)]


def expert_layout(module: nn.Module) -> dict[str, int]:
    """What this rank holds of the experts, counted from its parameters."""
    layers = _expert_layers(module)
    expert_params = {id(p): p for layer in layers for p in layer.experts.parameters()}
    all_params = {id(p): p for p in module.parameters()}
    expert_bytes = sum(p.numel() * p.element_size() for p in expert_params.values())
    total_bytes = sum(p.numel() * p.element_size() for p in all_params.values())
    first = layers[0]  # AutoEP refuses a model where its preset finds no MoE block
    return {
        "moe_layers": len(layers),
        "experts_per_layer": first.num_experts,
        "local_experts_per_layer": first.num_local_experts,
        "ep_size": first.ep_size,
        "ep_rank": first.ep_rank,
        "expert_param_bytes": expert_bytes,
        "non_expert_param_bytes": total_bytes - expert_bytes,
    }


@contextmanager
def _registry_lookup_by_class_name() -> Iterator[None]:
    """transformers' output-capture registry as AutoEP reads it (module docstring): a string
    key (AutoEP's ``str(cls)``, with or without a default) is looked up as the dict key it
    is; transformers' own calls (with a model) go to its method unchanged."""
    from transformers.utils import output_capturing

    registry = output_capturing._CAN_RECORD_REGISTRY
    by_model = registry.get

    def get(key: str | PreTrainedModel, *default: object) -> object:
        return dict.get(registry, key, *default) if isinstance(key, str) else by_model(key)

    # A broader get (string keys, a default) than transformers' get(model): patched for the
    # conversion, restored below.
    registry.get = get  # type: ignore[method-assign, assignment]
    try:
        yield
    finally:
        del registry.get


def prepare(model: nn.Module, block_type: type[nn.Module], cell: CellSpec, env: DistEnv) -> Prepared:
    deepspeed = deepspeed_zero.import_deepspeed(env.device)
    # Its shared-memory collectives from the run's op cache, as every DeepSpeed cell's: without
    # it DeepSpeed builds them into torch's default folder inside the cell (3 minutes here).
    deepspeed_zero.load_ops(cell)
    config = ds_config(cell)
    client_optimizer = optimizers.make(model.parameters(), cell.strategy.optimizer, cell.lr)
    # The engine replaces the MoE blocks and moves the client optimizer onto the new
    # (sharded) expert parameters before it wraps anything.
    with _registry_lookup_by_class_name():
        engine, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=client_optimizer, config=config)
    inner = getattr(optimizer, "optimizer", optimizer)
    layout = expert_layout(engine.module)

    steps = deepspeed_zero.EngineSteps(engine, cell)

    def engine_report() -> dict[str, Any]:
        return {
            "name": "deepspeed_autoep",
            "version": deepspeed.__version__,
            "config": config,
            "optimizer": type(inner).__name__,
            "expert_layout": layout,
            "comms_logger_step": steps.comm_step,
            "comms_logger_by_op": steps.comms_of_counted_step(),
        }

    return steps.prepared(optimizer, engine_report=engine_report)


def _layout_problem(cell: CellSpec) -> str | None:
    experts = cell.model_spec.n_experts or 0
    if experts % cell.world_size:
        return (f"world_size={cell.world_size} with deepspeed_autoep: model {cell.model_name}'s {experts} experts per"
                " layer must divide evenly over the ranks")
    return None


STRATEGIES = (
    Strategy(
        name="deepspeed_autoep",
        summary="expert parallel: DeepSpeed's AutoEP splits a MoE model's experts over the ranks",
        engine="deepspeed", families=("ep", "deepspeed"), capabilities=CAPABILITIES,
        combination_problem=combination_problem, layout_problem=_layout_problem,
        unsupported_reason=unsupported_reason, engine_model=EngineModel(analytic="expert_parallel"),
        prepare=prepare,
    ),
)
