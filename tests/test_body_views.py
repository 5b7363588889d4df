"""The stager's bodies held as views (``connectors.commitlog.arrow.BodyViews``).

Whatever rows are kept and in whatever order, across file rolls and batch cuts, each row's body
after ``bodies`` must be the one the writer appended (the oracle: ``append_many``'s own messages),
whether short enough to sit inside its view (12 bytes or less), long, or compressed; and the views
must outlive the reader that mapped the files.
"""

from __future__ import annotations

import random

import pyarrow as pa
from hypothesis import given
from hypothesis import strategies as st

from connectors.commitlog import CommitLogReader, CommitLogWriter, Message
from connectors.commitlog.arrow import BodyViews
from connectors.commitlog.compression import compress

FILE = 8192


def _body(i: int, n: int) -> bytes:
    return bytes([(i * 13 + j) % 251 for j in range(n)])


@given(sizes=st.lists(st.one_of(st.integers(0, 14), st.integers(15, 3000), st.just(-1)), min_size=1, max_size=40),
       batch_rows=st.integers(1, 7), seed=st.integers(0, 2**32 - 1))
def test_bodies_come_out_as_appended_after_any_filter_and_reorder(tmp_path_factory, sizes, batch_rows, seed):
    directory = str(tmp_path_factory.mktemp("log"))
    plain = [b"order line %d " % i * 300 if n < 0 else _body(i, n) for i, n in enumerate(sizes)]  # -1: compressed
    with CommitLogWriter(directory, file_size=FILE, fsync="never") as w:
        w.append_many(Message(topic=f"t{i % 3}", queue_id=i % 2, body=compress(body, "zlib") if n < 0 else body,
                              sysflag=0x301 if n < 0 else 0, properties={"KEYS": f"k{i}"})
                      for i, (n, body) in enumerate(zip(sizes, plain)))
    views = BodyViews()
    with CommitLogReader(directory, check_crc=True) as reader:
        table = pa.Table.from_batches([views.hold(b) for b in reader.record_batches(
            0, batch_rows=batch_rows, body_views=True)])
    assert table.num_rows == len(sizes) and table.column("body").num_chunks > (len(sizes) - 1) // batch_rows
    rng = random.Random(seed)
    keep = rng.sample(range(len(sizes)), rng.randint(0, len(sizes)))
    got = views.bodies(table.take(pa.array(keep, pa.int64())))
    assert got.schema.field("body").type == pa.binary()
    assert got.column("body").to_pylist() == [plain[i] for i in keep]
    assert got.column("topic").to_pylist() == [f"t{i % 3}" for i in keep]
