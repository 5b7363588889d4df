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
    emit(table_rows(settings, rebuild=args.table_command == "rebuild"), args.format, COLUMNS)
    return 0


def table_rows(settings: Settings, rebuild: bool = False) -> list[dict]:
    """One row per table of this broker (``tierlog table info``, and ``status``'s table lag); with
    ``rebuild``, each table is first made equal to the tier alone."""
    from connectors.tables.latest import LatestTables
    from connectors.tables.messages import MessageTables, TierView
    from connectors.tier.location import open_backend
    from connectors.tier.log import TierLog

    location, broker = settings.paths.tier, settings.broker
    backend = open_backend(location)
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
