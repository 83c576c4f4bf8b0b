"""DeepSpeed ZeRO stages 1-3 (deepspeed_zero1/2/3): the DeepSpeed engine owns the backward
pass, gradient reduction and the optimizer step.

The engine's config is built from the cell (no JSON files):

- ``zero_optimization.stage`` from the strategy name; ``train_micro_batch_size_per_gpu`` =
  cell.micro_batch; ``gradient_accumulation_steps`` = cell.strategy.accumulation.
- precision: fp32 (nothing), ``bf16: {enabled}`` (DeepSpeed casts the model to bf16 and keeps
  fp32 master weights in the ZeRO optimizer, so no autocast), ``fp16: {enabled,
  loss_scale: 0}`` (dynamic loss scaling; ``loss_scale: 1``, a static scale of one, for
  ``loss_scaling="none"``) where the device has fp16. DeepSpeed's CPU
  accelerator has fp16 where oneDNN has it (``torch.ops.mkldnn._is_mkldnn_fp16_supported()``,
  e.g. AVX512-FP16/AMX CPUs); elsewhere deepspeed.initialize raises "Type fp16 is not
  supported on your device.", which ``unsupported_reason`` reports before launching.
- buckets, prefetch and persistence as a transformers Trainer user gets them with ``auto``
  (``zero_sizes``, README "Engine settings"): from the model's hidden size h,
  reduce_bucket_size = h², stage3_prefetch_bucket_size = int(0.9·h²),
  stage3_param_persistence_threshold = 10·h (transformers' HfTrainerDeepSpeedConfig
  .trainer_config_finalize); DeepSpeed's own defaults for the keys it has no rule for
  (allgather_bucket_size 5e8, stage3_model_persistence_threshold sys.maxsize,
  stage3_max_live_parameters and stage3_max_reuse_distance 1e9). Never the whole model:
  buckets of the model's size made ZeRO-3 hold a gradient-sized reduce buffer. The values
  are in ``engine_report()["config"]``, the hidden size they came from in ``sizing_hidden``.
- ZeRO-3's memory-efficient linear (DeepSpeed's default ``memory_efficient_linear``, which
  saves the weight parameter rather than a view of its gathered data, so that ZeRO-3's release
  frees it): given to the cell's own nn.Linear layers (``_memory_efficient_linear``), since the
  config key patches torch.nn.functional.linear for every later cell of the process.
- offload: "optimizer" -> ``offload_optimizer: cpu`` (stages 1-3) with DeepSpeed's CPU Adam
  (DeepSpeed refuses a client torch optimizer with ZeRO-Offload unless forced);
  "params" -> ``offload_param: cpu`` (stage 3 only; works without offload_optimizer);
  "optimizer_params" -> both.
- comms_logger configured (prof_all) but on for the harness's comm-counted step only
  (``EngineSteps``): it makes every collective blocking ("Need to make op blocking for
  accurate logging": an accelerator synchronize after each op), and its cost grows with the
  run (DeepSpeed ZeRO-3 fp32 on gpt2-bytes, 200 steps on 2 gloo ranks: 273 ms a step with it
  on, 203 ms off, the on run's 20-step means climbing from 215 to 330 ms). Its per-op counts
  and message bytes are snapshotted at every optimizer-step boundary, so ``engine_report()``
  gives the counted step's own numbers (the other steps' are empty).

The harness's training step divides each micro-step's loss by the accumulation count
itself, so ``engine.backward(loss, scale_wrt_gas=False)`` (DeepSpeed would divide again),
and ``engine.step()`` after every micro-step (DeepSpeed reduces and updates only at the
accumulation boundary).
"""

from __future__ import annotations

import dataclasses
import fcntl
import functools
import hashlib
import itertools
import math
import os
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from harness.features import optimizers
from harness.strategies.base import ALL_PRECISIONS, Capabilities, EngineModel, Prepared, Strategy

if TYPE_CHECKING:
    from harness.config import CellSpec
    from harness.distributed import DistEnv

STAGES = {"deepspeed_zero1": 1, "deepspeed_zero2": 2, "deepspeed_zero3": 3}

# DeepSpeed's own message (deepspeed/runtime/engine.py, _do_sanity_check, 0.19.8), raised
# from deepspeed.initialize when the accelerator reports no fp16 (the CPU accelerator asks
# oneDNN: torch.ops.mkldnn._is_mkldnn_fp16_supported()).
FP16_UNSUPPORTED = "Type fp16 is not supported on your device."

# Parameter offload (offload_param) exists for ZeRO-3 only; on its own (without
# offload_optimizer) it runs and passes the gate with DeepSpeed 0.19.8.
STAGE3_ONLY_NOTE = "offload_param is a ZeRO-3 feature in DeepSpeed: use deepspeed_zero3"

# ZeRO hands the client optimizer flat 1-D partitions of the parameters. Block-wise 8-bit
# state copes (gate passed at 1.1e-5..1.2e-5, as on FSDP1's flat shards); Adafactor silently
# switches to its unfactored second moment on 1-D tensors and trains a different model
# (2.4e-4 off its reference in fp32, every stage).
_ADAFACTOR_NOTE = ("DeepSpeed ZeRO hands the optimizer flat 1-D partitions: Adafactor falls back to its"
                   " unfactored second moment, a different update rule than the reference's factored one")
_OPTIMIZERS = frozenset(optimizers.NAMES) - {"adafactor"} - optimizers.PER_TENSOR_NORM
_LAMB_NOTES = dict.fromkeys(optimizers.PER_TENSOR_NORM, optimizers.PER_TENSOR_NORM_NOTE)

_STAGE3_CAPABILITIES = Capabilities(
    precisions=ALL_PRECISIONS,
    overlap_options=frozenset({"overlap_comm"}),
    offload=frozenset({"none", "optimizer", "params", "optimizer_params"}),
    min_world_size=1,  # ZeRO-3 with its offload fits one large model on one GPU
    optimizers=_OPTIMIZERS,
    notes={"adafactor": _ADAFACTOR_NOTE, **_LAMB_NOTES},
)
_STAGE12_CAPABILITIES = Capabilities(
    precisions=ALL_PRECISIONS,
    overlap_options=frozenset({"overlap_comm"}),
    offload=frozenset({"none", "optimizer"}),
    optimizers=_OPTIMIZERS,
    notes={"params": STAGE3_ONLY_NOTE, "optimizer_params": STAGE3_ONLY_NOTE, "adafactor": _ADAFACTOR_NOTE,
           **_LAMB_NOTES},
)


def _offloads_optimizer(cell: CellSpec) -> bool:
    return cell.strategy.offload in ("optimizer", "optimizer_params")


def combination_problem(cell: CellSpec) -> str | None:
    """A pair of individually allowed values that cannot go together."""
    s = cell.strategy
    if _offloads_optimizer(cell) and s.optimizer != "adamw":
        return (f"optimizer={s.optimizer} with offload={s.offload}: DeepSpeed's optimizer offload runs its own"
                " CPU Adam (AdamW mode), not the cell's optimizer")
    return None


# DeepSpeed JIT-compiles its C++ ops into TORCH_EXTENSIONS_DIR: on a CPU accelerator its
# shared-memory collectives (every cell, inside deepspeed.initialize) and CPU Adam (offload
# cells, ~80 s with gcc). torch's default (~/.cache/torch_extensions/<python-torch tag>) is
# fine too, but a named cache makes the cost visible and shared by tests and runs. One folder
# per Python environment: a build's flags name the venv's include paths, so two venvs sharing
# one folder (two clones) would rebuild over each other's ops on every switch. A user's
# setting wins.
EXTENSIONS_CACHE = (Path.home() / ".cache" / "shardbench" / "torch_extensions"
                    / hashlib.sha1(sys.prefix.encode()).hexdigest()[:12])

# torch.optim.AdamW defaults, which the reference uses; DeepSpeedCPUAdam's weight_decay
# default is 0, so every value is passed explicitly.
_ADAMW_DEFAULTS = {"betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 1e-2}

# comms_logger record names -> the harness's op kinds (harness/measure/comm.py), and the
# factor from DeepSpeed's message size to the harness's byte convention. DeepSpeed sizes a
# message by the op's ``tensor`` argument: for all_gather_into_tensor that is the input
# shard, where the harness counts the gathered output (world_size x).
_DS_KIND = {
    "all_reduce": "all_reduce",
    "all_reduce_coalesced": "all_reduce",
    "inference_all_reduce": "all_reduce",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter": "reduce_scatter",
    "all_gather_into_tensor": "all_gather",
    "allgather_fn": "all_gather",
    "all_gather": "all_gather",
    "broadcast": "broadcast",
    "reduce": "reduce",
    "barrier": "barrier",
}
_GATHERED_BY_INPUT = {"all_gather_into_tensor", "allgather_fn"}


# DeepSpeed's defaults (deepspeed/runtime/zero/config.py, 0.19.8) for the keys transformers'
# `auto` rules leave alone. allgather_bucket_size only splits ZeRO-1/2's all-gather of the
# updated partitions into chunks (views: no buffer) and is unused wherever torch has
# all_gather_into_tensor (torch >= 1.13, every backend); stage3_model_persistence_threshold
# caps the persistent elements in all (sys.maxsize: no cap); a model within
# stage3_max_live_parameters and stage3_max_reuse_distance stays gathered from forward to
# the end of backward (measured: one all-gather per micro-step for the tiny models).
ALLGATHER_BUCKET_ELEMENTS = 500_000_000
MODEL_PERSISTENCE_THRESHOLD = sys.maxsize
MAX_LIVE_PARAMETERS = 1_000_000_000
MAX_REUSE_DISTANCE = 1_000_000_000
# ZeRO-3 steps its partition a sub-group at a time (stage3.py: _create_fp16_sub_groups, then
# each sub-group's fp32 gradient made, stepped and released in turn).
SUB_GROUP_SIZE = 1_000_000_000


def model_hidden(cell: CellSpec) -> int:
    """The hidden size the sizing rule reads: the cell's model's (the one place to change
    where the model comes from)."""
    return cell.model_spec.hidden


def zero_sizes(hidden: int, stage: int) -> dict[str, int]:
    """ZeRO's bucket, prefetch and persistence settings (elements) as transformers fills a
    DeepSpeed config's ``auto`` values from the model's hidden size (transformers/
    integrations/deepspeed.py, HfTrainerDeepSpeedConfig.trainer_config_finalize), and
    DeepSpeed's defaults for the keys it has no rule for."""
    sizes = {"reduce_bucket_size": hidden * hidden, "allgather_bucket_size": ALLGATHER_BUCKET_ELEMENTS}
    if stage == 3:
        sizes |= {
            "stage3_prefetch_bucket_size": int(0.9 * hidden * hidden),
            "stage3_param_persistence_threshold": 10 * hidden,
            "stage3_model_persistence_threshold": MODEL_PERSISTENCE_THRESHOLD,
            "stage3_max_live_parameters": MAX_LIVE_PARAMETERS,
            "stage3_max_reuse_distance": MAX_REUSE_DISTANCE,
            "sub_group_size": SUB_GROUP_SIZE,
        }
    return sizes


def largest_sub_group(shapes: Iterable[tuple[int, ...]], world_size: int) -> int:
    """The elements of a rank's largest ZeRO-3 optimizer sub-group: its partitions of the
    parameters, in order, cut once SUB_GROUP_SIZE is reached (stage3.py,
    _create_fp16_sub_groups). Moonlight-16B on 8 ranks: two of about 10⁹, where the rank's
    partition is 2·10⁹."""
    sizes, current = [], 0
    for shape in shapes:
        current += math.ceil(math.prod(shape) / world_size)
        if current >= SUB_GROUP_SIZE:
            sizes.append(current)
            current = 0
    return max([*sizes, current])


def persistent_numel(shapes: Iterable[tuple[int, ...]], param_threshold: int, model_threshold: int) -> int:
    """Elements ZeRO-3 keeps whole on every rank throughout training (gathered again after
    every step): each parameter of at most ``param_threshold`` elements, in the module's
    parameter order, while the running total stays within ``model_threshold``
    (deepspeed/runtime/zero/parameter_offload.py, mark_persistent_parameters)."""
    total = 0
    for shape in shapes:
        n = math.prod(shape)
        if n <= param_threshold and total + n <= model_threshold:
            total += n
    return total


def gradient_partition_numel(shapes: Iterable[tuple[int, ...]], world_size: int) -> int:
    """Elements of the contiguous buffer ZeRO-1 and ZeRO-2 copy a rank's gradients into
    (deepspeed/runtime/zero/stage_1_and_2.py, copy_grads_in_partition), the largest rank's:
    every parameter with elements in the rank's equal share of the model flattened in the
    module's parameter order (padded to a multiple of twice the world size, its
    nccl_start_alignment_factor), whole."""
    sizes = [math.prod(shape) for shape in shapes]
    starts = list(itertools.accumulate(sizes, initial=0))
    padded = -(-starts[-1] // (2 * world_size)) * 2 * world_size
    share = padded // world_size
    held = [0] * world_size
    for start, n in zip(starts, sizes):
        for rank in range(start // share, (start + n - 1) // share + 1):  # the shares it has elements in
            held[rank] += n
    return max(held)


def _zero_config(cell: CellSpec, stage: int) -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": stage, **zero_sizes(model_hidden(cell), stage)}
    if cell.strategy.overlap_comm is not None:  # otherwise DeepSpeed's default: on for ZeRO-3 only
        zero["overlap_comm"] = cell.strategy.overlap_comm
    if stage == 3:
        # By default ZeRO-3 replaces torch.nn.functional.linear for the rest of the
        # process, so every later cell of the same launch would run DeepSpeed's linear
        # (a FairScale SDP bf16 cell measured 2,728,756 B after a ZeRO-3 cell, 2,786,100 B alone):
        # the cell's own linear layers get it instead (_memory_efficient_linear).
        zero["memory_efficient_linear"] = False
    return zero


def ds_config(cell: CellSpec) -> dict[str, Any]:
    """The DeepSpeed config of a cell."""
    s = cell.strategy
    zero = _zero_config(cell, STAGES[s.name])
    if _offloads_optimizer(cell):
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": False}
    if s.offload in ("params", "optimizer_params"):
        zero["offload_param"] = {"device": "cpu", "pin_memory": False}
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": cell.micro_batch,
        "gradient_accumulation_steps": s.accumulation,
        "train_batch_size": cell.global_batch,
        "gradient_clipping": s.clip_grad_norm or 0.0,  # 0: no clipping
        "zero_optimization": zero,
        "comms_logger": {"enabled": True, "prof_all": True, "verbose": False, "debug": False},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if s.optimizer != "adamw":
        # DeepSpeed vets its ZeRO wrappers against a list of optimizers it has tested and
        # refuses others ("You are using an untested ZeRO Optimizer") unless told; the
        # equivalence gate is the test that matters here.
        config["zero_allow_untested_optimizer"] = True
    if s.precision == "bf16":
        config["bf16"] = {"enabled": True}
    elif s.precision == "fp16":
        # loss_scale 0: dynamic loss scaling; 1: a static scale of 1, i.e. none.
        config["fp16"] = {"enabled": True, "loss_scale": 0 if s.loss_scaling == "dynamic" else 1}
    return config


def load_ops(cell: CellSpec) -> None:
    """Build or load, once per process, the JIT ops the cell's engine will load, one process
    at a time. torch marks a build in progress with a ``lock`` file that it removes when done
    and that every other process polls for ever: a process killed in that window (a cell's
    timeout, a SIGKILL) would hang every later DeepSpeed cell on the machine. Here builders
    hold an flock, which the kernel releases when its holder dies, so a ``lock`` file found
    while holding it is a dead builder's and is removed. Run inside prepare, before the
    warm-up steps, so no compile lands in a measured step; DeepSpeed keeps the loaded ops
    (OpBuilder._loaded_ops), so its own loads inside initialize are then no-ops."""
    _load(_op_builders(cpu_adam=_offloads_optimizer(cell)))


def build_ops(device_type: str) -> None:
    """Every JIT op a cell on ``device_type`` can load, built ahead: run_all.sh's set-up runs
    this, so a fresh clone's first run does not pay the builds inside its cells and its trace
    (about 3 minutes on the reference host). The cache is keyed by the build's flags, which
    name the venv's paths: each new .venv builds its own."""
    import_deepspeed(torch.device(device_type))
    _load(_op_builders(cpu_adam=True))


def _op_builders(cpu_adam: bool) -> list[Any]:
    """DeepSpeed's op builders a cell needs on this process's accelerator: the shared-memory
    collectives always (the CPU accelerator's; none on CUDA), CPU Adam for optimizer offload."""
    from deepspeed.accelerator import get_accelerator
    from deepspeed.ops.op_builder import CPUAdamBuilder

    builders = [get_accelerator().create_op_builder("ShareMemCommBuilder"), CPUAdamBuilder() if cpu_adam else None]
    return [b for b in builders if b is not None and b.is_compatible(verbose=False)]


def _load(builders: list[Any]) -> None:
    """Build or load ``builders``' ops under the flock (load_ops says why)."""
    if not builders:
        return
    cache = Path(os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(EXTENSIONS_CACHE)))
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / ".shardbench-build.flock", "w") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)
        for stale in cache.glob("*/lock"):
            stale.unlink(missing_ok=True)
        for builder in builders:
            builder.load(verbose=False)


def _client_optimizer(model: nn.Module, cell: CellSpec) -> torch.optim.Optimizer:
    if _offloads_optimizer(cell):
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        cpu_adam: torch.optim.Optimizer = DeepSpeedCPUAdam(  # untyped; a torch.optim.Optimizer subclass
            model.parameters(), lr=cell.lr, adamw_mode=True, bias_correction=True, **_ADAMW_DEFAULTS)
        return cpu_adam
    return optimizers.make(model.parameters(), cell.strategy.optimizer, cell.lr)


def _estimates(model: nn.Module, cell: CellSpec) -> dict[str, Any]:
    """DeepSpeed's model-states memory estimators for this cell's layout (bytes).

    ZeRO-1 has no estimator of its own; the ZeRO-2 one is reported for it (it assumes
    sharded gradients, so it underestimates ZeRO-1's gradient memory)."""
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage3 import model_to_params as zero3_params
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    s = cell.strategy
    offload_opt = _offloads_optimizer(cell)
    if STAGES[s.name] == 3:
        total, largest_layer = zero3_params(model)
        if s.offload == "params":
            # DeepSpeed's estimator models parameter offload only together with optimizer
            # offload; asking it anyway would count the optimizer state off the device.
            return {"estimator": None,
                    "note": "no DeepSpeed estimator for offload_param without offload_optimizer"}
        cpu, per_rank, largest = estimate_zero3_model_states_mem_needs(
            total, largest_layer, num_gpus_per_node=cell.world_size, num_nodes=1,
            cpu_offload=offload_opt, cpu_offload_params=s.offload == "optimizer_params",
            zero_init=False)
        return {"estimator": "estimate_zero3_model_states_mem_needs",
                "estimate_zero3_per_rank_bytes": per_rank, "estimate_zero3_cpu_bytes": cpu,
                "estimate_zero3_largest_layer_bytes": largest,
                "estimate_total_params": total}
    total = sum({p.data_ptr(): p.numel() for p in model.parameters()}.values())
    cpu, per_rank = estimate_zero2_model_states_mem_needs(
        total, num_gpus_per_node=cell.world_size, num_nodes=1, cpu_offload=offload_opt)
    return {"estimator": "estimate_zero2_model_states_mem_needs",
            "estimate_zero2_per_rank_bytes": per_rank, "estimate_zero2_cpu_bytes": cpu,
            "estimate_total_params": total}


def _comms_snapshot() -> dict[str, tuple[int, int]]:
    """comms_logger's running totals: record name -> (count, message bytes)."""
    from deepspeed.comm.comm import comms_logger

    return {name: (sum(v[0] for v in sizes.values()), sum(size * v[0] for size, v in sizes.items()))
            for name, sizes in comms_logger.comms_dict.items()}


def _log_comms(enabled: bool) -> None:
    """Switch DeepSpeed's comms_logger on or off between steps (it reads the flag per op)."""
    from deepspeed.comm.comm import comms_logger

    comms_logger.enabled = enabled


def _delta(after: dict[str, tuple[int, int]], before: dict[str, tuple[int, int]]) -> dict[str, dict[str, int]]:
    out = {}
    for name, (count, nbytes) in after.items():
        c0, b0 = before.get(name, (0, 0))
        if count - c0:
            out[name] = {"count": count - c0, "bytes": nbytes - b0}
    return out


class EngineSteps:
    """The engine's backward and step as the worker calls them, and comms_logger's totals at
    each optimizer-step boundary, from which the step the worker counts is read."""

    def __init__(self, engine: Any, cell: CellSpec) -> None:  # a DeepSpeedEngine: untyped
        self.engine = engine
        self.accumulation = cell.strategy.accumulation
        self.comm_step = cell.warmup_steps + 1  # the step the worker counts with harness.measure.comm
        self._micro_steps = 0
        self._snapshots = [_comms_snapshot()]
        _log_comms(self.comm_step == 0)  # deepspeed.initialize switched it on (module docstring)

    def backward(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss, scale_wrt_gas=False)

    def after_micro_step(self) -> None:
        self.engine.step()
        self._micro_steps += 1
        if self._micro_steps % self.accumulation == 0:
            self._snapshots.append(_comms_snapshot())
            steps_done = len(self._snapshots) - 1
            _log_comms(steps_done == self.comm_step)  # on for the counted step alone

    def prepared(self, optimizer: Any, **extra: Any) -> Prepared:
        """What every DeepSpeed engine hands the worker: the engine (it casts and scales the
        loss itself: no autocast), its backward and step, and for the memory tracker the
        module and the torch optimizer inside DeepSpeed's wrapper (the wrappers themselves
        are refused by it)."""
        return Prepared(model=self.engine, optimizer=optimizer, use_autocast=False, backward=self.backward,
                        after_micro_step=self.after_micro_step, memory_module=self.engine.module,
                        memory_optimizer=getattr(optimizer, "optimizer", optimizer),
                        engine_numerics=self.numerics, **extra)

    def numerics(self) -> tuple[float | None, int, float | None]:
        """After a step: the loss scale of DeepSpeed's own scaler (fp16 only), the steps it has
        skipped for overflow, and the gradient norm its optimizer computed before clipping
        (inf on an overflowed step; None where it computes none)."""
        engine = self.engine
        scale = float(engine.optimizer.loss_scale) if engine.fp16_enabled() else None
        norm = engine.get_global_grad_norm()
        return scale, engine.skipped_steps, None if norm is None else float(norm)

    def comms_by_step(self) -> list[dict[str, dict[str, int]]]:
        return [_delta(b, a) for a, b in zip(self._snapshots, self._snapshots[1:])]

    def comms_of_counted_step(self) -> dict[str, dict[str, int]]:
        per_step = self.comms_by_step()
        return per_step[self.comm_step] if self.comm_step < len(per_step) else {}


def as_harness_ops(ds_ops: dict[str, dict[str, int]], world_size: int) -> dict[str, dict[str, int]]:
    """comms_logger's per-record counts/bytes in the harness's op kinds and byte convention."""
    out: dict[str, dict[str, int]] = {}
    for name, v in ds_ops.items():
        kind = _DS_KIND.get(name, name)
        factor = world_size if name in _GATHERED_BY_INPUT else 1
        acc = out.setdefault(kind, {"count": 0, "bytes": 0})
        acc["count"] += v["count"]
        acc["bytes"] += v["bytes"] * factor
    return out


def import_deepspeed(device: torch.device) -> Any:  # the deepspeed module: untyped
    """DeepSpeed, its accelerator the cell's device. It picks the accelerator once per process,
    from DS_ACCELERATOR or else CUDA wherever a GPU is visible, which would put a --device cpu
    cell's engine on the GPU beside its CPU batches and gloo group."""
    os.environ["DS_ACCELERATOR"] = device.type
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    chosen = get_accelerator().device_name()
    if chosen != device.type:
        raise RuntimeError(f"DeepSpeed's accelerator is {chosen}, chosen before this cell, which runs on"
                           f" {device.type}: one worker process runs cells of one device")
    return deepspeed


def _memory_efficient_linear(model: nn.Module) -> None:
    """DeepSpeed's ZeRO-3 linear for this model's nn.Linear layers, as its default
    (``memory_efficient_linear``) gives every linear of the process: it saves the weight
    parameter for backward, which ZeRO-3 gathers again there, where torch's linear saves a
    view of the gathered weight, whose storage then outlives ZeRO-3's release of it until the
    layer's backward (llama3-8b on 8 ranks without checkpointing: 6.4B parameters held
    gathered through forward rather than the 1.0B ZeRO-3's rules keep)."""
    from deepspeed.runtime.zero.linear import zero3_linear_wrap

    for module in model.modules():
        if type(module) is nn.Linear:
            module.forward = functools.partial(_zero3_linear, zero3_linear_wrap, module)  # type: ignore[method-assign]


def _zero3_linear(linear: Callable[..., torch.Tensor], module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return linear(x, module.weight, module.bias)


def prepare(model: nn.Module, block_type: type[nn.Module], cell: CellSpec, env: DistEnv) -> Prepared:
    deepspeed = import_deepspeed(env.device)
    load_ops(cell)
    config = ds_config(cell)
    if STAGES[cell.strategy.name] == 3:
        _memory_efficient_linear(model)
    estimates = _estimates(model, cell)
    client_optimizer = _client_optimizer(model, cell)
    engine, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=client_optimizer,
                                                   config=config)
    # The torch optimizer inside DeepSpeed's wrapper (ZeRO stages, BF16_Optimizer), which the
    # memory tracker can register; the wrappers themselves are refused by it.
    inner = getattr(optimizer, "optimizer", optimizer)

    steps = EngineSteps(engine, cell)
    # ZeRO-3's persistent parameters, kept whole on every rank (stage3_param_persistence_threshold).
    persistent = (sum(p.ds_numel for p in optimizer.persistent_parameters)
                  if STAGES[cell.strategy.name] == 3 else None)

    def engine_report() -> dict[str, Any]:
        ds_ops = steps.comms_of_counted_step()
        return {
            "name": "deepspeed",
            "version": deepspeed.__version__,
            "zero_stage": STAGES[cell.strategy.name],
            "config": config,
            "sizing_hidden": model_hidden(cell),
            "persistent_numel": persistent,
            "optimizer": type(inner).__name__,
            "optimizer_wrapper": type(optimizer).__name__,
            "torch_extensions_dir": os.environ.get("TORCH_EXTENSIONS_DIR"),
            "comms_logger_step": steps.comm_step,
            "comms_logger_by_op": ds_ops,
            "comms_logger_by_op_harness_kinds": as_harness_ops(ds_ops, env.world_size),
            "comms_logger_by_step": steps.comms_by_step(),
            "memory_estimates": estimates,
        }

    def memory_held() -> list[torch.Tensor]:
        # The fp32 master partitions: ZeRO-1/2 keep them in single_partition_of_fp32_groups,
        # ZeRO-3 in fp32_partitioned_groups_flat (handed to the torch optimizer only inside
        # step()); ZeRO-3's parameter partitions hang off each parameter as ds_tensor, and its
        # gradient partitions live in one flat buffer made with the engine (untracked until
        # backward first writes to it, it would be missing from a peak at backward's start).
        masters = (getattr(optimizer, "single_partition_of_fp32_groups", None)
                   or getattr(optimizer, "fp32_partitioned_groups_flat", None) or [])
        partitions = [p.ds_tensor for p in engine.module.parameters() if hasattr(p, "ds_tensor")]
        grad_buffer = getattr(optimizer, "grad_partitions_flat_buffer", None)
        return [*masters, *partitions, *([grad_buffer] if grad_buffer is not None else [])]

    return steps.prepared(optimizer, memory_held=memory_held, engine_report=engine_report)


def unsupported_reason(cell: CellSpec, device_type: str) -> str | None:
    """fp16 on a CPU without oneDNN fp16: DeepSpeed's own refusal, asked of the same check
    deepspeed.initialize makes (its CPU accelerator), so it holds on any CPU."""
    if cell.strategy.precision == "fp16" and device_type == "cpu":
        from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

        if not CPU_Accelerator().is_fp16_supported():
            return f"DeepSpeed: {FP16_UNSUPPORTED} (the CPU accelerator has no fp16 support)"
    return None


# ZeRO-1 runs the ZeRO-2 code path with gradient partitioning deferred to the end of
# backward: it then frees the full gradients and keeps its partition, as ZeRO-2 does. With
# accumulation it reduces at the boundary's backward only, the whole gradients summed until
# then (EngineModel.accumulated_grads).
_STAGE12_MODEL = EngineModel(sharded=frozenset({"optimizer", "grads"}), fp32_master_partition=True, comm="deepspeed",
                             frees_16bit_grads_before_step=True, accumulated_grads="unsharded_compute",
                             overlap_comm_default=False)
STRATEGIES = (
    Strategy(
        name="deepspeed_zero1", summary="DeepSpeed ZeRO stage 1: optimizer state partitioned", engine="deepspeed",
        families=("deepspeed",), zero_idea="zero1", capabilities=_STAGE12_CAPABILITIES,
        combination_problem=combination_problem, unsupported_reason=unsupported_reason,
        engine_model=_STAGE12_MODEL, prepare=prepare,
    ),
    Strategy(
        name="deepspeed_zero2", summary="DeepSpeed ZeRO stage 2: optimizer state and gradients partitioned",
        engine="deepspeed", families=("deepspeed",), zero_idea="zero2", capabilities=_STAGE12_CAPABILITIES,
        combination_problem=combination_problem, unsupported_reason=unsupported_reason,
        engine_model=dataclasses.replace(_STAGE12_MODEL, grad_partition_in_backward=True, last_rank_heavier=True,
                                         accumulated_grads="sharded_beside_partition"),
        prepare=prepare,
    ),
    Strategy(
        name="deepspeed_zero3", summary="DeepSpeed ZeRO stage 3: optimizer state, gradients and parameters partitioned",
        engine="deepspeed", families=("deepspeed",), zero_idea="zero3", capabilities=_STAGE3_CAPABILITIES,
        combination_problem=combination_problem, unsupported_reason=unsupported_reason,
        engine_model=EngineModel(sharded=frozenset({"optimizer", "grads", "params"}), fp32_master_partition=True,
                                 grad_buffer="deepspeed_reduce_bucket", persistent_params="deepspeed_threshold",
                                 comm="deepspeed", keeps_gathered="within_live_parameters",
                                 grad_partition_in_backward=True, steps_in_sub_groups=True,
                                 overlap_comm_default=True),
        prepare=prepare,
    ),
)
