"""Collective bandwidth of the run's own process group, swept over message sizes the way
nccl-tests measures it, once per run (its own short torchrun launch before the cells,
harness/runner/launcher.py ``run_bandwidth_sweep``); stored with the run's environment.

For each collective and size: ``WARMUP_ITERS`` untimed calls, then ``REPEATS`` spans of
``ITERS`` calls back to back between two device synchronisations (nccl-tests' -w 5 -n 20,
as three spans of 7: as many calls); the time of one call is the median span ÷ ITERS, and the slowest
rank's time is the one reported (the job waits for it). The median, not one span: on a host
whose cores the ranks share, one span that the scheduler stalled read 2.5-3.3 ms a call for
send/recv of 1-16 KiB in one run's sweep, 0.17 ms in the run before, and every small
collective of a step is priced by these rows.
The size S is nccl-tests' too: the all-reduce and broadcast buffer; all-gather's whole output
(each rank sends S/n); reduce-scatter's whole input (each rank keeps S/n); all-to-all's whole
input (each rank sends S/n to every rank); send/recv's buffer, which every rank sends to one
peer while it receives as much from another (nccl-tests' sendrecv). algbw = S / t and
busbw = algbw × factor (2(n−1)/n for all-reduce, (n−1)/n for all-gather, reduce-scatter and
all-to-all, 1 for broadcast and send/recv: comm.busbw_factor), the number to hold against the
link's bandwidth.

Point-to-point rows say which links they crossed (``scope``): ``intra_node``, each rank
sending to the next rank of its node and receiving from the previous one; ``inter_node``,
each rank sending to the rank in its place on the next node, so every pair crosses the
network. A sweep over one node has intra-node rows only.

On gloo the ranks share the host's memory bus and cores: the numbers describe that
process group, not a network.

The run's calibration launch (harness/calibration.py) runs the sweep, then measures the
ranks' compute rates and its engines' steps: one launch calibrates the step-time predictor.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from harness.distributed import DistEnv
from harness.measure.comm import busbw_factor

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all", "send_recv")
WARMUP_ITERS = 5
ITERS, REPEATS = 7, 3
# 1 KiB .. 64 MiB on CUDA (×4 steps); 1 KiB .. 16 MiB on CPU, where gloo at 64 MiB takes
# seconds per call and the sweep would cost more than the cells it describes.
CUDA_SIZES = tuple(2**k for k in range(10, 27, 2))
CPU_SIZES = tuple(2**k for k in range(10, 25, 2))
ELEMENT = torch.float32


def message_sizes(device_type: str) -> tuple[int, ...]:
    return CUDA_SIZES if device_type == "cuda" else CPU_SIZES


def p2p_peers(env: DistEnv) -> dict[str, tuple[int, int]]:
    """For each scope the sweep can measure on this job, (the rank this one sends to, the
    rank it receives from): within a node, the next and previous of its node's ranks (torchrun
    numbers a node's ranks contiguously); across nodes, the same place on the next and the
    previous node. A scope with nobody to pair with is left out."""
    per_node = env.world_size // env.nnodes
    node_start, local = divmod(env.rank, per_node)
    node_start *= per_node
    peers = {}
    if per_node > 1:
        peers["intra_node"] = (node_start + (local + 1) % per_node, node_start + (local - 1) % per_node)
    if env.nnodes > 1:
        peers["inter_node"] = ((env.rank + per_node) % env.world_size, (env.rank - per_node) % env.world_size)
    return peers


def _send_recv(sent: torch.Tensor, received: torch.Tensor, peers: tuple[int, int]) -> None:
    send_to, receive_from = peers
    for request in dist.batch_isend_irecv([dist.P2POp(dist.isend, sent, send_to),
                                           dist.P2POp(dist.irecv, received, receive_from)]):
        request.wait()


def _collective(op: str, nbytes: int, world_size: int, device: torch.device,
                peers: tuple[int, int] | None = None) -> tuple[Callable[[], None], int]:
    """A call of ``op`` on buffers of nccl-tests' size ``nbytes`` (rounded down so every
    rank's part holds whole elements), and the size actually used. ``peers``: send/recv's
    (to, from)."""
    per_rank = max(1, nbytes // (ELEMENT.itemsize * world_size))
    whole = torch.ones(per_rank * world_size, dtype=ELEMENT, device=device)
    part = torch.ones(per_rank, dtype=ELEMENT, device=device)
    size = whole.numel() * ELEMENT.itemsize
    if op == "all_reduce":
        return (lambda: dist.all_reduce(whole)), size
    if op == "all_gather":
        return (lambda: dist.all_gather_into_tensor(whole, part)), size
    if op == "reduce_scatter":
        return (lambda: dist.reduce_scatter_tensor(part, whole)), size
    if op == "broadcast":
        return (lambda: dist.broadcast(whole, src=0)), size
    if op == "all_to_all":
        received = torch.empty_like(whole)
        return (lambda: dist.all_to_all_single(received, whole)), size
    if op == "send_recv":
        if peers is None:
            raise ValueError("send_recv needs its peers (p2p_peers)")
        received = torch.empty_like(whole)
        return (lambda: _send_recv(whole, received, peers)), size
    raise ValueError(f"op={op!r}: choose one of {', '.join(OPS)}")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_per_call(call: Callable[[], None], env: DistEnv) -> float:
    """Seconds per call on the slowest rank, after the warm-up (module docstring)."""
    for _ in range(WARMUP_ITERS):
        call()
    spans = []
    for _ in range(REPEATS):
        _sync(env.device)
        dist.barrier()
        start = time.perf_counter()
        for _ in range(ITERS):
            call()
        _sync(env.device)
        spans.append((time.perf_counter() - start) / ITERS)
    elapsed = torch.tensor([statistics.median(spans)], dtype=torch.float64, device=env.device)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed.item())


def sweep(env: DistEnv, sizes: tuple[int, ...]) -> list[dict[str, Any]]:
    """One row per (collective, size), and per scope for send/recv: bytes, time per call,
    algbw and busbw in GB/s."""
    rows = []
    for op in OPS:
        factor = busbw_factor(op, env.world_size)
        scopes: list[tuple[str | None, tuple[int, int] | None]] = (
            list(p2p_peers(env).items()) if op == "send_recv" else [(None, None)])
        for scope, peers in scopes:
            for nbytes in sizes:
                call, size = _collective(op, nbytes, env.world_size, env.device, peers)
                seconds = time_per_call(call, env)
                algbw = size / seconds / 1e9
                rows.append({"op": op, **({"scope": scope} if scope else {}), "bytes": size, "time_s": seconds,
                             "algbw_gbps": algbw, "busbw_gbps": algbw * factor})
    return rows
