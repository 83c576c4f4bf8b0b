"""Peak memory of one training step, predicted by tracing it: no tensor memory is allocated.

What is predicted: the heaviest rank's peak tensor bytes in the memory-tracked step of a
cell, by category (memory.BREAKDOWN_KEYS, summing to the peak), i.e. what the record's
``metrics`` (the max over ranks) report for the cell run on the CPU with gloo: rank 0's, and
where another rank can hold more, that rank's too (``traced_ranks``: a pipeline's last stage
and the rank its schedule puts highest, DeepSpeed ZeRO-2's last rank, the fullest rank of a
whole-tensor optimizer partition).

How: the harness's own code runs the cell under ``FakeTensorMode`` (tensors carry shapes,
dtypes and storages but no data) in a fake process group of the cell's world size
(``torch.testing._internal.distributed.fake_pg``; this process is rank 0 of W, one node,
with the variables torchrun would set), as harness.training.run_cell does on every rank:
training.prepare_cell (models.build → checkpointing.apply_checkpointing →
strategies.get(name).prepare, and training.local_batches) → ``cell.warmup`` steps of
training.train_step → the memory-tracked step (memory.track_step_memory) with the same
trackers (MemTracker; FSDPMemTracker for FSDP2). The trackers count storages and a fake
storage has the size the real one would have, so the numbers are the measurement's wherever
the traced step allocates what the real step allocates: on the default suite, every traced
cell to the byte but those listed below.
A tiny cell takes 0.4-1.5 s (DeepSpeed ZeRO-3 with accumulation up to 8 s); gpt2-1.5b and
llama3-8b under fsdp_full at 64 ranks, micro-batch 1, 11-20 s at under 400 MB of RSS.

The step is the CPU/gloo step (DistEnv device cpu, backend gloo): CPU SDPA kernels, no
allocator rounding, PowerSGD's single gloo bucket, gloo's reduce-scatter copy (below). For a
CUDA run expect the caching allocator's 512-byte rounding, library workspaces and other
attention kernels on top. Hybrid sharding gets the one-node mesh (distributed.hsdp_shape).

What the fake world needs, each the smallest stand-in for something that reads real data or
real peers:
- Collectives: the fake group's works complete with no value (a future of None), and DDP's
  reducer and its comm hooks read the reduced bucket from the future: every c10d collective
  gets a completed work whose value is its outputs, as gloo's has. Gloo runs a
  reduce-scatter as an all-reduce of a copy of the whole input and, when the work is waited
  on, splits that copy on the caller's thread, where the tracker sees it: the traced
  reduce-scatter makes the same copy at wait() (FSDP1 bf16 and ViT FSDP2 peak right there).
- DDP checks parameter shapes across ranks in C++ with real metadata tensors (skipped: no
  peers) and rebuilds its buckets before the second forward by broadcasting rank 0's order
  in int32 tensors it fills in C++: the rebuild is run at that point with those index
  tensors real (the rebuilt buckets are fake).
- DeviceMesh keeps its ranks in a tensor it reads: meshes are built outside fake mode, and
  so is the mesh FSDP2 joins from the dp and tp dimensions of a tensor-parallel model.
- DTensor derives an op's global output shape by running the op on fake tensors of the
  global shape in whichever fake mode is active, which in a trace is the step's own: the
  tracker counted them as the rank's. torch's loss_parallel does so on every call, its
  cross-entropy over the whole vocabulary (gpt2 with 50,257 tokens under tp: 1.22 and 2.11 of
  the measured peak at 2 and 4 ranks, to the byte once run outside the step's mode).
- Data-dependent Python scalars (``.item()``, ``bool(t)``) that fake mode cannot know read as
  0: GradScaler's found-inf count (the step is taken), Adafactor's parameter RMS (a step-size
  factor), the rejection loop of trunc_normal_ in ViT's init (one draw), bitsandbytes LAMB's
  weight norm (a 0-d tensor it hands its update op where the op's schema takes a float: read
  first, ``_WithPythonParamNorm``). Constants fake mode made itself (an optimizer's step
  count) keep their value.
- transformers reads position ids to detect packed sequences and, on fake tensors, assumes
  they may be packed and builds an explicit causal mask the real run never makes (16 KB per
  two gpt2-tiny samples). The harness never packs (every sample's positions are 0..T-1), so the answer
  the real run computes, "not packed", is given.
- torch 2.13's Module.to() swaps fake parameters, and swap_tensors refuses weakly referenced
  tensors ("Cannot swap t1 because it has weakref associated with it", pytorch/pytorch#170781):
  this fake mode does not memoise wrapping fresh meta tensors (what holds the weak
  references), and DeepSpeed's debug map of parameter names is not filled.
- DeepSpeed ZeRO-3 checks that every rank fetches parameters in the same order (skipped: no
  peers).
- A mixture of experts' grouped matmul (``aten._grouped_mm``): torch's meta kernel keeps
  CUDA's bf16-only rule, and the CPU kernel the cell runs takes fp32 too, so fp32 calls get
  their output shape (``_grouped_mm_shape``) from the fake mode directly.
- A pipeline stage learns its input and gradient shapes from its neighbours' pickled
  metadata (``recv_object_list`` reads the bytes with ``.numpy()``): rank 0 answers for its
  neighbours (``_pipeline_metadata_from_this_rank``), as every cut between blocks carries
  the same hidden state. The stages' vote on static shapes reads 0, dynamic, as the real
  run's does (no stage is given its shapes).

Known differences from the measurement (the default and full suites, CPU, 2 ranks):
- Two ranks at most (``traced_ranks``), three in a pipeline. A pipeline's first and last (and
  on more than two ranks a middle one: the one whose stage its schedule makes heaviest, or
  the one with the most blocks, whose work prices the middle ranks' steps): llama-tiny on 2 ranks,
  GPipe's rank 1 (1.40× rank 0's: the last stage keeps every micro-batch's logits) and
  1F1B's to the byte, interleaved 1F1B 0.964 (its rank 1 holds stages 1 and 3, traced from
  rank 0's forward metadata). DeepSpeed ZeRO-2's last rank (gpt2-tiny fp32: 9.9 % above
  rank 0, rank 1 to the byte) and the fullest rank of FairScale OSS/SDP's and
  ZeroRedundancyOptimizer's partitions (gpt2-tiny: 0.7 % above rank 0) are traced too. Where
  even shards still leave one rank a little more (FSDP2 on llama-tiny: 0.26 %), rank 0 stands
  for them all.
- Comm hooks' future callbacks (PowerSGD's P/Q temporaries): the trace completes futures on
  the caller's thread, where the callbacks run inline; track_step_memory runs them without
  the tracker there, as it does on gloo's thread in the measured step (measure/memory.py), so
  neither counts what they allocate.
- Timing: where an engine frees memory in callbacks on gloo's threads, the measured peak
  depends on when they ran (llama-tiny deepspeed_zero2 fp32, rank 0: 3,791,056 B in one run,
  3,649,236 B, the traced value, in another); the trace has no concurrency.
- Data-dependent values read as 0: a measured step skipped on an fp16 overflow is predicted
  as a step taken; control flow that depends on values received from other ranks follows
  rank 0's own values.

Not traced (``{"unavailable": reason}``): cells that are not valid combinations; cells the
CPU cannot run as themselves (strategies.unsupported_reason(cell, "cpu"): the trace runs the
CPU step); DeepSpeed's optimizer offload (DeepSpeedCPUAdam, a C++ kernel on the tensors'
data, segfaults on fake tensors: refused before it can take the process down); DeepSpeed
AutoEP (``_AUTOEP``). Their records keep the analytic peak alone; for the step time these
two trace a stand-in, the nearest cell that traces (``work_stand_in``), whose dispatched work
the record keeps as ``stand_in``. Anything else that raises while tracing gives its
exception and the frame that raised it, condensed; where it is an error the step's own code
raises whatever the tensors hold (``FAILS_FOR_REAL``), the result also says ``"fails"``: a
real run of the configuration fails the same way, and planning must not call it a fit.

Kernels (``kernels``): the CPU's by default, as the cell's own step runs them here.
``harness plan`` plans for GPUs and traces with CUDA's (``kernels="cuda"``), for attention and
for the optimizer. torch's Adam and AdamW take their multi-tensor path by default for CUDA
tensors, whose out-of-place sqrt(v̂) + ε is one fp32 copy of every parameter of the rank at
once; for CPU tensors their one-tensor-at-a-time path, two copies of the largest tensor
(Moonlight's 4-layer cut under DDP, whose step is its peak: 56.1 GiB against 49.5). torch's SDPA
takes its flash kernel where CUDA's would (16-bit, no mask, equal head widths up to 256;
grouped K and V as they are) and its memory-efficient kernel for the rest (a mask, unequal
query and value head widths: DeepSeek's latent attention), each keeping its output and an
fp32 log-sum-exp a row. The CPU's would run its math kernel there, keeping every score in
fp32 (a bf16 model's too): at Moonlight-16B's size (27 layers, 16 heads, 4,096 tokens) tens
of GiB a GPU never holds. Fake tensors take both kernels' CUDA ops through their meta
kernels. Left to the CPU's math kernel: an fp32 model with grouped K and V passed as they
are (enable_gqa), which CUDA runs in its math kernel too.

``trace`` needs a process without a process group (it makes and destroys a fake one);
``trace_cells`` runs it for a list of cells in one fresh subprocess
(``python -m harness.predict.traced --cells cells.json --out out.json [--kernels cuda]``).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import unittest.mock
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor._sharding_prop import ShardingPropagator
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from harness import distributed, entry, strategies, training
from harness.config import CellSpec
from harness.distributed import DistEnv
from harness.measure import memory
from harness.measure.dispatched_work import DispatchedWork
from harness.predict import analytic, analytic_data_parallel
from harness.strategies import (  # deepspeed_zero.import_deepspeed: its accelerator set before the import
    deepspeed_zero,
    pipeline,
)

# A trace subprocess that traces no cell for this long is killed (a cell traces in well under a
# minute at real size; a share of thousands of cells takes longer in all, and goes on).
DEFAULT_TIMEOUT_S = 600.0
PROGRESS_EVERY_S = 30.0
_TRACED_PREFIX = "traced "  # the subprocess's line per cell done, counted for the progress
# Trace subprocesses at once (each one thread, its own torch and transformers: ~1 GB of memory).
MAX_TRACE_PROCESSES = 8
_REASON_CHARS = 400
KERNELS = ("cpu", "cuda")  # whose kernels a trace runs, attention and optimizer (above)
_FLASH_HEAD_WIDTHS = 256  # the widest head CUDA's flash kernel takes

# Found by trying (DeepSpeed 0.19.8): with its activation check (an allclose on a probe) run on
# real tensors, the step fails in backward: "IndexPutBackward0 returned an invalid gradient at
# index 1 - got [128, 64] but expected shape compatible with [0, 64]".
_AUTOEP = ("DeepSpeed AutoEP sizes each expert's token buffers from the routing's counts, values that"
           " fake tensors do not have (they read as 0, so the traced shapes are wrong: its backward fails"
           " on a [0, hidden] buffer); the analytic prediction stands in")
# Found by trying (DeepSpeed 0.19.8): the step segfaults, in the C++ kernel of DeepSpeedCPUAdam.
_DEEPSPEED_CPU_ADAM = (
    "DeepSpeed's offload_optimizer steps with DeepSpeedCPUAdam, a C++ kernel that reads the"
    " tensors' data: on fake tensors (no data) the process dies with a segmentation fault"
)

# Ops whose CPU kernel is Python written in torch ops (around other custom ops, which fake
# tensors answer): the trace runs that kernel, so that what it dispatches is counted and what
# it allocates tracked, as in the real step, where the op alone would be one fake answer.
# bitsandbytes 0.49's CPU 8-bit optimizer update: ~40 ops per parameter tensor, dequantizing
# both states to fp32, updating, and quantizing them back (bitsandbytes/backends/cpu/ops.py).
_COMPOSITE_CPU_KERNELS = frozenset({"bitsandbytes::optimizer_update_8bit_blockwise"})
_CPU_KERNEL = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)

_c10d = torch.ops.c10d
# c10d ops returning (outputs, work): the value of the work's future is the outputs (a
# single output tensor as a one-element list), as gloo's and NCCL's futures are.
_COLLECTIVES_WITH_WORK = {
    _c10d.allreduce_.default,
    _c10d.broadcast_.default,
    _c10d.allgather_.default,
    _c10d._allgather_base_.default,
    _c10d.reduce_scatter_.default,
    _c10d._reduce_scatter_base_.default,
}


def _fake_world_mode():
    """FakeTensorMode, plus what the fake group and fake tensors cannot answer, answered as
    the real run would (one dispatch layer: a second mode would add its cost to every op)."""
    from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensorMode

    class FakeWorldMode(FakeTensorMode):
        work: DispatchedWork | None = None  # set while the counted step runs

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = self._answer(func, types, args, kwargs)
            # NotImplemented: a subclass's op (a DTensor optimizer's, under FSDP2) handed back to
            # the subclass, whose ops on its local tensors come back here and are the work.
            # Counted too, each such op was twice (FSDP2's AdamW step, traced without the memory
            # tracker's mode above this one: 1,095 ops a llama-tiny step against 927 with it and
            # 908 counted in the real step).
            if self.work is not None and out is not NotImplemented:
                self.work.add(func, args, kwargs or {}, out)
            return out

        def _answer(self, func, types, args, kwargs):
            if func.name() in _COMPOSITE_CPU_KERNELS:
                return func.redispatch(_CPU_KERNEL, *args, **kwargs)
            if func is torch.ops.aten._grouped_mm.default and args[0].dtype != torch.bfloat16:
                # Its meta kernel keeps CUDA's bf16-only rule; the CPU kernel the cell runs
                # (a mixture of experts' grouped matmul) takes fp32 too.
                shape = _grouped_mm_shape(args[0], args[1], args[2] if len(args) > 2 else kwargs.get("offs"))
                dtype = kwargs.get("out_dtype") or args[0].dtype
                return super().__torch_dispatch__(torch.ops.aten.empty.memory_format, types, (shape,),
                                                  {"dtype": dtype, "device": args[0].device})
            if func is torch.ops.aten._local_scalar_dense.default:
                try:  # fake mode knows the constants it made (an optimizer's step count)
                    return super().__torch_dispatch__(func, types, args, kwargs)
                except DataDependentOutputException:
                    return _zero_of(args[0].dtype)
            out = super().__torch_dispatch__(func, types, args, kwargs)
            if func is _c10d._reduce_scatter_base_.default:
                return out[0], _gloo_reduce_scatter_work(output=args[0], input=args[1]).boxed()
            if func in _COLLECTIVES_WITH_WORK:
                from torch._C._distributed_c10d import _create_work_from_future

                outputs = out[0]
                future = torch.futures.Future()
                future.set_result([outputs] if isinstance(outputs, torch.Tensor) else outputs)
                return outputs, _create_work_from_future(future).boxed()
            return out

    mode = FakeWorldMode()
    # Module.to() swaps fake parameters and swap_tensors refuses tensors with weak references;
    # the converter memo is what holds them (see the module docstring).
    mode.fake_tensor_converter.set_tensor_memo = lambda tensor, fake: None
    return mode


def _grouped_mm_shape(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor | None) -> list[int]:
    """aten._grouped_mm's output shape: 2-D × 2-D gives a matrix per group (offs splits the
    shared dimension), 2-D × 3-D and 3-D × 2-D split the rows of the 2-D side, 3-D × 3-D is a
    batched matmul."""
    if a.dim() == 2 and b.dim() == 2:
        if offs is None:
            raise ValueError("_grouped_mm of two matrices needs offs")
        return [offs.size(0), a.size(0), b.size(1)]
    if a.dim() == 2:
        return [a.size(0), b.size(-1)]
    if b.dim() == 2:
        return [a.size(1), b.size(1)]
    return [a.size(0), a.size(1), b.size(-1)]


def _zero_of(dtype: torch.dtype) -> bool | int | float:
    """What ``.item()`` of a tensor of `dtype` returns, as 0."""
    if dtype is torch.bool:
        return False
    return 0.0 if dtype.is_floating_point or dtype.is_complex else 0


def _gloo_reduce_scatter_work(*, output: torch.Tensor, input: torch.Tensor):
    """A work that does on wait() what gloo's reduce_scatter_tensor does on this thread.

    Gloo all-reduces a copy of the whole input on its own thread (unseen by the tracker) and,
    when the work is waited on, splits that copy and copies this rank's chunk into the output
    on the caller's thread: the tracker sees an input-sized buffer appear then, alive as long
    as the work (FSDP's reduce-scatter of the unsharded gradient: a full-size fp32 buffer).
    """
    from torch._C._distributed_c10d import PythonCallbackWork

    held: list[torch.Tensor] = []

    def wait(timeout) -> bool:
        if not held:
            held.append(input.detach().clone())
            output.view(-1).copy_(held[0].view(-1)[: output.numel()])  # rank 0's chunk
        return True

    return PythonCallbackWork(wait)


class _RealIndexTensors(TorchDispatchMode):
    """Real int32 factory tensors, and real results of ops on real tensors only: DDP's bucket
    rebuild fills and broadcasts int32 index tensors in C++ (at::empty + accessor)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily

        kwargs = kwargs or {}
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        if tensors:
            real = not any(isinstance(t, FakeTensor) for t in tensors)
        else:
            real = kwargs.get("dtype") is torch.int32
        if real:
            with unset_fake_temporarily():
                return func(*args, **kwargs)
        return func(*args, **kwargs)


@contextmanager
def _cuda_kernels() -> Iterator[None]:
    """The step's attention and optimizer as CUDA would run them (the module docstring's
    "Kernels"): torch's SDPA patched where transformers looks it up at every call, so that
    recomputation under checkpointing runs the same kernel as the forward did (a
    TorchFunctionMode is not active where autograd recomputes); Adam's default path the one
    it takes for CUDA tensors."""
    cpu_sdpa = torch.nn.functional.scaled_dot_product_attention

    def sdpa(*args: Any, **kwargs: Any) -> torch.Tensor:
        out = _cuda_sdpa(*args, **kwargs)
        return cpu_sdpa(*args, **kwargs) if out is None else out

    def multi_tensor_default(params: list[torch.Tensor], differentiable: bool,
                             use_fused: bool = False) -> tuple[bool, bool]:
        return False, not differentiable  # (fused, foreach), as for CUDA tensors

    with (unittest.mock.patch.object(torch.nn.functional, "scaled_dot_product_attention", sdpa),
          unittest.mock.patch("torch.optim.adam._default_to_fused_or_foreach", multi_tensor_default)):
        yield


def _cuda_sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None = None,
               dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
               enable_gqa: bool = False) -> torch.Tensor | None:
    """The output of the fused kernel CUDA's SDPA would pick for these inputs, or None where it
    would run its math kernel (as the CPU's does). Under autocast (the trace's is the CPU's)
    its inputs are cast to the autocast precision first, as CUDA's autocast casts SDPA's."""
    if torch.is_autocast_enabled("cpu"):
        dtype = torch.get_autocast_dtype("cpu")
        query, key, value = (t.to(dtype) for t in (query, key, value))
    widths = {query.shape[-1], key.shape[-1], value.shape[-1]}
    if (attn_mask is None and query.dtype in (torch.float16, torch.bfloat16) and len(widths) == 1
            and max(widths) <= _FLASH_HEAD_WIDTHS):
        return torch.ops.aten._scaled_dot_product_flash_attention(query, key, value, dropout_p, is_causal, False,
                                                                  scale=scale)[0]
    if key.shape[-3] != query.shape[-3]:  # grouped K and V: the memory-efficient kernel takes them expanded
        return None
    bias = attn_mask
    if bias is not None and bias.dtype == torch.bool:  # SDPA's own conversion, on CUDA too
        bias = torch.zeros(bias.shape, dtype=query.dtype).masked_fill_(bias.logical_not(), float("-inf"))
    return torch.ops.aten._scaled_dot_product_efficient_attention(query, key, value, bias, query.requires_grad,
                                                                  dropout_p, is_causal, scale=scale)[0]


@contextmanager
def _fake_group(world_size: int, rank: int = 0) -> Iterator[DistEnv]:
    """A fake process group of `world_size` with this process as `rank` (one node), the
    variables torchrun would set, and the DistEnv the worker would get."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("trace() creates its own fake process group; this process already has one:"
                           " use trace_cells(), which traces in a fresh subprocess")
    torchrun = {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
                "LOCAL_WORLD_SIZE": str(world_size)}
    distributed.mesh.cache_clear()  # meshes of an earlier group
    with unittest.mock.patch.dict(os.environ, torchrun):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
        try:
            yield DistEnv(rank=rank, world_size=world_size, nnodes=1, device=torch.device("cpu"), backend="gloo")
        finally:
            distributed.mesh.cache_clear()
            _destroy_group()


def _destroy_group() -> None:
    deepspeed_comm = sys.modules.get("deepspeed.comm.comm")
    if deepspeed_comm is not None and deepspeed_comm.cdb is not None and deepspeed_comm.cdb.is_initialized():
        deepspeed_comm.destroy_process_group()  # also drops DeepSpeed's cached groups
    else:
        dist.destroy_process_group()


def _outside_fake_mode(fn: Callable) -> Callable:
    def call(*args, **kwargs):
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        with unset_fake_temporarily():
            return fn(*args, **kwargs)

    return call


def _no_op(*args, **kwargs) -> None:
    pass


class _WithPythonParamNorm:
    """bitsandbytes' 32-bit update op with its ``param_norm`` (the 8th argument, LAMB's weight
    norm) as a Python float: bitsandbytes passes a 0-d tensor where the op's schema takes a
    float, which a real tensor converts to and a fake one refuses; read, it is data-dependent
    (0 here, as every such scalar in the trace). Everything else is the op's own."""

    def __init__(self, op: Any) -> None:
        self._op = op

    def __call__(self, *args: Any) -> Any:
        norm = args[7]
        return self._op(*args[:7], float(norm) if isinstance(norm, torch.Tensor) else norm, *args[8:])

    def __getattr__(self, name: str) -> Any:
        return getattr(self._op, name)


@contextmanager
def _patched_for_fake_world(cell: CellSpec, stage_metas: list[object]) -> Iterator[None]:
    """Each patch stands for a step that needs real data or peers; see the module docstring.
    ``stage_metas``: the forward metadata pipeline stages sent, kept across the ranks traced."""
    patches: list[contextlib.AbstractContextManager[object]] = [
        unittest.mock.patch.object(distributed, "mesh", _outside_fake_mode(distributed.mesh)),
        # FSDP2 over a tensor-parallel model joins the dp and tp sub-meshes into a new mesh.
        unittest.mock.patch.object(DeviceMesh, "_concatenate",
                                   staticmethod(_outside_fake_mode(DeviceMesh._concatenate))),
        # DTensor's global-shape propagation (module docstring), in a fake mode of its own.
        unittest.mock.patch.object(ShardingPropagator, "_propagate_tensor_meta_non_cached",
                                   _outside_fake_mode(ShardingPropagator._propagate_tensor_meta_non_cached)),
        unittest.mock.patch("torch.nn.parallel.distributed._verify_param_shape_across_processes", _no_op),
        unittest.mock.patch("transformers.masking_utils.find_packed_sequence_indices", _no_op),
    ]
    if cell.strategy.pipelined:
        patches += _pipeline_metadata_from_this_rank(stage_metas)
    if cell.strategy.optimizer in ("lamb", "lamb8bit"):
        import bitsandbytes  # noqa: F401  (registers torch.ops.bitsandbytes)
        patches.append(unittest.mock.patch.object(torch.ops.bitsandbytes, "optimizer_update_32bit",
                                                  _WithPythonParamNorm(torch.ops.bitsandbytes.optimizer_update_32bit)))
    if cell.strategy.name.startswith("deepspeed"):
        patches += [
            # Debug names of parameters, kept in weakref.finalize maps: Module.to() on fake
            # parameters swaps tensors, and swap_tensors refuses weakly referenced ones.
            unittest.mock.patch("deepspeed.utils.debug.WeakIdNameMap.__setitem__", _no_op),
            # ZeRO-3 checks that every rank traces the same module order; rank 0 is alone.
            unittest.mock.patch("deepspeed.runtime.zero.partitioned_param_coordinator"
                                ".assert_ints_same_as_other_ranks", _no_op),
        ]
    with contextlib.ExitStack() as stack:
        for patch in patches:
            stack.enter_context(patch)
        yield


def _pipeline_metadata_from_this_rank(sent: list[object]) -> list[contextlib.AbstractContextManager[object]]:
    """A pipeline stage infers its input and gradient shapes from its neighbours' metadata,
    pickled through p2p (recv_object_list reads the bytes with ``.numpy()``). With no peers,
    a stage's neighbour is answered from what was ``sent``: the previous stage sends the hidden
    state a stage sent on (every cut between blocks carries the same hidden state; the last
    rank, which sends none forward, is traced after rank 0 and reads rank 0's), and the next
    stage sends gradients shaped as this stage's outputs."""
    from torch.distributed.pipelining import _utils
    from torch.distributed.pipelining.stage import PipelineStage

    def send_meta(stage: PipelineStage, meta: object, dst_stage: int) -> None:
        sent.append(meta)

    def recv_meta(stage: PipelineStage, src_stage: int) -> object:
        if src_stage < stage.stage_index:
            return next(m for m in reversed(sent) if isinstance(m, _utils._StageForwardMeta))
        outputs = stage._stage_meta.outputs
        if outputs is None:
            raise RuntimeError(f"stage {stage.stage_index}: gradients asked for before its forward metadata")
        return _utils._StageBackwardMeta(backward_metas=_utils._derive_grad_metas(outputs))

    return [unittest.mock.patch.object(PipelineStage, "_send_meta", send_meta),
            unittest.mock.patch.object(PipelineStage, "_recv_meta", recv_meta)]


def _rebuild_ddp_buckets(model: torch.nn.Module) -> None:
    """What DDP does before the second step's forward, with its index tensors real."""
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, DistributedDataParallel):
        with _RealIndexTensors():
            model.reducer._rebuild_buckets()


def _run(cell: CellSpec, env: DistEnv, mode, tracked: bool = True) -> tuple[memory.StepMemory | None, DispatchedWork]:
    """The training step's warm-up and memory-tracked step (and DDP's bucket rebuild where DDP
    would make it, before the second step), and what the tracked step dispatched; not
    ``tracked``: that step without the memory tracker (None for its memory), which dispatches
    the same ops, and the wait on each functional collective (tensor parallelism's all-reduces)
    that the real step dispatches and the tracker answers itself. A real-data cell is traced
    on synthetic batches of its shapes: a step's memory follows the shapes, not the values, and
    the loader's real tensors cannot enter the fake mode."""
    session = training.prepare_cell(dataclasses.replace(cell, data="synthetic", eval_every=None), env)
    for i in range(cell.warmup_steps):
        if i == 1:
            _rebuild_ddp_buckets(session.prep.model)
        # The last warm-up step keeps what the tracker counts as the engine's buffers.
        (session.last_warmup_step if tracked and i == cell.warmup_steps - 1 else session.step)(i)
    mode.work = DispatchedWork()
    if not tracked:
        session.step(cell.warmup_steps)
        return None, mode.work
    return session.tracked_step(cell.warmup_steps)[1], mode.work


# Messages of errors a real run raises too. torch's selective checkpointing refuses a
# recompute that issues an op its forward did not: DeepSpeed ZeRO-3 fetching, inside a
# block's recompute, a parameter that block's forward found gathered, as it does at real
# size (llama-1b, llama3-8b) beyond its reuse distance. Reproduced for real: gpt2-tiny on 2
# gloo ranks with stage3_max_reuse_distance 1,000 and stage3_max_live_parameters 20,000
# fails at its first step with this error, as its trace does; at seven other settings
# (everything kept, nothing kept, partial residencies) the trace and the real run both step.
FAILS_FOR_REAL = ("encountered during backward but not found in storage",)


def _failure(error: BaseException, rank: int) -> dict:
    reason = f"tracing failed{f' on rank {rank}' if rank else ''}: {_condensed(error)}"
    return {"unavailable": reason, **({"fails": reason} if any(m in str(error) for m in FAILS_FOR_REAL) else {})}


def _condensed(error: BaseException) -> str:
    """``Type: first line of the message (at file:line that raised) [<- its cause]``, one line."""
    parts: list[str] = []
    link: BaseException | None = error  # the error, then its cause
    while link is not None and len(parts) < 2:
        message = str(link).strip().splitlines()
        text = f"{type(link).__name__}: {message[0] if message else ''}".strip()
        frames = traceback.extract_tb(link.__traceback__)
        if frames:
            path = Path(frames[-1].filename)
            text += f" (at {'/'.join(path.parts[-2:])}:{frames[-1].lineno})"
        parts.append(text)
        link = link.__cause__
    text = " <- ".join(parts)
    return text if len(text) <= _REASON_CHARS else text[: _REASON_CHARS - 3] + "..."


def _refusal(cell: CellSpec) -> str | None:
    """Why `cell` is not attempted, or None: not a valid cell, not a cell the CPU runs as
    itself (the trace runs the CPU step), or an engine known to crash the process on fake
    tensors (a crash would take the remaining cells of trace_cells with it)."""
    problem = strategies.incompatibility(cell)
    if problem:
        return f"not a valid cell: {problem}"
    why = strategies.unsupported_reason(cell, "cpu")
    if why:
        return f"the trace runs the step on the CPU, which cannot run this cell as itself: {why}"
    s = cell.strategy
    if s.name.startswith("deepspeed") and s.offload in ("optimizer", "optimizer_params"):
        return _DEEPSPEED_CPU_ADAM
    if s.name == "deepspeed_autoep":
        return _AUTOEP
    return None


def work_stand_in(cell: CellSpec) -> CellSpec | None:
    """The nearest cell that traces, for a refused cell whose step differs from it in what
    the trace cannot run, or None. DeepSpeed's optimizer offload: the same cell with the
    optimizer on the device (on a CPU host the same AdamW step over the same partition; the
    host copies are left out); AutoEP: the same model under DeepSpeed's lightest ZeRO stage
    here, ZeRO-1 (the same engine and the same experts' FLOPs, each rank running all experts
    for its own tokens rather than its experts for every rank's)."""
    s, refused = cell.strategy, _refusal(cell)
    if refused == _DEEPSPEED_CPU_ADAM:
        stand_in = dataclasses.replace(cell, strategy=dataclasses.replace(
            s, offload="params" if s.offload == "optimizer_params" else "none"))
    elif refused == _AUTOEP:
        stand_in = dataclasses.replace(cell, strategy=dataclasses.replace(s, name="deepspeed_zero1"))
    else:
        return None
    return None if _refusal(stand_in) else stand_in


def _with_stand_in(result: dict, stand_in: CellSpec, traced_stand_in: dict) -> dict:
    """A refused cell's result with its stand-in's work, where the stand-in traced."""
    if "work" not in traced_stand_in:
        return result
    return {**result, "stand_in": {"cell_id": stand_in.cell_id, "strategy": stand_in.strategy.name,
                                   "work": traced_stand_in["work"]}}


def trace(cell: CellSpec, stand_in: bool = True, kernels: str = "cpu", work_only: bool = False) -> dict:
    """The predicted step peak, the heaviest of ``traced_ranks``: {"peak_bytes",
    "breakdown_bytes" {memory.BREAKDOWN_KEYS, summing to peak_bytes}, "tracker", "work" (what
    rank 0's tracked step dispatched: dispatched_work.DispatchedWork.to_dict, for the step-time
    predictor), and for a pipeline its other ranks' (pipeline.other_ranks_work)}, or
    {"unavailable": "<one-line reason>"} when the cell
    cannot be traced (never raises for such a cell: what the attempt raised, condensed, is
    the reason), with {"stand_in": {"cell_id", "work"}} where ``work_stand_in`` names one
    that traced (unless ``stand_in`` is False: trace_cells traces stand-ins with the cells).
    ``kernels``: whose kernels the step runs, attention and optimizer (KERNELS; the module docstring).
    ``work_only``: {"work"} alone, rank 0's, its step run without the memory tracker (what
    ``plan --calibration`` prices a configuration's step from): none of the tracker's cost, and
    no second rank where the peak needs one (a pipeline's, ZeRO-2's last, a whole-tensor
    optimizer partition's fullest).

    Needs a process without a process group (raises RuntimeError otherwise): use
    trace_cells() from a process that has one.
    """
    refused = _refusal(cell)
    if refused:
        nearest = work_stand_in(cell) if stand_in else None
        return {"unavailable": refused} if nearest is None else _with_stand_in(
            {"unavailable": refused}, nearest, trace(nearest, kernels=kernels, work_only=work_only))
    stage_metas: list[object] = []
    traced: list[tuple[memory.StepMemory | None, DispatchedWork]] = []
    try:
        ranks = [0] if work_only else traced_ranks(cell)
    except Exception as error:  # choosing a pipeline's ranks runs the analytic model on the cell
        return _failure(error, 0)
    for rank in ranks:
        with _fake_group(cell.world_size, rank) as env:
            try:
                mode = _fake_world_mode()
                on_cuda = _cuda_kernels() if kernels == "cuda" else contextlib.nullcontext()
                with mode, on_cuda, _patched_for_fake_world(cell, stage_metas):
                    traced.append(_run(cell, env, mode, tracked=not work_only))
            except Exception as error:  # an untraceable cell is a result, like an unsupported one
                return _failure(error, rank)
    work_by_rank = {rank: work.to_dict() for rank, (_, work) in zip(ranks, traced)}
    if work_only:
        return {"work": work_by_rank[0]}
    mem = max((m for m, _ in traced if m is not None), key=lambda m: m.peak_bytes)  # None: work_only, returned above
    return {"peak_bytes": mem.peak_bytes, "breakdown_bytes": mem.breakdown_bytes, "tracker": mem.tracker,
            "work": work_by_rank[0],
            **(pipeline.other_ranks_work(cell.world_size, work_by_rank) if cell.strategy.pipelined else {})}


def traced_ranks(cell: CellSpec) -> list[int]:
    """The ranks whose steps are traced, the heaviest's peak being the prediction, as the
    record's is the max over ranks: rank 0, and where another rank can hold more, that one.
    A pipeline's last (it keeps the logits: GPipe's of every micro-batch), traced last, and
    before it the rank its schedule, played out, says holds most
    (analytic_parallel.pipeline_rank_peak: a middle stage's blocks where the first holds
    fewer, llama-tiny's on 4 ranks twice rank 0's), or where that is the first or the last
    and there are ranks between them, the one of those with the most blocks
    (pipeline.busiest_middle_rank): the step-time predictor plays the schedule out with the
    first, a middle and the last ranks' work (pipeline.other_ranks_work). The last where the
    engine's last rank is heavier (EngineModel.last_rank_heavier); the fullest of a
    whole-tensor optimizer partition (analytic_data_parallel.fullest_optimizer_rank). The
    work is rank 0's (and a pipeline's others' beside it)."""
    last = cell.world_size - 1
    if cell.strategy.pipelined:
        heaviest = _heaviest_pipeline_rank(cell)
        middle = heaviest if 0 < heaviest < last else pipeline.busiest_middle_rank(
            cell.strategy.name, cell.model_spec.n_layers, cell.world_size)
        return list(dict.fromkeys([0, *([] if middle is None else [middle]), last]))
    if strategies.get(cell.strategy.name).engine_model.last_rank_heavier:
        other = last
    else:
        other = analytic_data_parallel.fullest_optimizer_rank(cell)
    return list(dict.fromkeys([0, other]))


def _heaviest_pipeline_rank(cell: CellSpec) -> int:
    """The pipeline rank the analytic model's schedule puts highest (rank 0 where the model
    has no figure for the cell)."""
    per_rank = analytic.predict(cell, device_type="cpu").get("per_rank_peak_bytes") or [0.0]
    return max(range(len(per_rank)), key=per_rank.__getitem__)


def trace_cells(cells: list[CellSpec], timeout_s: float = DEFAULT_TIMEOUT_S,
                progress: Callable[[int, int], None] | None = None, kernels: str = "cpu",
                work_only: bool = False) -> dict[str, dict]:
    """cell_id -> trace(cell), computed in fresh subprocesses (``python -m
    harness.predict.traced``), so this process (which may hold a real process group) is
    untouched: one per core up to ``MAX_TRACE_PROCESSES``, each tracing every n-th cell (a trace
    is one thread's work, and nothing else runs while the cells are traced). A cell whose trace
    raises gets {"unavailable": reason} and the others go on; if a subprocess dies, or traces no
    cell for `timeout_s`, every cell of its share without a result gets {"unavailable": ...}
    saying so (the first of them is the one it was tracing). Never raises for a cell. A refused
    cell's stand-in (``work_stand_in``) is traced among the cells, once, or taken from the cells
    where it is one of them. ``progress(traced, total)`` is called every PROGRESS_EVERY_S while
    the traces run (a large suite's take minutes). ``kernels``, ``work_only``: as trace's.
    """
    if kernels not in KERNELS:
        raise ValueError(f"kernels={kernels!r}: choose {' or '.join(KERNELS)}")
    if not cells:
        return {}
    # Stand-ins are traced beside the cells, once each, and not again where one is a cell too.
    stand_ins = {c.cell_id: s for c in cells if (s := work_stand_in(c)) is not None}
    to_trace = list({c.cell_id: c for c in [*cells, *stand_ins.values()]}.values())
    processes = max(1, min(MAX_TRACE_PROCESSES, os.cpu_count() or 1, len(to_trace)))
    shares = [to_trace[k::processes] for k in range(processes)]
    done = [0] * processes  # cells each subprocess has traced so far
    with concurrent.futures.ThreadPoolExecutor(max_workers=processes) as pool:
        running = [pool.submit(_trace_in_subprocess, share, timeout_s, done, k, kernels, work_only)
                   for k, share in enumerate(shares)]
        while concurrent.futures.wait(running, timeout=PROGRESS_EVERY_S).not_done:
            if progress is not None:
                progress(sum(done), len(to_trace))
        traced = [future.result() for future in running]
    results = {cell_id: result for share in traced for cell_id, result in share.items()}
    for cell_id, stand_in in stand_ins.items():
        results[cell_id] = _with_stand_in(results[cell_id], stand_in, results[stand_in.cell_id])
    return {cell.cell_id: results[cell.cell_id] for cell in cells}  # in the order given


def _trace_in_subprocess(cells: list[CellSpec], timeout_s: float, done: list[int], slot: int,
                         kernels: str, work_only: bool) -> dict[str, dict]:
    """One subprocess's share; ``done[slot]`` counts its traced cells as it reports them (a
    line on stderr each), and it is killed once it reports none for ``timeout_s``."""
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="shardbench-trace-") as tmp:
        cells_path, out_path = Path(tmp) / "cells.json", Path(tmp) / "out.json"
        cells_path.write_text(json.dumps([cell.to_dict() for cell in cells]))
        command = [sys.executable, "-m", "harness.entry", "harness.predict.traced",
                   "--cells", str(cells_path), "--out", str(out_path), "--kernels", kernels,
                   *(["--work-only"] if work_only else [])]
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        assert process.stderr is not None  # PIPE
        stalled = threading.Event()

        def stall() -> None:
            stalled.set()
            process.kill()

        watchdog = _Watchdog(timeout_s, stall)
        last = ""
        for line in process.stderr:  # until the subprocess exits (or is killed)
            if line.startswith(_TRACED_PREFIX):
                done[slot] += 1
                watchdog.reset()
            elif line.strip():
                last = line.strip()
        returncode = process.wait()
        watchdog.cancel()
        failure = (f"trace subprocess traced no cell for {timeout_s:g} s (its timeout)" if stalled.is_set()
                   else None if returncode == 0
                   else f"trace subprocess exited with status {returncode}: {last[:_REASON_CHARS] or '(no output)'}")
        if out_path.exists():
            results = json.loads(out_path.read_text())
    missing = [cell for cell in cells if cell.cell_id not in results]
    for k, cell in enumerate(missing):
        if failure is None:
            results[cell.cell_id] = {"unavailable": "trace subprocess gave no result for this cell"}
        else:
            where = "while tracing this cell" if k == 0 else "before this cell was traced"
            results[cell.cell_id] = {"unavailable": f"{failure} ({where})"}
    return results


class _Watchdog:
    """Calls ``expire`` once ``timeout_s`` pass without a ``reset``."""

    def __init__(self, timeout_s: float, expire: Callable[[], object]) -> None:
        self._timeout_s, self._expire = timeout_s, expire
        self._timer = self._started()

    def _started(self) -> threading.Timer:
        timer = threading.Timer(self._timeout_s, self._expire)
        timer.daemon = True
        timer.start()
        return timer

    def reset(self) -> None:
        self._timer.cancel()
        self._timer = self._started()

    def cancel(self) -> None:
        self._timer.cancel()


def _write_atomic(path: Path, data: dict) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def _import_engines(cells: list[CellSpec]) -> None:
    """Import the trackers and the engines the cells will need before the first trace, so
    that they are frozen with the rest (main) and no trace's collections scan them."""
    import importlib

    from harness.features import optimizers

    for name in ("torch.testing._internal.distributed.fake_pg", "torch.distributed._tools.mem_tracker",
                 "torch.distributed._tools.fsdp2_mem_tracker"):
        importlib.import_module(name)

    for cell in cells:
        try:
            if _refusal(cell) is None:
                engine = strategies.get(cell.strategy.name).engine
                if engine == "deepspeed":  # its accelerator the traced step's device, not a visible GPU
                    deepspeed_zero.import_deepspeed(torch.device("cpu"))
                elif engine == "fairscale":
                    importlib.import_module(engine)
                if cell.strategy.optimizer in optimizers.BITSANDBYTES:
                    importlib.import_module("bitsandbytes")
        except Exception:  # the cell's own trace reports it
            pass


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Trace the memory of cells (harness.predict.traced).")
    parser.add_argument("--cells", type=Path, required=True, help="JSON list of CellSpec.to_dict()")
    parser.add_argument("--out", type=Path, required=True, help="JSON object cell_id -> trace result")
    parser.add_argument("--kernels", choices=KERNELS, default="cpu", help="whose attention and optimizer kernels")
    parser.add_argument("--work-only", action="store_true", help="rank 0's dispatched work alone, no peak")
    args = parser.parse_args(argv)
    specs = json.loads(args.cells.read_text())
    cells: list[CellSpec | None] = []
    results: dict[str, dict] = {}
    # What reading the cells and their engines imports is frozen with the rest (harness/entry.py):
    # the collection memory.track_step_memory makes after each step then scans only what the
    # traces made (0.15 s a cell otherwise, for torch's and transformers' objects).
    with entry.collector_paused():
        for i, spec in enumerate(specs):
            try:
                cells.append(CellSpec.from_dict(spec))
            except Exception as error:  # a bad spec is a result; the list goes on
                cells.append(None)
                results[f"cells[{i}]"] = {"unavailable": f"not a cell: {_condensed(error)}"}
        _import_engines([cell for cell in cells if cell is not None])
    for cell in cells:
        if cell is None:
            continue
        start = time.perf_counter()
        try:
            results[cell.cell_id] = trace(cell, stand_in=False, kernels=args.kernels, work_only=args.work_only)
        except Exception as error:
            results[cell.cell_id] = {"unavailable": f"tracing failed: {_condensed(error)}"}
        print(f"{_TRACED_PREFIX}{cell.cell_id} in {time.perf_counter() - start:.2f} s", file=sys.stderr, flush=True)
        # Written after every cell: a crash later leaves the finished cells' results.
        _write_atomic(args.out, results)
    _write_atomic(args.out, results)


if __name__ == "__main__":
    main()
