"""A task's ``examples()`` tried on the first few training records before a federation starts, so a bug in a task
(or data it cannot read) is one line at launch, not a failure of every cluster in every round."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from nebula_fl.errors import NebulaError
from nebula_fl.tasks.base import Task, TaskSetup

FIRST = 8


def try_examples(task: Task, *, setup: TaskSetup, texts: Sequence[str], labels: np.ndarray, count: int = FIRST) -> None:
    """Make the training examples of the first `count` records as a cluster would, or raise a NebulaError naming the
    task and what went wrong. Under per-example DP the rows must be the records (Opacus samples rows, the
    accounting counts records)."""
    texts, labels = list(texts[:count]), labels[:count]
    try:
        data = task.examples(setup=setup, tokenizer=task.tokenizer(setup), texts=texts, labels=labels, train=True)
        rows = len(data)
    except NebulaError:
        raise
    except Exception as err:  # a plug-in's bug, whatever it raises: one line naming the task, not a traceback
        raise NebulaError(f"task '{task.name}' could not make training examples of the first {len(texts)} records "
                          f"({type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else 'no message'}); "
                          "fix the task's examples() or the data") from None
    if setup.privacy_mode == "sample":
        check_rows(task, rows=rows, records=len(texts), whose="its first")


def check_rows(task: Task, *, rows: int, records: int, whose: str, error: type[NebulaError] = NebulaError) -> None:
    """Under per-example DP a task's examples are its records, one row each (Opacus samples rows, the accounting
    counts records): else `error`, naming the task and the counts (`whose`: "its first", "this cluster's")."""
    if rows != records:
        raise error(f"task '{task.name}' made {rows:,} rows of {whose} {records:,} records under per-example DP; its "
                    "examples() must return one row per record when setup.privacy_mode is 'sample' (the unit the "
                    "privacy accounting counts)")
