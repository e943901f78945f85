"""A (λ, ρ) grid of grafts in one run: inputs read once, one model folder per grid point.

Every output must equal, tensor for tensor and bit for bit, a separate
``mergekit-yaml`` run of the same config with that λ and ρ. So nothing here
re-derives the graft: tensors are planned and loaded by mergekit's own planner
and ``LoadTensor`` tasks (names, optional weights, dtype casts), dtypes are
aligned as mergekit's executor aligns them, each grid point is grafted by the
merge kernel itself (:func:`graftmerge.pipeline.graft.graft_tensor`), cast as mergekit's
``SaveTensor`` casts, and written with mergekit's ``TensorWriter`` in the order mergekit's
executor would write them (so the shards and the index are the same too).

What is shared is only what is provably the same for every grid point:

- the reads: the scoring pass (global masks) reads each tensor once and forms
  Δ(λ) for every λ from that read; the writing pass reads each tensor once and
  grafts it for every grid point (two reads in all, instead of two per point);
- the Fisher of a tensor, read once and handed to every grid point (a huge one,
  read in row blocks, is read again per point: a merge never holds it whole);
- the scores, once per λ: the threshold pass scores Δ(λ) once and feeds one
  exact threshold search per ρ. Δ(λ) is not λ·Δ(1) in floating point, so
  scores, thresholds and ties are never carried from one λ to another;
- Δ̃ = UᵀΔ(λ)V of a KFAC weight, rotated once per λ by the threshold pass and
  reused by every ρ (exactly what a single merge does with its own pass).

Memory does not grow with the grid: one tensor's inputs and one grid point's graft at
a time (freed memory given back between steps: :class:`FreedMemory`), at most
one Δ̃ and one Fisher tensor (or one row block of a huge one) held, the threshold
searches of all λ sharing one spill budget, and every point's shard buffer on disk
(:class:`SpillingWriter`), read back only to be written, one shard at a time.
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import logging
import os
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml
from mergekit.architecture import get_architecture_info
from mergekit.common import dtype_from_name
from mergekit.config import MergeConfiguration, ParameterSetting
from mergekit.graph import Executor
from mergekit.io.tasks import GatherTensors, LoaderCache, SaveTensor
from mergekit.io.tensor_writer import TensorWriter
from mergekit.merge_methods.buffers import copy_non_floating_buffer
from mergekit.options import MergeOptions
from mergekit.plan import MergePlanner
from pydantic import TypeAdapter
from tqdm import tqdm

from graftmerge.adapter import mergekit_compat
from graftmerge.errors import GraftError
from graftmerge.formats.output_folder import EMPTY, OutputFolder, check_not_inputs
from graftmerge.formats.rotation_store import RotationStore
from graftmerge.pipeline import schedule_binding
from graftmerge.pipeline.card_writer import DataInputs, graft_card_data, write_merge_card
from graftmerge.pipeline.config_files import read_graft_config
from graftmerge.pipeline.config_paths import anchored_config
from graftmerge.pipeline.graft import graft_tensor, tensor_records
from graftmerge.pipeline.graft_plan import GraftInputs, GraftPlan, plan_inputs
from graftmerge.pipeline.lora_inputs import lora_inputs_in_mergekit
from graftmerge.pipeline.mask_preview import grid_views, score_pass
from graftmerge.pipeline.merge_run import MergeRun
from graftmerge.pipeline.mergekit_inputs import check_mergekit_inputs
from graftmerge.pipeline.schedules import point_settings

LOG = logging.getLogger(__name__)
_SETTINGS = TypeAdapter(dict[str, ParameterSetting])  # a config's parameters, as mergekit validates them
_LIBC = ctypes.CDLL(None)  # the C library this process already uses
_PAGE = os.sysconf("SC_PAGE_SIZE")


@dataclass(frozen=True)
class GridPoint:
    """One (λ, ρ) of a sweep, and the folder its model is written to."""

    lam: float
    rho: float

    @property
    def folder(self) -> str:
        """``lambda-<λ>_rho-<ρ>``, each number as Python prints it (``lambda-0.5_rho-0.001``)."""
        return f"lambda-{self.lam!r}_rho-{self.rho!r}"

    def settings(self, parameters) -> dict:
        """The config's global parameters at this point (``point_settings``): what its mergekit config says."""
        return point_settings(parameters, self.lam, self.rho)


def grid(lambdas: list[float], rhos: list[float]) -> list[GridPoint]:
    """Every (λ, ρ) pair, λ-major in the given orders, as floats."""
    return [GridPoint(float(lam), float(rho)) for lam in lambdas for rho in rhos]


class _LastFisher:
    """The Fisher cache, remembering the tensor it read last: every grid point gets the same tensors.

    A row block of a huge tensor (an embedding) is read again for each grid point instead:
    a merge holds one block of it at a time, and so does the sweep.
    """

    def __init__(self, cache):
        self._cache = cache
        self._memo: dict[tuple, object] = {}
        self._name: str | None = None

    def __getattr__(self, attribute):
        return getattr(self._cache, attribute)

    def _remember(self, key: tuple, read: Callable):
        if key[1] != self._name:
            self._memo.clear()
            self._name = key[1]
        if key not in self._memo:
            self._memo[key] = read()
        return self._memo[key]

    def diagonal(self, name: str, rows=None):
        """The cache's diagonal of ``name``, read once while ``name`` is the current tensor (a row block: each time)."""
        if rows is not None:
            return self._cache.diagonal(name, rows)
        return self._remember(("diagonal", name, rows), lambda: self._cache.diagonal(name, rows))

    def kfac(self, name: str):
        """The cache's KFAC factors of ``name``, read once while ``name`` is the current tensor."""
        return self._remember(("kfac", name, None), lambda: self._cache.kfac(name))


class _LastRotation:
    """A RotationStore that keeps the last Δ̃ it loaded (every ρ of one λ asks for the same one).

    All λ share one ``slot``: a Δ̃ is dropped when another λ's is loaded, so at most one is
    held, however many λ the grid has.
    """

    def __init__(self, store: RotationStore, slot: list):
        self._store = store
        self._slot = slot  # [(key, Δ̃)] or []

    def load(self, name: str, device) -> torch.Tensor | None:
        """The store's Δ̃ of ``name`` on ``device``; the same object again for a repeated request."""
        key = (id(self._store), name, str(device))
        if not self._slot or self._slot[0][0] != key:
            self._slot.clear()
            self._slot.append((key, self._store.load(name, device)))
        return self._slot[0][1]


class SpillingWriter(mergekit_compat.ShardWriter):
    """mergekit's ``TensorWriter`` for one grid point, its shard buffer on disk instead of in memory.

    mergekit's writer keeps a shard's tensors in memory until the shard is full (up to
    ``--out-shard-size``); a sweep has a writer per grid point, so that buffer would be
    paid once per point. This writer is handed each tensor as a data-less (meta) tensor of
    the same shape and dtype, so it still chooses the shards, their names and the index
    exactly as mergekit's does, while the bytes go to a spill file in ``spill``, one per
    shard. When the writer writes a shard, the shard's tensors are read back (fresh
    tensors, as the writer would have held them) and the spill file is deleted. Shards are
    written synchronously (``--async-write`` does not apply), so with one writer per grid
    point at most one shard is in memory at a time, and the spill files on disk hold at
    most one unwritten shard per grid point.
    """

    def __init__(self, folder: Path, spill: Path, options):
        super().__init__(str(folder), options)
        self._spill_folder = spill
        self._spill: str | None = None  # the spill file of the shard being filled
        self._where: dict[str, tuple[int, torch.dtype, torch.Size]] = {}  # offset in it, dtype, shape

    def save_tensor(self, name: str, tensor: torch.Tensor, clone: bool = False) -> None:
        """Queue ``tensor`` in the current shard, its bytes on disk (read back fresh: ``clone`` is moot)."""
        tensor = tensor.detach().to("cpu").contiguous()
        shards = self.shards_written
        super().save_tensor(name, torch.empty_like(tensor, device="meta"))  # may write the previous shard
        if self._spill is None or self.shards_written != shards:
            handle, self._spill = tempfile.mkstemp(dir=self._spill_folder, suffix=".spill")
            os.close(handle)
        with open(self._spill, "ab") as file:
            self._where[name] = (file.tell(), tensor.dtype, tensor.shape)
            file.write(tensor.reshape(-1).view(torch.uint8).numpy().data)

    def shard_tensors(self, shard_data: dict) -> dict:
        """The shard's real tensors, read back from its spill file (every tensor of it, and only those)."""
        with open(self._spill, "rb") as file:
            return {name: _read_spilled(file, *self._where.pop(name)) for name in shard_data}

    def shard_written(self) -> None:
        """The shard's spill file goes."""
        os.unlink(self._spill)
        self._spill = None


def _read_spilled(file, offset: int, dtype: torch.dtype, shape: torch.Size) -> torch.Tensor:
    """A new tensor of ``dtype`` and ``shape`` holding the bytes at ``offset`` of ``file``."""
    tensor = torch.empty(shape, dtype=dtype)
    raw = tensor.reshape(-1).view(torch.uint8).numpy()
    file.seek(offset)
    if file.readinto(raw.data) != raw.size:
        raise GraftError(f"sweep spill file {file.name} is shorter than written; was it deleted or truncated?")
    return tensor


class FreedMemory:
    """Gives the pages of freed tensors back to the system once more than ``keep`` bytes piled up.

    glibc keeps freed blocks below its mmap threshold (which rises to 32 MiB as large
    blocks are freed) in its heap, and a sweep's stream of tensors of many sizes (a graft
    per grid point, a score per λ, between the threshold searches' long-lived kept
    scores) fragments it, so resident memory grows with the grid: on a 96M-parameter
    model, 1.75–1.84 GB for a 3 × 3 grid instead of 1.41–1.45 GB, and 2.9 GB in the
    scoring pass alone for 5 × 5. :meth:`step`, called after each step (one grid point's
    graft, one λ's scores of a block), runs glibc's ``malloc_trim`` when the process's
    anonymous resident memory has grown by more than ``keep`` since the last trim: the
    sweep never holds more than ``keep`` of garbage on top of what one step needs, and a
    small step's freed blocks are reused by the next (each trim makes the next steps
    fault their pages in again). Elsewhere than glibc: a no-op.
    """

    def __init__(self, keep: int = 128 << 20):
        self.keep = keep
        self._trim = getattr(_LIBC, "malloc_trim", None)
        self._after_trim: int | None = None

    def step(self) -> None:
        """Trim if anonymous resident memory grew by more than ``keep`` since the last trim."""
        if self._trim is None:
            return
        if self._after_trim is not None and _anonymous_resident() <= self._after_trim + self.keep:
            return
        self._trim(0)
        self._after_trim = _anonymous_resident()


def _anonymous_resident() -> int:
    """Resident bytes of this process not backed by files (``/proc/self/statm``: resident − shared)."""
    with open("/proc/self/statm", "rb") as statm:
        fields = statm.read().split()
    return (int(fields[1]) - int(fields[2])) * _PAGE


def grid_config_source(source: str, point: GridPoint) -> str:
    """The config's YAML with this grid point's lambda and rho (``point_settings``): what mergekit-yaml would be
    given."""
    data = yaml.safe_load(source)
    data["parameters"] = point.settings(data.get("parameters"))
    return yaml.safe_dump(data, sort_keys=False)


def point_config(config, point: GridPoint):
    """``config`` (as mergekit runs it) with this grid point's lambda and rho, as ``grid_config_source`` writes
    them."""
    plain = point.settings(config.parameters)
    return config.model_copy(update={"parameters": _SETTINGS.validate_python(plain)})


def bind_grid(plans: dict[GridPoint, GraftPlan], config, options, inputs: GraftInputs) -> dict[GridPoint, GraftPlan]:
    """Each point's plan with its schedule resolved by mergekit on that point's config (``config``: the one
    mergekit runs, LoRA inputs in their view); the plans themselves when nothing is scheduled."""
    bind = schedule_binding.bind_schedule  # a filter that matches nothing is warned about once, not per point
    return {point: bind(plan, point_config(config, point), options, names=inputs.post.tensors, warn=index == 0)
            for index, (point, plan) in enumerate(plans.items())}


def check_sweepable(config, points: list[GridPoint], plan: GraftPlan) -> dict[GridPoint, GraftPlan]:
    """Per grid point, the plan a merge with that λ and ρ would run; checks what sweep does not support."""
    if config.tokenizer is not None or config.tokenizer_source is not None:
        raise GraftError("sweep does not support `tokenizer:` / `tokenizer_source:`; run mergekit-yaml per grid point")
    plans = {point: plan.at_point(point.lam, point.rho) for point in points}
    for grid_plan in plans.values():
        grid_plan.check()
    return plans


def run_sweep(config, source: str, plan: GraftPlan, points: list[GridPoint], out_dir: str, options) -> list[Path]:
    """Write one model folder per grid point under ``out_dir`` (all or nothing: see ``output_folder``)."""
    plans = check_sweepable(config, points, plan)
    read = plan_inputs(plan)
    check_not_inputs(out_dir, read)  # before anything else: OUT may be none of the inputs
    loaded = check_mergekit_inputs(config, options.allow_crimes, options.trust_remote_code)
    out = Path(out_dir).resolve()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise GraftError(f"output {out_dir} already exists and is not an empty folder; choose a new one")
    with OutputFolder(out_dir, replace=EMPTY, inputs=read) as output:  # locked before any read
        masked = [p for p in plans.values() if p.masked]
        inputs = GraftInputs.open(masked[0] if masked else plans[points[0]])
        with Grid.open(config, source, inputs, plans, loaded, options, output.scratch) as opened:
            opened.write(points, output.staging, output.scratch / "spill")
    return [output.out / point.folder for point in points]


@dataclass
class Grid:
    """A (λ, ρ) grid of one graft config, its inputs read once: each point's tensors, or its model folders.

    Made by :meth:`Grid.open` (or :func:`open_grid` from a config file): the inputs opened, mergekit's
    plan of the output made, and the global masks' scoring pass run for every point at once.
    :meth:`tensors` yields one point's output tensors as ``mergekit-yaml`` writes them (names, order,
    casts); :meth:`write` writes points' folders, each equal to ``mergekit-yaml`` of its
    ``mergekit_config.yml`` (:func:`grid_config_source`), bit for bit. Memory: one tensor's inputs and
    one point's graft at a time, whatever the grid's size.
    """

    source: str  # the config's YAML, as the user wrote it
    config: object  # mergekit's view of the config (LoRA inputs in its loader cache)
    runs: dict[GridPoint, MergeRun]  # each point's merge: its view of the shared inputs, thresholds resolved
    inputs: GraftInputs
    arch_info: object
    saves: list  # mergekit's SaveTensor tasks, in its executor's order
    options: object
    freed: FreedMemory

    @classmethod
    @contextlib.contextmanager
    def open(cls, config, source: str, inputs: GraftInputs, plans: dict[GridPoint, GraftPlan], loaded, options,
             scratch: Path) -> Iterator[Grid]:
        """The grid of ``plans`` (:func:`check_sweepable`) over the opened ``inputs``; ``loaded``: what
        :func:`check_mergekit_inputs` found; ``scratch``: a folder for the scoring pass's Δ̃ and plans."""
        with lora_inputs_in_mergekit(config, inputs) as merge_config:
            arch_info = (loaded[0].arch_info if all(i.arch_info for i in loaded)
                         else get_architecture_info(merge_config, options))
            if getattr(arch_info, "post_fill_parameters", False):
                raise GraftError("sweep does not support architectures whose parameters mergekit fills in after "
                                 "merging")
            LoaderCache().setup(options=options)
            freed = FreedMemory()
            plans = bind_grid(plans, merge_config, options, inputs)
            runs = _grid_views(inputs, plans, scratch / "kfac-rotations", options.device or "cpu", freed,
                               progress=not options.quiet)
            inputs.check_unchanged()  # the pass read what was validated
            _, saves = _planned_tensors(merge_config, arch_info, options, scratch / "planned")
            yield cls(source, merge_config, runs, inputs, arch_info, saves, options, freed)

    @property
    def points(self) -> list[GridPoint]:
        """The grid's points, in the order they were given."""
        return list(self.runs)

    def tensors(self, point: GridPoint) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor) of every weight of ``point``'s model, as mergekit-yaml would write it, one at a time."""
        refs, device, taken = _model_refs(self.config), self.options.device or "cpu", []
        collect = {point: _Collect(taken)}
        for save in self.saves:
            _write_tensor(save, {point: self.runs[point]}, collect, refs, device, self.options, self.freed)
            yield from taken
            taken.clear()
            self.freed.step()
        self.inputs.check_unchanged()  # grafted from the files as validated

    def write(self, points: list[GridPoint], folder: Path, spill: Path) -> None:
        """The model folders of ``points`` in ``folder`` (``folder/<point.folder>``): each tensor read once for
        all of them; mergekit's own writer for a single point."""
        spill.mkdir(parents=True, exist_ok=True)
        _write_grid(self.config, self.source, {point: self.runs[point] for point in points}, folder, spill,
                    self.arch_info, self.options, self.options.device or "cpu", self.freed)
        self.inputs.check_unchanged()  # the merge read what was validated: else nothing is published


class _Collect:
    """A writer that hands each saved tensor to a list (a point's tensors, not a folder)."""

    def __init__(self, taken: list):
        self.taken = taken

    def save_tensor(self, name: str, tensor: torch.Tensor, clone: bool = False) -> None:
        """Keep ``(name, tensor)``."""
        self.taken.append((name, tensor))


def _model_refs(config) -> tuple:
    """(post, donor, donor_fts, deltas) model references of a (mergekit view of a) graft config."""
    roles = {entry.model: (entry.parameters or {}).get("role") for entry in config.models}
    return (config.base_model, next((ref for ref, role in roles.items() if role == "donor"), None),
            [ref for ref, role in roles.items() if role == "donor_ft"],
            [ref for ref, role in roles.items() if role == "delta"])


@contextlib.contextmanager
def open_grid(config_file: str, lambdas: list[float], rhos: list[float], options=None,
              scratch: str | None = None) -> Iterator[Grid]:
    """The :class:`Grid` of a graft config file over ``lambdas`` × ``rhos`` (λ-major), ready to yield tensors.

    ``options``: mergekit's ``MergeOptions`` (default: its defaults). Nothing is written but scratch files,
    in ``scratch`` (default: a temporary folder), removed when the block ends.
    """
    options = options or MergeOptions()
    config, source, plan = read_graft_config(config_file)
    points = grid(lambdas, rhos)
    plans = check_sweepable(config, points, plan)
    loaded = check_mergekit_inputs(config, options.allow_crimes, options.trust_remote_code)
    masked = [p for p in plans.values() if p.masked]
    inputs = GraftInputs.open(masked[0] if masked else plans[points[0]])
    with (tempfile.TemporaryDirectory(dir=scratch) as folder,
          Grid.open(config, source, inputs, plans, loaded, options, Path(folder)) as opened):
        yield opened


def _grid_views(inputs: GraftInputs, plans: dict[GridPoint, GraftPlan], scratch: Path, device: str,
                freed: FreedMemory, progress: bool) -> dict[GridPoint, MergeRun]:
    """Each grid point's merge: its view of the shared inputs, with its global threshold and the λ's kept Δ̃."""
    views = grid_views(inputs, plans)
    fisher = _LastFisher(inputs.fisher) if inputs.fisher is not None else None
    for view in views.values():
        view.fisher = fisher
    runs = {point: MergeRun(view) for point, view in views.items()}
    global_points = [p for p, plan in plans.items() if plan.masked and plan.rho_scope == "global"]
    if not global_points:
        for run in runs.values():
            run.records = tensor_records(run)
        return runs
    lambdas = sorted({p.lam for p in global_points})
    rhos = sorted({p.rho for p in global_points})
    by_lambda = {lam: views[next(p for p in global_points if p.lam == lam)] for lam in lambdas}
    stores = {lam: RotationStore(scratch / f"lambda-{index}") for index, lam in enumerate(lambdas)}
    results = score_pass(by_lambda, rhos, device=device, progress=progress, rotations=stores,
                         after_each=freed.step)
    slot: list = []
    kept = {lam: _LastRotation(store, slot) for lam, store in stores.items()}
    for point in global_points:
        runs[point].threshold = results[point.lam].thresholds[point.rho]
        runs[point].rotations = kept[point.lam]
    for run in runs.values():
        run.records = tensor_records(run)
    return runs


def _write_grid(config, source: str, runs: dict[GridPoint, MergeRun], staging: Path, spill: Path, arch_info,
                options, device: str, freed: FreedMemory) -> None:
    """Graft every tensor once per grid point, as it is read, into each point's own (spilling) writer."""
    out_config, saves = _planned_tensors(config, arch_info, options, staging)
    refs = _model_refs(config)
    folders = {point: staging / point.folder for point in runs}
    spill.mkdir(parents=True, exist_ok=True)
    writers = {point: _writer(folder, spill, options, len(folders)) for point, folder in folders.items()}
    for save in tqdm(saves, desc=f"graft sweep ({len(runs)} models)", disable=options.quiet, unit="tensor"):
        _write_tensor(save, runs, writers, refs, device, options, freed)
        freed.step()  # this tensor's inputs, before the next one's are read
    for point, writer in writers.items():
        writer.finalize()
        _write_model_files(config, source, point, str(folders[point]), out_config, arch_info, options,
                           graft_card_data(runs[point]))


def _writer(folder: Path, spill: Path, options, models: int) -> TensorWriter:
    """mergekit's own TensorWriter for a single model (its shard buffer is what one merge holds, and nothing is
    written twice); a SpillingWriter per model when a grid writes several."""
    if models == 1:
        return TensorWriter(str(folder), max_shard_size=options.out_shard_size,
                            safe_serialization=options.safe_serialization)
    return SpillingWriter(folder, spill, options)


def _write_tensor(save, runs: dict[GridPoint, MergeRun], writers: dict, refs: tuple, device: str, options,
                  freed: FreedMemory) -> None:
    """One output weight for every grid point: its inputs read once, then grafted, cast and written per point."""
    name = save.tensor_name
    tensors = _load_group(save.tensor_task, device)
    if tensors is None:
        return  # an optional weight none of the inputs has (mergekit skips it too)
    buffer = copy_non_floating_buffer(list(tensors.values()), name)
    if buffer is None:
        dtype = _promoted(list(tensors.values()))  # mergekit's align_dtype
        aligned = {ref: tensor.to(dtype=dtype) for ref, tensor in tensors.items()}
        base_ref, donor_ref, fine_tune_refs, delta_refs = refs
        post, donor = aligned[base_ref], aligned.get(donor_ref)
        fine_tunes = [aligned[ref] for ref in fine_tune_refs]
        deltas = [aligned[ref] for ref in delta_refs]
    storage = device if options.low_cpu_memory else "cpu"
    out_dtype = dtype_from_name(save.dtype) if save.dtype else None
    for point, run in runs.items():
        with torch.no_grad():
            tensor = buffer if buffer is not None else graft_tensor(run, name, post, donor, fine_tunes, deltas,
                                                                    out_dtype=out_dtype)
        tensor = tensor.to(storage)
        if save.dtype:
            tensor = tensor.to(dtype=dtype_from_name(save.dtype))
        writers[point].save_tensor(name, tensor)
        del tensor
        freed.step()  # this point's graft, before the next point's


def _promoted(tensors: list[torch.Tensor]) -> torch.dtype:
    """The dtype all ``tensors`` promote to (mergekit's align_dtype)."""
    dtype = tensors[0].dtype
    for tensor in tensors[1:]:
        dtype = torch.promote_types(dtype, tensor.dtype)
    return dtype


def _planned_tensors(config, arch_info, options, out_path: Path) -> tuple:
    """(output config, mergekit's SaveTensor tasks in the order its executor runs them).

    The same weights, names and casts as mergekit-yaml, and the same order: a writer
    cuts shards in the order it is given tensors, so this order makes the same shards.
    Building the executor only schedules the tasks; nothing runs, nothing is written.
    """
    out_config = mergekit_compat.model_out_config(config, arch_info, options)
    planner = MergePlanner(copy.deepcopy(config), arch_info, options=options, out_model_config=out_config)
    schedule = Executor(planner.plan_to_disk(out_path=str(out_path))).schedule.tasks
    return out_config, [handle.task() for handle in schedule if isinstance(handle.task(), SaveTensor)]


def _load_group(task, device: str) -> dict | None:
    """The inputs of one output weight, loaded by mergekit's own LoadTensor tasks, in model order."""
    gather = task.gather_tensors
    if not isinstance(gather, GatherTensors):
        raise GraftError(f"{task.output_weight.name}: sweep supports plain model inputs only (no vocabulary changes)")
    loaded = gather.execute(**{key: load.execute() for key, load in gather.arguments().items()})
    present = {ref: loaded[ref].to(device) for ref in task.model_order if ref in loaded}
    if not present and task.output_weight.optional:
        return None
    if len(present) != len(task.model_order):
        missing = [str(ref) for ref in task.model_order if ref not in present]
        raise GraftError(f"tensor {task.output_weight.name} is missing from {', '.join(missing)}")
    return present


def _write_model_files(config, source: str, point: GridPoint, folder: str, out_config, arch_info, options,
                       card_data: DataInputs) -> None:
    """config.json, model card (graftmerge's, as a single merge writes it), tokenizer and tag-along files, as
    mergekit's run_merge writes them."""
    out_config.save_pretrained(folder)
    point_source = grid_config_source(source, point)
    point_config = MergeConfiguration.model_validate(yaml.safe_load(point_source))
    if options.write_model_card:
        write_merge_card(folder, point_config, point_source, card_data)
        # local paths absolute: the folder's config reruns from any working directory (docs/paths.md)
        anchored = yaml.safe_dump(anchored_config(yaml.safe_load(point_source)), sort_keys=False)
        Path(folder, "mergekit_config.yml").write_text(anchored, encoding="utf-8")
    if options.copy_tokenizer:
        try:
            mergekit_compat.copy_tokenizer(point_config, folder, options)
        except Exception as error:  # noqa: BLE001 - mergekit also keeps the merge when this fails
            LOG.error("Failed to copy tokenizer into %s: %s", folder, error)
    mergekit_compat.copy_tagalong_files(point_config, folder, arch_info.tagalong_files or [], options)
