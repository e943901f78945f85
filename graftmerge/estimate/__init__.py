"""Estimate a post model's retention Fisher (diagonal and KFAC) from its own rollouts.

Math lives in :mod:`retention_loss`, :mod:`per_sequence_gradients` and
:mod:`kfac_factors` (pure tensor functions); :mod:`accumulator` hooks a model and
sums them over batches; :mod:`run` does IO, torchrun sharding and checkpoints.
Imports are lazy so ``graftmerge fisher --help`` stays fast.
"""

from __future__ import annotations

from typing import Any

__all__ = ["EstimateSettings", "FisherAccumulator", "estimate_fisher"]


def __getattr__(name: str) -> Any:
    if name == "FisherAccumulator":
        from graftmerge.estimate.accumulator import FisherAccumulator

        return FisherAccumulator
    if name in ("EstimateSettings", "estimate_fisher"):
        from graftmerge.estimate import run

        return getattr(run, name)
    raise AttributeError(name)
