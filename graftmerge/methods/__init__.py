"""graftmerge's merge methods as mergekit sees them: one module per method (graft, fisher, regmean).

Registered with mergekit, and ``run_merge`` wrapped, in one place: :mod:`graftmerge.adapter.registration`.
mergekit's registry is imported first, before any module of this package: the import hook then
registers the methods (importing them whole) while no module here is half-initialised.
"""

import mergekit.merge_methods  # noqa: F401 - first, for the reason above
