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
