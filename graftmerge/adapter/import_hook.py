"""Make the stock ``mergekit-yaml`` know ``graft`` without importing anything heavy.

mergekit has no plugin entry point, only ``mergekit.merge_methods.register()``.
``graftmerge_hook.pth`` (installed into site-packages) calls :func:`install`
at interpreter start-up; it only appends a finder to ``sys.meta_path``. When
mergekit's registry module is first imported, the finder runs the real module
and then registers ``graft`` (and ``fisher``, ``regmean``); when ``mergekit.merge`` is imported, it wraps
``run_merge`` so graft configs are validated before mergekit loads a tensor; when
``mergekit-yaml``'s or ``mergekit-multi``'s command module is imported, it hands the
command to :mod:`graftmerge.cli.mergekit_scripts` (one ``error:`` line per refusal).

The table below names those handlers as strings: this module imports none of them
itself (it runs at every interpreter start), so it is no import arrow up the layers;
the handler of a click command is in ``cli/``, the only layer that knows click.
"""

from __future__ import annotations

import sys

# Plain classes, not importlib.abc subclasses: importing importlib.abc pulls in
# importlib.resources, pathlib and tempfile (~35 ms) at every interpreter start.

_AFTER_IMPORT = {
    "mergekit.merge_methods.registry": (("graftmerge.adapter.registration", "register_methods"),),
    "mergekit.merge": (("graftmerge.adapter.registration", "wrap_run_merge"),),
    # mergekit's click commands: their errors are the command line's business (graftmerge.cli)
    "mergekit.scripts.run_yaml": (("graftmerge.cli.mergekit_scripts", "wrap_config_script"),),
    "mergekit.scripts.multimerge": (("graftmerge.cli.mergekit_scripts", "wrap_config_script"),),
}


class _PatchingLoader:
    """The real loader of a watched mergekit module, calling its graftmerge hook once it has run."""

    def __init__(self, loader, fullname: str):
        self._loader = loader
        self._fullname = fullname

    def create_module(self, spec):
        """The real loader's module (or None for the default), unchanged."""
        return self._loader.create_module(spec)

    def __getattr__(self, name):  # get_code, get_source, ... of the real loader
        return getattr(self._loader, name)

    def exec_module(self, module) -> None:
        """Run the real module, then its graftmerge hook (register graft, wrap run_merge)."""
        self._loader.exec_module(module)
        _call_after_import(self._fullname, module)


class _PostImportFinder:
    """A meta path finder that only wraps the loaders of the mergekit modules in ``_AFTER_IMPORT``."""

    def find_spec(self, fullname, path, target=None):
        """The spec the other finders give a watched module, its loader wrapped; None otherwise."""
        if fullname not in _AFTER_IMPORT:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _PatchingLoader(spec.loader, fullname)
                return spec
        return None


def install() -> None:
    """Idempotent: at most one finder, and modules already imported get patched now."""
    if not any(isinstance(f, _PostImportFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _PostImportFinder())
    for name in _AFTER_IMPORT:
        if name in sys.modules:
            _call_after_import(name, sys.modules[name])


def _call_after_import(name: str, module) -> None:
    for target_module, function in _AFTER_IMPORT[name]:
        # lazy: this module is imported at every interpreter start (graftmerge_hook.pth), so
        # the adapter (torch, mergekit, the pipeline) is imported only once mergekit itself is.
        __import__(target_module)
        # When an adapter module itself triggered this import it is still half-initialised;
        # it registers itself once its own import finishes.
        callback = getattr(sys.modules[target_module], function, None)
        if callback is not None:
            callback(module)
