"""Kafka sinks: the mirror and the changelog (see issue 5)."""
