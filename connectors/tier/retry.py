"""How a backend waits out a store that is away: a retriable failure (S3 throttling, a 5xx, a
timeout, a full disk) is tried again with jittered exponential backoff, each retry a warning in the
log, until a deadline or a stop (``connectors.stopping``).  Shared by the backends, whose I/O alone differs."""

from __future__ import annotations

import logging
import random
import time
from typing import Callable, TypeVar

from connectors.errors import StopRequested
from connectors.stopping import stop_requested
from connectors.tier.errors import InvalidObjectName

log = logging.getLogger("connectors.tier.backend")
T = TypeVar("T")
RETRY_DEADLINE_S = 600.0  # how long a backend keeps retrying a transient failure before it gives up
READ_DEADLINE_S = 10.0  # the same for a person's read command: an endpoint that is away is said in seconds
_patience = RETRY_DEADLINE_S


def set_patience(deadline_s: float) -> None:
    """How long this process's backends retry from now on, by default: the service waits out an
    outage (``RETRY_DEADLINE_S``); a read command gives up soon (``READ_DEADLINE_S``)."""
    global _patience
    _patience = deadline_s


def patience() -> float:
    return _patience


def retry_transient(call: Callable[[], T], deadline_s: float | None = None) -> T:
    """``call()``, again after each retriable ``TierError`` (S3 throttling, a 5xx, a timeout, a full
    disk) with jittered exponential backoff, until ``deadline_s`` has passed, or until a stop is
    requested (``request_stop``: ``StopRequested``).

    Each retry is a warning in the log, so an operator sees why tiering waits.
    A store that is down for a while delays tiering instead of failing it.
    """
    deadline = time.monotonic() + (_patience if deadline_s is None else deadline_s)
    attempt = 0
    while True:
        try:
            return call()
        except InvalidObjectName:
            raise
        except Exception as exc:
            attempt += 1
            if not getattr(exc, "retriable", False) or time.monotonic() >= deadline:
                raise
            if stop_requested():
                raise StopRequested(f"stop requested while retrying: {exc}") from None
            delay = min(30.0, 0.1 * 2**attempt, max(0.1, deadline - time.monotonic())) * (0.5 + random.random() / 2)
            # A read command's person learns the outcome in seconds: its retries are not each a warning.
            log.log(logging.WARNING if _patience >= RETRY_DEADLINE_S else logging.DEBUG,
                    "%s; retrying in %.1fs (attempt %d)", exc, delay, attempt)
            if stop_requested(delay):
                raise StopRequested(f"stop requested while retrying: {exc}") from None
