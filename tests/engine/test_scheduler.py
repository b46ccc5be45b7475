"""Scheduler and sequence state: batching, admission, preemption, page ownership.

A fake runner stands in for the model: it stores every fed token in the KV
slot its page table names and samples from the context it reads back, so a
wrong page table, a shared page or a page reused too early changes the
output, and outputs are compared with a reference computed without any
scheduler.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import fields, replace

import pytest
from hypothesis import event, given, settings, target
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pdcluster.runtime.engine.page_allocator import PageAllocator
from pdcluster.runtime.engine.scheduler import (
    RequestRejected,
    ScheduledBatch,
    Scheduler,
    SchedulerConfig,
    SchedulerError,
)
from pdcluster.runtime.engine.sequence import (
    TRANSITIONS,
    IllegalTransition,
    Sequence,
    SequenceStatus,
)
from pdcluster.runtime.spec import pages_for

S = SequenceStatus
VOCAB = 7
DEFAULTS = SchedulerConfig(
    page_size=4,
    max_running_requests=8,
    max_batch_tokens=64,
    chunk_size=16,
    max_prompt_tokens=64,
    max_model_len=128,
)


def next_token(context: Iterable[int]) -> int:
    """The fake model: a deterministic function of the whole context."""
    h = 0
    for t in context:
        h = (h * 1_000_003 + t + 1) % (1 << 61)
    return h % VOCAB


def reference(seq: Sequence) -> tuple[list[int], str]:
    """Output and finish reason of ``seq`` computed directly, with no scheduler."""
    tokens, out = list(seq.prompt_token_ids), []
    while True:
        token = next_token(tokens)
        tokens.append(token)
        out.append(token)
        if seq.mode == "prefill_only":
            return out, "prefill_done"
        if not seq.ignore_eos and token == seq.eos_token_id:
            return out, "stop"
        if token in seq.stop_token_ids:
            return out, "stop"
        if len(out) >= seq.max_tokens:
            return out, "length"


class FakeRunner:
    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.slots: dict[tuple[int, int], int] = {}

    def write(self, page_table: Iterable[int], start: int, tokens: Iterable[int]) -> None:
        pages = list(page_table)
        for pos, token in enumerate(tokens, start):
            self.slots[(pages[pos // self.page_size], pos % self.page_size)] = token

    def read(self, page_table: Iterable[int], n: int) -> list[int]:
        pages = list(page_table)
        return [
            self.slots.get((pages[p // self.page_size], p % self.page_size), -1) for p in range(n)
        ]

    def run(self, batch: ScheduledBatch) -> tuple[dict[str, int], dict[str, list[int]]]:
        sampled: dict[str, int] = {}
        contexts: dict[str, list[int]] = {}
        for c in batch.chunks:
            assert len(c.page_table) * self.page_size >= c.end_pos, "page table too short"
            contexts[c.rid] = self.read(c.page_table, c.start_pos) + list(c.token_ids)
            self.write(c.page_table, c.start_pos, c.token_ids)
            if c.sample:
                sampled[c.rid] = next_token(contexts[c.rid])
        return sampled, contexts


def make(num_pages: int = 64, **overrides: int) -> tuple[Scheduler, FakeRunner]:
    config = replace(DEFAULTS, **overrides)
    return Scheduler(config, PageAllocator(num_pages)), FakeRunner(config.page_size)


def new_seq(rid: str, prompt_len: int = 5, max_tokens: int = 4, **kw: object) -> Sequence:
    prompt = [(7 * i + len(rid)) % VOCAB for i in range(prompt_len)]
    return Sequence(rid=rid, prompt_token_ids=prompt, max_tokens=max_tokens, **kw)  # type: ignore[arg-type]


def prefilled_elsewhere(sched: Scheduler, runner: FakeRunner, seq: Sequence) -> Sequence:
    """What the PD layer hands decode: pages reserved here, KV written, first token."""
    pages = sched.allocator.allocate(pages_for(seq.num_prompt_tokens, sched.config.page_size))
    runner.write(pages, 0, seq.prompt_token_ids)
    return replace(
        seq,
        mode="prefilled",
        page_table=pages,
        num_computed_tokens=seq.num_prompt_tokens,
        output_token_ids=[next_token(seq.prompt_token_ids)],
    )


def step(sched: Scheduler, runner: FakeRunner) -> tuple[ScheduledBatch, list[Sequence]]:
    batch = sched.schedule()
    sampled, _ = runner.run(batch)
    return batch, sched.on_step_done(sampled)


def drain(sched: Scheduler, runner: FakeRunner, max_steps: int = 5000) -> dict[str, Sequence]:
    """Step until no work is left, releasing HELD sequences as they appear."""
    done: dict[str, Sequence] = {}
    for _ in range(max_steps):
        if not sched.has_work():
            return done
        _, changed = step(sched, runner)
        for seq in changed:
            if seq.status is S.HELD:
                sched.release(seq.rid)
            if seq.is_finished:
                done[seq.rid] = seq
    raise AssertionError(f"no progress after {max_steps} steps")


def snapshot(sched: Scheduler) -> tuple[int, ...]:
    return (sched.allocator.num_free, sched.num_waiting, sched.num_running, sched.num_held)


# ---- sequence ------------------------------------------------------------


@pytest.mark.parametrize("old", list(S))
@pytest.mark.parametrize("new", list(S))
def test_status_transitions_follow_the_table(old: S, new: S) -> None:
    seq = new_seq("r", status=old)
    if new in TRANSITIONS[old]:
        seq.transition(new)
        assert seq.status is new
    else:
        with pytest.raises(IllegalTransition, match=f"{old.name} -> {new.name}"):
            seq.transition(new)
        assert seq.status is old


@pytest.mark.parametrize(("start", "end"), [(0, 0), (0, 3), (1, 5), (3, 6), (4, 6), (0, 6)])
def test_token_slice_spans_prompt_and_output(start: int, end: int) -> None:
    seq = Sequence("r", [10, 11, 12, 13], max_tokens=5, output_token_ids=[20, 21])
    assert seq.num_tokens == 6
    assert seq.token_slice(start, end) == tuple(seq.token_ids[start:end])


# ---- config and admission ------------------------------------------------


@pytest.mark.parametrize("field", [f.name for f in fields(SchedulerConfig)])
@pytest.mark.parametrize("value", [0, -3])
def test_config_rejects_non_positive_limits(field: str, value: int) -> None:
    with pytest.raises(ValueError, match=field):
        replace(DEFAULTS, **{field: value})


def test_config_requires_room_for_every_decode() -> None:
    with pytest.raises(ValueError, match="max_batch_tokens"):
        replace(DEFAULTS, max_running_requests=8, max_batch_tokens=7)


@pytest.mark.parametrize(
    ("prompt_len", "max_tokens", "prefill_only", "message"),
    [
        (0, 4, False, "empty prompt"),
        (5, 0, False, "max_tokens must be >= 1"),
        (11, 1, False, "max_prompt_tokens=10"),
        (10, 11, False, "exceeds max_model_len=20"),
        (10, 7, False, "needs 4 KV pages"),  # 16 KV tokens, 4 per page, pool of 3
        (10, 7, True, None),  # prefill_only keeps the prompt's pages only
        (10, 3, False, None),  # 12 KV tokens: exactly the pool
        (1, 1, False, None),
    ],
)
def test_check_admissible(
    prompt_len: int, max_tokens: int, prefill_only: bool, message: str | None
) -> None:
    sched, _ = make(num_pages=3, max_prompt_tokens=10, max_model_len=20)
    if message is None:
        sched.check_admissible(prompt_len, max_tokens, prefill_only=prefill_only)
        return
    with pytest.raises(RequestRejected, match=message):
        sched.check_admissible(prompt_len, max_tokens, prefill_only=prefill_only)


BAD_REQUESTS = [
    "duplicate rid",
    "empty rid",
    "unknown mode",
    "negative token",
    "bool token",
    "not new",
    "normal with pages",
    "too long",
    "two first tokens",
    "progress mismatch",
    "too few pages",
    "page twice",
    "page not allocated",
    "page out of range",
    "page of another sequence",
]


def _bad_request(sched: Scheduler, runner: FakeRunner, name: str) -> tuple[Sequence, str]:
    owner = prefilled_elsewhere(sched, runner, new_seq("p", 5))
    sched.add(owner)
    ok = prefilled_elsewhere(sched, runner, new_seq("x", 5))  # valid, not added
    loose = ok.page_table  # allocated, owned by no sequence yet
    cases = [
        (new_seq("p"), "already in use"),
        (new_seq(""), "non-empty string"),
        (new_seq("x", mode="bogus"), "mode must be one of"),
        (Sequence("x", [1, -2], max_tokens=2), "non-negative integers"),
        (Sequence("x", [1, True], max_tokens=2), "non-negative integers"),  # type: ignore[list-item]
        (new_seq("x", status=S.RUNNING), "not new"),
        (new_seq("x", page_table=[loose[0]]), "must start with no output"),
        (new_seq("x", max_tokens=1000), "max_model_len"),
        (replace(ok, output_token_ids=[1, 2]), "exactly one first"),
        (replace(ok, num_computed_tokens=4), "num_computed_tokens"),
        (replace(ok, page_table=loose[:1]), "its prompt needs 2"),
        (replace(ok, page_table=[loose[0], loose[0]]), "lists a page twice"),
        (replace(ok, page_table=[loose[0], 60]), "page 60 was not allocated"),
        (replace(ok, page_table=[loose[0], 99]), "unknown page 99"),
        (replace(ok, page_table=[loose[0], owner.page_table[0]]), "another sequence"),
    ]
    return dict(zip(BAD_REQUESTS, cases, strict=True))[name]


@pytest.mark.parametrize("name", BAD_REQUESTS)
def test_bad_requests_are_rejected_with_nothing_reserved(name: str) -> None:
    sched, runner = make()
    seq, message = _bad_request(sched, runner, name)
    before = snapshot(sched)
    with pytest.raises(RequestRejected, match=message):
        sched.add(seq)
    assert snapshot(sched) == before
    assert sched.get("x") is None


# ---- batching ------------------------------------------------------------


@pytest.mark.parametrize("prompt_len", [1, 7, 8, 9, 23])
@pytest.mark.parametrize(("chunk_size", "page_size"), [(1, 1), (4, 4), (8, 3), (64, 16)])
def test_chunked_prefill_then_decode(prompt_len: int, chunk_size: int, page_size: int) -> None:
    sched, runner = make(chunk_size=chunk_size, page_size=page_size)
    seq = new_seq("r", prompt_len, max_tokens=3, ignore_eos=True)
    sched.add(seq)
    chunks = []
    while sched.has_work():
        batch, _ = step(sched, runner)
        chunks.extend(batch.chunks)
    prefill = [c for c in chunks if c.is_prefill]
    assert [len(c.token_ids) for c in prefill[:-1]] == [chunk_size] * (len(prefill) - 1)
    assert len(prefill) == -(-prompt_len // chunk_size)
    assert [c.sample for c in prefill] == [False] * (len(prefill) - 1) + [True]
    assert [c.start_pos for c in chunks] == [i * chunk_size for i in range(len(prefill))] + [
        prompt_len,
        prompt_len + 1,
    ]
    assert all(len(c.token_ids) == 1 and c.sample for c in chunks[len(prefill) :])
    assert (seq.output_token_ids, seq.finish_reason) == reference(seq)
    assert seq.status is S.FINISHED and seq.page_table == []
    assert sched.allocator.num_free == 64


def test_decodes_go_first_and_prefill_fills_the_token_budget() -> None:
    sched, runner = make(max_batch_tokens=10, chunk_size=8)
    sched.add(new_seq("a", 3, max_tokens=20, ignore_eos=True))
    step(sched, runner)
    sched.add(new_seq("b", 30))
    sched.add(new_seq("c", 30))
    batch = sched.schedule()
    assert [(c.rid, len(c.token_ids), c.is_prefill) for c in batch.chunks] == [
        ("a", 1, False),
        ("b", 8, True),
        ("c", 1, True),
    ]
    assert batch.num_tokens == 10


def test_queued_prefill_tokens_count_what_is_left_to_prefill() -> None:
    sched, runner = make(max_batch_tokens=10, chunk_size=8)
    sched.add(new_seq("a", 3, max_tokens=20, ignore_eos=True))
    sched.add(new_seq("b", 30))
    assert sched.num_queued_prefill_tokens == 33
    step(sched, runner)  # a's 3 tokens, then b's first 7 within the budget of 10
    assert sched.num_queued_prefill_tokens == 23
    step(sched, runner)  # a decodes (not counted), b gets 8 more
    assert sched.num_queued_prefill_tokens == 15
    drain(sched, runner)
    assert sched.num_queued_prefill_tokens == 0


def test_running_limit_caps_admission() -> None:
    sched, runner = make(max_running_requests=2)
    for rid in "abc":
        sched.add(new_seq(rid, 3, max_tokens=5, ignore_eos=True))
    batch, _ = step(sched, runner)
    assert [c.rid for c in batch.chunks] == ["a", "b"]
    assert (sched.num_running, sched.num_waiting) == (2, 1)
    done = drain(sched, runner)
    assert set(done) == {"a", "b", "c"}


def test_head_of_line_blocks_smaller_requests_behind_it() -> None:
    # 6 pages of 4: "a" holds 2, the head "big" needs 5 for its first chunk.
    sched, runner = make(num_pages=6, chunk_size=20, max_model_len=40)
    sched.add(new_seq("a", 7, max_tokens=8, ignore_eos=True))
    step(sched, runner)
    sched.add(new_seq("big", 20, max_tokens=2))
    sched.add(new_seq("small", 2, max_tokens=2))
    batch, _ = step(sched, runner)
    assert [c.rid for c in batch.chunks] == ["a"]
    assert sched.get("small").status is S.WAITING  # type: ignore[union-attr]
    done = drain(sched, runner)
    order = [rid for rid in done if rid != "a"]
    assert order == ["big", "small"]


def test_head_cut_by_token_budget_admits_nobody_behind() -> None:
    sched, runner = make(max_running_requests=2, max_batch_tokens=6, chunk_size=16)
    sched.add(new_seq("a", 10))
    sched.add(new_seq("b", 1))
    batch = sched.schedule()
    assert [(c.rid, len(c.token_ids)) for c in batch.chunks] == [("a", 6)]


# ---- finishing -----------------------------------------------------------


@pytest.mark.parametrize("kind", ["eos", "stop_id", "length", "ignore_eos"])
def test_stop_conditions(kind: str) -> None:
    sched, runner = make()
    probe = new_seq("r", 4, max_tokens=6, ignore_eos=True)
    natural, _ = reference(probe)  # the tokens the fake model produces
    kw: dict[str, object] = {
        "eos": {"eos_token_id": natural[1]},
        "stop_id": {"stop_token_ids": [natural[2]]},
        "length": {},
        "ignore_eos": {"eos_token_id": natural[1], "ignore_eos": True},
    }[kind]
    seq = new_seq("r", 4, max_tokens=6, **kw)
    sched.add(seq)
    drain(sched, runner)
    expected = reference(seq)
    assert (seq.output_token_ids, seq.finish_reason) == expected
    assert expected[1] == ("length" if kind in ("length", "ignore_eos") else "stop")
    assert sched.allocator.num_free == 64


def test_prefill_only_samples_once_then_holds_pages_until_release() -> None:
    sched, runner = make()
    seq = new_seq("r", 9, max_tokens=50, mode="prefill_only")
    sched.add(seq)
    changed: list[Sequence] = []
    while not changed:
        _, changed = step(sched, runner)
    assert changed == [seq]
    assert (seq.status, seq.finish_reason) == (S.HELD, "prefill_done")
    assert seq.output_token_ids == [next_token(seq.prompt_token_ids)]
    assert runner.read(seq.page_table, 9) == seq.prompt_token_ids
    assert sched.allocator.num_free == 64 - 3 and sched.num_held == 1
    assert not sched.has_work()
    assert sched.schedule().is_empty
    sched.release("r")
    assert seq.status is S.FINISHED and sched.allocator.num_free == 64
    with pytest.raises(SchedulerError, match="no HELD sequence"):
        sched.release("r")


def test_release_of_a_running_sequence_is_refused() -> None:
    sched, runner = make()
    sched.add(new_seq("r"))
    step(sched, runner)
    before = snapshot(sched)
    with pytest.raises(SchedulerError, match="RUNNING"):
        sched.release("r")
    assert snapshot(sched) == before


def test_prefilled_sequence_decodes_like_a_normal_one() -> None:
    sched, runner = make()
    normal = new_seq("n", 9, max_tokens=6, ignore_eos=True)
    seq = prefilled_elsewhere(sched, runner, replace(normal, rid="p"))
    sched.add(seq)
    assert seq.status is S.RUNNING
    batch = sched.schedule()
    assert [(c.start_pos, c.token_ids, c.is_prefill) for c in batch.chunks] == [
        (9, (seq.output_token_ids[0],), False)
    ]
    sched.on_step_done(runner.run(batch)[0])
    drain(sched, runner)
    assert seq.output_token_ids == reference(normal)[0]
    assert sched.allocator.num_free == 64


@pytest.mark.parametrize("why", ["max_tokens", "eos"])
def test_prefilled_sequence_finished_by_its_first_token(why: str) -> None:
    sched, runner = make()
    base = new_seq("p", 5, max_tokens=1 if why == "max_tokens" else 8)
    seq = prefilled_elsewhere(sched, runner, base)
    if why == "eos":
        seq.eos_token_id = seq.output_token_ids[0]
    sched.add(seq)
    assert seq.status is S.FINISHED and sched.allocator.num_free == 64
    assert sched.has_work()  # the finish is still to be reported
    assert sched.schedule().is_empty
    assert sched.on_step_done({}) == [seq]
    assert seq.finish_reason == ("length" if why == "max_tokens" else "stop")
    assert not sched.has_work()


def test_prefilled_sequences_wait_for_a_running_slot() -> None:
    sched, runner = make(max_running_requests=1, max_batch_tokens=4)
    sched.add(new_seq("a", 3, max_tokens=3, ignore_eos=True))
    step(sched, runner)
    seq = prefilled_elsewhere(sched, runner, new_seq("p", 5, max_tokens=3, ignore_eos=True))
    sched.add(seq)
    assert seq.status is S.WAITING and sched.num_waiting == 1
    done = drain(sched, runner)
    assert list(done) == ["a", "p"]
    assert seq.output_token_ids == reference(replace(seq, output_token_ids=[]))[0]


# ---- preemption ----------------------------------------------------------


def _tight(chunk_size: int = 16) -> tuple[Scheduler, FakeRunner, list[Sequence]]:
    # 4 pages of 2 tokens; each prompt of 3 takes 2 pages: the pool is full
    # after both prefills, and the older one needs a third page at position 4.
    sched, runner = make(num_pages=4, page_size=2, max_model_len=20, chunk_size=chunk_size)
    seqs = [new_seq(rid, 3, max_tokens=4, ignore_eos=True) for rid in ("old", "young")]
    for s in seqs:
        sched.add(s)
    return sched, runner, seqs


def test_youngest_running_sequence_is_preempted_and_recomputed() -> None:
    sched, runner, (old, young) = _tight()
    step(sched, runner)  # both prefilled
    step(sched, runner)  # both decode position 3 inside their second page
    batch, _ = step(sched, runner)  # old needs a page at position 4
    assert batch.preempted == ("young",)
    assert [c.rid for c in batch.chunks] == ["old"]
    assert young.status is S.PREEMPTED and young.page_table == []
    assert young.num_preemptions == 1 and len(young.output_token_ids) == 2
    drain(sched, runner)
    for s in (old, young):
        assert (s.output_token_ids, s.finish_reason) == reference(replace(s, output_token_ids=[]))
    assert sched.allocator.num_free == 4


def test_recompute_feeds_generated_tokens_without_sampling_them_again() -> None:
    sched, runner, (_, young) = _tight()
    for _ in range(3):
        step(sched, runner)
    generated = list(young.output_token_ids)
    chunks = []
    while young.status is not S.FINISHED:
        batch, _ = step(sched, runner)
        chunks += [c for c in batch.chunks if c.rid == "young"]
    recompute = chunks[0]
    assert recompute.is_prefill and recompute.start_pos == 0 and recompute.sample
    assert recompute.token_ids == tuple(young.prompt_token_ids + generated)
    assert young.output_token_ids[:2] == generated


def test_a_step_that_preempted_admits_nobody() -> None:
    sched, runner, _ = _tight(chunk_size=1)
    batch, _ = step(sched, runner)
    while not batch.preempted:
        batch, _ = step(sched, runner)
    assert batch.preempted == ("young",) and [c.rid for c in batch.chunks] == ["old"]
    # The victim's first recompute chunk (one token, one page) would fit.
    assert sched.allocator.num_free == 1
    batch, _ = step(sched, runner)
    assert [(c.rid, c.start_pos) for c in batch.chunks] == [("old", 5), ("young", 0)]


def test_a_prefill_that_preempted_admits_nobody_either() -> None:
    # One-token pages, chunks of 3: after two steps the three prompts hold 16
    # of 20 pages; "b" needs 3 more for its last chunk and preempts "c".
    sched, runner = make(num_pages=20, page_size=1, chunk_size=3, max_batch_tokens=8)
    for rid, n in (("a", 8), ("b", 9), ("c", 5)):
        sched.add(new_seq(rid, n, max_tokens=1))
    step(sched, runner)
    step(sched, runner)
    batch = sched.schedule()
    assert batch.preempted == ("c",)
    assert [(c.rid, c.start_pos) for c in batch.chunks] == [("a", 6), ("b", 6)]
    assert sched.get("c").status is S.PREEMPTED  # type: ignore[union-attr]


def test_a_sequence_waits_rather_than_preempting_an_older_one() -> None:
    # 4 pages of 2: "old" (prompt 5) takes 3, "young" (prompt 2) takes 1. At
    # the first decode young needs a second page first; nothing younger holds
    # any, so young waits; a step later old needs a page and preempts young.
    sched, runner = make(num_pages=4, page_size=2, max_model_len=20)
    old, young = new_seq("old", 5, max_tokens=3, ignore_eos=True), new_seq("young", 2)
    sched.add(old)
    sched.add(young)
    step(sched, runner)
    batch, _ = step(sched, runner)
    assert [c.rid for c in batch.chunks] == ["old"] and batch.preempted == ()
    assert young.status is S.RUNNING and len(young.page_table) == 1
    batch, _ = step(sched, runner)
    assert batch.preempted == ("young",)
    drain(sched, runner)
    for s in (old, young):
        assert (s.output_token_ids, s.finish_reason) == reference(replace(s, output_token_ids=[]))


def test_oldest_sequence_waits_rather_than_being_preempted() -> None:
    # Pages held outside the scheduler (a PD reservation) starve the only
    # running sequence: it waits with its pages and resumes when they return.
    sched, runner = make(num_pages=3, page_size=2)
    seq = new_seq("r", 4, max_tokens=3, ignore_eos=True)
    sched.add(seq)
    step(sched, runner)
    outside = sched.allocator.allocate(1)
    batch, _ = step(sched, runner)  # position 4 needs a third page
    assert batch.is_empty and batch.preempted == () and seq.status is S.RUNNING
    sched.allocator.free(outside)
    drain(sched, runner)
    assert seq.output_token_ids == reference(replace(seq, output_token_ids=[]))[0]


# ---- aborts and protocol errors -----------------------------------------


def test_abort_matches_the_exact_rid_only() -> None:
    sched, runner = make()
    for rid in ("req-1", "req-10", "req-11"):
        sched.add(new_seq(rid))
    step(sched, runner)
    assert sched.abort("req-") is None
    aborted = sched.abort("req-1")
    assert aborted is not None and aborted.rid == "req-1" and aborted.finish_reason == "abort"
    assert sched.get("req-10") is not None and sched.get("req-11") is not None
    assert sched.abort("req-1") is None


@pytest.mark.parametrize("where", ["waiting", "running", "held", "ready"])
def test_abort_frees_pages_wherever_the_sequence_is(where: str) -> None:
    sched, runner = make(max_running_requests=1, max_batch_tokens=8)
    sched.add(new_seq("first", 3, max_tokens=9, ignore_eos=True))
    step(sched, runner)
    if where == "ready":
        sched.add(prefilled_elsewhere(sched, runner, new_seq("x", 6)))
    else:
        sched.add(new_seq("x", 6, mode="prefill_only" if where == "held" else "normal"))
    if where in ("running", "held"):
        sched.abort("first")
        step(sched, runner)
    assert (
        sched.get("x").status
        is {  # type: ignore[union-attr]
            "waiting": S.WAITING,
            "ready": S.WAITING,
            "running": S.RUNNING,
            "held": S.HELD,
        }[where]
    )
    seq = sched.abort("x")
    assert seq is not None and seq.status is S.FINISHED and seq.page_table == []
    sched.abort("first")
    assert sched.allocator.num_free == 64 and not sched.has_work()


def test_pages_of_a_sequence_aborted_mid_step_return_after_the_step() -> None:
    sched, runner = make(num_pages=8)
    sched.add(new_seq("a", 8))
    batch = sched.schedule()
    pages = list(batch.chunks[0].page_table)
    sched.abort("a")
    # The runner may still be writing these pages: they are not reusable yet.
    assert all(sched.allocator.is_allocated(p) for p in pages)
    assert not sched.allocator.can_allocate(7)
    sampled, _ = runner.run(batch)
    assert sched.on_step_done(sampled) == []  # its token is ignored
    assert sched.allocator.num_free == 8


def test_finish_ends_a_sequence_for_an_outside_reason() -> None:
    sched, runner = make()
    sched.add(new_seq("r", max_tokens=10))
    step(sched, runner)
    with pytest.raises(SchedulerError, match="finish reason"):
        sched.finish("r", "prefill_done")
    with pytest.raises(SchedulerError, match="no unfinished sequence"):
        sched.finish("nope", "stop")
    sched.finish("r", "stop")
    assert sched.get("r") is None and sched.allocator.num_free == 64


def test_finish_refuses_held_sequences() -> None:
    sched, runner = make()
    sched.add(new_seq("r", mode="prefill_only"))
    step(sched, runner)
    with pytest.raises(SchedulerError, match="use release"):
        sched.finish("r", "stop")
    assert sched.num_held == 1


@pytest.mark.parametrize(
    ("sampled", "message"),
    [
        ({}, "no sampled token for 'b'"),
        ({"b": 1, "zzz": 1}, "not sampled this step"),
        ({"a": 1, "b": 1}, "not sampled this step"),  # "a" is mid-prefill
        ({"b": -1}, "int >= 0"),
        ({"b": True}, "int >= 0"),
    ],
)
def test_bad_step_results_are_refused_and_the_step_stays_open(
    sampled: dict[str, int], message: str
) -> None:
    sched, runner = make(chunk_size=4)
    sched.add(new_seq("a", 9))
    sched.add(new_seq("b", 2))
    batch = sched.schedule()
    with pytest.raises(SchedulerError, match=message):
        sched.on_step_done(sampled)
    with pytest.raises(SchedulerError, match="before on_step_done"):
        sched.schedule()
    good, _ = runner.run(batch)
    assert [s.rid for s in sched.on_step_done(good)] == ["b"]
    assert sched.get("a").num_computed_tokens == 4  # type: ignore[union-attr]


def test_tokens_without_a_batch_are_refused() -> None:
    sched, _ = make()
    with pytest.raises(SchedulerError, match="no batch is in flight"):
        sched.on_step_done({"r": 1})
    assert sched.on_step_done({}) == []


def test_fail_step_aborts_the_batch_and_returns_its_pages() -> None:
    sched, runner = make(max_running_requests=2, max_batch_tokens=8)
    for rid in "abc":
        sched.add(new_seq(rid))
    sched.schedule()
    aborted = sched.fail_step()
    assert [s.rid for s in aborted] == ["a", "b"]
    assert all(s.finish_reason == "abort" for s in aborted)
    assert sched.allocator.num_free == 64 and sched.num_waiting == 1
    assert drain(sched, runner).keys() == {"c"}


# ---- properties ----------------------------------------------------------

CONFIGS = st.builds(
    SchedulerConfig,
    page_size=st.integers(1, 4),
    max_running_requests=st.integers(1, 4),
    max_batch_tokens=st.integers(4, 16),
    chunk_size=st.integers(1, 8),
    max_prompt_tokens=st.integers(6, 16),
    max_model_len=st.integers(12, 32),
)
# A pool of 8..40 token slots: each request fits alone, a few together do not.
POOL_TOKENS = st.integers(8, 40)
REQUESTS = st.builds(
    Sequence,
    rid=st.just(""),  # named on add
    prompt_token_ids=st.lists(st.integers(0, VOCAB - 1), max_size=12),
    max_tokens=st.integers(0, 10),
    # Mostly without stop ids, so that sequences grow and the pool runs out.
    stop_token_ids=st.lists(st.integers(0, 4 * VOCAB), max_size=1),
    eos_token_id=st.integers(0, 4 * VOCAB).map(lambda t: t if t < VOCAB else None),
    ignore_eos=st.booleans(),
    mode=st.sampled_from(["normal", "normal", "prefill_only", "prefilled"]),
)


def admissible(cfg: SchedulerConfig, num_pages: int, seq: Sequence) -> bool:
    n, m = seq.num_prompt_tokens, seq.max_tokens
    kv_tokens = n if seq.mode == "prefill_only" else n + m - 1
    return (
        1 <= n <= cfg.max_prompt_tokens
        and m >= 1
        and n + m <= cfg.max_model_len
        and -(-kv_tokens // cfg.page_size) <= num_pages
    )


def check_progress(seq: Sequence) -> None:
    """Outputs so far are a prefix of the reference; a finished one is all of it."""
    expected, reason = reference(replace(seq, output_token_ids=[]))
    assert seq.output_token_ids == expected[: seq.num_output_tokens]
    if seq.is_finished and seq.finish_reason != "abort":
        assert (seq.output_token_ids, seq.finish_reason) == (expected, reason)


class SchedulerMachine(RuleBasedStateMachine):
    """Random add / schedule / complete / abort / release / finish traffic."""

    @initialize(config=CONFIGS, pool_tokens=POOL_TOKENS)
    def setup(self, config: SchedulerConfig, pool_tokens: int) -> None:
        num_pages = pool_tokens // config.page_size
        self.cfg, self.total = config, num_pages
        self.sched = Scheduler(config, PageAllocator(num_pages))
        self.runner = FakeRunner(config.page_size)
        self.live: dict[str, Sequence] = {}
        self.batch: ScheduledBatch | None = None
        self.deferred: list[int] = []  # pages of sequences ended mid-step
        self.count = 0
        self.preemptions = 0

    def _in_batch(self, seq: Sequence) -> bool:
        return self.batch is not None and seq.rid in {c.rid for c in self.batch.chunks}

    def _ended(self, seq: Sequence, pages: list[int]) -> None:
        assert seq.status is S.FINISHED and seq.page_table == []
        assert self.sched.get(seq.rid) is None
        if self._in_batch(seq):
            self.deferred += pages  # the runner may still write them
            event("ended mid-step")
        del self.live[seq.rid]

    def _absorb(self, changed: list[Sequence]) -> None:
        for seq in changed:
            check_progress(seq)
            event(f"finished: {seq.finish_reason}")
            if seq.status is S.FINISHED:
                self.live.pop(seq.rid, None)  # gone already if its first token ended it

    @rule(specs=st.lists(REQUESTS, min_size=1, max_size=4))
    def add(self, specs: list[Sequence]) -> None:
        for spec in specs:
            self._add_one(spec)

    def _add_one(self, spec: Sequence) -> None:
        seq = replace(spec, rid=f"r{self.count}")
        self.count += 1
        ok = admissible(self.cfg, self.total, seq)
        before = snapshot(self.sched)
        if seq.mode == "prefilled":
            need = pages_for(seq.num_prompt_tokens, self.cfg.page_size)
            if not seq.prompt_token_ids or not self.sched.allocator.can_allocate(need):
                return
            seq = prefilled_elsewhere(self.sched, self.runner, seq)
        if not ok:
            with pytest.raises(RequestRejected):
                self.sched.add(seq)
            self.sched.allocator.free(seq.page_table)
            assert snapshot(self.sched) == before
            return
        self.live[seq.rid] = seq
        self.sched.add(seq)
        if seq.status is S.FINISHED:  # a prefilled request its first token ended
            del self.live[seq.rid]

    @precondition(lambda self: self.batch is None)
    @rule(n=st.integers(1, 12))
    def steps(self, n: int) -> None:
        for _ in range(n):
            self.schedule()
            if self.batch is not None:
                self.complete()

    @precondition(lambda self: self.batch is None)
    @rule()
    def schedule(self) -> None:
        by_arrival = sorted(self.live.values(), key=lambda s: s.arrival)
        waiting = [
            s for s in by_arrival if s.status in (S.WAITING, S.PREEMPTED) and not s.page_table
        ]
        running = [s for s in by_arrival if s.status is S.RUNNING]
        has_work = self.sched.num_running + self.sched.num_waiting > 0
        batch = self.sched.schedule()
        cfg = self.cfg
        assert len({c.rid for c in batch.chunks}) == len(batch.chunks)
        assert batch.num_tokens <= cfg.max_batch_tokens
        assert self.sched.num_running <= cfg.max_running_requests
        for c in batch.chunks:
            seq = self.live[c.rid]
            assert seq.status is S.RUNNING and c.start_pos == seq.num_computed_tokens
            assert c.token_ids == tuple(seq.token_ids[c.start_pos : c.end_pos])
            assert c.page_table == tuple(seq.page_table)
            assert len(c.page_table) * cfg.page_size >= c.end_pos
            assert len(c.token_ids) <= (cfg.chunk_size if c.is_prefill else 1)
            assert c.sample == (c.end_pos == seq.num_tokens)
        admitted = [s for s in waiting if s.status is S.RUNNING]
        assert admitted == waiting[: len(admitted)], "FIFO admission broken"
        assert not (admitted and batch.preempted)
        if running:
            assert running[0].rid not in batch.preempted, "oldest running sequence preempted"
        for rid in batch.preempted:
            assert self.live[rid].status is S.PREEMPTED and not self.live[rid].page_table
            self.preemptions += 1
        if has_work and self.sched.num_held == 0:
            assert batch.chunks, "work left but nothing scheduled with no pages held outside"
        if batch.chunks:
            self.batch = batch
        else:
            self._absorb(self.sched.on_step_done({}))

    @precondition(lambda self: self.batch is not None)
    @rule()
    def complete(self) -> None:
        assert self.batch is not None
        sampled, contexts = self.runner.run(self.batch)
        for c in self.batch.chunks:
            if c.rid in self.live:  # not ended mid-step: its context must be intact
                assert contexts[c.rid] == self.live[c.rid].token_ids[: c.end_pos]
        changed = self.sched.on_step_done(sampled)
        self.batch, self.deferred = None, []
        self._absorb(changed)

    @precondition(lambda self: self.batch is not None)
    @rule()
    def fail_step(self) -> None:
        victims = {rid: list(s.page_table) for rid, s in self.live.items() if self._in_batch(s)}
        aborted = self.sched.fail_step()
        assert sorted(s.rid for s in aborted) == sorted(victims)
        for seq in aborted:
            assert seq.finish_reason == "abort"
            del self.live[seq.rid]
        self.batch, self.deferred = None, []

    @rule(pick=st.integers(0, 1 << 16))
    def abort(self, pick: int) -> None:
        # Two draws in three name no live sequence ("r" prefixes every rid):
        # aborts stay rare enough for sequences to grow and meet the pool's end.
        rids = sorted(self.live)
        rid = rids[pick // 3 % len(rids)] if pick % 3 == 0 and rids else ("r", "nope")[pick % 2]
        seq = self.live.get(rid)
        pages = list(seq.page_table) if seq else []
        result = self.sched.abort(rid)
        assert result is seq
        if seq is not None:
            assert seq.finish_reason == "abort"
            self._ended(seq, pages)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def release_or_finish(self, data: st.DataObject) -> None:
        held = sorted(rid for rid, s in self.live.items() if s.status is S.HELD)
        seq = self.live[data.draw(st.sampled_from(held or sorted(self.live)))]
        pages = list(seq.page_table)
        if seq.status is S.HELD:
            with pytest.raises(SchedulerError):
                self.sched.finish(seq.rid, "stop")
            self.sched.release(seq.rid)
        else:
            with pytest.raises(SchedulerError):
                self.sched.release(seq.rid)
            self.sched.finish(seq.rid, "length")
        self._ended(seq, pages)

    @invariant()
    def pages_have_one_owner(self) -> None:
        if not hasattr(self, "sched"):
            return
        tables = [p for s in self.live.values() for p in s.page_table]
        assert len(set(tables)) == len(tables), "a page belongs to two sequences"
        assert not set(tables) & set(self.deferred)
        alloc = self.sched.allocator
        assert alloc.num_allocated == len(tables) + len(self.deferred), "page leak"
        assert all(alloc.is_allocated(p) for p in tables + self.deferred)
        statuses = [s.status for s in self.live.values()]
        assert self.sched.num_running == statuses.count(S.RUNNING)
        assert self.sched.num_held == statuses.count(S.HELD)
        assert self.sched.num_waiting == statuses.count(S.WAITING) + statuses.count(S.PREEMPTED)
        assert all(self.sched.get(rid) is s for rid, s in self.live.items())

    def teardown(self) -> None:
        if not hasattr(self, "sched"):
            return
        if self.batch is not None:
            self.complete()
        for rid in list(self.live):
            self.sched.abort(rid)
        self._absorb(self.sched.on_step_done({}))  # finishes reported late
        assert self.sched.allocator.num_free == self.total, "pages leaked"
        assert not self.sched.has_work()
        event("preempted" if self.preemptions else "no preemption")
        target(self.preemptions, label="preemptions")


SchedulerMachine.TestCase.settings = settings(
    max_examples=100, stateful_step_count=50, deadline=None
)
TestSchedulerMachine = SchedulerMachine.TestCase


@settings(max_examples=150, deadline=None)
@given(
    config=CONFIGS,
    pool_tokens=POOL_TOKENS,
    requests=st.lists(st.tuples(st.integers(0, 6), REQUESTS), min_size=1, max_size=10),
)
def test_every_admitted_request_finishes_with_its_reference_output(
    config: SchedulerConfig, pool_tokens: int, requests: list[tuple[int, Sequence]]
) -> None:
    """Batching, chunking and preemption never change what a request produces."""
    num_pages = pool_tokens // config.page_size
    sched, runner = Scheduler(config, PageAllocator(num_pages)), FakeRunner(config.page_size)
    pending = sorted((when, i, replace(seq, rid=f"r{i}")) for i, (when, seq) in enumerate(requests))
    accepted: list[Sequence] = []
    preemptions = 0
    for t in range(5000):
        while pending and pending[0][0] <= t:
            _, _, seq = pending.pop(0)
            if not admissible(config, num_pages, seq):
                with pytest.raises(RequestRejected):
                    sched.add(replace(seq, mode="normal"))
                continue
            if seq.mode == "prefilled":
                need = pages_for(seq.num_prompt_tokens, config.page_size)
                if not sched.allocator.can_allocate(need):
                    seq = replace(seq, mode="normal")
                else:
                    seq = prefilled_elsewhere(sched, runner, seq)
            sched.add(seq)
            accepted.append(seq)
        if not pending and not sched.has_work():
            break
        batch, changed = step(sched, runner)
        preemptions += len(batch.preempted)
        for seq in changed:
            if seq.status is S.HELD:
                sched.release(seq.rid)
    else:
        raise AssertionError("requests did not finish")
    event("preempted" if preemptions else "no preemption")
    target(preemptions, label="preemptions")  # steer generation toward tight pools
    for seq in accepted:
        check_progress(seq)
        assert seq.status is S.FINISHED
    assert sched.allocator.num_free == num_pages


def test_prefill_only_takes_all_prompt_pages_at_once_and_is_never_preempted() -> None:
    # A prefill_only sequence's KV streams to decode while it computes: the
    # pages a transfer may be reading must never be freed or moved under it.
    sched, runner = make(num_pages=6, page_size=4, chunk_size=4, max_batch_tokens=64)
    older = new_seq("older", prompt_len=4, max_tokens=20)
    held = new_seq("held", prompt_len=12, max_tokens=1, mode="prefill_only")
    sched.add(older)
    step(sched, runner)  # older admitted: 1 page
    sched.add(held)
    batch, _ = step(sched, runner)
    assert [c.rid for c in batch.chunks if c.rid == "held"] == ["held"]
    assert len(held.page_table) == 3, "all prompt pages on admission, not one chunk's worth"
    pages = list(held.page_table)
    while held.status is not SequenceStatus.HELD:
        batch, _ = step(sched, runner)
        assert "held" not in batch.preempted
        assert held.page_table == pages
    # The older normal sequence now runs out of pages; it must not take the held ones.
    for _ in range(30):
        if not sched.has_work() or older.is_finished:
            break
        batch, _ = step(sched, runner)
        assert "held" not in batch.preempted
    assert held.page_table == pages and all(sched.allocator.is_allocated(p) for p in pages)
    sched.release("held")
    drain(sched, runner)
    assert sched.allocator.num_free == 6
