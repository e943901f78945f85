"""Fisher caches with random values for tests: diagonal, mixed KFAC/diagonal, and sharded
(a tiny model's cache spread over many files, as pushed to the Hub)."""

from __future__ import annotations

from pathlib import Path

import torch

from graftmerge.formats.checkpoint import Checkpoint
from graftmerge.formats.fisher_cache import FisherCacheWriter


def write_diagonal_cache(path: Path, post: Path, seed: int = 0, transform=None) -> Path:
    """A diagonal Fisher cache with random non-negative entries for every post tensor."""
    generator = torch.Generator().manual_seed(seed)
    checkpoint = Checkpoint(post)
    with FisherCacheWriter(path, model=post, overwrite=True) as writer:
        for name, info in checkpoint.tensors.items():
            values = torch.rand(info.shape, generator=generator)
            writer.add_diagonal(name, transform(name, values) if transform else values)
    return path


def spd(n: int, generator: torch.Generator, dtype=torch.float64) -> torch.Tensor:
    """A well-conditioned random symmetric positive definite matrix."""
    a = torch.randn(n, n, generator=generator, dtype=dtype)
    return a @ a.T / n + 0.05 * torch.eye(n, dtype=dtype)


def write_mixed_cache(path: Path, post: Path, seed: int = 0) -> Path:
    """KFAC (random SPD factors) for attention/MLP weights and the embedding, diagonal for the rest."""
    g = torch.Generator().manual_seed(seed)
    checkpoint = Checkpoint(post)
    shared: dict[int, torch.Tensor] = {}
    with FisherCacheWriter(path, model=post, overwrite=True) as writer:
        for name, info in sorted(checkpoint.tensors.items()):
            if len(info.shape) == 2 and "proj" in name:
                Q = shared.setdefault(info.shape[1], spd(info.shape[1], g))
                writer.add_kfac(name, P=spd(info.shape[0], g) / 10, Q=Q)
            elif name == "model.embed_tokens.weight":  # one-hot rows: a diagonal side (U = I)
                writer.add_kfac(
                    name, P=torch.rand(info.shape[0], generator=g, dtype=torch.float64), Q=spd(info.shape[1], g)
                )
            else:
                writer.add_diagonal(name, torch.rand(info.shape, generator=g) ** 2)
    return path


SHARD_BYTES = 40_000  # tiny shards: a tiny model's cache spans many files


def write_sharded_cache(path: Path, post: Path, seed: int = 0, only=None, source: str | None = None) -> Path:
    """KFAC for attention/MLP weights (input factors shared by size, so q/k/v share one), diagonal else.

    ``only``: keep just the weights it accepts, with the same values (a cache "holding only
    those weights"); small shards so the cache spans many files.
    """
    g = torch.Generator().manual_seed(seed)
    shared: dict[int, torch.Tensor] = {}
    estimator = {"kind": "both", "data": {"token_sha256": "ab" * 32, "rollouts_file_sha256": "cd" * 32},
                 "batch_size": 4, "modules": ["*"]}
    with FisherCacheWriter(path, model=post, source=source, estimator=estimator, max_shard_bytes=SHARD_BYTES,
                           counts={"sequences": 16, "tokens": 2736, "completion_tokens": 2048}, overwrite=True) as w:
        for name, info in sorted(Checkpoint(post).tensors.items()):
            if len(info.shape) == 2 and "proj" in name:
                Q = shared.setdefault(info.shape[1], spd(info.shape[1], g))
                P = spd(info.shape[0], g) / 10
                if only is None or only(name):
                    w.add_kfac(name, P=P, Q=Q)
            else:
                values = torch.rand(info.shape, generator=g) ** 2
                if only is None or only(name):
                    w.add_diagonal(name, values)
    return path
