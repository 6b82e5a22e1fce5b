"""What a config may ask of llmd. Each model class's `check_config` (called by
load_hf_config and load_gguf_config before any weight is read, and by the model's
constructor) reads the fields its architecture honours through these checks; a field
asking for something llmd does not implement, or that transformers' model of the same
architecture would ignore, is a ValueError naming the architecture and the field, so a
model that loads is one llmd runs as transformers does."""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any, NoReturn

from llmd.gpu.layers.norms import ACTIVATIONS
from llmd.gpu.layers.rotary import ROPE_TYPES, rope_parameters, rotary_dim

# Fields of Gemma 2 (all) and Gemma 3 (some) that other architectures' transformers
# models do not read: a config carrying them is refused rather than run without them.
SOFTCAP_FIELDS = ("attn_logit_softcapping", "final_logit_softcapping")
GEMMA_FIELDS = (*SOFTCAP_FIELDS, "query_pre_attn_scalar", "use_bidirectional_attention")

# Keys each rope type must have (besides rope_type and rope_theta).
_ROPE_KEYS = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("factor",),
    "longrope": ("short_factor", "long_factor", "original_max_position_embeddings"),
}


def refuse(architecture: str, field: str, value: Any, why: str) -> NoReturn:
    raise ValueError(f"{architecture}: config {field}={value!r} {why}")


def check_heads(architecture: str, config: Any) -> int:
    """The head size the model will use, or a refusal of head counts and sizes it
    cannot run: kv heads that do not divide the query heads, no head_dim and a hidden
    size that is not a multiple of the heads, an odd or non-positive head_dim."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if not isinstance(heads, int) or heads < 1:
        refuse(architecture, "num_attention_heads", heads, "must be a positive int")
    if not isinstance(kv_heads, int) or kv_heads < 1 or heads % kv_heads:
        refuse(architecture, "num_key_value_heads", kv_heads,
               f"must be a positive divisor of num_attention_heads ({heads})")
    head_dim = getattr(config, "head_dim", None)
    if head_dim is None:
        if config.hidden_size % heads:
            refuse(architecture, "hidden_size", config.hidden_size,
                   f"is not a multiple of num_attention_heads ({heads}) and no head_dim is given")
        head_dim = config.hidden_size // heads
    if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim < 2 or head_dim % 2:
        refuse(architecture, "head_dim", head_dim,
               "must be a positive even int (rotary embeddings turn the two halves of a head)")
    return head_dim


def check_activation(architecture: str, field: str, value: Any) -> None:
    if value not in ACTIVATIONS:
        refuse(architecture, field, value, f"is not implemented by llmd (implemented: {', '.join(ACTIVATIONS)})")


def check_unread(architecture: str, config: Any, fields: Iterable[str]) -> None:
    """Refuse fields set to anything but None/False that transformers' model of this
    architecture does not read (it would run as if they were absent; the checkpoint
    may have been trained with them)."""
    for field in fields:
        value = getattr(config, field, None)
        if value is not None and value is not False:
            refuse(architecture, field, value, "is not part of this architecture (transformers' model of it "
                   "ignores the field); llmd refuses rather than guess")


def check_rope(architecture: str, config: Any, head_dim: int, partial_rotary: bool,
               layer_types: Iterable[str | None] = (None,)) -> None:
    """The rope parameters of each layer type (None: the one flat dict) must be of a
    type llmd implements, with the keys that type needs; `partial_rotary_factor` only
    where the architecture applies it, and whole, even rotated sizes."""
    for layer_type in sorted(set(layer_types), key=str):
        params = rope_parameters(config, layer_type)
        field = "rope_parameters" if layer_type is None else f"rope_parameters[{layer_type!r}]"
        rope_type = params["rope_type"]
        if rope_type not in ROPE_TYPES:
            refuse(architecture, f"{field}.rope_type", rope_type,
                   f"is not implemented by llmd (implemented: {', '.join(ROPE_TYPES)})")
        missing = [k for k in _ROPE_KEYS[rope_type] if params.get(k) is None]
        if missing:
            refuse(architecture, f"{field}.rope_type", rope_type, f"needs {', '.join(missing)} in {field}")
        factor = params.get("partial_rotary_factor", 1.0)
        if factor != 1.0 and not partial_rotary:
            refuse(architecture, f"{field}.partial_rotary_factor", factor,
                   "asks for partial rotary, which transformers' model of this architecture does not apply")
        dim = rotary_dim(params, head_dim)
        if not 2 <= dim <= head_dim or dim % 2:
            refuse(architecture, f"{field}.partial_rotary_factor", factor,
                   f"rotates {dim} of the {head_dim} dimensions of a head (a positive even count is needed)")
        if rope_type == "longrope":
            _check_longrope(architecture, field, params, dim)


def _check_longrope(architecture: str, field: str, params: dict[str, Any], dim: int) -> None:
    for key in ("short_factor", "long_factor"):
        factors = params[key]
        if not isinstance(factors, list) or len(factors) != dim // 2:
            count = len(factors) if isinstance(factors, list) else type(factors).__name__
            refuse(architecture, f"{field}.{key}", f"<{count} values>",
                   f"must list one factor per rotated frequency ({dim // 2})")
    original = params["original_max_position_embeddings"]
    if isinstance(original, bool) or not isinstance(original, int) or original < 1:
        refuse(architecture, f"{field}.original_max_position_embeddings", original, "must be a positive int")
