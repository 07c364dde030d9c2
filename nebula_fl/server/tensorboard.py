"""Per-round scalars of a run as TensorBoard event files, because curves read better than metrics.jsonl.

The server hands every metrics.jsonl round line to :class:`TensorBoardLog`, which writes each numeric
value with ``global_step`` = the round number, under a tag grouped by what it measures:

- ``eval/`` accuracy, macro_f1, loss on the held-out split; ``train/`` loss, update_norm, clusters_aggregated,
  clusters_usable;
- ``bytes/`` up, down, cumulative(_up/_down) and, under ``--wan``, wan_up, wan_down, wan_requests, wan_cumulative;
- ``time/`` round_seconds, elapsed_seconds; any other numeric top-level field lands under ``round/``;
- ``cluster_<id>/<key>`` each cluster's numeric fields (bytes, seconds, losses, steps, ...);
- ``strategy/<key>`` what the strategy recorded for the round, and ``strategy/<key>/cluster_<id>`` what it
  recorded per cluster (one chart per key, a curve per cluster); here a bool (``kept``) is drawn as 0 or 1;
- ``privacy/``, ``secagg/``, ``timeline/`` the numeric leaves of those objects, with per-cluster ones under
  ``timeline/cluster_<id>/<key>`` (and likewise for any nested ``clusters`` object): among them each cluster's
  ``busy_fraction`` and ``idle_s`` and the round's ``timeline/busy_fraction_min`` and ``timeline/idle_s_max``.

Elsewhere booleans, None, strings and identifiers (``*_id``, wall-clock ``*_at`` stamps) are not curves and are
skipped, so a round without evaluation or privacy writes what it has. Each write is flushed: a run that crashes keeps
every round it logged.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from torch.utils.tensorboard import SummaryWriter

from nebula_fl.errors import NebulaError

STRATEGY = "strategy"  # a round line's and each cluster's object of what the strategy recorded
# Top-level fields of a round line and their tags; other numeric top-level fields go under "round/".
TOP_LEVEL_TAGS = {
    "accuracy": "eval/accuracy",
    "macro_f1": "eval/macro_f1",
    "loss": "eval/loss",
    "train_loss": "train/loss",
    "update_norm": "train/update_norm",
    "clusters_aggregated": "train/clusters_aggregated",
    "clusters_usable": "train/clusters_usable",
    "bytes_up": "bytes/up",
    "bytes_down": "bytes/down",
    "cumulative_bytes_up": "bytes/cumulative_up",
    "cumulative_bytes_down": "bytes/cumulative_down",
    "cumulative_bytes": "bytes/cumulative",
    "wan_bytes_up": "bytes/wan_up",
    "wan_bytes_down": "bytes/wan_down",
    "wan_requests": "bytes/wan_requests",
    "cumulative_wan_bytes": "bytes/wan_cumulative",
    "seconds": "time/round_seconds",
    "elapsed_seconds": "time/elapsed_seconds",
}


def is_curve(key: str, value: Any) -> bool:
    """A value worth a curve: a real number (not a bool) under a key that is not an id or a timestamp."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    return not (key.endswith("_id") or key.endswith("_at"))


def scalars(line: Mapping[str, Any]) -> Iterator[tuple[str, float]]:
    """The (tag, value) pairs of one round line, in the grouping the module docstring describes."""
    for key, value in line.items():
        if key == "round":
            continue
        if key == STRATEGY and isinstance(value, Mapping):
            yield from _strategy(value, suffix="")
        elif key == "clusters" and isinstance(value, Mapping):
            for cid, fields in value.items():
                if isinstance(fields, Mapping):
                    yield from _leaves(f"cluster_{cid}", {k: v for k, v in fields.items() if k != STRATEGY})
                    if isinstance(fields.get(STRATEGY), Mapping):
                        yield from _strategy(fields[STRATEGY], suffix=f"/cluster_{cid}")
        elif isinstance(value, Mapping):
            yield from _leaves("", {key: value})
        elif is_curve(key, value):
            yield TOP_LEVEL_TAGS.get(key, f"round/{key}"), float(value)


def _strategy(records: Mapping[str, Any], *, suffix: str) -> Iterator[tuple[str, float]]:
    """A strategy's records (strategies/records.py): numbers, and bools as 0/1 (kept or not is a curve)."""
    for key, value in records.items():
        if isinstance(value, bool) or is_curve(str(key), value):
            yield f"{STRATEGY}/{key}{suffix}", float(value)


def _leaves(prefix: str, tree: Mapping[str, Any]) -> Iterator[tuple[str, float]]:
    """Numeric leaves of a nested object; each entry of a ``clusters`` object becomes ``cluster_<id>``."""
    for key, value in tree.items():
        key = str(key)
        if isinstance(value, Mapping):
            if key == "clusters":
                for cid, fields in value.items():
                    if isinstance(fields, Mapping):
                        yield from _leaves(_join(prefix, f"cluster_{cid}"), fields)
            else:
                yield from _leaves(_join(prefix, key), value)
        elif is_curve(key, value):
            yield _join(prefix, key), float(value)


def _join(prefix: str, key: str) -> str:
    return f"{prefix}/{key}" if prefix else key


class TensorBoardLog:
    """Writes round lines as TensorBoard scalars under ``folder`` (the run folder's ``tensorboard``)."""

    def __init__(self, *, folder: Path) -> None:
        folder = Path(folder)
        if folder.exists() and not folder.is_dir():
            raise NebulaError(f"TensorBoard folder {folder} is a file; remove it or choose another run folder")
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise NebulaError(f"cannot create TensorBoard folder {folder}: {err.strerror}; "
                              "check that the run folder is writable") from err
        self.folder = folder
        self._writer: SummaryWriter | None = SummaryWriter(log_dir=str(folder))

    def write(self, line: dict[str, Any]) -> None:
        """Write one metrics.jsonl round line at step ``line["round"]`` and flush it to disk."""
        if self._writer is None:
            raise RuntimeError(f"TensorBoardLog for {self.folder} is closed")
        step = line.get("round") if isinstance(line, Mapping) else None
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"a round line needs a non-negative integer 'round', got {step!r}")
        for tag, value in scalars(line):
            self._writer.add_scalar(tag, value, global_step=step)
        self._writer.flush()

    def close(self) -> None:
        """Flush and close the event file; closing twice is harmless."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def __repr__(self) -> str:
        return f"TensorBoardLog(folder={str(self.folder)!r}, closed={self._writer is None})"
