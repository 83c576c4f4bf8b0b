"""Activation memory of a transformer layer (Korthikanti et al. 2022)."""

from __future__ import annotations

# s·b·ffn-wide tensors an MLP keeps for backward, by how its activation is computed.
_MLP_KEPT = {"relu": 1, "gelu": 2, "swiglu": 4, "gelu_tanh_unfused": 5, "swiglu_clamped": 7}


def activation_bytes_per_layer(seq: int, batch: int, hidden: int, heads: int, *, ffn: int | None = None,
                               mlp: str = "gelu", value_bytes: int = 2, dropout: bool = True,
                               fused_attention: bool = False, checkpointing: str = "none",
                               tensor_parallel: int = 1, sequence_parallel: bool = False,
                               kv_heads: int | None = None, experts_per_token: int = 1,
                               router_experts: int = 0, norm_bytes: float | None = None,
                               input_copies: tuple[int, int] = (1, 1), attention_width: int | None = None,
                               mlp_value_bytes: int | None = None, norms: int = 2,
                               score_bytes: float | None = None, value_width: int | None = None,
                               gathered_inputs_kept: bool = False) -> float:
    """Activation bytes one transformer layer keeps for backward.

    Korthikanti et al. 2022, §4.1-4.2 (Table 2), for a GPT layer with 16-bit values
    (``value_bytes=2``) and 1-byte dropout masks:
      attention 11sbh + 5as²b: QKV input 2sbh, Q and K 4sbh, softmax output 2as²b, its
        dropout mask as²b and output 2as²b, V 2sbh, projection input 2sbh, dropout mask sbh;
      MLP 19sbh: input 2sbh, GeLU input 8sbh and output 8sbh (4h wide), dropout mask sbh;
      two LayerNorm inputs 4sbh;
    in all s·b·h·(34 + 5·a·s/h). Generalised here, each term as the paper derives it:
      - ``value_bytes`` for every stored value (4 for fp32 activations); masks stay 1 byte;
      - ``dropout=False`` drops the masks and the dropout outputs (the models here train
        without dropout): attention 10sbh + 2as²b, MLP 18sbh;
      - ``ffn`` (default 4h) widens the MLP terms; ``mlp="swiglu"`` (LLaMA) keeps the gate
        and up projections' outputs, the SiLU output and their product (4 × s·b·ffn) where
        GeLU keeps 2 (``mlp="relu"`` 1: ReLU's backward reads its output, which the second
        matmul keeps as its input anyway: OPT's); ``mlp="gelu_tanh_unfused"``, the tanh GeLU written as separate tensor
        ops (transformers' NewGELUActivation, GPT-2's), keeps 5: its input, the tanh output,
        0.5·x and 1 + tanh (the operands of its last multiply), and its output;
        ``mlp="swiglu_clamped"``, gpt-oss's experts, keeps 7: the fused gate and up
        projections' output (2), the clamped gate, its sigmoid, their product, the clamped up
        projection plus one, and the product of the two;
      - ``fused_attention`` (flash / SDPA kernels) keeps no s×s score matrix: the a·s² terms
        vanish (the kernel's per-row statistics, 4·a·s·b bytes, are kept instead);
      - ``checkpointing="full"``: only the layer input, 2sbh (§4.3); "selective": the
        paper's selective recompute, the attention core (the a·s² terms) recomputed from
        the kept Q, K, V, leaving 34sbh with dropout;
      - ``tensor_parallel=t`` divides the terms computed inside the TP region (24sbh and
        the score terms) by t; ``sequence_parallel`` also the LayerNorm and dropout terms
        and the inputs of the QKV and first MLP matmuls (the remaining 10sbh), giving the
        table's 34sbh/t, for Megatron re-gathers those inputs in backward;
        ``gathered_inputs_kept``: the matmuls keep their all-gathered inputs whole instead
        (torch's DTensor sequence parallelism), so 4sbh of the 10 stay undivided;
      - ``kv_heads`` (grouped-query attention, Ainslie et al. 2023; multi-query, Shazeer
        2019): K and V are kv_heads/heads as wide as Q, so their terms (2sbh of the paper's
        Q, K and V 6sbh at 2 bytes) scale by kv_heads/heads;
      - ``experts_per_token=k`` (a mixture of experts routing every token to k experts, no
        token dropped: Mixtral, Jiang et al. 2024) keeps the MLP terms k times, and
        ``router_experts=E`` adds the router's fp32 logits, 4·s·b·E, and what routing keeps
        per routed copy of a token: its input gathered for its expert and the expert's
        output before its routing weight multiplies it, 2·k·sbh (transformers' grouped-matmul
        Mixtral experts, measured);
      - ``norm_bytes``: what each of the two norms keeps per element of its input, where
        that is not one ``value_bytes`` value (measured for the models here: models.NormKeeps);
      - ``input_copies``: how many copies of the attention's and of the MLP's input the
        layer keeps: one, unless torch autocast casts it once for each linear layer that reads
        it (it caches the weights' casts, not the activations'): LLaMA's separate q, k, v
        and gate, up projections keep (3, 2) under bf16 or fp16 autocast;
      - ``attention_width``: the heads' total width, heads × head width, where a config sets
        its head width apart from hidden / heads (Qwen3, Gemma): Q, the attention's output
        and (by ``kv_heads``) K and V are that wide, not h;
      - ``value_width``: V's and the attention output's width where it is not Q's and K's
        (multi-head latent attention, DeepSeek-V2: value heads narrower than query heads);
      - ``mlp_value_bytes``: the MLP terms' value bytes where they are not ``value_bytes``
        (a mixture of experts whose grouped matmul autocast does not cast: its experts
        compute in the fp32 of the residual stream under bf16 autocast);
      - ``norms``: the layer's norms, each keeping ``norm_bytes`` an element of its s·b·h
        input (two in the paper; Gemma2 and Gemma3 norm each sublayer's input and output);
      - ``score_bytes``: what unfused attention keeps per score, where it is not one value
        (under autocast the softmax runs in fp32 and the matmul after it takes a 16-bit copy:
        4 + 2; Gemma2 soft-caps the scores with a tanh, which keeps its output too).
    With every default (GPT, 16-bit, dropout, unfused, no recompute, t = 1) this is exactly
    the paper's s·b·h·(34 + 5·a·s/h).
    Korthikanti's "selective" is not the harness's selective policy (which saves every
    matmul and attention output): the formula is reported beside the measurement, not as
    its prediction.
    """
    if checkpointing not in ("none", "full", "selective"):
        raise ValueError(f"checkpointing={checkpointing!r}: choose none, full or selective")
    if mlp not in _MLP_KEPT:
        raise ValueError(f"mlp={mlp!r}: choose one of {', '.join(_MLP_KEPT)}")
    s, b, h, a, t = seq, batch, hidden, heads, tensor_parallel
    f = ffn or 4 * h
    v, mask = value_bytes, (1 if dropout else 0)
    sbh = s * b * h
    if checkpointing == "full":
        return v * sbh / (t if sequence_parallel else 1)
    kv_share = (kv_heads or a) / a
    heads_wide = s * b * (attention_width or h)  # Q's elements, and the attention output's
    # Inside the tensor-parallel region (divided by t).
    qk = v * heads_wide * (1 + kv_share)  # Q and K, the inputs of the score matmul
    values_wide = s * b * (value_width or attention_width or h)
    value_in = v * values_wide * kv_share  # V
    proj_in = v * values_wide  # input of the output projection
    if fused_attention:
        scores = 4.0 * a * s * b  # the kernel's fp32 log-sum-exp per row, no s×s matrix
    elif checkpointing == "selective":
        scores = 0.0  # the attention core is recomputed from Q, K, V
    else:  # softmax output; with dropout also its mask and output
        scores = ((v if score_bytes is None else score_bytes) + (1 + v if dropout else 0)) * a * s * s * b
    mlp_v = mlp_value_bytes or v
    mlp_kept = _MLP_KEPT[mlp] * mlp_v * s * b * f * experts_per_token
    if router_experts:
        mlp_kept += 2 * mlp_v * sbh * experts_per_token
    inside = qk + value_in + proj_in + scores + mlp_kept
    # Outside it (divided by t only with sequence parallelism): the inputs of the QKV and
    # the first MLP matmul, the two LayerNorm inputs, the two dropout masks.
    # The router (replicated, like the LayerNorms) keeps its fp32 logits.
    norm = v if norm_bytes is None else norm_bytes
    attention_in, mlp_in = input_copies
    region_inputs = attention_in * v * sbh + mlp_in * v * sbh
    outside = norms * norm * sbh + 2 * mask * sbh + 4.0 * s * b * router_experts
    sliced = t if sequence_parallel else 1
    return inside / t + outside / sliced + region_inputs / (1 if gathered_inputs_kept else sliced)
