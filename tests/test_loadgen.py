"""The sustained benchmarks' load generator (``bench/loadgen.py``) encodes RocketMQ records on its
own, from the byte format; tierlog's reader, with the body CRC checked, is its oracle here, and it
is one for that reader: two encoders written apart agree on every field."""

from __future__ import annotations

import collections
import json
import subprocess
import sys

from connectors.commitlog.reader import CommitLogReader
from connectors.commitlog.workload import Workload, append_in_chunks
from connectors.commitlog.writer import CommitLogWriter

FILE = 4 << 20


def test_the_load_generator_continues_a_log_across_files_with_every_queue_offset_in_order(tmp_path):
    directory = str(tmp_path / "commitlog")
    with CommitLogWriter(directory, file_size=FILE, fsync="never") as writer:  # a log already there
        append_in_chunks(writer, Workload(messages=1_500, queues=8, keys=100, seed=1).generate())
    out = subprocess.run([sys.executable, "-m", "bench.loadgen", directory, "--rate", "40000", "--messages", "12000",
                          "--queues", "8", "--keys", "500", "--body", "700", "--file-size", str(FILE)],
                         capture_output=True, text=True, check=True)
    written = json.loads(out.stdout)
    assert written["messages"] == 12_000 and written["end_phy"] > 2 * FILE  # it rolled files
    with CommitLogReader(directory, check_crc=True) as reader:
        messages = list(reader.messages())
    assert len(messages) == 1_500 + 12_000
    theirs = messages[1_500:]
    assert theirs[0].phy_offset == written["from_phy"]
    assert all(len(m.body) == 700 and m.topic == "topic-0" and m.properties["KEYS"].startswith("key-")
               for m in theirs)
    assert theirs[-1].phy_offset + theirs[-1].size <= written["end_phy"]
    queues = collections.defaultdict(list)
    for m in messages:
        queues[(m.topic, m.queue_id)].append(m.queue_offset)
    assert len(queues) == 8
    assert all(offsets == list(range(len(offsets))) for offsets in queues.values())
    assert all(m.store_ts == m.born_ts and m.store_ts > 0 for m in theirs)
