"""Each settings group, from a ``tierlog.toml`` to the typed settings its handler receives.

``streaming.settings.derive`` (its ``kafka`` and ``source`` parts too, which Spark and the Kafka
clients take as they are) is the only parser of a setting's text; these tests
write every value of a group away from its default, with units and per-topic maps, and assert the
fields the tier writer, the stager, the commitlog readers, compaction and the Kafka sinks get.
The expected values are written out here, not computed by the code under test.
"""

from __future__ import annotations

import pytest

from connectors.commitlog.topics import TopicFilter
from connectors.errors import ConfigError
from streaming import config as cfg
from streaming.settings import derive

DAY, HOUR, MIB, GIB = 86_400.0, 3_600.0, 1 << 20, 1 << 30


def load(tmp_path, tier: str = "", commitlog: str = "", rest: str = "") -> cfg.Config:
    """A ``tierlog.toml`` of broker-b with ``tier`` and ``commitlog`` lines in their sections and
    ``rest`` (other sections) after them."""
    toml = tmp_path / "tierlog.toml"
    toml.write_text(f'[broker]\nname = "broker-b"\n[commitlog]\ndir = "{tmp_path / "log"}"\n{commitlog}'
                    f'[tier]\nlocation = "{tmp_path / "tier"}"\n{tier}{rest}')
    return cfg.load(str(toml), env={})


def test_the_commitlog_group_reaches_every_reader_and_the_stager(tmp_path):
    s = derive(load(tmp_path, commitlog='check_crc = false\non_corrupt = "quarantine"\n'
                              'key_property = "ORDER_ID"\nlocal_retention = "2h"\n'))
    assert (s.reader.directory, s.reader.check_crc, s.reader.on_corrupt, s.reader.broker, s.reader.key_property) == (
        str(tmp_path / "log"), False, "quarantine", "broker-b", "ORDER_ID")
    # One object carries how the commitlog is read, to every reader of it (it used to be six copies
    # whose check_crc defaults differed, some without the broker or on_corrupt).
    assert s.stage.reader is s.reader and s.stage.location == str(tmp_path / "tier")
    assert s.compaction.writer.reader is s.reader
    assert (s.source["path"], s.source["checkCrc"], s.source["onCorrupt"], s.source["broker"],
            s.source["keyProperty"], s.source["onMissing"]) == (str(tmp_path / "log"), "false", "quarantine",
                                                                "broker-b", "ORDER_ID", "fail")
    assert s.local_retention_s == 2 * HOUR
    reader = s.reader.open(check_crc=True)  # a reader that needs more than the settings say
    try:
        assert (reader.check_crc, reader.on_corrupt) == (True, "quarantine")
    finally:
        reader.close()


def test_the_tier_group_reaches_the_writer(tmp_path):
    s = derive(load(tmp_path, tier='segment_bytes = "64MiB"\nsegment_messages = 5000\nsegment_age_s = 90\n'
                              'delete_grace_s = 5\nfold_every = 17\nretention = "*=7d,orders=30d"\n'
                              'retention_bytes = "*=10GiB,orders=1TiB"\nretention_messages = "logs=1000"\n'))
    w = s.writer
    assert (w.location, w.broker, w.segment_bytes, w.segment_messages, w.segment_age_s, w.delete_grace_s,
            w.fold_every) == (str(tmp_path / "tier"), "broker-b", 64 * MIB, 5000, 90.0, 5.0, 17)
    assert w.retention.seconds == {"*": 7 * DAY, "orders": 30 * DAY}
    assert w.retention.bytes == {"*": 10 * GIB, "orders": 1024 * GIB}
    assert w.retention.messages == {"logs": 1000}
    assert w.retention == s.retention
    plain = derive(load(tmp_path, ""))
    assert not plain.writer.retention and plain.writer.fold_every == 200


def test_the_old_name_of_fold_every_still_works_and_says_so(tmp_path, caplog):
    with caplog.at_level("WARNING", logger="tierlog.config"):
        s = derive(load(tmp_path, tier="checkpoint_every = 9\n"))
    assert s.writer.fold_every == 9
    assert any("tier.checkpoint_every" in r.getMessage() and "fold_every" in r.getMessage() for r in caplog.records)


def test_the_compaction_group_reaches_the_compaction_handler(tmp_path):
    s = derive(load(tmp_path, rest='[compaction]\nttl = "sessions=30m,*=7d"\nsnapshot_interval_s = 45\nsnapshot_keep = 4\n'
                              '[topics]\ncompaction_exclude = "audit-*"\n'))
    c = s.compaction.writer
    assert c.ttl == {"sessions": 1800.0, "*": 7 * DAY}
    assert (c.reader.directory, c.tier_location, c.reader.broker, c.snapshot_interval_s, c.snapshot_keep) == (
        str(tmp_path / "log"), str(tmp_path / "tier"), "broker-b", 45.0, 4)
    assert isinstance(c.topics, TopicFilter) and c.topics is s.filters["compaction"]
    assert not c.topics.accepts("audit-eu") and c.topics.accepts("orders")
    assert s.filters["tier"].accepts("audit-eu")  # a sink's own exclude is its own
    assert derive(load(tmp_path, "")).compaction.writer.ttl is None


def test_the_kafka_group_reaches_the_sinks_and_keeps_the_password_out_of_repr(tmp_path):
    conf = load(tmp_path, rest='[kafka]\nbootstrap = "k1:9092, k2:9093"\nmirror_topic = "rmq.{topic}"\n'
                          'mirror_topic_map = "orders=orders-mirror,%DLQ%g=dlq-g"\npartitions = 3\n'
                          'replication_factor = 0\nbatch_bytes = "1MiB"\nlinger_ms = 20\ndelivery_timeout_s = 1\n'
                          'security_protocol = "SASL_SSL"\nsasl_mechanism = "PLAIN"\nsasl_username = "u"\n'
                          'sasl_password = "s3cret"\n')
    k = derive(conf).kafka
    assert k.client["bootstrap_servers"] == ["k1:9092", "k2:9093"]
    assert (k.client["security_protocol"], k.client["sasl_mechanism"], k.client["sasl_plain_username"],
            k.client["sasl_plain_password"]) == ("SASL_SSL", "PLAIN", "u", "s3cret")
    assert "ssl_cafile" not in k.client  # unset options are left to kafka-python's defaults
    assert (k.broker, k.mirror_topic, k.partitions, k.replication_factor, k.batch_bytes, k.linger_ms) == (
        "broker-b", "rmq.{topic}", 3, 1, MIB, 20)
    assert k.mirror_topic_map == {"orders": "orders-mirror", "%DLQ%g": "dlq-g"}
    assert k.delivery_timeout_s == pytest.approx(2.02)  # never below the linger plus two seconds
    assert "s3cret" not in repr(k)
    assert derive(load(tmp_path, "")).kafka is None  # no bootstrap: the sinks are off


def test_the_source_group_reaches_the_commitlog_source(tmp_path):
    opts = derive(load(tmp_path, rest='[source]\nmax_records_per_trigger = 0\nmax_bytes_per_trigger = "64MiB"\n'
                                              'partition_bytes = "8MiB"\nstarting_offset = "latest"\n')).source
    assert opts["maxRecordsPerTrigger"] is None  # 0: no cap, left out of the stream's options
    assert (opts["maxBytesPerTrigger"], opts["partitionBytes"], opts["startingOffset"], opts["broker"]) == (
        64 * MIB, 8 * MIB, "latest", "broker-b")


@pytest.mark.parametrize("where, body, setting", [
    ("tier", 'retention = "orders=3x"\n', "tier.retention"),
    ("tier", 'retention_bytes = "*=lots"\n', "tier.retention_bytes"),
    ("tier", 'retention_messages = "orders"\n', "tier.retention_messages"),
    ("rest", '[compaction]\nttl = "sessions=soon"\n', "compaction.ttl"),
    ("commitlog", 'local_retention = "forever"\n', "commitlog.local_retention"),
    ("rest", '[topics]\ntier = "business,nonsense"\n', "topics.tier"),
])
def test_a_bad_value_is_refused_naming_its_setting(tmp_path, where, body, setting):
    with pytest.raises(ConfigError, match=setting.replace(".", r"\.")):
        derive(load(tmp_path, **{where: body}))


def test_a_bad_kafka_setting_is_refused_with_the_rest_before_spark_starts(tmp_path):
    # derive runs before `tierlog run` builds its Spark session (streaming.service): the Kafka part
    # is one of the settings it parses, no longer built once the session is up.
    with pytest.raises(ConfigError, match="kafka.mirror_topic_map"):
        derive(load(tmp_path, rest='[kafka]\nbootstrap = "k1:9092"\nmirror_topic_map = "orders"\n'))


def test_compactions_batch_cap_is_its_own_or_from_the_sources(tmp_path):
    def batch_cap(conf):
        return derive(conf).compaction.max_batch_bytes

    own = load(tmp_path, rest='[compaction]\nmax_batch_bytes = "1GiB"\n[source]\nmax_bytes_per_trigger = "64MiB"\n')
    assert batch_cap(own) == GIB
    # A batch holds few bodies: the view references large values, and the changelog sends them a
    # slice at a time.  So four times the source's, the changelog on or off.
    for rest in ('[source]\nmax_bytes_per_trigger = "64MiB"\n',
                 '[source]\nmax_bytes_per_trigger = "64MiB"\n[kafka]\nbootstrap = "k1:9092"\n',
                 '[source]\nmax_bytes_per_trigger = "64MiB"\n[kafka]\nbootstrap = "k1:9092"\nchangelog = false\n'):
        conf = load(tmp_path, rest=rest)
        assert conf.compaction.max_batch_bytes == 0
        assert batch_cap(conf) == 256 * MIB
    assert load(tmp_path, rest='[kafka]\nbootstrap = "k1:9092"\n').kafka.changelog  # on by default
    assert batch_cap(load(tmp_path)) == GIB  # the default source cap's
    assert batch_cap(load(tmp_path, rest='[source]\nmax_bytes_per_trigger = 0\n')) is None
