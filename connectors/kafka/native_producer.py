"""librdkafka's producer called through ctypes (``connectors.kafka.native``), for a sink that sends
``Records``: the mirror.

It is the same client as ``RdKafkaProducer``, configured the same (``rdkafka_options``): idempotent,
``acks=all``, no timeout of its own, only failed records reported.  Only the way records reach it
differs: ``send_records`` fills the arguments of a few thousand records at once with numpy, from
the columns' Arrow buffers, then calls ``rd_kafka_produceva`` once a record, holding the
interpreter lock for the call (it never blocks): a fraction of the sending thread's time a record
that the binding's ``produce`` takes (``docs/benchmarks.md``, "The mirror's records from Arrow buffers").
"""

from __future__ import annotations

import ctypes
import logging
from functools import lru_cache

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from connectors.kafka import native
from connectors.kafka.columns import HEADERS_TYPE, Records
from connectors.kafka.errors import KafkaSinkError, KafkaUnavailable
from connectors.kafka.producer import Producer, TooLarge
from connectors.kafka.rdkafka import MSG_SIZE_TOO_LARGE, QUEUE_FULL, rd_send_error, rdkafka_options
from connectors.kafka.settings import KafkaSettings

log = logging.getLogger("tierlog.kafka")

CHUNK_ROWS = 4096  # records whose arguments are built at once: about 4 MB of them with 12 headers
_DISCARD_WAIT_MS = 5000  # a purge's reports come at once; this only bounds a stuck client
_NAMES_KEPT = 4096  # header names kept as C strings between batches (a broker has a few dozen)
FIXED = 6  # arguments every record has: topic, partition, flags, value, key, timestamp


def open_native(settings: KafkaSettings) -> NativeProducer | None:
    """A native producer, or None where no usable librdkafka was found or it failed its self-test."""
    lib = usable_library()
    return None if lib is None else NativeProducer(settings, lib)


@lru_cache(maxsize=1)
def usable_library() -> native.Library | None:
    """``native.library()``, once it passed ``self_test`` in this process; None otherwise (said once)."""
    lib = native.library()
    if lib is None:
        return None
    problem = self_test(lib)
    if problem is not None:
        log.warning("librdkafka at %s failed tierlog's self-test (%s): the mirror sends through the binding's "
                    "produce instead", lib.path, problem)
        return None
    return lib


SELF_TEST = {"key": b"tierlog-self-test-key", "value": b"tierlog self-test value \x00\xff" * 3, "partition": 2,
             "headers": (("h1", b"first"), ("h2", b""))}


def self_test(lib: native.Library, timeout_s: float = 10.0) -> str | None:
    """One record with a key, a value, headers and a partition, sent the way every batch is sent
    (``send_records``: the ``rd_kafka_vu_t`` arrays filled here) to librdkafka's in-process mock
    broker (``test.mock.num.brokers``: no network, no Kafka); its delivery report must give back
    the key, value and partition as sent.  So a librdkafka whose argument layout or numbering
    moved is never called with ours.  None when it holds, else what differed."""
    got: list[tuple] = []
    settings = KafkaSettings(client={"bootstrap_servers": "127.0.0.1:1"})
    try:
        producer = NativeProducer(settings, lib, on_delivered=lambda *report: got.append(report), conf_overrides={
            "test.mock.num.brokers": 1, "delivery.report.only.error": False, "linger.ms": 0, "log_level": 3,
            "topic.metadata.refresh.interval.ms": 100})
    except KafkaSinkError as exc:
        return f"it could not start a producer: {exc}"
    try:
        t = SELF_TEST
        producer.send("tierlog-self-test", t["partition"], t["key"], t["value"], list(t["headers"]), 1, 0)
        producer.flush(timeout_s)
    except Exception as exc:  # noqa: BLE001 - any failure means: do not use this path
        return f"{type(exc).__name__}: {exc}"
    finally:
        producer.discard()
    want = (0, t["partition"], t["key"], t["value"])
    if got != [want]:
        return f"its delivery report said {got!r} for {want!r}"
    return None


class NativeProducer(Producer):
    """One ``native.Handle``; one thread calls it (``Producer``'s contract)."""

    def __init__(self, settings: KafkaSettings, lib: native.Library, *, on_delivered=None,
                 conf_overrides: dict | None = None):
        super().__init__()
        conf = {name: value for name, value in rdkafka_options(settings).items() if name != "logger"}
        conf["delivery.report.only.error"] = True
        conf.update(conf_overrides or {})
        try:
            self._handle = native.Handle(lib, conf, self._report, self._client_error, on_delivered)
        except native.NativeError as exc:
            raise KafkaSinkError(str(exc)) from None
        self._discarded = False
        self._names: dict[str, ctypes.Array] = {}
        self._empty = ctypes.create_string_buffer(1)  # where an empty value points
        self._prepared: tuple[Records, _Columns] | None = None

    # ------------------------------------------------------------ sending

    def send(self, topic, partition, key, value, headers, timestamp_ms, position) -> None:
        one = Records(
            topics=(topic,), topic=np.zeros(1, np.int64), partition=np.array([partition], np.int64),
            key=pa.array([key], pa.binary()), value=pa.array([value], pa.binary()),
            timestamp=np.array([timestamp_ms or 0], np.int64), position=np.array([position], np.int64),
            headers=tuple((name, pa.array([v], pa.binary())) for name, v in headers))
        done, too_large = self.send_records(one, np.zeros(1, np.int64))
        if too_large is not None:
            raise TooLarge(too_large)

    def send_records(self, records: Records, rows: np.ndarray) -> tuple[int, str | None]:
        handle = self._handle
        try:
            rk = handle.live()
        except native.NativeError as exc:
            raise KafkaSinkError(str(exc)) from None
        columns = self._columns(records)
        produceva = handle.lib.fast.rd_kafka_produceva
        done = 0
        for lo in range(0, len(rows), CHUNK_ROWS):
            vus, starts, counts = columns.arguments(rows[lo: lo + CHUNK_ROWS])
            base = vus.ctypes.data
            for k, (address, count) in enumerate(zip((base + starts * native.VU_BYTES).tolist(), counts.tolist())):
                err = produceva(rk, address, count)
                while err:  # rare: a full queue, a record too large, or a client that failed
                    error = handle.error_of(err)
                    if error.code == MSG_SIZE_TOO_LARGE:
                        return done + k, f"{handle.lib.err_name(error.code)}: {error}"
                    if error.code != QUEUE_FULL:
                        failure = rd_send_error(error.code, f"{handle.lib.err_name(error.code)}: {error}",
                                                fatal=error.fatal, retriable=error.retriable)
                        raise (KafkaUnavailable if failure.retriable else KafkaSinkError)(failure.text)
                    handle.poll(50)  # its queue is full: let it send
                    err = produceva(rk, address, count)
            done += len(counts)
            handle.poll(0)  # failures surface during a long batch
        return done, None

    def _columns(self, records: Records) -> _Columns:
        if self._prepared is None or self._prepared[0] is not records:
            if len(self._names) > _NAMES_KEPT:
                self._names = {}
            self._prepared = (records, _Columns(records, self._handle, self._name, ctypes.addressof(self._empty)))
        return self._prepared[1]

    def _name(self, name: str) -> int:
        buffer = self._names.get(name)
        if buffer is None:
            buffer = self._names[name] = ctypes.create_string_buffer(name.encode())
        return ctypes.addressof(buffer)

    # ------------------------------------------------------------ reports

    def _report(self, code: int, topic: str, partition: int) -> None:
        if not self._discarded:
            lib = self._handle.lib
            failure = rd_send_error(code, f"{lib.err_name(code)}: {lib.err_str(code)}")
            self._fail(-1, failure.__class__(failure.text + f" (topic {topic!r}, partition {partition})",
                                             failure.retriable, failure.too_large))

    def _client_error(self, code: int, reason: str) -> None:
        # Connection trouble is reported here and retried by librdkafka itself; records it cannot
        # deliver wait for the sink's deadline (KafkaSink.flush), never time out by themselves.
        log.debug("librdkafka: %s: %s", self._handle.lib.err_name(code), reason)

    # ------------------------------------------------------------ the rest of Producer

    def flush(self, timeout_s: float, leave: int = 0) -> bool:
        self._prepared = None  # the records are sent: their buffers may go
        handle = self._handle
        if not leave:
            handle.flush(int(timeout_s * 1000))
            return handle.queued() == 0
        import time

        deadline = time.monotonic() + timeout_s
        while handle.queued() > leave:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            handle.poll(int(min(0.05, left) * 1000))
        return True

    def close(self, timeout_s: float) -> None:
        self._handle.flush(int(timeout_s * 1000))
        self.discard()

    def discard(self) -> None:
        self._discarded = True
        self._prepared = None
        handle = self._handle
        if handle.rk is None:
            return
        try:
            handle.purge()
            handle.flush(_DISCARD_WAIT_MS)  # every purged record reported (and ignored) before it goes
        finally:
            handle.destroy()


class _Columns:
    """A ``Records``' columns as the addresses and sizes ``rd_kafka_vu_t`` takes, for every row;
    ``arguments`` lays out the arguments of some of its rows.  Holds every Arrow array made on
    the way (casts), so what the addresses point at lives as long as this."""

    def __init__(self, records: Records, handle: native.Handle, name_of, empty: int):
        self.rkt = np.array([handle.topic(t) for t in records.topics], np.uint64)[records.topic]
        self.partition = records.partition.astype(np.uint64)
        self.timestamp = records.timestamp.astype(np.uint64)
        self.value = native.pointers(records.value, empty)
        if records.value_rows is not None:
            self.value = (self.value[0][records.value_rows], self.value[1][records.value_rows])
        self.key = native.pointers(records.key, empty)
        self.headers = [(name_of(name), *native.pointers(column, empty)) for name, column in records.headers]
        self.keep = [records]
        n = len(records)
        if records.pairs is None:
            self.pair_count = np.zeros(n, np.int64)
            return
        pairs = pc.cast(records.pairs, HEADERS_TYPE)
        self.keep.append(pairs)
        offsets = pairs.offsets.to_numpy().astype(np.int64)
        count = offsets[1:] - offsets[:-1]
        if pairs.null_count:
            count = np.where(np.asarray(pairs.is_valid(), dtype=bool), count, 0)
        self.pair_start, self.pair_count = offsets[:-1], count
        names = pc.dictionary_encode(pairs.keys)
        self.pair_name = np.array([name_of(s) for s in names.dictionary.to_pylist()], np.uint64)[
            names.indices.to_numpy(zero_copy_only=False)] if len(pairs.keys) else np.zeros(0, np.uint64)
        self.pair_value = native.pointers(pairs.items, empty)

    def arguments(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(vus, starts, counts)``: the arguments of ``rows``, record j's ``counts[j]`` of them
        from row ``starts[j]`` of ``vus`` (``rd_kafka_vu_t`` as rows of nine 64-bit words)."""
        pair_count = self.pair_count[rows]
        counts = FIXED + pair_count + len(self.headers)
        starts = np.zeros(len(rows), np.int64)
        np.cumsum(counts[:-1], out=starts[1:])
        vus = np.zeros((int(counts.sum()), native.VU_WORDS), np.uint64)
        for j, vtype, a, b in ((0, native.RKT, self.rkt[rows], 0),
                               (1, native.PARTITION, self.partition[rows], 0),
                               (2, native.MSGFLAGS, native.MSG_F_COPY, 0),
                               (3, native.VALUE, self.value[0][rows], self.value[1][rows]),
                               (4, native.KEY, self.key[0][rows], self.key[1][rows]),
                               (5, native.TIMESTAMP, self.timestamp[rows], 0)):
            at = starts + j
            vus[at, 0], vus[at, 1], vus[at, 2] = vtype, a, b
        total = int(pair_count.sum())
        if total:
            within = np.arange(total) - np.repeat(np.cumsum(pair_count) - pair_count, pair_count)
            flat = np.repeat(self.pair_start[rows], pair_count) + within
            at = np.repeat(starts + FIXED, pair_count) + within
            vus[at, 0], vus[at, 1] = native.HEADER, self.pair_name[flat]
            vus[at, 2], vus[at, 3] = self.pair_value[0][flat], self.pair_value[1][flat]
        for j, (name, address, size) in enumerate(self.headers):
            at = starts + FIXED + pair_count + j
            vus[at, 0], vus[at, 1], vus[at, 2], vus[at, 3] = native.HEADER, name, address[rows], size[rows]
        return vus, starts, counts
