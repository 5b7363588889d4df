"""``tierlog table info`` and ``tierlog table rebuild``: the Iceberg message tables (``[tables]``)."""

from __future__ import annotations

import logging

from connectors.errors import ConfigError
from streaming import config as cfg
from streaming.cli.output import emit

log = logging.getLogger("tierlog")


def cmd_table(args, conf: cfg.Config) -> int:
    from connectors.tables.messages import MessageTables
    from connectors.tier.backend import open_backend
    from connectors.tier.log import TierLog
    from streaming.settings import tables

    settings = tables(conf)
    if settings is None:
        raise ConfigError("setting tables.enabled is false: set `[tables] enabled = true` in tierlog.toml "
                          "(or TIERLOG_TABLES_ENABLED=true) to keep Iceberg tables of the tier")
    view = TierLog(open_backend(conf.tier.location), conf.broker.name).view()
    message_tables = MessageTables(settings, conf.tier.location, conf.broker.name)
    if args.table_command == "rebuild":
        committed = message_tables.rebuild(view.seq, view.segments.values())
        log.info("%d tables brought to the tier's record %d (%d sealed segments of broker %s)",
                 committed, view.seq, len(view.segments), conf.broker.name)
    emit(message_tables.info(view.seq), args.format)
    return 0
