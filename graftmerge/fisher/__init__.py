"""Fisher caches: the retention Fisher of a post-trained model, stored for grafting.

Format v1 is documented in ``fisher/README.md`` at the repository root.
"""

from graftmerge.fisher.cache import (
    FORMAT_VERSION,
    MANIFEST_NAME,
    FisherCache,
    FisherCacheWriter,
    KfacFactors,
    open_fisher_cache,
)

__all__ = [
    "FORMAT_VERSION",
    "MANIFEST_NAME",
    "FisherCache",
    "FisherCacheWriter",
    "KfacFactors",
    "open_fisher_cache",
]
