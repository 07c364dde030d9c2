"""Tasks: what a federation trains. Built-ins, one per file; more come from the entry-point group
``nebula_fl.tasks`` (see ``nebula_fl/plugins.py``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from nebula_fl.plugins import Plugins
from nebula_fl.tasks.base import Examples, Task, TaskSetup, check_task_class


def _builtins() -> dict[str, type[Task]]:
    from nebula_fl.tasks.causal_lm import CausalLMTask
    from nebula_fl.tasks.classify import ClassifyTask
    from nebula_fl.tasks.distill import DistillTask
    from nebula_fl.tasks.mlm import MLMTask

    return {cls.name: cls for cls in (ClassifyTask, MLMTask, DistillTask, CausalLMTask)}


TASKS = Plugins(group="nebula_fl.tasks", kind="task", builtins=_builtins, check=check_task_class)


def task_class(name: str) -> type[Task]:
    return TASKS.get(name)


def make_task(name: str, options: Mapping[str, Any] | None = None) -> Task:
    """The task `name` with its ``task.*`` options (keys as in the run config)."""
    return task_class(name)(options=options)


__all__ = ["TASKS", "Examples", "Task", "TaskSetup", "make_task", "task_class"]
