"""Estimate a post model's retention Fisher (diagonal and KFAC) from its own rollouts.

Math lives in :mod:`retention_loss`, :mod:`per_sequence_gradients` and
:mod:`kfac_factors` (pure tensor functions); :mod:`accumulator` hooks a model and
sums them over batches; :mod:`run` does IO, torchrun sharding and checkpoints and
writes the cache through :mod:`graftmerge.formats.fisher_cache`.
With ``--fsdp``, :mod:`sharded_run` shards the model (:mod:`sharded_loading`), the sums
(:mod:`sharded_accumulator`) and the writing (:mod:`sharded_writer`) over torchrun ranks;
:mod:`memory_plan` is ``--dry-run``.
May import: ``math``, ``formats``, ``hub`` (never ``pipeline``, its sibling).
"""
