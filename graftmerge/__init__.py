"""graftmerge: graft a donor's fine-tuning delta onto a post-trained model.

See ``SPEC``-level docs in README.md. Importing this package is cheap; the
mergekit adapter lives in :mod:`graftmerge.adapter.merge_method`.
"""

__version__ = "0.1.0"
