"""Score an in-memory model on a task suite: batched forwards, batched greedy generation.

Everything that needs the tokenizer is checked when the :class:`Evaluator` is built,
before any model is merged or loaded: chat templates, answers that tokenize to nothing,
lm-eval tasks. ``score`` then only runs the model, so a sweep can build one Evaluator and
score every grid point with it; a non-finite logit makes a task's value NaN (a failed
point), never an exception.

Batches are left-padded with explicit position ids (0, 1, ... from each row's first real
token) and an attention mask, so a row's numbers do not depend on what it is batched
with; sequences are sorted by length so that little is padding. Log-likelihoods are
taken from the last K+1 positions only (``logits_to_keep``) where the model supports it.
"""

from __future__ import annotations

import inspect
import math
import os
from collections.abc import Iterable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers import AutoTokenizer

from graftmerge.errors import GraftError
from graftmerge.estimate.model_loading import (
    DTYPES,
    LOAD_ERRORS,
    TOKENIZER_FILES,
    causal_lm_config,
    load_causal_lm,
)
from graftmerge.evaluation.lm_eval_tasks import HarnessTask, resolve, score_harness_task
from graftmerge.evaluation.prompts import Prepared, generation_limit, prepare, render_suite
from graftmerge.evaluation.tasks import SPLITS, Task, TaskSuite, first_line
from graftmerge.evaluation.threads import scoring_threads
from graftmerge.pipeline.graft_plan import resolve_model_folder


class Evaluator:
    """A task suite bound to a tokenizer: every example tokenized and checked, ready to score models."""

    def __init__(self, suite: TaskSuite, tokenizer, *, device="cpu", batch_size=16, progress=True,
                 splits: Sequence[str] | None = None):
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise GraftError(f"batch size must be a positive integer, got {batch_size!r}")
        self.tokenizer = tokenizer
        self.device = torch.device(device)  # where a model is expected; inputs follow each model's own device
        self.batch_size = batch_size
        self.progress = progress
        rendered = render_suite(tokenizer, suite.tasks)  # every chat template rendering, in one bounded batch
        self.prepared: dict[str, tuple[Prepared, ...]] = {
            task.name: tuple(prepare(task, example, tokenizer, rendered) for example in task.examples)
            for task in suite.tasks if task.lm_eval is None
        }
        self.harness: dict[str, HarnessTask] = {
            task.name: resolve(task) for task in suite.tasks if task.lm_eval is not None
        }
        tasks = tuple(self.harness[t.name].task if t.name in self.harness else t for t in suite.tasks)
        self.suite = replace(suite, tasks=tasks)  # lm-eval entries with their splits and metric direction
        self.pad_id = 0  # padding is masked, so any id in the vocabulary does (a tokenizer's pad id may lie outside it)
        if splits is not None:
            self.check_splits(splits)

    @property
    def splits(self) -> dict[str, tuple[str, ...]]:
        """{task name: the splits it has}, lm-eval tasks included."""
        return {task.name: task.splits for task in self.suite.tasks}

    def check_splits(self, splits: Iterable[str]) -> None:
        """GraftError naming the first task with no example in one of ``splits``."""
        self.suite.check_splits(tuple(splits))

    def score(self, model, splits=("validation",), *, only_present: bool = False) -> dict[str, dict[str, float]]:
        """{task: {split: raw value}} of ``model`` (in memory); NaN where the model gave non-finite numbers.

        ``only_present``: a task without examples in a split is left out of it instead of refused.
        The model is put in eval mode for the call and left as it was.
        """
        splits = tuple(splits)
        for split in splits:
            if split not in SPLITS:
                raise GraftError(f"unknown split {split!r}; choose one of {', '.join(SPLITS)}")
        if not only_present:
            self.check_splits(splits)
        self._check_context(model)
        was_training = model.training
        model.eval()
        results: dict[str, dict[str, float]] = {}
        try:
            with torch.no_grad(), scoring_threads():  # threads the shared machine can give (evaluation/threads)
                for task in self.suite.tasks:
                    for split in (s for s in splits if s in task.splits):
                        results.setdefault(task.name, {})[split] = self._score_task(model, task, split)
        finally:
            model.train(was_training)
        return results

    def _check_context(self, model) -> None:
        """GraftError if a token id is outside the model's vocabulary or a sequence would not fit its positions."""
        vocabulary = getattr(model.config, "vocab_size", None)
        context = getattr(model.config, "max_position_embeddings", None)
        for task in self.suite.tasks:
            prepared = self.prepared.get(task.name, ())
            if not prepared:
                continue
            generated = generation_limit(task, list(prepared)) if task.metric in ("exact", "contains") else 0
            for example in prepared:
                ids = [*example.prompt_ids, *(t for c in example.continuations for t in c)]
                if isinstance(vocabulary, int) and max(ids) >= vocabulary:
                    raise GraftError(f"{example.where}: token id {max(ids)} is outside the model's vocabulary "
                                     f"({vocabulary}): the tokenizer does not belong to this model")
                longest = len(example.prompt_ids) + max(generated, *map(len, example.continuations))
                if isinstance(context, int) and longest > context:
                    raise GraftError(f"{example.where}: prompt and answer take {longest} tokens, "
                                     f"more than the model's {context} positions")

    def _score_task(self, model, task: Task, split: str) -> float:
        if task.lm_eval is not None:
            return score_harness_task(self.harness[task.name], model, self.tokenizer, split, self.batch_size,
                                      progress=self.progress)
        examples = [p for p, e in zip(self.prepared[task.name], task.examples) if e.split == split]
        desc = f"{task.name} ({split})"
        if task.metric == "nll":
            logprobs = self._logprobs(model, [(e.prompt_ids, e.continuations[0]) for e in examples], desc)
            total = torch.cat(logprobs)
            value = -float(total.sum()) / total.numel()
        elif task.metric == "choice":
            value = self._choice_accuracy(model, examples, desc)
        else:
            value = self._generation_score(model, task, examples, desc)
        return value if math.isfinite(value) else math.nan

    def _choice_accuracy(self, model, examples: list[Prepared], desc: str) -> float:
        """Share of examples whose answer has the highest total log-likelihood (first in list order on ties)."""
        pairs = [(e.prompt_ids, c) for e in examples for c in e.continuations]
        totals = iter([float(lp.sum()) for lp in self._logprobs(model, pairs, desc)])
        correct = 0
        for example in examples:
            scores = [next(totals) for _ in example.continuations]
            if not all(map(math.isfinite, scores)):
                return math.nan
            correct += max(range(len(scores)), key=lambda i: (scores[i], -i)) == example.target
        return correct / len(examples)

    def _generation_score(self, model, task: Task, examples: list[Prepared], desc: str) -> float:
        """exact: share of replies equal to the answer; contains: share containing it (both stripped)."""
        limit = generation_limit(task, list(self.prepared[task.name]))
        limits = [limit if e.chat or task.metric == "contains" else len(e.continuations[0]) for e in examples]
        stops = stop_ids(self.tokenizer, model, self.prepared[task.name])
        replies = self._replies(model, [e.prompt_ids for e in examples], limits, stops, desc)
        if replies is None:
            return math.nan
        texts = [self.tokenizer.decode(r, skip_special_tokens=True).strip() for r in replies]
        if task.metric == "exact":
            hits = [text == e.reply for text, e in zip(texts, examples)]
        else:
            hits = [e.answer in text for text, e in zip(texts, examples)]
        return sum(hits) / len(hits)

    def _batches(self, lengths: list[int], desc: str):
        """Indices per batch, longest first; a progress bar over the batches."""
        order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
        batches = [order[i : i + self.batch_size] for i in range(0, len(order), self.batch_size)]
        return tqdm(batches, desc=desc, unit="batch", disable=not self.progress, leave=False)

    def _logprobs(self, model, pairs: list[tuple[tuple[int, ...], tuple[int, ...]]], desc: str) -> list[torch.Tensor]:
        """Per continuation token, log p(token | everything before it), float64, one tensor per pair."""
        out: list[torch.Tensor] = [torch.empty(0)] * len(pairs)
        keep = accepts(model, "logits_to_keep")
        for batch in self._batches([len(p) + len(c) for p, c in pairs], desc):
            ids, mask, positions = left_padded([pairs[i][0] + pairs[i][1] for i in batch], self.pad_id,
                                               model_device(model))
            k = max(len(pairs[i][1]) for i in batch)
            extra = {"logits_to_keep": k + 1} if keep else {}
            logits = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False, **extra).logits
            logprobs = logits[:, -(k + 1) : -1].float().log_softmax(-1)
            picked = logprobs.gather(-1, ids[:, -k:, None])[..., 0].double().cpu()
            for row, i in enumerate(batch):
                out[i] = picked[row, k - len(pairs[i][1]) :]
        return out

    def _replies(self, model, prompts: list[tuple[int, ...]], limits: list[int], stops: list[int],
                 desc: str) -> list[list[int]] | None:
        """Greedy replies (token ids before the first stop token, at most each row's limit); None if a logit was
        not finite."""
        replies: list[list[int]] = [[] for _ in prompts]
        for batch in self._batches([len(p) for p in prompts], desc):
            ids, mask, positions = left_padded([prompts[i] for i in batch], self.pad_id, model_device(model))
            generated = greedy_tokens(model, ids, mask, positions, max(limits[i] for i in batch), stops, self.pad_id)
            if generated is None:
                return None
            for row, i in enumerate(batch):
                tokens = generated[row][: limits[i]]
                cut = next((n for n, token in enumerate(tokens) if token in stops), len(tokens))
                replies[i] = tokens[:cut]
        return replies


def greedy_tokens(model, ids, mask, positions, steps: int, stops: list[int], pad_id: int) -> list[list[int]] | None:
    """Argmax decoding of a left-padded batch with a KV cache, up to ``steps`` tokens a row.

    Plain argmax, whatever the model's generation_config says (no repetition penalty,
    no suppressed tokens): the scores must not depend on a sampling setting. A row that
    has stopped is fed padding and ignored. None if an active row's logits were not finite.
    """
    keep = {"logits_to_keep": 1} if accepts(model, "logits_to_keep") else {}
    cache_argument = "cache" if accepts(model, "cache") else "past_key_values"
    stop = torch.tensor(stops or [-1], device=ids.device)
    done = torch.zeros(ids.shape[0], dtype=torch.bool, device=ids.device)
    columns = []
    output = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, **keep)
    for step in range(steps):
        logits = output.logits[:, -1]
        if not bool(torch.isfinite(logits[~done]).all()):
            return None
        token = logits.argmax(-1).masked_fill(done, pad_id)
        columns.append(token)
        done = done | torch.isin(token, stop)
        if bool(done.all()) or step == steps - 1:
            break
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        positions = positions[:, -1:] + 1
        output = model(input_ids=token[:, None], attention_mask=mask, position_ids=positions,
                       use_cache=True, **{cache_argument: cache_of(output)})
    return torch.stack(columns, dim=1).tolist() if columns else [[] for _ in range(ids.shape[0])]


def left_padded(rows: list[tuple[int, ...]], pad_id: int, device: torch.device):
    """(input_ids, attention_mask, position_ids) of rows padded on the left; positions start at each row's first
    token."""
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for row, tokens in enumerate(rows):
        ids[row, width - len(tokens) :] = torch.tensor(tokens, dtype=torch.long)
        mask[row, width - len(tokens) :] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    return ids.to(device), mask.to(device), positions.to(device)


def accepts(model, argument: str) -> bool:
    """Whether ``model``'s forward names ``argument`` (``logits_to_keep``, ``cache`` are recent in transformers)."""
    try:
        return argument in inspect.signature(type(model).forward).parameters  # follows decorators' __wrapped__
    except (TypeError, ValueError):
        return False


def cache_of(output):
    """The KV cache a forward returned (``cache`` in recent transformers, ``past_key_values`` before)."""
    for name in ("cache", "past_key_values"):
        value = getattr(output, name, None)
        if value is not None:
            return value
    raise GraftError("the model returned no KV cache with use_cache=True; it cannot generate replies")


def stop_ids(tokenizer, model, prepared: Iterable[Prepared]) -> list[int]:
    """Tokens that end a reply: the template's end of turn, the tokenizer's and the model's EOS."""
    stops = {token for example in prepared for token in example.end_ids}
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for token in (tokenizer.eos_token_id, *(configured if isinstance(configured, list) else [configured])):
        if token is not None:
            stops.add(int(token))
    return sorted(stops)


def read_chat_template(path: str | os.PathLike) -> str:
    """A Jinja chat template from a text file; GraftError if it cannot be read or is empty."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise GraftError(f"cannot read chat template {path}: {first_line(error)}") from error
    if not text.strip():
        raise GraftError(f"chat template {path} is empty")
    return text


def load_model_for_eval(reference: str | os.PathLike, device="cpu", dtype=None, *,
                        chat_template: str | os.PathLike | None = None, trust_remote_code: bool = False):
    """(model in eval mode, tokenizer) of a model folder or a Hub id from the local HF cache (offline).

    ``dtype``: a name (float32, bfloat16, float16, float64, auto) or a torch dtype; None means
    float32. ``chat_template``: a Jinja file that replaces the tokenizer's template.
    """
    folder = Path(resolve_model_folder(str(reference)))
    if isinstance(dtype, torch.dtype):
        dtype = next((name for name, value in DTYPES.items() if value == dtype), str(dtype))
    model = load_causal_lm(folder, dtype=dtype or "float32", device=device, progress=False,
                           trust_remote_code=trust_remote_code)
    return model, load_tokenizer(folder, chat_template=chat_template, trust_remote_code=trust_remote_code)


def load_tokenizer(reference: str | os.PathLike, *, chat_template: str | os.PathLike | None = None,
                   trust_remote_code: bool = False):
    """The tokenizer of a model folder or cached Hub id, without its weights (to build an Evaluator early).

    The folder's config.json is checked too (a causal LM, no code of its own unless trusted),
    so a folder that is not a model is refused before anything else is loaded.
    """
    folder = Path(resolve_model_folder(str(reference)))
    causal_lm_config(folder, trust_remote_code=trust_remote_code)
    if not any((folder / name).exists() for name in TOKENIZER_FILES):
        raise GraftError(f"{folder} has no tokenizer; evaluation needs the model's own tokenizer files")
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=trust_remote_code)
    except LOAD_ERRORS as error:
        raise GraftError(f"cannot load the tokenizer of {folder}: {first_line(error)}") from error
    if chat_template is not None:
        tokenizer.chat_template = read_chat_template(chat_template)
        tokenizer.graftmerge_template_file = str(chat_template)  # what a template past its budget is called
    return tokenizer


def model_device(model) -> Any:
    """The device of the model's first parameter (where its inputs must go)."""
    return next(model.parameters()).device
