"""The root of every error tierlog raises on purpose.

Modelled on kafka-python's errors: one root class, and a ``retriable`` flag that
tells a caller whether trying the same thing again can succeed.  Each package
defines its own subclasses next to the code that raises them.
"""

from __future__ import annotations


class TierlogError(Exception):
    """Base of all tierlog errors.

    ``retriable`` is True when the same call may succeed later without any
    change by the operator (a broker that is down, a throttled bucket).
    ``exit_code`` is what the ``tierlog`` command exits with on it, by kind
    (``EXIT_CODES``), so a script can tell a bad setting from lost data.
    """

    retriable: bool = False
    exit_code: int = 1


class ConfigError(TierlogError):
    """A setting is missing, malformed or contradicts another one.

    The message always names the setting (``section.key``) and where its value
    came from (the file, an environment variable or a flag).
    """

    exit_code = 2


# What `tierlog` exits with, by kind of error; docs/cli.md lists the same.
EXIT_CODES = {
    1: "any other failure",
    2: "a usage or configuration error",
    3: "corrupt commitlog input",
    4: "commitlog files deleted before tierlog read them (the broker's retention outran it)",
    5: "commitlog.dir does not hold the log the tier and checkpoints were made from (a replica behind, say)",
    75: "a system that is away (Kafka, S3) or the commitlog's writer lock another producer holds: trying again "
        "later can succeed",
}


def exit_code(exc: TierlogError) -> int:
    return 75 if exc.retriable else exc.exit_code


class StopRequested(TierlogError):
    """A graceful stop was requested; the work in hand was abandoned before it changed anything
    that a restart would not redo."""
