"""The ServerApp's last log line: how the run ended, for whoever reads its log stream (`nebula-fl submit`).

Flower's own run status says only completed or failed, and a run in which every cluster refused ends
``completed`` in Flower's eyes were the ServerApp not to fail it; the submitter is often on another host than the
run folder. So the ServerApp ends its log with one machine-readable line: status, rounds, the error, and where the
run folder is on the server host.
"""

from __future__ import annotations

import json
from typing import Any

PREFIX = "nebula-fl outcome: "


def outcome_line(*, status: str, rounds_completed: int, rounds_aggregated: int, error: str | None,
                 run_folder: str | None) -> str:
    return PREFIX + json.dumps({"status": status, "rounds_completed": rounds_completed,
                                "rounds_aggregated": rounds_aggregated, "error": error, "run_folder": run_folder},
                               sort_keys=True)


def parse_outcome(text: str) -> dict[str, Any] | None:
    """The outcome a log line carries (the line may hold a logger's prefix before it), or None."""
    at = text.find(PREFIX)
    if at < 0:
        return None
    try:
        found = json.loads(text[at + len(PREFIX):])
    except json.JSONDecodeError:
        return None
    return found if isinstance(found, dict) else None
