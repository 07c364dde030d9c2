"""The one exception type a user sees: a sentence saying what is wrong, where, and how to fix it."""

from __future__ import annotations


class NebulaError(Exception):
    """A user-facing error: its message is one line that says what, where and how to fix.

    The CLI prints it as ``nebula-fl: error: <message>`` and exits with status 2; everything else
    is a bug and gets a traceback.
    """

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(message.split()))


class ConfigError(NebulaError, ValueError):
    """A configuration value or key is invalid."""
