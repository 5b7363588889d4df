"""Opening the RocksDB stores without their lock while their writer restarts (``state.rocks``)."""

from __future__ import annotations

import threading
import time

import pytest

from state import rocks
from state.metadata import MetadataError, MetadataStore


def test_read_only_opens_beside_a_writer_reopening_its_store_all_succeed(tmp_path):
    """`tierlog status` and `commitlog gc` open the metadata store read-only beside a service that
    may be restarting: each writer open writes a new MANIFEST and deletes the old one, and an open
    between the two read a MANIFEST that was gone (CI met it in a chaos run's gc; about 7 opens in
    950 failed here without the retry)."""
    path = str(tmp_path / "metadata")
    MetadataStore(path).close()
    stop, reopened = threading.Event(), []

    def writer() -> None:
        while not stop.is_set():
            store = MetadataStore(path)
            store.write_json({"n": len(reopened)})
            store.close()
            reopened.append(1)

    thread = threading.Thread(target=writer)
    thread.start()
    opened, failed = 0, []
    try:
        deadline = time.monotonic() + 6
        while time.monotonic() < deadline:
            try:
                MetadataStore(path, read_only=True).close()
                opened += 1
            except MetadataError as exc:
                failed.append(str(exc))
    finally:
        stop.set()
        thread.join()
    assert len(reopened) > 50, "the writer thread did not reopen its store often enough to race"
    assert opened > 50 and not failed, failed[:3]


def test_a_store_that_stays_unreadable_is_an_error_after_its_tries(tmp_path, monkeypatch):
    """Fault injected: every open meets the transient message; the error names the store."""
    path = str(tmp_path / "metadata")
    MetadataStore(path).close()
    calls = []

    def refuse(*args, **kwargs):
        calls.append(1)
        raise Exception("Invalid argument: leveldb.BytewiseComparator: does not match existing comparator rocksdict")

    monkeypatch.setattr(rocks, "Rdict", refuse)
    monkeypatch.setattr(rocks.time, "sleep", lambda s: None)
    with pytest.raises(MetadataError, match="cannot open metadata store .*metadata"):
        MetadataStore(path, read_only=True)
    assert len(calls) == rocks.OPEN_ATTEMPTS
    calls.clear()
    with pytest.raises(MetadataError):  # the writer's own open is not tried again: it holds the lock
        MetadataStore(path)
    assert len(calls) == 1
