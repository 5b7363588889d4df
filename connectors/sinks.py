"""The names of tierlog's sinks: where its outputs go, and under which name the metadata store
records how far each has applied the commitlog (the safepoint is the lowest of them)."""

TIER = "tier"  # the tier's commit log (the tiering query)
KV = "kv"  # the KV view (the compaction query)
CHANGELOG = "changelog"  # the Kafka changelog topic (the compaction query, with Kafka on)
MIRROR = "mirror"  # the Kafka mirror topic (the mirror query, with Kafka on)

# The topic filters of ``[topics]``: one per query, so the kv and changelog sinks, which the
# compaction query feeds, share the ``compaction`` one.
FILTERED_SINKS = ("tier", "compaction", "mirror")
FILTER_OF = {TIER: "tier", KV: "compaction", CHANGELOG: "compaction", MIRROR: "mirror"}
