"""A cell's analytic prediction, per rank: the papers' formulas (harness/predict/formulas/)
with what the cell's engine does on top of the paper (which tensors it keeps in which
precision, DDP's gradient bucket, how many times FSDP gathers the root unit, the order torch's
pipeline schedule runs its micro-batches in, the receive buffers its stages keep), in the
harness's own categories and byte conventions, so each number can be put beside the measured
one (README "Predicted beside measured": what is checked against measurement, and how close).

This module says which cells the model describes and assembles the record's
``predicted.analytic``; the parts come from analytic_data_parallel.py (the data-parallel and
sharded strategies) and analytic_parallel.py (those that split the model or the sequence).
"""

from __future__ import annotations

from harness import models, strategies
from harness.config import CellSpec
from harness.models import ModelSpec, hf_config, sources
from harness.predict.analytic_data_parallel import (
    PRECISION_BYTES,
    activation_bytes,
    comm_bytes_per_step,
    model_states_at_step,
    offloaded_bytes,
    optimizer_step_bytes,
    shard_degree,
    transient_bytes,
    vocabulary_slices,
)
from harness.predict.analytic_parallel import (
    model_parallel_parts,
    pipeline_stage_layers,
    tp_accumulated_numel,
    tp_sharded_numel,
)
from harness.predict.formulas import comm_volume
from harness.strategies import deepspeed_zero, pipeline  # ZeRO-1's gradient buffer; a pipeline's stages

# Families whose blocks the analytic model counts (attention, MLP or experts, norms); a
# transformers config's model is counted by its sizes and layout (harness/models/spec.py).
TRANSFORMER_FAMILIES = ("gpt2", "llama", "bert", "vit", "moe", "hf_config")
# The config model types whose analytic peak a test holds within ±5 % of their trace
# (tests/test_model_sources.py, one tiny config of each in tests/model_configs.py). Another
# type is counted by the same rules, unchecked; `plan` says so and `plan --traced` checks it.
HELD_AGAINST_TRACE = frozenset({"llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi3",
                                "olmo2", "granite", "starcoder2", "gpt2", "opt", "phi", "gpt_neox", "olmo", "roberta",
                                "gptj", "gpt_bigcode", "nemotron", "persimmon", "falcon",
                                "stablelm", "cohere", "mixtral", "qwen3_moe", "olmoe", "qwen2_moe", "glm4_moe",
                                "deepseek_v2", "deepseek_v3", "gpt_oss", "ernie4_5", "seed_oss", "olmo3",
                                "cohere2", "exaone4", "arcee", "granitemoe", "phimoe"})


def unheld(spec: ModelSpec) -> str | None:
    """What of a config's model the analytic predictor has not been held against a trace
    for (None where it has): a model type outside ``HELD_AGAINST_TRACE``, or a Falcon with
    ALiBi (Falcon-RW), which adds its position biases to a float mask heads times larger than
    the causal one counted."""
    if spec.hf is None:
        return None
    if spec.hf.model_type not in HELD_AGAINST_TRACE:
        return f"model_type {spec.hf.model_type}"
    if sources.config_value(hf_config.resolved(spec.hf), "alibi"):
        return f"model_type {spec.hf.model_type} with ALiBi position biases"
    return None


def unavailable_reason(cell: CellSpec, spec: ModelSpec) -> str | None:
    """Why the analytic model has no prediction for this cell, or None. A strategy or model
    it does not describe gets none rather than another strategy's formula."""
    name, family, layout = cell.strategy.name, spec.family, spec.layout
    kind = strategies.get(name).engine_model.analytic  # which part of the model describes it
    if family not in TRANSFORMER_FAMILIES + ("mlp", "convnet"):
        return f"family {family}: no activation or parameter formula for it in harness/predict/analytic.py"
    if family == "hf_config" and not spec.has_attention:
        return (f"{spec.name}: an attention-free sequence model (a state-space or recurrent layer): no activation"
                " formula for its layers; the traced predictor follows it")
    if family == "convnet" and (cell.strategy.precision != "fp32" or cell.strategy.checkpointing != "none"):
        return ("family convnet: its activations are modelled in fp32 without checkpointing only (which dtype"
                " autocast gives a convolution's and BatchNorm's outputs, and what recompute keeps, are not)")
    if kind == "data_parallel":
        return None
    if kind == "tensor_parallel":
        if tp_sharded_numel(spec) is None:
            return (f"{name} on {spec.name}: which of its parameters are split is modelled for the gpt2 and llama"
                    " layouts only")
        if cell.strategy.optimizer != "adamw":
            return f"{name} with optimizer={cell.strategy.optimizer}: the state formula needs the split shapes"
        return None
    if kind == "megatron":
        if layout not in ("gpt2", "llama"):
            return f"megatron on {spec.name}: GPTModel is built for the gpt2 and llama layouts only"
        pp = cell.strategy.layout("pp_degree")
        if spec.n_layers % pp:
            return f"megatron: {spec.n_layers} layers do not split evenly into pp_degree={pp} stages"
        return None
    if kind == "context_parallel":
        if layout != "llama":
            return f"cp on {spec.name}: context parallel is wired for the llama layout only"
        return None
    if kind == "expert_parallel":
        if layout != "mixtral":
            return (f"deepspeed_autoep on {spec.name}: expert parallelism needs a mixture of experts"
                    " (the mixtral layout)")
        n_experts = spec.required("n_experts")
        if n_experts % cell.world_size:
            return f"deepspeed_autoep: {n_experts} experts do not split evenly over {cell.world_size} ranks"
        if cell.strategy.precision != "fp32":
            return (f"deepspeed_autoep with precision={cell.strategy.precision}: only fp32 is wired"
                    " (DeepSpeed's BF16_Optimizer and its master copies are not modelled)")
        return None
    if layout not in ("gpt2", "llama"):  # a pipeline
        return f"{name} on {spec.name}: the stage split is modelled for the gpt2 and llama layouts only"
    try:
        pipeline_stage_layers(spec.n_layers, pipeline.n_stages(name, cell.world_size))
    except ValueError as e:
        return f"{name}: {e}"
    return None


def predict(cell: CellSpec, spec: ModelSpec | None = None, nodes: int = 1, device_type: str = "cuda") -> dict:
    """The analytic prediction for one cell, per rank; the record's ``predicted.analytic``.

    ``spec`` replaces the cell's preset (``harness plan`` with another sequence length);
    ``nodes`` shapes the HSDP mesh (replicate across nodes); ``device_type`` the ranks'
    devices ("cuda" where it plans for GPUs), whose default kernels keep different
    temporaries. A cell the model does not describe (``unavailable_reason``) gets
    ``{"unavailable": reason}``."""
    spec = spec or cell.model_spec
    why = unavailable_reason(cell, spec)
    if why:
        return {"unavailable": why}
    layout = models.param_layout(spec)
    extra, schedule_moment = {}, None
    if strategies.get(cell.strategy.name).engine_model.analytic == "data_parallel":
        states = model_states_at_step(cell, layout, nodes)
        acts = activation_bytes(cell, spec, device_type)
        comm = comm_bytes_per_step(cell, layout, nodes)
        transient = transient_bytes(cell, layout, spec, device_type)
    else:
        parts = model_parallel_parts(cell, spec, layout)
        keys = ("states", "activations", "comm", "transient", "extra")
        states, acts, comm, transient, extra = (parts[k] for k in keys)
        schedule_moment = parts.get("schedule_moment")
    offloaded = offloaded_bytes(cell, states, layout)
    if cell.strategy.checkpointing == "offload":  # what the blocks save goes to host memory
        offloaded["activations"] = acts["layers"]
    model_state_bytes = sum(states.values())
    step_temporaries = optimizer_step_bytes(cell, layout, device_type) if not offloaded["optimizer"] else 0.0
    # On a CPU the host is the device: what offload moves stays in the memory the trackers count.
    peak = peak_breakdown(cell, layout, states, offloaded if device_type != "cpu" else {}, acts, transient,
                          step_temporaries, schedule_moment)
    return {
        "model_states_bytes": states,
        "model_state_bytes": model_state_bytes,
        "activation_bytes": acts,
        "transient_bytes": transient,
        "peak_bytes": sum(peak.values()),
        "peak_breakdown_bytes": peak,
        "offloaded_bytes": offloaded,
        "comm_bytes_by_op": comm,
        "comm_bytes_per_step": sum(comm.values()),
        "comm_volume_per_step": comm_volume(comm),
        "flops_per_token": models.flops_per_sample(spec) / spec.tokens_per_sample,
        "n_params": layout.numel,
        **extra,
    }


def peak_breakdown(cell: CellSpec, layout: models.ParamLayout, states: dict[str, float],
                   offloaded: dict[str, float], acts: dict[str, float], transient: dict[str, float],
                   step_temporaries: float, schedule_moment: dict[str, float] | None = None) -> dict[str, float]:
    """The peak per rank in the measured categories (harness/measure/memory.py
    BREAKDOWN_KEYS): the largest of the step's high points.

    - The start of backward: the states on the device, the gathered parameters, every
      activation of the micro-batch and the loss's gradients; gradients
      only where accumulation or a pipeline's schedule holds them from the micro-batches
      before, or the engine zeroes them in place (zero_grad otherwise sets them to None, so
      a step's first backward starts without any); a gradient partition that exists in
      backward (DeepSpeed ZeRO-2's, made early in backward and held by the rank that reduces
      first; ZeRO-3's, made with the engine).
    - The last block's backward under checkpointing: the same, less the logits (the
      head's backward is done), plus what the block recomputes and the blocks prefetched
      beside it; where attention makes its scores, further into it, its softmax's backward:
      the loss's gradients gone, the scores' gradients held (``transient["score_grads"]``).
    - A pipeline's rank: in place of those two, its schedule's highest moment
      (``schedule_moment``, analytic_parallel.pipeline_rank_peak), played out micro-batch by
      micro-batch.
    - The optimizer step: the states and every gradient, no activations, and the
      optimizer's own temporaries; where the engine frees the 16-bit gradients before it
      (DeepSpeed ZeRO-1/2 under bf16 or fp16), without them, and the end of backward with
      them as a moment of its own.
    - FSDP's last block reducing its gradients, first in backward: the root unit gathered, the
      other blocks' activations, the loss's gradients and the block's gradient copies
      (``transient["block_reduce"]``).
    - FSDP's root unit reducing its gradients, last in backward: the root resharded, every
      other unit's gradient shard, no activations, and the root's gradient copies
      (``transient["root_reduce"]``).
    - A tied token table's gradient summed from the head's and the embedding's, backward's
      last op: three copies of it in the gradients' dtype, beside every gradient DeepSpeed
      ZeRO-1 holds until after backward (ZeRO-2: the rank's partition), or beside FSDP's
      gathered root and every other unit's gradient shard.

    Gathered parameters count as parameters; autocast's weight copies and a recomputed block
    are made in forward, so the trackers count them as activations; the engines' buffers and
    the loss's gradients are "other". The traced predictor times every tensor exactly; this
    is the first-order figure that ``plan`` and the fit check decide by."""
    on_device = {k: states[k] - offloaded.get(k, 0.0) for k in ("params", "grads", "optimizer")}
    # Activation offload: the blocks' saved tensors are on the host, and one block's come back
    # as its backward runs (as a recomputed block is made again).
    layers_on_device = acts["layers"] - offloaded.get("activations", 0.0)
    unpacked = acts["per_layer"] if offloaded.get("activations") else 0.0
    buffers = states.get("buffers", 0.0)
    # Buffers made (or first seen) at the end of backward: held at the step, not before.
    in_backward = buffers - transient.get("buffers_after_backward", 0.0)
    engine = strategies.get(cell.strategy.name).engine_model
    # A tied head's token table: backward's last op sums its gradient from the head's and the
    # embedding's, three copies of it at once (the moments below, per engine).
    # (A vocabulary-parallel rank's slice of it.)
    table = (cell.model_spec.required("vocab_size") * cell.model_spec.hidden / vocabulary_slices(cell)
             if cell.model_spec.head_tied else 0)
    # A pipeline's schedule runs later micro-batches' forwards while earlier ones' gradients
    # are held, as accumulation does.
    pipelined = engine.analytic == "pipeline" or (engine.analytic == "megatron"
                                                  and cell.strategy.layout("pp_degree") > 1)
    held_grads = cell.strategy.accumulation > 1 or pipelined or engine.grads_between_steps == "zeroed"
    # What the micro-steps before hold (EngineModel.accumulated_grads), unsharded: the whole
    # model's, or a tensor-parallel rank's part of it.
    unsharded = tp_accumulated_numel(cell, layout) if engine.analytic == "tensor_parallel" else layout.numel
    grads_held = ({"sharded": on_device["grads"], "sharded_beside_partition": on_device["grads"],
                   "unsharded_fp32": 4.0 * unsharded,
                   "unsharded_compute": PRECISION_BYTES[cell.strategy.precision] * unsharded}
                  [engine.accumulated_grads] if cell.strategy.accumulation > 1 else on_device["grads"])
    # A gradient partition allocated early in backward is held at its start by the rank
    # that reduces first, whose peak the record's (the max over ranks) is. Under accumulation
    # ZeRO-3's is the buffer the micro-steps accumulate in, counted as their gradients;
    # ZeRO-2 allocates one every micro-step beside those (gpt2-tiny, 2 ranks, 4 micro-steps:
    # 0.899 of the measured peak without it).
    beside = engine.accumulated_grads == "sharded_beside_partition"
    partition = on_device["grads"] if engine.grad_partition_in_backward and (beside or not held_grads) else 0.0
    backward = {
        "params": on_device["params"] + transient.get("gathered", 0.0),
        "grads": grads_held if held_grads else 0.0,
        "optimizer": on_device["optimizer"],
        "activations": layers_on_device + acts["logits"] + transient.get("autocast_copies", 0.0),
        "other": in_backward + transient.get("loss", 0.0) + transient.get("activation_grads", 0.0) + partition,
    }
    # The last block's backward recomputing it: the head's backward is done, so the logits
    # are gone (the loss's gradients are still held, as the trackers see them).
    recomputing = {**backward, "params": backward["params"] + transient.get("prefetched", 0.0),
                   "activations": (layers_on_device + transient.get("autocast_copies", 0.0)
                                   + transient.get("recompute", 0.0) + unpacked)}
    freed = engine.frees_16bit_grads_before_step and cell.strategy.precision != "fp32"
    step = {**on_device, "grads": 0.0 if freed else on_device["grads"],
            "optimizer": on_device["optimizer"] + step_temporaries, "activations": 0.0, "other": buffers}
    # A pipeline's schedule, played out, gives its own highest moment in backward (the
    # micro-batches in flight, the loss's gradients, a recompute; analytic_parallel).
    moments = [backward, recomputing, step] if schedule_moment is None else [schedule_moment, step]
    if transient.get("head_grad"):
        # The head's backward, next: the logits and the loss's gradients gone with the loss's
        # backward but the logits' own, the head's weight gradient made beside every other
        # activation.
        moments.append({**backward, "activations": backward["activations"] - acts["logits"],
                        "other": backward["other"] - transient.get("loss", 0.0) + transient["head_grad"]})
    if table and transient.get("prefetched") and engine.keeps_gathered == "within_live_parameters":
        # DeepSpeed ZeRO-3 in the last block's backward, its prefetch having gathered the
        # parameters forward released (the tied table among them: transient["prefetched"]):
        # the table's gradient from the head's backward held until the embedding's adds to it,
        # in the compute precision, the loss's gradients gone (llama-1b on 8 ranks at 128
        # tokens, checkpointed: the trace's peak, in block 15's backward; 0.89 of it in fp32
        # and 0.91 in bf16 without this moment).
        moments.append({**recomputing, "other": in_backward + partition
                        + PRECISION_BYTES[cell.strategy.precision] * table})
    if transient.get("score_grads"):
        # Further into that block's backward, its softmax's: the loss's gradients are gone too,
        # and the scores' gradients held (traced: eager attention at 2,048 tokens peaks here).
        moments.append({**recomputing, "other": in_backward + partition + transient["score_grads"]})
    if engine.frees_16bit_grads_before_step:
        # DeepSpeed ZeRO-1/2, backward done, in any precision (its gradients are in the compute
        # precision): ZeRO-1's gradients whole (not partitioned), ZeRO-2's partition (Moonlight
        # under ZeRO-1: the trace's peak). ZeRO-1 without overlap_comm reduces them after
        # backward, and the first gradient of the rank's partition it reduces allocates the
        # contiguous buffer the partition's gradients move into while every one of them is held
        # (Moonlight-16B on 8 ranks: 0.953 of the trace without it; 1.004 with the largest
        # rank's, where the trace follows rank 0's).
        grad_bytes = PRECISION_BYTES[cell.strategy.precision]
        partitioned = shard_degree(cell) if engine.grad_partition_in_backward else 1
        reduced_after = not engine.grad_partition_in_backward and not cell.strategy.overlap_comm
        buffer = deepspeed_zero.gradient_partition_numel(layout.shapes, shard_degree(cell)) if reduced_after else 0
        moments.append({**on_device, "grads": grad_bytes * (layout.numel / partitioned + buffer), "activations": 0.0,
                        "other": buffers})
        if table:
            # Backward's last op, before any of that: the tied table's gradient summed beside
            # every other gradient (ZeRO-1) or the rank's partition (ZeRO-2), the head's held
            # since its backward. A checkpointed or short-sequence step peaks here: gpt2-124m
            # on 8 ranks at 128 tokens, fully checkpointed, ZeRO-1 read 0.58 (fp32) and 0.93
            # (bf16) of its trace without it, ZeRO-2 bf16 0.89.
            held = layout.numel / partitioned if partitioned > 1 else layout.numel - table
            moments.append({**on_device, "grads": grad_bytes * held, "activations": 0.0,
                            "other": buffers + 3 * grad_bytes * table})
    whole_grads = "grads" not in engine.sharded and not engine.fp32_master_partition
    if table and whole_grads and engine.analytic == "data_parallel":
        # torch's engines hold every gradient whole, in fp32 as their parameters are (the
        # reference, DDP, ZeroRedundancyOptimizer, FairScale): the tied table's gradient summed
        # beside every other gradient, or every one where the table's own is already there
        # (FairScale SDP zeroes them in place; accumulation). gpt2-124m under SDP on 8 ranks at
        # 128 tokens, checkpointed: 0.912 of the trace without it.
        held = layout.numel if engine.grads_between_steps == "zeroed" or held_grads else layout.numel - table
        moments.append({**on_device, "grads": 4.0 * held, "activations": 0.0, "other": buffers + 3 * 4.0 * table})
    if transient.get("block_reduce"):
        # The last block's gradients reduce-scattering as its backward ends: the root unit
        # gathered, the other blocks' activations still held (the head's and the logits' done).
        low = PRECISION_BYTES[cell.strategy.precision]
        layers = layers_on_device * (1 - 1 / cell.model_spec.n_layers)
        moments.append({"params": on_device["params"] + low * layout.root_numel, "grads": 0.0,
                        "optimizer": on_device["optimizer"], "activations": layers,
                        "other": in_backward + transient["block_reduce"] + transient.get("loss", 0.0)})
    if transient.get("root_reduce"):
        # The root unit's gradients reduce-scattered last, the root resharded by then, every
        # other unit's gradient shard held.
        low = PRECISION_BYTES[cell.strategy.precision]
        root_last = {"params": on_device["params"],
                     "grads": on_device["grads"] * (1 - layout.root_numel / layout.numel),
                     "optimizer": on_device["optimizer"], "activations": 0.0}
        moments.append({**root_last, "other": buffers + transient["root_reduce"]})
        if table:
            # Just before, in the root's backward (the root gathered): the tied table's
            # gradient summed, in the compute dtype, beside the first block's fp32 reduce
            # input, not yet freed (gpt2-124m, 8 ranks, 128 tokens, checkpointed: the trace's
            # peak in fp32 and bf16).
            moments.append({**root_last, "params": on_device["params"] + low * layout.root_numel,
                            "other": buffers + 3 * low * table + 4.0 * layout.block_numel})
    return max(moments, key=lambda phase: sum(phase.values()))
