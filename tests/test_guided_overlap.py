"""Guided-decoding masks off the critical path: a step is handed to the executor before
its grammar bitmask rows are filled, and sampling waits for them. Proved by ordering (a
fill that may only finish once its own step's forward has begun), in process, with
async (chained) steps, under speculative verification and with worker processes (the
rows follow the step in a second message); outputs equal those of an unhindered engine.
A matcher that fails while filling ends only its request; a request aborted while its
rows are being filled leaves the engine serving with every KV block free. The batched
fill equals xgrammar's one-matcher-at-a-time fill, drafts included.

On a CPU device an engine fills the rows before the launch (its model's threads hold
the cores); the tests turn the overlap on, as a GPU engine has it, to prove it here."""
from __future__ import annotations

import collections
import itertools
import random
import re
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from engine_util import drain
from llmd import LLM, GuidedDecodingParams, SamplingParams
from llmd_tools.make_model import fixture_path
from test_guided import KINDS, PERSON, REGEX, json_valid

ENGINE = dict(dtype="float32", max_model_len=256)
PROMPTS = ["The answer is", "def main():\n    return", "Q: What now?\nA:", "{"]
MODES = {
    "in_process": {},
    "async": dict(async_scheduling=True),
    "ngram": dict(speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}),
    "worker_process": dict(distributed_executor_backend="mp"),
}


def make(beside_forward: bool = True, **settings) -> LLM:
    llm = LLM(model=str(fixture_path("tiny-llama")), **ENGINE, **settings)
    assert not llm.engine.structured.filler.beside_forward  # the CPU's default
    llm.engine.structured.filler.beside_forward = beside_forward
    return llm


def workload() -> tuple[list[str], list[SamplingParams]]:
    """Every kind of grammar, greedy and seeded, beside one unguided request."""
    prompts, params = [], []
    for i, (guided, _) in enumerate(KINDS.values()):
        prompts += [PROMPTS[i], PROMPTS[-1 - i]]
        params += [SamplingParams(temperature=0.0, max_tokens=64, guided=guided),
                   SamplingParams(temperature=1.0, seed=i, max_tokens=64, guided=guided)]
    prompts.append("plain")
    params.append(SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    return prompts, params


def token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    llm = make(beside_forward=False)
    try:
        return token_ids(llm.generate(*workload()))
    finally:
        llm.engine.shutdown()


class ForwardFirst:
    """Makes every bitmask fill wait until its own step's forward has begun: in process,
    the model's forward entered for that step; with worker processes, the step sent to
    them. Were the rows filled before the step was launched, the fill would wait for
    ever and the step with it (the test fails after 60 s)."""

    def __init__(self, engine) -> None:
        self.cond = threading.Condition()
        self.begun = 0  # guided steps whose forward began
        self.queued: collections.deque = collections.deque()  # fills started, oldest first
        self.current = None  # the step the in-process runner is running
        self.fills = 0
        structured = engine.structured
        start_fill, fill = structured.fill_bitmask, structured.filler.fill
        started = itertools.count()

        def queue_fill(grammars, drafts):
            # Guided steps are launched in the order their fills start: the k-th fill
            # is the k-th guided step's. Queued before the fill is submitted: fills run
            # in this order.
            self.queued.append(next(started))
            return start_fill(grammars, drafts)

        def fill_after_forward(groups):
            k = self.queued.popleft()
            with self.cond:
                assert self.cond.wait_for(lambda: self.begun > k, 60), \
                    "the step's forward did not begin while its rows were being filled"
            self.fills += 1
            return fill(groups)

        structured.fill_bitmask = queue_fill
        structured.filler.fill = fill_after_forward
        executor = engine.executor
        if hasattr(executor, "runner"):
            self._watch_runner(executor.runner)
        else:
            self._watch_sends(executor)

    def _began(self, output) -> None:
        if not output.grammar_req_ids:
            return
        with self.cond:
            self.begun += 1
            self.cond.notify_all()

    def _watch_runner(self, runner) -> None:
        for name in ("execute_model",):
            run = getattr(runner, name)

            def running(so, grammar=None, run=run):
                self.current = so
                return run(so, grammar)

            setattr(runner, name, running)
        runner.model.register_forward_pre_hook(lambda module, args: self._began(self.current))

    def _watch_sends(self, executor) -> None:
        broadcast = executor._broadcast

        def sent(message):
            broadcast(message)
            if hasattr(message, "scheduler_output"):
                self._began(message.scheduler_output)

        executor._broadcast = sent


@pytest.mark.parametrize("mode", list(MODES))
def test_forward_begins_before_the_rows_are_filled(reference, mode):
    llm = make(**MODES[mode])
    try:
        gate = ForwardFirst(llm.engine)
        prompts, params = workload()
        got = llm.generate(prompts, params)
        assert gate.fills > 10
        if mode == "ngram":  # a verify step's rows: one per verified position
            assert llm.engine.scheduler.spec_stats.num_draft_tokens > 0
        # Seeded rows draw differently when verifying drafts; greedy ones do not.
        same = [i for i, p in enumerate(params) if mode != "ngram" or p.temperature == 0.0]
        assert [token_ids(got)[i] for i in same] == [reference[i] for i in same]
        for out, p in zip(got, params):
            sample = out.outputs[0]
            if p.guided is not None and sample.finish_reason == "stop":
                valid = next(check for guided, check in KINDS.values() if guided is p.guided)
                assert valid(sample.text), sample.text
        llm.engine.kv_cache_manager.assert_all_free()
    finally:
        llm.engine.shutdown()


@pytest.mark.parametrize("beside_forward", [True, False])
def test_a_matcher_that_fails_to_fill_ends_only_its_request(beside_forward):
    llm = make(beside_forward)
    engine = llm.engine
    guided = GuidedDecodingParams(json_schema=PERSON)
    greedy = SamplingParams(temperature=0.0, max_tokens=64, guided=guided)
    alone = token_ids(llm.generate(PROMPTS[:2], greedy))
    fill = engine.structured.filler._fill_matchers

    def fill_or_fail(rows, groups):
        bad = engine.scheduler.requests.get("bad")
        if bad is not None and any(g.matcher is bad.grammar.matcher for g in groups):
            raise RuntimeError("xgrammar failed")
        return fill(rows, groups)

    engine.structured.filler._fill_matchers = fill_or_fail
    try:
        engine.add_request("bad", PROMPTS[2], greedy)
        for i, prompt in enumerate(PROMPTS[:2]):
            engine.add_request(f"good{i}", prompt, greedy)
        finished = drain(engine)
        failed = finished["bad"].outputs[0]
        assert failed.finish_reason == "error" and "broke the grammar" in failed.error
        assert [finished[f"good{i}"].outputs[0].token_ids for i in range(2)] == alone
        engine.kv_cache_manager.assert_all_free()
        again = llm.generate(["A person:"], SamplingParams(temperature=0.8, seed=1, max_tokens=200, guided=guided))
        assert again[0].outputs[0].finish_reason == "stop" and json_valid(again[0].outputs[0].text, PERSON)
    finally:
        engine.shutdown()


@pytest.mark.parametrize("mode", ["in_process", "worker_process"])
def test_abort_while_the_rows_are_being_filled(mode):
    """As the daemon runs it: steps on a model thread, an abort arriving between launch
    and result. The step completes, the aborted request's token is dropped, its blocks
    are freed, and the others run on to valid outputs."""
    llm = make(**MODES[mode])
    engine = llm.engine
    model_thread = ThreadPoolExecutor(max_workers=1)
    engine.core.use_model_thread(model_thread)
    regex = GuidedDecodingParams(regex=REGEX)
    try:
        for rid in ("victim", "other"):
            engine.add_request(rid, "id:", SamplingParams(temperature=0.0, max_tokens=40, guided=regex))
        engine.add_request("plain", "x", SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
        # The grammars compile in a pool: on a loaded machine three steps could end before
        # they do, and a step without the guided requests has no rows to hold (a CI run
        # failed so). Their requests run from the step after the compile ends.
        for request in list(engine.scheduler.waiting_for_grammar):
            request.grammar.job.future.result(timeout=60)
        for _ in range(3):
            engine.step()
        filling, release = threading.Event(), threading.Event()
        fill = engine.structured.filler.fill

        def held_fill(groups):
            filling.set()
            assert release.wait(60)
            return fill(groups)

        engine.structured.filler.fill = held_fill
        step = engine.core.begin_step()  # launched on the model thread; its rows held
        assert filling.wait(30) and not step.future.done()
        aborted = engine.abort_request("victim")
        assert aborted[0].finished and aborted[0].outputs[0].finish_reason == "abort"
        engine.structured.filler.fill = fill
        release.set()
        finished = drain(engine)
        assert sorted(finished) == ["other", "plain"]
        assert re.fullmatch(REGEX, finished["other"].outputs[0].text)
        engine.kv_cache_manager.assert_all_free()
        again = llm.generate(["id:"], SamplingParams(temperature=0.0, max_tokens=40, guided=regex))
        assert again[0].outputs[0].text == finished["other"].outputs[0].text
    finally:
        engine.shutdown()
        model_thread.shutdown()


def test_tensor_parallel_rank_zero_alone_reads_the_rows():
    """Only rank 0 samples, so only it is sent the rows; greedy guided output equals one
    worker's."""
    prompts, params = workload()
    greedy = [(pr, p) for pr, p in zip(prompts, params) if p.temperature == 0.0]
    outputs = []
    for tp in (1, 2):
        llm = make(tensor_parallel_size=tp, distributed_executor_backend="mp", device="cpu")
        try:
            outputs.append(token_ids(llm.generate([pr for pr, _ in greedy], [p for _, p in greedy])))
        finally:
            llm.engine.shutdown()
    assert outputs[0] == outputs[1]


def test_batched_fill_equals_one_matcher_at_a_time():
    """Rows of several matchers, each verifying its own drafts, filled in one go equal
    xgrammar's fill of each matcher alone with the drafts accepted one by one (and the
    UTF-8 guard applied likewise); the matchers end where they started."""
    import numpy as np
    import xgrammar as xgr

    from llmd.structured_output.bitmask_filler import BitmaskFiller, RowGroup

    llm = make()
    engine = llm.engine
    try:
        # Compiles through the engine (tokenizer info, UTF-8 guard), then takes matchers
        # walked a random way into the output.
        llm.generate(["x"], SamplingParams(max_tokens=2, guided=KINDS["json_schema"][0]))
        service = engine.structured.service
        compiled = service.submit(_spec()).future.result()  # the compile cache's
        guard, words = service.utf8_guard, (engine.vocab_size + 31) // 32
        rng = random.Random(0)
        groups = []
        for k in range(6):
            matcher = xgr.GrammarMatcher(compiled)
            walk = _walk(matcher, rng, 5 + 3 * k, words)
            drafts = _walk(matcher, rng, k % 4, words)
            matcher.rollback(len(drafts))
            tail = b""
            for token in walk:
                tail = guard.advance(tail, token) or b""
            groups.append(RowGroup(matcher, tail, drafts))
        groups.insert(2, RowGroup(None, b"", [11, 12]))  # a finished request: rows allow all
        before = [g.matcher and _state(g.matcher, words) for g in groups]
        filler = BitmaskFiller(words, lambda: guard)
        got = np.frombuffer(filler.fill(groups), dtype=np.int32).reshape(-1, words)
        assert np.array_equal(got, np.concatenate([_reference_rows(g, guard, words) for g in groups]))
        assert [g.matcher and _state(g.matcher, words) for g in groups] == before
        filler.shutdown()
    finally:
        engine.shutdown()


def _spec():
    from llmd.structured_output import parse_guided

    return parse_guided(KINDS["json_schema"][0])


def _walk(matcher, rng: random.Random, steps: int, words: int) -> list[int]:
    """Accept up to `steps` random allowed tokens (never one that ends the grammar)."""
    import numpy as np

    taken = []
    row = np.full((1, words), -1, dtype=np.int32)
    for _ in range(steps):
        matcher.fill_next_token_bitmask(row, 0)
        allowed = np.flatnonzero(np.unpackbits(row[0].view(np.uint8), bitorder="little"))
        allowed = [int(t) for t in allowed if t > 2]  # not a special token: not the end
        if not allowed:
            break
        token = rng.choice(allowed)
        assert matcher.accept_token(token)
        taken.append(token)
    return taken


def _state(matcher, words: int) -> bytes:
    import numpy as np

    row = np.full((1, words), -1, dtype=np.int32)
    matcher.fill_next_token_bitmask(row, 0)
    return row.tobytes()


def _reference_rows(group, guard, words: int):
    """The rows the engine filled before they were batched: matcher by matcher, draft by
    draft, each row ANDed with the UTF-8 guard unless that left it empty."""
    import numpy as np

    rows = np.full((group.num_rows, words), -1, dtype=np.int32)
    if group.matcher is None:
        return rows
    tail = group.utf8_tail
    for i in range(group.num_rows):
        if i:
            assert group.matcher.accept_token(group.drafts[i - 1])
            tail = guard.advance(tail, group.drafts[i - 1]) or b""
        group.matcher.fill_next_token_bitmask(rows, i)
        guarded = rows[i] & guard.mask(tail)
        if guarded.any():
            rows[i] = guarded
    group.matcher.rollback(len(group.drafts))
    return rows


def test_rows_applied_on_the_device_equal_a_bit_by_bit_reference():
    """A step's rows go to the device as packed words, unguided rows all ones, and are
    applied as a 0 / -inf bias unpacked there: the masked logits equal a bit-by-bit
    reference and xgrammar's own kernel, padded vocab included."""
    import numpy as np
    import torch
    import xgrammar as xgr

    from llmd.gpu.sample.metadata import SamplingMetadata

    num_rows, vocab, logit_width = 5, 70, 96  # the bitmask covers the logit width
    rng = np.random.default_rng(0)
    rows = [1, 3, 4]
    words = rng.integers(-2**31, 2**31 - 1, (len(rows), logit_width // 32), dtype=np.int32)
    md = SamplingMetadata.build([SamplingParams()] * num_rows, [[1]] * num_rows, [[]] * num_rows,
                                valid_vocab_size=vocab)
    md.set_grammar_bitmask(rows, words.tobytes(), torch.device("cpu"))
    logits = torch.randn(num_rows, vocab)
    before, expected = logits.clone(), logits.clone()
    for i, row in enumerate(rows):
        for token in range(vocab):
            if not (int(words[i, token // 32]) >> (token % 32)) & 1:
                expected[row, token] = float("-inf")
    assert torch.equal(md.mask_grammar(logits), expected)
    by_xgrammar = logits.clone()
    xgr.apply_token_bitmask_inplace(by_xgrammar, md.grammar_bitmask, vocab_size=vocab)
    assert torch.equal(by_xgrammar, expected)
    assert torch.equal(logits, before)  # a new tensor: the logits themselves are left as they were
