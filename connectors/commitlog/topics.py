"""Topic classes of a broker's commitlog, and the per-sink filters built on them.

A real broker's log holds more than business messages.  RocketMQ's ``TopicValidator`` names its
system topics; retry and dead-letter topics are made per consumer group on the fly.  tierlog
decides a topic's class by name alone, with RocketMQ's rules:

``system``    the fixed system topics below, and every topic starting with ``rmq_sys_`` (timer
              wheel, POP revive logs, broker member sync) or ``%LMQ%`` (light queues, which the
              broker fills by dispatching other topics' messages again)
``retry``     ``%RETRY%<group>`` and ``%DLQ%<group>``
``business``  every other topic

A broker also registers its cluster name and broker name as system topics at start; they are not
knowable from the log, so exclude them by name (``topics.exclude``) if they carry messages.

Each sink keeps the classes it is given plus the topics it includes by name, minus what is
excluded everywhere or for it; see ``TopicFilter``.
"""

from __future__ import annotations

import fnmatch
import json
from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.compute as pc

SYSTEM_TOPICS = frozenset({
    "TBW102",  # the template of auto-created topics
    "SCHEDULE_TOPIC_XXXX",  # delayed messages until they are due
    "SCHEDULE_TOPIC_XXXX_V2",
    "BenchmarkTest",
    "RMQ_SYS_TRANS_HALF_TOPIC",  # transactional half messages
    "RMQ_SYS_TRANS_OP_HALF_TOPIC",  # their commit and rollback marks
    "TRANS_CHECK_MAX_TIME_TOPIC",
    "RMQ_SYS_TRACE_TOPIC",
    "SELF_TEST_TOPIC",
    "OFFSET_MOVED_EVENT",
    "CHECKPOINT_TOPIC",  # RocksDB consume-queue offsets (5.3)
})
SYSTEM_PREFIXES = ("rmq_sys_", "%LMQ%")
RETRY_PREFIXES = ("%RETRY%", "%DLQ%")
CLASSES = ("business", "retry", "system")


def topic_class(topic: str) -> str:
    """``system``, ``retry`` or ``business``, by RocketMQ's naming rules."""
    if topic in SYSTEM_TOPICS or topic.startswith(SYSTEM_PREFIXES):
        return "system"
    if topic.startswith(RETRY_PREFIXES):
        return "retry"
    return "business"


@dataclass(frozen=True)
class TopicFilter:
    """Which topics one sink takes.

    A topic passes when it matches ``include`` and no ``exclude`` pattern, and either its class
    is in ``classes`` or it matches one of ``also`` (the sink's own includes, which let one
    system topic in without the whole class).  Patterns are shell globs (``orders-*``).
    """

    classes: frozenset = frozenset(CLASSES)
    include: tuple = ("*",)
    exclude: tuple = ()
    also: tuple = ()
    _seen: dict = field(default_factory=dict, compare=False, repr=False)

    def accepts(self, topic: str) -> bool:
        ok = self._seen.get(topic)
        if ok is None:
            named = lambda patterns: any(fnmatch.fnmatchcase(topic, p) for p in patterns)  # noqa: E731
            ok = (named(self.include) and not named(self.exclude)
                  and (topic_class(topic) in self.classes or named(self.also)))
            if len(self._seen) < 100_000:  # retry topics are made per consumer group: bound the memo
                self._seen[topic] = ok
        return ok

    @property
    def everything(self) -> bool:
        return self.classes == frozenset(CLASSES) and self.include == ("*",) and not self.exclude

    def mask(self, topics: pa.Array | pa.ChunkedArray) -> pa.Array:
        """True for the rows whose topic passes; the test runs once per distinct topic."""
        encoded = pc.dictionary_encode(topics)
        if isinstance(encoded, pa.ChunkedArray):
            encoded = encoded.combine_chunks()
        verdicts = pa.array([self.accepts(t) for t in encoded.dictionary.to_pylist()], pa.bool_())
        return pc.take(verdicts, encoded.indices)

    def to_json(self) -> str:
        return json.dumps({"classes": sorted(self.classes), "include": list(self.include),
                           "exclude": list(self.exclude), "also": list(self.also)})

    @classmethod
    def from_json(cls, text: str | None) -> "TopicFilter":
        if not text:
            return cls()
        d = json.loads(text)
        return cls(frozenset(d["classes"]), tuple(d["include"]), tuple(d["exclude"]), tuple(d["also"]))


def filtered_counts(topics: pa.Array | pa.ChunkedArray, filters: dict[str, TopicFilter]) -> dict[str, dict[str, int]]:
    """Per sink, per class: how many of ``topics`` (one per message) the sink's filter leaves out."""
    encoded = pc.dictionary_encode(topics)
    if isinstance(encoded, pa.ChunkedArray):
        encoded = encoded.combine_chunks()
    names = encoded.dictionary.to_pylist()
    counts = pc.value_counts(encoded.indices)
    out: dict[str, dict[str, int]] = {}
    for item in counts.to_pylist():
        topic, n = names[item["values"]], item["counts"]
        for sink, f in filters.items():
            if not f.accepts(topic):
                by_class = out.setdefault(sink, {})
                by_class[topic_class(topic)] = by_class.get(topic_class(topic), 0) + n
    return out
