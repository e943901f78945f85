"""graft inside mergekit: the merge method and the import hook that registers it.

Kept import-free: ``graftmerge_hook.pth`` imports :mod:`import_hook` in every Python process.
"""
