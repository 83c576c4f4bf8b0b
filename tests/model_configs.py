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
LAYOUTS = {"mistral": "llama", "qwen2": "llama", "qwen3": "llama", "gpt_neox": None, "opt": None, "phi": None,
           "roberta": None, "deit": None}
TASKS = {"roberta": "masked_lm", "deit": "image_classification"}  # the rest: causal_lm
LLAMA_LIKE = tuple(name for name, layout in LAYOUTS.items() if layout == "llama")
OWN_HEAD_WIDTH = ("qwen3",)  # Megatron's GPTModel, as built here, refuses it


def write(folder: Path, name: str, **changes: object) -> Path:
    """``name``'s config.json (with ``changes``) in ``folder``/``name``/."""
    path = folder / name / "config.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**CONFIGS[name], **changes}, indent=2))
    return path
