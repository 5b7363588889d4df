"""Prometheus metrics of `tierlog run`, served by prometheus_client on ``metrics.port``.

Each metric is updated where the figure is known: the per-batch reports of the
three queries, the seal and upload timings, the Kafka sinks' counters, and a
poll of Spark's query progress (state rows) and of the metadata store
(safepoint) once per trigger interval.  A registry of its own per service, so
in-process runs (the tests) never see each other's values.
"""

from __future__ import annotations

import logging

from connectors.brokers import DEFAULT_BROKER
from connectors.sinks import CHANGELOG, MIRROR
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, start_http_server

log = logging.getLogger(__name__)

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
_BATCH_BUCKETS = (0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300)

class Metrics:
    def __init__(self, broker: str = DEFAULT_BROKER, queries=("tiering", "compaction", "mirror")) -> None:
        r = self.registry = CollectorRegistry()
        # Which broker's log this service reads: one series to join on, not a label on every metric.
        Info("tierlog_broker", "The RocketMQ broker (broker.name) whose commitlog this service reads.",
             registry=r).info({"broker": broker})
        self.batch_seconds = Histogram("tierlog_batch_duration_seconds", "Seconds per micro-batch.", ["query"],
                                       buckets=_BATCH_BUCKETS, registry=r)
        self.rows_in = Counter("tierlog_rows_in", "Rows a query's source gave Spark (compaction: each key's last of a staging object).", ["query"], registry=r)
        self.bytes_in = Counter("tierlog_bytes_in", "Message bytes a query took in.", ["query"], registry=r)
        self.behind_messages = Gauge("tierlog_dispatch_behind_messages",
                                     "Messages in the commitlog not yet tiered, after the last batch.", registry=r)
        self.behind_seconds = Gauge("tierlog_dispatch_behind_seconds",
                                    "Age of the newest tiered message while a backlog remains (0 when caught up).",
                                    registry=r)
        self.upload_seconds = Histogram("tierlog_upload_duration_seconds", "Seconds per object upload to the tier.",
                                        ["kind"], buckets=_LATENCY_BUCKETS, registry=r)
        self.objects = Counter("tierlog_objects_written", "Objects written to the tier.", ["kind"], registry=r)
        self.seals = Counter("tierlog_seals", "Segments sealed.", registry=r)
        self.table_lag_messages = Gauge("tierlog_table_lag_messages",
                                        "Committed messages a topic's message table does not hold yet.", ["topic"],
                                        registry=r)
        self.table_lag_seconds = Gauge("tierlog_table_lag_seconds", "How long the oldest committed message a topic's "
                                       "message table does not hold yet has waited.", ["topic"], registry=r)
        self.table_commits = Counter("tierlog_table_commits", "Commits to the message tables.", registry=r)
        self.table_unreadable = Counter("tierlog_table_unreadable_bodies", "Bodies of a topic with typed columns "
                                        "(topics.body_format) its format could not read: kept whole, typed columns "
                                        "null, _body_errors [\"$\"].", ["topic"], registry=r)
        self.table_files = Counter("tierlog_table_fresh_files", "Fresh files written for the message tables.",
                                   registry=r)
        self.late_starts = Counter("tierlog_query_late_starts",
                                   "Starts of a query that failed because Spark's Python worker connected back late "
                                   "(a busy host); each is started again after a backoff.", ["query"], registry=r)
        self.kafka_sent = Counter("tierlog_kafka_records_sent", "Records a Kafka sink sent and had acknowledged.",
                                  ["sink"], registry=r)
        self.kafka_rate = Gauge("tierlog_kafka_send_rate", "Records per second a Kafka sink sent in its last batch.",
                                ["sink"], registry=r)
        self.kafka_errors = Counter("tierlog_kafka_errors", "Failed Kafka deliveries (each retried).", ["sink"],
                                    registry=r)
        self.state_rows = Gauge("tierlog_state_rows", "Keys the KV view holds (kv), RocksDB's estimate.", ["store"],
                                registry=r)
        self.state_memory = Gauge("tierlog_state_memory_bytes",
                                  "Memory a RocksDB store holds: kv and metadata (the driver's), spark (the "
                                  "compaction query's state stores, Spark's estimate).", ["store"], registry=r)
        self.headroom_bytes = Gauge(
            "tierlog_commitlog_headroom_bytes", "Commitlog bytes the broker's retention may delete before it "
            "reaches what tierlog has yet to read (negative: already deleted, unread).", registry=r)
        self.headroom_seconds = Gauge(
            "tierlog_commitlog_headroom_seconds", "The same headroom in store time: how much older the oldest "
            "retained file's first message is than the first of the file tierlog still needs.", registry=r)
        self.gaps = Gauge("tierlog_commitlog_gaps", "Ranges deleted before tierlog read them (source.on_missing = "
                          "skip), not yet acknowledged with `tierlog gap ack`.", registry=r)
        self.safepoint = Gauge("tierlog_safepoint_offset",
                               "Lowest physical offset every enabled sink has applied (-1 until each has).", registry=r)
        self.sink_applied = Gauge("tierlog_sink_applied_offset", "The physical offset a sink (tier, kv, mirror, "
                                  "changelog) has applied through: its lag is tierlog_commitlog_end_offset minus this.",
                                  ["sink"], registry=r)
        self.commitlog_end = Gauge("tierlog_commitlog_end_offset", "The commitlog's end (physical offset) as the "
                                   "tiering query last found it.", registry=r)
        self.quarantined = Gauge("tierlog_commitlog_quarantined", "Corrupt commitlog ranges skipped under "
                                 "commitlog.on_corrupt = quarantine.", registry=r)
        for query in queries:  # present from the start, so dashboards see 0
            self.rows_in.labels(query)
            self.bytes_in.labels(query)
        for sink in (MIRROR, CHANGELOG):
            self.kafka_sent.labels(sink)
            self.kafka_errors.labels(sink)
        self._server = None

    def serve(self, host: str, port: int) -> None:
        """Serve /metrics; a port in use is logged, not fatal: tiering matters more than its metrics."""
        if not port:
            return
        try:
            self._server, _ = start_http_server(port, addr=host, registry=self.registry)
            log.info("metrics on http://%s:%d/metrics", host, port)
        except OSError as exc:
            log.warning("metrics.port %d on %s is not available (%s): running without metrics", port, host,
                        exc.strerror)

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


def register_read_cache_metrics(registry) -> Gauge:
    """``tierlog_read_cache_hit_ratio`` in ``registry``: for an application that serves consumers
    from the tier with ``ReadAheadCache``.  Not part of ``tierlog run``'s metrics: it reads no
    tiered queues, so the ratio would always be 0 there."""
    gauge = Gauge("tierlog_read_cache_hit_ratio",
                  "Hits over lookups of this process's read-ahead caches (0 without lookups).", registry=registry)
    gauge.set_function(_cache_hit_ratio)
    return gauge


def _cache_hit_ratio() -> float:
    from connectors.tier.cache import live_caches

    caches = live_caches()
    hits = sum(c.stats.hits for c in caches)
    lookups = hits + sum(c.stats.misses for c in caches)
    return hits / lookups if lookups else 0.0
