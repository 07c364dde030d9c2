"""Python ``logging`` lines of plug-ins reach the ServerApp's log (``logs/server.log``), beside Flower's own.

Flower's ``flwr-serverapp`` sends what the process writes to stdout/stderr to the SuperLink, which streams
it to ``flwr run`` (the launcher writes that to ``logs/server.log``). Flower's logger has its own console
handler; any other logger, e.g. a strategy plug-in's ``logging.getLogger(__name__)``, propagates to a root
logger with no handler and level WARNING, so its INFO lines are lost and its warnings come out bare. One
handler on the root logger, at INFO, prints them in Flower's layout with the logger's name; Flower's own
records (they propagate to the root too) are left to Flower's handler, so no line is written twice.
"""

from __future__ import annotations

import logging
import sys
from typing import TextIO

FLOWER = "flwr"
# libraries that log routine INFO lines of their own (each HTTP request); a plug-in wants its lines, not theirs
QUIET = ("httpx", "httpcore", "urllib3", "filelock", "fsspec", "asyncio", "matplotlib", "PIL")


class RootLogHandler(logging.StreamHandler):
    """Writes non-Flower records to the process's current stdout (the stream Flower mirrors to the SuperLink)."""

    def __init__(self, stream: TextIO | None = None) -> None:
        super().__init__(stream)
        self.fixed = stream is not None
        self.setFormatter(logging.Formatter("[%(name)s] %(message)s"))
        self.addFilter(lambda r: r.name != FLOWER and not r.name.startswith(FLOWER + "."))

    def format(self, record: logging.LogRecord) -> str:
        """Flower's console layout (`INFO :      message`, uncoloured), the message led by the logger's name."""
        return f"{record.levelname} : {' ' * max(8 - len(record.levelname), 0)} {super().format(record)}"

    def emit(self, record: logging.LogRecord) -> None:
        if not self.fixed:  # sys.stdout as it is now: Flower (and pytest) may have replaced it
            self.stream = sys.stdout
        super().emit(record)


def route_python_logging(*, level: int = logging.INFO, stream: TextIO | None = None) -> RootLogHandler:
    """Install the root handler (once: calling again returns the one installed) and lower the root logger to
    `level`, keeping the chatty libraries at WARNING unless their level was set already."""
    root = logging.getLogger()
    for handler in root.handlers:
        if isinstance(handler, RootLogHandler):
            return handler
    handler = RootLogHandler(stream)
    handler.setLevel(level)
    root.addHandler(handler)
    if root.level == logging.NOTSET or root.level > level:
        root.setLevel(level)
    for name in QUIET:
        if logging.getLogger(name).level == logging.NOTSET:
            logging.getLogger(name).setLevel(logging.WARNING)
    return handler
