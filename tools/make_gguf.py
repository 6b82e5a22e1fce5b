"""Quantized GGUF fixtures of real shapes, made as a user makes one: a random-weight HF
model (make_model) converted by the `convert_hf_to_gguf.py` that llama-cpp-python ships
(to BF16), then quantized by llama.cpp's own quantizer through the binding
(`llama_model_quantize`): the K-quant mixes (Q4_K_M: Q4_K with Q6_K for some tensors)
exactly as llama.cpp picks them. Needs llama-cpp-python (the `llamacpp` extra); where its
wheel does not install the converter (0.3.36's do not), LLMD_CONVERT_HF_TO_GGUF names the
one in its sdist (`pip download --no-binary :all: --no-deps llama-cpp-python==V`, then
`vendor/llama.cpp/convert_hf_to_gguf.py`, its gguf-py beside it).

Built once per recipe and cached under the fixture cache (make_model.default_cache_dir):
`<name>-<key>/<name>-<TYPE>.gguf` for each type of the recipe, the key a hash of the
recipe, make_model's and this module's sources, the converter, llama-cpp-python's version
and the library versions. The HF model (bf16 safetensors) and the BF16 GGUF are
intermediates, deleted once the quantized files exist (the BF16 GGUF kept where the
recipe lists BF16 among its types); `build_hf_model` makes the HF model again for a
test's reference.

    python -m llmd_tools.make_gguf --name llama3.2-1b [--type Q4_K_M] [--threads 2]
    python -m llmd_tools.make_gguf --list

prints the path of each file (built on first use: the 1B model takes minutes and ~5 GB of
memory at its peak, 2.5 GB of disk for the intermediates).

Five adaptations of the converter, all from outside it (its file is not changed):
* it imports `mistral_common` at the top, used only for Mistral-format models; the
  package pins numpy<2.4 (so it is not installed beside llmd), so where it is missing
  the converter gets placeholder modules whose names fail if ever called;
* it reads transformers 4's `rope_theta` / `rope_scaling`; transformers 5 writes
  `rope_parameters`, so the legacy keys are derived from it before the converter reads
  the config (else the file would say rope base 10000);
* it imports `sentencepiece` before it looks for a `tokenizer.model` (and falls back to
  tokenizer.json on the FileNotFoundError); without the package, a model that has no
  tokenizer.model gets that FileNotFoundError first;
* Gemma 2's takes a sentencepiece vocabulary only: on that FileNotFoundError it takes the
  fixture's BPE one as the converter takes any other model's (`_set_vocab_gpt2`);
* it identifies a BPE pre-tokenizer by hashing a test string's token ids, which only
  knows published tokenizers; the fixtures' tokenizer splits text with GPT-2's byte-level
  regex (make_model's "bytelevel" flavour), llama.cpp's pre-tokenizer "gpt-2".
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import hashlib
import importlib.metadata
import importlib.util
import logging
import os
import shutil
import sys
import sysconfig
import time
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from llmd_tools import make_model

# name -> recipe: make_model.build_model's arguments (arch, preset, overrides) and the
# types to make: llama.cpp's quantized types, and "BF16" for the converter's own file.
GGUF_FIXTURES: dict[str, dict[str, Any]] = {
    # Llama 3.2 1B's shapes and rope: theta 500000 (the preset's) and llama3 scaling x32
    # from 8192 positions (low/high frequency factors 1 and 4, make_model's defaults),
    # which the converter writes as a `rope_freqs` tensor, as for the real model
    "llama3.2-1b": dict(arch="llama", preset="llama3.2-1b", tie_word_embeddings=True, llama3_rope={"factor": 32.0},
                        dtype="bfloat16", types=("Q4_K_M", "Q8_0")),
    # the same pipeline in seconds (tests/test_make_gguf.py): rows of 256 and 512, so
    # every K-quant block fits and Q4_K_M picks its K-quants as for the 1B model. No llama3
    # rope: that test's reference is transformers reading the GGUF, which skips rope_freqs
    "tiny-llama-256": dict(arch="llama", preset="tiny", tie_word_embeddings=True, llama3_rope=False,
                           hidden_size=256, intermediate_size=512, num_hidden_layers=2, head_dim=64, rope_theta=500000.0,
                           dtype="bfloat16", types=("Q4_K_M", "Q8_0")),
    # llama3 rope scaling (the tiny preset's: x8 from 64 positions; of its 8 frequencies one
    # kept, two blended, five divided by 8) through the converter's rope_freqs
    # (tests/test_gguf_rope_freqs.py); Q8_0's blocks fit rows of 64 and 192
    "tiny-llama3-rope": dict(arch="llama", preset="tiny", intermediate_size=192, dtype="bfloat16",
                             types=("BF16", "Q8_0")),
    # a mixture of experts through the same pipeline in seconds (tests/test_make_gguf.py):
    # experts of 768 (transformers' GGUF reader, the test's reference, takes Qwen3MoeConfig's
    # default: it ignores expert_feed_forward_length), rows of 256 and 768 for the K-quants
    "tiny-qwen3-moe-256": dict(arch="qwen3_moe", preset="tiny", hidden_size=256, num_hidden_layers=2, head_dim=64,
                               num_experts=8, num_experts_per_tok=2, moe_intermediate_size=768,
                               norm_topk_prob=True, dtype="bfloat16", types=("Q4_K_M", "Q8_0")),
    # a mixture of experts of real shapes (Qwen3-30B-A3B's layout scaled down: 32 experts of
    # 512, 4 per token, hidden 1024, 8 layers; ~440M weights, ~80M active per token):
    # llama.cpp's converter stacks the experts (ffn_*_exps) and its Q4_K_M mix gives them
    # their own types (tools/bench_gguf.py against llama.cpp, docs/benchmarks.md)
    "qwen3-moe-32x512": dict(arch="qwen3_moe", preset="small", hidden_size=1024, num_hidden_layers=8,
                             num_attention_heads=16, num_key_value_heads=4, head_dim=64, num_experts=32,
                             num_experts_per_tok=4, moe_intermediate_size=512, norm_topk_prob=True,
                             dtype="bfloat16", types=("Q4_K_M", "Q8_0")),
    # the same with Qwen3-30B-A3B's expert width, 768: three 256-weight blocks a row of the
    # down projections, which two ranks cannot split equally (tp.split_share: 512 / 256)
    "qwen3-moe-32x768": dict(arch="qwen3_moe", preset="small", hidden_size=1024, num_hidden_layers=8,
                             num_attention_heads=16, num_key_value_heads=4, head_dim=64, num_experts=32,
                             num_experts_per_tok=4, moe_intermediate_size=768, norm_topk_prob=True,
                             dtype="bfloat16", types=("Q4_K_M",)),
    # Gemma 2 2B's shapes (26 layers, hidden 2304, 8 heads of 256, 4 KV heads, intermediate
    # 9216, vocab 256000 tied: the tokenizer's 8192 tokens, the rest padding), its window of
    # 4096 on every other layer and soft-caps 50 / 30 (tools/bench_gguf.py; 10 GB in fp32)
    "gemma2-2b": dict(arch="gemma2", preset="llama3.2-1b", tie_word_embeddings=True, hidden_size=2304,
                      num_hidden_layers=26, num_attention_heads=8, num_key_value_heads=4, head_dim=256,
                      intermediate_size=9216, vocab_size=256000, max_position_embeddings=8192, rope_theta=10000.0,
                      sliding_window=4096, query_pre_attn_scalar=256, attn_logit_softcapping=50.0,
                      final_logit_softcapping=30.0, dtype="bfloat16", types=("Q4_K_M",)),
}
CONVERTED_TYPE = "BF16"  # the converter's output, kept when a recipe lists it

# The llama_ftype names llama.cpp's quantize tool takes, for the types offered here.
QUANT_FTYPES = {"Q4_0": "LLAMA_FTYPE_MOSTLY_Q4_0", "Q4_1": "LLAMA_FTYPE_MOSTLY_Q4_1",
                "Q5_0": "LLAMA_FTYPE_MOSTLY_Q5_0", "Q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0",
                "Q4_K_S": "LLAMA_FTYPE_MOSTLY_Q4_K_S", "Q4_K_M": "LLAMA_FTYPE_MOSTLY_Q4_K_M",
                "Q5_K_M": "LLAMA_FTYPE_MOSTLY_Q5_K_M", "Q6_K": "LLAMA_FTYPE_MOSTLY_Q6_K"}
# llama.cpp's pre-tokenizer name for each make_model tokenizer flavour.
PRE_TOKENIZERS = {"bytelevel": "gpt-2", "qwen2": "qwen2"}
# The modules and names the converter imports from mistral_common.
_MISTRAL_IMPORTS = {
    "mistral_common.tokens.tokenizers.base": ("TokenizerVersion",),
    "mistral_common.tokens.tokenizers.multimodal": ("DATASET_MEAN", "DATASET_STD"),
    "mistral_common.tokens.tokenizers.tekken": ("Tekkenizer",),
    "mistral_common.tokens.tokenizers.sentencepiece": ("SentencePieceTokenizer",),
}


class LlamaCppUnavailable(RuntimeError):
    """llama-cpp-python (its converter or its quantizer) is not installed."""


def converter_path() -> Path:
    """The convert_hf_to_gguf.py that $LLMD_CONVERT_HF_TO_GGUF names, else the one
    llama-cpp-python installs (`<purelib>/bin/`; its wheels stopped shipping it by 0.3.36:
    then the sdist's `vendor/llama.cpp/convert_hf_to_gguf.py`, named by the variable, with
    the `gguf-py` beside it)."""
    named = os.environ.get("LLMD_CONVERT_HF_TO_GGUF")
    path = Path(named) if named else Path(sysconfig.get_paths()["purelib"]) / "bin" / "convert_hf_to_gguf.py"
    if not path.is_file():
        raise LlamaCppUnavailable(f"{path} not found: install llama-cpp-python (pip install -e '.[llamacpp]'), or set "
                                  "LLMD_CONVERT_HF_TO_GGUF to the convert_hf_to_gguf.py of its sdist's vendor/llama.cpp")
    return path


def _llama_cpp() -> Any:
    try:
        import llama_cpp
    except ImportError as e:
        raise LlamaCppUnavailable(f"llama-cpp-python is not installed ({e}): pip install -e '.[llamacpp]'") from e
    return llama_cpp


class _MissingMistralName:
    """Stands for a mistral_common name the converter imports but a non-Mistral model
    never uses: using it says why it is missing."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> Any:
        raise LlamaCppUnavailable(f"{self._name}.{attr}: mistral_common is not installed (needed only to "
                                  "convert Mistral-format models)")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise LlamaCppUnavailable(f"{self._name}(): mistral_common is not installed (needed only to convert "
                                  "Mistral-format models)")


@contextlib.contextmanager
def _mistral_common_or_placeholders() -> Iterator[None]:
    """mistral_common as it is, or placeholder modules in sys.modules while the
    converter is imported (removed afterwards: nothing else sees them)."""
    if importlib.util.find_spec("mistral_common") is not None:
        yield
        return
    added = []
    for module, names in _MISTRAL_IMPORTS.items():
        parts = module.split(".")
        for i in range(1, len(parts) + 1):
            prefix = ".".join(parts[:i])
            if prefix not in sys.modules:
                sys.modules[prefix] = types.ModuleType(prefix)
                added.append(prefix)
        for name in names:
            setattr(sys.modules[module], name, _MissingMistralName(name))
    try:
        yield
    finally:
        for prefix in added:
            sys.modules.pop(prefix, None)


@contextlib.contextmanager
def _converter_imports(folder: Path) -> Iterator[None]:
    """While the converter is imported, what it imports when run as a script: its folder
    on sys.path (newer ones keep their `conversion` package there) and the gguf-py it is
    shipped with, where there is one (its classes may be newer than the gguf package's of
    the same version). Afterwards sys.modules holds the installed gguf again; the
    converter keeps the one it imported."""
    vendored = folder / "gguf-py"
    paths = [str(folder)] + ([str(vendored)] if vendored.is_dir() else [])
    installed = {name: sys.modules.pop(name) for name in list(sys.modules)
                 if vendored.is_dir() and (name == "gguf" or name.startswith("gguf."))}
    sys.path[:0] = paths
    try:
        yield
    finally:
        del sys.path[:len(paths)]
        for name in [n for n in sys.modules if n == "gguf" or n.startswith("gguf.")] if installed else ():
            del sys.modules[name]
        sys.modules.update(installed)


def load_converter() -> types.ModuleType:
    """The shipped converter as a module (imported once), adapted as the module doc says:
    `ModelBase.load_hparams` adds transformers 4's rope keys. The pre-tokenizer is set per
    conversion (convert_hf_to_gguf)."""
    if "_llmd_convert_hf_to_gguf" in sys.modules:
        return sys.modules["_llmd_convert_hf_to_gguf"]
    path = converter_path()
    spec = importlib.util.spec_from_file_location("_llmd_convert_hf_to_gguf", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    with _converter_imports(path.parent), _mistral_common_or_placeholders():
        spec.loader.exec_module(module)
        if hasattr(module, "load_all_models"):  # newer converters: each model's class in a module of its own
            module.load_all_models()
    load_hparams = module.ModelBase.load_hparams

    def load_hparams_with_legacy_rope(dir_model: Path, is_mistral_format: bool) -> dict[str, Any]:
        return with_legacy_rope_keys(load_hparams(dir_model, is_mistral_format))

    module.ModelBase.load_hparams = staticmethod(load_hparams_with_legacy_rope)
    sys.modules["_llmd_convert_hf_to_gguf"] = module
    return module


def with_legacy_rope_keys(hparams: dict[str, Any]) -> dict[str, Any]:
    """`hparams` plus transformers 4's `rope_theta` and `rope_scaling` (and, for llama3
    scaling, the top-level `original_max_position_embeddings` the converter reads) from
    transformers 5's `rope_parameters`; keys already there are kept."""
    rope = hparams.get("rope_parameters")
    if not isinstance(rope, dict) or "rope_type" not in rope:  # absent, or one per layer type (gemma3)
        return hparams
    out = dict(hparams)
    if "rope_theta" in rope:
        out.setdefault("rope_theta", rope["rope_theta"])
    if rope["rope_type"] != "default":
        out.setdefault("rope_scaling", {k: v for k, v in rope.items() if k != "rope_theta"})
        if "original_max_position_embeddings" in rope:
            out.setdefault("original_max_position_embeddings", rope["original_max_position_embeddings"])
    return out


def converter_model_class(conv: types.ModuleType, arch: str) -> Any:
    """The converter's class for the HF architecture `arch` (e.g. "LlamaForCausalLM")."""
    if hasattr(conv, "get_model_class"):  # newer converters import a model's class on demand
        return conv.get_model_class(arch)
    return conv.ModelBase.from_model_architecture(arch, model_type=conv.ModelType.TEXT)


def convert_hf_to_gguf(hf_dir: Path, out: Path, outtype: str = "bf16", pre_tokenizer: str = "gpt-2",
                       model_name: str | None = None) -> Path:
    """Convert the HF directory `hf_dir` to the GGUF `out` (`outtype`: f32, f16, bf16 or
    q8_0) with the shipped converter. `pre_tokenizer`: llama.cpp's name for the BPE
    pre-tokenizer, used when the converter does not recognise the tokenizer itself;
    `model_name`: general.name (default: the converter's, from the directory's name)."""
    import torch

    conv = load_converter()
    ftypes = {"f32": conv.gguf.LlamaFileType.ALL_F32, "f16": conv.gguf.LlamaFileType.MOSTLY_F16,
              "bf16": conv.gguf.LlamaFileType.MOSTLY_BF16, "q8_0": conv.gguf.LlamaFileType.MOSTLY_Q8_0}
    if outtype not in ftypes:
        raise ValueError(f"outtype must be one of {sorted(ftypes)}, not {outtype!r}")
    hparams = conv.ModelBase.load_hparams(Path(hf_dir), False)
    arch = conv.get_model_architecture(hparams, conv.ModelType.TEXT)
    model_class = converter_model_class(conv, arch)
    recognised = model_class.get_vocab_base_pre

    def vocab_base_pre(self: Any, tokenizer: Any) -> str:
        log = logging.getLogger("hf-to-gguf")
        level = log.level
        log.setLevel(logging.ERROR)  # its banner about an unrecognised tokenizer: expected here
        try:
            return recognised(self, tokenizer)
        except NotImplementedError:  # "BPE pre-tokenizer was not recognized"
            return pre_tokenizer
        finally:
            log.setLevel(level)

    sentencepiece_vocab, set_vocab = model_class._create_vocab_sentencepiece, model_class.set_vocab

    def sentencepiece_vocab_if_any(self: Any) -> Any:
        if not (self.dir_model / "tokenizer.model").is_file():
            raise FileNotFoundError(f"no tokenizer.model in {self.dir_model}")  # as the converter raises it
        return sentencepiece_vocab(self)

    def vocab_of_any_kind(self: Any) -> None:  # Gemma 2's takes a sentencepiece model only
        try:
            set_vocab(self)
        except FileNotFoundError:
            self._set_vocab_gpt2()

    with (torch.inference_mode(), _patched(model_class, "get_vocab_base_pre", vocab_base_pre),
          _patched(model_class, "_create_vocab_sentencepiece", sentencepiece_vocab_if_any),
          _patched(model_class, "set_vocab", vocab_of_any_kind)):
        model = model_class(Path(hf_dir), ftypes[outtype], Path(out), model_name=model_name)
        model.write()
    return Path(out)


@contextlib.contextmanager
def _patched(owner: Any, name: str, value: Any) -> Iterator[None]:
    had = name in vars(owner)
    old = vars(owner).get(name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        if had:
            setattr(owner, name, old)
        else:
            delattr(owner, name)


def quantize_gguf(src: Path, out: Path, quant: str, threads: int = 0) -> Path:
    """llama.cpp's quantizer (as its `llama-quantize SRC OUT TYPE`) through the binding;
    `threads` 0: llama.cpp's default (every core)."""
    if quant not in QUANT_FTYPES:
        raise ValueError(f"quant must be one of {sorted(QUANT_FTYPES)}, not {quant!r}")
    llama_cpp = _llama_cpp()
    llama_cpp.llama_backend_init()
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, QUANT_FTYPES[quant])
    params.nthread = threads
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(out).encode(), params)
    if rc != 0 or not Path(out).is_file():
        raise RuntimeError(f"llama_model_quantize({src} -> {quant}) failed (returned {rc})")
    return Path(out)


def recipe_key(name: str) -> str:
    """Hash of everything that determines fixture `name`'s files."""
    if name not in GGUF_FIXTURES:
        raise KeyError(f"unknown GGUF fixture {name!r}; known: {sorted(GGUF_FIXTURES)}")
    sources = [*make_model.builder_sources(), Path(__file__), converter_path()]
    return make_model._hash({
        "recipe": GGUF_FIXTURES[name],
        "sources": [hashlib.sha256(p.read_bytes()).hexdigest() for p in sources],
        "llama_cpp": importlib.metadata.version("llama_cpp_python"),
        "corpus": make_model._corpus_hash(),
        **make_model._versions(),
    })[:12]


def gguf_fixture(name: str, quant: str, cache_dir: Path | None = None, threads: int = 0,
                 verbose: bool = False) -> Path:
    """The `quant` GGUF of fixture `name`, built (every type of its recipe at once) on
    first use and cached."""
    if name not in GGUF_FIXTURES:
        raise KeyError(f"unknown GGUF fixture {name!r}; known: {sorted(GGUF_FIXTURES)}")
    recipe = dict(GGUF_FIXTURES[name])
    quants = tuple(recipe.pop("types"))
    if quant not in quants:
        raise ValueError(f"GGUF fixture {name!r} is made in {', '.join(quants)}, not {quant!r}")
    cache = Path(cache_dir) if cache_dir is not None else make_model.default_cache_dir()
    final = cache / f"{name}-{recipe_key(name)}"

    def build(tmp: Path) -> None:
        log = (lambda msg: print(f"make_gguf {name}: {msg}", file=sys.stderr)) if verbose else (lambda msg: None)
        started = time.monotonic()
        hf_dir, bf16 = tmp / "hf", tmp / f"{name}-{CONVERTED_TYPE}.gguf"
        build_hf_model(name, hf_dir, cache)
        gc.collect()  # the float32 model built there: gone before the converter reads
        log(f"HF model built ({time.monotonic() - started:.0f} s)")
        flavour = recipe.get("tokenizer_flavour", make_model.ARCH_TOKENIZER_FLAVOUR[recipe["arch"]])
        convert_hf_to_gguf(hf_dir, bf16, "bf16", PRE_TOKENIZERS[flavour], model_name=name)
        shutil.copy(hf_dir / "llmd_fixture.json", tmp / "llmd_fixture.json")
        shutil.rmtree(hf_dir)
        log(f"converted to {CONVERTED_TYPE} ({time.monotonic() - started:.0f} s)")
        for q in quants:
            if q == CONVERTED_TYPE:
                continue
            quantize_gguf(bf16, tmp / f"{name}-{q}.gguf", q, threads)
            log(f"quantized to {q} ({time.monotonic() - started:.0f} s)")
        if CONVERTED_TYPE not in quants:
            bf16.unlink()

    path = make_model._build_atomically(final, build) / f"{name}-{quant}.gguf"
    make_model._prune_stale(cache, name, keep=final)
    return path


def build_hf_model(name: str, out: Path, cache_dir: Path | None = None) -> Path:
    """Fixture `name`'s HF model in `out`: the one its GGUFs are converted from (the build
    deletes its own; the same recipe and seed give the same weights), for a test's
    reference."""
    if name not in GGUF_FIXTURES:
        raise KeyError(f"unknown GGUF fixture {name!r}; known: {sorted(GGUF_FIXTURES)}")
    recipe = {k: v for k, v in GGUF_FIXTURES[name].items() if k != "types"}
    return make_model.build_model(Path(out), recipe.pop("arch"), recipe.pop("preset"), cache_dir=cache_dir, **recipe)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m llmd_tools.make_gguf", description=__doc__.splitlines()[0])
    parser.add_argument("--name", choices=sorted(GGUF_FIXTURES), help="the fixture")
    parser.add_argument("--type", dest="types", action="append", default=None,
                        help="a type of the recipe (repeatable; default: all of them)")
    parser.add_argument("--threads", type=int, default=0, help="the quantizer's threads (0: every core)")
    parser.add_argument("--cache-dir", type=Path, default=None, help="default: the fixture cache")
    parser.add_argument("--list", action="store_true", help="list the fixtures and their types")
    args = parser.parse_args(argv)
    if args.list:
        for name, recipe in GGUF_FIXTURES.items():
            print(name, " ".join(recipe["types"]))
        return 0
    if args.name is None:
        parser.error("give --name or --list")
    quants = args.types or list(GGUF_FIXTURES[args.name]["types"])
    for quant in quants:
        if quant not in GGUF_FIXTURES[args.name]["types"]:
            parser.error(f"--type {quant}: {args.name} is made in {', '.join(GGUF_FIXTURES[args.name]['types'])}")
    try:
        for quant in quants:
            print(gguf_fixture(args.name, quant, args.cache_dir, args.threads, verbose=True))
    except LlamaCppUnavailable as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
