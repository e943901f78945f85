"""Every contact graftmerge has with mergekit's internals, in one place.

mergekit's public surface is its config, options, ``run_merge`` and merge-method base classes.
graftmerge also needs a few of its private functions and methods, patches ``run_merge`` and
fills its loader cache: all of that is named here and nowhere else, and
tests/test_mergekit_compat.py checks each against the mergekit that pyproject.toml pins, so an
upgrade that moves one fails there first. Imports only mergekit and :mod:`graftmerge.errors`.

Two behaviours of mergekit 0.1.5 are changed here (tests/test_offline_merges.py):

- **Its model card asks the Hub about local folders.** ``mergekit.card.is_hf`` asks the Hub
  whether a path with at most one ``/`` that exists on disk (``models/post``, ``post``) is a
  repository: offline that ends a finished merge in a traceback with nothing published, online it
  sends the user's folder names to the Hub API. :func:`keep_local_folders_off_the_hub` makes the
  card ask :func:`names_a_hub_repo` instead, answered on disk, for every merge method.
- **It lists a Hub id's repository before loading it** (``ModelReference.local_path``), also
  offline and for a cached checkpoint. :func:`wrap_run_merge` takes a ``view`` that hands
  mergekit the config with cached Hub ids as snapshot folders (the caller decides which).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping

import torch
from mergekit.common import ModelReference
from mergekit.io.tasks import LoaderCache
from mergekit.io.tensor_writer import TensorWriter

from graftmerge.errors import GraftError

PINNED = ">=0.1.5,<0.2"  # pyproject.toml's pin; the names below are those of these releases
# mergekit sets the output config's dtype through transformers' deprecated `torch_dtype` alias, and
# transformers (>= 4.56) logs a deprecation notice for it that the user of a merge cannot act on.
TORCH_DTYPE_NOTICE = "`torch_dtype` is deprecated"
TRANSFORMERS_CONFIG_LOGGER = "transformers.configuration_utils"
WRAPPED = "_graftmerge_routes"  # the attribute marking mergekit.merge.run_merge as graftmerge's one wrapper


def _not_the_torch_dtype_notice(record: logging.LogRecord) -> bool:
    return TORCH_DTYPE_NOTICE not in record.getMessage()


@contextlib.contextmanager
def without_torch_dtype_notice() -> Iterator[None]:
    """transformers' ``torch_dtype`` deprecation notice, caused by mergekit's own code, left out inside the block.

    Only that one message of transformers' config logger is dropped; anything else it logs shows.
    """
    logger = logging.getLogger(TRANSFORMERS_CONFIG_LOGGER)
    logger.addFilter(_not_the_torch_dtype_notice)
    try:
        yield
    finally:
        logger.removeFilter(_not_the_torch_dtype_notice)


def model_out_config(config, arch_info, options):
    """The output model's config.json as mergekit's run_merge writes it (``_model_out_config``)."""
    with without_torch_dtype_notice():
        return _merge_module()._model_out_config(config, arch_info, trust_remote_code=options.trust_remote_code)


def copy_tokenizer(config, folder: str, options) -> None:
    """Copy or build the tokenizer into ``folder`` as mergekit's run_merge does (``_copy_tokenizer``)."""
    _merge_module()._copy_tokenizer(config, folder, options=options)


def copy_tagalong_files(config, folder: str, files: list[str], options) -> None:
    """Copy the architecture's tag-along files into ``folder`` as run_merge does (``_copy_tagalong_files``)."""
    _merge_module()._copy_tagalong_files(config, folder, files=files, options=options)


def _merge_module():
    """``mergekit.merge``, looked up when used: the import hook may import us while it is still importing."""
    return __import__("mergekit.merge", fromlist=["run_merge"])


class ShardWriter(TensorWriter):
    """mergekit's ``TensorWriter``, with a say over each shard's tensors just before it is written.

    Subclasses override :meth:`shard_tensors` (what goes into the file) and :meth:`shard_written`
    (called after); both hook mergekit's private ``_write_shard_task``.
    """

    def __init__(self, folder: str, options):
        if not callable(getattr(TensorWriter, "_write_shard_task", None)):
            raise GraftError("this mergekit's TensorWriter has no _write_shard_task; graftmerge needs mergekit "
                             f"{PINNED} as pinned by graftmerge: reinstall graftmerge's dependencies")
        super().__init__(folder, max_shard_size=options.out_shard_size, safe_serialization=options.safe_serialization)

    def shard_tensors(self, shard_data: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The tensors written for the shard that holds ``shard_data`` (default: those)."""
        return shard_data

    def shard_written(self) -> None:
        """Called once a shard's file is written."""

    def _write_shard_task(self, shard_data: dict, shard_index: int, shard_path: str) -> None:
        tensors = self.shard_tensors(shard_data)
        super()._write_shard_task(tensors, shard_index, shard_path)
        del tensors
        self.shard_written()


class TensorGroupMethod:
    """Put before mergekit's ``GroupMergeMethod`` (``class M(TensorGroupMethod, GroupMergeMethod)``): in-memory
    inputs (``merge_state_dicts``: ids that are no model references) go to :meth:`merge_in_memory` instead of
    tensor by tensor (mergekit's private ``_execute``).

    A mixin, not a subclass: importing ``mergekit.merge_methods`` runs mergekit's registry, whose import hook
    registers the methods built on this class, so this module must be importable without it (imported first,
    as ``from graftmerge import lora_delta_state_dict`` does, it would otherwise be half-initialised then).
    """

    def merge_in_memory(self, groups, parameters, options, input_dtypes, out_dtype) -> tuple[torch.Tensor, ...]:
        """Every in-memory group at once (default: :meth:`merge_groups`)."""
        return self.merge_groups(groups, parameters, options, input_dtypes, out_dtype)

    def merge_groups(self, groups, parameters, options, input_dtypes, out_dtype) -> tuple[torch.Tensor, ...]:
        """mergekit's own execution: ``merge_group`` per group."""
        return super()._execute(groups, parameters, options, input_dtypes=input_dtypes, out_dtype=out_dtype)

    def _execute(self, groups, parameters, options, *, input_dtypes, out_dtype=None):
        if all(isinstance(entry.id, ModelReference) for group in groups for entry in group.entries):
            return self.merge_groups(groups, parameters, options, input_dtypes, out_dtype)
        return self.merge_in_memory(groups, parameters, options, input_dtypes, out_dtype)


def register(registry_module, methods: Iterable) -> None:
    """Register each of ``methods`` with mergekit's registry module; one already known is left as it is."""
    known = {method.spec.name for method in registry_module.registered_methods()}
    for method in methods:
        if method.spec.name not in known:
            registry_module.register(method)


Route = Callable[..., object]  # (mergekit's run_merge, config, out_path, options, config_source) -> its result


def wrap_run_merge(merge_module, routes: Mapping[str, Route], view: Callable | None = None) -> None:
    """Replace ``merge_module.run_merge`` once: a config whose merge_method is in ``routes`` goes through its
    route (handed mergekit's own run_merge), any other straight to mergekit's. ``view(config)``, if given,
    is the config both are handed (the config as written stays the card's source). Keyword ``settings``
    beyond mergekit's own (``use_threshold_cache``) go to the route; mergekit's run_merge takes none."""
    original = getattr(merge_module, "run_merge", None)
    if original is None or hasattr(original, WRAPPED):
        return  # half-imported (the import hook wraps it once mergekit.merge finishes), or wrapped already

    @functools.wraps(original)
    def run_merge(merge_config, out_path, options, config_source=None, **settings):
        seen = merge_config if view is None else view(merge_config)
        if seen is not merge_config and config_source is None:
            config_source = merge_config.to_yaml()  # the card shows the config as written
        merge_config = seen
        route = routes.get(merge_config.merge_method)
        if route is None:
            if settings:
                raise GraftError(f"{', '.join(sorted(settings))}: only for {', '.join(sorted(routes))} merges, "
                                 f"not merge_method {merge_config.merge_method}")
            return original(merge_config, out_path, options=options, config_source=config_source)
        with without_torch_dtype_notice():
            return route(original, merge_config, out_path, options, config_source, **settings)

    setattr(run_merge, WRAPPED, routes)
    merge_module.run_merge = run_merge


@contextlib.contextmanager
def loaders_in_cache(loaders: Mapping[ModelReference, object]) -> Iterator[None]:
    """Each loader in mergekit's ``LoaderCache`` under its reference until the block ends, however it ends."""
    cache = LoaderCache().loaders  # one dict, shared by every thread's LoaderCache
    cache.update(loaders)
    try:
        yield
    finally:
        for reference in loaders:
            cache.pop(reference, None)


def names_a_hub_repo(path: str) -> bool:
    """mergekit's card question, "is ``path`` a Hub model repository?", answered without the network.

    A path that exists on disk is a local folder however it is written (``models/post``, ``post``):
    nothing about it is asked of the Hub. A path that does not exist is a Hub id unless it is
    written as an absolute or home path or has more than one ``/`` (mergekit's own rule for those).
    """
    if not path or os.path.exists(path):
        return False
    return path[0] not in "/~" and path.count("/") <= 1


def keep_local_folders_off_the_hub() -> None:
    """mergekit's model card (``mergekit.card``, imported by ``mergekit.merge``) asks :func:`names_a_hub_repo`.

    ``generate_card``, ``generate_card_lora`` and ``maybe_link_hf`` look ``is_hf`` up in their module at
    call time, so replacing that global changes every card mergekit writes, whoever calls it.
    """
    card = sys.modules.get("mergekit.card")
    if card is not None and callable(getattr(card, "is_hf", None)):
        card.is_hf = names_a_hub_repo
