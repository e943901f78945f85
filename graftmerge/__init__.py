"""graftmerge: graft a donor's fine-tuning delta onto a post-trained model.

What it computes: docs/math.md; the manual: docs/.

The public Python API is the names in ``__all__``: import them from here
(``from graftmerge import merge, estimate_fisher, sweep``), never from the module that
defines them, which may move (docs/api-policy.md). They are loaded on first use, so
``import graftmerge`` stays cheap: ``graftmerge_hook.pth`` imports this package in
every Python, and ``graftmerge --help`` must not load torch. A graft also runs
through mergekit's own API under the method name ``graft`` (README.md, "From Python").
"""

import sys

__version__ = "0.1.0"

# Public name -> "module:attribute". An internal module that moves needs a one-line edit
# here (and its import under TYPE_CHECKING below); tests/test_public_api.py fails if an
# entry does not resolve or the two differ.
_EXPORTS = {
    # the three jobs (docs/python-api.md): graftmerge merge, fisher estimate, sweep [--eval]
    "merge": "graftmerge.api:merge",
    "estimate_fisher": "graftmerge.api:estimate_fisher",
    "sweep": "graftmerge.api:sweep",
    # errors: every bad input, as one line
    "GraftError": "graftmerge.errors:GraftError",
    # the graft method, as mergekit sees it
    "GraftMergeMethod": "graftmerge.methods.graft:GraftMergeMethod",
    # Fisher caches (docs/formats/fisher-cache.md)
    "FisherCacheWriter": "graftmerge.formats.fisher_cache:FisherCacheWriter",
    "FisherCache": "graftmerge.formats.fisher_cache:FisherCache",
    "open_fisher_cache": "graftmerge.formats.fisher_cache:open_fisher_cache",
    "KfacFactors": "graftmerge.math.kfac:KfacFactors",
    # a PEFT LoRA adapter as a Δ state dict for merge_state_dicts (role: delta)
    "lora_delta_state_dict": "graftmerge.pipeline.lora_inputs:lora_delta_state_dict",
    # the delta tool (docs/delta-tool.md): graftmerge delta extract | stats, graftmerge suggest
    "extract_delta": "graftmerge.pipeline.delta_extract:extract_delta",
    "extract_lora": "graftmerge.pipeline.delta_extract:extract_lora",
    "LoraExtraction": "graftmerge.pipeline.delta_extract:LoraExtraction",
    "compute_stats": "graftmerge.pipeline.delta_report:compute_stats",
    "DeltaStats": "graftmerge.pipeline.delta_report:DeltaStats",
    "format_table": "graftmerge.pipeline.delta_report:format_table",
    "plot_stats": "graftmerge.pipeline.delta_report:plot_stats",
    "suggest_graft": "graftmerge.pipeline.suggest:suggest_graft",
    "Suggestion": "graftmerge.pipeline.suggest:Suggestion",
    # a (λ, ρ) grid read once: each point's tensors or folders (docs/sweeps.md): sweep, sweep --eval, searches
    "open_grid": "graftmerge.pipeline.sweep:open_grid",
    "Grid": "graftmerge.pipeline.sweep:Grid",
    "GridPoint": "graftmerge.pipeline.sweep:GridPoint",
    # scoring models on the user's own tasks (docs/evaluation.md): graftmerge eval, sweep --eval
    "load_tasks": "graftmerge.evaluation.tasks:load_tasks",
    "Task": "graftmerge.evaluation.tasks:Task",
    "TaskSuite": "graftmerge.evaluation.tasks:TaskSuite",
    "Evaluator": "graftmerge.evaluation.scoring:Evaluator",
    "load_model_for_eval": "graftmerge.evaluation.scoring:load_model_for_eval",
    "load_tokenizer": "graftmerge.evaluation.scoring:load_tokenizer",
    "normalised": "graftmerge.evaluation.roles:normalised",
    "role_scores": "graftmerge.evaluation.roles:role_scores",
}

# Spelled out for type checkers and linters; equal to sorted(_EXPORTS) (tested).
__all__ = [
    "DeltaStats", "Evaluator", "FisherCache", "FisherCacheWriter", "GraftError", "GraftMergeMethod",
    "Grid", "GridPoint", "KfacFactors", "LoraExtraction", "Suggestion", "Task", "TaskSuite", "compute_stats",
    "estimate_fisher", "extract_delta", "extract_lora", "format_table", "load_model_for_eval", "load_tasks",
    "load_tokenizer", "lora_delta_state_dict", "merge", "normalised", "open_fisher_cache", "open_grid", "plot_stats",
    "role_scores", "suggest_graft", "sweep",
]

# Not `from typing import TYPE_CHECKING`: typing costs ~30 ms at every interpreter start
# (the .pth hook). Type checkers treat any TYPE_CHECKING as true; keep this list equal
# to _EXPORTS (tests/test_public_api.py checks it).
TYPE_CHECKING = False
if TYPE_CHECKING:
    from graftmerge.api import estimate_fisher, merge, sweep
    from graftmerge.errors import GraftError
    from graftmerge.evaluation.roles import normalised, role_scores
    from graftmerge.evaluation.scoring import Evaluator, load_model_for_eval, load_tokenizer
    from graftmerge.evaluation.tasks import Task, TaskSuite, load_tasks
    from graftmerge.formats.fisher_cache import FisherCache, FisherCacheWriter, open_fisher_cache
    from graftmerge.math.kfac import KfacFactors
    from graftmerge.methods.graft import GraftMergeMethod
    from graftmerge.pipeline.delta_extract import LoraExtraction, extract_delta, extract_lora
    from graftmerge.pipeline.delta_report import DeltaStats, compute_stats, format_table, plot_stats
    from graftmerge.pipeline.lora_inputs import lora_delta_state_dict
    from graftmerge.pipeline.suggest import Suggestion, suggest_graft
    from graftmerge.pipeline.sweep import Grid, GridPoint, open_grid


def __getattr__(name: str):
    """A public name, imported from its module on first use (PEP 562) and kept here."""
    target = _EXPORTS.get(name)
    if target is None:
        raise AttributeError(f"module 'graftmerge' has no attribute {name!r}")
    module, attribute = target.split(":")
    __import__(module)
    value = getattr(sys.modules[module], attribute)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    """The module's own names and every public name, loaded or not."""
    return sorted({*globals(), *__all__})
