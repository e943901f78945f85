"""Estimate a post model's retention Fisher (diagonal and KFAC) from its own rollouts.

Math lives in :mod:`retention_loss`, :mod:`per_sequence_gradients` and
:mod:`kfac_factors` (pure tensor functions); :mod:`accumulator` hooks a model and
sums them over batches; :mod:`run` does IO, torchrun sharding and checkpoints and
writes the cache through :mod:`graftmerge.formats.fisher_cache`.
May import: ``math``, ``formats``, ``hub`` (never ``pipeline``, its sibling).
"""
