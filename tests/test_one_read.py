"""One read of the commitlog for the whole service: in a run of all three queries (tiering,
compaction with the changelog, the Kafka mirror), each commitlog record is decoded, and its body
CRC checked, once: by the tiering query.  Compaction and the mirror read the tier's committed
batches.  The witness is the decoder itself (``connectors.faults.note_decoded``, on in every
process of the run through ``TIERLOG_READ_LOG``); the oracle for the count is the writer's ledger."""

from __future__ import annotations

import pytest

from streaming import config as cfg
from tests import ledger
from tests.cli_runner import tierlog
from tests.kafka_helpers import assert_mirror_equals_oracle, changelog_oracle, changelog_records, compacted
from tests.kv_helpers import append, kv_messages, view_contents
from tests.oracle import latest_per_key
from tests.test_kafka_crash import TOPICS, write_config


@pytest.mark.timeout(900)
def test_a_run_of_all_three_queries_decodes_each_commitlog_record_once_with_its_crc(
        tmp_path, kafka_bootstrap, kafka_prefix):
    config = write_config(tmp_path, kafka_bootstrap, kafka_prefix)
    conf = cfg.load(str(config), env={})
    append(conf, kv_messages(3000, keys=300, seed=5))
    reads = tmp_path / "decoded.log"
    result = tierlog("run", "--until-caught-up", "--config", str(config), env={"TIERLOG_READ_LOG": str(reads)},
                     timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    ranges = sorted(tuple(map(int, line.split()[:4])) for line in reads.read_text().splitlines())
    assert sum(r[2] for r in ranges) == len(ledger.stored(conf.commitlog.dir))  # every record, once
    assert all(crc for *_, crc in ranges)  # each with its body CRC checked
    overlaps = [(a, b) for a, b in zip(ranges, ranges[1:]) if b[0] < a[1]]
    assert not overlaps, f"ranges decoded twice: {overlaps[:5]}"
    # The other queries did their work, from the tier: this is not a run where they read nothing.
    assert view_contents(conf) == latest_per_key(conf.commitlog.dir)
    assert compacted(changelog_records(conf, TOPICS)) == changelog_oracle(conf)
    assert_mirror_equals_oracle(conf, TOPICS)


@pytest.mark.timeout(900)
def test_on_s3_compaction_and_the_mirror_read_the_committed_batches_back_without_a_get(
        tmp_path, s3_endpoint, s3_location, kafka_bootstrap, kafka_prefix):
    """With ``tier.local_copy_bytes`` (on by default), the staging objects the stagers uploaded are
    read back from their local copies: every request the service makes to S3 passes through a
    proxy that lists it, and none is a GET of a staging object."""
    from tests.chaos.s3proxy import S3FaultProxy
    from tests.cli_runner import write_config as shared_config

    proxy = S3FaultProxy(s3_endpoint).start()
    try:
        config = shared_config(tmp_path, source={"max_bytes_per_trigger": 60000},
                               tier={"location": s3_location, "delete_grace_s": 0},
                               compaction={"snapshot_interval_s": 0},
                               kafka={"bootstrap": kafka_bootstrap, "mirror_topic": f"{kafka_prefix}.{{topic}}",
                                      "changelog_topic": f"{kafka_prefix}.{{topic}}.changelog", "partitions": 4,
                                      "linger_ms": 2})
        conf = cfg.load(str(config), env={})
        append(conf, kv_messages(3000, keys=300, seed=6))
        result = tierlog("run", "--until-caught-up", "--config", str(config),
                         env={"AWS_ENDPOINT_URL_S3": proxy.endpoint}, timeout=600)
        assert result.returncode == 0, result.stderr[-3000:]
    finally:
        proxy.stop()
    staged = [(method, path) for method, path in proxy.requests if "/_staging/" in path]
    puts = sum(1 for method, _ in staged if method == "PUT")
    assert puts >= 5, f"only {puts} staging objects: the run is too small to show anything"
    assert [r for r in staged if r[0] == "GET"] == []
    assert view_contents(conf) == latest_per_key(conf.commitlog.dir)
    assert compacted(changelog_records(conf, TOPICS)) == changelog_oracle(conf)
    assert_mirror_equals_oracle(conf, TOPICS)
