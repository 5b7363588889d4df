"""connectors/tables/view.py's staging parts kept from round to round (``StagingParts``) against the
whole list worked out afresh each round, as a seal retires objects and batches add them."""

from __future__ import annotations

import random

from connectors.tables.view import StagingParts, TierView, parts_from
from connectors.tier.manifest import StagingObject


def afresh(staging: list[StagingObject]) -> dict:
    """The oracle: every live object's parts, by queue, in the objects' order (no shared code)."""
    out: dict = {}
    for obj in staging:
        for key in sorted(obj.queues):
            st = obj.queues[key]
            out.setdefault(key, []).append((st["last"], st["bytes"], obj.time_ms))
    return out


def view(staging: list[StagingObject]) -> TierView:
    return TierView(0, 0.0, {}, list(staging), [], lambda topic, q: ())


def test_parts_kept_between_rounds_equal_the_parts_worked_out_afresh():
    rng, kept, live, next_offset, n = random.Random(7), StagingParts(), [], {}, 0
    retired = added = 0
    for _round in range(400):
        if live and rng.random() < 0.1:  # a seal retires the oldest objects
            cut = rng.randint(1, len(live))
            live, retired = live[cut:], retired + cut
        for _ in range(rng.choice((0, 0, 1, 2))):  # batches commit new objects
            queues = {}
            for key in rng.sample([("a", 0), ("a", 1), ("b", 0)], rng.randint(1, 3)):
                first = next_offset.get(key, 0)
                last = first + rng.randint(0, 5)
                next_offset[key] = last + 1
                queues[key] = {"first": first, "last": last, "rows": last - first + 1, "bytes": rng.randint(1, 999)}
            live.append(StagingObject(f"s{n}", 1, n, queues, time_ms=1000 + n))
            n, added = n + 1, added + 1
        assert kept.of(view(live)) == afresh(live)
    assert retired and added > retired  # both kinds of change happened


def test_parts_from_an_offset_are_those_holding_it_or_later():
    parts = {("a", 0): [(4, 10, 1), (9, 20, 2), (15, 30, 3)]}
    assert parts_from(parts, ("a", 0), 0) == parts[("a", 0)]
    assert parts_from(parts, ("a", 0), 9) == [(9, 20, 2), (15, 30, 3)]
    assert parts_from(parts, ("a", 0), 10) == [(15, 30, 3)]
    assert parts_from(parts, ("a", 0), 16) == []
    assert parts_from(parts, ("b", 0), 0) == ()
