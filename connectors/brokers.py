"""Broker identity: which RocketMQ broker a commitlog, and every row tiered from it, belongs to.

A RocketMQ cluster is several broker groups, each a master and its replicas sharing one
``brokerName`` and holding the same bytes at the same physical offsets.  Queue ids, queue
offsets and physical offsets are per broker group: ``orders`` queue 0 on ``broker-a`` and on
``broker-b`` are two different queues.  So every row carries the broker's name, the tier
keeps each broker's queues apart, and ``broker.name`` is what says which one a tierlog reads.
"""

from __future__ import annotations

import re

# RocketMQ's sample configuration (conf/broker.conf) names its first broker this.
DEFAULT_BROKER = "broker-a"
# Letters, digits, '-', '_' and '.': what real broker names use, and safe as a path level,
# a Kafka header value and a metric label alike.
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,126}$")


def broker_name_problem(name: str) -> str | None:
    """Why ``name`` cannot be a broker name, or None when it can."""
    if _NAME.match(name):
        return None
    return (f"{name!r} is not a broker name: use 1-127 letters, digits, '-', '_' or '.', starting with a "
            "letter or digit (RocketMQ's brokerName of the broker whose store/commitlog this is)")
