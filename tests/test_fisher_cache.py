"""Fisher cache format v1: round trips, atomic writes, sharing, refusals."""

from __future__ import annotations

import json
import os
import stat

import pytest
import torch

from graftmerge.errors import GraftError
from graftmerge.formats.checkpoint import Checkpoint
from graftmerge.formats.fisher_cache import MANIFEST_NAME, FisherCacheWriter, open_fisher_cache

Q_PROJ = "model.layers.0.self_attn.q_proj.weight"
K_PROJ = "model.layers.0.self_attn.k_proj.weight"


def spd(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(n, n, generator=g, dtype=torch.float64)
    return a @ a.T + 0.1 * torch.eye(n, dtype=torch.float64)


def test_diagonal_round_trip_and_manifest(tmp_path, tied_models):
    post = Checkpoint(tied_models["post"])
    tensors = {n: torch.rand(i.shape) for n, i in post.tensors.items()}
    with FisherCacheWriter(tmp_path / "c", model=tied_models["post"], max_shard_bytes=20_000,
                           estimator={"kind": "diagonal"}, counts={"sequences": 3}) as writer:
        for name, tensor in tensors.items():
            writer.add_diagonal(name, tensor)
    cache = open_fisher_cache(tmp_path / "c")
    assert len(list((tmp_path / "c").glob("fisher-*.safetensors"))) > 1
    assert cache.kind == "diagonal" and cache.manifest["counts"] == {"sequences": 3}
    assert cache.manifest["model"]["tensors"] == post.fingerprint()
    for name, tensor in tensors.items():
        assert torch.equal(cache.diagonal(name), tensor)
    cache.check_fits(post)


def test_kfac_round_trip_shares_factors_and_reconstructs(tmp_path, tied_models):
    Q, P_q, P_k = spd(64, 0), spd(64, 1), spd(32, 2)
    with FisherCacheWriter(tmp_path / "c", model=tied_models["post"]) as writer:
        writer.add_kfac(Q_PROJ, P=P_q, Q=Q)
        writer.add_kfac(K_PROJ, P=P_k, Q=Q.clone())
        writer.add_diagonal(Q_PROJ, torch.ones(64, 64))
        writer.add_kfac("model.embed_tokens.weight", P=torch.rand(256, dtype=torch.float64), Q=spd(64, 3))
    cache = open_fisher_cache(tmp_path / "c")
    assert cache.kind == "mixed" and cache.representation(Q_PROJ) == "kfac"
    entries = cache.manifest["entries"]
    assert entries[Q_PROJ]["kfac"]["columns"] == entries[K_PROJ]["kfac"]["columns"]  # stored once
    f = cache.kfac(Q_PROJ)
    assert torch.allclose((f.U * f.S) @ f.U.T, P_q.float(), rtol=1e-4, atol=1e-3)
    assert torch.allclose((f.V * f.D) @ f.V.T, Q.float(), rtol=1e-4, atol=1e-3)
    embedding = cache.kfac("model.embed_tokens.weight")
    assert embedding.U is None and embedding.S.shape == (256,) and embedding.V.shape == (64, 64)


def test_tiny_negative_eigenvalues_are_clamped_and_counted(tmp_path, tied_models):
    v = torch.linalg.qr(torch.randn(32, 32, dtype=torch.float64))[0]
    P = (v * torch.cat([torch.tensor([-1e-12]), torch.rand(31, dtype=torch.float64)])) @ v.T
    with FisherCacheWriter(tmp_path / "c", model=tied_models["post"]) as writer:
        writer.add_kfac(K_PROJ, P=P, Q=spd(64, 0))
    cache = open_fisher_cache(tmp_path / "c")
    assert cache.manifest["clamped_eigenvalues"] >= 1 and float(cache.kfac(K_PROJ).S.min()) >= 0


def test_interrupted_write_leaves_no_cache(tmp_path, tied_models):
    with pytest.raises(RuntimeError), FisherCacheWriter(tmp_path / "c", model=tied_models["post"]) as writer:
        writer.add_diagonal("model.norm.weight", torch.ones(64))
        raise RuntimeError("killed")
    assert not (tmp_path / "c").exists()
    assert list(tmp_path.iterdir()) == []


def test_manifest_is_written_last(tmp_path, tied_models, monkeypatch):
    writer = FisherCacheWriter(tmp_path / "c", model=tied_models["post"], max_shard_bytes=1)
    writer.add_diagonal("model.norm.weight", torch.ones(64))
    partial = next(tmp_path.glob(".c.partial-*")) / "c"  # the staging folder has the cache's own name
    assert list(partial.glob("fisher-*.safetensors")) and not (partial / MANIFEST_NAME).exists()
    with pytest.raises(GraftError, match="not a Fisher cache"):
        open_fisher_cache(partial)
    writer.close()
    assert (tmp_path / "c" / MANIFEST_NAME).exists() and not list(tmp_path.glob(".c.partial-*"))
    assert (tmp_path / "c").stat().st_mode & 0o755 == 0o755  # not mkdtemp's private 0700
    umask = os.umask(0)
    os.umask(umask)
    modes = {path.name: stat.S_IMODE(path.stat().st_mode) for path in (tmp_path / "c").iterdir()}
    assert modes == dict.fromkeys(modes, 0o666 & ~umask)  # shards as readable as the manifest (safetensors: 0600)


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda w: w.add_diagonal("nope", torch.ones(1)), "not a tensor of the post model"),
        (lambda w: w.add_diagonal("model.norm.weight", torch.ones(3)), "has shape"),
        (lambda w: w.add_diagonal("model.norm.weight", torch.full((64,), float("nan"))), "NaN"),
        (lambda w: w.add_diagonal("model.norm.weight", -torch.ones(64)), "negative"),
        (lambda w: w.add_kfac("model.norm.weight", P=torch.eye(64), Q=torch.eye(64)), "needs a 2-D weight"),
        (lambda w: w.add_kfac(K_PROJ, P=torch.eye(64), Q=torch.eye(64)), "row factor"),
        (lambda w: w.add_kfac(K_PROJ, P=-spd(32, 0), Q=torch.eye(64)), "below zero"),
        (lambda w: w.add_kfac(K_PROJ, P=torch.full((32, 32), float("inf")), Q=torch.eye(64)), "NaN or Inf"),
        (lambda w: w.add_kfac_eigen(K_PROJ, U=torch.ones(32, 32), S=torch.ones(32), V=None, D=torch.ones(64)),
         "not orthonormal"),
        (lambda w: w.add_kfac_eigen(K_PROJ, U=None, S=-torch.ones(32), V=None, D=torch.ones(64)), "below zero"),
    ],
)
def test_writer_refuses_bad_entries(tmp_path, tied_models, call, message):
    with (
        FisherCacheWriter(tmp_path / "c", model=tied_models["post"]) as writer,
        pytest.raises(GraftError, match=message),
    ):
        call(writer)


def test_existing_cache_is_not_overwritten_by_default(tmp_path, tied_models):
    with FisherCacheWriter(tmp_path / "c", model=tied_models["post"]) as writer:
        writer.add_diagonal("model.norm.weight", torch.ones(64))
    with pytest.raises(GraftError, match="already exists"):
        FisherCacheWriter(tmp_path / "c", model=tied_models["post"])


def test_unsupported_format_version_is_refused(tmp_path, tied_models):
    with FisherCacheWriter(tmp_path / "c", model=tied_models["post"]) as writer:
        writer.add_diagonal("model.norm.weight", torch.ones(64))
    manifest = json.loads((tmp_path / "c" / MANIFEST_NAME).read_text())
    manifest["format_version"] = 99
    (tmp_path / "c" / MANIFEST_NAME).write_text(json.dumps(manifest))
    with pytest.raises(GraftError, match="format version 99"):
        open_fisher_cache(tmp_path / "c")
