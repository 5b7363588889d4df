"""A start that would corrupt a query's checkpoint is refused, naming the setting that changed."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest

from connectors.errors import ConfigError
from connectors.tier.reader import TierReader
from streaming import config as cfg
from streaming.runtime.checkpoints import FINGERPRINT, LOCAL_FILE_MANAGER, SHUFFLE_PARTITIONS
from streaming.service import Service
from streaming.plan import session_conf
from streaming.settings import derive
from tests.tiering_helpers import assert_tier_equals_commitlog, make_conf, produce


def replace(conf: cfg.Config, section: str, **values) -> cfg.Config:
    return dataclasses.replace(conf, **{section: dataclasses.replace(getattr(conf, section), **values)})


def refused(spark, conf: cfg.Config, *needles: str) -> str:
    before = TierReader(conf.tier.location).committed().seq if os.path.isdir(conf.tier.location) else None
    with pytest.raises(ConfigError) as info:
        Service(conf).run(until_caught_up=True, spark=spark)
    text = str(info.value)
    assert all(n in text for n in needles), text
    assert "\n" not in text and "checkpoint.dir" in text  # one line, saying what to do
    if before is not None:
        assert TierReader(conf.tier.location).committed().seq == before  # nothing was written
    return text


def test_changed_settings_that_would_corrupt_a_checkpoint_are_refused(spark, tmp_path):
    conf = make_conf(tmp_path, str(tmp_path / "tier"), compaction=cfg.CompactionConfig())
    produce(conf, 300)
    assert Service(conf).run(until_caught_up=True, spark=spark) == 0
    for query in ("tiering", "compaction"):
        recorded = json.loads(open(os.path.join(derive(conf).paths.checkpoint(query), FINGERPRINT)).read())
        assert recorded["settings"]["commitlog.dir"] == os.path.abspath(conf.commitlog.dir)

    refused(spark, replace(conf, "tier", location=str(tmp_path / "other-tier")), "tier.location", "tiering")
    refused(spark, replace(conf, "broker", name="broker-b"), "broker.name")
    refused(spark, replace(conf, "commitlog", key_property="ORDER_ID"), "commitlog.key_property", "compaction")
    partitions = spark.conf.get(SHUFFLE_PARTITIONS)
    spark.conf.set(SHUFFLE_PARTITIONS, str(int(partitions) + 1))
    try:
        text = refused(spark, conf, "spark.shuffle_partitions", f"{partitions!r}", f"'{int(partitions) + 1}'")
        # A checkpoint from before fingerprints: Spark's offset log still says how it was made.
        os.remove(os.path.join(derive(conf).paths.checkpoint("compaction"), FINGERPRINT))
        assert refused(spark, conf, "spark.shuffle_partitions") == text
    finally:
        spark.conf.set(SHUFFLE_PARTITIONS, partitions)

    produce(conf, 200, start=300)  # the unchanged config still runs on
    assert Service(conf).run(until_caught_up=True, spark=spark) == 0
    assert_tier_equals_commitlog(conf)


def test_only_local_checkpoints_get_the_file_manager_that_starts_no_process_per_path(tmp_path):
    """The FileSystem-based checkpoint file manager is chosen for a local checkpoint.dir (the
    shared test session runs with it, so every streaming test crosses it); any other scheme keeps
    Spark's default, whose rename is the one Spark vouches for there."""
    (key, value), = LOCAL_FILE_MANAGER.items()
    conf = make_conf(tmp_path, str(tmp_path / "tier"))
    for root in (str(tmp_path / "checkpoints"), "checkpoints", f"file://{tmp_path}/checkpoints"):
        assert session_conf(derive(replace(conf, "checkpoint", dir=root))).get(key) == value, root
    for root in ("s3a://bucket/checkpoints", "hdfs://namenode/checkpoints", "viewfs://cluster/checkpoints"):
        assert key not in session_conf(derive(replace(conf, "checkpoint", dir=root))), root


def test_a_hadoop_checkpoint_path_is_guarded_too(spark, tmp_path):
    """Checkpoints given as a URI (s3a://, hdfs://) are read and written through Spark's JVM."""
    conf = make_conf(tmp_path, str(tmp_path / "tier"))
    conf = replace(conf, "checkpoint", dir=f"file://{tmp_path}/remote-checkpoints")
    produce(conf, 100)
    assert Service(conf).run(until_caught_up=True, spark=spark) == 0
    assert os.path.exists(tmp_path / "remote-checkpoints" / "tiering" / FINGERPRINT)
    refused(spark, replace(conf, "tier", location=str(tmp_path / "elsewhere")), "tier.location")


def test_checkpoints_on_another_hadoop_file_system_work_end_to_end(spark, tmp_path):
    """A checkpoint.dir of a scheme other than file:// (as s3a:// or hdfs:// would be): Hadoop's
    viewfs, mounted on a local directory, so nothing is downloaded.  Spark keeps its offsets and
    commits there, and tierlog reads each batch's range and the last committed end through Hadoop."""
    from tests.kv_helpers import assert_all_equal_oracle

    backing = tmp_path / "mounted"
    backing.mkdir()
    hadoop = spark.sparkContext._jsc.hadoopConfiguration()
    hadoop.set("fs.viewfs.mounttable.tierlogtest.link./checkpoints", f"file://{backing}")
    conf = make_conf(tmp_path, str(tmp_path / "tier"), compaction=cfg.CompactionConfig(snapshot_interval_s=0))
    conf = replace(conf, "checkpoint", dir="viewfs://tierlogtest/checkpoints")
    conf = replace(conf, "source", max_bytes_per_trigger=50_000)
    produce(conf, 300)
    assert Service(conf).run(until_caught_up=True, spark=spark) == 0
    for query in ("tiering", "compaction"):  # Spark's files and tierlog's, all behind the mount
        assert (backing / query / FINGERPRINT).exists() and os.listdir(backing / query / "commits"), query
    produce(conf, 200, start=300)
    assert Service(conf).run(until_caught_up=True, spark=spark) == 0  # goes on from the committed batches
    assert_tier_equals_commitlog(conf)
    assert_all_equal_oracle(spark, conf, snapshot=False)
    refused(spark, replace(conf, "tier", location=str(tmp_path / "elsewhere")), "tier.location")
