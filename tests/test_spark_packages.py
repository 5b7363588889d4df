"""Spark plugins the way users add them: jars from Maven Central (fetched by ``./dev``, never by
tierlog) named in ``spark.jars``.  The one real use here is what the README promises, Spark
checkpoints at ``s3a://``: hadoop-aws and the AWS SDK bundle, against the moto S3 endpoint, with
all three queries, so each reads its batch ranges from Spark's offset log through Hadoop.
"""

from __future__ import annotations

import boto3
import pytest

from streaming import config as cfg
from tests.cli_runner import tierlog, write_config
from tests.jvm import classpath
from tests.kafka_helpers import assert_mirror_equals_oracle
from tests.kv_helpers import append, kv_messages, view_contents
from tests.oracle import latest_per_key
from tests.tiering_helpers import assert_tier_equals_commitlog

TOPICS = ["t0", "t1"]


@pytest.fixture
def s3a_config(tmp_path, s3_endpoint, kafka_bootstrap, kafka_prefix):
    bucket = f"checkpoints-{kafka_prefix}".lower()
    boto3.client("s3", endpoint_url=s3_endpoint).create_bucket(Bucket=bucket)
    jars = ",".join(classpath("spark-s3a").split(":"))
    config = write_config(tmp_path, checkpoint={"dir": f"s3a://{bucket}/run"}, spark={"jars": jars},
                          compaction={"snapshot_interval_s": 0},
                          kafka={"bootstrap": kafka_bootstrap, "mirror_topic": f"{kafka_prefix}.{{topic}}",
                                 "changelog_topic": f"{kafka_prefix}.{{topic}}.changelog", "partitions": 2})
    return config, bucket


@pytest.mark.timeout(600)
def test_checkpoints_at_s3a_carry_every_query_across_restarts(s3a_config, s3_endpoint):
    config, bucket = s3a_config
    conf = cfg.load(str(config), env={})
    for seed in range(2):  # the second run starts from the checkpoints the first left in S3
        append(conf, kv_messages(700, keys=80, seed=seed, topics=2))
        result = tierlog("run", "--until-caught-up", "--config", str(config), timeout=400)
        assert result.returncode == 0, result.stderr[-4000:]
        assert_tier_equals_commitlog(conf)
        assert {k: v["body"] for k, v in view_contents(conf).items()} == \
            {k: v["body"] for k, v in latest_per_key(conf.commitlog.dir).items()}
        assert_mirror_equals_oracle(conf, TOPICS)
    keys = [o["Key"] for o in boto3.client("s3", endpoint_url=s3_endpoint)
            .list_objects_v2(Bucket=bucket, Prefix="run/")["Contents"]]
    for query in ("tiering", "compaction"):
        assert f"run/{query}/tierlog-checkpoint.json" in keys
        assert any(k.startswith(f"run/{query}/commits/1") for k in keys), f"{query} committed no second batch in S3"
    assert not any(k.startswith("run/mirror/") for k in keys), "the mirror keeps its progress in the metadata store"


def test_an_s3a_checkpoint_without_hadoop_aws_is_refused_by_name(tmp_path, s3_endpoint):
    config = write_config(tmp_path, checkpoint={"dir": "s3a://anywhere/run"})
    (tmp_path / "commitlog").mkdir()
    for argv in (["config", "check"], ["run", "--until-caught-up"]):
        result = tierlog(*argv, "--config", str(config))
        assert result.returncode != 0
        assert "checkpoint.dir 's3a://anywhere/run' needs Hadoop's s3a file system" in result.stderr, result.stderr
        assert "spark.jars" in result.stderr
