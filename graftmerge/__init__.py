"""graftmerge: graft a donor's fine-tuning delta onto a post-trained model.

What it computes: docs/math.md; the manual: docs/. Importing this package is cheap; the
mergekit adapter lives in :mod:`graftmerge.adapter.merge_method`.
"""

__version__ = "0.1.0"
