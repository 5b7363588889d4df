"""A reader racing a writer that appends large batches never reports corruption, and misses nothing."""

from __future__ import annotations

import threading

from connectors.commitlog import CommitLogReader, CommitLogWriter, Message


def test_reader_racing_big_appends(log_dir):
    total, stop, errors, seen = 60_000, threading.Event(), [], []

    def write():
        with CommitLogWriter(log_dir, file_size=8 << 20, fsync="never") as w:
            for i in range(0, total, 2000):
                w.append_many(Message(topic="t", queue_id=j % 3, body=b"x" * 700) for j in range(i, i + 2000))
        stop.set()

    def read():
        pos = 0
        with CommitLogReader(log_dir) as r:
            while True:
                try:
                    done = stop.is_set()
                    result = r.scan(pos)
                    seen.append(result.records)
                    pos = result.end
                    if done and result.records == 0:
                        return
                except Exception as exc:  # noqa: BLE001 - the test records any failure
                    errors.append(exc)
                    return

    writer = threading.Thread(target=write)
    writer.start()
    read()
    writer.join()
    assert not errors, str(errors[0]) if errors else ""
    assert sum(seen) == total and len([n for n in seen if n]) > 5
