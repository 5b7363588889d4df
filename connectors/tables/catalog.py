"""Which catalog holds the tables, and what each table is called.

By default a SQL catalog in a SQLite file beside the metadata store, and a warehouse in the tier
under ``_tables/`` (so DuckDB or pyiceberg read a table from its metadata file wherever the tier is
readable); a REST catalog when the URI is ``http(s)://``.
"""

from __future__ import annotations

import logging
import os
import re
import time
from dataclasses import dataclass, field

from connectors.errors import ConfigError

log = logging.getLogger(__name__)
WAREHOUSE_DIR = "_tables"  # in the tier root; the tier's readers glob ``topic=*`` and never see it
_NOT_IN_NAME = re.compile(r"[^A-Za-z0-9_]")
OPEN_ATTEMPTS = 5


@dataclass(frozen=True)
class TableSettings:
    catalog_uri: str  # sqlite:///..., postgresql://... (SQL catalog) or http(s)://... (REST catalog)
    warehouse: str  # a directory or s3://bucket/prefix where table metadata is written
    namespace: str = "tierlog"
    name: str = "rmq_{topic}"  # {topic}: the topic with characters other than [A-Za-z0-9_] made '_'
    latest_name: str = "rmq_{topic}_latest"  # the latest-per-key table of the topic
    properties: dict[str, str] = field(default_factory=dict)  # catalog properties: token, credential, s3.*
    # When a table commits (``connectors.tables.messages``): at most every ``commit_interval_s``, once
    # its new rows reach ``min_commit_bytes`` or have waited ``max_commit_delay_s``; all tables together
    # at most ``commits_per_minute`` times a minute, longest waiting first.  Why these: a message is in
    # its table within a few seconds of its commit on a busy broker, a quiet one's commits wait to fill
    # a little, and a host with a thousand topics spends a bounded number of requests a day, each
    # table then waiting its turn (docs/operations.md, "The tables' requests").
    commit_interval_s: float = 2.0
    min_commit_bytes: int = 1 << 20
    max_commit_delay_s: float = 5.0
    commits_per_minute: int = 60
    # Older snapshots expire, with the manifests only they referenced.  Why 20: a commit's cost grows
    # with the snapshots the table metadata holds (pyiceberg copies the whole metadata for each change
    # a transaction makes, many times per commit), so a commit with 100 kept costs about twice one with
    # 20, and stays flat in the table's history either way (./dev bench tables --snapshots-kept).
    snapshots_kept: int = 20
    body_formats: str = ""  # topics.body_format: ``glob=format`` pairs (connectors.bodies.base.BodyFormats)


def default_settings(tier_location: str, state_dir: str, **overrides) -> TableSettings:
    """The embedded default: SQLite under ``state_dir``, metadata under the tier's ``_tables/``."""
    warehouse = overrides.pop("warehouse", "") or data_location(tier_location, WAREHOUSE_DIR)
    uri = overrides.pop("catalog_uri", "") or f"sqlite:///{os.path.abspath(os.path.join(state_dir, 'tables.db'))}"
    return TableSettings(catalog_uri=uri, warehouse=warehouse, **overrides)


def data_location(tier_location: str, name: str) -> str:
    """The URI an engine opens for the tier object ``name``: ``s3://...`` or ``file:///...``."""
    if tier_location.startswith("s3://"):
        return f"{tier_location.rstrip('/')}/{name}"
    return f"file://{os.path.abspath(tier_location)}/{name}"


def table_name(template: str, topic: str) -> str:
    """The table name for ``topic``: characters engines would need quoted become ``_``
    (``warn_if_renamed`` says so once, when the table is made)."""
    return template.format(topic=_NOT_IN_NAME.sub("_", topic))


_SAID: set[str] = set()  # topics whose table names were said, in this process


def warn_if_renamed(template: str, topic: str) -> None:
    """Say once per topic, at INFO, that its table's name is not the topic's own (a hyphen is the
    usual case: the names are made so engines need no quotes, which is no one's mistake)."""
    name = table_name(template, topic)
    if name != template.format(topic=topic) and topic not in _SAID:
        _SAID.add(topic)
        log.info("topic %r has tables named as %r: characters other than letters, digits and '_' become '_'",
                 topic, name)


def sqlite_file(uri: str) -> str | None:
    """The file of a ``sqlite:///path`` catalog URI; None for any other catalog."""
    return uri[len("sqlite:///"):] if uri.startswith("sqlite:///") else None


def open_catalog(settings: TableSettings):
    """The pyiceberg catalog the settings name; raises ``ConfigError`` naming the setting."""
    from pyiceberg.catalog import load_catalog

    props = {"warehouse": settings.warehouse, **settings.properties}
    uri = settings.catalog_uri
    if uri.startswith(("http://", "https://")):
        props.update(type="rest", uri=uri)
    elif "://" in uri:
        if sqlite_file(uri) is not None:
            os.makedirs(os.path.dirname(sqlite_file(uri)) or ".", exist_ok=True)
        props.update(type="sql", uri=uri)
    else:
        raise ConfigError(f"setting tables.catalog_uri: {uri!r} is neither a SQLAlchemy URL (sqlite:///path) "
                          "nor a REST catalog's http(s):// URL")
    if settings.warehouse.startswith("s3://"):  # the same AWS_* variables the tier's S3 backend reads
        env = os.environ.get
        for key, value in (("s3.endpoint", env("AWS_ENDPOINT_URL_S3") or env("AWS_ENDPOINT_URL")),
                           ("s3.region", env("AWS_REGION")), ("s3.access-key-id", env("AWS_ACCESS_KEY_ID")),
                           ("s3.secret-access-key", env("AWS_SECRET_ACCESS_KEY"))):
            if value:
                props.setdefault(key, value)
    else:
        os.makedirs(settings.warehouse.removeprefix("file://"), exist_ok=True)
    for attempt in range(OPEN_ATTEMPTS):
        try:
            catalog = load_catalog("tierlog", **props)
            catalog.create_namespace_if_not_exists(settings.namespace)
            return catalog
        except Exception as exc:
            # Two openers of a new SQL catalog (tiering and compaction of one process, or two
            # brokers) both find its tables missing and both create them: the loser's CREATE fails
            # ("table iceberg_tables already exists"); opened again, it finds them.
            if attempt == OPEN_ATTEMPTS - 1 or type(exc).__name__ not in ("OperationalError", "IntegrityError"):
                raise
            log.debug("opening catalog %s raced another opener (%s); again", uri, exc)
            time.sleep(0.05 * 2 ** attempt)
