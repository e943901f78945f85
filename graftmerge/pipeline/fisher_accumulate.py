"""``graftmerge fisher accumulate OLDER NEWER -o OUT --decay γ``: the online, EWC-style sum of two caches.

OUT = γ·OLDER + NEWER, diagonal by diagonal (:mod:`graftmerge.math.online_fisher`), streamed one
tensor at a time. OUT belongs to NEWER's model (its ``model`` record: the model the newer
Fisher was estimated on, the one a graft will start from); both caches must rank the same
weights with the same shapes. Only diagonal caches add up (a sum of Kronecker products is
not one), so a cache with KFAC entries is refused. ``graftmerge continual`` calls this at each
step when the stream asks for accumulation.
"""

from __future__ import annotations

from pathlib import Path

from tqdm import tqdm

from graftmerge.errors import GraftError
from graftmerge.formats.fisher_cache import FisherCache, FisherCacheWriter, open_fisher_cache
from graftmerge.formats.output_folder import check_not_inputs
from graftmerge.math.online_fisher import accumulate_diagonal, check_decay


def check_accumulate(older: str | Path, newer: str | Path, out: str | Path,
                     decay: float) -> tuple[FisherCache, FisherCache, float]:
    """Everything accumulate refuses, before any work: OUT an input, γ outside [0, 1], KFAC entries,
    caches ranking different weights or shapes, an existing OUT."""
    check_not_inputs(out, [("older Fisher cache", older), ("newer Fisher cache", newer)])
    try:
        decay = check_decay(decay)
    except ValueError as error:
        raise GraftError(f"--decay: {error}") from None
    caches = (open_fisher_cache(older), open_fisher_cache(newer))
    for cache in caches:
        if cache.names("kfac"):
            raise GraftError(f"Fisher cache {cache.path} has KFAC entries (kind {cache.kind}); only diagonal caches "
                             "accumulate (a sum of Kronecker products is not one): estimate with --kind diagonal")
    first, second = (set(cache.names("diagonal")) for cache in caches)
    if first != second:
        name = sorted(first ^ second)[0]
        raise GraftError(f"Fisher caches {older} and {newer} rank different weights ({name} is in only one); "
                         "accumulate caches of the same model's weights")
    for name in sorted(first):
        shapes = [list(cache.model_tensors[name]["shape"]) for cache in caches]
        if shapes[0] != shapes[1]:
            raise GraftError(f"weight {name} has shape {shapes[0]} in {older} and {shapes[1]} in {newer}; "
                             "accumulate caches of the same architecture")
    if Path(out).exists():
        raise GraftError(f"output {out} already exists; choose a new folder")
    return caches[0], caches[1], decay


def accumulate_caches(older: str | Path, newer: str | Path, out: str | Path, decay: float,
                      progress: bool = True) -> Path:
    """Write OUT = γ·``older`` + ``newer`` (atomically; module doc) and return its path."""
    previous, current, decay = check_accumulate(older, newer, out, decay)
    estimator = dict(current.manifest.get("estimator") or {})
    estimator["accumulated"] = {"rule": "decay * older + newer", "decay": decay,
                                "older": str(Path(older).resolve()), "newer": str(Path(newer).resolve()),
                                "older_estimator": previous.manifest.get("estimator")}
    with FisherCacheWriter(out, model=current.manifest["model"], estimator=estimator,
                           inputs=[("older Fisher cache", older), ("newer Fisher cache", newer)],
                           counts=dict(current.manifest.get("counts") or {})) as writer:
        for name in tqdm(current.names("diagonal"), desc="fisher accumulate", disable=not progress, unit="tensor"):
            writer.add_diagonal(name, accumulate_diagonal(previous.diagonal(name), current.diagonal(name), decay))
    return Path(out)
