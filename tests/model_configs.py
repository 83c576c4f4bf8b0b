"""Tiny transformers config.json files of architectures beyond the built-in families, for the
tests of models-as-data (tests/test_model_sources.py, tests/test_model_configs_run.py).

Each entry: the config's keys (as a user's config.json has them), the layout the harness must
recognise (None: not one the layout-dependent strategies are written for), and the task.
"""

from __future__ import annotations

import json
from pathlib import Path

_TEXT = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 512}

CONFIGS: dict[str, dict] = {
    # LLaMA-style decoders: the tensor-parallel plan and the pipeline split apply.
    "mistral": {"model_type": "mistral", "architectures": ["MistralForCausalLM"], **_TEXT,
                "intermediate_size": 128, "num_key_value_heads": 2, "max_position_embeddings": 64,
                "sliding_window": None},
    "qwen2": {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], **_TEXT,
              "intermediate_size": 128, "num_key_value_heads": 2, "max_position_embeddings": 64,
              "tie_word_embeddings": True, "attention_dropout": 0.1},
    # Heads wider than hidden / heads (32 against 16), each head's queries and keys normalised
    # (q_norm, k_norm): Qwen3's attention, which Gemma's head width and Gemma3's norms share.
    "qwen3": {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], **_TEXT,
              "intermediate_size": 128, "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 64,
              "tie_word_embeddings": True},
    # Other decoders: the data-parallel strategies take them, the layout ones refuse them.
    # GLM-4.5's first block is a dense LLaMA block, the next a mixture of experts with a shared
    # one (DeepSeek's arrangement): no layout describes both.
    "glm4_moe": {"model_type": "glm4_moe", "architectures": ["Glm4MoeForCausalLM"], **_TEXT,
                 "intermediate_size": 128, "moe_intermediate_size": 32, "num_key_value_heads": 2,
                 "n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2,
                 "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1, "max_position_embeddings": 64},
    "gpt_neox": {"model_type": "gpt_neox", "architectures": ["GPTNeoXForCausalLM"], **_TEXT,
                 "intermediate_size": 256, "max_position_embeddings": 64, "rotary_pct": 0.25,
                 "hidden_dropout": 0.1},
    "opt": {"model_type": "opt", "architectures": ["OPTForCausalLM"], **_TEXT, "ffn_dim": 256,
            "word_embed_proj_dim": 64, "max_position_embeddings": 64, "dropout": 0.1},
    "phi": {"model_type": "phi", "architectures": ["PhiForCausalLM"], **_TEXT, "intermediate_size": 256,
            "max_position_embeddings": 64, "partial_rotary_factor": 0.5},
    # An encoder (masked LM) and an image classifier.
    "roberta": {"model_type": "roberta", "architectures": ["RobertaForMaskedLM"], **_TEXT,
                "intermediate_size": 256, "max_position_embeddings": 66, "hidden_dropout_prob": 0.1},
    "deit": {"model_type": "deit", "architectures": ["DeiTForImageClassification"], "hidden_size": 64,
             "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128, "image_size": 32,
             "patch_size": 8, "num_labels": 10},
}
LAYOUTS = {"mistral": "llama", "qwen2": "llama", "qwen3": "llama", "glm4_moe": None, "gpt_neox": None, "opt": None,
           "phi": None, "roberta": None, "deit": None}
TASKS = {"roberta": "masked_lm", "deit": "image_classification"}  # the rest: causal_lm
LLAMA_LIKE = tuple(name for name, layout in LAYOUTS.items() if layout == "llama")
OWN_HEAD_WIDTH = ("qwen3",)  # Megatron's GPTModel, as built here, refuses it


def write(folder: Path, name: str, **changes: object) -> Path:
    """``name``'s config.json (with ``changes``) in ``folder``/``name``/."""
    path = folder / name / "config.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**CONFIGS[name], **changes}, indent=2))
    return path


# Text models users bring, by what sets their activations apart (tests/test_model_sources.py
# holds the analytic peak of each against its trace): LLaMA's blocks; Qwen3's and Gemma's own head
# width and Qwen3's and OLMo2's query-key norms; Gemma2's four norms a block and soft-capped
# scores and logits (eager only); Phi-3's fused projections; mixtures of experts named the
# Mixtral, Qwen and OLMoE ways, Qwen2-MoE's with a shared expert, DeepSeek's and GLM-4.5's
# after dense first blocks, gpt-oss's clamped experts; a sliding window shorter than the
# sequence (Mistral's on every block, Gemma3's on those its layer_types names), for which
# transformers hands SDPA a mask. Left out: Bloom (``UNCHECKED``).
_DECODER = {**_TEXT, "intermediate_size": 128, "num_key_value_heads": 2, "max_position_embeddings": 128}
# Bloom (ALiBi, eager attention only): 0.95 of its traced peak at its default 2,048 tokens, what
# its ALiBi attention holds beyond LLaMA's eager attention not counted: `plan` says it was never
# held against a trace.
UNCHECKED = {"bloom": {"architectures": ["BloomForCausalLM"]}}
_MOE = {"num_experts_per_tok": 2}
_DEEPSEEK_MOE = {"n_routed_experts": 4, "n_shared_experts": 1, "moe_intermediate_size": 32, "first_k_dense_replace": 1,
                 "n_group": 1, "topk_group": 1, **_MOE}
_LATENT = {"num_key_value_heads": 4, "q_lora_rank": 32, "kv_lora_rank": 16, "qk_nope_head_dim": 16,
           "qk_rope_head_dim": 8, "v_head_dim": 16}
PREDICTED_TEXT_MODELS: dict[str, dict] = {
    "llama": {"architectures": ["LlamaForCausalLM"]},
    "mistral": {"architectures": ["MistralForCausalLM"], "sliding_window": 64},
    "qwen2": {"architectures": ["Qwen2ForCausalLM"]},
    "qwen3": {"architectures": ["Qwen3ForCausalLM"], "head_dim": 32},
    "gemma": {"architectures": ["GemmaForCausalLM"], "head_dim": 32},
    "gemma2": {"architectures": ["Gemma2ForCausalLM"], "head_dim": 32, "sliding_window": 64,
               "query_pre_attn_scalar": 32},
    "gemma3_text": {"architectures": ["Gemma3ForCausalLM"], "head_dim": 32, "sliding_window": 64,
                    "query_pre_attn_scalar": 32},
    # Phi-3: one fused qkv_proj whose V, a view, keeps it whole beside grouped K; its rotary
    # embedding concatenates, so the kernel's output is copied for o_proj.
    "phi3": {"architectures": ["Phi3ForCausalLM"], "pad_token_id": 0},
    "olmo2": {"architectures": ["Olmo2ForCausalLM"]},
    "granite": {"architectures": ["GraniteForCausalLM"]},
    "starcoder2": {"architectures": ["Starcoder2ForCausalLM"]},
    # GPT-2 and OPT read from their own keys (n_embd, n_inner; ffn_dim): the LLaMA keys beside
    # them here, which their classes do not define and their models never read, must not be read
    # either. OPT's ReLU keeps its output alone.
    "gpt2": {"architectures": ["GPT2LMHeadModel"], "n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 128},
    "opt": {"architectures": ["OPTForCausalLM"], "ffn_dim": 128, "word_embed_proj_dim": 64},
    # Phi-2: attention and MLP side by side behind one LayerNorm, half the head's channels rotated.
    "phi": {"architectures": ["PhiForCausalLM"], "partial_rotary_factor": 0.5},
    # GPT-NeoX (Pythia): side by side behind a norm each, reading the same residual stream; one
    # fused QKV projection, whose output V keeps whole once Q and K are rotated.
    "gpt_neox": {"architectures": ["GPTNeoXForCausalLM"], "rotary_pct": 0.25},
    # OLMo: LayerNorms without weights, upcast to fp32 (what a norm keeps is measured).
    "olmo": {"architectures": ["OlmoForCausalLM"]},
    # GPT-J: attention and MLP side by side behind one LayerNorm, rotary on 8 of each head's 16
    # channels; StarCoder's GPT-BigCode: one key/value head in a fused c_attn; Nemotron: a
    # squared-ReLU MLP, half-rotary heads; Persimmon: per-head query and key LayerNorms over a
    # head's channels, beside the block's own.
    "gptj": {"architectures": ["GPTJForCausalLM"], "n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 128,
             "rotary_dim": 8},
    "gpt_bigcode": {"architectures": ["GPTBigCodeForCausalLM"], "n_embd": 64, "n_layer": 2, "n_head": 4,
                    "n_positions": 128, "multi_query": True},
    "nemotron": {"architectures": ["NemotronForCausalLM"], "partial_rotary_factor": 0.5},
    "persimmon": {"architectures": ["PersimmonForCausalLM"], "partial_rotary_factor": 0.5},
    # A masked LM: its embeddings' LayerNorm and its head's transform (RoBERTa's positions start
    # after the padding id, two more than the sequence).
    "roberta": {"architectures": ["RobertaForMaskedLM"], "max_position_embeddings": 130},
    # Attention and MLP side by side behind one LayerNorm written in torch ops (fp32 upcast).
    "cohere": {"architectures": ["CohereForCausalLM"]},
    # StableLM-2-12B's per-head query and key LayerNorms (one a head, over views of one tensor).
    "stablelm": {"architectures": ["StableLmForCausalLM"], "qk_layernorm": True},
    # Falcon-40B's arrangement (grouped key/value heads in one fused projection, attention and
    # MLP side by side): it hands SDPA a causal mask it has made, so transformers expands K and V
    # to every head and SDPA keeps an additive copy of the mask in every block.
    "falcon": {"architectures": ["FalconForCausalLM"], "new_decoder_architecture": True, "num_kv_heads": 2},
    "mixtral": {"architectures": ["MixtralForCausalLM"], "num_local_experts": 4, **_MOE},
    "qwen3_moe": {"architectures": ["Qwen3MoeForCausalLM"], "head_dim": 16, "num_experts": 4,
                  "moe_intermediate_size": 64, **_MOE},
    "olmoe": {"architectures": ["OlmoeForCausalLM"], "num_experts": 4, **_MOE},
    "qwen2_moe": {"architectures": ["Qwen2MoeForCausalLM"], "num_experts": 4, "moe_intermediate_size": 64,
                  "shared_expert_intermediate_size": 64, **_MOE},
    # DeepSeek's arrangement: a dense first block, then experts with a shared one; GLM-4.5's with
    # a partial rotary embedding, DeepSeek-V2's and V3's with latent attention whose query and
    # key heads are wider than its value heads (24 against 16; 192 against 128 at full size).
    "glm4_moe": {"architectures": ["Glm4MoeForCausalLM"], **_DEEPSEEK_MOE},
    "deepseek_v3": {"architectures": ["DeepseekV3ForCausalLM"], **_DEEPSEEK_MOE, **_LATENT},
    "deepseek_v2": {"architectures": ["DeepseekV2ForCausalLM"], **_DEEPSEEK_MOE, **_LATENT},
    # Checked as they came (2026-12, transformers 5.25), each within 1-3 % of its trace with
    # nothing added for it: ERNIE 4.5 and Seed-OSS, LLaMA's blocks; OLMo 3, Cohere2 and
    # EXAONE 4 with a window on their sliding blocks (OLMo2's, Cohere's and a QK-normed
    # block's); Arcee's ungated ReLU² MLP; IBM's GraniteMoE and Phi-3.5-MoE, routed experts.
    "ernie4_5": {"architectures": ["Ernie4_5ForCausalLM"]},
    "seed_oss": {"architectures": ["SeedOssForCausalLM"]},
    "olmo3": {"architectures": ["Olmo3ForCausalLM"], "sliding_window": 64},
    "cohere2": {"architectures": ["Cohere2ForCausalLM"], "sliding_window": 64},
    "exaone4": {"architectures": ["Exaone4ForCausalLM"], "sliding_window": 64},
    "arcee": {"architectures": ["ArceeForCausalLM"]},
    "granitemoe": {"architectures": ["GraniteMoeForCausalLM"], "num_local_experts": 4, **_MOE},
    "phimoe": {"architectures": ["PhimoeForCausalLM"], "num_local_experts": 4, **_MOE},
    # gpt-oss: experts that clamp their gate and up projections, attention sinks (eager only).
    "gpt_oss": {"architectures": ["GptOssForCausalLM"], "num_local_experts": 4, "head_dim": 16, "sliding_window": 64,
                "attn_implementation": "eager", **_MOE},
}
