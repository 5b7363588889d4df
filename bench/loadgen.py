"""A load generator for the sustained benchmarks: appends pre-encoded RocketMQ records to a
commitlog directory at a steady rate, at a small part of a core, from a process of its own.

    python -m bench.loadgen DIR --rate 50000 --seconds 60 [--body 1024] [--queues 64]
                            [--topic topic-0] [--keys 100000] [--file-size BYTES] [--seed 0]
                            [--bodies random|json]

Why: ``tierlog produce`` encodes every message in Python (about 20 µs of a core each), so beside
the service it reached only 14,400-17,300 msgs/s of 1 KiB when asked for 25,000; the rates the
sustained targets name (50,000 msgs/s of 1 KiB, 100 MB/s of 16 KiB) could not be asked for.

How: a pool of records is encoded once, before the clock starts.  Each has the same length (one
topic, fixed-width keys, no ``UNIQ_KEY``, so the message id is the broker's offset id and stays
unique), so a tick takes the pool's next rows and rewrites four fields in place, on whole columns:
the queue offset, the physical offset, and the born and store timestamps (the tick's clock, in ms).
One ``pwrite`` a tick, no fsync (a broker flushes asynchronously); a record that would leave fewer
than 8 bytes in its file goes to the next one, after a blank marker, as a broker does.

Independent of the code under test: the encoding is written here from the byte format
(docs/commitlog-format.md, §4, §6, §7, §9) and imports nothing of tierlog, so a benchmark that
counts what it wrote does not share a bug with what it measures.  It continues a log that is there:
the physical offset from its end, and the queue offsets of ``--topic`` from the records found.

Prints one JSON line: messages, bytes, seconds, msgs/s, MB/s, and its own CPU (user + system) in
seconds and cores, which is how the benchmark shows the generator costs under a tenth of a core.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import random
import resource
import struct
import sys
import time
import zlib

import numpy as np

MAGIC_V1 = 0xDAA320A7
BLANK_MAGIC = 0xCBD43194
MIN_BLANK = 8  # §9: every record leaves at least this many bytes free in its file
HOST = bytes([127, 0, 0, 1]) + struct.pack(">i", 10911)
POS_QUEUE_OFFSET, POS_PHY_OFFSET, POS_BORN_TS, POS_STORE_TS = 20, 28, 40, 56
TICK_S = 0.005
POOL_BYTES = 256 << 20


def encode(topic: bytes, queue_id: int, body: bytes, props: bytes) -> bytes:
    """§4: a V1 record with IPv4 hosts; offsets and timestamps 0, rewritten at each append."""
    size = 74 + 8 + 8 + 1 + len(body) + len(topic) + len(props)
    crc = zlib.crc32(body) & 0x7FFFFFFF  # §6
    return b"".join((
        struct.pack(">iIiiiqqiq", size, MAGIC_V1, crc, queue_id, 0, 0, 0, 0, 0), HOST,
        struct.pack(">q", 0), HOST, struct.pack(">iq", 0, 0), struct.pack(">i", len(body)), body,
        struct.pack(">B", len(topic)), topic, struct.pack(">h", len(props)), props,
    ))


_ALNUM = bytes((b"abcdefghijklmnopqrstuvwxyz0123456789" * 8)[:256])  # a random byte -> a letter or digit


def order(i: int, key: str, size: int, noise: bytes) -> bytes:
    """An order in JSON of exactly ``size`` bytes (when ``size`` leaves room for its fields), of
    one shape all along: its ``note`` pads it, with letters and digits from ``noise``, so zstd finds
    no more repeats in it than in a producer's text."""
    head = json.dumps({"order_id": i, "customer": f"c-{key[-4:]}", "amount": (i % 500) + 0.25, "paid": i % 3 == 0,
                       "placed_at": f"2026-12-{1 + i % 28:02d}T{i % 24:02d}:{i % 60:02d}:00.{i % 1000:03d}Z",
                       "address": {"city": ("Berlin", "Lyon", "Koeln")[i % 3], "zip": f"{10000 + i % 90000}"},
                       "items": [{"sku": f"s-{(i + j) % 50}", "qty": 1 + j} for j in range(1 + i % 3)],
                       "coupon": f"WINTER{i % 5}"}).encode()
    pad = size - len(head) - len(',"note":""')
    if pad <= 0:
        return head
    return head[:-1] + b',"note":"' + noise[:pad].translate(_ALNUM) + b'"}'


def pool(topic: str, queues: int, keys: int, body: int, seed: int, bodies: str = "random") -> np.ndarray:
    """Records ``i`` in queue ``i % queues``, keys drawn from ``keys``, as rows of one array;
    ``bodies``: random bytes, or JSON orders (``order``) of the same size."""
    rng = random.Random(seed)
    probe = encode(topic.encode(), 0, bytes(body), b"")
    count = max(queues, min(65_536, POOL_BYTES // (len(probe) + 64)) // queues * queues)
    # Bodies of random bytes, none a copy of another within the pool (about 65,000 messages of
    # 1 KiB): a tier batch holds no repeat for zstd to find, as with `tierlog produce`'s bodies.
    # (Slices of one buffer a byte apart compressed a batch's staging objects to a sliver, so the
    # mirror sent 200 MB batches on the driver.)
    noise = rng.randbytes(body * count)
    rows = []
    for i in range(count):
        # §7: name U+0001 value U+0002; fixed-width values keep every record the same length.
        key = f"key-{rng.randrange(keys):08d}"
        props = f"KEYS\x01{key}\x02TAGS\x01tag-{i % 3}\x02".encode()
        payload = noise[i * body:(i + 1) * body]
        if bodies == "json":
            payload = order(i, key, body, payload)
            if len(payload) != body:
                sys.exit(f"loadgen: --body {body} is too small for a JSON order of {len(payload)} bytes")
        rows.append(encode(topic.encode(), i % queues, payload, props))
    return np.frombuffer(b"".join(rows), dtype=np.uint8).reshape(count, len(rows[0])).copy()


def files(directory: str) -> list[str]:
    return sorted(n for n in os.listdir(directory) if len(n) == 20 and n.isdigit())


def log_end(directory: str, topic: str, queues: int) -> tuple[int, list[int]]:
    """Where the log ends, and the next queue offset of each of ``topic``'s queues, from its records."""
    names, wanted = files(directory), topic.encode()
    offsets = [0] * queues
    end = 0
    for name in names:
        base = int(name)
        with open(os.path.join(directory, name), "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            data = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) if size else b""
        pos = 0
        while pos + 8 <= size:
            total, magic = struct.unpack_from(">iI", data, pos)
            if total <= 0 or magic == BLANK_MAGIC:
                break
            queue_id, queue_offset, sysflag = struct.unpack_from(">i4xq8xi", data, pos + 12)
            hosts = (20 if sysflag & 0x10 else 8) + (20 if sysflag & 0x20 else 8)
            at = 48 + hosts + 8 + 4 + 8  # past the hosts, the store time, reconsume times, prepared offset
            at += 4 + struct.unpack_from(">i", data, pos + at)[0]
            v2 = magic != MAGIC_V1
            topic_len = struct.unpack_from(">h" if v2 else ">B", data, pos + at)[0]
            at += 2 if v2 else 1
            if data[pos + at:pos + at + topic_len] == wanted and 0 <= queue_id < queues:
                offsets[queue_id] = max(offsets[queue_id], queue_offset + 1)
            pos += total
        end = base + pos
    return end, offsets


class Appender:
    """Appends rows of the pool from message ``g``, patching each row's offsets and timestamps."""

    def __init__(self, directory: str, rows: np.ndarray, queues: int, file_size: int, end: int, offsets: list[int]):
        self.directory, self.rows, self.queues, self.file_size = directory, rows, queues, file_size
        self.length = rows.shape[1]
        self.base_offsets = np.array(offsets, dtype=np.int64)
        self.g = 0  # messages appended by this run
        self.base = end - end % file_size if end else 0
        self.pos = end - self.base
        self.fd = self._open(self.base)

    def _open(self, base: int) -> int:
        fd = os.open(os.path.join(self.directory, f"{base:020d}"), os.O_RDWR | os.O_CREAT, 0o644)
        if os.fstat(fd).st_size < self.file_size:
            os.ftruncate(fd, self.file_size)  # a broker's files are preallocated: zeros past the end
        return fd

    def append(self, n: int) -> int:
        """Up to ``n`` messages into the current file (fewer at its end, then the next file); how many."""
        room = (self.file_size - MIN_BLANK - self.pos) // self.length
        if room <= 0:
            os.pwrite(self.fd, struct.pack(">iI", self.file_size - self.pos, BLANK_MAGIC), self.pos)
            os.close(self.fd)
            self.base += self.file_size
            self.pos = 0
            self.fd = self._open(self.base)
            room = (self.file_size - MIN_BLANK) // self.length
        start = self.g % len(self.rows)
        n = min(n, room, len(self.rows) - start)  # a slice of the pool, patched in place: no copy
        g = np.arange(self.g, self.g + n, dtype=np.int64)
        chunk = self.rows[start:start + n]
        now = int(time.time() * 1000)
        self._patch(chunk, POS_QUEUE_OFFSET, self.base_offsets[g % self.queues] + g // self.queues)
        self._patch(chunk, POS_PHY_OFFSET, self.base + self.pos + np.arange(n, dtype=np.int64) * self.length)
        self._patch(chunk, POS_BORN_TS, np.full(n, now, dtype=np.int64))
        self._patch(chunk, POS_STORE_TS, np.full(n, now, dtype=np.int64))
        os.pwrite(self.fd, chunk.data, self.pos)
        self.pos += n * self.length
        self.g += n
        return n

    @staticmethod
    def _patch(chunk: np.ndarray, pos: int, values: np.ndarray) -> None:
        chunk[:, pos:pos + 8] = values.astype(">i8").view(np.uint8).reshape(-1, 8)

    def close(self) -> None:
        os.close(self.fd)


def command(commitlog, rate: float, messages: int, body: int, keys: int, seed: int, queues: int = 64,
            bodies: str = "random") -> list[str]:
    """This generator's command line for a service's ``commitlog`` settings (its ``dir`` and
    ``file_size``), run from the repository's root."""
    return [sys.executable, "-m", "bench.loadgen", commitlog.dir, "--rate", str(rate), "--messages", str(messages),
            "--queues", str(queues), "--body", str(body), "--keys", str(keys), "--seed", str(seed),
            "--file-size", str(commitlog.file_size), "--bodies", bodies]


def run(args) -> dict:
    os.makedirs(args.dir, exist_ok=True)
    rows = pool(args.topic, args.queues, args.keys, args.body, args.seed, args.bodies)
    end, offsets = log_end(args.dir, args.topic, args.queues)
    total = args.messages or int(args.rate * args.seconds)
    appender = Appender(args.dir, rows, args.queues, args.file_size, end, offsets)
    cpu0, started = resource.getrusage(resource.RUSAGE_SELF), time.monotonic()
    try:
        while appender.g < total:
            due = min(total, int((time.monotonic() - started) * args.rate) + 1)
            while appender.g < due:
                appender.append(due - appender.g)
            time.sleep(TICK_S)
    finally:
        appender.close()
    elapsed = time.monotonic() - started
    cpu1 = resource.getrusage(resource.RUSAGE_SELF)
    cpu = (cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime)
    nbytes = appender.g * rows.shape[1]
    return {"messages": appender.g, "bytes": nbytes, "record_bytes": rows.shape[1], "pool": len(rows),
            "from_phy": end, "end_phy": appender.base + appender.pos, "seconds": round(elapsed, 3),
            "msgs_per_s": round(appender.g / elapsed), "mb_per_s": round(nbytes / elapsed / 1e6, 1),
            "cpu_s": round(cpu, 3), "cores": round(cpu / elapsed, 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dir", help="the commitlog directory (created if missing; a log there is continued)")
    ap.add_argument("--rate", type=float, required=True, help="messages a second")
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--messages", type=int, default=0, help="this many, in place of rate x seconds")
    ap.add_argument("--body", type=int, default=1024, help="body bytes")
    ap.add_argument("--queues", type=int, default=64)
    ap.add_argument("--topic", default="topic-0")
    ap.add_argument("--keys", type=int, default=100_000)
    ap.add_argument("--file-size", type=int, default=1 << 30, help="the commitlog's file size (the broker's)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--bodies", choices=("random", "json"), default="random",
                    help="random bytes, or JSON orders of one shape, each --body bytes")
    args = ap.parse_args()
    if args.rate <= 0 or args.queues < 1 or args.keys < 1 or args.body < 0:
        sys.exit("loadgen: --rate, --queues and --keys must be positive, --body not negative")
    print(json.dumps(run(args)))


if __name__ == "__main__":
    main()
