"""The chaos harness's producer: appends to a commitlog at a steady rate until killed or told to stop.

    python -m tests.chaos.producer --dir D --rate 2000 --seed 7 [--skew-file F]

Messages are keyed puts and deletes over ``--keys`` keys in three topics of
four queues; every message has a unique ``UNIQ_KEY``.  Each batch reads the
clock skew (milliseconds, may be negative) from ``--skew-file`` and adds it
to the store times, as a broker with a wrong clock would.  SIGTERM ends it
after the current batch, with the writer closed cleanly; SIGKILL (the harness's
fault) leaves whatever the kill interrupted, and ``TIERLOG_FAULT=torn_append:n``
makes it kill itself half-way through its n-th batch.

``--ledger F`` appends, after each batch the writer returned, 12 bytes per message to F: its
physical offset (int64) and the CRC-32 of its UNIQ_KEY (uint32), little-endian, in one write per
batch.  It is the harness's account of what was produced, kept on the writing side: a kill
between the append and that write leaves at most one batch in the log that F lacks.
"""

from __future__ import annotations

import argparse
import os
import random
import struct
import zlib
import signal
import time

from connectors.commitlog.format import Message
from connectors.commitlog.writer import CommitLogWriter

TOPICS = ("t0", "t1", "t2")
QUEUES = 4
BATCHES_PER_S = 10


def read_skew(path: str | None) -> int:
    if not path:
        return 0
    try:
        with open(path) as fh:
            return int(fh.read().strip() or 0)
    except (FileNotFoundError, ValueError):
        return 0


def batch(rng: random.Random, n: int, *, seed: int, first: int, keys: int, body_size: int, skew_ms: int):
    now = int(time.time() * 1000) + skew_ms
    for i in range(first, first + n):
        props = {"UNIQ_KEY": f"{seed:08X}{i:024X}", "KEYS": f"k{rng.randrange(keys):07d}"}
        body = b""
        if rng.random() < 0.1:
            props["KV_OP"] = "DELETE"
        else:
            body = b"%d:%d:" % (seed, i) + rng.randbytes(rng.randrange(body_size))
        yield Message(topic=rng.choice(TOPICS), queue_id=rng.randrange(QUEUES), body=body, properties=props,
                      store_ts=now, born_ts=now)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dir", required=True)
    p.add_argument("--rate", type=int, default=1000, help="messages per second")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--keys", type=int, default=2000)
    p.add_argument("--body-size", type=int, default=200)
    p.add_argument("--file-size", type=int, default=8 << 20)
    p.add_argument("--skew-file")
    p.add_argument("--ledger", help="append each appended message's position and UNIQ_KEY CRC here")
    args = p.parse_args(argv)
    ledger = os.open(args.ledger, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644) if args.ledger else None

    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    rng = random.Random(args.seed)
    per_batch = max(1, args.rate // BATCHES_PER_S)
    sent = 0
    with CommitLogWriter(args.dir, file_size=args.file_size, fsync="never") as writer:
        start = time.monotonic()
        while not stopping:
            skew = read_skew(args.skew_file)
            stored = writer.append_many(list(batch(rng, per_batch, seed=args.seed, first=sent, keys=args.keys,
                                                   body_size=args.body_size, skew_ms=skew)))
            if ledger is not None:
                os.write(ledger, b"".join(struct.pack("<qI", m.phy_offset, zlib.crc32(m.properties["UNIQ_KEY"].encode()))
                                          for m in stored))
            sent += per_batch
            ahead = start + sent / args.rate - time.monotonic()
            if ahead > 0:
                time.sleep(ahead)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
