"""Megatron-core: its GPTModel split by its tensor and pipeline parallelism, wrapped in its
DistributedDataParallel, stepped by its distributed optimizer (get_megatron_optimizer with
use_distributed_optimizer).

Parallel layout: world_size = tp_degree × pp_degree × data-parallel size (StrategySpec; 2 × 1
by default, so 4 ranks are 2 data-parallel groups of 2 tensor-parallel ranks).
``parallel_state.initialize_model_parallel`` lays the ranks out in Megatron's default order
(tp-cp-ep-dp-pp: the tensor-parallel ranks of a group adjacent, then the data-parallel groups,
then the pipeline stages). Each rank builds the GPTModel of its pipeline stage: the first
stage embeds (pre_process), the last applies the final norm, the head and the loss
(post_process), and each holds n_layers / pp_degree consecutive layers (Megatron splits them
evenly). With pp_degree > 1 a step is Megatron's own schedule (get_forward_backward_func:
1F1B without interleaving) over pp_microbatches micro-batches of micro_batch samples, with
its p2p sends of the activations and their gradients; the loss lives on the last stage
(``holds_loss``). A tied head (GPT-2 always) is a copy of the word embeddings on the last
stage, whose gradient Megatron all-reduces with the first stage's over its embedding group
(finalize_model_grads, which the schedule calls after the last backward). Each data-parallel
group takes its own share of the samples (``data_rank`` = its data-parallel rank); Megatron's
DDP averages the gradients over the group (the mean loss of the whole batch, as the
reference) and its distributed optimizer shards the optimizer state over it.

Process groups: made by initialize_model_parallel for a layout and kept while the worker's
cells share it; a cell with another (tp, pp) drops them (destroy_model_parallel) and makes the
new ones. A worker runs a batch of cells at one world size, which can mix layouts (the default
suite at 4 ranks has tp2×pp1 and tp2×pp2), so refusing a second layout would fail cells that
can run; Megatron-LM's own unit tests switch layouts the same way in one process
(Utils.initialize_model_parallel: destroy_model_parallel, then initialize_model_parallel).
destroy_model_parallel only drops Megatron's references: the old groups' communicators live on
until the worker exits, and a cell whose layout did not change makes none.

Equivalence: the harness's HF model's weights are copied into a GPTModel of the same sizes
(``copy_hf_weights``), which computes the same function with HF's loss, so the reference
stays the one-process HF run; README "Model parallelism" says how, layout by layout.

Why it needs CUDA (read in megatron-core 0.16.1's source) and how to install it: README
"Model parallelism".
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers.modeling_outputs import CausalLMOutput

from harness import models
from harness.models import sources
from harness.models.spec import ModelSpec
from harness.strategies.base import Capabilities, EngineModel, Prepared, Strategy

if TYPE_CHECKING:
    from transformers import PreTrainedConfig, PreTrainedModel

    from harness.config import CellSpec, StrategySpec
    from harness.distributed import DistEnv

INSTALL = "pip install megatron-core"
LAYOUTS = ("gpt2", "llama")

CAPABILITIES = Capabilities(
    precisions=frozenset({"fp32"}),
    checkpointing=frozenset({"none", "full"}),
    clipping=False,
    evaluation=False,
    notes={
        "evaluation": "Megatron's forward runs through its own schedule and loss: no held-out evaluation wired",
        "clip_grad_norm": ("Megatron clips inside its own optimizer (OptimizerConfig.clip_grad), which"
                           " needs CUDA to be measured against the gate: not wired"),
        "bf16": ("Megatron's bf16 recipe (Float16Module: bf16 parameters, fp32 main copies in the"
                 " optimizer) starts its fp32 master weights from bf16-rounded copies, not the"
                 " reference's fp32 weights; not wired until it is measured against the gate on a GPU"),
        "fp16": "Megatron's fp16 needs its own loss scaler in place of the harness's GradScaler: not wired",
        "selective": ("Megatron's selective recompute checkpoints core attention only, which is not the"
                      " harness's selective policy"),
    },
)

CPU_REASON = (
    "megatron-core needs CUDA: its attention takes buffers and the causal mask from"
    " torch.cuda.current_device() / device='cuda' (GlobalMemoryBuffer, get_default_causal_mask), its"
    " forward forks the CUDA RNG tracker (CudaRNGStatesTracker), its DDP allocates gradient buffers on"
    " torch.cuda.current_device(), its optimizers make device='cuda' tensors (DistributedOptimizer"
    " refuses parameters that are not torch.cuda tensors), and its pipeline schedule and p2p buffers"
    " are made on the CUDA device"
)


def unsupported_reason(cell: CellSpec, device_type: str) -> str | None:
    if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
        return f"megatron-core is not installed: {INSTALL}"
    if device_type != "cuda":
        return CPU_REASON
    return None


def combination_problem(cell: CellSpec) -> str | None:
    """Cells GPTModel in this tensor × pipeline layout cannot express exactly. (CellSpec has
    checked that the layout fits the world size and the model's depth.)"""
    spec = cell.model_spec
    if spec.layout not in LAYOUTS:
        return (f"model {cell.model_name}: Megatron's GPTModel is built here for the {' and '.join(LAYOUTS)} layouts"
                " only (harness/models/spec.py, Layout)")
    if spec.hidden != spec.required("n_heads") * spec.head_dim:
        return (f"model {cell.model_name}: its heads are {spec.head_dim} wide, not hidden / heads"
                f" ({spec.hidden // spec.required('n_heads')}): GPTModel is built here with Megatron's default"
                " kv_channels")
    if models.param_layout(spec).qk_norm:
        return (f"model {cell.model_name}: its attention normalises queries and keys per head (q_norm), which"
                " GPTModel as built here (no qk_layernorm) and its weight copy do not carry")
    if (window := sources.window_passed(spec)) is not None:
        return (f"model {cell.model_name}: its attention is masked to a {window}-token sliding window, which"
                f" {spec.tokens_per_sample} tokens pass; GPTModel as built here attends to the whole causal context")
    if cell.attention != "eager":
        return (f"attention={cell.attention}: Megatron-core's local layer spec computes attention unfused"
                " (DotProductAttention), which is HF's eager; set attention='eager'")
    partial = [f"{o}={getattr(cell.strategy, o)!r}" for o in ("checkpoint_every", "checkpoint_blocks")
               if getattr(cell.strategy, o)]
    if partial:
        return (f"{partial[0]}: Megatron's full recompute checkpoints every layer of its own GPTModel"
                " (recompute_granularity full, uniform): no subset of blocks is wired")
    tp, pp = cell.strategy.layout("tp_degree"), cell.strategy.layout("pp_degree")
    sizes = {"n_heads": spec.required("n_heads"), "n_kv_heads": spec.kv_heads, "ffn": spec.ffn,
             "vocab_size": spec.required("vocab_size")}
    for name, size in sizes.items():
        if size % tp:
            # Padding the vocabulary would add logits the reference does not have.
            return f"model {cell.model_name}: {name}={size} is not divisible by the tensor-parallel size tp_degree={tp}"
    if spec.n_layers % pp:
        return (f"model {cell.model_name}: its {spec.n_layers} layers do not split evenly into pp_degree={pp} stages"
                " (Megatron's even split)")
    return None


def use_layout(tp: int, pp: int) -> None:
    """Megatron's process groups for this (tp, pp) layout: made on the first cell, kept while
    the layout stays, re-made when it changes (module docstring)."""
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        current = (parallel_state.get_tensor_model_parallel_world_size(),
                   parallel_state.get_pipeline_model_parallel_world_size())
        if current == (tp, pp):
            return
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)


def _seed_rng_tracker(seed: int) -> None:
    """Megatron's CUDA RNG tracker, which its attention forks: reset to the cell's seed for
    every cell (each call replaces the tracker's states)."""
    from megatron.core import tensor_parallel

    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def transformer_config(spec: ModelSpec, hf_config: PreTrainedConfig, tp_size: int, pp_size: int = 1,
                       checkpointing: str = "none") -> Any:
    """A TransformerConfig with the HF model's sizes and maths (module docstring)."""
    from megatron.core.transformer import TransformerConfig

    common: dict[str, Any] = dict(
        num_layers=spec.n_layers, hidden_size=spec.hidden, num_attention_heads=spec.n_heads,
        num_query_groups=spec.kv_heads, ffn_hidden_size=spec.ffn,
        tensor_model_parallel_size=tp_size, pipeline_model_parallel_size=pp_size,
        pipeline_dtype=torch.float32,  # what the stages send each other (fp32 only: CAPABILITIES)
        hidden_dropout=0.0, attention_dropout=0.0,  # the HF models run without dropout
        params_dtype=torch.float32,
        # Built on the CPU, then overwritten from the HF model. The initialisation must run all
        # the same: it is what marks the tensor-parallel weights (tensor_model_parallel,
        # partition_dim), which the copy, the optimizer and the gradient norms read.
        use_cpu_initialization=True, perform_initialization=True,
        # The fused kernels need Apex / Transformer Engine; the unfused paths are plain torch.
        bias_activation_fusion=False, masked_softmax_fusion=False, persist_layer_norm=False,
        gradient_accumulation_fusion=False, apply_rope_fusion=False, bias_dropout_fusion=False,
    )
    if checkpointing == "full":  # one checkpoint per transformer layer, as the harness's "full"
        common.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    if spec.layout == "gpt2":
        family = dict(
            normalization="LayerNorm", layernorm_epsilon=hf_config.layer_norm_epsilon,
            add_bias_linear=True, add_qkv_bias=True, gated_linear_unit=False,
            activation_func=functools.partial(F.gelu, approximate="tanh"),  # HF's "gelu_new"
        )
    else:
        family = dict(
            normalization="RMSNorm", layernorm_epsilon=hf_config.rms_norm_eps,
            add_bias_linear=False, add_qkv_bias=False, gated_linear_unit=True, activation_func=F.silu,
        )
    return TransformerConfig(**common, **family)


def build_gpt_model(spec: ModelSpec, hf_config: PreTrainedConfig, config: Any) -> nn.Module:
    """This rank's pipeline stage of the GPTModel: the embedding on the first stage, the head
    and the loss on the last, the stage's share of the layers (parallel_state's stage)."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    llama = spec.layout == "llama"
    with torch.random.fork_rng(devices=[]):  # its throw-away init must not move the caller's RNG
        gpt: nn.Module = GPTModel(
            config=config,
            transformer_layer_spec=get_gpt_layer_local_spec(normalization=config.normalization),
            vocab_size=spec.vocab_size,
            max_sequence_length=spec.seq_len,
            pre_process=parallel_state.is_pipeline_first_stage(),
            post_process=parallel_state.is_pipeline_last_stage(),
            share_embeddings_and_output_weights=spec.tie_embeddings if llama else True,  # GPT-2 always ties
            position_embedding_type="rope" if llama else "learned_absolute",
            rotary_base=int(hf_config.rope_parameters["rope_theta"]) if llama else 10000,
        )
    return gpt


def _interleave_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: int) -> torch.Tensor:
    """[q; k; v] stacked by kind -> Megatron's per-group layout: for each query group its
    query heads, then its key head, then its value head (so a column split gives each
    tensor-parallel rank whole groups)."""
    def by_group(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(groups, -1, *t.shape[1:])

    return torch.cat([by_group(q), by_group(k), by_group(v)], dim=1).reshape(-1, *q.shape[1:])


# The HF model's tree, walked by attribute name below: its blocks may be the checkpoint
# wrappers of features/checkpointing.py, which forward attributes to the block they wrap, so
# no static type describes what the walk reaches.
_HFTree = Any


def _gpt2_tensors(hf: PreTrainedModel, spec: ModelSpec) -> Iterator[tuple[str, torch.Tensor]]:
    """(Megatron name, full tensor) for GPT-2, layers by their index in the whole model. HF's
    Conv1D stores weights as [in, out]."""
    t: _HFTree = hf.transformer
    yield "embedding.word_embeddings.weight", t.wte.weight
    yield "embedding.position_embeddings.weight", t.wpe.weight
    for i, block in enumerate(t.h):
        p = f"decoder.layers.{i}."
        yield p + "input_layernorm.weight", block.ln_1.weight
        yield p + "input_layernorm.bias", block.ln_1.bias
        q, k, v = block.attn.c_attn.weight.t().chunk(3, dim=0)
        yield p + "self_attention.linear_qkv.weight", _interleave_qkv(q, k, v, spec.kv_heads)
        q, k, v = block.attn.c_attn.bias.chunk(3, dim=0)
        yield p + "self_attention.linear_qkv.bias", _interleave_qkv(q, k, v, spec.kv_heads)
        yield p + "self_attention.linear_proj.weight", block.attn.c_proj.weight.t()
        yield p + "self_attention.linear_proj.bias", block.attn.c_proj.bias
        yield p + "pre_mlp_layernorm.weight", block.ln_2.weight
        yield p + "pre_mlp_layernorm.bias", block.ln_2.bias
        yield p + "mlp.linear_fc1.weight", block.mlp.c_fc.weight.t()
        yield p + "mlp.linear_fc1.bias", block.mlp.c_fc.bias
        yield p + "mlp.linear_fc2.weight", block.mlp.c_proj.weight.t()
        yield p + "mlp.linear_fc2.bias", block.mlp.c_proj.bias
    yield "decoder.final_layernorm.weight", t.ln_f.weight
    yield "decoder.final_layernorm.bias", t.ln_f.bias


def _llama_tensors(hf: PreTrainedModel, spec: ModelSpec) -> Iterator[tuple[str, torch.Tensor]]:
    """(Megatron name, full tensor) for Llama, layers by their index in the whole model;
    linear_fc1 is [gate; up] before the rank split."""
    m: _HFTree = hf.model
    yield "embedding.word_embeddings.weight", m.embed_tokens.weight
    for i, layer in enumerate(m.layers):
        p = f"decoder.layers.{i}."
        a, mlp = layer.self_attn, layer.mlp
        if a.q_proj.bias is not None:  # Qwen2's: the local spec's add_qkv_bias is not wired here
            raise ValueError("megatron: the LLaMA-layout weight copy takes no attention biases; this model has them")
        yield p + "input_layernorm.weight", layer.input_layernorm.weight
        yield p + "self_attention.linear_qkv.weight", _interleave_qkv(
            a.q_proj.weight, a.k_proj.weight, a.v_proj.weight, spec.kv_heads)
        yield p + "self_attention.linear_proj.weight", a.o_proj.weight
        yield p + "pre_mlp_layernorm.weight", layer.post_attention_layernorm.weight
        yield p + "mlp.linear_fc1.weight", torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])
        yield p + "mlp.linear_fc2.weight", mlp.down_proj.weight
    yield "decoder.final_layernorm.weight", m.norm.weight


def _stage_name(name: str, gpt: nn.Module, local_layer: dict[int, int]) -> str | None:
    """The name in this pipeline stage's GPTModel of a whole-model tensor, or None when the
    tensor belongs to another stage. Layers are numbered per stage from 0 (``local_layer``
    maps the whole model's index to it); the head's weight is a parameter of the last stage
    unless it is the embedding's own (tied on a stage that also embeds)."""
    if name.startswith("embedding."):
        return name if gpt.pre_process else None
    if name.startswith("decoder.final_layernorm."):
        return name if gpt.post_process else None
    if name == "output_layer.weight":
        held = gpt.post_process and not (gpt.share_embeddings_and_output_weights and gpt.pre_process)
        return name if held else None
    index, rest = name.removeprefix("decoder.layers.").split(".", 1)
    local = local_layer.get(int(index))
    return None if local is None else f"decoder.layers.{local}.{rest}"


def _rank_slice(full: torch.Tensor, param: Any, tp_rank: int, tp_size: int) -> torch.Tensor:
    """This rank's part of a full tensor, split where Megatron splits the parameter (a torch
    Parameter carrying the tensor_model_parallel / partition_dim attributes Megatron sets)."""
    if not getattr(param, "tensor_model_parallel", False):
        return full  # replicated: norms, position embeddings, row-parallel biases
    return full.chunk(tp_size, dim=param.partition_dim)[tp_rank]


@torch.no_grad()
def copy_hf_weights(hf: PreTrainedModel, gpt: Any, spec: ModelSpec, tp_rank: int, tp_size: int) -> None:
    """Overwrite every parameter of ``gpt`` (this pipeline stage's layers and ends, this
    tensor-parallel rank's shard of them) with the HF model's weights; a parameter left unset
    or a shape that does not fit is an error."""
    tensors: Iterable[tuple[str, torch.Tensor]] = (
        _gpt2_tensors(hf, spec) if spec.layout == "gpt2" else _llama_tensors(hf, spec))
    # The head: HF's lm_head, which is the embedding table itself where the model ties them.
    tensors = [*tensors, ("output_layer.weight", hf.get_output_embeddings().weight)]
    # TransformerLayer.layer_number counts from 1 over the whole model (the stage's offset added).
    local_layer = {layer.layer_number - 1: j for j, layer in enumerate(gpt.decoder.layers)}
    params = dict(gpt.named_parameters())
    glu = gpt.config.gated_linear_unit
    unset = set(params)
    for whole_model_name, full in tensors:
        name = _stage_name(whole_model_name, gpt, local_layer)
        if name is None:
            continue
        param = params[name]
        if glu and name.endswith("mlp.linear_fc1.weight"):
            # SwiGLU: each rank holds [its gate rows; its up rows] (MLP.forward chunks in two).
            gate, up = full.chunk(2, dim=0)
            part = torch.cat([gate.chunk(tp_size)[tp_rank], up.chunk(tp_size)[tp_rank]])
        else:
            part = _rank_slice(full, param, tp_rank, tp_size)
        if part.shape != param.shape:
            raise ValueError(f"{name}: HF gives {tuple(part.shape)} for this rank, Megatron holds {tuple(param.shape)}")
        param.copy_(part)
        unset.discard(name)
    if unset:
        raise ValueError(f"no HF weight for Megatron parameters {sorted(unset)}")


def gpt_inputs(input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor | None]:
    """GPTModel's arguments for a causal-LM batch. Megatron's labels are each position's
    target; HF shifts inside its model. The last position has no next token: its rolled-in
    target is dropped by ``mean_predicted_loss``, as in HF."""
    batch, seq = input_ids.shape
    position_ids = torch.arange(seq, device=input_ids.device).expand(batch, seq)
    return dict(input_ids=input_ids, position_ids=position_ids, attention_mask=None, labels=labels.roll(-1, dims=1))


def mean_predicted_loss(per_token: torch.Tensor) -> torch.Tensor:
    """HF's causal-LM loss from GPTModel's per-token losses: the mean over the seq_len - 1
    predicted positions."""
    return per_token[:, :-1].mean()


class MegatronCausalLM(nn.Module):
    """The worker's loss path for a GPTModel without a pipeline: ``forward(input_ids, labels)``
    returns an output whose ``loss`` is HF's causal-LM loss, so ``built.loss`` serves it unchanged."""

    def __init__(self, gpt: nn.Module):
        super().__init__()
        self.gpt = gpt

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> CausalLMOutput:
        return CausalLMOutput(loss=mean_predicted_loss(self.gpt(**gpt_inputs(input_ids, labels))))


def forward_step(data_iterator: Iterator[tuple[torch.Tensor, torch.Tensor]], model: nn.Module
                 ) -> tuple[torch.Tensor, Callable[[torch.Tensor], tuple[torch.Tensor, dict[str, torch.Tensor]]]]:
    """Megatron's forward_step_func: one micro-batch through this stage. The last stage's
    output is the per-token loss, which the schedule hands to the returned loss function."""
    input_ids, labels = next(data_iterator)
    return model(**gpt_inputs(input_ids, labels)), _schedule_loss


def _schedule_loss(per_token: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    loss = mean_predicted_loss(per_token)
    # The schedule divides the first in place by the micro-batch count (for the backward):
    # the reported loss is a copy.
    return loss, {"loss": loss.detach().clone()}


class _PipelineStep:
    """One optimizer step's forward and backward through Megatron's pipeline schedule: the
    step's rows cut into pp_microbatches micro-batches of micro_batch samples. Returns the
    mean loss on the last stage, None on the others."""

    def __init__(self, ddp_model: nn.Module, cell: CellSpec, holds_loss: bool):
        from megatron.core.pipeline_parallel import get_forward_backward_func

        self.ddp_model, self.holds_loss = ddp_model, holds_loss
        self.micro_batch, self.n_micro = cell.micro_batch, cell.strategy.pp_microbatches
        self.schedule = get_forward_backward_func()

    def __call__(self, batch: dict[str, torch.Tensor]) -> torch.Tensor | None:
        input_ids, labels = batch["input_ids"], batch["labels"]
        losses = self.schedule(
            forward_step_func=forward_step,
            data_iterator=zip(input_ids.split(self.micro_batch), labels.split(self.micro_batch)),
            model=[self.ddp_model], num_microbatches=self.n_micro,
            seq_length=input_ids.shape[1], micro_batch_size=self.micro_batch,
        )
        if not self.holds_loss:
            return None
        # The mean of equal micro-batches' means: the whole step's mean loss.
        return torch.stack([loss["loss"] for loss in losses]).mean()


def _torch_optimizer(megatron_optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer inside get_megatron_optimizer's ChainedOptimizer (one dense group)."""
    (inner,) = megatron_optimizer.chained_optimizers
    optimizer: torch.optim.Optimizer = inner.optimizer
    return optimizer


class _OptimizerStepper:
    """Megatron's end of an optimizer step, after the last micro-step's backward: finish the
    gradient reductions (unless the pipeline schedule has), step, zero the DDP gradient
    buffers (Megatron-LM's train_step order)."""

    def __init__(self, ddp_model: Any, optimizer: Any, accumulation: int, finish_grads: bool):
        self.ddp_model, self.optimizer, self.accumulation = ddp_model, optimizer, accumulation
        self.finish_grads = finish_grads
        self.micro_steps = 0

    def after_micro_step(self) -> None:
        from megatron.core.distributed import finalize_model_grads

        self.micro_steps += 1
        if self.micro_steps % self.accumulation:
            return
        if self.finish_grads:
            finalize_model_grads([self.ddp_model])
        self.optimizer.step()
        self.ddp_model.zero_grad_buffer()
        self.optimizer.zero_grad()


def prepare(model: nn.Module, block_type: type[nn.Module], cell: CellSpec, env: DistEnv) -> Prepared:
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from transformers import PreTrainedModel  # loaded with the model already; a registry lookup need not

    # combination_problem admits the gpt2 and llama layouts only, which transformers builds.
    if not isinstance(model, PreTrainedModel):
        raise TypeError(f"{type(model).__name__}: megatron copies the weights of a transformers causal LM"
                        f" ({' or '.join(LAYOUTS)} layout)")
    spec = cell.model_spec
    tp, pp = cell.strategy.layout("tp_degree"), cell.strategy.layout("pp_degree")
    use_layout(tp, pp)
    _seed_rng_tracker(cell.seed)
    config = transformer_config(spec, model.config, tp, pp, cell.strategy.checkpointing)
    gpt = build_gpt_model(spec, model.config, config)
    copy_hf_weights(model, gpt, spec, parallel_state.get_tensor_model_parallel_rank(), tp)
    gpt = gpt.to(env.device)
    ddp_model = DistributedDataParallel(
        config, DistributedDataParallelConfig(use_distributed_optimizer=True, grad_reduce_in_fp32=True), gpt)
    # What the pipeline schedule calls around and after its backwards (as Megatron-LM sets them):
    # no reductions until the last micro-batch, then the data-parallel reduction and the tied
    # embeddings' all-reduce.
    config.no_sync_func = ddp_model.no_sync
    config.finalize_model_grads_func = finalize_model_grads
    # torch.optim.AdamW's defaults, as the reference; {} overrides: weight decay on every
    # parameter (Megatron's default skips biases and norms), and no gradient clipping.
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=cell.lr, weight_decay=0.01, adam_beta1=0.9, adam_beta2=0.999,
                        adam_eps=1e-8, clip_grad=0.0, use_distributed_optimizer=True),
        [ddp_model], config_overrides={})
    holds_loss = parallel_state.is_pipeline_last_stage()
    pipeline = _PipelineStep(ddp_model, cell, holds_loss) if pp > 1 else None
    stepper = _OptimizerStepper(ddp_model, optimizer, cell.strategy.accumulation, finish_grads=pipeline is None)
    buffers = ddp_model.buffers + ddp_model.expert_parallel_buffers
    return Prepared(
        model=MegatronCausalLM(ddp_model),
        optimizer=_torch_optimizer(optimizer),
        no_sync=ddp_model.no_sync,
        use_autocast=False,  # fp32 only (CAPABILITIES)
        backward=lambda loss: loss.backward(),
        after_micro_step=stepper.after_micro_step,
        memory_module=gpt,
        # The contiguous gradient (and, with the distributed optimizer, parameter) buffers.
        memory_held=lambda: [t for b in buffers for t in (b.grad_data, b.param_data) if t is not None],
        # The ranks of a data-parallel group (its tensor-parallel ranks and pipeline stages)
        # take the same samples.
        data_rank=parallel_state.get_data_parallel_rank(),
        forward_backward=pipeline,
        holds_loss=holds_loss,
    )


def _layout_problem(cell: CellSpec) -> str | None:
    """world_size = tp_degree × pp_degree × data-parallel size (at least 1), and a layer or
    more per pipeline stage."""
    tp, pp = cell.strategy.layout("tp_degree"), cell.strategy.layout("pp_degree")
    if cell.world_size % (tp * pp):
        return (f"world_size={cell.world_size} with megatron tp_degree={tp} × pp_degree={pp}: the world size must"
                f" be a multiple of tp_degree × pp_degree ({tp * pp}, {2 * tp * pp}, ...)")
    n_layers = cell.model_spec.n_layers
    if pp > n_layers:
        return f"pp_degree={pp} with model {cell.model_name}: more pipeline stages than its {n_layers} layers"
    return None


def _pipelined(spec: StrategySpec) -> bool:
    return spec.layout("pp_degree") > 1


def _layout_families(spec: StrategySpec) -> tuple[str, ...]:
    """tp where it splits the layers, pp where it pipelines them."""
    degrees = (("tp", spec.layout("tp_degree")), ("pp", spec.layout("pp_degree")))
    return tuple(family for family, degree in degrees if degree > 1)


STRATEGIES = (
    Strategy(
        name="megatron", summary="Megatron-core GPTModel in tp_degree × pp_degree × data parallel (CUDA only)",
        engine="megatron", layout_families=_layout_families,
        # No pipeline unless asked; its pipeline cuts a step into 4 micro-batches unless asked.
        options={"tp_degree": 2, "pp_degree": 1, "pp_microbatches": 4},
        pipelined=_pipelined, pipelined_when="megatron with pp_degree > 1", capabilities=CAPABILITIES,
        combination_problem=combination_problem, layout_problem=_layout_problem,
        unsupported_reason=unsupported_reason, engine_model=EngineModel(analytic="megatron"), prepare=prepare,
    ),
)
