"""Moving a tier written before tierlog knew brokers under one broker's name.

Such a tier has ``topic=<t>/queue=<q>/`` segments and one commit log at ``_log/``.  Upgrading
it to broker ``b`` copies every retained segment, key index, staging object and snapshot to
its ``broker=<b>`` name, writes ``b``'s metadata naming the copies, and only then deletes every
object of the old layout, the commit log last.

It is an explicit, offline step (``tierlog tier upgrade``): it reads and writes everything the
tier holds once, and no tierlog may write the tier meanwhile.  A crash at any point leaves a
tier the same command finishes: before the new root nothing old was deleted and the copies are
named by nothing; after it the old objects are only deleted.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import time
from typing import Callable

from connectors.tier import layout
from connectors.tier.backend import Backend
from connectors.tier.log import TierHead, TierLog, empty_root
from connectors.tier.manifest import QueueManifest
from connectors.tier.pool import io_map

log = logging.getLogger("tierlog.tier")

# Names of the layout before brokers: nothing between the topic (or _log/, _meta/, _staging/,
# _compacted/) and what follows it.
_OLD = [
    re.compile(r"^topic=[^/]*/queue=\d+/\d{20}\.parquet$"),
    re.compile(r"^_keys/topic=[^/]*/queue=\d+/\d{20}\.parquet$"),
    re.compile(r"^_staging/\d{20}\.parquet$"),
    re.compile(r"^_compacted/topic=[^/]*/\d{20}\.parquet$"),
    re.compile(r"^_meta/(buckets|queues|pages)/"),
]


def upgrade_to_broker(backend: Backend, broker: str, progress: Callable[[str], None] = log.info) -> dict | None:
    """Move a tier from before brokers under ``broker``; None when there is nothing to move."""
    old, new = TierLog(backend, None), TierLog(backend, broker)
    started = time.monotonic()
    listing = new._listing()
    if not listing.before_brokers:
        return None
    report = {"broker": broker, "queues": 0, "objects_copied": 0, "objects_deleted": 0}
    if not (listing.roots or listing.records):
        old.upgrade()  # a first-layout tier becomes manifests first (nothing happens otherwise)
        report.update(_copy(old, new, progress))
    report["objects_deleted"] = _delete_old(backend, progress)
    report["seconds"] = round(time.monotonic() - started, 1)
    progress(f"the tier at {backend.location} now holds broker {broker!r}: {report['queues']} queues, "
             f"{report['objects_copied']} objects copied, {report['objects_deleted']} old ones deleted "
             f"({report['seconds']} s)")
    return report


def _copy(old: TierLog, new: TierLog, progress) -> dict:
    committed = old.committed()
    keys = committed.queue_keys()
    committed.prefetch(keys)
    names = new.names
    # One past the old log's last seq: a metadata store that followed the old log is then behind a
    # root with no records after it, and rebuilds itself from the tier (its segment names moved).
    seq = committed.seq + 1
    head = TierHead({**empty_root(committed.buckets), "seq": seq, "source_end": committed.source_end,
                     "last_batch_id": committed.last_batch_id, "filtered": committed.filtered, "last_record": committed.last_record,
                     "quarantined": [q for _, q in sorted(committed.quarantined.items())]})
    moves: dict[str, str] = {}
    manifests: dict[tuple[str, int], QueueManifest] = {}
    for key in keys:
        m = committed.queue(key)
        segments = []
        for s in committed.segments_for(key):
            moved = dataclasses.replace(s, name=names.segment(*key, s.base),
                                        keys=names.key_index(*key, s.base) if s.keys else None)
            moves[s.name] = moved.name
            if s.keys:
                moves[s.keys] = moved.keys
            segments.append(moved)
        staged = committed.staging_for(key)
        parts = [dataclasses.replace(p, name=names.staging(p.first_phy)) for p in staged]
        moves.update({p.name: names.staging(p.first_phy) for p in staged})
        manifests[key] = QueueManifest(m.state, parts, segments)
        head._add_queue(key)
        head.queues[key] = m.state
        head.versions[key] = seq
    for info in new.backend.list("_compacted/"):
        if _OLD[3].match(info.name):
            moves[info.name] = "_compacted/" + names.level + info.name[len("_compacted/"):]
    progress(f"upgrading the tier at {new.backend.location} to broker {new.broker!r}: copying {len(moves)} objects "
             f"of {len(keys)} queues")
    copied = [0]

    def copy(pair: tuple[str, str]) -> None:
        new.backend.put(pair[1], new.backend.read(pair[0]))
        copied[0] += 1
        if copied[0] % 1000 == 0:
            progress(f"copied {copied[0]} of {len(moves)} objects")

    io_map(copy, sorted(moves.items()))

    new.write_whole(head, manifests)  # from here on the tier is the broker's; the old objects are only garbage
    return {"queues": len(keys), "objects_copied": len(moves)}


def _delete_old(backend: Backend, progress) -> int:
    doomed = [info.name for prefix in ("topic=", "_keys/", "_staging/", "_compacted/", "_meta/")
              for info in backend.list(prefix) if any(p.match(info.name) for p in _OLD)]
    before = layout.Names(None)
    log_objects = [info.name for info in backend.list(layout.LOG_PREFIX) if before.parse_log(info.name)]
    io_map(backend.delete, doomed)
    for name in log_objects:  # last: while one is left, the command knows it has more to delete
        backend.delete(name)
    if doomed or log_objects:
        progress(f"deleted {len(doomed) + len(log_objects)} objects of the layout before brokers")
    return len(doomed) + len(log_objects)

