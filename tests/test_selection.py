"""Exact top-k selection and the streaming global threshold against brute force."""

from __future__ import annotations

import pytest
import torch

import graftmerge.math.global_threshold as gt
from graftmerge.math.global_threshold import ThresholdSearch
from graftmerge.math.selection import mask_from_threshold, masked_count, top_k_mask
from tests.helpers.references import brute_force_mask, continuous_scores, tied_scores


def streaming_mask(scores: dict[str, torch.Tensor], k: int, spill_limit: int = 1 << 26) -> dict[str, torch.Tensor]:
    total = sum(s.numel() for s in scores.values())
    search = ThresholdSearch(k=k, total=total, spill_limit=spill_limit)
    for name, s in scores.items():
        for block in torch.split(s.clone(), 3):  # row blocks, like huge tensors in the pre-pass
            search.add_coarse(name, block)
    for name in search.fine_pass_names():
        for block in torch.split(scores[name].clone(), 3):
            search.add_fine(name, block)
    result = search.result()
    return {n: mask_from_threshold(s, result.threshold, result.tie_quota.get(n, 0)) for n, s in scores.items()}


@pytest.mark.parametrize("spill_limit", [1 << 26, 40, 0], ids=["kept", "partly-rescored", "all-rescored"])
@pytest.mark.parametrize("make", [tied_scores, continuous_scores])
@pytest.mark.parametrize("seed", [0, 1])
def test_global_threshold_equals_brute_force(make, seed, spill_limit):
    scores = make(seed)
    total = sum(s.numel() for s in scores.values())
    for k in [0, 1, 2, 5, total // 10, total // 3, total // 2, total - 1, total]:
        got = streaming_mask(dict(sorted(scores.items())), k, spill_limit)
        expected = brute_force_mask([scores[n] for n in sorted(scores)], k)
        for name, want in zip(sorted(scores), expected):
            assert torch.equal(got[name], want), (name, k)


def test_streaming_path_with_tiny_chunks(monkeypatch):
    """Chunked bincounts give the same answer as whole tensors."""
    monkeypatch.setattr(gt, "_CHUNK", 5)
    scores = tied_scores(3)
    total = sum(s.numel() for s in scores.values())
    got = streaming_mask(scores, total // 4)
    expected = brute_force_mask([scores[n] for n in sorted(scores)], total // 4)
    for name, want in zip(sorted(scores), expected):
        assert torch.equal(got[name], want)


def test_kept_scores_spare_the_second_pass():
    scores = continuous_scores(0)
    total = sum(s.numel() for s in scores.values())
    search = ThresholdSearch(k=total // 50, total=total)
    for name, s in scores.items():
        search.add_coarse(name, s.clone())
    assert search.needs_fine_pass() and search.fine_pass_names() == []
    overflowing = ThresholdSearch(k=total // 50, total=total, spill_limit=0)
    for name, s in scores.items():
        overflowing.add_coarse(name, s.clone())
    assert overflowing.fine_pass_names()


def test_scores_in_one_coarse_bin_need_the_fine_pass():
    """All scores share exponent and top mantissa bits: only the fine pass separates them."""
    base = torch.tensor(1.0).view(torch.int32).item()
    bits = torch.arange(base, base + 1000, dtype=torch.int32)
    scores = {"x": bits.view(torch.float32)[torch.randperm(1000)]}
    got = streaming_mask(scores, 37)["x"]
    assert torch.equal(got, brute_force_mask([scores["x"]], 37)[0])
    assert int(got.sum()) == 37


def test_top_k_mask_equals_brute_force_with_ties():
    for seed in range(4):
        for s in tied_scores(seed).values():
            for k in range(0, s.numel() + 2):
                assert torch.equal(top_k_mask(s, k), brute_force_mask([s], k)[0]), k


def test_zero_scores_are_never_masked():
    s = torch.tensor([0.0, 0.0, 3.0, 0.0, 1.0])
    assert top_k_mask(s, 4).tolist() == [False, False, True, False, True]
    assert streaming_mask({"s": s}, 4)["s"].tolist() == [False, False, True, False, True]


def test_masked_count_reads_rho_as_a_decimal():
    assert masked_count(0.01, 300) == 3  # 0.01 * 300 == 3.0000000000000004 in floating point
    assert masked_count(0.01, 301) == 4
    assert masked_count(0.0, 10**9) == 0
    assert masked_count(0.1, 7) == 1
