"""When the broker's retention outruns tierlog: files deleted before tierlog read them.

The scenario, as a new user met it: tier a log, stop, append more across new files, delete the
oldest files past the tier's position (as the broker's fileReservedTime would), start again.
- ``source.on_missing = "fail"`` (the default): one plain line naming the range and the way on,
  exit code 4, no traceback, nothing written.
- ``skip``: the tier, the KV view, the mirror and the changelog equal the writer's ledger minus
  exactly the deleted range; the range is a gap that ``status`` reports (exit 4) until ``gap ack``;
  a kill -9 as the gap is committed, and a restart, change nothing of that.
"""

from __future__ import annotations

import json
import os

import pytest

from connectors.commitlog.reader import list_files
from streaming import config as cfg
from tests.cli_runner import run_killed_at, sink_offsets, tierlog, write_config
from tests.kafka_helpers import changelog_records, compacted, mirror_contents, mirror_place, mirror_record
from tests.kv_helpers import append, kv_messages, view_contents
from tests.oracle import entered_a_queue, message_row, view_fields, written_messages
from tests.tiering_helpers import tier_rows

pytestmark = pytest.mark.heavy
TOPICS = ["t0", "t1"]


def outrun(tmp_path, **sections) -> tuple:
    """Tier 600 messages, append 6,000 more over new files, delete the oldest files up to the third:
    the config, its Config, and the deleted range [tiered_to, first retained)."""
    config = write_config(tmp_path, source={"max_bytes_per_trigger": 100_000}, tier={"segment_messages": 150},
                          compaction={"snapshot_interval_s": 0}, **sections)
    conf = cfg.load(str(config), env={})
    append(conf, kv_messages(600, keys=90, seed=11))
    first = tierlog("run", "--until-caught-up", "--config", str(config))
    assert first.returncode == 0, first.stderr[-3000:]
    tiered_to = sink_offsets(conf)["tier"]
    append(conf, kv_messages(6000, keys=90, seed=12))
    files = list_files(conf.commitlog.dir)
    assert len(files) >= 4 and files[0].base <= tiered_to < files[1].base
    for f in files[:2]:
        os.remove(f.path)
    return config, conf, (tiered_to, files[2].base)


def kept(conf, gap) -> list:
    """The ledger's messages outside the deleted range."""
    return [m for m in written_messages(conf.commitlog.dir) if not gap[0] <= m.phy_offset < gap[1]]


def status(config) -> tuple[int, list[dict]]:
    r = tierlog("status", "--format", "json", "--config", str(config))
    return r.returncode, [json.loads(line) for line in r.stdout.splitlines()]


def test_fail_says_what_was_lost_and_how_to_go_on_in_one_line(tmp_path):
    config, conf, gap = outrun(tmp_path)
    before = sink_offsets(conf)
    r = tierlog("run", "--until-caught-up", "--config", str(config))
    errors = [line for line in r.stderr.splitlines() if line.startswith("tierlog: error")]
    assert r.returncode == 4 and "Traceback" not in r.stderr and len(errors) == 1, r.stderr[-3000:]
    assert f"physical offsets {gap[0]} to {gap[1]}" in errors[0] and "deleted before tierlog read them" in errors[0]
    assert "--on-missing skip" in errors[0] and "source.on_missing" in errors[0]
    assert sink_offsets(conf) == before  # nothing written


def test_skip_records_the_gap_and_every_sink_holds_the_rest_exactly_once(tmp_path, kafka_bootstrap, kafka_prefix):
    kafka = {"bootstrap": kafka_bootstrap, "mirror_topic": f"{kafka_prefix}.{{topic}}",
             "changelog_topic": f"{kafka_prefix}.{{topic}}.changelog", "partitions": 4, "linger_ms": 2,
             "mirror_tasks": 2}
    config, conf, gap = outrun(tmp_path, kafka=kafka)
    # Killed as the first batch after the gap commits it to the tier, then started again.
    assert run_killed_at(config, "committed", 1, tmp_path / "fault", "--on-missing", "skip"), \
        "the run never reached the commit"
    r = tierlog("run", "--until-caught-up", "--on-missing", "skip", "--config", str(config))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "deleted before tierlog read them" in r.stderr

    rows = [message_row(m) for m in kept(conf, gap)]
    assert tier_rows(conf.tier.location) == [r for r in rows if entered_a_queue(r)]
    latest: dict = {}
    for m in kept(conf, gap):
        if m.key("KEYS") is not None and m.dispatched:
            latest[(m.topic, m.key("KEYS"))] = view_fields(m)
    assert view_contents(conf) == {k: v for k, v in latest.items() if not v["deleted"]}
    mirrored: dict = {}
    for row in rows:
        if entered_a_queue(row):
            mirrored.setdefault(mirror_place(conf.kafka, row), []).append(mirror_record(row))
    assert mirror_contents(conf, TOPICS) == mirrored
    records = changelog_records(conf, TOPICS)
    assert compacted(records) == {k: None if v["deleted"] else v["body"] for k, v in latest.items()}

    code, lines = status(config)
    [found] = [x for x in lines if x["kind"] == "gap"]
    assert code == 4 and (found["start_phy"], found["end_phy"], found["acknowledged"]) == (*gap, False)
    assert next(x for x in lines if x["kind"] == "summary")["gaps"] == 1
    ack = tierlog("gap", "ack", "--config", str(config))
    assert ack.returncode == 0, ack.stderr
    code, lines = status(config)
    assert code == 0 and [x["acknowledged"] for x in lines if x["kind"] == "gap"] == [True]


def test_headroom_warns_before_retention_reaches_what_is_unread(tmp_path, caplog):
    """tierlog behind by several files: the broker may delete nothing more before it reaches what
    tierlog has yet to read.  status shows it and warns; the running service's metric says the same."""
    from connectors.commitlog.headroom import headroom
    from connectors.commitlog.reader import CommitLogReader
    from state.metadata import MetadataStore
    from streaming.settings import derive
    from streaming.service import Service

    config = write_config(tmp_path, compaction={"snapshot_interval_s": 0})
    conf = cfg.load(str(config), env={})
    append(conf, kv_messages(300, keys=90, seed=13))
    assert tierlog("run", "--until-caught-up", "--config", str(config)).returncode == 0
    caught_up = tierlog("status", "--config", str(config))
    assert caught_up.returncode == 0 and "retention is close" not in caught_up.stderr  # in the file being written
    tiered_to = sink_offsets(conf)["tier"]
    append(conf, kv_messages(9000, keys=90, seed=14))
    files = list_files(conf.commitlog.dir)
    assert len(files) >= 4 and tiered_to < files[1].base

    r = tierlog("status", "--format", "json", "--config", str(config))
    summary = next(json.loads(x) for x in r.stdout.splitlines() if json.loads(x)["kind"] == "summary")
    assert r.returncode == 0 and summary["headroom_bytes"] == 0 and summary["headroom_s"] is not None
    assert "the broker's retention is close to what tierlog has yet to read" in r.stderr
    assert "Traceback" not in r.stderr

    service = Service(conf)
    service._metadata = MetadataStore(derive(conf).paths.metadata, read_only=True)
    try:
        service._watch_retention(tiered_to)
        # The next tick walks only what was appended since: its reader remembers the frontier (one
        # opened afresh walked the file being written from its start, every second).
        reader, end = service._log_reader, service._log_reader.end_offset()
        append(conf, kv_messages(50, keys=90, seed=15))
        walks = []
        real_scan = reader.scan
        reader.scan = lambda start, *a, **k: (walks.append(start), real_scan(start, *a, **k))[1]
        service._watch_retention(tiered_to)
        assert service._log_reader is reader and walks and min(walks) >= end, (walks, end)
    finally:
        service._close_log_reader()
        service._metadata.close()
    scrape = service.metrics.registry.get_sample_value
    assert scrape("tierlog_commitlog_headroom_bytes") == 0 and scrape("tierlog_commitlog_gaps") == 0
    assert any("retention is close" in rec.getMessage() for rec in caplog.records)

    with CommitLogReader(conf.commitlog.dir) as reader:
        far = headroom(reader, files[-1].base)  # in the file being written: retention cannot reach it
        gone = headroom(reader, files[0].base - 1)
    assert far.bytes == files[-1].base - files[0].base and not far.at_risk and not far.below(0.1, 3600)
    assert gone.bytes < 0 and gone.at_risk and "deleted before tierlog read them" in gone.warning()
