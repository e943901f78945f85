"""Task files: what a model is scored on, read and checked before any model is loaded.

A tasks file (YAML) lists tasks; each names a role (``old``: what the post model could
already do and must keep; ``new``: what the graft should teach), a metric, and either a
JSONL data file (paths relative to the tasks file) or an lm-evaluation-harness task.
Everything that can be checked without a tokenizer is checked here, each error naming
the file, line and field; docs/evaluation.md describes every field.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from graftmerge.errors import GraftError
from graftmerge.estimate.rollouts import read_jsonl
from graftmerge.pipeline.config_files import load_yaml_file

ROLES = ("old", "new")
METRICS = ("exact", "contains", "nll", "choice", "lm_eval")
SPLITS = ("validation", "test")
DEFAULT_SPLIT = "validation"
TASK_FIELDS = ("name", "role", "metric", "data", "weight", "system", "max_new_tokens", "lm_eval")
LM_EVAL_FIELDS = ("task", "metric", "include_path", "num_fewshot", "limit", "apply_chat_template")
LINE_FIELDS = ("messages", "prompt", "answer", "choices", "split", "id", "meta")
# lm-eval metrics that are lower-is-better; used until the harness itself says (Evaluator resolves it).
LOWER_IS_BETTER_LM_EVAL = ("perplexity", "word_perplexity", "byte_perplexity", "bits_per_byte")


@dataclass(frozen=True)
class Example:
    """One data line: a prompt (chat ``messages`` or plain text ``prompt``) and its expected answer."""

    where: str  # "file:line"
    split: str
    answer: str
    messages: tuple[dict, ...] | None = None  # chat turns before the answer
    prompt: str | None = None  # plain text, no chat template
    choices: tuple[str, ...] | None = None  # metric choice only; answer is one of them


@dataclass(frozen=True)
class LmEvalSpec:
    """An lm-evaluation-harness task, scored through the harness's own Python API."""

    task: str
    metric: str | None = None  # None: "acc" if the task reports it, else its first metric
    include_path: Path | None = None  # extra folder of task YAMLs
    num_fewshot: int | None = None
    limit: int | None = None  # score only the first N documents of the split
    apply_chat_template: bool = False
    higher_is_better: bool | None = None  # the harness's word, filled in by the Evaluator
    splits: tuple[str, ...] = ()  # our split names the harness task has, filled in by the Evaluator
    folder: Path | None = None  # the tasks file's folder (absolute): relative data paths of the harness task


@dataclass(frozen=True)
class Task:
    """One scored task of a tasks file."""

    name: str
    role: str  # "old" | "new"
    metric: str  # one of METRICS
    where: str  # "tasks.yml:LINE", for error messages
    examples: tuple[Example, ...] = ()
    data: Path | None = None
    weight: float = 1.0  # its share of its role's score
    system: str | None = None  # system message put before every "messages" line that has none
    max_new_tokens: int | None = None  # exact/contains: generation bound (default from the longest answer)
    lm_eval: LmEvalSpec | None = None

    @property
    def higher_is_better(self) -> bool:
        """Whether a larger raw value is better (nll and perplexity-like lm-eval metrics: no)."""
        if self.metric == "nll":
            return False
        if self.lm_eval is None:
            return True
        if self.lm_eval.higher_is_better is not None:
            return self.lm_eval.higher_is_better
        return self.lm_eval.metric not in LOWER_IS_BETTER_LM_EVAL

    @property
    def splits(self) -> tuple[str, ...]:
        """The split names this task has examples in, in SPLITS order (lm-eval: once resolved)."""
        if self.lm_eval is not None:
            return self.lm_eval.splits
        present = {example.split for example in self.examples}
        return tuple(split for split in SPLITS if split in present)

    def examples_of(self, split: str) -> tuple[Example, ...]:
        """The examples of ``split``, in file order."""
        return tuple(example for example in self.examples if example.split == split)


@dataclass(frozen=True)
class TaskSuite:
    """Every task of a tasks file, and a fingerprint of the file and all its data."""

    tasks: tuple[Task, ...]
    source: Path
    fingerprint: str  # sha256 over the tasks file and every data file's bytes

    @property
    def inputs(self) -> tuple[Path, ...]:
        """Everything the suite reads: the tasks file, each data file, each lm-eval include_path folder.

        An output folder may be none of them, nor inside one: a sweep's DIR inside an
        include_path would change the very files the suite's fingerprint covers.
        """
        data = [task.data for task in self.tasks if task.data is not None]
        folders = [task.lm_eval.include_path for task in self.tasks
                   if task.lm_eval is not None and task.lm_eval.include_path is not None]
        return (self.source, *data, *dict.fromkeys(folders))

    def task(self, name: str) -> Task:
        """The task called ``name``."""
        for task in self.tasks:
            if task.name == name:
                return task
        raise KeyError(name)

    def check_splits(self, splits) -> None:
        """GraftError naming the first task with no example in one of ``splits``."""
        for split in splits:
            if split not in SPLITS:
                raise GraftError(f"unknown split {split!r}; choose one of {', '.join(SPLITS)}")
            for task in self.tasks:
                if task.lm_eval is not None and not task.lm_eval.splits:
                    continue  # not resolved yet: the Evaluator checks it against the harness
                if split not in task.splits:
                    have = ", ".join(task.splits) or "none"
                    raise GraftError(f"{task.where}: task {task.name!r} has no {split} examples "
                                     f"(it has: {have}); label data lines with \"split\": \"{split}\"")


def first_line(error: BaseException) -> str:
    """An exception's message as one line (library messages are often paragraphs)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[0] if lines else type(error).__name__


def load_tasks(path: str | os.PathLike) -> TaskSuite:
    """Read and check a tasks file and every data file it names; GraftError naming file, line and field."""
    path = Path(path)
    entries = _read_task_entries(path)
    tasks: list[Task] = []
    for entry, lines in entries:
        task = _parse_task(entry, lines, path)
        if any(task.name == other.name for other in tasks):
            raise GraftError(f"{task.where}: task name {task.name!r} is used twice")
        tasks.append(task)
    return TaskSuite(tuple(tasks), path, _fingerprint(path, tasks))


def _read_task_entries(path: Path) -> list[tuple[dict, dict[str, int]]]:
    """(entry, {field: line, "": entry line}) for every item of the file's ``tasks:`` list."""
    if not path.is_file():
        raise GraftError(f"tasks file {path} does not exist" if not path.exists()
                         else f"tasks file {path} is not a file")
    document, node, _ = load_yaml_file(str(path), "tasks file")
    if not isinstance(document, dict) or "tasks" not in document:
        raise GraftError(f"{path}: expected a mapping with a `tasks:` list")
    extra = sorted(set(document) - {"tasks"}, key=repr)
    if extra:
        raise GraftError(f"{path}: unknown top-level field {extra[0]!r} (only `tasks:` is allowed)")
    items = document["tasks"]
    if not isinstance(items, list) or not items:
        raise GraftError(f"{path}: `tasks:` must be a non-empty list")
    listed = next((value for key, value in node.value if key.value == "tasks"), None)  # absent: from a << merge
    item_nodes = listed.value if isinstance(listed, yaml.SequenceNode) else [node] * len(items)
    entries = []
    for item, item_node in zip(items, item_nodes):
        entry_line = item_node.start_mark.line + 1
        if not isinstance(item, dict):
            raise GraftError(f"{path}:{entry_line}: each task must be a mapping (name:, role:, data:, metric:)")
        pairs = item_node.value if isinstance(item_node, yaml.MappingNode) else []
        lines = {key.value: key.start_mark.line + 1 for key, _ in pairs if isinstance(key, yaml.ScalarNode)}
        entries.append((item, {"": entry_line, **lines}))
    return entries


def _parse_task(entry: dict, lines: dict[str, int], path: Path) -> Task:
    """One ``tasks:`` item as a Task (its data file read and checked)."""
    where = f"{path}:{lines['']}"

    def fail(key: str, message: str) -> GraftError:
        """GraftError at the line of ``key`` (the entry's line when absent)."""
        return GraftError(f"{path}:{lines.get(key, lines[''])}: {message}")

    unknown = [key for key in entry if key not in TASK_FIELDS]
    if unknown:
        raise fail(unknown[0], f"unknown task field {unknown[0]!r} (allowed: {', '.join(TASK_FIELDS)})")
    for required in ("name", "role"):
        if required not in entry:
            raise fail("", f"task is missing the field {required!r}")
    name = entry["name"]
    if not isinstance(name, str) or not name.strip() or name != name.strip():
        raise fail("name", f"task name must be a non-empty string without surrounding spaces, got {name!r}")
    label = f"task {name!r}"
    role = entry["role"]
    if role not in ROLES:
        raise fail("role", f"{label}: unknown role {role!r} (choose old or new)")
    options = _task_options(entry, fail, label)
    if "lm_eval" in entry:
        spec = _parse_lm_eval(entry, fail, label, path)
        return Task(name, role, "lm_eval", where, lm_eval=spec, **options)
    metric = entry.get("metric")
    if metric is None:
        raise fail("", f"{label} is missing the field 'metric' (one of {', '.join(METRICS[:-1])})")
    if metric not in METRICS[:-1]:
        hint = " (an lm_eval metric needs an `lm_eval:` entry)" if metric == "lm_eval" else ""
        raise fail("metric", f"{label}: unknown metric {metric!r} (choose one of {', '.join(METRICS[:-1])}){hint}")
    if "data" not in entry:
        raise fail("", f"{label} is missing the field 'data' (a JSONL file, relative to {path.name})")
    if not isinstance(entry["data"], str) or not entry["data"]:
        raise fail("data", f"{label}: data must be a file name")
    data = path.parent / entry["data"]
    if options["max_new_tokens"] is not None and metric not in ("exact", "contains"):
        raise fail("max_new_tokens", f"{label}: max_new_tokens applies to exact and contains only, not {metric}")
    examples = _read_examples(data, metric, label, fail)
    if options["system"] is not None and all(example.messages is None for example in examples):
        raise fail("system", f"{label}: system applies to \"messages\" lines, and {data} has none")
    return Task(name, role, metric, where, examples, data, **options)


def _task_options(entry: dict, fail, label: str) -> dict[str, Any]:
    """weight, system and max_new_tokens of an entry, checked."""
    weight = entry.get("weight", 1.0)
    if isinstance(weight, bool) or not isinstance(weight, int | float) or not 0 < weight <= sys.float_info.max:
        shown = f"an integer of {len(str(abs(weight)))} digits" if isinstance(weight, int) and abs(weight) > 1e20 \
            else repr(weight)
        raise fail("weight", f"{label}: weight must be a positive number of at most {sys.float_info.max:.4g}, "
                             f"got {shown}")
    system = entry.get("system")
    if system is not None and (not isinstance(system, str) or not system):
        raise fail("system", f"{label}: system must be a non-empty string")
    limit = entry.get("max_new_tokens")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise fail("max_new_tokens", f"{label}: max_new_tokens must be a positive integer, got {limit!r}")
    return {"weight": float(weight), "system": system, "max_new_tokens": limit}


def _parse_lm_eval(entry: dict, fail, label: str, path: Path) -> LmEvalSpec:
    """The ``lm_eval:`` mapping of an entry (the task's existence is checked by the Evaluator)."""
    for clash in ("data", "system", "max_new_tokens"):
        if clash in entry:
            raise fail(clash, f"{label}: an lm_eval task takes no {clash!r} (the harness task has its own)")
    if entry.get("metric", "lm_eval") != "lm_eval":
        raise fail("metric", f"{label}: with `lm_eval:`, put the harness metric inside it (lm_eval: {{metric: ...}})")
    spec = entry["lm_eval"]
    if not isinstance(spec, dict):
        raise fail("lm_eval", f"{label}: lm_eval must be a mapping (task: NAME, metric: acc, include_path: DIR)")
    unknown = [key for key in spec if key not in LM_EVAL_FIELDS]
    if unknown:
        raise fail("lm_eval", f"{label}: unknown lm_eval field {unknown[0]!r} (allowed: {', '.join(LM_EVAL_FIELDS)})")
    task = spec.get("task")
    if not isinstance(task, str) or not task:
        raise fail("lm_eval", f"{label}: lm_eval needs `task:`, the harness task's name")
    metric = spec.get("metric")
    if metric is not None and (not isinstance(metric, str) or not metric):
        raise fail("lm_eval", f"{label}: lm_eval metric must be a metric name such as acc")
    include = spec.get("include_path")
    if include is not None:
        if not isinstance(include, str) or not (path.parent / include).is_dir():
            raise fail("lm_eval", f"{label}: lm_eval include_path {include!r} is not a folder "
                                  f"(relative to {path.name})")
        include = path.parent / include
    counts = {}
    for key, least in (("num_fewshot", 0), ("limit", 1)):
        value = spec.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < least):
            raise fail("lm_eval", f"{label}: lm_eval {key} must be an integer >= {least}, got {value!r}")
        counts[key] = value
    chat = spec.get("apply_chat_template", False)
    if not isinstance(chat, bool):
        raise fail("lm_eval", f"{label}: lm_eval apply_chat_template must be true or false")
    return LmEvalSpec(task, metric, include, counts["num_fewshot"], counts["limit"], chat,
                      folder=path.parent.resolve())


def _read_examples(data: Path, metric: str, label: str, fail) -> tuple[Example, ...]:
    """Every line of a data file as an Example; GraftError naming file:line and the field."""
    if not data.is_file():
        raise fail("data", f"{label}: data file {data} does not exist" if not data.exists()
                   else f"{label}: data {data} is not a file")
    return tuple(_parse_line(record, f"{data}:{number}", metric) for number, record in read_jsonl(data, "data"))


def _parse_line(record: dict, where: str, metric: str) -> Example:
    """One JSON object of a data file."""
    unknown = [key for key in record if key not in LINE_FIELDS]
    if unknown:
        raise GraftError(f"{where}: unknown field {unknown[0]!r} (allowed: {', '.join(LINE_FIELDS)})")
    if ("messages" in record) == ("prompt" in record):
        raise GraftError(f"{where}: give exactly one of \"messages\" (chat turns) or \"prompt\" (plain text)")
    messages = _messages(record["messages"], where) if "messages" in record else None
    prompt = record.get("prompt")
    if prompt is not None and (not isinstance(prompt, str) or not prompt):
        raise GraftError(f"{where}: \"prompt\" must be a non-empty string")
    if "answer" not in record:
        raise GraftError(f"{where}: missing \"answer\"")
    answer = _nonempty_text(record["answer"], where, "answer")
    split = record.get("split", DEFAULT_SPLIT)
    if split not in SPLITS:
        raise GraftError(f"{where}: unknown split {split!r} (choose validation or test)")
    choices = None
    if metric == "choice":
        choices = _choices(record, where, answer)
    elif "choices" in record:
        raise GraftError(f"{where}: \"choices\" is for metric choice; this task's metric is {metric}")
    return Example(where, split, answer, messages, prompt, choices)


def _messages(messages: Any, where: str) -> tuple[dict, ...]:
    """Chat turns: objects with string role and content, the assistant's reply not among them."""
    if not isinstance(messages, list) or not messages:
        raise GraftError(f"{where}: \"messages\" must be a non-empty list of {{\"role\", \"content\"}} objects")
    for turn in messages:
        if (not isinstance(turn, dict) or not isinstance(turn.get("role"), str)
                or not isinstance(turn.get("content"), str)):
            raise GraftError(f"{where}: every message needs a string \"role\" and a string \"content\"")
    if messages[-1]["role"] == "assistant":
        raise GraftError(f"{where}: the last message is the assistant's; put the expected reply in \"answer\" instead")
    return tuple(messages)


def _nonempty_text(value: Any, where: str, key: str) -> str:
    """A string with something besides whitespace."""
    if not isinstance(value, str):
        raise GraftError(f"{where}: \"{key}\" must be a string, got {type(value).__name__}")
    if not value.strip():
        raise GraftError(f"{where}: \"{key}\" is empty")
    return value


def _choices(record: dict, where: str, answer: str) -> tuple[str, ...]:
    """The choices of a choice line: distinct non-empty strings, the answer among them."""
    choices = record.get("choices")
    if choices is None:
        raise GraftError(f"{where}: metric choice needs \"choices\": [...] (the answer one of them)")
    if not isinstance(choices, list) or len(choices) < 2:
        raise GraftError(f"{where}: \"choices\" must be a list of at least two strings")
    checked = tuple(_nonempty_text(choice, where, "choices") for choice in choices)
    if len(set(checked)) != len(checked):
        raise GraftError(f"{where}: \"choices\" lists one choice twice")
    if answer not in checked:
        raise GraftError(f"{where}: the answer {answer!r} is not one of the choices")
    return checked


def _fingerprint(path: Path, tasks: list[Task]) -> str:
    """sha256 over the tasks file, every data file and every include_path file (names and bytes).

    Bytecode is left out: the harness writes ``__pycache__`` beside a task's ``!function``
    module when it first imports it, which would otherwise make every resume a new suite.
    """""
    digest = hashlib.sha256()

    def add(label: str, data: bytes) -> None:
        """One named blob, length-prefixed so that boundaries are unambiguous."""
        digest.update(f"{label}\0{len(data)}\0".encode())
        digest.update(data)

    add("tasks", path.read_bytes())
    for task in tasks:
        if task.data is not None:
            add(f"data:{task.name}", task.data.read_bytes())
        if task.lm_eval is not None:
            add("lm-eval", _lm_eval_version().encode())
            if task.lm_eval.include_path is not None:
                root = task.lm_eval.include_path
                for file in sorted(p for p in root.rglob("*") if p.is_file() and not bytecode(p, root)):
                    add(f"include:{task.name}:{file.relative_to(root).as_posix()}", file.read_bytes())
    return digest.hexdigest()


def bytecode(file: Path, root: Path) -> bool:
    """Whether ``file`` (under ``root``) is Python's compiled cache of a module, not a file anyone wrote."""
    return "__pycache__" in file.relative_to(root).parts or file.suffix in (".pyc", ".pyo")


def _lm_eval_version() -> str:
    """The installed harness's version (its built-in tasks change with it), or "absent"."""
    try:
        return importlib.metadata.version("lm-eval")
    except importlib.metadata.PackageNotFoundError:
        return "absent"
