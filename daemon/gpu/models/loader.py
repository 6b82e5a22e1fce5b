"""Load a model from a local Hugging Face directory (config and tokenizer via
transformers, weights from safetensors through our own name mapping) or from a GGUF file
(gguf_loader: the same three things read from the one file). Nothing is fetched."""
from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from llmd.gpu.layers.cpu.cpu_kernels import attach_cpu_kernels
from llmd.gpu.layers.cpu.cpu_linear import pack_linears
from llmd.gpu.models.gguf_loader import (gguf_stop_token_ids, is_gguf_path, iter_gguf_weights, load_gguf_config,
                                  load_gguf_tokenizer, open_gguf)
from llmd.gpu.models import get_model_class
from llmd.load_progress import LoadProgress

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str, device: torch.device, checkpoint_dtype: str | None) -> torch.dtype:
    """`auto`: bfloat16 on CUDA; on CPU the checkpoint's dtype, float32 for fp16 checkpoints
    (CPU float16 matmuls are slow and lossy)."""
    if name != "auto":
        return _DTYPES[name]
    if device.type == "cuda":
        return torch.bfloat16
    if checkpoint_dtype == "bfloat16":
        return torch.bfloat16
    return torch.float32


def load_hf_config(model_dir: str | Path):
    """The model's transformers config, checked before any weight is read: an
    architecture llmd does not run, or a config field its model would not honour as
    transformers does (a layer type other than full or sliding attention, a window where
    the architecture has none, a rope type, activation or soft-cap llmd does not
    implement, odd head sizes: the model class's check_config), is a ValueError naming
    the architecture and the field.
    `model_dir` may be a GGUF file (its metadata is the config)."""
    from transformers import AutoConfig

    if is_gguf_path(model_dir):
        return load_gguf_config(model_dir)
    path = Path(model_dir)
    if not path.exists():
        raise FileNotFoundError(f"model path {str(path)!r} does not exist")
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"model directory {str(path)!r} has no config.json")
    config = AutoConfig.from_pretrained(str(path), local_files_only=True)
    get_model_class(_architecture(config)).check_config(config)
    return config


def load_tokenizer(path: str | Path):
    """The tokenizer of an HF directory, or the one a GGUF file's vocabulary describes."""
    if is_gguf_path(path):
        return load_gguf_tokenizer(path)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


def stop_token_ids(path: str | Path) -> set[int]:
    """End-of-generation ids besides the tokenizer's EOS: generation_config.json's
    eos_token_id of an HF directory, a GGUF's end-of-turn/end-of-message ids."""
    if is_gguf_path(path):
        return gguf_stop_token_ids(path)
    file = Path(path) / "generation_config.json"
    if not file.is_file():
        return set()
    eos = json.loads(file.read_text()).get("eos_token_id")
    if eos is None:
        return set()
    return set(eos) if isinstance(eos, list) else {eos}


def _architecture(config: Any) -> str:
    archs = getattr(config, "architectures", None) or [""]
    return archs[0]


def iter_safetensors(model_dir: str | Path,
                     shard: Callable[[str, Any], torch.Tensor] | None = None
                     ) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every checkpoint tensor. With `shard(name, slice)` (tensor
    parallelism) each tensor is read through safetensors' get_slice and only the piece
    `shard` picks is materialised."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {str(model_dir)!r}")
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                if shard is None:
                    yield name, f.get_tensor(name)
                else:
                    yield name, shard(name, f.get_slice(name))


def _count_safetensors(model_dir: str | Path) -> int:
    total = 0
    for file in Path(model_dir).glob("*.safetensors"):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            total += len(f.keys())
    return total


def load_model(model_dir: str | Path, dtype: torch.dtype, device: torch.device,
               max_positions: int, tp_rank: int = 0, tp_size: int = 1,
               attention_backend: str = "torch", progress: LoadProgress | None = None) -> nn.Module:
    """The model, or with tp_size > 1 this rank's tensor-parallel shard of it; its layers
    attend with `attention_backend` (a name resolve_attention_backend returned). From a
    GGUF file each rank dequantizes every tensor and keeps its shard. On CPU its linear
    layers run on oneDNN-packed weights (cpu_linear) and its torch attention layers
    decode through the C++ paged kernel (cpu_kernels)."""
    config = load_hf_config(model_dir)
    cls = get_model_class(_architecture(config))
    # Build on meta (no random init, no memory), then materialize and fill from disk.
    with torch.device("meta"):
        model = cls(config, max_positions, tp_rank, tp_size, attention_backend=attention_backend)
    model = model.to(dtype=dtype).to_empty(device=device)
    model.reset_rotary(device)
    if model.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    shard = model.shard_checkpoint_tensor if tp_size > 1 else None
    if is_gguf_path(model_dir):
        weights, total = iter_gguf_weights(model_dir, config, shard), len(open_gguf(model_dir).tensors)
    else:
        weights, total = iter_safetensors(model_dir, shard), _count_safetensors(model_dir)
    model.load_weights(progress.track("weights", weights, total) if progress is not None else weights)
    model.eval()
    model.requires_grad_(False)
    if device.type == "cpu":
        pack_linears(model)  # oneDNN's blocked weights: faster GEMMs than MKL's on plain ones (cpu_linear)
        attach_cpu_kernels(model)  # decode attention over the paged cache in place (cpu_kernels)
    return model
