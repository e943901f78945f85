"""Fast paths against the slow ones they replace, bit for bit.

- The threshold pass keeps each tensor's final mask (``ThresholdSearch.masked_positions``)
  and each KFAC weight's candidate pairs, so the merge right after it removes the mask
  without reading the Fisher cache or rotating Δ again: same bits as scoring again.
- An eigenbasis that passed the full orthonormality check is recorded by content digest in
  the user cache folder, so later reads skip the Gram; other bytes are still checked.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import graftmerge.formats.fisher_cache as fisher_cache
import graftmerge.pipeline.graft_kernel as graft_kernel
import graftmerge.pipeline.threshold_pass as threshold_pass
from graftmerge.errors import GraftError
from graftmerge.formats.checkpoint import read_safetensors_layout
from graftmerge.formats.fisher_cache import FisherCacheWriter, KfacFactors, open_fisher_cache
from graftmerge.math.global_threshold import ThresholdSearch, positions_at_or_above
from graftmerge.math.projection import (
    TensorFisher,
    candidate_pairs,
    remove_masked,
    remove_masked_coordinates,
    remove_masked_pairs,
    score_delta,
)
from graftmerge.math.scores import diagonal_scores
from graftmerge.math.selection import mask_from_threshold, top_k_mask
from tests.helpers.configs import graft_yaml
from tests.helpers.fisher_caches import spd, write_diagonal_cache, write_mixed_cache
from tests.helpers.models import read_model
from tests.helpers.references import brute_force_mask, continuous_scores, tied_scores
from tests.helpers.runners import run_cli

# -- the mask the search keeps ----------------------------------------------------------------


@pytest.mark.parametrize("spill_limit", [1 << 26, 80, 0], ids=["kept", "partly-kept", "none-kept"])
@pytest.mark.parametrize("make", [tied_scores, continuous_scores])
def test_kept_positions_are_the_brute_force_mask(make, spill_limit):
    scores = dict(sorted(make(0).items()))
    total = sum(s.numel() for s in scores.values())
    for k in [0, 1, 5, total // 10, total // 2, total - 1, total]:
        search = ThresholdSearch(k=k, total=total, spill_limit=spill_limit, keep_positions=True)
        candidates = {}
        for name, s in scores.items():
            for block in torch.split(s.clone(), 3):  # row blocks: positions continue across them
                search.add_coarse(name, block)
            candidates[name] = search.kept_positions(name)
        for name in search.fine_pass_names():
            for block in torch.split(scores[name].clone(), 3):
                search.add_fine(name, block)
        result = search.result()
        expected = brute_force_mask(list(scores.values()), k)
        for (name, s), want in zip(scores.items(), expected):
            got = search.masked_positions(name)
            slow = mask_from_threshold(s, result.threshold, result.tie_quota.get(name, 0))
            assert torch.equal(slow, want), (name, k)  # the threshold itself is still exact
            if got is None:
                assert spill_limit < 1 << 26  # only an overflowing search gives up a tensor
                continue
            assert torch.equal(got, torch.nonzero(want.reshape(-1)).squeeze(1)), (name, k)
            assert bool(torch.isin(got, candidates[name]).all())  # the mask is among the candidates


def test_the_first_chunk_sets_the_bound_before_anything_is_kept():
    """The first tensor is histogrammed whole before keeping: only its top scores are kept, not all."""
    scores = torch.rand(10_000, generator=torch.Generator().manual_seed(0))
    search = ThresholdSearch(k=100, total=20_000, keep_positions=True)
    search.add_coarse("a", scores)
    assert 100 <= search.kept_positions("a").numel() < 500


# -- removing a kept mask ------------------------------------------------------------------


def random_factors(rows: int, columns: int, seed: int, row_side: bool = True, column_side: bool = True):
    g = torch.Generator().manual_seed(seed)
    S, U = torch.linalg.eigh(spd(rows, g, torch.float32))
    D, V = torch.linalg.eigh(spd(columns, g, torch.float32))
    return KfacFactors(U=U if row_side else None, S=S.clamp_min(0), V=V if column_side else None, D=D.clamp_min(0))


@pytest.mark.parametrize("sides", [(True, True), (False, True), (True, False), (False, False)],
                         ids=["both", "diagonal-rows", "diagonal-columns", "identity"])
@pytest.mark.parametrize("share", [0.0, 0.01, 0.2, 1.0])
def test_removing_kept_pairs_equals_scoring_again(sides, share):
    factors = random_factors(24, 16, seed=1, row_side=sides[0], column_side=sides[1])
    fisher = TensorFisher(kfac=factors)
    delta = torch.randn(24, 16, generator=torch.Generator().manual_seed(2))
    scored = score_delta(delta.clone(), fisher)
    mask = top_k_mask(scored.scores, int(share * delta.numel()))
    flat = scored.scores.reshape(-1)
    # Candidates: every masked pair plus more (the pass keeps all scores above a lower bound).
    candidates = torch.nonzero(mask.reshape(-1) | (flat >= flat.median())).squeeze(1)
    pairs = candidate_pairs(scored.rotated, candidates, factors)
    fast = remove_masked_pairs(delta.clone(), pairs, torch.nonzero(mask.reshape(-1)).squeeze(1))
    slow = remove_masked(scored, mask, fisher)
    assert torch.equal(fast, slow)


def test_removing_kept_coordinates_equals_masked_fill():
    g = torch.Generator().manual_seed(3)
    delta = torch.randn(7, 5, generator=g)
    mask = torch.rand(7, 5, generator=g) < 0.3
    fast = remove_masked_coordinates(delta.clone(), torch.nonzero(mask.reshape(-1)).squeeze(1))
    assert torch.equal(fast, delta.masked_fill(mask, 0))
    assert torch.equal(remove_masked_coordinates(delta.clone(), torch.zeros(0, dtype=torch.int64)), delta)


# -- whole merges: the kept masks against a merge that scores again ---------------------------------


def count_calls(monkeypatch, module, name: str) -> list:
    calls = []
    original = getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a, **k: calls.append(1) or original(*a, **k))
    return calls


@pytest.mark.parametrize("cache_kind", ["diagonal", "mixed"])
@pytest.mark.parametrize("spill_limit", [None, 200], ids=["kept", "overflowing"])
def test_merge_with_kept_masks_equals_merge_from_cached_threshold(tmp_path, monkeypatch, tied_models, cache_kind,
                                                                   spill_limit):
    """A fresh pass (masks kept) and a cached threshold (everything scored again) give the same bits."""
    m = tied_models
    write = write_diagonal_cache if cache_kind == "diagonal" else write_mixed_cache
    fisher = write(tmp_path / "fisher", m["post"])
    if spill_limit is not None:  # some tensors overflow: their Δ̃ is kept whole, they are scored again
        monkeypatch.setattr(
            threshold_pass, "ThresholdSearch", functools.partial(ThresholdSearch, spill_limit=spill_limit)
        )
    config = tmp_path / "graft.yml"
    config.write_text(graft_yaml(m["post"], m["donor"], [(m["donor_ft"], 0.7), (m["donor_ft2"], 0.4)], rho=0.05,
                                 fisher=fisher, dtype="float32", out_dtype="float32"))
    env = {"GRAFTMERGE_CACHE_DIR": str(tmp_path / "cache")}
    fast = {
        name: count_calls(monkeypatch, graft_kernel, name)
        for name in ("remove_masked_coordinates", "remove_masked_pairs")
    }
    slow = count_calls(monkeypatch, graft_kernel, "remove_masked")
    assert run_cli("mergekit-yaml", str(config), str(tmp_path / "fresh"), env=env).returncode == 0
    used = {name: len(calls) for name, calls in fast.items()}
    assert used["remove_masked_coordinates"] > 0
    assert (used["remove_masked_pairs"] > 0) == (cache_kind == "mixed")
    rescored = len(slow)
    assert (rescored > 0) == (spill_limit is not None)  # overflowing tensors only
    for calls in (*fast.values(), slow):
        calls.clear()
    assert run_cli("mergekit-yaml", str(config), str(tmp_path / "cached"), env=env).returncode == 0  # cache hit
    assert not any(fast.values()) and slow  # no pass ran: every tensor scored again
    fresh, cached = read_model(tmp_path / "fresh"), read_model(tmp_path / "cached")
    assert fresh.keys() == cached.keys()
    for name in fresh:
        assert torch.equal(fresh[name].view(torch.int32), cached[name].view(torch.int32)), name


# -- the orthonormality record ------------------------------------------------------------------


def kfac_cache(path, post, seed: int = 0):
    return write_mixed_cache(path, post, seed=seed)


def test_a_basis_is_checked_in_full_once_per_machine(tmp_path, monkeypatch, tied_models):
    monkeypatch.setenv("GRAFTMERGE_CACHE_DIR", str(tmp_path / "user-cache"))
    cache = kfac_cache(tmp_path / "fisher", tied_models["post"])  # add_kfac: eigh output, not yet checked
    names = open_fisher_cache(cache).names("kfac")
    checks = count_calls(monkeypatch, fisher_cache, "check_orthonormal")
    for name in names:
        open_fisher_cache(cache).kfac(name)
    first = len(checks)
    assert first > 0
    checks.clear()
    for name in names:  # a new process: another FisherCache object, same user cache folder
        open_fisher_cache(cache).kfac(name)
    assert not checks
    monkeypatch.setenv("GRAFTMERGE_CACHE_DIR", str(tmp_path / "another-machine"))
    open_fisher_cache(cache).kfac(names[0])
    assert checks  # nothing recorded there: checked in full again


def test_the_record_vouches_for_those_bytes_only(tmp_path, monkeypatch, tied_models):
    monkeypatch.setenv("GRAFTMERGE_CACHE_DIR", str(tmp_path / "user-cache"))
    post = tied_models["post"]
    name = "model.layers.0.self_attn.o_proj.weight"
    shape = open_fisher_cache(kfac_cache(tmp_path / "probe", post)).model_tensors[name]["shape"]
    g = torch.Generator().manual_seed(0)
    basis = torch.linalg.qr(torch.randn(shape[0], shape[0], generator=g, dtype=torch.float64))[0]
    good = tmp_path / "good"
    with FisherCacheWriter(good, model=post) as writer:  # checked (and recorded) as written
        writer.add_kfac_eigen(name, U=basis, S=torch.ones(shape[0]), V=None, D=torch.ones(shape[1]))
    checks = count_calls(monkeypatch, fisher_cache, "check_orthonormal")
    open_fisher_cache(good).kfac(name)
    assert not checks  # the writer's check is recorded: the first read needs no Gram
    hostile = tmp_path / "hostile"
    with FisherCacheWriter(hostile, model=post) as writer:
        writer.add_kfac_eigen(name, U=basis, S=torch.ones(shape[0]), V=None, D=torch.ones(shape[1]))
    shard = next(hostile.glob("*.safetensors"))
    tensors = load_file(shard)
    key = next(k for k in tensors if k.endswith("eigenvectors"))
    tensors[key] = tensors[key] * 1.5  # same shape and dtype, not orthonormal
    save_file(tensors, str(shard), metadata={"format": "pt"})
    with pytest.raises(GraftError, match="not orthonormal"):
        open_fisher_cache(hostile).kfac(name)
    assert checks
    with pytest.raises(GraftError, match="not orthonormal"):  # and again: a failure is never recorded
        open_fisher_cache(hostile).kfac(name)
    square = basis.float()
    assert fisher_cache.orthonormal_digest(square) != fisher_cache.orthonormal_digest(square.T.contiguous())


def eigenvector_shard(cache: Path) -> tuple[str, str, Path]:
    """(a KFAC weight, the key of one of its sides' eigenvectors, the shard file holding them)."""
    opened = open_fisher_cache(cache)
    for name in opened.names("kfac"):
        for side in ("rows", "columns"):
            record = opened.kfac_side(name, side)
            if "eigenvectors" in record:
                return name, record["eigenvectors"], cache / opened.manifest["files"][record["eigenvectors"]]
    raise AssertionError("no eigenvectors in the cache")


def test_a_settled_shard_is_found_in_the_record_without_hashing(tmp_path, monkeypatch, tied_models):
    monkeypatch.setenv("GRAFTMERGE_CACHE_DIR", str(tmp_path / "user-cache"))
    cache = kfac_cache(tmp_path / "fisher", tied_models["post"])
    names = open_fisher_cache(cache).names("kfac")
    hashed, checked = (
        count_calls(monkeypatch, fisher_cache, name) for name in ("orthonormal_digest", "check_orthonormal")
    )
    for name in names:  # just written: named by content only
        open_fisher_cache(cache).kfac(name)
    assert hashed
    monkeypatch.setattr(fisher_cache, "SETTLED_SECONDS", 0.0)  # as if written long ago
    for name in names:  # hashed once more, now recorded by file identity too
        open_fisher_cache(cache).kfac(name)
    hashed.clear()
    checked.clear()
    for name in names:
        open_fisher_cache(cache).kfac(name)
    assert not hashed and not checked


def test_an_edit_in_place_with_its_mtime_put_back_is_checked_again(tmp_path, monkeypatch, tied_models):
    monkeypatch.setenv("GRAFTMERGE_CACHE_DIR", str(tmp_path / "user-cache"))
    monkeypatch.setattr(fisher_cache, "SETTLED_SECONDS", 0.0)
    cache = kfac_cache(tmp_path / "fisher", tied_models["post"])
    name, key, shard = eigenvector_shard(cache)
    open_fisher_cache(cache).kfac(name)  # passed: recorded by content and by file identity
    layout = read_safetensors_layout(shard)
    begin, end = layout.offsets[key]
    before = os.stat(shard)
    with open(shard, "r+b") as handle:  # same size, same shape: the first column scaled, no longer orthonormal
        handle.seek(layout.data_start + begin)
        vectors = torch.frombuffer(bytearray(handle.read(end - begin)), dtype=torch.float32).reshape(
            layout.tensors[key].shape
        )
        vectors[:, 0] *= 1.5
        handle.seek(layout.data_start + begin)
        handle.write(vectors.numpy().tobytes())
    os.utime(shard, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = os.stat(shard)
    assert after.st_mtime_ns == before.st_mtime_ns and after.st_size == before.st_size
    assert after.st_ctime_ns != before.st_ctime_ns  # the kernel's change time cannot be put back
    with pytest.raises(GraftError, match="not orthonormal"):
        open_fisher_cache(cache).kfac(name)


def test_identity_needs_an_unchanged_file_and_a_settled_change_time(tmp_path, monkeypatch):
    file = tmp_path / "shard"
    file.write_bytes(b"x")
    fresh = os.stat(file)
    assert fisher_cache.unchanged_file_identity(fresh, fresh, "k") is None  # changed just now
    monkeypatch.setattr(fisher_cache, "SETTLED_SECONDS", 0.0)
    named = fisher_cache.unchanged_file_identity(fresh, fresh, "k")
    assert named is not None and named != fisher_cache.unchanged_file_identity(fresh, fresh, "another key")
    file.write_bytes(b"y")
    assert fisher_cache.unchanged_file_identity(fresh, os.stat(file), "k") is None  # changed during the read


# -- the threshold pass's own fast paths ------------------------------------------------------


@pytest.mark.parametrize("size", [0, 5, 8, 1003, 4096])
@pytest.mark.parametrize("share", [0.0, 0.001, 0.05, 0.3, 1.0])
def test_positions_at_or_above_equals_nonzero(size, share):
    """Word-wise scan (8 flags per int64) == ``nonzero(bits >= lowest)``, sparse or dense, any tail."""
    g = torch.Generator().manual_seed(size)
    bits = torch.randint(-(1 << 31), (1 << 31) - 1, (size,), generator=g, dtype=torch.int64).to(torch.int32)
    lowest = int(torch.quantile(bits.double(), 1 - share)) if size and 0 < share < 1 else (
        -(1 << 31) if share == 1.0 else (1 << 31) - 1)
    assert torch.equal(positions_at_or_above(bits, lowest), torch.nonzero(bits >= lowest).squeeze(1))


def test_diagonal_scores_in_place_equal_a_fresh_buffer():
    g = torch.Generator().manual_seed(4)
    delta, fisher = torch.randn(33, 17, generator=g), torch.rand(33, 17, generator=g).to(torch.bfloat16)
    fresh = diagonal_scores(fisher, delta)
    buffer = delta.clone()
    assert torch.equal(diagonal_scores(fisher, buffer, in_place=True), fresh)
    assert torch.equal(buffer, fresh)  # Δ's own buffer holds the scores


def test_read_ahead_keeps_order_and_raises_for_its_item():
    assert list(threshold_pass.read_ahead([], lambda item: item)) == []
    assert list(threshold_pass.read_ahead([3, 1, 2], lambda item: item * item)) == [(3, 9), (1, 1), (2, 4)]

    def fail_on_two(item):
        if item == 2:
            raise GraftError(f"bad block {item}")
        return item

    seen = []
    with pytest.raises(GraftError, match="bad block 2"):
        for item, _ in threshold_pass.read_ahead([1, 2, 3], fail_on_two):
            seen.append(item)
    assert seen == [1]  # item 1 arrives; item 2's error is raised where it would be consumed
