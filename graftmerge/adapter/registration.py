"""graftmerge's merge methods in mergekit: registered once, and ``run_merge`` wrapped once.

The import hook calls :func:`register_methods` when mergekit's registry module has run and
:func:`wrap_run_merge` when ``mergekit.merge`` has. Imported directly instead (this module's
own mergekit imports may run the registry first, while it is half-initialised, and the hook then
skips it), the lines at the bottom do the same with whatever mergekit has loaded.
"""

from __future__ import annotations

import sys
from types import ModuleType

from huggingface_hub import constants as hub_constants

from graftmerge.adapter import mergekit_compat
from graftmerge.hub.models import localize_models
from graftmerge.methods import data_aware, fisher, graft, regmean

METHODS = (graft.graft_merge_method, fisher.fisher_merge_method, regmean.regmean_merge_method)
ROUTES = {"graft": graft.run_merge, "fisher": data_aware.run_merge, "regmean": data_aware.run_merge}


def register_methods(registry_module: ModuleType | None = None) -> None:
    """Register graft, fisher and regmean with mergekit's registry (default: the one imported); a second call
    is a no-op."""
    registry_module = registry_module or sys.modules.get("mergekit.merge_methods.registry") or __import__(
        "mergekit.merge_methods.registry", fromlist=["register"])
    mergekit_compat.register(registry_module, METHODS)


def mergekit_view(merge_config):
    """``merge_config`` as mergekit is given it: cached Hub ids as their snapshot folders, for graftmerge's
    methods always (what they validated is what mergekit reads) and for mergekit's own offline (where mergekit
    cannot resolve them; online it does, as always). GraftError for an id not cached, offline."""
    if merge_config.merge_method in ROUTES or hub_constants.is_offline_mode():
        return localize_models(merge_config)
    return merge_config


def wrap_run_merge(merge_module: ModuleType) -> None:
    """Route graft, fisher and regmean configs through graftmerge's checks first, every config with its cached
    Hub ids read from the cache (:func:`mergekit_view`); mergekit's card asks the Hub nothing about a folder."""
    mergekit_compat.wrap_run_merge(merge_module, ROUTES, view=mergekit_view)
    mergekit_compat.keep_local_folders_off_the_hub()


if "mergekit.merge_methods.registry" in sys.modules:
    register_methods(sys.modules["mergekit.merge_methods.registry"])
if "mergekit.merge" in sys.modules:
    wrap_run_merge(sys.modules["mergekit.merge"])
