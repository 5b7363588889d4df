"""The mutation check: plant one deliberate bug at a time in a copy of the product and show that
the tests that should catch it fail.  ``./dev mutants [NAME ...]`` runs it and prints one JSON
object per mutant, then a summary; it exits 1 if any mutant survived.

Each mutant replaces one exact piece of code (the check refuses to run if the piece is gone, so
the list cannot silently rot) and names the tests that must catch it.  The copy is made from the
files git tracks plus the untracked ones it does not ignore, so the check runs on the working
tree as it is, and never touches it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Mutant:
    name: str
    what: str
    path: str
    old: str
    new: str
    tests: tuple[str, ...]


MUTANTS = (
    Mutant(
        "reader_drops_last_record_before_a_roll",
        "the commitlog reader drops the last record of a file when it rolls to the next",
        "connectors/commitlog/reader.py",
        """            if stop == "blank" and (end is None or f.end < end) and idx + 1 < len(files):
                span.end = f.end""",
        """            if stop == "blank" and (end is None or f.end < end) and idx + 1 < len(files):
                if span.starts:
                    span.sizes.pop()
                    span.starts.pop()
                span.end = f.end""",
        ("tests/test_tiering.py::test_tier_holds_exactly_the_commitlog_and_seals_segments",),
    ),
    Mutant(
        "commit_offset_skipped_for_one_queue",
        "a batch record never moves queue 1's commit offset",
        "connectors/tier/manifest.py",
        """                    state.commit = max(state.commit, stats["last"] + 1)""",
        """                    if q != 1:
                        state.commit = max(state.commit, stats["last"] + 1)""",
        ("tests/test_tiering.py::test_tier_holds_exactly_the_commitlog_and_seals_segments",),
    ),
    Mutant(
        "kv_view_forgets_deletes",
        "the KV view skips a changed key's delete and keeps its old value",
        "state/kv.py",
        """        for k, v in zip(keys, values.to_pylist()):
            wb.put(k, v)""",
        """        for k, v, gone in zip(keys, values.to_pylist(), deleted):
            if gone:
                continue
            wb.put(k, v)""",
        ("tests/test_compaction.py::test_latest_per_key_survives_restarts_and_equals_the_oracle",),
    ),
    Mutant(
        "mirror_sends_a_record_twice",
        "the mirror sends the message at queue offset 5 of every queue twice",
        "connectors/kafka/mirror_sink.py",
        """            send(kafka_topic, partition, key, body, headers, phy, ts)""",
        """            send(kafka_topic, partition, key, body, headers, phy, ts)
            if queue_offset == 5:
                send(kafka_topic, partition, key, body, headers, phy, ts, force=True)""",
        ("tests/test_kafka_sinks.py::test_mirror_and_changelog_equal_the_oracle_across_restarts",),
    ),
    Mutant(
        "staging_object_lost_after_a_crash",
        "a restart that catches the metadata store up also schedules the batch's staging objects for deletion",
        "state/metadata.py",
        """        deletes = {n: now for n in record.get("retire", ())} | {n: now for s in expired for n in (s.name, s.keys) if n}""",
        """        deletes = {n: now for n in record.get("retire", ())} | {n: now for s in expired for n in (s.name, s.keys) if n}
        deletes |= {o["name"]: now for o in record.get("staging", ())}""",
        ("tests/test_tier_writer.py", "tests/test_crash.py"),
    ),
    Mutant(
        "seal_retires_staging_a_queue_still_needs",
        "a seal retires a staging object once any of its queues (not every one) is sealed past it",
        "connectors/tier/writer.py",
        """            if all(st["last"] < sealed_after.get(k, self.head.queues[k].sealed) for k, st in o.queues.items())""",
        """            if any(st["last"] < sealed_after.get(k, self.head.queues[k].sealed) for k, st in o.queues.items())""",
        ("tests/test_tier_writer.py",),
    ),
    Mutant(
        "retired_staging_deleted_under_the_mirror",
        "the tier deletes a retired staging object the mirror (a consumer of the tier feed) has not read yet",
        "connectors/tier/writer.py",
        """            if held is not None and self._staged_from(name) >= held:""",
        """            if held is not None and self._staged_from(name) >= held and False:""",
        ("tests/test_tier_feed.py",),
    ),
    Mutant(
        "feed_released_for_one_consumer",
        "the tier unlists a batch once one consumer is past it, though the other (compaction or the mirror) is not",
        "state/tier_feed.py",
        """        up_to = min(positions, default=None)""",
        """        up_to = max(positions, default=None)""",
        ("tests/test_tier_feed.py",),
    ),
    Mutant(
        "stale_local_copy_outlives_its_object",
        "a staging object's local copy is only replaced after the upload, so a failed upload leaves the old copy to be read",
        "connectors/tier/copies.py",
        """            _remove(path)  # before the upload: a stale copy must never outlive the object it copied""",
        """            pass""",
        ("tests/test_tier_feed.py",),
    ),
    Mutant(
        "tier_record_carries_every_sinks_filter_counts",
        "the tier's commit record holds the other sinks' filter counts again, as before the metadata store's split",
        "connectors/tier/writer.py",
        """        own = {"tier": filtered.pop("tier")} if "tier" in filtered else None""",
        """        own, filtered = dict(filtered) or None, {}""",
        ("tests/test_journal.py",),
    ),
    Mutant(
        "compaction_decodes_the_commitlog_again",
        "the KV writer reads the changed keys' messages from the commitlog instead of the tier's committed batches",
        "streaming/queries/compaction/query.py",
        """                                         changelog=changelog, messages=self.feed,""",
        """                                         changelog=changelog, messages=None,""",
        ("tests/test_one_read.py",),
    ),
    Mutant(
        "metadata_store_left_behind_after_a_crash",
        "a restart finds the metadata store one record behind the tier and does not catch it up",
        "connectors/tier/writer.py",
        """        log.info("metadata store is at commit record %d, tier at %d: catching up", meta_seq, head.seq)""",
        """        log.info("metadata store is at commit record %d, tier at %d: catching up", meta_seq, head.seq)
        return""",
        ("tests/test_tier_writer.py",),
    ),
    Mutant(
        "committed_transactions_filtered_out",
        "the shared queue filter drops the COMMIT records of transactions (so committed transactional "
        "messages never enter a queue)",
        "connectors/commitlog/arrow.py",
        """    return pc.or_(pc.equal(tx, fmt.TRANSACTION_NOT_TYPE), pc.equal(tx, fmt.TRANSACTION_COMMIT))""",
        """    return pc.equal(tx, fmt.TRANSACTION_NOT_TYPE)""",
        ("tests/test_tiering.py::test_the_tier_holds_committed_transactions_only",),
    ),
    Mutant(
        "retention_by_messages_keeps_one_segment_too_many",
        "retention by messages drops a segment only while more than the limit stays (not at the limit)",
        "connectors/tier/retention.py",
        """            too_many = max_messages is not None and state.commit - (seg.end + 1) >= max_messages""",
        """            too_many = max_messages is not None and state.commit - (seg.end + 1) > max_messages""",
        ("tests/test_retention_limits.py",),
    ),
    Mutant(
        "retention_by_bytes_counts_the_segment_it_drops",
        "retention by bytes compares what the queue holds before the drop, not what stays after it",
        "connectors/tier/retention.py",
        """            too_big = max_bytes is not None and kept_bytes - seg.size >= max_bytes""",
        """            too_big = max_bytes is not None and kept_bytes >= max_bytes""",
        ("tests/test_retention_limits.py",),
    ),
    Mutant(
        "light_queues_are_business_topics",
        "%LMQ% topics (RocketMQ's light queues, copies of other topics' messages) are not system topics",
        "connectors/commitlog/topics.py",
        """SYSTEM_PREFIXES = ("rmq_sys_", "%LMQ%")""",
        """SYSTEM_PREFIXES = ("rmq_sys_",)""",
        ("tests/test_topic_filters.py",),
    ),
    Mutant(
        "sink_exclude_ignored",
        "a sink's own exclude list (topics.<sink>_exclude) is not applied",
        "streaming/settings.py",
        """                                _globs(t.exclude) + _globs(getattr(t, f"{sink}_exclude")),""",
        """                                _globs(t.exclude),""",
        ("tests/test_topic_filters.py",),
    ),
    Mutant(
        "replica_behind_read_as_a_complete_range",
        "the start check walks a replica to a query's checkpoint as a range known to be complete, so the "
        "zeros of a replica still catching up read as corruption",
        "streaming/runtime/failover.py",
        """            end = reader.scan(start, max_bytes=target - start).end if start is not None else reader.end_offset()""",
        """            end = reader.scan(start, target).end if start is not None else reader.end_offset()""",
        ("tests/test_failover.py",),
    ),
    Mutant(
        "new_queue_id_left_out_of_the_fold",
        "a topic's new highest queue id does not mark its home bucket changed, so a fold whose window "
        "only added that queue writes the topic's old queue count",
        "connectors/tier/log.py",
        """            self.topics_by_home.setdefault(home, set()).add(topic)
            self.changed_buckets.add(home)""",
        """            self.topics_by_home.setdefault(home, set()).add(topic)""",
        ("tests/test_tier_queues_added.py",),
    ),
    Mutant(
        "tier_source_skips_staging_that_straddles_a_time_bound",
        "the tier Spark source plans a staging object only if all of it is past a store-time lower bound, "
        "so a time-bounded read of a topic misses the unsealed messages after the bound",
        "streaming/sources/tier.py",
        """                if info.first < hi and info.last >= unsealed and info.max_ts >= b.ts[0] and info.min_ts <= b.ts[1]:""",
        """                if info.first < hi and info.last >= unsealed and info.min_ts >= b.ts[0] and info.min_ts <= b.ts[1]:""",
        ("tests/test_tier_queues_added.py",),
    ),
    Mutant(
        "expiry_tombstones_given_up_when_kafka_is_away",
        "the changelog tries an expiry's tombstones once and gives up on a failure, while the KV view "
        "forgets the keys: a Kafka outage at the moment keys expire keeps their old values in the changelog",
        "connectors/kafka/changelog.py",
        """        self.deliver(lambda: self._send_columns(_columns(rows), op="expire", floor=floor))""",
        """        try:
            self.deliver_once(lambda: self._send_columns(_columns(rows), op="expire", floor=floor))
        except Exception:
            pass""",
        ("tests/test_kafka_outage.py::test_keys_that_expire_while_kafka_is_away_stay_until_their_tombstones_are_in_the_changelog",),
    ),
    Mutant(
        "stager_ignores_on_corrupt",
        "the stager's settings keep the default on_corrupt = fail whatever tierlog.toml says",
        "streaming/settings.py",
        """    return ReaderOptions(c.dir, check_crc=c.check_crc, on_corrupt=c.on_corrupt, broker=conf.broker.name,""",
        """    return ReaderOptions(c.dir, check_crc=c.check_crc, broker=conf.broker.name,""",
        ("tests/test_settings.py",),
    ),
    Mutant(
        "reader_trusts_a_corrupt_totalsize",
        "the commitlog reader never checks a record's TOTALSIZE against the record's own fields (so a "
        "wrong size is reported where it led the walk, a quarantining reader skips the good records it "
        "jumped over, and one that claims the rest of the file holds the reader there without an error)",
        "connectors/commitlog/reader.py",
        """    def _missized(self, f: MappedFile, pos: int, size: int) -> str | None:""",
        """    def _missized(self, f: MappedFile, pos: int, size: int) -> str | None:
        return None""",
        ("tests/test_commitlog_properties.py",),
    ),
    Mutant(
        "table_keeps_expired_segments",
        "a table commit takes the seals since the last one but not the expirations",
        "connectors/tables/fresh.py",
        """            state.unregister.append(seg)""",
        """            pass""",
        ("tests/test_tables.py::test_tables_follow_random_commits_seals_expirations_folds_and_restarts",),
    ),
    Mutant(
        "expired_objects_deleted_while_a_table_lists_them",
        "the writer deletes retired objects whether or not the tables have let them go",
        "connectors/tier/writer.py",
        """        elif self.tables.synced_at is not None:
            self.delete_retired(now_ms, before=self.tables.synced_at)""",
        """        else:
            self.delete_retired(now_ms)""",
        ("tests/test_tables.py::test_a_catalog_that_is_away_holds_the_deletes_not_the_tier",),
    ),
    Mutant(
        "fresh_file_removed_before_its_rows_are_in_segments",
        "a table commit removes every fresh file of a queue that sealed, whatever other queues it holds",
        "connectors/tables/fresh.py",
        """        if not stays:
            break""",
        """        break""",
        ("tests/test_tables_fresh.py", "tests/test_tables.py::test_tables_follow_random_commits_seals_expirations_folds_and_restarts"),
    ),
    Mutant(
        "tables_never_diffed_against_the_tier",
        "a new process takes no segment from the tier when it reconciles a table",
        "connectors/tables/messages.py",
        """            tier_segments = list(view.segments_of(topic, q))""",
        """            tier_segments = []""",
        ("tests/test_tables.py::test_a_tier_sealed_without_tables_is_registered_by_the_first_sync",),
    ),
    Mutant(
        "table_changed_outside_the_process_goes_unnoticed",
        "a table another process of the broker committed to (a `tierlog table rebuild`) is taken for as it was",
        "connectors/tables/messages.py",
        """        if not self._others_only(table, self._topics[topic]):""",
        """        if False:""",
        ("tests/test_tables.py::test_a_table_rebuilt_beside_a_running_writer_is_taken_afresh",),
    ),
    Mutant(
        "table_backlog_part_removes_what_it_does_not_register",
        "a table commit cut to FILES_PER_COMMIT segments removes the fresh files the whole backlog would free",
        "connectors/tables/fresh.py",
        """        registered, taken, cut = _registrable(state, removable, max_register)""",
        """        registered, _, cut = _registrable(state, removable)
        _, taken, _ = _registrable(state, removable, max_register)""",
        ("tests/test_tables.py::test_a_seal_of_more_segments_than_a_commit_takes_registers_each_once",),
    ),
    Mutant(
        "first_table_sync_unbounded",
        "the first round of a process reconciles every table at once, holding that batch",
        "connectors/tables/messages.py",
        """            if worked and time.monotonic() > deadline:""",
        """            if False:""",
        ("tests/test_tables.py::test_the_first_sync_of_a_large_tier_goes_in_parts_registering_each_file_once",),
    ),
    Mutant(
        "kept_table_state_trusted_at_any_snapshot",
        "a new process takes a table's kept state back even when the table moved on since",
        "connectors/tables/messages.py",
        """        if (None if current is None else current.snapshot_id) != record["snapshot"]:
            return False""",
        """        pass""",
        ("tests/test_tables.py::test_a_clean_stop_in_step_spares_the_next_process_the_reconciliation",),
    ),
    Mutant(
        "table_commits_ignore_the_interval_and_the_budget",
        "every round commits every table with something new, whatever tables.commit_interval_s and the budget say",
        "connectors/tables/messages.py",
        """            ready = not hold or (""",
        """            ready = True or (""",
        ("tests/test_tables.py::test_a_commit_interval_holds_a_table_and_its_lag_shows_what_waits",
         "tests/test_tables.py::test_the_request_budget_bounds_commits_and_the_longest_waiting_table_goes_first"),
    ),
    Mutant(
        "snapshot_rounds_write_every_topic",
        "each compacted snapshot round writes every topic, changed or not, whatever the tables' request budget",
        "state/kv_writer.py",
        """            topics = set(by_age)""",
        """            topics = None""",
        ("tests/test_kv_writer.py::test_a_snapshot_round_writes_the_topics_that_changed_and_the_budget_defers_the_rest",),
    ),
    Mutant(
        "snapshots_only_after_batches",
        "a snapshot falls due only when a batch comes: the last changes before a quiet spell never reach the "
        "latest-per-key tables",
        "streaming/queries/compaction/handler.py",
        """                self._pending.append(self._apply_thread.submit(self.writer.maybe_snapshot))""",
        """                pass""",
        ("tests/test_kv_writer.py::test_a_snapshot_falls_due_between_batches_and_takes_what_the_view_applied",),
    ),
    Mutant(
        "latest_table_keeps_snapshots_of_pruned_files",
        "the latest-per-key tables let go of an older compacted snapshot without expiring the table snapshots "
        "that list it, so time travel names a deleted file",
        "connectors/tables/latest.py",
        """            self._expire(topic, expired)""",
        """            pass""",
        ("tests/test_tables_latest.py::test_latest_tables_are_the_ledgers_latest_values_at_each_snapshot",),
    ),
    Mutant(
        "latest_table_keeps_the_previous_snapshot_file",
        "a latest-per-key table commit adds the new snapshot without removing the broker's previous one",
        "connectors/tables/latest.py",
        """                    overwrite.delete_data_file(have[old])""",
        """                    pass""",
        ("tests/test_tables_latest.py::test_latest_tables_are_the_ledgers_latest_values_at_each_snapshot",),
    ),
    Mutant(
        "seal_takes_rows_below_the_sealed_offset",
        "a seal filters each staging object's rows from one past the queue's sealed offset",
        "connectors/tier/layout.py",
        """    keep = table["queue_offset"].to_numpy().astype(np.int64) >= floor[inverse]""",
        """    keep = table["queue_offset"].to_numpy().astype(np.int64) > floor[inverse]""",
        ("tests/test_tier_writer.py::test_random_sequences_of_commits_seals_expirations_folds_and_restarts_equal_the_ledger",),
    ),
)


def copy_tree(into: Path) -> None:
    """The working tree as it is (tracked files and untracked ones git does not ignore)."""
    names = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, check=True,
                           capture_output=True).stdout.decode().split("\0")
    for name in filter(None, names):
        source = ROOT / name
        if source.is_file():
            target = into / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)
    (into / ".cache").mkdir(exist_ok=True)
    if (ROOT / ".cache" / "jvm").exists():  # the brokers' class paths, fetched by ./dev
        (into / ".cache" / "jvm").symlink_to(ROOT / ".cache" / "jvm")


def run(mutant: Mutant) -> dict:
    with tempfile.TemporaryDirectory(prefix=f"mutant-{mutant.name}-") as tmp:
        tree = Path(tmp)
        copy_tree(tree)
        target = tree / mutant.path
        text = target.read_text()
        if text.count(mutant.old) != 1:
            raise SystemExit(f"mutant {mutant.name}: the code it changes is not in {mutant.path} exactly once; "
                             "update tests/mutants.py")
        target.write_text(text.replace(mutant.old, mutant.new))
        started = time.monotonic()
        result = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *mutant.tests],
                                cwd=tree, env={**os.environ, "PYTHONPATH": str(tree)}, capture_output=True, text=True)
        failed = [line.split(" ", 1)[1].split(" - ")[0] for line in result.stdout.splitlines()
                  if line.startswith("FAILED ")]
        return {"mutant": mutant.name, "what": mutant.what, "caught": result.returncode == 1 and bool(failed),
                "caught_by": failed, "exit": result.returncode, "seconds": round(time.monotonic() - started, 1),
                **({} if failed else {"output": result.stdout[-3000:]})}  # why it survived, or what broke


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("names", nargs="*", help="mutants to run (default: all): " + ", ".join(m.name for m in MUTANTS))
    args = ap.parse_args()
    unknown = set(args.names) - {m.name for m in MUTANTS}
    if unknown:
        ap.error(f"no such mutant: {', '.join(sorted(unknown))}")
    results = []
    for mutant in (m for m in MUTANTS if not args.names or m.name in args.names):
        print(f"mutants: {mutant.name}: {', '.join(mutant.tests)}", file=sys.stderr, flush=True)
        results.append(run(mutant))
        print(json.dumps(results[-1]), flush=True)
    survived = [r["mutant"] for r in results if not r["caught"]]
    print(json.dumps({"mutants": len(results), "caught": len(results) - len(survived), "survived": survived}))
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main())
