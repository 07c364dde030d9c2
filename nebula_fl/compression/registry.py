"""Codec names -> classes: the built-ins, ``register_codec`` from code, and installed plugins.

A package adds codecs without touching nebula-fl by declaring entry points in the group
``nebula_fl.codecs``; each loads a Codec subclass whose ``name`` equals the entry point's name::

    [project.entry-points."nebula_fl.codecs"]
    sign = "nebula_codec_sign:SignCodec"

Plugins are discovered lazily: a spec naming only built-ins never imports one. A plugin that fails
to import, is not a Codec, or reuses a taken name raises CodecError naming the plugin and its package.
"""

from __future__ import annotations

import importlib.metadata
import inspect
import threading

from nebula_fl.compression.codec import Codec
from nebula_fl.compression.errors import CodecError

GROUP = "nebula_fl.codecs"

_lock = threading.RLock()
_builtins: dict[str, type[Codec]] = {}
_registered: dict[str, type[Codec]] = {}
_scan: dict[str, list[importlib.metadata.EntryPoint]] | None = None
_loaded: dict[tuple[str, str], type[Codec]] = {}


def _builtin_table() -> dict[str, type[Codec]]:
    if not _builtins:
        from nebula_fl.compression.bf16 import BF16
        from nebula_fl.compression.fp16 import FP16
        from nebula_fl.compression.int4 import Int4
        from nebula_fl.compression.int8 import Int8
        from nebula_fl.compression.lowrank import LowRank
        from nebula_fl.compression.none import NoneCodec
        from nebula_fl.compression.randk import RandK
        from nebula_fl.compression.topk import TopK

        for cls in (NoneCodec, FP16, BF16, Int8, Int4, TopK, RandK, LowRank):
            _builtins[cls.name] = cls
    return _builtins


def _entry_points(*, refresh: bool = False) -> dict[str, list[importlib.metadata.EntryPoint]]:
    global _scan
    if _scan is None or refresh:
        found: dict[str, list[importlib.metadata.EntryPoint]] = {}
        seen = set()
        for ep in importlib.metadata.entry_points(group=GROUP):
            if (ep.name, ep.value) not in seen:
                seen.add((ep.name, ep.value))
                found.setdefault(ep.name, []).append(ep)
        _scan = found
    return _scan


def _describe(ep: importlib.metadata.EntryPoint) -> str:
    dist = getattr(ep, "dist", None)
    package = f"{dist.name} {dist.version}" if dist is not None else "an unknown package"
    return f"codec plugin '{ep.name}' ({ep.value} from {package})"


def _check_class(cls: object, *, name: str, where: str) -> type[Codec]:
    if not (isinstance(cls, type) and issubclass(cls, Codec)):
        raise CodecError(f"{where} is {cls!r}, not a subclass of nebula_fl.compression.Codec; fix the plugin")
    if inspect.isabstract(cls):
        missing = sorted(getattr(cls, "__abstractmethods__", ()))
        raise CodecError(f"{where} does not implement {missing}; fix the plugin")
    if cls.name != name:
        raise CodecError(f"{where} defines name = {cls.name!r}, but is registered as '{name}'; make them equal")
    if cls.role not in ("transform", "quantizer"):
        raise CodecError(f"{where} has role {cls.role!r}; use 'transform' or 'quantizer'")
    return cls


def _load(ep: importlib.metadata.EntryPoint) -> type[Codec]:
    key = (ep.name, ep.value)
    if key not in _loaded:
        try:
            cls = ep.load()
        except Exception as exc:
            raise CodecError(f"{_describe(ep)} failed to load ({type(exc).__name__}: {exc}); "
                             "fix or uninstall that package") from exc
        _loaded[key] = _check_class(cls, name=ep.name, where=_describe(ep))
    return _loaded[key]


def _plugin(name: str, eps: list[importlib.metadata.EntryPoint]) -> type[Codec]:
    if name in _builtin_table() or name in _registered:
        raise CodecError(f"{_describe(eps[0])} reuses the name of a {'built-in' if name in _builtins else 'registered'} "
                         "codec; rename its entry point or uninstall that package")
    if len(eps) > 1:
        raise CodecError(f"codec name '{name}' is claimed by several plugins: "
                         f"{', '.join(_describe(ep) for ep in eps)}; uninstall all but one")
    return _load(eps[0])


def get_codec(name: str, *, rescan: bool = True) -> type[Codec]:
    """The class registered under `name`; CodecError listing what is available when there is none.

    A name not seen yet triggers one new look for plugins installed since the last one, unless
    `rescan` is False (the decoder: a hostile blob must not make it walk the installed packages).
    """
    with _lock:
        eps = _entry_points().get(name)
        if eps is None and rescan and name not in _builtin_table() and name not in _registered:
            eps = _entry_points(refresh=True).get(name)
        if eps:
            return _plugin(name, eps)
        if name in _builtin_table():
            return _builtins[name]
        if name in _registered:
            return _registered[name]
        known = sorted({*_builtins, *_registered, *_entry_points()})
        raise CodecError(f"unknown codec '{name}'; available: {', '.join(known)} "
                         f"(plugins add more through the '{GROUP}' entry-point group)")


def register_codec(name: str, cls: type[Codec]) -> None:
    """Make `cls` available as `name` in specs, from code (tests, private codecs)."""
    with _lock:
        where = f"codec class {getattr(cls, '__qualname__', cls)!r}"
        if name in _builtin_table() or name in _registered or name in _entry_points():
            raise CodecError(f"codec name '{name}' is already taken; register {where} under another name")
        _registered[name] = _check_class(cls, name=name, where=where)


def unregister_codec(name: str) -> None:
    """Forget a codec added with register_codec (built-ins and plugins stay)."""
    with _lock:
        if name not in _registered:
            raise CodecError(f"codec '{name}' was not added with register_codec")
        del _registered[name]


def refresh_plugins() -> None:
    """Look for installed plugins again (after installing or removing one in a running process)."""
    with _lock:
        global _scan
        _scan = None
        _loaded.clear()


def available_codecs() -> tuple[str, ...]:
    """Every usable codec name, sorted: built-ins, registered ones and installed plugins (not imported)."""
    with _lock:
        plugins = _entry_points(refresh=True)
        for name, eps in plugins.items():
            if name in _builtin_table() or name in _registered or len(eps) > 1:
                _plugin(name, eps)  # raises the duplicate error
        return tuple(sorted({*_builtin_table(), *_registered, *plugins}))
