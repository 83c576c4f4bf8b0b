"""ModelSpec: the one config dataclass that describes every benchmark model."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

Family = Literal["gpt2", "llama", "bert", "vit", "mlp", "moe"]

# Size fields each family needs; any other optional size field must stay None, so a spec
# never carries a number that silently does nothing.
_REQUIRED: dict[str, tuple[str, ...]] = {
    "gpt2": ("n_heads", "seq_len", "vocab_size"),
    "llama": ("n_heads", "seq_len", "vocab_size"),
    "bert": ("n_heads", "seq_len", "vocab_size"),
    "vit": ("n_heads", "image_size", "patch_size", "num_classes"),
    "mlp": ("num_classes",),
    "moe": ("n_heads", "seq_len", "vocab_size", "n_experts", "top_k"),
}
_OPTIONAL: dict[str, tuple[str, ...]] = {
    "gpt2": ("ffn_hidden",),
    "llama": ("ffn_hidden", "n_kv_heads"),
    "bert": ("ffn_hidden",),
    "vit": ("ffn_hidden",),
    "mlp": ("ffn_hidden",),
    "moe": ("ffn_hidden", "n_kv_heads"),
}
SizeField = Literal["n_heads", "n_kv_heads", "ffn_hidden", "seq_len", "vocab_size",
                    "image_size", "patch_size", "num_classes", "n_experts", "top_k"]
_SIZES: tuple[SizeField, ...] = get_args(SizeField)

VIT_CHANNELS = 3  # RGB images


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
    n_heads: int | None = None  # every family but mlp
    n_kv_heads: int | None = None  # llama, moe (grouped-query attention); None = n_heads
    ffn_hidden: int | None = None  # None = 4 * hidden; llama, moe: the 8/3 * hidden rule (moe: per expert)
    seq_len: int | None = None  # gpt2, llama, bert
    vocab_size: int | None = None  # gpt2, llama, bert
    image_size: int | None = None  # vit
    patch_size: int | None = None  # vit
    num_classes: int | None = None  # vit, mlp
    n_experts: int | None = None  # moe: experts per layer
    top_k: int | None = None  # moe: experts each token is routed to
    tie_embeddings: bool = False  # llama only (Llama-3.2-1B ties); gpt2 and bert always tie

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("name is empty: give the model a name, e.g. 'gpt2-tiny'")
        if self.family not in get_args(Family):
            raise ValueError(f"family={self.family!r}: choose one of {', '.join(get_args(Family))}")
        for f in ("n_layers", "hidden"):
            if getattr(self, f) <= 0:
                raise ValueError(f"{f}={getattr(self, f)} must be a positive integer")
        required, optional = _REQUIRED[self.family], _OPTIONAL[self.family]
        for f in _SIZES:
            value = getattr(self, f)
            if value is None and f in required:
                raise ValueError(f"{f}=None: family {self.family!r} needs it; set {f}")
            if value is not None and f not in required + optional:
                raise ValueError(f"{f}={value} does not apply to family {self.family!r}; leave it None")
            if value is not None and value <= 0:
                raise ValueError(f"{f}={value} must be a positive integer")
        if self.tie_embeddings and self.family != "llama":
            raise ValueError(f"tie_embeddings=True applies to llama only "
                             f"({self.family!r} ties or has no LM head by construction); leave it False")
        if self.n_heads is not None and self.hidden % self.n_heads:
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
    def head_dim(self) -> int:
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
        if self.family == "vit":
            return (self.required("image_size") // self.required("patch_size")) ** 2 + 1  # patches + class token
        if self.family == "mlp":
            return 1
        return self.required("seq_len")
