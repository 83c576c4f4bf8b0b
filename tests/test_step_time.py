"""The step-time predictor: what a traced step dispatches (harness/measure/dispatched_work.py),
how it is priced (harness/predict/step_time.py), and its ratio beside the measurement."""

import math
import time

import pytest
import torch

from harness import calibration, models
from harness.config import CellSpec, StrategySpec
from harness.measure import compute_rate, dispatched_work
from harness.measure.comm import busbw_factor
from harness.predict import accuracy, analytic, step_time, traced

MS = 1e-3


def _calibration(op_s=10e-6, flops=100e9, memory=((1e3, 100e9), (1e8, 10e9)), latency=1 * MS,
                 bandwidth=1e9, world_size=2) -> dict:
    """A run's environment.bandwidth with round rates: every collective at ``latency`` up
    to 1 KiB and at ``bandwidth`` bytes/s from 1 MiB."""
    rows = [{"op": op, "bytes": size, "time_s": t}
            for op in ("all_reduce", "all_gather", "reduce_scatter")
            for size, t in ((2**10, latency), (2**20, 2**20 / bandwidth))]
    rates = {"matmul_flops_per_s": {"fp32": flops, "bf16": 4 * flops, "fp16": flops},
             "memory_bytes_per_s": [list(p) for p in memory], "op_s": dict.fromkeys(("fp32", "bf16", "fp16"), op_s)}
    alone = {**rates, "op_s": dict.fromkeys(("fp32", "bf16", "fp16"), op_s / 2)}
    return {"world_size": world_size, "rows": rows,
            "compute_rates": {"concurrent": rates, "alone": alone, "world_size": world_size}}


def _cell(name="ddp", world_size=2, **strategy) -> CellSpec:
    return CellSpec(model="gpt2-tiny", strategy=StrategySpec(name=name, **strategy), world_size=world_size)


def _work(ops=1000, flops=1e9, memory=((1e8, 1e8),), collectives=None) -> dict:
    return {"ops": ops, "matmul_flops": flops, "memory_bytes": [list(m) for m in memory],
            "collectives": collectives or {}}


def test_a_step_is_its_ops_flops_bytes_and_collectives_at_the_measured_rates():
    cell = _cell()
    work = _work(collectives={"all_reduce": [[2**20, 2], [512, 3]]})
    p = step_time.predict(cell, analytic.predict(cell, device_type="cpu"), {"work": work}, _calibration(), "cpu")
    compute = 1000 * 10e-6 + 1e9 / 100e9 + 1e8 / 10e9
    comm = 2 * 2**20 / 1e9 + 3 * 1 * MS  # below the smallest size: its latency
    assert p["compute_s"] == pytest.approx(compute)
    assert p["comm_s"] == pytest.approx(comm) == p["exposed_comm_s"]  # gloo on the CPU: no overlap
    assert p["step_time_s"] == pytest.approx(compute + comm)
    assert (p["work"], p["rates"], p["bubble"]) == ("traced", "concurrent", 1.0)


def test_matmuls_are_priced_by_size_and_bytes_at_the_memory_factor():
    cell, work = _cell(), {**_work(), "matmul_flops_by_size": [[2**20, 1e8], [2**30, 9e8]]}
    calibration = _calibration()
    rates = calibration["compute_rates"]["concurrent"]
    rates["memory_factor"] = [[1e3, 3.0], [1e9, 1.0]]  # 3 at the work's 1e8-byte ops, in log size
    rates["matmul_flops_per_s_by_size"] = {"fp32": [[2**20, 10e9], [2**30, 100e9]]}
    p = step_time.predict(cell, analytic.predict(cell, device_type="cpu"), {"work": work}, calibration, "cpu")
    factor = 3.0 ** (1 / 6)  # log-log between (1e3, 3) and (1e9, 1): 1e8 is five sixths of the way
    assert p["compute_s"] == pytest.approx(1000 * 10e-6 + 1e8 / 10e9 + 9e8 / 100e9 + factor * 1e8 / 10e9)


def test_attention_is_priced_by_direction_and_flops_per_head():
    cell = _cell()
    work = {**_work(flops=3e8), "attention_flops_by_size": {"forward": [[2**16, 1e8]], "backward": [[2**18, 2e8]]}}
    calibration = _calibration()
    rates = calibration["compute_rates"]["concurrent"]
    p = step_time.predict(cell, analytic.predict(cell, device_type="cpu"), {"work": work}, calibration, "cpu")
    # Rates from before attention was timed: at the matmul rate.
    assert p["compute_s"] == pytest.approx(1000 * 10e-6 + 3e8 / 100e9 + 1e8 / 10e9)
    rates["attention_flops_per_s_by_size"] = {"fp32": {"forward": [[2**16, 20e9], [2**20, 80e9]],
                                                       "backward": [[2**16, 2e9], [2**20, 8e9]]}}
    p = step_time.predict(cell, analytic.predict(cell, device_type="cpu"), {"work": work}, calibration, "cpu")
    backward_rate = math.sqrt(2e9 * 8e9)  # 2**18 is halfway between 2**16 and 2**20 in log size
    assert p["compute_s"] == pytest.approx(1000 * 10e-6 + 1e8 / 20e9 + 2e8 / backward_rate + 1e8 / 10e9)


def test_the_cpus_flash_attention_is_counted_as_attention_by_sdpas_formulas():
    """torch's FLOP registry lacks the CPU's flash attention kernels: counted by its SDPA
    formulas (forward 4·s²·d a head, backward 10·s²·d), per (sample, head), apart from matmuls."""
    q, k, v = (torch.randn(2, 4, 32, 16, requires_grad=True) for _ in range(3))
    with dispatched_work.Counting() as counter:
        torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
    work = counter.work.to_dict()
    heads, per_head = 2 * 4, 32 * 32 * 16
    assert work["attention_flops_by_size"] == {"forward": [[4 * per_head, heads * 4 * per_head]],
                                               "backward": [[16 * per_head, heads * 10 * per_head]]}
    assert work["matmul_flops"] == heads * 14 * per_head and work["matmul_flops_by_size"] == []


def test_views_and_allocations_move_no_bytes_but_count_as_ops():
    """A batched matmul's output reshape (``_unsafe_view``) and an uninitialised allocation
    dispatch, but read and write nothing."""
    a, b = torch.randn(2, 8, 16), torch.randn(16, 4)
    with dispatched_work.Counting() as counter:
        torch.empty(1000)
        a.transpose(0, 1)
        a @ b  # a view to 2-D, an mm, then _unsafe_view back to 3-D
    work = counter.work.to_dict()
    assert work["memory_bytes"] == [] and work["matmul_flops"] == 2 * 16 * 16 * 4
    assert work["ops"] == 5


def test_a_topk_selection_is_counted_by_its_elements_and_priced_at_its_own_rate():
    """Gradient sparsification's top-k: a partial sort, no elementwise op's bytes."""
    gradient = torch.randn(5000)
    with dispatched_work.Counting() as counter:
        gradient.abs().topk(50, sorted=False)
    work = counter.work.to_dict()
    assert work["topk_elements_by_size"] == [[8192, 5000]] and work["ops"] == 2
    assert sum(nbytes for _, nbytes in work["memory_bytes"]) == 2 * 4 * 5000  # abs's alone
    rates = {"topk_elements_per_s_by_size": [[2**12, 1e9], [2**16, 1e8]]}
    # 2**13 is a quarter of the way from 2**12 to 2**16 in log size.
    assert compute_rate.topk_seconds(work, rates) == pytest.approx(5000 / (1e9 * 0.1**0.25))


def test_a_library_optimizer_update_is_counted_by_calls_and_elements_and_priced_at_its_measured_costs():
    """bitsandbytes' update ops: one call per parameter tensor, 8-bit above min_8bit_size
    (4,096 elements) and 32-bit below it; each call's bytes as any op's, and its calls and
    elements priced at what the calibration measured beyond them."""
    from harness.features import optimizers

    params = [torch.nn.Parameter(torch.ones(n)) for n in (2**16, 2**16, 1000)]
    for param in params:
        param.grad = torch.full_like(param, 1e-3)
    optimizer = optimizers.make(params, "adam8bit", lr=1e-3)
    optimizer.step()
    with dispatched_work.Counting() as counter:
        optimizer.step()
    work = counter.work.to_dict()
    assert work["optimizer_ops"] == {"optimizer_update_8bit_blockwise/adam": [2, 2**17],
                                     "optimizer_update_32bit/adam": [1, 1000]}
    assert sum(nbytes for _, nbytes in work["memory_bytes"]) > 2**17 * (4 + 4 + 1 + 1)  # its operands: g, p, 2 states
    costs = {"optimizer_update_8bit_blockwise/adam": {"call_s": 1e-4, "element_s": 2e-8}}
    assert compute_rate.optimizer_op_seconds(work, {"optimizer_op_s": costs}) == pytest.approx(2e-4 + 2**17 * 2e-8)
    assert compute_rate.optimizer_op_seconds(work, {}) == 0  # unmeasured: its bytes alone price it
    # The calibration's line through (elements, seconds beyond the priced): a call's and an element's.
    fitted = compute_rate._per_call_and_element([(2**11, 1e-4 + 2**11 * 2e-8), (2**17, 1e-4 + 2**17 * 2e-8)])
    assert fitted == pytest.approx({"call_s": 1e-4, "element_s": 2e-8})
    assert compute_rate._per_call_and_element([(2**11, 3e-4), (2**17, 1e-4)]) == {"call_s": pytest.approx(2e-4),
                                                                                 "element_s": 0.0}


def test_a_library_optimizer_that_cannot_be_timed_is_recorded_with_why(monkeypatch, one_rank_env):
    """No bitsandbytes (the GPU image's torch alone): the calibration says so per optimizer
    and prices their ops by their bytes; every rank agrees on it before any timing."""
    from harness.features import optimizers

    def make(params, name, lr):
        raise ImportError("No module named 'bitsandbytes'")

    monkeypatch.setattr(optimizers, "make", make)
    costs, unavailable = compute_rate._optimizer_op_costs({}, torch.device("cpu"), env=None, alone=True)
    assert costs == {}
    assert unavailable == dict.fromkeys(sorted(optimizers.BITSANDBYTES - {"paged_adamw8bit"}),
                                        "ImportError: No module named 'bitsandbytes'")


def test_memory_factor_times_in_place_only_the_ops_that_move_bytes():
    """compute_rate's in-place timing of a step's elementwise ops: a matmul (priced by its
    FLOPs) and a view (moves nothing) are counted as ops but not timed as bytes; an add is
    both, and a large add timed so reads what the add takes outside the timing."""
    a, big = torch.ones(64, 64), torch.ones(2**20)
    with compute_rate._ElementwiseTiming(torch.device("cpu")) as timing:
        torch.mm(a, a)
        a.view(-1)
        torch.add(a, a)
    assert (timing.work.ops, timing.calls) == (3, 1) and timing.seconds() > 0
    assert timing.work.memory_bytes == {2**16: 3 * 64 * 64 * 4}  # two inputs and the output
    out, cpu = torch.empty_like(big), torch.device("cpu")

    def per_add(timed: bool) -> float:
        if not timed:
            start = time.perf_counter()
            for _ in range(20):
                torch.add(big, big, out=out)
            return (time.perf_counter() - start) / 20
        with compute_rate._ElementwiseTiming(cpu) as timing:
            for _ in range(20):
                torch.add(big, big, out=out)
        return (timing.seconds() - timing.calls * compute_rate._timed_call_s(cpu)) / 20

    # 0.75-1.53 in five tries on this project's 2-core host: the bounds only catch a timing of
    # something else (the mode's own overhead, or nothing).
    assert 1 / 3 < min(per_add(True) for _ in range(3)) / min(per_add(False) for _ in range(3)) < 3


def test_sizes_between_measured_points_are_interpolated_log_log():
    # Halfway between 1 KiB and 1 MiB in log size: the geometric mean of the two times.
    seconds = step_time._call_seconds("all_gather", 2**15, 2, _calibration()["rows"], 2)
    assert seconds == pytest.approx(math.sqrt(1 * MS * 2**20 / 1e9))
    # Larger than the sweep: its largest size's bandwidth; another world size: the bus factor.
    assert step_time._call_seconds("all_reduce", 2**22, 2, _calibration()["rows"], 2) == pytest.approx(2**22 / 1e9)
    assert step_time._call_seconds("all_reduce", 2**22, 4, _calibration()["rows"], 2) == pytest.approx(
        2**22 / 1e9 * 1.5)
    rate = compute_rate.rate_at_size([[1e3, 100e9], [1e5, 1e9]], 1e4)
    assert rate == pytest.approx(10e9)


def test_each_collective_is_priced_by_its_own_rows_and_p2p_by_the_intra_node_send_recv():
    rows = _calibration()["rows"]
    rows += [{"op": "broadcast", "bytes": 2**20, "time_s": 3 * MS},
             {"op": "send_recv", "scope": "intra_node", "bytes": 2**20, "time_s": 5 * MS},
             {"op": "send_recv", "scope": "inter_node", "bytes": 2**20, "time_s": 50 * MS}]
    assert step_time._call_seconds("broadcast", 2**20, 2, rows, 2) == pytest.approx(3 * MS)
    assert step_time._call_seconds("send", 2**20, 2, rows, 2) == pytest.approx(5 * MS)
    assert step_time._call_seconds("recv", 2**20, 2, rows, 2) == pytest.approx(5 * MS)
    # Not swept (gather; all-to-all in a sweep from before it was added): as an all-gather.
    assert step_time._call_seconds("gather", 2**20, 2, rows, 2) == pytest.approx(2**20 / 1e9)
    assert step_time._call_seconds("all_to_all", 2**20, 2, rows, 2) == pytest.approx(2**20 / 1e9)


def test_local_sgd_pays_its_averaging_once_a_period():
    averaging = {"work": _work(collectives={"all_reduce": [[2**20, 1]]})}
    ddp, local_sgd = _cell(), _cell(local_sgd_period=4)
    plain = step_time.predict(ddp, analytic.predict(ddp, device_type="cpu"), averaging, _calibration(), "cpu")
    every_4 = step_time.predict(local_sgd, analytic.predict(local_sgd, device_type="cpu"), averaging,
                                _calibration(), "cpu")
    assert every_4["comm_s"] == pytest.approx(plain["comm_s"] / 4) and every_4["compute_s"] == plain["compute_s"]


def test_convolutions_are_their_own_kernel_family_priced_per_call():
    images, weight = torch.randn(4, 8, 6, 6, requires_grad=True), torch.randn(8, 8, 3, 3, requires_grad=True)
    with dispatched_work.Counting() as counter:
        torch.nn.functional.conv2d(images, weight, padding=1).sum().backward()
    work = counter.work.to_dict()
    forward = 2 * 4 * 8 * 36 * 8 * 9  # 2 · images · out channels · positions · in channels · 3×3
    assert work["convolution_flops_by_size"] == {"forward": [[2**18, forward]], "backward": [[2**19, 2 * forward]]}
    assert work["matmul_flops_by_size"] == [] and work["matmul_flops"] == 3 * forward
    rates = {"convolution_flops_per_s_by_size": {"fp32": {"forward": [[1e3, 1e9]], "backward": [[1e3, 5e8]]}},
             "matmul_flops_per_s": {"fp32": 1e11}}
    assert compute_rate.kernel_seconds(work, rates, "fp32") == pytest.approx(forward / 1e9 + 2 * forward / 5e8)


def test_one_process_takes_the_rates_measured_alone_and_extra_ranks_share_the_cores():
    single = _cell("single", world_size=1)
    work = {"work": _work(ops=1000, flops=0, memory=())}
    alone = step_time.predict(single, analytic.predict(single, device_type="cpu"), work, _calibration(), "cpu")
    assert alone["rates"] == "alone" and alone["compute_s"] == pytest.approx(1000 * 5e-6)
    four = _cell(world_size=4)
    crowded = step_time.predict(four, analytic.predict(four, device_type="cpu"), work, _calibration(), "cpu")
    assert crowded["rank_share"] == 0.5 and crowded["compute_s"] == pytest.approx(1000 * 10e-6 * 2)


def test_a_pipeline_is_stretched_by_its_bubble():
    cell = CellSpec(model="gpt2-tiny", strategy=StrategySpec(name="pp_gpipe", pp_microbatches=4), world_size=2)
    p = step_time.predict(cell, analytic.predict(cell, device_type="cpu"), {"work": _work()}, _calibration(), "cpu")
    assert p["bubble"] == pytest.approx((4 + 2 - 1) / 4)
    assert p["step_time_s"] == pytest.approx(p["compute_s"] * 5 / 4 + p["exposed_comm_s"])


def test_an_interleaved_pipelines_bubble_is_divided_by_its_stages_a_rank():
    cell = CellSpec(model="llama-tiny", strategy=StrategySpec(name="pp_interleaved_1f1b", pp_microbatches=4),
                    world_size=2)
    p = step_time.predict(cell, analytic.predict(cell, device_type="cpu"), {"work": _work()}, _calibration(), "cpu")
    assert p["bubble"] == pytest.approx(1 + (2 - 1) / (2 * 4))


def test_a_pipelines_last_stage_is_priced_from_its_own_trace():
    # The last rank runs the LM head and the loss: here three times rank 0's work. GPipe, 2
    # ranks, 4 micro-batches, no hand-overs: rank 0's first forward, the last rank's whole
    # step, rank 0's last backward.
    cell = CellSpec(model="gpt2-tiny", strategy=StrategySpec(name="pp_gpipe", pp_microbatches=4), world_size=2)
    traced = {"work": _work(ops=1000, flops=0, memory=()), "last_rank_work": _work(ops=3000, flops=0, memory=())}
    p = step_time.predict(cell, analytic.predict(cell, device_type="cpu"), traced, _calibration(), "cpu")
    first, last = 1000 * 10e-6, 3000 * 10e-6
    assert p["compute_s"] == pytest.approx(last)
    assert p["step_time_s"] == pytest.approx(first / 4 + last)


def test_a_pipelines_middle_ranks_are_priced_from_a_middle_ranks_trace_by_their_blocks():
    # gpt2-124m's 12 blocks over 8 ranks: [1, 2, 2, 2, 2, 1, 1, 1]. The traced middle rank 5
    # holds one block at 3000 ops, so ranks 1-4, two blocks each, take 6000: the slowest,
    # where rank 0's work alone (1000 ops) would have priced every middle rank.
    cell = CellSpec(model="gpt2-124m", strategy=StrategySpec(name="pp_gpipe", pp_microbatches=8), world_size=8,
                    seq_len=64)
    first, middle, last = (_work(ops=ops, flops=0, memory=()) for ops in (1000, 3000, 2000))
    predicted = analytic.predict(cell, device_type="cpu")
    without = step_time.predict(cell, predicted, {"work": first, "last_rank_work": last}, _calibration(), "cpu")
    with_middle = step_time.predict(cell, predicted, {"work": first, "last_rank_work": last,
                                                      "middle_rank_work": {"rank": 5, "work": middle}},
                                    _calibration(), "cpu")
    share = 2 / 8  # the calibration's 2 ranks' rates shared by 8
    assert without["compute_s"] == pytest.approx(2000 * 10e-6 / share)
    assert with_middle["compute_s"] == pytest.approx(6000 * 10e-6 / share)


def test_a_pipelines_engine_overhead_makes_its_timeline_take_the_calibration_steps_time():
    # The calibration timed the pipeline's own step at 50 ms where its ops, priced plainly
    # and played out on the schedule, take 1000 × 10 µs × 5/4 and 3000 × 10 µs on the last
    # rank: the overhead per op is what closes the gap, so the calibration's own cell is
    # predicted at the step it took.
    cell = calibration.engine_step_cell("pp_gpipe", 2)
    work, last = _work(ops=1000, flops=0, memory=()), _work(ops=3000, flops=0, memory=())
    rates = _calibration()
    rates["compute_rates"]["engines"] = {"pp_gpipe": {"step_s": 0.05, "work": work, "last_rank_work": last}}
    overhead = step_time.engine_overhead_per_op("pp_gpipe", rates)
    assert overhead > 0
    p = step_time.predict(cell, analytic.predict(cell, device_type="cpu"), {"work": work, "last_rank_work": last},
                          rates, "cpu")
    assert p["engine_overhead_per_op_s"] == overhead
    assert p["step_time_s"] == pytest.approx(0.05, rel=1e-4)


def test_a_pipelines_hand_over_between_nodes_is_priced_at_the_sweep_across_them():
    # GPipe, 4 ranks on 2 nodes, one micro-batch: its hand-overs run 0-1-2-3 forward and back,
    # each on the critical path; the two across the nodes' boundary (1 <-> 2) at the slower
    # sweep across nodes, the four within a node at the node's own. The tied table's exchange
    # (rank 0 with rank 3, twice a hand-over's bytes) crosses the nodes whole.
    cell = CellSpec(model="llama-tiny", strategy=StrategySpec(name="pp_gpipe", pp_microbatches=1), world_size=4)
    hidden, within, between = 2**12, 0.1 * MS, 3 * MS
    calibration = _calibration(world_size=4)
    calibration["rows"] += [{"op": "send_recv", "scope": "intra_node", "bytes": hidden, "time_s": within}]
    across = {"world_size": 4, "rows": [{"op": "send_recv", "scope": scope, "bytes": hidden, "time_s": t}
                                        for scope, t in (("intra_node", within), ("inter_node", between))]}
    exchanged = [[hidden, 1], [2 * hidden, 1]]
    work = _work(ops=1000, flops=0, memory=(), collectives={"send": exchanged, "recv": exchanged})
    predicted = analytic.predict(cell, device_type="cpu")

    def exposed(nodes: int, swept_across: dict | None) -> float:
        rates = {**calibration, **({"across_nodes": swept_across} if swept_across else {})}
        return step_time.predict(cell, predicted, {"work": work}, rates, "cpu", nodes)["exposed_comm_s"]

    assert exposed(1, across) == pytest.approx(6 * within + 2 * 2 * within)
    assert exposed(2, across) == pytest.approx(4 * within + 2 * between + 2 * 2 * between)
    # A run that swept one node only: what crosses is priced as within it (plan says so).
    assert exposed(2, None) == pytest.approx(exposed(1, across))


@pytest.mark.parametrize("device_type", ["cpu", "cuda"])
def test_a_pipelines_hand_overs_are_exposed_only_on_its_critical_path(device_type):
    # GPipe on 2 ranks, 4 micro-batches: rank 0 sends 4 micro-batches' hidden states and
    # receives 4 gradients; with hops shorter than a forward only the first micro-batch's
    # two (one each way) delay the step. The tied embeddings' exchange is exposed whole.
    cell = CellSpec(model="gpt2-tiny", strategy=StrategySpec(name="pp_gpipe", pp_microbatches=4), world_size=2)
    calibration = _calibration()
    calibration["rows"] += [{"op": "send_recv", "scope": "intra_node", "bytes": size, "time_s": t}
                            for size, t in ((2**10, 0.1 * MS), (2**20, 2 * MS))]
    hidden, tied = 2**10, 2**20
    work = _work(ops=10_000, collectives={"send": [[hidden, 4], [tied, 1]], "recv": [[hidden, 4], [tied, 1]]})
    p = step_time.predict(cell, analytic.predict(cell, device_type=device_type), {"work": work}, calibration,
                          device_type)
    assert p["comm_s"] == pytest.approx(8 * 0.1 * MS + 2 * 2 * MS)
    assert p["exposed_comm_s"] == pytest.approx(2 * 0.1 * MS + 2 * 2 * MS)
    assert p["step_time_s"] == pytest.approx(p["compute_s"] * p["bubble"] + p["exposed_comm_s"])


def test_on_cuda_gradient_reductions_hide_behind_backward():
    cell = _cell()
    a = analytic.predict(cell)
    small = {"work": _work(collectives={"all_reduce": [[2**20, 1]]})}
    p = step_time.predict(cell, a, small, _calibration(), "cuda")
    assert p["comm_s"] < p["compute_s"] * 2 / 3 and p["exposed_comm_s"] == 0.0
    large = {"work": _work(collectives={"all_reduce": [[2**30, 1]]})}
    q = step_time.predict(cell, a, large, _calibration(), "cuda")
    assert q["exposed_comm_s"] == pytest.approx(q["comm_s"] - q["compute_s"] * 2 / 3)


def test_on_cuda_accumulation_leaves_only_the_last_micro_steps_backward_to_hide_the_reduction():
    # DDP skips the sync on all but the last micro-step; DeepSpeed ZeRO-2 reduces every one,
    # beside backward with overlap_comm, on the compute stream without (its default).
    work = {"work": _work(collectives={"all_reduce": [[2**30, 1]]})}
    for options, window in (({"name": "ddp"}, 1 / 4), ({"name": "deepspeed_zero2", "overlap_comm": True}, 1.0),
                            ({"name": "deepspeed_zero2"}, 0.0)):
        cell = _cell(accumulation=4, **options)
        p = step_time.predict(cell, analytic.predict(cell), work, _calibration(), "cuda")
        assert p["exposed_comm_s"] == pytest.approx(p["comm_s"] - p["compute_s"] * 2 / 3 * window), options


def test_on_cuda_a_sharded_engine_hides_all_but_its_first_gather_behind_compute():
    gathers = {"all_gather": [[2**10, 1], [2**20, 10]], "reduce_scatter": [[2**20, 10]]}
    for name in ("fsdp_full", "fsdp_grad_op", "deepspeed_zero3"):
        cell = _cell(name)
        p = step_time.predict(cell, analytic.predict(cell), {"work": _work(collectives=gathers)}, _calibration(),
                              "cuda")
        assert p["comm_s"] < p["compute_s"] and p["exposed_comm_s"] == pytest.approx(1 * MS), name


def test_a_job_over_several_nodes_prices_what_crosses_them_at_the_sweep_across_nodes():
    """8 ranks on 2 nodes, the network ten times slower than a node's links: a flat collective
    crosses; HSDP's gathers and reduce-scatters stay in their node of 4, its all-reduce over the
    2 replicas crosses with every local rank's bytes at once."""
    within = _calibration(bandwidth=10e9, world_size=8)
    job = {**within, "across_nodes": {"world_size": 8, "rows": _calibration(bandwidth=1e9, world_size=8)["rows"]}}
    collectives = {"all_gather": [[2**24, 1]], "reduce_scatter": [[2**24, 1]], "all_reduce": [[2**22, 1]]}
    work = {"work": _work(collectives=collectives)}
    flat, hsdp = _cell("fsdp_full", world_size=8), _cell("fsdp_hybrid", world_size=8)

    def comm(cell, calibration, nodes):
        return step_time.predict(cell, analytic.predict(cell), work, calibration, "cuda", nodes)["comm_s_by_op"]

    one_node = comm(flat, within, 1)
    flat_across = comm(flat, job, 2)
    assert all(flat_across[kind] == pytest.approx(10 * one_node[kind]) for kind in collectives)
    assert comm(flat, within, 2) == pytest.approx(one_node)  # no sweep across nodes: the node's stands in
    hsdp_across = comm(hsdp, job, 2)
    # Within a node of 4: the sweep's own world size, its own rows.
    assert hsdp_across["all_gather"] == pytest.approx(comm(_cell("fsdp_full", world_size=4), within, 1)["all_gather"])
    # Across: 4 local ranks' 4 MiB at once, at 1 GB/s, over 2 replicas (the sweep's 8 rescaled).
    assert hsdp_across["all_reduce"] == pytest.approx(
        4 * 2**22 / 1e9 * busbw_factor("all_reduce", 2) / busbw_factor("all_reduce", 8))


def test_tp_fsdp_prices_each_collective_in_its_own_group():
    """8 ranks, tensor parallel in groups of 2, FSDP2 over the 4 groups: the all-reduce is the
    tensor-parallel group's (bus factor 1, not the world's 1.75), the gathers and
    reduce-scatters the data-parallel group's. On 2 nodes of 4 the tensor-parallel groups stay
    in a node; each data-parallel group crosses, the 2 of a node at once. On CUDA the
    tensor-parallel all-reduces wait between a block's matmuls: exposed whole, while FSDP's
    gathers hide behind compute as fsdp_full's do."""
    within = _calibration(bandwidth=10e9, world_size=8)
    job = {**within, "across_nodes": {"world_size": 8, "rows": _calibration(bandwidth=1e9, world_size=8)["rows"]}}
    collectives = {"all_gather": [[2**24, 1]], "reduce_scatter": [[2**24, 1]], "all_reduce": [[2**22, 1]]}
    cell = _cell("tp_fsdp", world_size=8, tp_degree=2)
    assert [step_time.call_group(cell, kind) for kind in ("all_reduce", "all_gather")] == [(2, 1), (4, 2)]

    def comm(calibration, nodes):
        return step_time.predict(cell, analytic.predict(cell), {"work": _work(collectives=collectives)}, calibration,
                                 "cuda", nodes)["comm_s_by_op"]

    def at(kind, nbytes, ranks, bandwidth):  # the sweep's 8 ranks rescaled to the group's
        return nbytes / bandwidth * busbw_factor(kind, ranks) / busbw_factor(kind, 8)

    one_node, two_nodes = comm(within, 1), comm(job, 2)
    assert one_node["all_reduce"] == pytest.approx(at("all_reduce", 2**22, 2, 10e9))
    assert one_node["all_gather"] == pytest.approx(at("all_gather", 2**24, 4, 10e9))
    assert two_nodes["all_reduce"] == one_node["all_reduce"]
    assert two_nodes["all_gather"] == pytest.approx(at("all_gather", 2 * 2**24, 4, 1e9))
    gathers = {"all_gather": [[2**10, 1], [2**20, 10]], "reduce_scatter": [[2**20, 10]], "all_reduce": [[2**20, 8]]}
    p = step_time.predict(cell, analytic.predict(cell), {"work": _work(collectives=gathers)}, within, "cuda")
    first_gather = 1 * MS * busbw_factor("all_gather", 4) / busbw_factor("all_gather", 8)  # its latency
    assert p["exposed_comm_s"] == pytest.approx(p["comm_s_by_op"]["all_reduce"] + first_gather)


def test_an_untraced_cell_is_priced_from_the_analytic_work_and_says_so():
    cell = _cell(checkpointing="full")
    a = analytic.predict(cell, device_type="cpu")
    p = step_time.predict(cell, a, {"unavailable": "not traced: --no-trace"}, _calibration(), "cpu")
    assert p["work"] == "analytic (not traced: --no-trace)"
    work = step_time.analytic_work(cell, a, "cpu")
    # One forward more under full checkpointing; no op count.
    assert work["matmul_flops"] == pytest.approx(models.flops_per_sample(cell.model_spec) * cell.micro_batch * 4 / 3)
    assert work["ops"] == 0 and work["collectives"] == {"all_reduce": [[a["comm_bytes_by_op"]["all_reduce"], 1]]}


@pytest.mark.parametrize("name, device_type, sharded", [("ddp", "cpu", False), ("fsdp_full", "cpu", True),
                                                         ("deepspeed_zero2", "cuda", True)])
def test_the_analytic_optimizer_step_is_its_counted_bytes_over_the_ranks_elements(name, device_type, sharded):
    """Where the step is not traced, the optimizer's traffic is its own step's, counted on one
    tensor with the implementation torch picks on the device, over the elements the rank steps."""
    cell = _cell(name)
    a = analytic.predict(cell, device_type=device_type)
    per_element = dispatched_work.optimizer_step_work("adamw", device_type)["bytes_per_element"]
    # torch's AdamW: a per-tensor loop on the CPU (84 B an element), foreach on CUDA (56).
    assert per_element == pytest.approx({"cpu": 84, "cuda": 56}[device_type], rel=1e-3)
    numel = models.param_layout(cell.model_spec).numel
    optimizer_traffic = per_element * numel / (cell.world_size if sharded else 1)
    work = step_time.analytic_work(cell, a, device_type)
    assert any(nbytes == pytest.approx(optimizer_traffic) for _, nbytes in work["memory_bytes"])


def test_an_offloaded_optimizer_steps_on_the_host_not_in_the_devices_traffic():
    cell = _cell("deepspeed_zero2", offload="optimizer")
    work = step_time.analytic_work(cell, analytic.predict(cell, device_type="cuda"), "cuda")
    assert len(work["memory_bytes"]) == 1  # the activations' alone (_offload_seconds prices the host's step)



def test_a_stand_in_prices_its_work_with_the_cells_own_collectives_where_it_has_none():
    """AutoEP's stand-in (DeepSpeed ZeRO-1) all-reduces and all-gathers but has no
    all-to-all: the cell's analytic all-to-all bytes are added, as one call."""
    cell = CellSpec(model="moe-tiny", strategy=StrategySpec(name="deepspeed_autoep"), world_size=2)
    a = analytic.predict(cell, device_type="cpu")
    stand_in = _work(collectives={"all_reduce": [[2**20, 1]], "all_gather": [[512, 2]]})
    result = {"unavailable": "AutoEP: the routing's counts", "stand_in": {"cell_id": "moe-tiny/deepspeed_zero1/x",
                                                                          "work": stand_in}}
    calibration = _calibration()
    p = step_time.predict(cell, a, result, calibration, "cpu")
    assert p["work"] == "traced stand-in moe-tiny/deepspeed_zero1/x (AutoEP: the routing's counts)"
    one_call = step_time._call_seconds("all_to_all", a["comm_bytes_by_op"]["all_to_all"], 2, calibration["rows"], 2)
    assert one_call > 0 and p["comm_s_by_op"]["all_to_all"] == pytest.approx(one_call)
    assert p["comm_s_by_op"]["all_reduce"] == pytest.approx(2**20 / 1e9)  # the stand-in's, not the analytic bytes
    assert p["compute_s"] == pytest.approx(1000 * 10e-6 + 1e9 / 100e9 + 1e8 / 10e9)

def test_without_measured_rates_there_is_no_step_time_and_the_reason():
    cell = _cell()
    a = analytic.predict(cell, device_type="cpu")
    assert step_time.predict(cell, a, {"work": _work()}, {"skipped": "--no-bandwidth"}, "cpu") == {
        "unavailable": "no measured rates to price the step at: --no-bandwidth"}
    predicted = accuracy.prediction(cell, None, "cpu", None)
    assert predicted["step_time_s"] is None and "unavailable" in predicted["step_time"]


def test_the_step_time_ratio_and_its_run_targets():
    cell = _cell()
    predicted = accuracy.prediction(cell, {"work": _work()}, "cpu", _calibration())
    metrics = {"step_time_s": predicted["step_time_s"] * 1.6, "comm_time_s_per_step": 0.001,
               "comm_by_op": {}, "comm_bytes_per_step": 0, "peak_mem_bytes": 1, "mem_breakdown_bytes": {}}
    ratio = accuracy.compare(predicted, metrics, cell)["step_time"]
    assert ratio["ratio"] == pytest.approx(1 / 1.6) and ratio["within_target"]  # within ±50 %
    slow = accuracy.compare(predicted, {**metrics, "step_time_s": predicted["step_time_s"] * 3}, cell)["step_time"]
    assert not slow["within_target"] and "measured" in slow["off"]
    record = {"cell_id": cell.cell_id, "status": "ok", "trial": 0,
              "predicted": {**predicted, "ratios": {"step_time": ratio}}}
    text, met = accuracy.report([record])
    # One cell at 0.625: within ±50 %, but the median is not within ±20 %.
    assert "step_time: 1 of 1 cells within ±50%" in text and "median ratio 0.625" in text and not met


def test_the_trace_counts_what_the_step_dispatches():
    single = CellSpec(model="gpt2-tiny", strategy=StrategySpec(name="single"), micro_batch=4, world_size=1)
    ddp, ckpt = _cell(), _cell(checkpointing="full")
    works = {c.cell_id: traced.trace(c)["work"] for c in (single, ddp, ckpt)}
    one = works[single.cell_id]
    # torch's FLOP formulas count every matmul of forward and backward: the PaLM formula's
    # figure but for the gradient of the first layer's input, which nothing needs.
    palm = models.flops_per_sample(single.model_spec) * 4
    assert 0.85 * palm < one["matmul_flops"] < palm
    assert one["collectives"] == {} and one["ops"] > 300
    # DDP all-reduces every gradient once (analytic bytes), in one bucket at this size.
    a = analytic.predict(ddp, device_type="cpu")
    assert works[ddp.cell_id]["collectives"] == {"all_reduce": [[a["comm_bytes_by_op"]["all_reduce"], 1]]}
    # Full checkpointing runs each block's forward again.
    assert works[ckpt.cell_id]["matmul_flops"] > works[ddp.cell_id]["matmul_flops"] * 1.1
    assert works[ckpt.cell_id]["ops"] > works[ddp.cell_id]["ops"]


def test_a_distributed_cell_without_a_sweep_says_why():
    """One rank per node measures compute rates but times no collective (harness/calibration.py)."""
    calibration = {**_calibration(), "rows": [], "no_sweep": "a bandwidth sweep needs at least 2 ranks"}
    cell = _cell()
    p = step_time.predict(cell, analytic.predict(cell, device_type="cpu"),
                          {"work": _work(collectives={"all_reduce": [[2**20, 1]]})}, calibration, "cpu")
    assert p == {"unavailable": "no collective timings to price its communication at:"
                                " a bandwidth sweep needs at least 2 ranks"}
