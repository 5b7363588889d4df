"""Outside systems: the commitlog files, the tier backends and reader, Kafka."""
