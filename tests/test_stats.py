"""The Chan merge (``merge.merge_stats``) against the statistics of the whole batch."""

from __future__ import annotations

import pytest
import torch
from merge import merge_stats

from encoding_syncbn.kernels import torch_ops
from encoding_syncbn.sync import stats

# Group sizes along dim 0, zeros included (an empty replica or rank).
SPLITS = [(3,), (1, 4), (2, 0, 5, 1), (0, 0, 6)]


def groups_of(x: torch.Tensor, split: tuple[int, ...]):
    pieces = torch.split(x, list(split))
    per_group = [torch_ops.channel_stats(piece) for piece in pieces]
    means = torch.stack([mean for mean, _, _ in per_group])
    m2s = torch.stack([m2 for _, m2, _ in per_group])
    return means, m2s, [count for _, _, count in per_group]


@pytest.mark.parametrize("split", SPLITS, ids=str)
@pytest.mark.parametrize("counts_as", ["ints", "tensor"])
def test_merge_gives_the_whole_batch_statistics(split, counts_as):
    x = torch.randn(sum(split), 3, 4, dtype=torch.float64) * 0.5 + 1e4
    means, m2s, counts = groups_of(x, split)
    given = counts if counts_as == "ints" else torch.tensor(counts, dtype=torch.float64)
    mean, m2, invstd = merge_stats(means, m2s, given, 1e-5)
    whole = x.transpose(0, 1).reshape(3, -1)
    torch.testing.assert_close(mean, whole.mean(1), rtol=1e-14, atol=0)
    torch.testing.assert_close(m2, whole.var(1, correction=0) * whole.shape[1],
                               rtol=1e-10, atol=0)
    torch.testing.assert_close(invstd, torch.rsqrt(whole.var(1, correction=0) + 1e-5),
                               rtol=1e-10, atol=0)


def test_all_counts_zero_merge_to_zeros():
    means, m2s = torch.zeros(2, 3), torch.zeros(2, 3)
    mean, m2, invstd = merge_stats(means, m2s, [0, 0], 1e-5)
    assert torch.equal(mean, torch.zeros(3)) and torch.equal(m2, torch.zeros(3))
    torch.testing.assert_close(invstd, torch.full((3,), 1e-5) ** -0.5)


def test_counts_given_as_ints_become_tensors_once():
    """Replicas' counts repeat from step to step: their tensors are built (on the GPU, a
    host-to-device copy that waits for the device) the first time only."""
    means, m2s = torch.randn(3, 4), torch.rand(3, 4)
    merge_stats(means, m2s, [5, 6, 7], 1e-5)
    built = stats._counts_from_ints.cache_info().misses
    for _ in range(3):
        merge_stats(means, m2s, [5, 6, 7], 1e-5)
    assert stats._counts_from_ints.cache_info().misses == built


def test_groups_as_separate_tensors_or_stacked_merge_alike():
    means, m2s = torch.randn(3, 4, dtype=torch.float64), torch.rand(3, 4, dtype=torch.float64)
    stacked = merge_stats(means, m2s, [2, 5, 1], 1e-5)
    separate = merge_stats(list(means), list(m2s), [2, 5, 1], 1e-5)
    for got, expected in zip(separate, stacked):
        torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_mismatched_or_no_groups_are_refused():
    with pytest.raises(ValueError, match="as many means, M2s and counts, got 3, 3 and 2"):
        merge_stats(torch.zeros(3, 4), torch.zeros(3, 4), [1, 2], 1e-5)
    with pytest.raises(ValueError, match="at least one group, got none"):
        merge_stats([], [], [], 1e-5)


def test_groups_m2_gradients_stay_apart_when_accumulated():
    """Every M2_i gets the same gradient tensor from the merge's backward: leaves that
    accumulate it over two backward passes must each own their ``.grad``."""
    means = [torch.randn(4, dtype=torch.float64, requires_grad=True) for _ in range(3)]
    m2s = [(torch.rand(4, dtype=torch.float64) + 1).requires_grad_() for _ in range(3)]
    grads = []
    for _ in range(2):
        _, m2, invstd = merge_stats(means, m2s, [2, 5, 1], 1e-5)
        (m2.sum() + invstd.sum()).backward()
        grads.append(m2s[0].grad.clone())
    torch.testing.assert_close(grads[1], 2 * grads[0], rtol=1e-14, atol=0)
    assert len({m2.grad.data_ptr() for m2 in m2s}) == len(m2s)
    for m2 in m2s[1:]:
        torch.testing.assert_close(m2.grad, grads[1], rtol=0, atol=0)
