"""A global diagonal mask found during the merge itself, then applied to the written output.

The separate threshold pass reads every donor and fine-tune a second time only to form
the Δ the merge kernel forms anyway. Here the kernel hands each tensor's Δ over
(:meth:`ThresholdWhileMerging.add`) and writes θpost + Δ unmasked; the scores F ⊙ Δ² go to
the search in a background thread while mergekit reads and writes the next tensors. After
the merge the exact threshold is known, and :meth:`ThresholdWhileMerging.finish` sets the
masked coordinates of every tensor in the written shards to what the kernel writes there
for a masked coordinate: θpost. The shards are bit for bit a pre-pass merge's
(tests/test_fast_paths.py).

Diagonal Fishers only: a masked KFAC direction changes every coordinate of its weight.
"""

from __future__ import annotations

import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch
from tqdm import tqdm

from graftmerge.errors import GraftError
from graftmerge.formats.checkpoint import Checkpoint, overwrite_elements
from graftmerge.formats.output_folder import stage_reached
from graftmerge.math.global_threshold import GlobalThreshold, ThresholdSearch
from graftmerge.math.scores import diagonal_scores
from graftmerge.math.selection import mask_from_threshold, masked_count
from graftmerge.pipeline.graft_plan import GraftInputs

_IN_FLIGHT = 2  # row blocks' scores waiting for the search at most (bounded memory)


def scores_while_merging(inputs: GraftInputs) -> bool:
    """Whether a global mask of these inputs can be found during the merge: every ranked tensor has a diagonal Fisher."""
    names = inputs.ranked_names()
    return bool(names) and all(inputs.fisher_kind(name) == "diagonal" for name in names)


class ThresholdWhileMerging:
    """The global threshold search fed by the merge kernel; see the module docstring."""

    def __init__(self, inputs: GraftInputs):
        names = inputs.ranked_names()
        total = sum(inputs.direction_count(name) for name in names)
        self.inputs = inputs
        self.search = ThresholdSearch(k=masked_count(inputs.plan.rho, total), total=total, keep_positions=True)
        self._ranked = set(names)
        self._merged: dict[str, tuple[torch.dtype, torch.dtype]] = {}  # name -> (working, Δ's) dtype
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="graft-threshold")
        self._pending: deque[Future] = deque()
        self._lock = threading.Lock()

    def add(self, name: str, delta: torch.Tensor, working: torch.dtype) -> None:
        """Score one merged tensor's unmasked Δ (left unchanged) and queue the scores for the search.

        ``working`` is the dtype the kernel returns (mergekit's working dtype). A tensor
        handed over twice is scored once.
        """
        if name not in self._ranked:
            return
        with self._lock:
            if name in self._merged:
                return
            stage_reached("scoring")
            for rows in self.inputs.row_blocks(name):
                part = delta if rows is None else delta[rows[0] : rows[1]]
                fisher = self.inputs.tensor_fisher(name, rows).diagonal.to(part.device)
                scores = diagonal_scores(fisher, part)
                while len(self._pending) >= _IN_FLIGHT:
                    self._pending.popleft().result()  # raises what the search raised
                self._pending.append(self._pool.submit(self.search.add_coarse, name, scores.cpu()))
            self._merged[name] = (working, delta.dtype)

    def finish(self, staging: Path, progress: bool = True) -> GlobalThreshold:
        """The exact threshold; the masked coordinates of the shards in ``staging`` set to θpost.

        Tensors mergekit never handed over still count towards the threshold (scored
        from the files, as the pre-pass scores them); tensors whose kept scores
        overflowed the search's memory are scored from the files again.
        """
        while self._pending:
            self._pending.popleft().result()
        self._pool.shutdown()
        for name in sorted(self._ranked - self._merged.keys()):
            for rows in self.inputs.row_blocks(name):
                self.search.add_coarse(name, self._file_scores(name, rows))
        for name in self.search.fine_pass_names():
            for rows in self.inputs.row_blocks(name):
                self.search.add_fine(name, self._file_scores(name, rows))
        result = self.search.result()
        output = Checkpoint(staging, label=f"merged output {staging}")
        with tqdm(total=len(self._merged), desc="graft threshold: masking the merged tensors", disable=not progress,
                  unit="tensor") as bar:
            for layout in output.layouts.values():
                names = sorted(self._merged.keys() & layout.tensors.keys())
                changes = {}
                for name in names:
                    positions = self.search.masked_positions(name)
                    if positions is None:
                        positions = self._rescored_mask(name, result)
                    changes[name] = (positions, self._post_values(name, positions, layout.tensors[name].torch_dtype))
                    bar.update()
                overwrite_elements(layout, changes)
        missing = sorted(name for name in self._merged if name not in output.tensors
                         or output.tensors[name].numel != self.inputs.post.tensors[name].numel)
        if missing:
            raise GraftError(f"{staging}: the merge wrote no tensor {missing[0]!r} shaped like θpost's, so its mask "
                             "cannot be applied (a graftmerge bug: please report it with the config)")
        return result

    def close(self) -> None:
        """Stop the search thread (queued scores are dropped); idempotent."""
        self._pool.shutdown(wait=True, cancel_futures=True)

    def _file_scores(self, name: str, rows: tuple[int, int] | None) -> torch.Tensor:
        fisher = self.inputs.tensor_fisher(name, rows).diagonal
        return diagonal_scores(fisher, self.inputs.read_delta(name, "cpu", rows), in_place=True)

    def _rescored_mask(self, name: str, result: GlobalThreshold) -> torch.Tensor:
        """Flat positions the mask selects in ``name``, from its scores read again (as the merge kernel selects them)."""
        ties_left, offset, parts = result.tie_quota.get(name, 0), 0, []
        for rows in self.inputs.row_blocks(name):
            scores = self._file_scores(name, rows)
            mask = mask_from_threshold(scores, result.threshold, ties_left)
            if ties_left:
                ties_left -= min(ties_left, int((scores == result.threshold).sum()))
            parts.append(torch.nonzero(mask.reshape(-1)).squeeze(1).add_(offset))
            offset += scores.numel()
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)

    def _post_values(self, name: str, positions: torch.Tensor, stored: torch.dtype) -> torch.Tensor:
        """What the kernel writes at a masked coordinate, in the shard's dtype: (0 + θpost) cast as the merge casts."""
        working, compute = self._merged[name]
        post = self.inputs.post.read(name).reshape(-1).index_select(0, positions)
        return torch.zeros(positions.numel(), dtype=compute).add_(post.to(working).to(compute)).to(working).to(stored)
