"""Retention data: read JSONL rollouts or prompts, tokenise, validate, hash.

Accepted rollout lines (one JSON object each):

- ``{"prompt_ids": [...], "completion_ids": [...]}``  pre-tokenised (the main path for
  rollouts sampled elsewhere, e.g. with vLLM)
- ``{"prompt": "...", "completion": "..."}``         text, tokenised with the model's tokenizer
- ``{"messages": [..., {"role": "assistant", ...}]}`` rendered with its chat template
  (within a budget, in a child process: :mod:`graftmerge.formats.bounded_template`);
  the last (assistant) message is the completion

Prompt files take ``prompt_ids``, ``prompt`` or ``messages`` (without the answer).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from graftmerge.errors import GraftError
from graftmerge.formats.bounded_template import Conversation, Rendering, conversation_key, render_each_once

TokenizerLoader = Callable[[], Any]


@dataclass(frozen=True)
class Rollout:
    """One retention sequence: prompt z_n and completion y_n as token ids."""

    prompt_ids: tuple[int, ...]
    completion_ids: tuple[int, ...]
    source: str = ""  # "file:line" for error messages

    @property
    def length(self) -> int:
        """Tokens in the sequence, prompt and completion."""
        return len(self.prompt_ids) + len(self.completion_ids)


@dataclass
class RolloutStats:
    """What happened to the input lines; recorded in the cache manifest."""

    lines: int = 0
    skipped_empty_completion: int = 0
    truncated: int = 0
    extra: dict[str, Any] = field(default_factory=dict)



def rollouts_sha256(rollouts: Sequence[Rollout]) -> str:
    """Hash of the token ids actually used, independent of file formatting and order of keys."""
    digest = hashlib.sha256()
    for rollout in rollouts:
        digest.update(json.dumps([rollout.prompt_ids, rollout.completion_ids]).encode())
        digest.update(b"\n")
    return digest.hexdigest()


def read_jsonl(path: str | Path, what: str) -> list[tuple[int, dict[str, Any]]]:
    """(line number, object) for every non-blank line; GraftError naming the bad line."""
    path = Path(path)
    if not path.is_file():
        raise GraftError(f"{what} file {path} does not exist")
    try:
        with open(path, encoding="utf-8") as handle:
            lines = handle.readlines()
    except UnicodeDecodeError as error:
        raise GraftError(f"{what} file {path} is not UTF-8 text (byte {error.start})") from error
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise GraftError(f"{path}:{number}: invalid JSON ({error.msg})") from error
        except (ValueError, RecursionError, MemoryError) as error:  # int() past Python's limit; deep nesting
            raise GraftError(f"{path}:{number}: invalid JSON (an integer of more than "
                             f"{sys.get_int_max_str_digits()} digits, or nested too deeply)") from error
        if not isinstance(record, dict):
            raise GraftError(
                f"{path}:{number}: expected a JSON object, got {type(record).__name__}"
            )
        records.append((number, record))
    if not records:
        raise GraftError(f"{what} file {path} is empty")
    return records


def _token_ids(value: Any, where: str, key: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(
        isinstance(i, int) and not isinstance(i, bool) for i in value
    ):
        raise GraftError(f"{where}: {key!r} must be a list of integer token ids")
    if any(i < 0 for i in value):
        raise GraftError(f"{where}: {key!r} has a negative token id")
    return tuple(value)


def _text(value: Any, where: str, key: str) -> str:
    if not isinstance(value, str):
        raise GraftError(f"{where}: {key!r} must be a string")
    return value


def _encode(tokenizer: Any, text: str, special: bool) -> tuple[int, ...]:
    return tuple(tokenizer(text, add_special_tokens=special)["input_ids"])


def _chat_parts(messages: list[dict], with_answer: bool) -> list[tuple[list[dict], dict]]:
    """The (messages, options) renderings a chat line needs: its prompt, and with an answer the whole chat."""
    if not with_answer:
        return [(messages, {"add_generation_prompt": True})]
    return [(messages[:-1], {"add_generation_prompt": True}), (messages, {})]


def _well_formed_chat(messages: Any, with_answer: bool) -> bool:
    """Whether ``messages`` is a chat _render_messages will render (else it says what is wrong)."""
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
        return False
    return not with_answer or messages[-1].get("role") == "assistant"


def render_chats(records, path, tokenizer: TokenizerLoader, with_answer: bool) -> dict[str, Rendering]:
    """Every chat line's template renderings in one bounded batch (the template is the model's code).

    Keyed by :func:`conversation_key`; empty when no line is a chat or the tokenizer has no template.
    """
    wanted = [Conversation(chat, f"{path}:{number}", options) for number, record in records
              if "messages" in record and not {"prompt_ids", "completion_ids"} & set(record)
              and _well_formed_chat(record["messages"], with_answer)
              for chat, options in _chat_parts(record["messages"], with_answer)]
    if not wanted or not getattr(tokenizer(), "chat_template", None):
        return {}
    return render_each_once(tokenizer(), wanted)


def _render_messages(
    tokenizer: Any, messages: Any, where: str, with_answer: bool, rendered: dict[str, Rendering] | None = None
) -> tuple[str, str]:
    """(prompt text, completion text) of a chat; completion empty when ``with_answer`` is False.

    Renderings come from ``rendered`` (:func:`render_chats`), else are made here, within the same budget.
    """
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
        raise GraftError(f"{where}: 'messages' must be a non-empty list of objects")
    if not getattr(tokenizer, "chat_template", None):
        raise GraftError(
            f"{where}: the model's tokenizer has no chat template; 'messages' needs one"
        )
    if with_answer and messages[-1].get("role") != "assistant":
        raise GraftError(f"{where}: the last message must be the assistant's completion")
    rendered = {} if rendered is None else rendered
    texts = []
    for chat, options in _chat_parts(messages, with_answer):
        key = conversation_key(chat, options)
        if key not in rendered:
            rendered.update(render_each_once(tokenizer, [Conversation(chat, where, options)]))
        if rendered[key].error is not None:
            raise GraftError(f"{where}: the chat template fails on this conversation: {rendered[key].error}")
        texts.append(rendered[key].text)
    if not with_answer:
        return texts[0], ""
    prompt, full = texts
    if not full.startswith(prompt):
        raise GraftError(
            f"{where}: the chat template does not render the prompt as a prefix of the chat"
        )
    return prompt, full[len(prompt) :]


def parse_rollout(record: dict[str, Any], where: str, tokenizer: TokenizerLoader,
                  rendered: dict[str, Rendering] | None = None) -> Rollout:
    """One JSONL object → Rollout (text is tokenised: prompt with special tokens, completion without)."""
    if "prompt_ids" in record or "completion_ids" in record:
        prompt = _token_ids(record.get("prompt_ids"), where, "prompt_ids")
        completion = _token_ids(record.get("completion_ids"), where, "completion_ids")
        return Rollout(prompt, completion, where)
    if "messages" in record:
        prompt_text, completion_text = _render_messages(
            tokenizer(), record["messages"], where, True, rendered
        )
        return Rollout(
            _encode(tokenizer(), prompt_text, False),
            _encode(tokenizer(), completion_text, False),
            where,
        )
    if "prompt" in record and "completion" in record:
        prompt_text = _text(record["prompt"], where, "prompt")
        completion_text = _text(record["completion"], where, "completion")
        return Rollout(
            _encode(tokenizer(), prompt_text, True),
            _encode(tokenizer(), completion_text, False),
            where,
        )
    raise GraftError(
        f"{where}: expected keys prompt_ids/completion_ids, prompt/completion, or messages; got {sorted(record)}"
    )


def parse_prompt(record: dict[str, Any], where: str, tokenizer: TokenizerLoader,
                 rendered: dict[str, Rendering] | None = None) -> tuple[int, ...]:
    """One prompts-file object → prompt token ids."""
    if "prompt_ids" in record:
        return _token_ids(record["prompt_ids"], where, "prompt_ids")
    if "messages" in record:
        return _encode(
            tokenizer(), _render_messages(tokenizer(), record["messages"], where, False, rendered)[0], False
        )
    if "prompt" in record:
        return _encode(tokenizer(), _text(record["prompt"], where, "prompt"), True)
    raise GraftError(f"{where}: expected key prompt_ids, prompt or messages; got {sorted(record)}")


def read_rollouts(
    path: str | Path, tokenizer: TokenizerLoader
) -> tuple[list[Rollout], RolloutStats]:
    """Every non-blank line of a rollouts JSONL file as a Rollout (GraftError names the bad line)."""
    records = read_jsonl(path, "rollouts")
    rendered = render_chats(records, path, tokenizer, True)
    rollouts = [parse_rollout(record, f"{path}:{number}", tokenizer, rendered) for number, record in records]
    return rollouts, RolloutStats(lines=len(records))


def read_prompts(path: str | Path, tokenizer: TokenizerLoader) -> list[tuple[str, tuple[int, ...]]]:
    """("file:line", prompt ids) per line of a prompts JSONL file; an empty prompt is an error."""
    records = read_jsonl(path, "prompts")
    rendered = render_chats(records, path, tokenizer, False)
    prompts = []
    for number, record in records:
        where = f"{path}:{number}"
        prompt = parse_prompt(record, where, tokenizer, rendered)
        if not prompt:
            raise GraftError(f"{where}: empty prompt")
        prompts.append((where, prompt))
    return prompts


def validate_rollouts(
    rollouts: Sequence[Rollout],
    stats: RolloutStats,
    *,
    vocab_size: int,
    max_length: int | None,
    truncate: bool,
) -> list[Rollout]:
    """Drop (and count) empty completions, enforce the context length, check token ids."""
    kept = []
    for rollout in rollouts:
        where = rollout.source or "rollout"
        if not rollout.prompt_ids:
            raise GraftError(f"{where}: empty prompt (the first completion token needs a context)")
        for ids in (rollout.prompt_ids, rollout.completion_ids):
            if ids and max(ids) >= vocab_size:
                raise GraftError(
                    f"{where}: token id {max(ids)} is outside the model's vocabulary ({vocab_size})"
                )
        if max_length is not None and rollout.length > max_length:
            if not truncate:
                raise GraftError(
                    f"{where}: sequence of {rollout.length} tokens is longer than the model's context "
                    f"({max_length}); pass --truncate to cut it"
                )
            keep = max(0, max_length - len(rollout.prompt_ids))
            rollout = Rollout(
                rollout.prompt_ids[:max_length], rollout.completion_ids[:keep], rollout.source
            )
            stats.truncated += 1
        if not rollout.completion_ids:
            stats.skipped_empty_completion += 1
            continue
        kept.append(rollout)
    if not kept:
        raise GraftError(
            f"no usable rollouts: all {len(rollouts)} have an empty completion"
            + (" (after truncation)" if stats.truncated else "")
        )
    return kept


def write_rollouts(
    path: str | Path, rollouts: Sequence[Rollout], tokenizer: Any | None = None
) -> None:
    """Save rollouts as pre-tokenised JSONL (plus decoded text when a tokenizer is at hand)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)  # never a user's file
    tmp = Path(name)
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        for rollout in rollouts:
            record: dict[str, Any] = {
                "prompt_ids": list(rollout.prompt_ids),
                "completion_ids": list(rollout.completion_ids),
            }
            if tokenizer is not None:
                record["prompt"] = tokenizer.decode(list(rollout.prompt_ids))
                record["completion"] = tokenizer.decode(list(rollout.completion_ids))
            handle.write(json.dumps(record) + "\n")
    tmp.replace(path)
