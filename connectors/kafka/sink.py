"""What the mirror and changelog sinks share: one producer, positions read back from Kafka,
and waiting out a broker that is away.

**Exactly once without transactions** (Kudu's "applied offset kept at Kafka").
Every record carries its source position, the commitlog physical offset, in
the ``tierlog.phy`` header and its RocketMQ broker in ``tierlog.broker``, and
each partition receives one broker's records in increasing position.  So a
partition's last record of a broker says how far that broker got there.
Before the first send to a topic, the sink reads that position back from every
partition; afterwards it sends a record only if its position is above its
partition's.  A batch that is sent again after a crash, or after the broker
went away, therefore skips what already arrived and sends the rest.

Several brokers' tierlogs may share a partition (one set of topics for a
cluster): the read-back then walks back from the end to this broker's last
record, past the records other brokers sent since, reading windows that grow
fourfold.  A record without ``tierlog.broker`` was sent before tierlog knew
brokers, and counts as ``broker-a``'s (the default name).

Order within a partition holds because there is one producer, records are
sent in position order, and the producer is idempotent (``acks=all``): the
broker refuses a batch that would land after a gap.  The client never gives up
on a record by itself (``connectors.kafka.producers``): only the sink does, by
discarding the whole producer.

It is longer than most modules because positions, read-back, retries and
health are one protocol: what a retry may resend depends on what the
read-back found, and both sinks must share exactly that.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
from kafka import KafkaConsumer, TopicPartition
from kafka import errors as kerr
from kafka.admin import KafkaAdminClient, NewTopic

from connectors.brokers import DEFAULT_BROKER
from connectors.errors import StopRequested
from connectors.kafka.errors import (
    ForeignRecordError,
    KafkaSinkError,
    KafkaUnavailable,
    RecordTooLargeError,
)
from connectors.kafka.kafka_python import describe, retriable
from connectors.kafka.producer import Producer, TooLarge
from connectors.kafka.producers import open_producer
from connectors.kafka.settings import KafkaSettings
from connectors.faults import crash_point

log = logging.getLogger("tierlog.kafka")

POSITION = "tierlog.phy"
BROKER = "tierlog.broker"
MAX_BACKOFF_S = 30.0
_SHARED: dict[str, Producer] = {}  # see KafkaSink.shared_producer


def close_shared_producer(settings: KafkaSettings, timeout_s: float = 5.0) -> None:
    """Close this process's shared producer for ``settings`` (``KafkaSink.shared_producer``), if it
    has one: for a process that outlives its sinks, as the driver does when it sends the mirror."""
    for records in (False, True):
        producer = _SHARED.pop(_shared_key(settings) + repr(records), None)
        if producer is not None:
            try:
                producer.close(timeout_s)
            except Exception as exc:  # noqa: BLE001 - closing must not hide the reason we stop
                log.warning("closing a shared producer: %s", exc)


def _shared_key(settings: KafkaSettings) -> str:
    return repr(sorted(settings.client.items())) + repr(settings)


@dataclass
class SinkStats:
    sent: int = 0
    skipped: int = 0  # at or below the partition's read-back position: already in Kafka
    too_large: int = 0  # skipped under on_too_large = "skip"
    bytes: int = 0
    retries: int = 0


def position_of(headers) -> int | None:
    for name, value in headers or ():
        if name == POSITION:
            return int(value)
    return None


def broker_of(headers) -> str:
    for name, value in headers or ():
        if name == BROKER:
            return value.decode()
    return DEFAULT_BROKER


class KafkaSink:
    """Base of the two sinks.  Subclasses route and build records; this class delivers them.

    Not thread-safe: one thread sends (the query's batch thread, or the compaction
    apply thread).  ``should_stop`` is polled while waiting for the broker, so a
    graceful stop does not wait for an outage to end.  ``on_health`` receives
    ``None`` when the sink is healthy and a dict (state, since, error) when it waits.
    """

    name = "kafka"
    compacted = False
    sends_records = False  # sends Records (send_records), so its producer reads columns

    def __init__(self, settings: KafkaSettings, *, should_stop: Callable[[], bool] = lambda: False,
                 on_health: Callable[[dict | None], None] | None = None,
                 on_skip: Callable[[int, str], None] | None = None,
                 owns: Callable[[str, int], bool] | None = None, shared_producer: bool = False):
        self.settings = settings
        self.should_stop = should_stop
        self.on_health = on_health
        self.on_skip = on_skip
        self.owns = owns  # None: every partition; else the partitions this sink (one of several) sends to
        # Reuse one producer per process across sinks (Spark tasks in a reused Python worker); one
        # sink uses it at a time, and a failure throws it away.
        self.shared_producer = shared_producer
        self.stats = SinkStats()
        self._producer: Producer | None = None
        self._partitions: dict[str, int] = {}  # Kafka topic -> partition count
        self._positions: dict[tuple[str, int], int] = {}  # (topic, partition) -> last position in Kafka
        self._last: dict[tuple[str, int], LastRecord] = {}  # (topic, partition) -> its last record, as read back
        # Everything at or below it is known sent (its owner recorded so): a record another
        # broker's compacted away cannot make the read-back send it again.
        self.floor = -1
        self.health = Health(self.name, on_health)

    # ------------------------------------------------------------ connection

    @property
    def producer(self) -> Producer:
        if self._producer is None:
            if self.shared_producer:
                key = _shared_key(self.settings) + repr(self.sends_records)
                self._producer = _SHARED.get(key) or _SHARED.setdefault(
                    key, open_producer(self.settings, records=self.sends_records))
                # A failure the last sink left (it stopped on an error before its flush) is its own:
                # this sink's records are judged by their own reports.
                self._producer.failure()
            else:
                self._producer = open_producer(self.settings, records=self.sends_records)
        return self._producer

    def close(self) -> None:
        if self.shared_producer:  # flushed already; it stays for the next task in this process
            self._producer = None
            return
        if self._producer is not None:
            try:
                self._producer.close(5)
            except Exception as exc:  # noqa: BLE001 - closing must not hide the reason we stop
                log.warning("closing the %s producer: %s", self.name, exc)
            self._producer = None

    def _reset(self) -> None:
        """Forget the producer and every position; the next send reads them back again."""
        if self._producer is not None:
            for key in [k for k, v in _SHARED.items() if v is self._producer]:
                del _SHARED[key]
            self._producer.discard()
        self._producer = None
        self._partitions.clear()
        self._positions.clear()
        self._last.clear()

    # ------------------------------------------------------------ topics and positions

    def partitions(self, topic: str) -> int:
        """The partition count of ``topic``, creating it first if allowed; its positions are read back."""
        count = self._partitions.get(topic)
        if count is None:
            self.learn([topic])
            count = self._partitions[topic]
        return count

    def learn(self, topics) -> None:
        """``partitions`` for each of ``topics`` (Kafka topics) this sink does not know yet, with
        their positions read back together: a sink about to send to several topics calls it first."""
        counts = {t: ensure_topic(self.settings, t, compacted=self.compacted)
                  for t in dict.fromkeys(topics) if t not in self._partitions}
        owned = {t: [p for p in range(n) if self.owns is None or self.owns(t, p)] for t, n in counts.items()}
        last = read_back_last(self.settings, owned)
        self._last.update(last)
        self._positions.update({tp: record.position for tp, record in last.items()})
        self._partitions.update(counts)

    def known(self) -> tuple[dict[str, int], dict[tuple[str, int], int]]:
        """Partition counts and positions this sink has learnt (to seed another with ``seed``)."""
        return dict(self._partitions), dict(self._positions)

    def seed(self, partitions: dict[str, int], positions: dict[tuple[str, int], int]) -> None:
        """Take counts and positions known to be current, so they need not be read back.

        A topic's count is taken only with the position of every partition this sink owns:
        a count alone would skip the read-back, and the sink would send from -1."""
        self._positions.update(positions)
        for topic, count in partitions.items():
            if all((topic, p) in self._positions for p in range(count) if self.owns is None or self.owns(topic, p)):
                self._partitions[topic] = count

    # ------------------------------------------------------------ sending

    def position(self, topic: str, partition: int) -> int:
        """The last position sent to (or read back from) a partition; -1 if none."""
        return self._positions.get((topic, partition), -1)

    def send(self, topic: str, partition: int, key: bytes | None, value: bytes | None, headers: list,
             position: int, timestamp_ms: int | None = None, *, force: bool = False) -> bool:
        """Send one record unless its partition already holds ``position``; True if it was sent.

        ``force`` sends it even at the partition's position (records without a message of
        their own, such as the changelog's expiries)."""
        if not force and position <= max(self.floor, self._positions.get((topic, partition), -1)):
            self.stats.skipped += 1
            return False
        try:
            self.producer.send(topic, partition, key, value, headers, timestamp_ms, position)
        except TooLarge as exc:
            self._too_large(position, str(exc))
            return False
        self._positions[(topic, partition)] = position
        self.stats.sent += 1
        if self.stats.sent % 100 == 0:  # records sent, some not yet acknowledged
            crash_point("kafka_sending")
        self.stats.bytes += len(value or b"")
        return True

    def send_records(self, records, *, force: bool = False) -> np.ndarray:
        """``send`` each row of a ``connectors.kafka.columns.Records``, in order, with ``send``'s
        checks and counts: its rows whose position is above their partition's are queued in one
        call of the producer (a producer opened with ``records=True`` reads the columns
        themselves).  The positions compared with are the ones before the call: within one call
        each partition's positions rise.  ``force`` sends every row (``send``'s).  Returns the
        rows sent."""
        n = len(records)
        if not n:
            return np.zeros(0, np.int64)
        if force:
            rows = np.arange(n)
        else:
            topics, partitions = records.topic, records.partition.astype(np.int64)
            width = int(partitions.max()) + 1
            above = np.full((len(records.topics), width), self.floor, np.int64)
            for (topic, partition), position in self._positions.items():
                t = self._topic_index(records, topic)
                if t is not None and partition < width:
                    above[t, partition] = max(self.floor, position)
            rows = np.flatnonzero(records.position > above[topics, partitions])
            self.stats.skipped += n - len(rows)
        if not len(rows):
            return rows
        sent_rows = []
        producer, stats = self.producer, self.stats
        sizes = records.value_sizes()
        # The crash tests kill the sender after its N-hundredth record, as send does: chunks that
        # end where the count of records sent passes a hundred, only while a fault is armed.
        armed = bool(os.environ.get("TIERLOG_FAULT"))
        start = 0
        while start < len(rows):
            end = min(len(rows), start + 100 - stats.sent % 100) if armed else len(rows)
            done, too_large = producer.send_records(records, rows[start:end])
            sent = rows[start: start + done]
            if len(sent):
                sent_rows.append(sent)
                self._note_sent(records, sent)
                stats.sent += len(sent)
                stats.bytes += int(sizes[sent].sum())
                if armed and stats.sent % 100 == 0:
                    crash_point("kafka_sending")
            start += done
            if too_large is not None:
                self._too_large(int(records.position[rows[start]]), too_large)
                start += 1
        return np.concatenate(sent_rows) if sent_rows else np.zeros(0, np.int64)

    @staticmethod
    def _topic_index(records, topic: str) -> int | None:
        try:
            return records.topics.index(topic)
        except ValueError:
            return None

    def _note_sent(self, records, sent: np.ndarray) -> None:
        """Each partition's position is its last record's of ``sent``."""
        where = records.topic[sent] * (int(records.partition[sent].max()) + 1) + records.partition[sent]
        keys, last = np.unique(where[::-1], return_index=True)
        last = sent[len(sent) - 1 - last]
        for row in last.tolist():
            self._positions[(records.topics[int(records.topic[row])], int(records.partition[row]))] = \
                int(records.position[row])

    def _too_large(self, position: int, reason: str) -> None:
        """Fail, or record and skip, the record at ``position`` (``kafka.on_too_large``).  One the
        broker refused without the library saying which (position -1) cannot be skipped: it fails
        either way, and nothing is recorded as sent."""
        if position < 0:
            raise RecordTooLargeError(
                f"Kafka refused records as too large ({reason}): the broker's message.max.bytes or "
                f"the topic's max.message.bytes is below kafka.max_request_size "
                f"({self.settings.max_request_size} bytes). Set kafka.max_request_size at or below the "
                "broker's limit: tierlog then refuses a record too large itself (kafka.on_too_large)")
        if self.settings.on_too_large != "skip":
            raise RecordTooLargeError(
                f"the message at physical offset {position} does not fit in a Kafka record ({reason}); raise "
                "kafka.max_request_size (and the broker's message.max.bytes), or set kafka.on_too_large = "
                '"skip" to record and skip such messages'
            )
        self.stats.too_large += 1
        log.warning("%s: skipped the message at physical offset %d: too large for Kafka (%s)", self.name, position, reason)
        if self.on_skip:
            self.on_skip(position, reason)

    def flush(self, report_every_s: float = 5.0, leave: int = 0) -> None:
        """Wait until every record sent is acknowledged, or all but ``leave`` of them; report while
        the broker keeps us waiting."""
        if self._producer is None:
            return
        started = time.monotonic()
        deadline = started + self.settings.delivery_timeout_s
        while not self._producer.flush(max(0.05, min(report_every_s, deadline - time.monotonic())), leave):
            now = time.monotonic()
            waited = now - started
            if now >= deadline:
                # The clients never give up on a record by themselves (a gap would follow: see
                # connectors.kafka.producers); here the whole producer is given up, and a new one
                # sends from the positions read back.
                raise KafkaUnavailable(f"records not acknowledged within {waited:.0f} s "
                                       "(kafka.delivery_timeout_s); reconnecting")
            self.health.waiting(f"records not acknowledged for {waited:.0f} s (broker down or slow?)")
            if self.should_stop():
                raise StopRequested(f"the {self.name} sink stopped while waiting for Kafka")
        failed = self._producer.failure()
        if failed is not None:
            error, position = failed
            if error.too_large:
                self._too_large(position, error.text)
                return
            where = "a record" if position < 0 else f"the record at physical offset {position}"
            what = f"Kafka did not take {where}: {error.text}"
            raise (KafkaUnavailable if error.retriable else KafkaSinkError)(what)

    def deliver_once(self, produce: Callable[[], None]) -> None:
        """Run ``produce`` (which calls ``send``) and flush; raise a ``KafkaSinkError`` on failure
        (``retriable`` says whether trying again can succeed) after dropping the producer."""
        try:
            produce()
            self.flush()
        except KafkaSinkError as exc:
            if exc.retriable:
                self._reset()
            raise
        except kerr.KafkaError as exc:
            self._reset()
            raise _wrap(exc, "Kafka failed") from None

    def deliver(self, produce: Callable[[], None]) -> None:
        """``deliver_once`` until it succeeds.

        On a retriable failure the sink waits with backoff (reported in the log and
        through ``on_health``), reconnects, reads the positions back and runs
        ``produce`` again from the start: what already arrived is skipped.
        """
        attempt = 0
        while True:
            try:
                self.deliver_once(produce)
                self.health.ok()
                return
            except KafkaSinkError as exc:
                if not exc.retriable:
                    raise
                error = exc
            self.stats.retries += 1
            attempt = backoff(attempt, error, self.health, self.should_stop)


class Health:
    """Says once in the log, and through ``on_health``, that a sink waits and why, and when it
    is healthy again; repeats the reason at each new failure."""

    def __init__(self, name: str, on_health: Callable[[dict | None], None] | None = None):
        self.name, self.on_health = name, on_health
        self.since: float | None = None

    def waiting(self, error: str, state: str = "waiting") -> None:
        if self.since is None:
            self.since = time.time()
        log.warning("%s: %s", self.name, error)
        if self.on_health:
            self.on_health({"state": state, "since": round(self.since, 3), "error": error})

    def ok(self) -> None:
        if self.since is None:
            return
        log.info("%s: Kafka reachable again after %.0f s", self.name, time.time() - self.since)
        self.since = None
        if self.on_health:
            self.on_health(None)


def backoff(attempt: int, error: BaseException, health: Health, should_stop: Callable[[], bool]) -> int:
    """Report ``error`` and sleep before try ``attempt + 1`` (0.5 s doubling to 30 s); a stop
    request ends the wait with ``StopRequested``.  Returns the next attempt number."""
    delay = min(MAX_BACKOFF_S, 0.5 * 2 ** attempt)
    health.waiting(f"{error}; retrying in {delay:.1f} s")
    deadline = time.monotonic() + delay
    while time.monotonic() < deadline:
        if should_stop():
            raise StopRequested(f"the {health.name} sink stopped while waiting for Kafka")
        time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))
    return attempt + 1


UNKNOWN_TOPIC = kerr.UnknownTopicOrPartitionError.errno


def _wrap(exc: BaseException, what: str) -> KafkaSinkError:
    """A kafka-python error of the consumer and admin clients (read-back, topics) as ours."""
    return (KafkaUnavailable if retriable(exc) else KafkaSinkError)(f"{what}: {describe(exc)}")


def _consumer(settings: KafkaSettings, **extra) -> KafkaConsumer:
    try:
        return KafkaConsumer(**settings.client, enable_auto_commit=False, allow_auto_create_topics=False,
                             request_timeout_ms=30000, **extra)
    except kerr.KafkaTimeoutError:
        raise KafkaUnavailable(f"no Kafka broker reachable at kafka.bootstrap = {settings.bootstrap!r}") from None


def _partitions_for(settings: KafkaSettings, topic: str, wait_s: float = 30.0) -> set | None:
    """The partitions of ``topic`` by the broker's own answer for it; None when it does not exist.

    Asked of a new admin client each time, not read from a consumer's metadata cache: a client's
    first refresh can fail ('Metadata refresh: failed Cancelled') and leave a topic that exists
    looking absent, which with ``kafka.auto_create_topics`` off reports it missing and waits for nothing.
    Retriable answers are asked again for up to ``wait_s``.
    """
    deadline = time.monotonic() + wait_s
    while True:
        try:
            admin = KafkaAdminClient(**settings.client)
        except kerr.KafkaTimeoutError:
            raise KafkaUnavailable(f"no Kafka broker reachable at kafka.bootstrap = {settings.bootstrap!r}") from None
        code = None
        try:
            (described,) = admin.describe_topics([topic])
            code = described["error_code"]
            error = None if code in (0, UNKNOWN_TOPIC) else kerr.for_code(code)()
        except kerr.KafkaError as e:
            error = e
        finally:
            admin.close()
        if code == UNKNOWN_TOPIC:
            return None
        if error is None:
            return {p["partition_index"] for p in described["partitions"]} or None
        if not retriable(error) or time.monotonic() > deadline:
            raise _wrap(error, f"describing Kafka topic {topic!r} at kafka.bootstrap = {settings.bootstrap!r}")
        time.sleep(0.2)


def ensure_topic(settings: KafkaSettings, topic: str, *, compacted: bool, wait_s: float = 30.0) -> int:
    """The partition count of ``topic``, creating it (compacted if asked) when allowed."""
    found = _partitions_for(settings, topic)
    if found:
        return len(found)
    if not settings.auto_create_topics:
        raise KafkaUnavailable(
            f"Kafka topic {topic!r} does not exist and kafka.auto_create_topics is off: create it, or "
            "turn kafka.auto_create_topics on"
        )
    admin = KafkaAdminClient(**settings.client)
    try:
        configs = {"cleanup.policy": "compact"} if compacted else {}
        admin.create_topics([NewTopic(topic, settings.partitions, settings.replication_factor, topic_configs=configs)])
    except kerr.TopicAlreadyExistsError:
        pass  # created meanwhile by someone else: fine
    except kerr.KafkaProtocolError:
        pass  # seen from tansu when two senders create a topic at once: whether it exists is checked below
    finally:
        admin.close()
    deadline = time.monotonic() + wait_s
    while not found:
        if time.monotonic() > deadline:
            raise KafkaUnavailable(f"Kafka topic {topic!r} was created but has no partitions after {wait_s:.0f} s")
        time.sleep(0.1)
        found = _partitions_for(settings, topic)
    log.info("created Kafka topic %s: %d partition(s)%s", topic, len(found), ", compacted" if compacted else "")
    return len(found)


READ_BACK_SETTLE_S = 2.0


@dataclass(frozen=True)
class LastRecord:
    """A partition's last record of this broker, as read back: its position (-1: none), key and
    headers (the changelog tells an interrupted round of expiries by them)."""

    position: int
    key: bytes | None = None
    headers: tuple = ()


def read_back(settings: KafkaSettings, wanted: dict[str, list[int]], timeout_s: float = 60.0,
              settle_s: float = READ_BACK_SETTLE_S) -> dict[tuple[str, int], int]:
    """The position in the last record of ``settings.broker`` in each partition of ``wanted``
    (Kafka topic -> partitions), -1 where it has none."""
    return {tp: last.position for tp, last in read_back_last(settings, wanted, timeout_s, settle_s).items()}


def read_back_last(settings: KafkaSettings, wanted: dict[str, list[int]], timeout_s: float = 60.0,
                   settle_s: float = READ_BACK_SETTLE_S) -> dict[tuple[str, int], LastRecord]:
    """The last record of ``settings.broker`` in each partition of ``wanted`` (Kafka topic ->
    partitions); ``LastRecord(-1)`` where it has none.

    A record a broker took just before a failure (a killed or discarded producer's last
    request, a restart) can become visible a moment later: the outage test caught records
    appearing after the read-back and being sent again.  So the positions are read again
    ``settle_s`` later, until two reads agree (at most five times).  Every topic is read in the
    same reads, so a sink with many topics waits ``settle_s`` once, not once a topic.
    """
    wanted = {t: ps for t, ps in wanted.items() if ps}
    last = _read_back_once(settings, wanted, timeout_s)
    for _ in range(5 if wanted else 0):
        time.sleep(settle_s)
        again = _read_back_once(settings, wanted, timeout_s)
        if again == last:
            break
        log.warning("Kafka topics %s: positions moved while being read back (%s); reading them again",
                    sorted(wanted), {k: (last[k].position, v.position) for k, v in again.items() if last.get(k) != v})
        last = again
    return last


def _read_back_once(settings: KafkaSettings, wanted: dict[str, list[int]],
                    timeout_s: float) -> dict[tuple[str, int], LastRecord]:
    """Each partition read up to the high watermark its fetch responses report, seeking straight
    to the record before it.  The end offsets a broker lists are only a first guess: tansu's
    lag behind the real end (measured: 1 for 1,000 records)."""
    if not wanted:
        return {}
    consumer = _consumer(settings, fetch_max_wait_ms=100)
    try:
        tps = [TopicPartition(t, p) for t, ps in wanted.items() for p in ps]
        consumer.assign(tps)
        begins, ends = consumer.beginning_offsets(tps), consumer.end_offsets(tps)
        for tp in tps:
            consumer.seek(tp, max(ends[tp] - 1, begins[tp]))
        last: dict = {}
        pending = set(tps)
        deadline = time.monotonic() + timeout_s
        while pending:
            for tp, records in consumer.poll(timeout_ms=300).items():
                last[tp] = records[-1]
            for tp in sorted(pending):
                high = consumer.highwater(tp)
                if high is None:
                    continue  # no fetch response for it yet
                position = consumer.position(tp)
                if position >= high:
                    pending.discard(tp)  # read to the end: ``last`` holds its last record, if any
                elif position < high - 1:
                    consumer.seek(tp, high - 1)  # only the last record matters
            if pending and time.monotonic() > deadline:
                late = sorted((tp.topic, tp.partition) for tp in pending)
                raise KafkaUnavailable(f"could not read the last records of Kafka topic partitions {late} back "
                                       f"within {timeout_s:.0f} s")
        out = {}
        for tp in tps:
            record = last.get(tp)
            if record is not None and _check(tp.topic, tp.partition, record) and broker_of(record.headers) != settings.broker:
                record = _last_of(consumer, tp, begins[tp], record.offset, settings.broker, deadline, tp.topic)
            out[(tp.topic, tp.partition)] = (LastRecord(-1) if record is None else
                                             LastRecord(position_of(record.headers), record.key, tuple(record.headers)))
        return out
    finally:
        consumer.close()


def _check(topic: str, partition: int, record) -> bool:
    if position_of(record.headers) is None:
        raise ForeignRecordError(
            f"Kafka topic {topic!r} partition {partition}: the record at offset {record.offset} has no "
            f"{POSITION} header, so another producer writes there; tierlog needs topics of its own "
            "(see kafka.mirror_topic and kafka.changelog_topic)"
        )
    return True


def _last_of(consumer, tp, begin: int, end: int, broker: str, deadline: float, topic: str):
    """The last record of ``broker`` in ``tp`` below offset ``end``, or None: windows read back
    from ``end``, each four times the last, so the walk costs what other brokers sent since."""
    window = 64
    while end > begin:
        start = max(begin, end - window)
        consumer.seek(tp, start)
        found = []
        while consumer.position(tp) < end:
            for part, records in consumer.poll(timeout_ms=300).items():
                if part == tp:  # the other partitions were read to their end already
                    found.extend(r for r in records if r.offset < end)
            if time.monotonic() > deadline:
                raise KafkaUnavailable(f"could not read Kafka topic {topic!r} partition {tp.partition} back to "
                                       f"broker {broker!r}'s last record in time")
        for record in reversed(found):
            if _check(topic, tp.partition, record) and broker_of(record.headers) == broker:
                return record
        end, window = start, window * 4
    return None
