"""The one definition of a changed key, shared by the compaction query, the KV view, the
changelog sink and the offline rebuild.

Spark's state holds only where each key's latest message is (``CHANGE_REF``); the driver reads
that message from the commitlog by physical offset to make the full row (``CHANGE_ROW``), which
the KV view applies and the changelog sends, in this column order.
"""

CHANGE_REF = ("topic", "key", "phy_offset")
CHANGE_ROW = CHANGE_REF + ("queue_id", "queue_offset", "store_ts", "deleted", "body")
