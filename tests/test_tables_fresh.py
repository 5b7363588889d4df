"""The plan of a message table's commits (``connectors.tables.fresh``) against a plain model of a
tier: random appends to several queues, seals of any queue at any time, retention, and table
commits in between.  After every commit the table (its registered segments and fresh files, as
the plan left them) holds exactly the committed, retained rows of every queue, each once; a fresh
file is only ever removed whole; and once every queue has sealed past a file, it is gone."""

from __future__ import annotations

import random

import pytest

from connectors.tables import fresh
from connectors.tier.manifest import Segment


class Tier:
    """Queues as the tier keeps them: committed, sealed and low offsets, and the segments."""

    def __init__(self, queues: int):
        self.commit = [0] * queues
        self.sealed = [0] * queues
        self.low = [0] * queues
        self.segments: list[list[Segment]] = [[] for _ in range(queues)]

    def append(self, q: int, n: int) -> None:
        self.commit[q] += n

    def seal(self, q: int) -> Segment | None:
        if self.commit[q] == self.sealed[q]:
            return None
        base, end = self.sealed[q], self.commit[q] - 1
        seg = Segment(f"topic=t/queue={q}/{base:020d}.parquet", "t", q, base, end, end - base + 1, 1, 0, 0)
        self.segments[q].append(seg)
        self.sealed[q] = self.commit[q]
        return seg

    def expire(self, q: int) -> Segment | None:
        if len(self.segments[q]) < 2:
            return None
        seg = self.segments[q].pop(0)
        self.low[q] = seg.end + 1
        return seg

    def now(self) -> dict[int, fresh.QueueNow]:
        return {q: fresh.QueueNow(self.commit[q], self.sealed[q], self.low[q]) for q in range(len(self.commit))}

    def rows(self) -> set[tuple[int, int]]:
        return {(q, o) for q in range(len(self.commit)) for o in range(self.low[q], self.commit[q])}


def table_rows(state: fresh.TopicState, listed: dict[int, list[Segment]], files: dict[str, set]) -> list[tuple[int, int]]:
    rows = [(s.queue_id, o) for segs in listed.values() for s in segs for o in range(s.base, s.end + 1)]
    rows += [r for name in state.files for r in files[name]]
    return rows


@pytest.mark.parametrize("seed", range(40))
def test_random_appends_seals_expiries_and_commits_keep_every_row_once(seed):
    rng = random.Random(seed)
    queues = rng.randint(1, 5)
    tier, state = Tier(queues), fresh.TopicState()
    listed: dict[int, list[Segment]] = {}  # what the table lists of the tier's segments
    files: dict[str, set] = {}  # each fresh file's rows, as written
    sealed, expired = [], []
    for step in range(rng.randint(20, 120)):
        for q in range(queues):
            if rng.random() < 0.7:
                tier.append(q, rng.randint(1, 9))
            if rng.random() < 0.15 and (seg := tier.seal(q)) is not None:
                sealed.append(seg)
            if rng.random() < 0.05 and (seg := tier.expire(q)) is not None:
                expired.append(seg)
        if rng.random() < 0.6:
            fresh.take_records(state, sealed, expired)
            sealed, expired = [], []
            plan = fresh.plan(state, tier.now())
            for seg in plan.unregister:
                listed[seg.queue_id] = [s for s in listed.get(seg.queue_id, []) if s.base != seg.base]
            for seg in plan.register:
                listed.setdefault(seg.queue_id, []).append(seg)
            added = None
            if plan.rows:
                name = f"f{step}"
                files[name] = {(q, o) for q, (a, b) in plan.rows.items() for o in range(a, b)}
                added = fresh.FreshFile(name, {q: (a, b - 1) for q, (a, b) in plan.rows.items()})
            fresh.apply(state, plan, added, {q: b for q, (a, b) in plan.rows.items()})
            rows = table_rows(state, listed, files)
            assert len(rows) == len(set(rows)), f"a row listed twice after step {step}"
            # Retention shorter than a file waits for its queues' seals leaves the file's rows below a
            # queue's low offset until the file goes: the one excess allowed, and nothing is missing.
            pinned = {(q, o) for name in state.files for q, o in files[name] if o < tier.low[q]}
            assert set(rows) == tier.rows() | pinned, f"the table differs from the tier after step {step}"
            for name in state.files:  # a file stays whole or goes whole
                assert files[name] <= set(rows)
    # Every queue seals past every file: one more commit leaves no fresh file, every retained
    # segment listed, and the rows the same.
    fresh.take_records(state, sealed + [s for q in range(queues) if (s := tier.seal(q)) is not None], expired)
    plan = fresh.plan(state, tier.now())
    assert not plan.rows
    fresh.apply(state, plan, None, {})
    for seg in plan.register:
        listed.setdefault(seg.queue_id, []).append(seg)
    assert not state.files and not state.pending
    assert {(s.queue_id, s.base) for segs in listed.values() for s in segs} >= {(q, s.base) for q in range(queues) for s in tier.segments[q]}
    assert set(table_rows(state, listed, files)) >= tier.rows()


def test_a_file_goes_once_every_queue_in_it_has_sealed_past_it():
    state = fresh.TopicState()
    tier = Tier(2)
    tier.append(0, 5)
    tier.append(1, 5)
    plan = fresh.plan(state, tier.now())
    assert plan.rows == {0: (0, 5), 1: (0, 5)}
    fresh.apply(state, plan, fresh.FreshFile("a", {0: (0, 4), 1: (0, 4)}), {0: 5, 1: 5})
    s0 = tier.seal(0)
    fresh.take_records(state, [s0], [])
    tier.append(0, 3)
    plan = fresh.plan(state, tier.now())
    assert plan.remove == [] and plan.register == [], "queue 1's rows in the file are not sealed yet"
    assert plan.rows == {0: (5, 8)}
    fresh.apply(state, plan, fresh.FreshFile("b", {0: (5, 7)}), {0: 8})
    s1 = tier.seal(1)
    fresh.take_records(state, [s1], [])
    plan = fresh.plan(state, tier.now())
    assert plan.remove == ["a"] and [s.base for s in plan.register] == [0, 0]
    assert plan.rows == {}
