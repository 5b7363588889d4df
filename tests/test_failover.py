"""The start check of a failover (``streaming.runtime.failover``), without Spark: a replica that is behind a
query's checkpoint, though not behind the tier's last record, ends in zeros (a pre-allocated file)
and must be told it is behind, not that its log is corrupt, whatever ``commitlog.on_corrupt`` says."""

from __future__ import annotations

import zlib

import pytest

from connectors.commitlog.reader import ReaderOptions
from connectors.commitlog.workload import Workload
from connectors.commitlog.writer import CommitLogWriter
from streaming.runtime.failover import ReplicaMismatchError, check_commitlog
from tests import ledger
from tests.test_brokers import copy_log


def fingerprint(directory: str, m) -> dict:
    with open(f"{directory}/{m.phy_offset - m.phy_offset % FILE:020d}", "rb") as fh:
        fh.seek(m.phy_offset % FILE)
        return {"phy": m.phy_offset, "size": m.size, "crc32": zlib.crc32(fh.read(m.size))}


FILE = 64 * 1024  # several files, each pre-allocated (sparse zeros past its last record)


@pytest.fixture
def master(tmp_path):
    directory = str(tmp_path / "master")
    with CommitLogWriter(directory, file_size=FILE, fsync="never") as w:
        written = ledger.append(w, Workload(messages=900, topics=2, queues=3, body_size=150, seed=5).generate())
    return directory, written


@pytest.mark.parametrize("on_corrupt", ["fail", "quarantine"])
@pytest.mark.parametrize("cut", [400, 650])  # mid-file, and in a later file than the tier's last record
def test_a_replica_behind_a_querys_checkpoint_is_behind_not_corrupt(tmp_path, master, on_corrupt, cut):
    directory, written = master
    tier_last, query_end = written[300], written[800].phy_offset + written[800].size
    replica = str(tmp_path / "replica")
    copy_log(directory, replica, cut_at=written[cut].phy_offset)
    with pytest.raises(ReplicaMismatchError,
                       match=f"ends at physical offset {written[cut].phy_offset}, but broker 'broker-a''s compaction "
                             f"query got to {query_end}: the log is behind. If it is a replica catching up, wait"):
        check_commitlog(ReaderOptions(replica, on_corrupt=on_corrupt), fingerprint(directory, tier_last),
                        {"compaction": query_end}, moved_from=directory)


@pytest.mark.parametrize("on_corrupt", ["fail", "quarantine"])
def test_a_replica_that_has_caught_up_passes(tmp_path, master, on_corrupt):
    directory, written = master
    replica = str(tmp_path / "replica")
    copy_log(directory, replica, cut_at=written[850].phy_offset)
    query_end = written[800].phy_offset + written[800].size
    check_commitlog(ReaderOptions(replica, on_corrupt=on_corrupt), fingerprint(directory, written[300]),
                    {"compaction": query_end}, moved_from=directory)


def test_a_corrupt_record_before_the_querys_end_is_still_named(tmp_path, master):
    from connectors.commitlog.errors import CommitLogError

    directory, written = master
    bad = written[500]
    with open(f"{directory}/{bad.phy_offset - bad.phy_offset % FILE:020d}", "r+b") as fh:
        fh.seek(bad.phy_offset % FILE + 4)
        fh.write(b"\xde\xad\xbe\xef")  # its magic code
    with pytest.raises(CommitLogError, match=f"physical offset {bad.phy_offset}"):
        check_commitlog(ReaderOptions(directory), fingerprint(directory, written[300]),
                        {"compaction": written[800].phy_offset + written[800].size})
