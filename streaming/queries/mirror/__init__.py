"""The mirror query: the tier's committed batches -> one Kafka record per message (``query``, ``handler``, ``send``: one slot's send, ``sender_process``)."""
