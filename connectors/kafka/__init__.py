"""Kafka sinks: the mirror and the changelog."""
