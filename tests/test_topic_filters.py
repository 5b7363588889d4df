"""The topic filters, table-driven through ``tierlog.toml``: RocketMQ's own topic names (its
``TopicValidator`` system topics, the ``rmq_sys_`` and ``%LMQ%`` prefixes, retry and dead-letter
topics) against every combination of classes, includes and excludes, for each sink.

The expectation is the documented rule written out here, not the product's code: a topic passes
when it matches ``topics.include`` and neither ``topics.exclude`` nor the sink's own exclude, and
either its class is among the sink's classes or it matches the sink's own include.
"""

from __future__ import annotations

import fnmatch
import itertools

import pytest

from streaming import config as cfg
from streaming.settings import derive

# RocketMQ's classes, as its TopicValidator and naming rules define them (written out, not imported).
TOPICS = {
    "TBW102": "system", "SCHEDULE_TOPIC_XXXX": "system", "RMQ_SYS_TRANS_HALF_TOPIC": "system",
    "RMQ_SYS_TRANS_OP_HALF_TOPIC": "system", "TRANS_CHECK_MAX_TIME_TOPIC": "system", "RMQ_SYS_TRACE_TOPIC": "system",
    "SELF_TEST_TOPIC": "system", "OFFSET_MOVED_EVENT": "system", "BenchmarkTest": "system",
    "rmq_sys_wheel_timer": "system", "rmq_sys_REVIVE_LOG_DefaultCluster": "system", "%LMQ%orders-by-user": "system",
    "%RETRY%billing": "retry", "%DLQ%billing": "retry", "%RETRY%audit-readers": "retry",
    "orders": "business", "orders-audit": "business", "payments": "business", "TBW1020": "business",
    "rmq_system_like": "business", "LMQ%orders": "business",
}
CLASSES = ["business", "business,retry", "system", "business,retry,system", ""]
INCLUDES = ["*", "orders*,%RETRY%*,%LMQ%*"]
EXCLUDES = ["", "*TRACE*,%DLQ%*"]
SINK_INCLUDES = ["", "RMQ_SYS_TRANS_HALF_TOPIC,%LMQ%*"]
SINK_EXCLUDES = ["", "orders-audit"]


def globs(text: str) -> list[str]:
    return [p.strip() for p in text.split(",") if p.strip()]


def expected(topic: str, classes: str, include: str, exclude: str, also: str, not_this: str) -> bool:
    named = lambda patterns: any(fnmatch.fnmatchcase(topic, p) for p in patterns)  # noqa: E731
    return (named(globs(include) or ["*"]) and not named(globs(exclude) + globs(not_this))
            and (TOPICS[topic] in globs(classes) or named(globs(also))))


@pytest.mark.parametrize("sink", ["tier", "compaction", "mirror"])
def test_every_combination_of_classes_includes_and_excludes_through_the_config(tmp_path, sink):
    checked = 0
    for classes, include, exclude, also, not_this in itertools.product(CLASSES, INCLUDES, EXCLUDES, SINK_INCLUDES,
                                                                       SINK_EXCLUDES):
        toml = tmp_path / "tierlog.toml"
        # Compaction off: its filter must otherwise lie within the tier's (it reads the tier).
        toml.write_text(f'[compaction]\nenabled = false\n[topics]\ninclude = "{include}"\nexclude = "{exclude}"\n'
                        f'{sink} = "{classes}"\n{sink}_include = "{also}"\n{sink}_exclude = "{not_this}"\n')
        filters = derive(cfg.load(str(toml), env={})).filters
        for topic in TOPICS:
            want = expected(topic, classes, include, exclude, also, not_this)
            assert filters[sink].accepts(topic) == want, (topic, classes, include, exclude, also, not_this)
            checked += 1
        others = [s for s in ("tier", "compaction", "mirror") if s != sink]
        for other in others:  # a sink's own include and exclude are its alone
            default_classes = {"tier": "business,retry", "compaction": "business", "mirror": "business"}[other]
            assert [filters[other].accepts(t) for t in TOPICS] == [
                expected(t, default_classes, include, exclude, "", "") for t in TOPICS]
    assert checked == len(CLASSES) * len(INCLUDES) * len(EXCLUDES) * len(SINK_INCLUDES) * len(SINK_EXCLUDES) * len(TOPICS)


def test_the_defaults_tier_business_and_retry_and_keep_system_topics_out(tmp_path):
    filters = derive(cfg.Config()).filters
    assert [t for t in TOPICS if filters["tier"].accepts(t)] == [t for t, c in TOPICS.items() if c != "system"]
    for sink in ("compaction", "mirror"):
        assert [t for t in TOPICS if filters[sink].accepts(t)] == [t for t, c in TOPICS.items() if c == "business"]


def test_an_unknown_class_is_refused_naming_the_setting(tmp_path):
    toml = tmp_path / "tierlog.toml"
    toml.write_text('[topics]\nmirror = "business,dlq"\n')
    # Refused as the configuration loads, naming where the value came from.
    with pytest.raises(cfg.ConfigError, match=r"setting topics\.mirror \(from .*tierlog\.toml\): 'dlq' is not a "
                                               r"topic class; use any of business, retry, system"):
        derive(cfg.load(str(toml), env={}))


@pytest.mark.parametrize("topics, says", [
    ('mirror = "business,system"', "topics.mirror takes the class(es) system, which topics.tier ('business,retry') "
                                    "leaves out"),
    ('tier_exclude = "orders-*"', "topics.tier_exclude leaves out orders-*, which topics.mirror_exclude does not"),
    ('tier = "business"\nmirror_include = "%RETRY%*"', "topics.mirror_include takes %RETRY%*, which "
                                                        "topics.tier_include does not"),
])
def test_a_mirror_filter_wider_than_the_tiers_is_refused_while_the_mirror_is_on(tmp_path, topics, says):
    """The mirror sends what the tier committed: it cannot send a topic the tier leaves out."""
    toml = tmp_path / "tierlog.toml"
    toml.write_text(f'[compaction]\nenabled = false\n[topics]\n{topics}\n')
    derive(cfg.load(str(toml), env={}))  # Kafka off: no mirror, nothing to refuse
    toml.write_text(f'[compaction]\nenabled = false\n[kafka]\nbootstrap = "localhost:9092"\n[topics]\n{topics}\n')
    with pytest.raises(cfg.ConfigError, match="the Kafka mirror sends what the tier keeps") as caught:
        derive(cfg.load(str(toml), env={}))
    assert says in str(caught.value)
    toml.write_text(f'[compaction]\nenabled = false\n[kafka]\nbootstrap = "localhost:9092"\nmirror = false\n'
                    f'[topics]\n{topics}\n')
    derive(cfg.load(str(toml), env={}))


@pytest.mark.parametrize("topics, says", [
    ('compaction = "business,retry"\ntier = "business"', "topics.compaction takes the class(es) retry, which "
                                                          "topics.tier ('business') leaves out"),
    ('tier_exclude = "orders-*"', "topics.tier_exclude leaves out orders-*, which topics.compaction_exclude does not"),
])
def test_a_compaction_filter_wider_than_the_tiers_is_refused_while_compaction_is_on(tmp_path, topics, says):
    """The KV view is built from what the tier committed: it cannot take a topic the tier leaves out."""
    toml = tmp_path / "tierlog.toml"
    toml.write_text(f'[topics]\n{topics}\n')
    with pytest.raises(cfg.ConfigError, match="the KV view takes what the tier keeps") as caught:
        derive(cfg.load(str(toml), env={}))
    assert says in str(caught.value)
    toml.write_text(f'[compaction]\nenabled = false\n[topics]\n{topics}\n')
    derive(cfg.load(str(toml), env={}))
