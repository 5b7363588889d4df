"""The compaction query: the tier's committed batches -> latest value per key (``query``, ``handler``, ``latest_per_key``: the stateful step)."""
