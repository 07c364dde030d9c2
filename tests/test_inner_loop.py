import itertools
import math

import numpy as np
import pytest
import torch

from nebula_fl.clients.inner_loop import BatchSchedule, scheduled_lr


def test_batch_schedule_resumes_exactly():
    a = BatchSchedule(10, batch_size=4, seed=1, rank=0)
    first = [a.next_indices() for _ in range(3)]
    b = BatchSchedule(10, batch_size=4, seed=1, rank=0)
    b.load_state_dict({**a.state_dict(), "step": 1})
    np.testing.assert_array_equal(b.next_indices(), first[1])
    # every example appears once per epoch: the first 8 positions of a 10-example epoch are distinct
    assert len(set(np.concatenate(first[:2]).tolist())) == 8


def test_batch_schedule_refuses_a_state_for_another_shard():
    a = BatchSchedule(10, batch_size=4, seed=1, rank=0)
    with pytest.raises(ValueError, match="'n'"):
        BatchSchedule(11, batch_size=4, seed=1, rank=0).load_state_dict(a.state_dict())


def test_ranks_draw_different_batches():
    a = BatchSchedule(100, batch_size=8, seed=1, rank=0).next_indices()
    b = BatchSchedule(100, batch_size=8, seed=1, rank=1).next_indices()
    assert not np.array_equal(a, b)


def test_cosine_schedule_endpoints_and_midpoint():
    assert scheduled_lr(1e-2, progress=0.0, schedule="cosine", min_ratio=0.1) == pytest.approx(1e-2)
    assert scheduled_lr(1e-2, progress=1.0, schedule="cosine", min_ratio=0.1) == pytest.approx(1e-3)
    assert scheduled_lr(1e-2, progress=0.5, schedule="cosine", min_ratio=0.0) == pytest.approx(5e-3)
    p = 0.3
    assert scheduled_lr(2.0, progress=p, schedule="cosine", min_ratio=0.25) == pytest.approx(
        2.0 * (0.25 + 0.75 * 0.5 * (1 + math.cos(math.pi * p)))
    )
    lrs = [scheduled_lr(1.0, progress=t / 10, schedule="cosine", min_ratio=0.1) for t in range(11)]
    assert all(x >= y for x, y in itertools.pairwise(lrs))


def test_constant_schedule_and_unknown_schedule():
    assert scheduled_lr(3e-3, progress=0.9, schedule="constant", min_ratio=0.1) == 3e-3
    with pytest.raises(ValueError):
        scheduled_lr(1.0, progress=0.5, schedule="linear", min_ratio=0.1)


def test_warm_up_then_cosine_matches_transformers_schedule():
    """The warmed rate against transformers' own cosine-with-minimum schedule (an independent implementation):
    equal after the warm-up, and during it one step ahead (ours never trains a step at rate 0)."""
    from transformers import get_cosine_with_min_lr_schedule_with_warmup

    from nebula_fl.clients.inner_loop import warmed_lr

    total, ratio, base, floor = 40, 0.1, 2e-4, 0.1
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([param], lr=base)
    reference = get_cosine_with_min_lr_schedule_with_warmup(optimizer, num_warmup_steps=4, num_training_steps=total,
                                                              min_lr_rate=floor)
    theirs = []
    for _ in range(total + 1):
        theirs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        reference.step()
    ours = [warmed_lr(base, step=s, total=total, warmup=ratio, schedule="cosine", min_ratio=floor) for s in range(total)]
    assert ours[:4] == pytest.approx(theirs[1:5])
    assert ours[4:] == pytest.approx(theirs[4:total])
    assert ours[0] == pytest.approx(base / 4) and max(ours) == pytest.approx(base)
    assert warmed_lr(base, step=0, total=total, warmup=0.0, schedule="cosine", min_ratio=floor) == pytest.approx(base)
