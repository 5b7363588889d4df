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
    """

    retriable: bool = False


class ConfigError(TierlogError):
    """A setting is missing, malformed or contradicts another one.

    The message always names the setting (``section.key``) and where its value
    came from (the file, an environment variable or a flag).
    """


class StopRequested(TierlogError):
    """A graceful stop was requested; the work in hand was abandoned before it changed anything
    that a restart would not redo."""
