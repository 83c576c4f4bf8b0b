"""Megatron-core: its GPTModel split by its tensor parallelism, wrapped in its
DistributedDataParallel, stepped by its distributed optimizer (get_megatron_optimizer with
use_distributed_optimizer).

Parallel layout: tensor parallel over every rank (TP = world size), no pipeline (PP = 1). A
StrategySpec option for the TP and PP sizes does not exist yet, so the data-parallel size is
1: Megatron's DDP reduces gradients over a group of one rank and its distributed optimizer
shards its state over that one rank. They run (their buffers, hooks and copies are measured),
but shard nothing until TP/PP sizes become options.

Equivalence: GPTModel is not the HF model, so the harness's HF model is not trained here.
Instead its weights are copied into a GPTModel of the same sizes (``copy_hf_weights``: each
tensor-parallel rank takes its slice, in Megatron's layouts: q/k/v interleaved per query
group, SwiGLU's gate and up halves per rank), and the model computes the same function: GPT-2
as LayerNorm + tanh-GELU + learned positions + tied head, Llama as RMSNorm + SwiGLU + RoPE +
grouped-query attention. The loss is HF's: the mean next-token cross-entropy over the
seq_len - 1 predicted positions. So the single reference stays the one-process HF run of the
cell (CellSpec.reference) and the gate compares as for any other strategy. Megatron's local
layer spec computes attention unfused (DotProductAttention: baddbmm, softmax, bmm): HF's
"eager", so a megatron cell must say attention="eager" (its reference then runs eager too).
Transformer Engine's spec (fused attention, fused norms) is not wired.

Why not on the CPU (read in megatron-core 0.16.1's source; building GPTModel with
use_cpu_initialization=True does work there, which is how copy_hf_weights is tested):
- attention buffers: DotProductAttention.forward takes its score buffer from
  parallel_state.get_global_memory_buffer(), whose GlobalMemoryBuffer.get_tensor allocates on
  torch.cuda.current_device() (core/utils.py), and the causal mask comes from
  get_default_causal_mask, built with device="cuda" (core/transformer/utils.py);
- RNG tracker: the same forward forks tensor_parallel.get_cuda_rng_tracker() around the
  attention dropout (at p=0 too); CudaRNGStatesTracker saves and sets torch.cuda RNG states
  (core/tensor_parallel/random.py), and model_parallel_cuda_manual_seed seeds it with
  torch.cuda.manual_seed;
- DDP: _ParamAndGradBuffer allocates its grad_data / param_data on
  torch.cuda.current_device() (core/distributed/param_and_grad_buffer.py);
- optimizers: FP32Optimizer and MixedPrecisionOptimizer make their scale / found-inf tensors
  with device='cuda' (core/optimizer/optimizer.py), and DistributedOptimizer raises TypeError
  for a parameter that is not a torch.cuda.{Float,Half,BFloat16}Tensor
  (core/optimizer/distrib_optimizer.py).

megatron-core is an optional extra: ``pip install megatron-core`` (0.16.1 on Python 3.11;
0.17 and later need Python 3.12). Its only install-time requirements are torch, numpy and
packaging; Apex and Transformer Engine are optional (without them it falls back to torch
norms and torch.optim.AdamW, and warns).
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn
from transformers.modeling_outputs import CausalLMOutput

from harness.config import CellSpec
from harness.distributed import DistEnv
from harness.models.presets import get_preset
from harness.models.spec import ModelSpec
from harness.strategies.base import Capabilities, Prepared

INSTALL = "pip install megatron-core"
FAMILIES = ("gpt2", "llama")

CAPABILITIES = Capabilities(
    precisions=frozenset({"fp32"}),
    checkpointing=frozenset({"none", "full"}),
    notes={
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
    " torch.cuda.current_device(), and its optimizers make device='cuda' tensors (DistributedOptimizer"
    " refuses parameters that are not torch.cuda tensors)"
)


def unsupported_reason(cell: CellSpec, device_type: str) -> str | None:
    if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
        return f"megatron-core is not installed: {INSTALL}"
    if device_type != "cuda":
        return CPU_REASON
    return None


def combination_problem(cell: CellSpec) -> str | None:
    """Cells GPTModel with tensor parallel over every rank cannot express exactly."""
    spec = get_preset(cell.model)
    if spec.family not in FAMILIES:
        return f"model {cell.model}: Megatron's GPTModel is built here for {', '.join(FAMILIES)} only"
    if cell.attention != "eager":
        return (f"attention={cell.attention}: Megatron-core's local layer spec computes attention unfused"
                " (DotProductAttention), which is HF's eager; set attention='eager'")
    tp = cell.world_size
    sizes = {"n_heads": spec.n_heads, "n_kv_heads": spec.kv_heads, "ffn": spec.ffn, "vocab_size": spec.vocab_size}
    for name, size in sizes.items():
        if size % tp:
            # Padding the vocabulary would add logits the reference does not have.
            return (f"model {cell.model}: {name}={size} is not divisible by the tensor-parallel size"
                    f" {tp} (= world_size)")
    return None


@functools.cache
def _initialize_model_parallel(world_size: int) -> None:
    """Megatron's process groups, once per worker process: re-creating them inside a
    long-lived worker hangs, and a second call refuses ("already initialized")."""
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world_size, pipeline_model_parallel_size=1)


def _seed_rng_tracker(seed: int) -> None:
    """Megatron's CUDA RNG tracker, which its attention forks: reset to the cell's seed for
    every cell (each call replaces the tracker's states)."""
    from megatron.core import tensor_parallel

    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def transformer_config(spec: ModelSpec, hf_config, tp_size: int, checkpointing: str = "none"):
    """A TransformerConfig with the HF model's sizes and maths (module docstring)."""
    from megatron.core.transformer import TransformerConfig

    common = dict(
        num_layers=spec.n_layers, hidden_size=spec.hidden, num_attention_heads=spec.n_heads,
        num_query_groups=spec.kv_heads, ffn_hidden_size=spec.ffn,
        tensor_model_parallel_size=tp_size, pipeline_model_parallel_size=1,
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
    if spec.family == "gpt2":
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


def build_gpt_model(spec: ModelSpec, hf_config, config) -> nn.Module:
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    llama = spec.family == "llama"
    with torch.random.fork_rng(devices=[]):  # its throw-away init must not move the caller's RNG
        return GPTModel(
            config=config,
            transformer_layer_spec=get_gpt_layer_local_spec(normalization=config.normalization),
            vocab_size=spec.vocab_size,
            max_sequence_length=spec.seq_len,
            share_embeddings_and_output_weights=spec.tie_embeddings if llama else True,  # GPT-2 always ties
            position_embedding_type="rope" if llama else "learned_absolute",
            rotary_base=int(hf_config.rope_parameters["rope_theta"]) if llama else 10000,
        )


def _interleave_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: int) -> torch.Tensor:
    """[q; k; v] stacked by kind -> Megatron's per-group layout: for each query group its
    query heads, then its key head, then its value head (so a column split gives each
    tensor-parallel rank whole groups)."""
    def by_group(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(groups, -1, *t.shape[1:])

    return torch.cat([by_group(q), by_group(k), by_group(v)], dim=1).reshape(-1, *q.shape[1:])


def _gpt2_tensors(hf: nn.Module, spec: ModelSpec) -> Iterator[tuple[str, torch.Tensor]]:
    """(Megatron name, full tensor) for GPT-2. HF's Conv1D stores weights as [in, out]."""
    t = hf.transformer
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


def _llama_tensors(hf: nn.Module, spec: ModelSpec) -> Iterator[tuple[str, torch.Tensor]]:
    """(Megatron name, full tensor) for Llama; linear_fc1 is [gate; up] before the rank split."""
    m = hf.model
    yield "embedding.word_embeddings.weight", m.embed_tokens.weight
    for i, layer in enumerate(m.layers):
        p = f"decoder.layers.{i}."
        a, mlp = layer.self_attn, layer.mlp
        yield p + "input_layernorm.weight", layer.input_layernorm.weight
        yield p + "self_attention.linear_qkv.weight", _interleave_qkv(
            a.q_proj.weight, a.k_proj.weight, a.v_proj.weight, spec.kv_heads)
        yield p + "self_attention.linear_proj.weight", a.o_proj.weight
        yield p + "pre_mlp_layernorm.weight", layer.post_attention_layernorm.weight
        yield p + "mlp.linear_fc1.weight", torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])
        yield p + "mlp.linear_fc2.weight", mlp.down_proj.weight
    yield "decoder.final_layernorm.weight", m.norm.weight
    if not spec.tie_embeddings:
        yield "output_layer.weight", hf.lm_head.weight


def _rank_slice(full: torch.Tensor, param: nn.Parameter, tp_rank: int, tp_size: int) -> torch.Tensor:
    """This rank's part of a full tensor, split where Megatron splits the parameter."""
    if not getattr(param, "tensor_model_parallel", False):
        return full  # replicated: norms, position embeddings, row-parallel biases
    return full.chunk(tp_size, dim=param.partition_dim)[tp_rank]


@torch.no_grad()
def copy_hf_weights(hf: nn.Module, gpt: nn.Module, spec: ModelSpec, tp_rank: int, tp_size: int) -> None:
    """Overwrite every parameter of ``gpt`` (this tensor-parallel rank's shard) with the HF
    model's weights; a parameter left unset or a shape that does not fit is an error."""
    tensors = _gpt2_tensors(hf, spec) if spec.family == "gpt2" else _llama_tensors(hf, spec)
    params = dict(gpt.named_parameters())
    glu = gpt.config.gated_linear_unit
    unset = set(params)
    for name, full in tensors:
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



class MegatronCausalLM(nn.Module):
    """The worker's loss path for a GPTModel: ``forward(input_ids, labels)`` returns an
    output whose ``loss`` is HF's causal-LM loss, so ``built.loss`` serves it unchanged."""

    def __init__(self, gpt: nn.Module):
        super().__init__()
        self.gpt = gpt

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> CausalLMOutput:
        batch, seq = input_ids.shape
        position_ids = torch.arange(seq, device=input_ids.device).expand(batch, seq)
        # Megatron's labels are each position's target; HF shifts inside its model. The last
        # position has no next token (its rolled-in target is dropped below), as in HF.
        per_token = self.gpt(input_ids=input_ids, position_ids=position_ids, attention_mask=None,
                             labels=labels.roll(-1, dims=1))
        return CausalLMOutput(loss=per_token[:, :-1].mean())


def _torch_optimizer(megatron_optimizer) -> torch.optim.Optimizer:
    """The torch optimizer inside get_megatron_optimizer's ChainedOptimizer (one dense group)."""
    (inner,) = megatron_optimizer.chained_optimizers
    return inner.optimizer


class _OptimizerStepper:
    """Megatron's end of an optimizer step, after the last micro-step's backward: finish the
    gradient reduction, step, zero the DDP gradient buffers (Megatron-LM's train_step order)."""

    def __init__(self, ddp_model, optimizer, accumulation: int):
        self.ddp_model, self.optimizer, self.accumulation = ddp_model, optimizer, accumulation
        self.micro_steps = 0

    def after_micro_step(self) -> None:
        self.micro_steps += 1
        if self.micro_steps % self.accumulation:
            return
        self.ddp_model.finish_grad_sync()
        self.optimizer.step()
        self.ddp_model.zero_grad_buffer()
        self.optimizer.zero_grad()


def prepare(model: nn.Module, block_type: type[nn.Module], cell: CellSpec, env: DistEnv) -> Prepared:
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    spec = get_preset(cell.model)
    _initialize_model_parallel(env.world_size)
    _seed_rng_tracker(cell.seed)
    config = transformer_config(spec, model.config, env.world_size, cell.strategy.checkpointing)
    gpt = build_gpt_model(spec, model.config, config)
    copy_hf_weights(model, gpt, spec, parallel_state.get_tensor_model_parallel_rank(), env.world_size)
    gpt = gpt.to(env.device)
    ddp_model = DistributedDataParallel(
        config, DistributedDataParallelConfig(use_distributed_optimizer=True, grad_reduce_in_fp32=True), gpt)
    # torch.optim.AdamW's defaults, as the reference; {} overrides: weight decay on every
    # parameter (Megatron's default skips biases and norms), and no gradient clipping.
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=cell.lr, weight_decay=0.01, adam_beta1=0.9, adam_beta2=0.999,
                        adam_eps=1e-8, clip_grad=0.0, use_distributed_optimizer=True),
        [ddp_model], config_overrides={})
    stepper = _OptimizerStepper(ddp_model, optimizer, cell.strategy.accumulation)
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
        data_rank=0,  # every rank takes the same samples: the model is split, not the batch
    )
