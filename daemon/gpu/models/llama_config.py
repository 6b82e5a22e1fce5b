"""The config of a llama GGUF: transformers' LlamaConfig, field for field, default for
default, validator for validator — declared here because importing LlamaConfig's own
module costs ~56 MiB of resident memory for nothing llmd uses (12% of the daemon serving
its built-in model). That module imports `transformers.utils.type_validators` for the
range check of `initializer_range`; it imports `transformers.activations`, whose
hub-kernel integration imports transformers' model loading and with it
`torch.distributed.tensor`, torch.fx's symbolic shapes, sympy and accelerate: 700
modules. The Qwen, Gemma, Phi and Mistral configs do not import it. An HF llama
directory's config.json is read into it too (loader.load_hf_config), and handed to
AutoTokenizer, which would otherwise read the directory's config itself through
AutoConfig (it uses only the config's model_type and names).

No `from __future__ import annotations` here: the strict dataclass checks each field
against its annotation as a type (as a string it would check the validator first, and
refuse an int `initializer_range` with another message than LlamaConfig's).

tests/test_llama_config.py holds this class to LlamaConfig: the same fields with the same
defaults, the same dict from the same arguments, the same refusals, and a llama GGUF
loaded without those modules imported."""
from huggingface_hub.dataclasses import as_validated_field, strict
from transformers.configuration_utils import PreTrainedConfig
from transformers.modeling_rope_utils import RopeParameters


@as_validated_field
def _unit_interval(value: int | float):
    """LlamaConfig's `interval(min=0.0, max=1.0)`."""
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"Value must be greater or equal to 0.0 and smaller or equal to 1.0, got {value}.")


@strict
class LeanLlamaConfig(PreTrainedConfig):
    model_type = "llama"

    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = None
    hidden_act: str = "silu"
    max_position_embeddings: int = 2048
    initializer_range: float = _unit_interval(default=0.02)
    rms_norm_eps: float = 1e-6
    use_cache: bool = True
    pad_token_id: int | None = None
    bos_token_id: int | None = 1
    eos_token_id: int | list[int] | None = 2
    pretraining_tp: int | None = 1
    tie_word_embeddings: bool = False
    rope_parameters: RopeParameters | dict | None = None
    attention_bias: bool = False
    attention_dropout: int | float | None = 0.0
    mlp_bias: bool = False
    head_dim: int | None = None

    def __post_init__(self, **kwargs):
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        super().__post_init__(**kwargs)

    def validate_architecture(self):
        if self.hidden_size % self.num_attention_heads != 0:
            raise ValueError(f"The hidden size ({self.hidden_size}) is not a multiple of the number of attention "
                             f"heads ({self.num_attention_heads}).")
