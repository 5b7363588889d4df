"""``tierlog table info`` and ``tierlog table rebuild``: the Iceberg message and latest-per-key tables
(``[tables]``)."""

from __future__ import annotations

import logging

from connectors.errors import ConfigError
from streaming import config as cfg
from streaming.cli.output import emit

log = logging.getLogger("tierlog")
COLUMNS = ["table", "kind", "topic", "snapshot_id", "tier_seq", "tier_head_seq", "lag_segments", "through_phy",
           "metadata_location"]


def cmd_table(args, conf: cfg.Config) -> int:
    from streaming.settings import tables

    settings = tables(conf)
    if settings is None:
        raise ConfigError("setting tables.enabled is false: set `[tables] enabled = true` in tierlog.toml "
                          "(or TIERLOG_TABLES_ENABLED=true) to keep Iceberg tables of the tier")
    emit(table_rows(conf, settings, rebuild=args.table_command == "rebuild"), args.format, COLUMNS)
    return 0


def table_rows(conf: cfg.Config, settings, rebuild: bool = False) -> list[dict]:
    """One row per table of this broker (``tierlog table info``, and ``status``'s table lag); with
    ``rebuild``, each table is first made equal to the tier alone."""
    from connectors.tables.latest import LatestTables
    from connectors.tables.messages import MessageTables
    from connectors.tier.location import open_backend
    from connectors.tier.log import TierLog

    backend = open_backend(conf.tier.location)
    try:
        tier = TierLog(backend, conf.broker.name).committed()
        message_tables = MessageTables(settings, conf.tier.location, conf.broker.name)
        latest_tables = LatestTables(settings, conf.tier.location, conf.broker.name, message_tables.catalog)
        if rebuild:
            committed = message_tables.rebuild(tier.seq, tier.segments.values())
            log.info("%d message tables brought to the tier's record %d (%d sealed segments of broker %s)",
                     committed, tier.seq, len(tier.segments), conf.broker.name)
            committed = latest_tables.rebuild(backend)
            log.info("%d latest-per-key tables hold broker %s's newest compacted snapshots", committed,
                     conf.broker.name)
        return message_tables.info(tier.seq, tier.segments.values()) + latest_tables.info()
    finally:
        backend.close()
