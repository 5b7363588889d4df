"""``tierlog tier ...`` maintenance and ``tierlog commitlog gc``: commands that change the tier or the commitlog offline."""

from __future__ import annotations

import logging
import time

from connectors.errors import ConfigError
from streaming import config as cfg
from streaming.cli.output import emit
from streaming.settings import derive

log = logging.getLogger("tierlog")


def cmd_tier(args, conf: cfg.Config) -> int:
    from connectors.tier.location import open_backend
    from connectors.tier.log import TierLog
    from state.metadata import MetadataStore

    s = derive(conf)
    backend = open_backend(s.paths.tier)
    if args.tier_command == "upgrade":
        from connectors.tier.upgrade import upgrade_to_broker

        report = upgrade_to_broker(backend, s.broker)
        if report is None:
            log.info("the tier at %s is up to date: nothing to upgrade", s.paths.tier)
        else:
            emit([report], args.format)
        return 0
    committed = TierLog(backend, s.broker).committed()
    store = MetadataStore(s.paths.metadata)
    try:
        store.rebuild(committed)
    finally:
        store.close()
    states = committed.queue_states()
    emit([{"commit_records": committed.seq + 1, "queues": len(states), "segments": sum(q.segments for q in states.values()),
           "staging_objects": len(committed.staging), "tiered_to_phy": committed.source_end}], args.format)
    return 0


def cmd_commitlog_gc(args, conf: cfg.Config) -> int:
    import os

    from connectors.commitlog.reader import list_files
    from streaming.cli.found import open_metadata
    from streaming.plan import commitlog_sinks, safepoint

    s = derive(conf)
    retention = s.local_retention_s
    store = open_metadata(s)
    try:
        sinks = store.journal.sinks()
    finally:
        store.close()
    point = safepoint(s, sinks)
    if point is None:
        raise ConfigError(
            f"no safepoint yet: every sink fed from the commitlog ({', '.join(commitlog_sinks(s))}) must have applied "
            "something and every query committed a batch (run `tierlog run` first); with checkpoint.dir "
            "outside the local file system gc cannot tell what a restart would read again, and deletes nothing"
        )
    now = time.time()
    files = list_files(s.paths.commitlog)
    # Never the newest file: a writer may be appending to it.
    doomed = [f for f in files[:-1] if f.end <= point and now - os.path.getmtime(f.path) >= retention]
    for f in doomed:
        if not args.dry_run:
            os.remove(f.path)
    emit([{"file": f.path, "start_phy": f.base, "end_phy": f.end, "deleted": not args.dry_run} for f in doomed]
         or [{"file": "-", "start_phy": None, "end_phy": None, "deleted": False}], args.format)
    log.info("safepoint %d (%s); %d file(s) %s", point, ", ".join(f"{k}={v}" for k, v in sinks.items()),
             len(doomed), "would be deleted" if args.dry_run else "deleted")
    return 0
