"""Answer one prompt with the offline engine on the built-in demo model.

`python -m llmd_tools.demo ["prompt"]`. The demo model has random weights (nothing can
be downloaded here), so its text is gibberish; what the demo shows is the whole path:
tokenize, schedule, paged-KV forward, sample, detokenize.
"""
from __future__ import annotations

import sys
import time

from llmd import LLM, SamplingParams
from llmd_tools.make_model import demo_model_path


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    prompt = argv[0] if argv else "def main():"
    model = demo_model_path()
    llm = LLM(model=str(model), max_model_len=1024, kv_cache_memory_bytes=256 << 20)
    start = time.perf_counter()
    out = llm.generate([prompt], SamplingParams(temperature=0.8, top_p=0.95, seed=0, max_tokens=48))[0]
    elapsed = time.perf_counter() - start
    completion = out.outputs[0]
    print(f"model: {model}")
    print(f"prompt: {prompt!r}")
    print(f"output: {completion.text!r}")
    print(f"{len(completion.token_ids)} tokens in {elapsed:.2f} s, finish_reason={completion.finish_reason}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
