"""lm-evaluation-harness tasks scored on an in-memory model (the optional ``eval`` extra).

The harness is imported only here and only when a tasks file has an ``lm_eval:`` entry:
it is optional (``pip install graftmerge[eval]``) and takes seconds to import. A task is
looked up in its ``include_path`` alone first (indexing the harness's ~13,000 built-in
tasks takes tens of seconds), then among the built-in ones. Our ``validation`` split is
the harness task's ``validation_split``, our ``test`` its ``test_split``. The harness reads a
task's local files (``data_files``, a ``dataset_path`` folder) relative to the working
directory; they are loaded from the tasks file's folder, so a tasks file means the same
from wherever it is run.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
import math
import os
from dataclasses import dataclass, replace
from typing import Any

from graftmerge.errors import GraftError
from graftmerge.evaluation.tasks import Task, first_line
from graftmerge.formats.bounded_template import (
    Conversation,
    Rendering,
    conversation_key,
    render_each_once,
    template_file,
)

INSTALL_HINT = "pip install graftmerge[eval]"
FEWSHOT_SEED = 1234  # the harness's own default


def harness():
    """The lm_eval modules this file uses; GraftError saying how to install them when absent."""
    # lazy: lm-eval is an optional extra that takes seconds to import; only lm_eval entries need it
    try:
        import lm_eval
        import lm_eval.evaluator
        from lm_eval.models.huggingface import HFLM
        from lm_eval.tasks import TaskManager
    except ImportError as error:
        raise GraftError(f"lm_eval entries need lm-evaluation-harness, which is not installed "
                         f"({error.name or error}): {INSTALL_HINT}") from error
    return lm_eval, HFLM, TaskManager


@functools.lru_cache(maxsize=8)
def task_manager(include_path: str | None, include_defaults: bool):
    """A TaskManager (its index built once per process and folder set)."""
    _, _, TaskManager = harness()
    with quiet_harness():
        return TaskManager(include_path=include_path, include_defaults=include_defaults)


@contextlib.contextmanager
def quiet_harness():
    """The harness's INFO and WARNING chatter off for the block (its errors still show)."""
    logger = logging.getLogger("lm_eval")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


@contextlib.contextmanager
def working_directory(folder):
    """The block run from ``folder`` (None: where it is), the previous directory restored however it ends.

    The harness hands a task's ``dataset_kwargs`` to ``datasets.load_dataset`` unchanged, which
    reads relative paths from the working directory: loading from the tasks file's folder
    anchors them there, as the tasks file's own ``data:`` and ``include_path`` are.
    """
    if folder is None:
        yield
        return
    previous = os.getcwd()
    os.chdir(folder)
    try:
        yield
    finally:
        os.chdir(previous)


# The harness's modules that draw progress bars with a module-level ``tqdm`` and no switch
# that ``evaluate`` passes down (request building, HFLM's scoring loops).
HARNESS_BAR_MODULES = ("lm_eval.api.task", "lm_eval.api.model", "lm_eval.models.huggingface")


def silenced(bar):
    """``bar`` with ``disable=True`` forced (the harness passes its own ``disable=False``)."""

    def make(*args, **kwargs):
        return bar(*args, **{**kwargs, "disable": True})

    return make


@contextlib.contextmanager
def harness_progress(enabled: bool):
    """The harness's progress bars on or off for the block (``--no-progress`` reaches them too).

    ``evaluate`` offers no switch for them, so the block swaps those modules' ``tqdm`` for one
    that always passes ``disable=True``, and puts the original back however the block ends.
    """
    if enabled:
        yield
        return
    modules = [importlib.import_module(name) for name in HARNESS_BAR_MODULES]
    saved = [module.tqdm for module in modules]
    for module, original in zip(modules, saved):
        module.tqdm = silenced(original)
    try:
        yield
    finally:
        for module, original in zip(modules, saved):
            module.tqdm = original


@dataclass
class HarnessTask:
    """One lm_eval entry resolved: the harness's task object, its metric and our split names."""

    task: Task  # ours, with splits and higher_is_better filled in
    harness_task: Any  # lm_eval.api.task.Task
    manager: Any  # lm_eval.tasks.TaskManager that knows it


def find_task(task: Task):
    """(TaskManager, harness task object) of an lm_eval entry; GraftError when the harness has no such task."""
    spec = task.lm_eval
    include = str(spec.include_path) if spec.include_path is not None else None
    manager = None
    for defaults in ([False] if include else []) + [True]:  # the harness's own index only when needed
        manager = task_manager(include, defaults)
        if spec.task in manager.all_subtasks:
            break
        if spec.task in manager.all_tasks:
            raise GraftError(f"{task.where}: lm-eval name {spec.task!r} is a group or tag of several tasks; "
                             "list each of its tasks as its own entry")
    else:
        searched = f" or in {spec.include_path}" if include else ""
        raise GraftError(f"{task.where}: lm-eval task {spec.task!r} does not exist (not among the harness's "
                         f"{len(manager.all_subtasks)} tasks{searched})")
    try:
        with quiet_harness(), working_directory(spec.folder):
            loaded = manager.load([spec.task])["tasks"]
    except Exception as error:  # the harness raises whatever its dataset loader raises
        raise GraftError(f"{task.where}: cannot load lm-eval task {spec.task!r}: {first_line(error)}") from error
    return manager, next(iter(loaded.values()))


def resolve(task: Task) -> HarnessTask:
    """An lm_eval entry checked against the harness: the task exists, has the metric and a split."""
    harness()  # installed? (before any cached TaskManager is reused)
    manager, harness_task = find_task(task)
    spec = task.lm_eval
    better = harness_task.higher_is_better() or {}
    metric = spec.metric or ("acc" if "acc" in better else next(iter(better), None))
    if metric not in better:
        raise GraftError(f"{task.where}: lm-eval task {spec.task!r} reports no metric {metric!r} "
                         f"(it reports: {', '.join(better) or 'none'})")
    config = harness_task.config
    splits = tuple(ours for ours, theirs in (("validation", config.validation_split), ("test", config.test_split))
                   if theirs is not None)
    if not splits:
        raise GraftError(f"{task.where}: lm-eval task {spec.task!r} has neither a validation nor a test split")
    check_fewshot(task, harness_task, splits)
    resolved = replace(task, lm_eval=replace(spec, metric=metric, higher_is_better=bool(better[metric]), splits=splits))
    return HarnessTask(resolved, harness_task, manager)


def check_fewshot(task: Task, harness_task, splits: tuple[str, ...]) -> None:
    """GraftError unless the harness task has enough few-shot documents for ``num_fewshot`` on every split.

    Checked here, before any model is loaded: the harness only finds out while it builds the
    requests, after the model is loaded, with a traceback from ``random.sample``. Its
    sampler draws one document more when the few-shot documents are the scored split's
    own (it then leaves the scored document out).
    """
    shots = task.lm_eval.num_fewshot
    shots = harness_task.get_config("num_fewshot") or 0 if shots is None else shots
    if not shots:
        return
    try:
        with quiet_harness():
            pool = len(harness_task.fewshot_docs())
    except Exception as error:  # the harness raises whatever its dataset or a task's own function raises
        raise GraftError(f"{task.where}: cannot read the few-shot documents of lm-eval task "
                         f"{task.lm_eval.task!r}: {first_line(error)}") from error
    fewshot_split = getattr(getattr(harness_task, "fewshot_cfg", None), "split", None)
    for split in splits:
        scored_test_split = None if split == "validation" else harness_task.config.test_split  # as score_harness_task
        needed = shots + (fewshot_split == scored_test_split)
        if pool < needed:
            source = f"its {fewshot_split!r} split" if fewshot_split else "the split the harness draws them from"
            raise GraftError(f"{task.where}: lm-eval task {task.lm_eval.task!r} has {pool} few-shot documents "
                             f"({source}), and num_fewshot {shots} needs {needed} to score its {split} split; "
                             f"lower num_fewshot to at most {pool - (needed - shots)}")


def score_harness_task(entry: HarnessTask, model, tokenizer, split: str, batch_size: int,
                       progress: bool = True) -> float:
    """The entry's metric on ``split`` of its harness task, computed by the harness on ``model`` in memory.

    Through the harness's ``evaluate`` (not ``simple_evaluate``, which also reseeds the
    global random generators and asks git for a commit hash); few-shot examples are
    drawn with the harness's default seed, so a score is the same on every call.
    """
    lm_eval, HFLM, _ = harness()
    spec, task = entry.task.lm_eval, entry.harness_task
    if split not in spec.splits:
        raise GraftError(f"{entry.task.where}: lm-eval task {spec.task!r} has no {split} split "
                         f"(it has: {', '.join(spec.splits)})")
    if spec.num_fewshot is not None:
        task.set_config(key="num_fewshot", value=spec.num_fewshot)
    elif task.get_config("num_fewshot") is None:
        task.set_config(key="num_fewshot", value=0)
    task.set_fewshot_seed(seed=FEWSHOT_SEED)
    saved_test_split = task.config.test_split
    if split == "validation":
        task.config.test_split = None  # the harness scores test_split when there is one, else validation_split
    try:
        with quiet_harness(), harness_progress(progress):
            lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size)
            if spec.apply_chat_template:
                lm.apply_chat_template = BoundedChat.prepared(lm, tokenizer, entry, spec.limit)
            results = lm_eval.evaluator.evaluate(
                lm=lm, task_dict={"tasks": {spec.task: task}}, limit=spec.limit, bootstrap_iters=0,
                log_samples=False, apply_chat_template=spec.apply_chat_template,
                fewshot_as_multiturn=spec.apply_chat_template,
            )
    finally:
        task.config.test_split = saved_test_split
    row = results["results"][spec.task]
    keys = [key for key in row if key.split(",")[0] == spec.metric]
    value = float(row[keys[0]]) if keys else math.nan
    return value if math.isfinite(value) else math.nan


class BoundedChat:
    """The harness LM's ``apply_chat_template``, rendered by the bounded renderer (docs/security.md, class 18).

    The harness renders a task's prompts one by one while it builds its requests; a
    recording pass of that build first collects them all, so they are rendered in one
    bounded batch (one fork) and the harness's own pass only looks them up. Options and
    the fallback (the system turn dropped when the template fails) are the harness's.
    """

    def __init__(self, tokenizer, options: dict, where: str):
        self.tokenizer, self.options, self.where = tokenizer, options, where
        self.rendered: dict[str, Rendering] = {}
        self.recorded: list[Conversation] | None = None

    @classmethod
    def prepared(cls, lm, tokenizer, entry: HarnessTask, limit) -> BoundedChat:
        """A renderer for ``lm`` holding every prompt of ``entry``'s task, rendered in one batch."""
        where = f"{entry.task.where} (lm-eval task {entry.task.lm_eval.task!r})"
        chat = cls(tokenizer, dict(getattr(lm, "chat_template_args", None) or {}), where)
        chat.recorded, task = [], entry.harness_task
        sample_size = importlib.import_module("lm_eval.evaluator_utils").get_sample_size  # lm-eval: optional
        try:
            task.build_all_requests(limit=sample_size(task, limit),
                                    rank=lm.rank, world_size=lm.world_size, apply_chat_template=True,
                                    fewshot_as_multiturn=True, chat_template=chat, tokenizer_name="")
        finally:
            recorded, chat.recorded = chat.recorded, None
            task.set_fewshot_seed(seed=FEWSHOT_SEED)  # the harness's own pass draws the same few-shot examples
        chat.rendered.update(render_each_once(tokenizer, recorded))
        return chat

    def __call__(self, chat_history: list[dict], add_generation_prompt: bool = True) -> str:
        """What the harness's HFLM.apply_chat_template returns, rendered within the budget."""
        options = {"add_generation_prompt": add_generation_prompt,
                   "continue_final_message": not add_generation_prompt, **self.options}
        if self.recorded is not None:
            self.recorded.append(Conversation(chat_history, self.where, options))
            return ""
        rendering = self.render(chat_history, options)
        if rendering.error is not None:  # as the harness does: once more without the system turn
            rendering = self.render([turn for turn in chat_history if turn.get("role") != "system"], options)
        if rendering.error is not None:
            raise GraftError(f"{template_file(self.tokenizer)}: the chat template failed on a prompt of "
                             f"{self.where}: {rendering.error}")
        return rendering.text

    def render(self, messages: list[dict], options: dict) -> Rendering:
        """The rendering of one conversation: from the batch, else rendered now (bounded, on its own)."""
        key = conversation_key(messages, options)
        if key not in self.rendered:
            self.rendered.update(render_each_once(self.tokenizer, [Conversation(messages, self.where, options)]))
        return self.rendered[key]
