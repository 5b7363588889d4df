"""``tierlog table info`` and ``tierlog table rebuild``: the Iceberg message and latest-per-key tables
(``[tables]``)."""

from __future__ import annotations

import logging

from connectors.errors import ConfigError
from streaming import config as cfg
from streaming.cli.output import emit
from streaming.settings import Settings, derive

log = logging.getLogger("tierlog")
COLUMNS = ["table", "kind", "topic", "snapshot_id", "tier_seq", "tier_head_seq", "lag_messages", "lag_s",
           "through_phy", "metadata_location"]


def cmd_table(args, conf: cfg.Config) -> int:
    settings = derive(conf)
    if settings.tables is None:
        raise ConfigError("setting tables.enabled is false: set `[tables] enabled = true` in tierlog.toml "
                          "(or TIERLOG_TABLES_ENABLED=true) to keep Iceberg tables of the tier")
    from streaming.cli.found import open_reader

    open_reader(settings)  # a tier that holds nothing is refused, naming the setting, before a catalog opens
    rows = table_rows(settings, rebuild=args.table_command == "rebuild")
    if not rows and args.format == "table":
        log.info("no table yet: `tierlog run` makes each topic's tables as it tiers the topic")
    typed = ["unreadable_bodies"] if any("unreadable_bodies" in r for r in rows) else []  # JSON topics only
    emit(rows, args.format, COLUMNS[:-1] + typed + COLUMNS[-1:])
    return 0


def table_rows(settings: Settings, rebuild: bool = False) -> list[dict]:
    """One row per table of this broker (``tierlog table info``, and ``status``'s table lag); with
    ``rebuild``, each table is first made equal to the tier alone.  Without ``rebuild`` nothing is
    created: a SQLite catalog file that is not there yet means no table yet."""
    import os

    from connectors.tables.catalog import sqlite_file

    from connectors.tables.latest import LatestTables
    from connectors.tables.messages import MessageTables
    from connectors.tables.view import TierView
    from connectors.tier.location import open_backend
    from connectors.tier.log import TierLog

    location, broker = settings.paths.tier, settings.broker
    catalog_file = sqlite_file(settings.tables.catalog_uri)
    if not rebuild and catalog_file is not None and not os.path.exists(catalog_file):
        return []
    backend = open_backend(location, create=False)
    try:
        tier = TierLog(backend, broker).committed()
        view = TierView.from_committed(tier)
        message_tables = MessageTables(settings.tables, location, broker, backend=backend)
        latest_tables = LatestTables(settings.tables, location, broker, message_tables.catalog)
        if rebuild:
            committed = message_tables.rebuild(view)
            log.info("%d message tables brought to the tier's record %d (every committed message of broker %s)",
                     committed, tier.seq, broker)
            committed = latest_tables.rebuild(backend)
            log.info("%d latest-per-key tables hold broker %s's newest compacted snapshots", committed, broker)
        return message_tables.info(view) + latest_tables.info()
    finally:
        backend.close()
