"""Build Hugging Face-format model directories for tests and benchmarks (the daemon's
own default model is a real one, llmd.builtin_model).

These random-weight models are fixtures with known, reproducible properties:

* a **byte-level BPE tokenizer** trained (deterministically, in well under a second)
  with the ``tokenizers`` library on Python's stdlib sources plus a short
  multilingual snippet, saved through transformers with a ChatML chat template
  (tools/fixture_tokenizer.py; the cache they are built into: tools/fixture_cache.py);
* **random-weight models** built from transformers' own config / ``*ForCausalLM``
  classes (Llama, Mistral, Qwen2, Qwen3, Gemma 2, Gemma 3 text, Phi-3, and the
  mixture-of-experts Qwen3-MoE, Qwen2-MoE and Mixtral; their presets and configs:
  tools/fixture_config.py, their weights' init: tools/fixture_init.py), saved as float32
  safetensors next to the tokenizer.

Public API::

    build_tokenizer(out_dir, vocab_size) -> Path
    build_model(out_dir, arch, preset, *, tie_word_embeddings=False, seed=0, **overrides) -> Path
    fixture_path(name, cache_dir=None) -> Path      # named, cached, built once
    demo_model_path() -> Path                       # the small llama fixture (CPU benchmarks)
    fixture_config.param_count(arch, preset, **overrides) -> int   # exact, without building
    greedy_stats(model_dir, prompts=..., steps=64)  # peakedness / diversity check

CLI::

    python -m llmd_tools.make_model --name tiny-llama [--out DIR]
    python -m llmd_tools.make_model --arch qwen3 --preset small [--tied] --out DIR
    python -m llmd_tools.make_model --list
    python -m llmd_tools.make_model --name tiny-qwen2 --check   # print peakedness stats

Facts the engine must know (all fixtures):

* special tokens (every vocab size): ``<|bos|>``=0, ``<|eos|>``=1, ``<|pad|>``=2,
  ``<|im_start|>``=3, ``<|im_end|>``=4. The tokenizer prepends BOS on encode, and the
  chat template starts with ``{{ bos_token }}``: encode rendered chat text with
  ``add_special_tokens=False``.
* tokenizers: llama/qwen3 fixtures use a plain byte-level BPE (no normalizer); qwen2
  fixtures use the pipeline transformers' Qwen2Tokenizer imposes (NFC normalizer, Qwen2
  split regex), because AutoTokenizer swaps that in for model_type qwen2 whatever
  tokenizer.json says. Either way AutoTokenizer and tokenizer.json give the same ids;
  decode(encode(x)) == x exactly (qwen2: for NFC text). Tokenizer vocab: tiny 1024,
  small 8192.
* ``config.json`` has ``eos_token_id`` = ``<|eos|>``; ``generation_config.json`` has
  ``eos_token_id`` = ``[<|eos|>, <|im_end|>]`` (a list, as real chat models do).
* padded vocab (default for ``qwen2``): ``config.vocab_size`` = ceil(V/64)*64 + 64 for a
  tokenizer of V tokens (1024 -> 1088). The padded ``lm_head`` / embedding rows are
  zero, so their logit is exactly 0 (never the greedy argmax here, but a sampler must
  still mask them: they are not valid output).
* sliding-window fixtures (tests/test_sliding_window.py): ``tiny-mistral-sw16`` has a
  16-token window on every layer; ``tiny-qwen2-sw24`` (``use_sliding_window``,
  ``max_window_layers=1``) has layer 0 in full and layers 1-2 with a 24-token window.
* Gemma / Phi-3 fixtures (tests/test_gemma_phi.py): ``tiny-gemma2-sw16`` (layers
  sliding 16 / full / sliding 16, attention soft-cap 8, final soft-cap 30, head_dim 24
  with query_pre_attn_scalar 32, tied embeddings); ``tiny-gemma3-sw16`` (sliding,
  sliding, full; q/k norms; local rope theta 100, global theta 10000 with linear
  scaling x4; final soft-cap 20; tied); ``tiny-phi3-longrope`` (fused qkv / gate_up,
  longrope with original_max_position_embeddings 48, partial rotary 0.75, a 16-token
  window on every layer, padded vocab). Their ``(1 + w)`` norms are initialised like
  the others' ``w`` (centred on 1 once the model adds the 1).
* mixture-of-experts fixtures (tests/test_moe.py): 8 experts, 2 per token, each of
  intermediate size 32. ``tiny-qwen3-moe``: top-2 weights renormalised
  (``norm_topk_prob``), layer 1 a dense MLP (``mlp_only_layers``); ``tiny-qwen2-moe``:
  a shared expert of size 64 with its sigmoid gate, weights not renormalised;
  ``tiny-mixtral``. The router's logits have std ~ROUTER_GAIN, so most tokens' top-2
  choice is clear of the third expert.
* llama fixtures use llama3 RoPE scaling (``config.rope_parameters`` with
  ``rope_type="llama3"``), with a small ``original_max_position_embeddings`` so the
  scaling changes results.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Iterator, Sequence

from llmd_tools import fixture_cache, fixture_config, fixture_init, fixture_tokenizer
from llmd_tools.fixture_cache import (RECIPE_VERSION, _build_atomically, _hash, _versions,  # noqa: F401
                                      default_cache_dir, source_hash)
from llmd_tools.fixture_config import ARCHS, PRESETS, SAVE_DTYPES, resolve_config
from llmd_tools.fixture_init import TARGET_LOGIT_STD, _peaked_init_
from llmd_tools.fixture_tokenizer import (ARCH_TOKENIZER_FLAVOUR, BOS, EOS, IM_END, IM_START, PAD,  # noqa: F401
                                          SPECIAL_TOKENS, TOKENIZER_FLAVOURS, _corpus_hash, build_tokenizer,
                                          special_token_ids)

DEFAULT_PROMPTS = (
    "Hello, world! This is a test of the inference engine.",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "The quick brown fox jumps over the lazy dog. 你好，世界！",
    "import os\nimport sys\n\nclass Config:",
)

# name -> build recipe: arch, preset, and optionally tie_word_embeddings, seed, and any
# build_model override (see resolve_config), e.g. dict(arch="qwen2", preset="tiny",
# pad_vocab=False). Changing a recipe (or this module) changes the cache key.
FIXTURES: dict[str, dict[str, Any]] = {
    "tiny-llama": dict(arch="llama", preset="tiny"),
    "tiny-llama-tied": dict(arch="llama", preset="tiny", tie_word_embeddings=True),
    "tiny-qwen2": dict(arch="qwen2", preset="tiny"),
    "tiny-qwen3": dict(arch="qwen3", preset="tiny"),
    "tiny-mistral-sw16": dict(arch="mistral", preset="tiny", sliding_window=16),
    "tiny-qwen2-sw24": dict(arch="qwen2", preset="tiny", use_sliding_window=True, sliding_window=24,
                            max_window_layers=1),
    "tiny-gemma2-sw16": dict(arch="gemma2", preset="tiny", tie_word_embeddings=True, head_dim=24,
                             query_pre_attn_scalar=32, sliding_window=16, attn_logit_softcapping=8.0,
                             final_logit_softcapping=30.0),
    "tiny-gemma3-sw16": dict(arch="gemma3", preset="tiny", tie_word_embeddings=True, head_dim=24,
                             query_pre_attn_scalar=32, sliding_window=16, final_logit_softcapping=20.0,
                             layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                             rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                                              "full_attention": {"rope_type": "linear", "factor": 4.0,
                                                                 "rope_theta": 10000.0}}),
    "tiny-phi3-longrope": dict(arch="phi3", preset="tiny", pad_vocab=True, sliding_window=16,
                               original_max_position_embeddings=48,
                               rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                                "partial_rotary_factor": 0.75,
                                                "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5],
                                                "long_factor": [1.0, 1.5, 2.5, 4.0, 6.0, 9.0]}),
    "tiny-qwen3-moe": dict(arch="qwen3_moe", preset="tiny", num_experts=8, num_experts_per_tok=2,
                           moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=[1]),
    "tiny-qwen2-moe": dict(arch="qwen2_moe", preset="tiny", num_experts=8, num_experts_per_tok=2,
                           moe_intermediate_size=32, shared_expert_intermediate_size=64),
    "tiny-mixtral": dict(arch="mixtral", preset="tiny", num_local_experts=8, num_experts_per_tok=2,
                         intermediate_size=32),
    "small-llama": dict(arch="llama", preset="small"),
    "small-qwen2": dict(arch="qwen2", preset="small"),
    "small-qwen3": dict(arch="qwen3", preset="small"),
    # tools/bench_moe.py: a MoE model and the dense model with its active parameters
    # (moe_defaults: 8 experts of 1408 / 8 = 176, 2 per token, so a dense MLP of 352).
    "small-qwen3-moe": dict(arch="qwen3_moe", preset="small"),
    "small-qwen3-active": dict(arch="qwen3", preset="small", intermediate_size=352),
}
DEMO_FIXTURE = "small-llama"


# ---------------------------------------------------------------------------------------
# models
# ---------------------------------------------------------------------------------------


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            hf_logging.enable_progress_bar()


def build_model(
    out_dir: Path,
    arch: str,
    preset: str,
    *,
    tie_word_embeddings: bool = False,
    seed: int = 0,
    cache_dir: Path | None = None,
    verbose: bool = False,
    **overrides: Any,
) -> Path:
    """Build a random-weight ``arch`` model of ``preset`` size into ``out_dir``: float32
    (or ``dtype=``) ``model.safetensors``, ``config.json``, ``generation_config.json``, tokenizer files
    and ``llmd_fixture.json`` (recipe, ``param_count``, vocab sizes, build time).

    ``overrides``: see resolve_config. Returns ``out_dir``."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    t0 = time.time()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    cfg, tok_vocab = resolve_config(arch, preset, tie_word_embeddings=tie_word_embeddings, **overrides)
    init = overrides.get("init", "peaked")
    if init not in ("peaked", "hf"):
        raise ValueError(f"init must be 'peaked' or 'hf', not {init!r}")
    save_dtype = overrides.get("dtype", "float32")
    if save_dtype not in SAVE_DTYPES:
        raise ValueError(f"dtype must be one of {SAVE_DTYPES}, not {save_dtype!r}")

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.eval()
    scale = 1.0
    with torch.no_grad():
        if init == "peaked":
            scale = _peaked_init_(model, cfg, logit_std=float(overrides.get("logit_std", TARGET_LOGIT_STD)))
        if cfg.vocab_size > tok_vocab:
            # padded rows: never produced by the tokenizer; zero embedding, logit exactly 0
            model.get_input_embeddings().weight[tok_vocab:].zero_()
            model.get_output_embeddings().weight[tok_vocab:].zero_()
    n_params = sum(p.numel() for p in model.parameters())
    if save_dtype != "float32":
        model.to(getattr(torch, save_dtype))
        model.config.dtype = save_dtype

    ids = special_token_ids()
    model.generation_config = GenerationConfig(
        bos_token_id=ids[BOS],
        eos_token_id=[ids[EOS], ids[IM_END]],
        pad_token_id=ids[PAD],
    )
    with _quiet_transformers():
        model.save_pretrained(str(out_dir), safe_serialization=True)
    flavour = overrides.get("tokenizer_flavour", ARCH_TOKENIZER_FLAVOUR[arch])
    build_tokenizer(
        out_dir, tok_vocab, flavour=flavour, model_max_length=cfg.max_position_embeddings, cache_dir=cache_dir
    )
    meta = {
        "arch": arch,
        "preset": preset,
        "tie_word_embeddings": tie_word_embeddings,
        "seed": seed,
        "overrides": overrides,
        "param_count": n_params,
        "tokenizer_vocab_size": tok_vocab,
        "tokenizer_flavour": flavour,
        "model_vocab_size": cfg.vocab_size,
        "final_norm_scale": scale,
        "special_token_ids": ids,
        "build_seconds": round(time.time() - t0, 3),
    }
    (out_dir / "llmd_fixture.json").write_text(json.dumps(meta, indent=2, default=str) + "\n")
    if verbose:
        print(
            f"built {arch}/{preset} tied={tie_word_embeddings}: {n_params:,} params, "
            f"vocab {cfg.vocab_size} (tokenizer {tok_vocab}), {time.time() - t0:.2f}s -> {out_dir}",
            file=sys.stderr,
        )
    return out_dir


# ---------------------------------------------------------------------------------------
# named, cached fixtures
# ---------------------------------------------------------------------------------------


def builder_sources() -> tuple[Path, ...]:
    """The modules whose code makes a fixture's files: this one, the configs', the
    init's, the tokenizer's and the cache's (their bytes are part of every fixture's key)."""
    return tuple(Path(m.__file__) for m in (sys.modules[__name__], fixture_config, fixture_init, fixture_tokenizer,
                                             fixture_cache))


def recipe_key(name: str) -> str:
    """Hash of everything that determines fixture ``name``'s files."""
    if name not in FIXTURES:
        raise KeyError(f"unknown fixture {name!r}; known: {sorted(FIXTURES)}")
    return _hash(
        {
            "v": RECIPE_VERSION,
            "recipe": FIXTURES[name],
            "source": source_hash(*builder_sources()),
            "corpus": _corpus_hash(),
            **_versions(),
        }
    )[:12]


def fixture_path(name: str, cache_dir: Path | None = None) -> Path:
    """Directory of the named fixture, built on first use and cached (keyed by a hash of
    the recipe, this module's source, the corpus and library versions)."""
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    final = cache / f"{name}-{recipe_key(name)}"
    if final.is_dir():
        return final
    r = dict(FIXTURES[name])

    def build(tmp: Path) -> None:
        build_model(
            tmp,
            r.pop("arch"),
            r.pop("preset"),
            tie_word_embeddings=r.pop("tie_word_embeddings", False),
            seed=r.pop("seed", 0),
            cache_dir=cache,
            **r.pop("overrides", {}),
            **r,  # any other key is an override too
        )

    path = _build_atomically(final, build)
    _prune_stale(cache, name, keep=final)
    return path


STALE_AFTER_S = 3600.0


def _prune_stale(cache: Path, name: str, keep: Path) -> None:
    """Remove builds of ``name`` from older recipes (untouched for STALE_AFTER_S, so a
    process still running older code is not pulled from under)."""
    pat = re.compile(re.escape(name) + r"-[0-9a-f]{12}")
    now = time.time()
    for d in cache.iterdir():
        if d != keep and pat.fullmatch(d.name) and d.is_dir():
            try:
                if now - d.stat().st_mtime > STALE_AFTER_S:
                    shutil.rmtree(d, ignore_errors=True)
            except OSError:
                pass


def demo_model_path() -> Path:
    """The small llama fixture the CPU benchmarks run on by default (built on first use)."""
    return fixture_path(DEMO_FIXTURE)


# ---------------------------------------------------------------------------------------
# peakedness check (HF reference greedy decoding, fp32)
# ---------------------------------------------------------------------------------------


def greedy_stats(model_dir: Path, prompts: Sequence[str] = DEFAULT_PROMPTS, steps: int = 64) -> dict[str, Any]:
    """Greedy-decode ``steps`` tokens per prompt with HF transformers (fp32, KV cache, no
    stopping) and report top1-top2 logprob gaps and output diversity."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    with _quiet_transformers():
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model.eval()
    gaps: list[float] = []
    p_top1: list[float] = []
    seqs: list[list[int]] = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([tok(prompt).input_ids])
            out = model(ids, use_cache=True)
            past = out.past_key_values
            logits = out.logits[0, -1]
            seq: list[int] = []
            for _ in range(steps):
                lp = torch.log_softmax(logits.float(), dim=-1)
                top = torch.topk(lp, 2)
                gaps.append(float(top.values[0] - top.values[1]))
                p_top1.append(float(top.values[0].exp()))
                nxt = int(top.indices[0])
                seq.append(nxt)
                out = model(torch.tensor([[nxt]]), past_key_values=past, use_cache=True)
                past = out.past_key_values
                logits = out.logits[0, -1]
            seqs.append(seq)
    g = torch.tensor(gaps)
    return {
        "frac_gap_gt_0.05": float((g > 0.05).float().mean()),
        "min_gap": float(g.min()),
        "median_gap": float(g.median()),
        "median_p_top1": float(torch.tensor(p_top1).median()),
        "distinct_per_seq": [len(set(s)) for s in seqs],
        "max_id": max(max(s) for s in seqs),
        "sequences": seqs,
        "texts": [tok.decode(s) for s in seqs],
    }


# ---------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m llmd_tools.make_model", description=__doc__.split("\n\n")[0])
    ap.add_argument("--name", help=f"named fixture: {', '.join(FIXTURES)} (cached)")
    ap.add_argument("--demo", action="store_true", help="the demo model (cached)")
    ap.add_argument("--arch", choices=ARCHS, help="custom build: architecture")
    ap.add_argument("--preset", choices=tuple(PRESETS), default="tiny", help="custom build: size preset")
    ap.add_argument("--tied", action="store_true", help="custom build: tie word embeddings")
    ap.add_argument("--pad-vocab", choices=("yes", "no"), help="custom build: pad model vocab (default: qwen2 only)")
    ap.add_argument("--no-llama3-rope", action="store_true", help="custom build: plain RoPE for llama")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, help="output dir (custom build: required; --name: cache dir)")
    ap.add_argument("--check", action="store_true", help="print greedy peakedness/diversity stats")
    ap.add_argument("--list", action="store_true", help="list named fixtures")
    a = ap.parse_args(argv)

    if a.list:
        for n, r in FIXTURES.items():
            print(n, json.dumps(r))
        return 0
    if a.name or a.demo:
        name = DEMO_FIXTURE if a.demo else a.name
        if name not in FIXTURES:
            ap.error(f"unknown fixture {name!r}; known: {', '.join(FIXTURES)}")
        path = fixture_path(name, a.out)
    elif a.arch:
        if a.out is None:
            ap.error("--out is required for a custom build")
        ov: dict[str, Any] = {}
        if a.pad_vocab:
            ov["pad_vocab"] = a.pad_vocab == "yes"
        if a.no_llama3_rope:
            ov["llama3_rope"] = False
        path = build_model(a.out, a.arch, a.preset, tie_word_embeddings=a.tied, seed=a.seed, verbose=True, **ov)
    else:
        ap.error("give --name, --demo, --arch or --list")
    meta_path = path / "llmd_fixture.json"
    if meta_path.is_file():
        meta = json.loads(meta_path.read_text())
        print(
            f"{meta['arch']}/{meta['preset']}: {meta['param_count']:,} params, vocab "
            f"{meta['model_vocab_size']} (tokenizer {meta['tokenizer_vocab_size']})",
            file=sys.stderr,
        )
    if a.check:
        st = greedy_stats(path)
        st.pop("sequences")
        print(json.dumps(st, indent=2, ensure_ascii=False), file=sys.stderr)
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
