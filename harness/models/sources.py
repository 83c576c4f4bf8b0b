"""Where a cell's model comes from: a preset's name, a transformers config.json (with
overrides of its own keys), or a factory of one's own, resolved here once into the ModelSpec
a cell carries.

    resolve("gpt2-124m")                                  -> "gpt2-124m" (a preset, by name)
    resolve("configs/mistral.json")                       -> ModelSpec(family="hf_config", ...)
    resolve({"config": "configs/mistral.json", "num_hidden_layers": 4})
    resolve("mypackage.models:tiny")                      -> ModelSpec(family="factory", ...)

A config is read as it is on disk: nothing is downloaded and no remote code runs (a config
whose ``auto_map`` names remote code is refused). Its sizes are read through transformers'
own config class (AutoConfig.for_model), its layout and parameter count from a build on the
meta device. The resolved config, kept whole in the ModelSpec and so in every record, is the
file's keys with the overrides applied, dropout probabilities set to 0 (dropout draws from
each rank's RNG, which would break the equivalence with the one-process reference) and
``use_cache`` off (a KV cache is for generation). The cell id names it
``{model_type}-{size}-{hash}``: its parameters, and 6 hex digits of the resolved config.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib
import inspect
import json
import re
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .presets import PRESETS
from .spec import ModelSpec, Task, TransformersConfig

# Which task an architecture's class name says it is trained for.
_TASK_BY_SUFFIX: tuple[tuple[str, Task], ...] = (
    ("ForCausalLM", "causal_lm"), ("LMHeadModel", "causal_lm"),
    ("ForMaskedLM", "masked_lm"), ("ForImageClassification", "image_classification"),
)
# A config with no ``architectures`` entry is a causal LM (the common case), as
# AutoModelForCausalLM would build it; give ``architectures`` for another task.
_DEFAULT_TASK: Task = "causal_lm"
# A config's model is trained by default at the largest power of two within its
# max_position_embeddings (RoBERTa's 514 counts its padding offset: 512), at most this (a
# config may allow 128k tokens): a cell's seq_len sets another.
DEFAULT_SEQ_LEN = 2048
CONFIG_KEY = "config"


def resolve(model: str | dict[str, Any], where: str = "model") -> str | ModelSpec:
    """A preset's name as it is, or the ModelSpec of a config file (``where`` names the
    option in the messages: ``--model``, ``cells[2].model``)."""
    if isinstance(model, dict):
        overrides = dict(model)
        path = overrides.pop(CONFIG_KEY, None)
        if not isinstance(path, str):
            raise ValueError(f"{where}: a table names its config.json as {CONFIG_KEY} = \"path/to/config.json\","
                             " its other keys override the config's own")
        return _resolve_config(path, json.dumps(overrides, sort_keys=True), where)
    if not isinstance(model, str):
        raise ValueError(f"{where}={model!r}: a preset's name, a config.json path, or a table with {CONFIG_KEY}")
    if model in PRESETS:
        return model
    if model.endswith(".json") or Path(model).is_file():
        return _resolve_config(model, "{}", where)
    if ":" in model:
        return _resolve_factory(model, where)
    raise ValueError(f"{where}: unknown model {model!r}: not a preset ({', '.join(PRESETS)}), a config.json file"
                     " nor a package.module:function factory")


def at_depth(spec: ModelSpec, n_layers: int) -> ModelSpec:
    """``spec`` with ``n_layers`` repeated blocks and all else kept, a config's re-resolved
    (a plan traces a real model's first blocks: predict/plan_work.py); ValueError for a
    factory's model, whose depth is its code's."""
    if spec.family == "factory":
        raise ValueError(f"{spec.name}: a factory's model has the depth its code gives it")
    if spec.hf is None:
        return dataclasses.replace(spec, n_layers=n_layers, name=f"{spec.name}-{n_layers}-blocks")
    config = json.loads(spec.hf.config_json) | {"num_hidden_layers": n_layers}
    if isinstance(config.get("layer_types"), list):
        # One attention type per layer (Gemma2's sliding and full in turn, Qwen3's): the first
        # blocks' own.
        config["layer_types"] = config["layer_types"][:n_layers]
    return _spec(spec.hf.source, spec.hf.model_type, spec.hf.task, config, spec.name)


@functools.cache
def _resolve_config(path: str, overrides_json: str, where: str) -> ModelSpec:
    file = Path(path)
    try:
        config = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError) as error:
        raise ValueError(f"{where}={path}: cannot read it ({error})") from None
    except json.JSONDecodeError as error:
        raise ValueError(f"{where}={path}: not valid JSON: {error}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{where}={path}: a config.json holds one JSON object")
    overrides = json.loads(overrides_json)
    unknown = sorted(set(overrides) - set(config))
    if unknown:
        raise ValueError(f"{where}={path}: override(s) {', '.join(unknown)} are not keys of the config;"
                         f" override the config's own keys only")
    config |= overrides
    _refuse_remote_code(config, path, where)
    model_type = config.get("model_type")
    if not isinstance(model_type, str):
        raise ValueError(f"{where}={path}: no model_type: a transformers config.json names its model_type")
    _check_known(model_type, path, where)
    _refuse_multimodal(config, model_type, path, where)
    task = _task(config, path, where)
    _check_task_class(model_type, task, path, where)
    config = _for_training(_with_defaults(config, path, where))
    return _spec(path, model_type, task, config, where)


def _refuse_remote_code(config: dict[str, Any], path: str, where: str) -> None:
    if "auto_map" in config:
        raise ValueError(f"{where}={path}: its auto_map names code outside transformers ({config['auto_map']});"
                         " shardbench runs no remote code: use a model type transformers has, or a factory")


def _check_known(model_type: str, path: str, where: str) -> None:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    if model_type not in CONFIG_MAPPING_NAMES:
        raise ValueError(f"{where}={path}: model_type={model_type!r} is not one this transformers knows"
                         " (a newer transformers, or remote code, which shardbench does not run)")


def _refuse_multimodal(config: dict[str, Any], model_type: str, path: str, where: str) -> None:
    """A composite config (Gemma 3, Llama 4, the VL models: a ``text_config`` beside a vision
    tower's) is refused rather than planned as its language model alone, which would leave
    the vision tower's parameters out of every figure without saying so."""
    text = config.get("text_config")
    if isinstance(text, dict):
        text_type = text.get("model_type", "its text model's type")
        towers = sorted(k for k in config if k.endswith("_config") and k != "text_config")
        raise ValueError(f"{where}={path}: model_type={model_type!r} is a composite config (text_config"
                         f"{' beside ' + ', '.join(towers) if towers else ' nested in it'}); shardbench builds one"
                         " model of one task: to measure its language model, give text_config's keys as a"
                         f" config.json of their own (model_type {text_type!r})")


def _check_task_class(model_type: str, task: Task, path: str, where: str) -> None:
    """transformers has a class for this model type and task (T5's encoder-decoder has no
    causal-LM class, CLIP no image classifier): else one line, not the auto class's list of
    every type it knows."""
    from transformers.models.auto import modeling_auto

    classes: dict[Task, Mapping[str, object]] = {
        "causal_lm": modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        "masked_lm": modeling_auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES,
        "image_classification": modeling_auto.MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES}
    if model_type not in classes[task]:
        why = "its architectures entry says" if task != _DEFAULT_TASK else "a config naming no architectures is"
        raise ValueError(f"{where}={path}: transformers has no {task} class for model_type={model_type!r}, which"
                         f" {why} (shardbench trains causal LMs, masked LMs and image classifiers)")


def _task(config: dict[str, Any], path: str, where: str) -> Task:
    architectures = config.get("architectures") or []
    if not architectures:
        return _DEFAULT_TASK
    for suffix, task in _TASK_BY_SUFFIX:
        if architectures[0].endswith(suffix):
            return task
    raise ValueError(f"{where}={path}: architecture {architectures[0]} is not a causal LM, masked LM or image"
                     " classifier (the tasks shardbench builds batches for)")


def _with_defaults(config: dict[str, Any], path: str, where: str) -> dict[str, Any]:
    """Every key the model is built from, the config class's defaults included, so that the
    record holds the whole config and dropout the file leaves at its default is seen."""
    from transformers import AutoConfig

    given = {k: v for k, v in config.items() if k != "model_type"}
    try:
        full: dict[str, Any] = AutoConfig.for_model(config["model_type"], **given).to_dict()
    except Exception as error:  # transformers' own validation (a bool for an int, say): its last line, the cause
        raise ValueError(f"{where}={path}: transformers refuses the config: {_last_line(error)}") from None
    full.pop("transformers_version", None)  # which transformers wrote it: the provenance says so
    return full


def _last_line(error: Exception) -> str:
    """An exception's message as one line: its last (the cause, where it spans several)."""
    lines = str(error).strip().splitlines()
    return lines[-1].strip() if lines else type(error).__name__


def _for_training(config: dict[str, Any]) -> dict[str, Any]:
    """Dropout (and layer drop, stochastic depth) off: every rank would draw its own masks; no KV cache."""
    out = {k: 0.0 if _is_dropout(k, v) else v for k, v in config.items()}
    out["use_cache"] = False
    return out


def _is_dropout(key: str, value: object) -> bool:
    """A probability of dropping something at random: dropout, *_pdrop, layerdrop, drop_path_rate."""
    return isinstance(value, int | float) and not isinstance(value, bool) and "drop" in key and value > 0


def config_value(config: object, name: str) -> Any:
    """``config``'s ``name`` where its model can read it: its class defines it (a field its
    ``__init__`` sets, or an alias in its attribute_map) or its model's code names it
    (``config.name``, or ``"name"`` as GLM's ``getattr(config, "head_dim", ...)`` does); else
    None. transformers keeps a key its class does not know as an attribute all the same, which
    a model that never names it does not read: a GPT-2 config.json carrying LLaMA's
    ``num_key_value_heads`` and ``intermediate_size`` still builds GPT-2's full heads and its
    ``n_inner`` MLP."""
    known, code = _class_knows(type(config))
    readable = name in known or code is None or re.search(rf'config\.{name}\b|"{name}"', code) is not None
    return getattr(config, name, None) if readable else None


_CLASS_KNOWS: dict[type, tuple[frozenset[str], str | None]] = {}


def _class_knows(config_class: type) -> tuple[frozenset[str], str | None]:
    """The names the class defines, and its model's code (the modeling module beside its
    configuration module, None where it cannot be had: then every key counts). The names are
    those its instance with every default has (what its ``__init__`` sets, Falcon's
    num_key_value_heads among them), built with transformers' warnings about its own defaults
    silenced, or where a class cannot be built without arguments its ``__init__``'s
    parameters; and its attribute_map's aliases."""
    if config_class not in _CLASS_KNOWS:
        from transformers.utils import logging as transformers_logging

        verbosity = transformers_logging.get_verbosity()
        transformers_logging.set_verbosity_error()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                known = frozenset(dir(config_class()))
        except Exception:  # a class that validates its defaults or requires arguments (strict dataclasses)
            known = frozenset(inspect.signature(config_class).parameters)
        finally:
            transformers_logging.set_verbosity(verbosity)
        # An alias is no attribute of the instance (Bloom's num_attention_heads reads its n_head).
        known |= frozenset(getattr(config_class, "attribute_map", {}))
        try:
            code: str | None = inspect.getsource(
                importlib.import_module(config_class.__module__.replace(".configuration_", ".modeling_")))
        except (ImportError, OSError, TypeError):
            code = None
        _CLASS_KNOWS[config_class] = (known, code)
    return _CLASS_KNOWS[config_class]


def _spec(path: str, model_type: str, task: Task, config: dict[str, Any], where: str) -> ModelSpec:
    """The ModelSpec of a resolved config: its sizes as transformers reads them, its layout
    and size from a build on the meta device."""
    from . import hf_config, layouts
    from .common import on_meta

    config_json = json.dumps(config, sort_keys=True)
    hf = TransformersConfig(model_type=model_type, task=task, config_json=config_json, source=path)
    c = hf_config.transformers_config(hf)
    read = functools.partial(config_value, c)
    text = task != "image_classification"
    max_positions = read("max_position_embeddings") if text else None
    sizes: dict[str, Any] = {
        "n_layers": c.num_hidden_layers, "hidden": c.hidden_size, "n_heads": read("num_attention_heads"),
        "n_kv_heads": read("num_key_value_heads"),
        # A mixture of experts' experts are moe_intermediate_size wide where the config sets it
        # (Qwen-MoE, DeepSeek), intermediate_size otherwise (Mixtral); GPT-2 names the MLP's
        # width n_inner, OPT ffn_dim, Falcon ffn_hidden_size.
        "ffn_hidden": (read("moe_intermediate_size") or read("intermediate_size") or read("n_inner")
                       or read("ffn_dim") or read("ffn_hidden_size")),
        "vocab_size": c.vocab_size if text else None,
        "seq_len": _default_seq_len(max_positions) if text else None,
        "image_size": None if text else _side(c.image_size),
        "patch_size": None if text or read("patch_size") is None else _side(c.patch_size),
        "num_classes": None if text else c.num_labels,
        # Mixtral names its experts num_local_experts, Qwen-MoE and OLMoE num_experts.
        "n_experts": read("num_local_experts") or read("num_experts") or None,
        "top_k": read("num_experts_per_tok"),
        "config_head_dim": read("head_dim"),
    }
    if sizes["n_experts"] is None:
        sizes["top_k"] = None
    provisional = ModelSpec(name=model_type, family="hf_config", hf=hf, max_seq_len=max_positions,
                            tie_embeddings=bool(getattr(c, "tie_word_embeddings", False)), **sizes)
    try:
        with on_meta():
            # Eager attention, which every class has: the build is for the class, sizes and layout.
            module = hf_config.build_module(provisional, "eager")
    except Exception as error:  # transformers' own code on a config it accepted (a pad id past the vocabulary, say)
        raise ValueError(f"{where}={path}: transformers cannot build its model from it:"
                         f" {type(error).__name__}: {_last_line(error)}") from None
    try:
        layout = layouts.recognise(module)
    except ValueError as error:
        raise ValueError(f"{where}={path}: {error}") from None
    n_params = sum(p.numel() for p in module.parameters())
    digest = hashlib.sha1(config_json.encode()).hexdigest()[:6]
    # transformers' own flags for whether the class computes attention through torch's SDPA and flash-attn.
    built_as = {"layout": layout, "model_class": type(module).__name__,
                "sdpa": bool(getattr(type(module), "_supports_sdpa", False)),
                "flash": bool(getattr(type(module), "_supports_flash_attn", False))}
    return ModelSpec(**{**provisional.__dict__, "name": f"{model_type}-{_size(n_params)}-{digest}",
                        "n_kv_heads": _built_kv_heads(module, provisional),
                        "hf": TransformersConfig(**{**hf.__dict__, **built_as})})


def attention_windows(spec: ModelSpec) -> tuple[int | None, ...]:
    """``config_windows`` of a config's model; no window for the built-in families."""
    if spec.hf is None:
        return (None,) * spec.n_layers
    from . import hf_config

    return config_windows(hf_config.resolved(spec.hf), spec.n_layers)


def window_passed(spec: ModelSpec) -> int | None:
    """The narrowest sliding window of the model's blocks that its sequence is longer than
    (there it attends to fewer tokens than the whole causal context), or None."""
    return min((w for w in attention_windows(spec) if w is not None and spec.tokens_per_sample > w), default=None)


def config_windows(config: object, n_layers: int) -> tuple[int | None, ...]:
    """Per block, the sliding window its attention is masked to (None: the whole causal
    context), as transformers builds the model: the config's ``sliding_window`` on the blocks
    its ``layer_types`` calls sliding_attention (Gemma2, Gemma3, gpt-oss, Qwen2's upper
    blocks), on every block where it names none (Mistral, Phi-3, Starcoder2)."""
    window = config_value(config, "sliding_window")
    types = config_value(config, "layer_types") or ("sliding_attention",) * n_layers
    if window is None:
        return (None,) * n_layers
    kinds = [*types[:n_layers], *("full_attention",) * (n_layers - len(types))]
    return tuple(window if kind == "sliding_attention" else None for kind in kinds)


def _built_kv_heads(module: Any, provisional: ModelSpec) -> int | None:
    """The key/value heads the built attention runs with: its heads over transformers'
    ``num_key_value_groups`` (Falcon-7B's multi_query takes one, whatever its num_kv_heads
    says), the config's count where no attention module states its groups."""
    groups = next((m.num_key_value_groups for m in module.modules()
                   if isinstance(getattr(m, "num_key_value_groups", None), int)), None)
    if groups is None or provisional.n_heads is None:
        return provisional.n_kv_heads
    return provisional.n_heads // groups


@functools.cache
def _resolve_factory(path: str, where: str) -> ModelSpec:
    """A factory's ModelSpec: its repeated blocks, width and parameters from a build on the meta
    device, its tokens per sample from one sample of its batches."""
    import torch

    from . import factory, layouts
    from .common import on_meta

    try:
        with on_meta():
            module, make_batch = factory.made(path)
        blocks = layouts.repeated_blocks(module)
    except ValueError as error:
        raise ValueError(f"{where}={path}: {error}") from None
    sample = make_batch(torch.Generator().manual_seed(0), 1)
    ids = sample.get("input_ids")
    linears = [m for m in blocks[0].modules() if isinstance(m, torch.nn.Linear)]
    hidden = linears[0].in_features if linears else 1
    n_params = sum(p.numel() for p in module.parameters())
    digest = hashlib.sha1(path.encode()).hexdigest()[:6]
    return ModelSpec(name=f"{path.rpartition(':')[2]}-{_size(n_params)}-{digest}", family="factory", factory=path,
                     n_layers=len(blocks), hidden=hidden, seq_len=int(ids.shape[1]) if ids is not None else None)


def _default_seq_len(max_positions: int | None) -> int:
    if max_positions is None or max_positions >= DEFAULT_SEQ_LEN:
        return DEFAULT_SEQ_LEN
    return 1 << (max_positions.bit_length() - 1)


def _side(size: int | list[int] | tuple[int, ...]) -> int:
    """An image or patch size (transformers takes an int or a square's (h, w))."""
    if isinstance(size, int):
        return size
    if len(set(size)) != 1:
        raise ValueError(f"image or patch size {size}: only square images are built")
    return int(size[0])


def _size(n_params: int) -> str:
    return f"{n_params / 1e9:.1f}b" if n_params >= 1e9 else f"{n_params / 1e6:.0f}m" if n_params >= 1e6 else (
        f"{n_params / 1e3:.0f}k")


# The transformers configs shipped with shardbench, which suites and claims name.
MODEL_CONFIGS = Path(__file__).resolve().parents[2] / "suites" / "configs"


def config_model(name: str) -> ModelSpec:
    """A model of suites/configs/ (``name``.json), resolved as a suite file's would be."""
    resolved = resolve(str(MODEL_CONFIGS / f"{name}.json"))
    if not isinstance(resolved, ModelSpec):
        raise TypeError(f"{name}.json resolved to the preset {resolved!r}")
    return resolved
