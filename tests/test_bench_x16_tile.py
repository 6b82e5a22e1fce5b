"""tools/bench_x16_tile (docs/benchmarks.md's tile figures): the AVX2 product's tile,
compiled alone from the package's headers, timed for each type and number of passes asked;
a folder of modified headers is found before the package's; bad arguments are refused
by name."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from llmd_tools import bench_x16_tile

CPU_FLAGS = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
pytestmark = pytest.mark.skipif(" avx2" not in CPU_FLAGS or shutil.which("c++") is None,
                                reason="needs an AVX2 CPU and a C++ compiler")
SMALL = ["--k", "256", "--groups", "2", "--rows", "5", "--reps", "2", "--issue-iterations", "1000"]


def test_each_type_and_pass_is_timed_and_the_issue_rates_follow(capsys):
    assert bench_x16_tile.main(["--types", "Q4_K", "Q8_0", "--passes", "1", "2", *SMALL]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = [line.split() for line in lines if line.startswith(("Q4_K", "Q8_0"))]
    assert [(r[0], r[1]) for r in rows] == [("Q4_K", "1"), ("Q4_K", "2"), ("Q8_0", "1"), ("Q8_0", "2")]
    assert all(r[2] == "32x256" and r[3] == "5" and float(r[4]) > 0 and float(r[5]) > 0 for r in rows)
    issued = [line for line in lines if line.startswith("issue rate")]
    assert [line.split(",")[1].split(":")[0].strip() for line in issued] == \
        ["vpmaddubsw", "vpaddw", "vpmaddwd", "vpmaddubsw+vpaddw"]


def test_modified_headers_are_found_first(tmp_path):
    (tmp_path / "cpu_quant_x16_avx2_tiles.h").write_text('#error "the modified copy was read"\n')
    with pytest.raises(SystemExit, match="the modified copy was read"):
        bench_x16_tile.main(["--types", "Q4_K", "--passes", "1", "--headers", str(tmp_path), *SMALL])


@pytest.mark.parametrize("args, message", [
    (["--types", "Q7_X"], "unknown type.*Q7_X"),
    (["--passes", "4"], "passes must be 1, 2 or 3"),
    (["--k", "300"], "--k must be a positive multiple of 256"),
])
def test_bad_arguments_are_refused_by_name(args, message):
    with pytest.raises(SystemExit, match=message):
        bench_x16_tile.main([*SMALL, *args])
