"""Name -> class lookup for tasks and strategies: the built-ins, then installed plugins by entry point.

A package adds a task or a strategy without touching nebula-fl by declaring an entry point::

    [project.entry-points."nebula_fl.tasks"]
    sentiment = "my_package.task:SentimentTask"

    [project.entry-points."nebula_fl.strategies"]
    trimmed-mean = "my_package.strategy:TrimmedMean"

Plugins are imported only when their name is asked for. A plugin that fails to import or is the wrong kind of
class raises a ConfigError naming it and its package, with the fix. A built-in's name always means the built-in:
a plugin cannot replace one.
"""

from __future__ import annotations

import difflib
import importlib.metadata
import threading
from collections.abc import Callable

from nebula_fl.errors import ConfigError


class Plugins:
    """One entry-point group: ``get(name)`` gives the class, ``names()`` every name that can be asked for."""

    def __init__(self, *, group: str, kind: str, builtins: Callable[[], dict[str, type]],
                 check: Callable[..., type]) -> None:
        self.group, self.kind = group, kind
        self._builtins, self._check = builtins, check
        self._lock = threading.RLock()
        self._loaded: dict[tuple[str, str], type] = {}

    def _entry_points(self) -> dict[str, list[importlib.metadata.EntryPoint]]:
        found: dict[str, list[importlib.metadata.EntryPoint]] = {}
        for ep in importlib.metadata.entry_points(group=self.group):
            if all(other.value != ep.value for other in found.get(ep.name, [])):
                found.setdefault(ep.name, []).append(ep)
        return found

    def names(self) -> list[str]:
        return sorted({*self._builtins(), *self._entry_points()})

    def get(self, name: str) -> type:
        builtin = self._builtins().get(name)
        if builtin is not None:
            return builtin
        eps = self._entry_points().get(name)
        if not eps:
            close = difflib.get_close_matches(name, self.names(), n=1)
            hint = f"did you mean '{close[0]}'? " if close else ""
            raise ConfigError(f"unknown {self.kind} '{name}'; {hint}known: {', '.join(self.names())} (a plugin "
                              f"package declares entry points in the group '{self.group}')")
        if len(eps) > 1:
            raise ConfigError(f"{self.kind} '{name}' is declared by {len(eps)} installed packages "
                              f"({', '.join(self._describe(ep) for ep in eps)}); uninstall all but one")
        return self._load(eps[0])

    def _describe(self, ep: importlib.metadata.EntryPoint) -> str:
        dist = getattr(ep, "dist", None)
        package = f"{dist.name} {dist.version}" if dist is not None else "an unknown package"
        return f"{self.kind} plugin '{ep.name}' ({ep.value} from {package})"

    def _load(self, ep: importlib.metadata.EntryPoint) -> type:
        key = (ep.name, ep.value)
        with self._lock:
            if key not in self._loaded:
                where = self._describe(ep)
                try:
                    cls = ep.load()
                except Exception as exc:
                    raise ConfigError(f"{where} failed to load ({type(exc).__name__}: {exc}); "
                                      "fix or uninstall that package") from exc
                try:
                    self._loaded[key] = self._check(cls, name=ep.name, where=where)
                except ValueError as err:
                    raise ConfigError(str(err)) from None
            return self._loaded[key]
