"""ModelSpec: the one config dataclass that describes every benchmark model."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any, Literal, get_args

# "hf_config": a transformers config.json, built through the Auto classes; "factory": a
# function of one's own that returns the model and its batches (harness.models.sources).
Family = Literal["gpt2", "llama", "bert", "vit", "mlp", "convnet", "moe", "hf_config", "factory"]
# What a config's model is trained for: which Auto class builds it, which batches feed it.
Task = Literal["causal_lm", "masked_lm", "image_classification"]
# The module layouts the layout-dependent strategies (tensor-parallel plans, pipeline splits,
# Megatron's weight copy, context and expert parallel) are written for, recognised from a
# built model's module names (harness.models.layouts), never from its family:
# - "llama": model.layers[i].self_attn.{q,k,v,o}_proj and mlp.{gate,up,down}_proj (LLaMA,
#   Mistral, Qwen2, ...);
# - "mixtral": LLaMA's attention with a routed mixture of experts in place of the MLP;
# - "gpt2": transformer.h[i].attn.c_attn / c_proj and mlp.c_fc / c_proj (Conv1D weights).
Layout = Literal["llama", "mixtral", "gpt2"]

# Size fields each family needs; any other optional size field must stay None, so a spec
# never carries a number that silently does nothing.
_REQUIRED: dict[str, tuple[str, ...]] = {
    "gpt2": ("n_heads", "seq_len", "vocab_size"),
    "llama": ("n_heads", "seq_len", "vocab_size"),
    "bert": ("n_heads", "seq_len", "vocab_size"),
    "vit": ("n_heads", "image_size", "patch_size", "num_classes"),
    "mlp": ("num_classes",),
    "convnet": ("image_size", "num_classes"),
    "moe": ("n_heads", "seq_len", "vocab_size", "n_experts", "top_k"),
    "hf_config": (),  # the task's own sizes (_TASK_SIZES)
    "factory": (),
}
_OPTIONAL: dict[str, tuple[str, ...]] = {
    "gpt2": ("ffn_hidden",),
    "llama": ("ffn_hidden", "n_kv_heads"),
    "bert": ("ffn_hidden",),
    "vit": ("ffn_hidden",),
    "mlp": ("ffn_hidden",),
    "convnet": (),
    "moe": ("ffn_hidden", "n_kv_heads"),
    # n_heads: None for an attention-free model (Mamba, RWKV: has_attention).
    "hf_config": ("n_heads", "ffn_hidden", "n_kv_heads", "n_experts", "top_k", "patch_size"),
    "factory": ("seq_len",),  # its tokens per sample, where its batches hold input_ids
}
_TASK_SIZES: dict[str, tuple[str, ...]] = {
    "causal_lm": ("seq_len", "vocab_size"),
    "masked_lm": ("seq_len", "vocab_size"),
    "image_classification": ("image_size", "num_classes"),
}
# The layout each built-in family is built with (its family file's transformers class);
# tests/test_models.py recognises every preset's built module and checks it is this one.
_FAMILY_LAYOUT: dict[str, Layout] = {"gpt2": "gpt2", "llama": "llama", "moe": "mixtral"}
SizeField = Literal["n_heads", "n_kv_heads", "ffn_hidden", "seq_len", "vocab_size",
                    "image_size", "patch_size", "num_classes", "n_experts", "top_k"]
_SIZES: tuple[SizeField, ...] = get_args(SizeField)
# The largest size a model may have, so a typo (a config's num_hidden_layers = 100000000) is
# refused, not built for ever: layers and experts are modules built one by one (the deepest
# published LMs have ~100 layers, the widest MoEs 256 experts); every other size is a tensor
# dimension (the largest vocabularies are ~2^18, contexts ~2^20).
_MAX_MODULES = 1024
_MAX_DIMENSION = 2**24

VIT_CHANNELS = 3  # RGB images
CONVNET_CHANNELS = 1  # grayscale images (scikit-learn's digits)


@dataclass(frozen=True, kw_only=True)
class TransformersConfig:
    """A model described by a transformers config.json (family hf_config): the resolved config
    (the file's keys with the cell's overrides applied, dropout off), kept whole so that a
    record alone rebuilds the model."""

    model_type: str
    task: Task
    config_json: str  # json.dumps(config, sort_keys=True): hashable, and one text per config
    layout: Layout | None = None  # as harness.models.layouts recognised it when resolved
    source: str = ""  # the file it was read from (for messages; the config is what counts)
    # The class transformers builds for it, and whether that class computes attention through
    # torch's scaled_dot_product_attention (its ``_supports_sdpa``: Gemma2's does not) and
    # through flash-attn (``_supports_flash_attn``: Bloom's does not).
    model_class: str = ""
    sdpa: bool = True
    flash: bool = True

    def __post_init__(self) -> None:
        _check_choice_of("task", self.task, get_args(Task))
        if self.layout is not None:
            _check_choice_of("layout", self.layout, get_args(Layout))
        if json.loads(self.config_json).get("model_type") != self.model_type:
            raise ValueError(f"config_json: its model_type is not {self.model_type!r}")

    @property
    def config(self) -> dict[str, Any]:
        loaded: dict[str, Any] = json.loads(self.config_json)
        return loaded


def _check_choice_of(name: str, value: object, allowed: tuple[object, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name}={value!r}: choose one of {', '.join(str(a) for a in allowed)}")


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """A model by its sizes; `harness.models.build` turns it into a randomly initialised module.

    Tokens per sample come from `seq_len` for text models, from image_size / patch_size for
    vit (patches + the class token) and are 1 for mlp; read them from `tokens_per_sample`.
    """

    name: str
    family: Family
    n_layers: int
    hidden: int
    n_heads: int | None = None  # every family but mlp and convnet
    n_kv_heads: int | None = None  # llama, moe (grouped-query attention); None = n_heads
    ffn_hidden: int | None = None  # None = 4 * hidden; llama, moe: the 8/3 * hidden rule (moe: per expert)
    seq_len: int | None = None  # gpt2, llama, bert
    vocab_size: int | None = None  # gpt2, llama, bert
    image_size: int | None = None  # vit, convnet
    patch_size: int | None = None  # vit
    num_classes: int | None = None  # vit, mlp, convnet
    n_experts: int | None = None  # moe: experts per layer
    top_k: int | None = None  # moe: experts each token is routed to
    tie_embeddings: bool = False  # llama only (Llama-3.2-1B ties); gpt2 and bert always tie
    # A config's head width where it sets one (Qwen3: 128 at hidden 2560 and 32 heads; Gemma
    # 256); None: hidden / n_heads. Read it as ``head_dim``.
    config_head_dim: int | None = None
    # Family hf_config: the config it is built from, and the longest sequence its position
    # embeddings take (a preset is rebuilt for any seq_len; a config's model is not).
    hf: TransformersConfig | None = None
    max_seq_len: int | None = None
    # Family factory: "package.module:function" (harness.models.sources, README: Models).
    factory: str | None = None

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("name is empty: give the model a name, e.g. 'gpt2-tiny'")
        if self.family not in get_args(Family):
            raise ValueError(f"family={self.family!r}: choose one of {', '.join(get_args(Family))}")
        for f in ("n_layers", "hidden"):
            if getattr(self, f) <= 0:
                raise ValueError(f"{f}={getattr(self, f)} must be a positive integer")
        for f in ("n_layers", "hidden", *_SIZES):
            value, bound = getattr(self, f), _MAX_MODULES if f in ("n_layers", "n_experts") else _MAX_DIMENSION
            if value is not None and value > bound:
                raise ValueError(f"{f}={value}: at most {bound:,} (a size beyond any model's: a typo?)")
        if (self.hf is None) == (self.family == "hf_config"):
            raise ValueError(f"hf: family {self.family!r} {'needs' if self.hf is None else 'takes no'} a"
                             " transformers config (harness.models.sources.resolve makes one)")
        if (self.factory is None) == (self.family == "factory"):
            raise ValueError(f"factory: family {self.family!r} {'needs' if self.factory is None else 'takes no'}"
                             " factory (package.module:function)")
        required, optional = _REQUIRED[self.family], _OPTIONAL[self.family]
        if self.hf is not None:
            required = required + _TASK_SIZES[self.hf.task]
        for f in _SIZES:
            value = getattr(self, f)
            if value is None and f in required:
                raise ValueError(f"{f}=None: family {self.family!r} needs it; set {f}")
            if value is not None and f not in required + optional:
                raise ValueError(f"{f}={value} does not apply to family {self.family!r}; leave it None")
            if value is not None and value <= 0:
                raise ValueError(f"{f}={value} must be a positive integer")
        if self.max_seq_len is not None and self.seq_len is not None and self.seq_len > self.max_seq_len:
            raise ValueError(f"seq_len={self.seq_len}: model {self.name!r} takes at most {self.max_seq_len} tokens"
                             " (its config's max_position_embeddings)")
        if self.tie_embeddings and self.family not in ("llama", "hf_config"):
            raise ValueError(f"tie_embeddings=True applies to llama only "
                             f"({self.family!r} ties or has no LM head by construction); leave it False")
        # A config that states head_dim sizes its heads apart from hidden (GLM-4.5-Air: 96
        # heads of 128 on a 4096-wide stream).
        if self.n_heads is not None and self.config_head_dim is None and self.hidden % self.n_heads:
            raise ValueError(f"hidden={self.hidden} must be divisible by n_heads={self.n_heads}")
        # The `is not None` tests narrow only: where n_kv_heads, image_size or top_k applies, the
        # size each is checked against is required (above).
        if self.n_kv_heads is not None and self.n_heads is not None and self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} must be divisible by n_kv_heads={self.n_kv_heads}")
        if self.image_size is not None and self.patch_size is not None and self.image_size % self.patch_size:
            raise ValueError(f"image_size={self.image_size} must be divisible by patch_size={self.patch_size}")
        if self.top_k is not None and self.n_experts is not None and self.top_k > self.n_experts:
            raise ValueError(f"top_k={self.top_k} must be at most n_experts={self.n_experts}:"
                             f" a token is routed to top_k distinct experts")

    def required(self, field: SizeField) -> int:
        """A size the family needs (``__post_init__`` has checked it is set); asked of a family
        that has no such size, a ValueError saying so."""
        value: int | None = getattr(self, field)
        if value is None:
            raise ValueError(f"{field}: model {self.name!r} of family {self.family!r} has none")
        return value

    @property
    def layout(self) -> Layout | None:
        """The module layout the layout-dependent strategies recognise, or None."""
        return self.hf.layout if self.hf is not None else _FAMILY_LAYOUT.get(self.family)

    @property
    def task(self) -> Task | None:
        """What a text or image model is trained for (None for the plain-torch mlp)."""
        if self.hf is not None:
            return self.hf.task
        return {"bert": "masked_lm", "vit": "image_classification", "convnet": "image_classification",
                "mlp": None, "factory": None}.get(self.family, "causal_lm")

    @property
    def head_tied(self) -> bool:
        """Whether the output head's weight is the token table (gpt2 and bert always; llama
        and a config where ``tie_embeddings``): one parameter whose gradient backward makes
        twice, the head's and the embedding's, and sums."""
        return self.family in ("gpt2", "bert") or self.tie_embeddings

    @property
    def has_batch_norm(self) -> bool:
        """Whether the model normalises by batch statistics (BatchNorm), which make a
        per-rank or per-micro-step batch a different computation from the whole batch."""
        return self.family == "convnet"

    @property
    def has_attention(self) -> bool:
        """Whether the model attends (the attention axis and its markers apply): not the
        plain MLP and convnet, nor a config without attention heads (a state-space or
        recurrent model: Mamba, RWKV)."""
        return self.family not in ("mlp", "convnet") and (self.family != "hf_config" or self.n_heads is not None)

    def to_dict(self) -> dict[str, Any]:
        """As a record keeps it: the config a JSON object, not a string."""
        d = dataclasses.asdict(self)
        if self.hf is not None:
            d["hf"]["config"] = json.loads(d["hf"].pop("config_json"))
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelSpec:
        d = dict(d)
        if d.get("hf") is not None:
            hf = dict(d["hf"])
            hf["config_json"] = json.dumps(hf.pop("config"), sort_keys=True)
            d["hf"] = TransformersConfig(**hf)
        return cls(**d)

    @property
    def head_dim(self) -> int:
        """A head's width: the config's own where it sets one, else hidden / heads."""
        if self.config_head_dim is not None:
            return self.config_head_dim
        return self.hidden // self.n_heads if self.n_heads else 0

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads or 0

    @property
    def ffn(self) -> int:
        """The resolved MLP width."""
        if self.ffn_hidden is not None:
            return self.ffn_hidden
        if self.family in ("llama", "moe"):
            # Llama's SwiGLU rule: 2/3 of 4*hidden, rounded up to a multiple of 256.
            return -(-(8 * self.hidden // 3) // 256) * 256
        return 4 * self.hidden

    @property
    def tokens_per_sample(self) -> int:
        if self.family == "vit" or (self.task == "image_classification" and self.patch_size is not None):
            return (self.required("image_size") // self.required("patch_size")) ** 2 + 1  # patches + class token
        if self.family == "factory":
            return self.seq_len or 1
        if self.family == "mlp" or self.task == "image_classification":
            return 1  # a convolutional classifier: one prediction per image
        return self.required("seq_len")
