"""The reference pages, generated from the code at every build (never written twice): every run-config key from
the config dataclasses and the built-in tasks' options (type, default, docstring with its bound), every command
and flag from the CLI's argument parsers, and the plug-in entry points with the task contract from their classes.

MkDocs calls ``on_files``; the tests call ``undocumented()`` so a key or flag without a docstring fails the suite.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import textwrap
import typing
from typing import Any

PAGES = {"reference/config.md": "config_page", "reference/cli.md": "cli_page", "reference/plugins.md": "plugins_page"}


# -- the config ------------------------------------------------------------------------------------------
def field_docs(cls: type) -> dict[str, str]:
    """A dataclass's attribute docstrings (the string right after each field), read from its source."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs = {}
    for node, following in zip(body, [*body[1:], None], strict=True):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(following, ast.Expr)
                and isinstance(following.value, ast.Constant) and isinstance(following.value.value, str)):
            docs[node.target.id] = " ".join(following.value.value.split())
    return docs


def section_rows(cls: type) -> list[dict[str, str]]:
    """One row per run-config key of a config Section: key, type, default, doc."""
    from nebula_fl.config import AUTO

    docs, hints = field_docs(cls), typing.get_type_hints(cls)
    rows = []
    for key, name in cls.flat_keys().items():  # type: ignore[attr-defined]
        field = next(f for f in dataclasses.fields(cls) if f.name == name)
        default = field.default if field.default is not dataclasses.MISSING else field.default_factory()  # type: ignore[misc]
        shown = AUTO if default is None else default
        kind = str(hints[name]).replace("typing.", "").replace("<class '", "").replace("'>", "")
        rows.append({"key": key, "type": kind.replace(" | None", ' or "auto"'), "default": repr(shown)
                     if isinstance(shown, str) else str(shown).lower() if isinstance(shown, bool) else str(shown),
                     "doc": docs.get(name, "")})
    return rows


def config_sections() -> list[tuple[str, type]]:
    from nebula_fl.config import RunConfig
    from nebula_fl.tasks import TASKS

    sections = [(f"[{name}]", cls) for name, cls in RunConfig.sections().items()]
    builtins = TASKS._builtins()
    return sections + [(f"task '{name}'", task.Options) for name, task in sorted(builtins.items())
                       if task.Options.flat_keys()]


def _table(rows: list[dict[str, str]]) -> list[str]:
    out = ["| key | type | default | what it is, and its bound |", "|---|---|---|---|"]
    for r in rows:
        doc = r["doc"].replace("|", "\\|")
        out.append(f"| `{r['key']}` | {r['type']} | `{r['default']}` | {doc} |")
    return out


def config_page() -> str:
    from nebula_fl.config import TASK_DEFAULTS
    from nebula_fl.tasks import TASKS

    lines = ["# Run-config keys", "",
             "Every key of `[tool.flwr.app.config]` (and of `--run-config`), generated from the dataclasses in "
             "`nebula_fl/config.py` and the built-in tasks' `Options`: its type, its default (`\"auto\"`: derived, "
             "as the docstring says) and its docstring, which states its bound. A value outside its bound stops a "
             "run before anything starts, with one line naming the key.", ""]
    for title, cls in config_sections():
        lines += [f"## {title}", "", " ".join((cls.__doc__ or "").split()), "", *_table(section_rows(cls)), ""]
    from nebula_fl.config import PRESETS

    lines += ["## Presets", "", "`--preset NAME` sets these keys before the flags and `--run-config` (which win); a "
              "task's own preset of the same name is merged over the generic one.", "",
              "| preset | task | keys |", "|---|---|---|"]
    for name, values in sorted(PRESETS.items()):
        lines.append(f"| `{name}` | every task | {_keys(values) or '(the defaults)'} |")
    for task_name, task in sorted(TASKS._builtins().items()):
        for name, values in sorted(task.presets.items()):
            lines.append(f"| `{name}` | `{task_name}` | {_keys(values)} |")
    lines += ["", "## What \"auto\" means per task", "",
              f"The keys {', '.join(f'`{k}`' for k in TASK_DEFAULTS)} take each task's own value when \"auto\" "
              "(`Task.defaults`); a run's `config.json` records the numbers.", "",
              "| task | " + " | ".join(TASK_DEFAULTS) + " |", "|---|" + "---|" * len(TASK_DEFAULTS)]
    for name, task in sorted(TASKS._builtins().items()):
        values = task.run_defaults()
        lines.append(f"| `{name}` | " + " | ".join(f"`{values[k]}`" for k in TASK_DEFAULTS) + " |")
    return "\n".join(lines) + "\n"


def _keys(values: dict[str, Any]) -> str:
    return ", ".join(f"`{k}={v}`" for k, v in values.items())


# -- the CLI ---------------------------------------------------------------------------------------------
def commands() -> dict[str, argparse.ArgumentParser]:
    from nebula_fl.cli import parser

    top = parser()
    sub = next(a for a in top._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def flag_rows(command: argparse.ArgumentParser) -> list[dict[str, str]]:
    rows = []
    for action in command._actions:
        if isinstance(action, argparse._HelpAction) or action.help == argparse.SUPPRESS:
            continue
        name = ", ".join(action.option_strings) or action.dest
        takes = "" if action.nargs == 0 else (action.metavar or action.dest.upper())
        default = "" if action.default in (None, False, argparse.SUPPRESS) else str(action.default)
        rows.append({"flag": name, "takes": str(takes), "default": default, "help": " ".join((action.help or "").split())})
    return rows


def cli_page() -> str:
    lines = ["# Commands and flags", "",
             "Every `nebula-fl` command and flag, generated from the argument parsers in `nebula_fl/cli.py` "
             "(`nebula-fl COMMAND --help` prints the same).", ""]
    for name, command in commands().items():
        lines += [f"## `nebula-fl {name}`", "", " ".join((command.description or "").split()), "",
                  "| flag | takes | default | what it does |", "|---|---|---|---|"]
        for r in flag_rows(command):
            lines.append(f"| `{r['flag']}` | {r['takes']} | {r['default']} | {r['help'].replace('|', chr(92) + '|')} |")
        lines.append("")
    return "\n".join(lines) + "\n"


# -- plug-ins --------------------------------------------------------------------------------------------
def contract() -> list[tuple[str, str, str]]:
    """(member, signature or value, docstring) of the Task contract: class attributes, then methods."""
    from nebula_fl.tasks import Task

    out = []
    docs = class_attribute_docs(Task)
    for name, doc in docs.items():
        value = getattr(Task, name, None)
        out.append((name, "" if value is None else repr(value), doc))
    for name, member in inspect.getmembers(Task, inspect.isfunction):
        if name.startswith("_") and name != "__init__":
            continue
        abstract = " (abstract: a task must define it)" if getattr(member, "__isabstractmethod__", False) else ""
        out.append((name, f"{name}{inspect.signature(member)}", " ".join((member.__doc__ or "").split()) + abstract))
    return out


def class_attribute_docs(cls: type) -> dict[str, str]:
    """A class's ClassVar docstrings (the string right after each annotated attribute)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs = {}
    for node, following in zip(body, [*body[1:], None], strict=True):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            text = following.value.value if (isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant)
                                             and isinstance(following.value.value, str)) else ""
            docs[node.target.id] = " ".join(text.split())
    return docs


def plugins_page() -> str:
    from nebula_fl import plugins
    from nebula_fl.compression import Codec
    from nebula_fl.strategies import STRATEGIES
    from nebula_fl.strategies.adapter_strategy import AdapterStrategy
    from nebula_fl.tasks import TASKS

    lines = ["# Plug-ins and the task contract", "", " ".join((plugins.__doc__ or "").split()), "",
             "| entry-point group | what it adds | built-ins | base class |", "|---|---|---|---|",
             f"| `{TASKS.group}` | a task | {', '.join(f'`{n}`' for n in sorted(TASKS._builtins()))} | "
             "`nebula_fl.tasks.Task` |",
             f"| `{STRATEGIES.group}` | an outer optimizer | {', '.join(f'`{n}`' for n in sorted(STRATEGIES._builtins()))} "
             f"| `{AdapterStrategy.__module__}.{AdapterStrategy.__name__}` |",
             f"| `nebula_fl.codecs` | a codec | see Communication | `{Codec.__module__}.{Codec.__name__}` |", "",
             "## The task contract", "",
             "Generated from `nebula_fl.tasks.Task`: what a task declares (class attributes) and what it implements "
             "(methods). How to write one, and how to test it without a federation: Writing a task.", "",
             "| member | value or signature | what it is |", "|---|---|---|"]
    for name, signature, doc in contract():
        lines.append(f"| `{name}` | `{signature.replace('|', chr(92) + '|')}` | {doc.replace('|', chr(92) + '|')} |")
    return "\n".join(lines) + "\n"


# -- checks and the hook ---------------------------------------------------------------------------------
def undocumented() -> list[str]:
    """Every config key and CLI flag with no docstring or help: the suite fails on any."""
    missing = [f"config key {r['key']}" for _, cls in config_sections() for r in section_rows(cls) if not r["doc"]]
    missing += [f"nebula-fl {name} {r['flag']}" for name, command in commands().items() for r in flag_rows(command)
                if not r["help"]]
    missing += [f"Task.{name}" for name, _, doc in contract() if not doc]
    return missing


def on_files(files: Any, config: Any) -> Any:
    from mkdocs.structure.files import File

    for path, builder in PAGES.items():
        files.append(File.generated(config, path, content=globals()[builder]()))
    return files
