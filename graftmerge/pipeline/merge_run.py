"""One merge's state, from its start to its end: the :class:`MergeRun`.

A merge is born validated: its config read into a :class:`GraftPlan` and its inputs
opened and checked (:class:`GraftInputs`) before it exists. What it then learns on the
way, before the first tensor (the global threshold and the user-cache record it came
from, the KFAC rotations and masks the threshold pass kept on disk) and while it grafts
(how many directions each tensor masked), lives here and nowhere else: not in the
process, not on the inputs. Before the first tensor it resolves one record per tensor
(:func:`graftmerge.pipeline.graft.tensor_records`); the kernel is handed that record and the
tensors, and never goes back to the run, the config, the Hub or the folders. The run dies
with the call that made it, and everything it held goes with it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from graftmerge.formats.rotation_store import RotationStore
from graftmerge.math.global_threshold import GlobalThreshold
from graftmerge.pipeline.graft_kernel import TensorRecord
from graftmerge.pipeline.graft_plan import GraftInputs, GraftPlan


@dataclass(eq=False)
class MergeRun:
    """One merge: its opened inputs (and so its validated plan), and what it learns before and while it grafts.

    Made by whoever runs the merge (``run_graft_merge``, ``graft_in_memory``, a sweep, one
    per grid point) and handed down to the kernel; never shared between merges.
    """

    inputs: GraftInputs
    out_dtype: torch.dtype | None = None  # what the result is cast to when written: checked finite in it too
    threshold: GlobalThreshold | None = None  # global ρ: fixed before the first tensor (``prepare``)
    threshold_record: str | None = None  # its record in the user's cache (removed if the merge disproves it)
    rotations: RotationStore | None = None  # Δ̃ of KFAC weights, kept by this merge's threshold pass
    kept_masks: RotationStore | None = None  # every ranked tensor's final mask, when the pass ran in this merge
    masked: dict[str, int] = field(default_factory=dict)  # directions masked per tensor, summed before publishing
    records: dict[str, TensorRecord] | None = None  # each tensor's record, resolved before the first tensor
    use_threshold_cache: bool = True  # False: the global threshold computed afresh, the user's cache untouched
    before_tensor: Callable[[], None] | None = None  # called by mergekit's task before each tensor is grafted

    @property
    def plan(self) -> GraftPlan:
        """The validated plan of this merge (its inputs were opened from it)."""
        return self.inputs.plan
