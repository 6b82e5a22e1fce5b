"""Expert weights of the MoE models (models/moe.py) from per-expert checkpoint tensors.

A Hugging Face MoE checkpoint stores every expert's projections as their own tensors,
`layers.{l}.mlp.experts.{e}.{gate_proj,up_proj,down_proj}.weight` (Mixtral:
`layers.{l}.block_sparse_moe.experts.{e}.{w1,w3,w2}.weight`, its router
`block_sparse_moe.gate`), and Qwen2-MoE a shared expert,
`mlp.shared_expert.{gate_proj,up_proj,down_proj}.weight`. llmd runs them from stacked
parameters: expert e's gate and up rows are `experts.w13[e]`'s two halves, its down
projection `experts.w2[e]`; the shared expert's gate and up are fused like a dense MLP's.

`ExpertTensorNames` says where a checkpoint tensor goes and, under tensor parallelism,
which piece of it this rank reads; `ExpertWeightLoader` copies the expert tensors in as
they stream past and hands every other tensor to the dense loader.
"""
from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from llmd.gpu.layers.tp import TPShape


@dataclass(frozen=True)
class ExpertTensor:
    """One checkpoint tensor of a sparse block."""

    param: str | None  # the parameter it is copied into here; None: the dense loader's, by name
    expert: int | None  # its index in a stacked parameter (None: not stacked)
    part: int  # which rows of the parameter: 0 gate (or the whole down), 1 up
    parts: int  # 2: the parameter is [gate | up] rows; 1: it is the tensor's shape
    split: str | None  # TP: "rows" or "cols" of the intermediate dimension; None: every rank all of it
    size: int  # the whole intermediate size that split cuts


class ExpertTensorNames:
    """Checkpoint names of one architecture's sparse blocks: `projections` are the
    expert's (gate, up, down) names, `renames` (old, new) pairs applied to every name
    first, the sizes those of the config (whole, before TP; shared None: no shared
    expert)."""

    def __init__(self, projections: tuple[str, str, str], renames: tuple[tuple[str, str], ...],
                 expert_size: int, shared_size: int | None) -> None:
        self.renames = renames
        self.roles = {name: role for role, name in enumerate(projections)}
        alternatives = "|".join(map(re.escape, projections))
        self.expert = re.compile(rf"layers\.(\d+)\.mlp\.experts\.(\d+)\.({alternatives})\.weight")
        self.shared = re.compile(r"layers\.(\d+)\.mlp\.shared_expert\.(gate_proj|up_proj|down_proj)\.weight")
        self.replicated = re.compile(r"layers\.\d+\.mlp\.(gate|shared_expert_gate)\.weight")
        self.expert_size = expert_size
        self.shared_size = shared_size

    def local_name(self, name: str) -> str:
        """The name as the models' loaders see it: no `model.` prefix, renames applied."""
        name = name.removeprefix("model.")
        for old, new in self.renames:
            name = name.replace(old, new)
        return name

    def classify(self, local_name: str) -> ExpertTensor | None:
        """Where a (local) tensor of a sparse block goes; None for any other tensor."""
        m = self.expert.fullmatch(local_name)
        if m is not None:
            layer, expert, role = int(m.group(1)), int(m.group(2)), self.roles[m.group(3)]
            if role < 2:
                return ExpertTensor(f"layers.{layer}.mlp.experts.w13", expert, role, 2, "rows", self.expert_size)
            return ExpertTensor(f"layers.{layer}.mlp.experts.w2", expert, 0, 1, "cols", self.expert_size)
        m = self.shared.fullmatch(local_name)
        if m is not None and self.shared_size is not None:
            if m.group(2) == "down_proj":
                return ExpertTensor(None, None, 0, 1, "cols", self.shared_size)
            part = 0 if m.group(2) == "gate_proj" else 1
            return ExpertTensor(f"layers.{m.group(1)}.mlp.shared_expert.gate_up_proj.weight", None, part, 2,
                                "rows", self.shared_size)
        if self.replicated.fullmatch(local_name):
            return ExpertTensor(None, None, 0, 1, None, 0)
        return None

    def shard(self, name: str, sl: Any, tp: TPShape) -> torch.Tensor | None:
        """This rank's piece of checkpoint tensor `name` (a safetensors slice) if it
        belongs to a sparse block, else None."""
        tensor = self.classify(self.local_name(name))
        if tensor is None:
            return None
        if tensor.split is None:
            return sl[:]
        size = tensor.size // tp.world_size
        start = tp.rank * size
        return sl[start:start + size] if tensor.split == "rows" else sl[:, start:start + size]


class ExpertWeightLoader:
    """Copies a model's expert tensors into its stacked parameters as the checkpoint
    streams past (`stream`), and yields every other tensor, renamed, for the dense
    loader. When the stream ends every expert of every sparse layer must have been
    read; each stacked parameter is then yielded as itself, so the dense loader's check
    for missing weights counts it as loaded (a copy onto itself changes nothing)."""

    def __init__(self, model: nn.Module, names: ExpertTensorNames) -> None:
        """`model` is a MoeForCausalLM (its sparse_blocks() name the expected experts)."""
        self.names = names
        self.params = dict(model.named_parameters())
        self.expected: set[tuple[str, int | None, int]] = set()
        for index, block in model.sparse_blocks().items():
            prefix = f"layers.{index}.mlp."
            for expert in range(block.experts.w13.shape[0]):
                self.expected |= {(prefix + "experts.w13", expert, 0), (prefix + "experts.w13", expert, 1),
                                  (prefix + "experts.w2", expert, 0)}
            if block.shared_expert is not None:
                fused = prefix + "shared_expert.gate_up_proj.weight"
                self.expected |= {(fused, None, 0), (fused, None, 1)}
        self.filled: set[tuple[str, int | None, int]] = set()

    def stream(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            local = self.names.local_name(name)
            target = self.names.classify(local)
            if target is None or target.param is None:
                yield local, tensor
            else:
                self._copy(local, tensor, target)
        missing = sorted(self.expected - self.filled, key=str)
        if missing:
            param, expert, part = missing[0]
            where = param if expert is None else f"{param}[{expert}]"
            raise ValueError(f"checkpoint is missing {len(missing)} expert weight(s), e.g. part {part} of {where!r}")
        for param in sorted({key[0] for key in self.expected}):
            yield param, self.params[param].data

    def _copy(self, name: str, tensor: torch.Tensor, target: ExpertTensor) -> None:
        param = self.params.get(target.param)
        if param is None or (target.expert is not None and target.expert >= param.shape[0]):
            raise ValueError(f"unexpected weight {name!r} in checkpoint")
        rows = param.data if target.expert is None else param.data[target.expert]
        size = rows.shape[0] // target.parts
        rows = rows[target.part * size:(target.part + 1) * size]
        if tensor.shape != rows.shape:
            raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(rows.shape)}")
        with torch.no_grad():
            rows.copy_(tensor)
        self.filled.add((target.param, target.expert, target.part))
