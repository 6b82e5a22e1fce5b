"""A GGUF split in shards (llama.cpp's gguf-split, its converter's --split-max-tensors:
`<stem>-00001-of-0000N.gguf`, ...) loads from its first shard as the one file does: the
shards written by gguf-py's writer (what the converter splits with), the model's greedy
tokens and logprobs bit for bit the unsplit file's, its size, digest and memory estimate
counting every shard. A split that does not hold together is refused naming the file."""
from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

import gguf
from gguf import GGMLQuantizationType as T
from gguf_fixtures import gguf_with, write_gguf
from llmd import LLM, SamplingParams
from llmd.gpu.models.gguf_summary import gguf_summary
from llmd.gpu.models.loader import load_hf_config
from llmd.pool.estimate import read_shape
from llmd_tools.split_gguf import split_gguf
from tiny_models import tiny_models

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)
SETTINGS = dict(device="cpu", dtype="float32", num_gpu_blocks_override=64, max_model_len=128)
PROMPTS = [[1, 5, 9, 200, 31], [7, 7, 100]]
U16, I32 = gguf.GGUFValueType.UINT16, gguf.GGUFValueType.INT32


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The tiny llama in Q8_0 (packed on CPU), whole; split in shards of 8 tensors; split
    with a first shard of metadata alone; and the whole file split by tensor bytes
    (tools/split_gguf.py, as gguf-split --split-max-size)."""
    root = tmp_path_factory.mktemp("split")
    hf = tiny_models(root, {"llama": dict(arch="llama", llama3_rope=False, intermediate_size=192)})("llama")
    for folder in ("whole", "split", "small", "sized"):
        (root / folder).mkdir()
    whole = write_gguf(hf, root / "whole" / "m.gguf", T.Q8_0)
    sized = split_gguf(whole, root / "sized" / "m.gguf", max_size=40_000)
    return (whole, write_gguf(hf, root / "split" / "m.gguf", T.Q8_0, split_max_tensors=8),
            write_gguf(hf, root / "small" / "m.gguf", T.Q8_0, split_max_tensors=8, small_first_shard=True), sized[0])


def _shards(first: Path) -> list[Path]:
    return sorted(first.parent.glob("m-*-of-*.gguf"))


def _run(path: Path) -> list[tuple[list[int], list[dict[int, float]]]]:
    outs = LLM(model=str(path), **SETTINGS).generate([list(p) for p in PROMPTS], GREEDY)
    return [(o.outputs[0].token_ids, [{t: lp.logprob for t, lp in pos.items()} for pos in o.outputs[0].logprobs])
            for o in outs]


def test_a_split_gguf_runs_as_the_one_file_does(files):
    whole, split, small, sized = files
    expected = _run(whole)
    for first in (split, small, sized):
        shards = _shards(first)
        assert first == shards[0] and first.name == f"m-00001-of-{len(shards):05d}.gguf" and len(shards) >= 3
        heads = [gguf.GGUFReader(p) for p in shards]  # the writer's own reader: real shards
        assert [int(h.fields["split.no"].contents()) for h in heads] == list(range(len(shards)))
        assert sum(len(h.tensors) for h in heads) == len(gguf.GGUFReader(whole).tensors)
        if first == small:
            assert len(heads[0].tensors) == 0  # the metadata alone
        assert _run(first) == expected, first
        config, reference = load_hf_config(first).to_dict(), load_hf_config(whole).to_dict()
        assert config == reference
        summary, one = gguf_summary(first), gguf_summary(whole)
        size = sum(p.stat().st_size for p in shards)
        assert summary.size_bytes == size and read_shape(str(first)).weights_bytes == size
        assert (summary.num_params, summary.quantization, summary.architecture) == \
               (one.num_params, one.quantization, one.architecture)
        assert summary.header_sha256 != one.header_sha256


def test_a_shard_rewritten_is_read_again(files, tmp_path):
    """What is read from a split (the summary, the memory estimate) is kept while its
    files are unchanged: every shard's, not the first's alone."""
    split = files[1]
    copy = tmp_path / "copy"
    shutil.copytree(split.parent, copy)
    first, last = _shards(copy / split.name)[0], _shards(copy / split.name)[-1]
    before = gguf_summary(first).size_bytes
    with last.open("ab") as f:  # bytes past the last tensor: the file grows, its tensors stay
        f.write(b"\0" * 4096)
    assert gguf_summary(first).size_bytes == before + 4096
    assert read_shape(str(first)).weights_bytes == before + 4096


def test_a_split_that_does_not_hold_together_is_refused(files, tmp_path):
    split = files[1]
    shards = _shards(split)
    count = len(shards)
    with pytest.raises(ValueError, match=rf"'{shards[1]}' is shard 2 of {count} of a split GGUF: load the model "
                                         rf"from its first shard, m-00001-of-{count:05d}.gguf"):
        LLM(model=str(shards[1]), **SETTINGS)

    renamed = tmp_path / "renamed.gguf"
    shutil.copy(split, renamed)
    with pytest.raises(ValueError, match=rf"is the first of {count} shards of a split GGUF, but its name does not "
                                         rf"end in -00001-of-{count:05d}.gguf"):
        load_hf_config(renamed)

    def copied(name: str, replace: dict[int, Path]) -> Path:
        folder = tmp_path / name
        folder.mkdir()
        for i, shard in enumerate(shards):
            if replace.get(i, shard) is not None:
                shutil.copy(replace.get(i, shard), folder / shard.name)
        return folder / split.name

    missing = copied("missing", {2: None})
    with pytest.raises(ValueError, match=rf"shard 3, 'm-00003-of-{count:05d}.gguf', is missing beside it"):
        load_hf_config(missing)
    swapped = copied("swapped", {1: shards[2]})  # shard 3's file under shard 2's name
    with pytest.raises(ValueError, match=rf"m-00002-of-{count:05d}.gguf' is shard 3 of {count} by its split.no and "
                                         rf"split.count, not shard 2 of {count}"):
        load_hf_config(swapped)


def test_shards_that_disagree_on_their_tensors_are_refused(tmp_path):
    """Two shards holding one tensor; a tensor count other than the shards hold."""
    def split_of(folder: str, tensors_count: int, second: dict[str, np.ndarray]) -> Path:
        (tmp_path / folder).mkdir()
        keys = {"split.count": (2, U16), "split.tensors.count": (tensors_count, I32)}
        first = gguf_with(tmp_path / folder / "m-00001-of-00002.gguf", "llama", {**keys, "split.no": (0, U16)},
                          {"token_embd.weight": np.zeros((8, 4), np.float32)})
        gguf_with(tmp_path / folder / "m-00002-of-00002.gguf", "llama", {**keys, "split.no": (1, U16)}, second)
        return first

    from llmd.gpu.models.gguf_file import GGUFFile

    twice = split_of("twice", 2, {"token_embd.weight": np.ones((8, 4), np.float32)})
    with pytest.raises(ValueError, match=r"m-00002-of-00002.gguf': tensor 'token_embd.weight' is in shard 1 too"):
        GGUFFile(twice)
    miscounted = split_of("miscounted", 3, {"output_norm.weight": np.ones(4, np.float32)})
    with pytest.raises(ValueError, match=r"m-00001-of-00002.gguf' has split.tensors.count=3, but its 2 shards hold 2"):
        GGUFFile(miscounted)
    fine = GGUFFile(split_of("fine", 2, {"output_norm.weight": np.ones(4, np.float32)}))
    assert fine.tensors["output_norm.weight"].shard == 1 and (fine.tensor_data("output_norm.weight") == 1).all()
    assert fine.total_size == sum(s.size for s in fine.shards) and len(fine.shards) == 2
