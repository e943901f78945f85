"""Chat templates rendered within a budget: a template is code from a model folder.

A Jinja chat template can loop without end (``{% for i in range(99999) %}{% for j in
range(99999) %}``), build a string of gigabytes (``{{ 'x' * 10**10 }}``) or compute a
huge power in one step; jinja2's sandbox stops attribute tricks, not any of these, and a
budget inside the process cannot interrupt one long C-level operation. So the tokenizer's
own ``apply_chat_template`` (transformers' rendering, exactly) runs in a forked child of
this process: each conversation must be rendered within RENDER_SECONDS, all of them
within BATCH_SECONDS plus BATCH_SECONDS_PER_CONVERSATION each, the child may grow by at
most MEMORY_BYTES and a rendering may be at most MAX_TEXT_CHARACTERS long. Past any of
them the child is killed and the caller gets one GraftError naming the template's file.

One fork renders a whole batch, so the cost is one fork, not one per conversation.
Where ``os.fork`` does not exist (Windows) templates are rendered in this process, unbounded.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import select
import signal
import struct
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from graftmerge.errors import GraftError

resource = importlib.import_module("resource") if os.name == "posix" else None  # rlimits: POSIX only

RENDER_SECONDS = 5.0  # one conversation (SmolLM2's template renders one in about 0.1 ms)
BATCH_SECONDS = 30.0  # a whole batch, plus BATCH_SECONDS_PER_CONVERSATION for each conversation in it
BATCH_SECONDS_PER_CONVERSATION = 0.01
MEMORY_BYTES = 1 << 30  # what the renderer may allocate beyond this process's address space
MAX_TEXT_CHARACTERS = 1 << 24  # one rendered conversation
TEMPLATE_FILES = ("chat_template.jinja", "tokenizer_config.json")  # where a model folder keeps its template


@dataclass(frozen=True)
class Conversation:
    """One rendering to do: ``apply_chat_template(messages, tokenize=False, **options)``, and where it came from."""

    messages: list[dict]
    where: str  # "data.jsonl:3", for messages
    options: dict  # add_generation_prompt, continue_final_message, ...


@dataclass(frozen=True)
class Rendering:
    """A conversation's rendered text, or the first line of the error the template raised."""

    text: str | None
    error: str | None = None


class OverBudget(Exception):
    """The renderer did not answer in time, died, or reported a budget it ran past."""


def template_file(tokenizer: Any) -> str:
    """The file the tokenizer's chat template was read from, for messages (best effort, never fails)."""
    named = getattr(tokenizer, "graftmerge_template_file", None)
    if named:
        return str(named)
    folder = Path(str(getattr(tokenizer, "name_or_path", "") or "."))
    for name in TEMPLATE_FILES:
        if (folder / name).is_file():
            return str(folder / name)
    return f"the chat template of {folder}"


def render_conversations(tokenizer: Any, conversations: Sequence[Conversation]) -> list[Rendering]:
    """Each conversation rendered by ``tokenizer.apply_chat_template`` within the budget, in a child process.

    A template that raises gives that conversation's Rendering an ``error``; a template past
    the budget is a GraftError naming its file and the conversation it was rendering.
    """
    if not conversations:
        return []
    if not hasattr(os, "fork"):
        return [render_one(tokenizer, conversation) for conversation in conversations]
    read_end, write_end = os.pipe()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # Python 3.12+: fork of a process with threads
        pid = os.fork()
    if pid == 0:  # the child: render, write, exit without running any of the parent's exit handlers
        os.close(read_end)
        render_in_child(tokenizer, conversations, write_end)
    os.close(write_end)
    results: list[Rendering] = []
    try:
        deadline = time.monotonic() + BATCH_SECONDS + BATCH_SECONDS_PER_CONVERSATION * len(conversations)
        while len(results) < len(conversations):
            results.append(read_rendering(read_end, min(deadline, time.monotonic() + RENDER_SECONDS)))
    except OverBudget as reason:
        where = conversations[len(results)].where
        raise GraftError(f"{template_file(tokenizer)}: the chat template ran past its budget ({reason}) rendering "
                         f"{where}; a chat template is code, and this one may never finish: fix it, or give another "
                         "with --chat-template FILE") from None
    finally:
        os.close(read_end)
        stop(pid)
    return results


def conversation_key(messages: Any, options: dict) -> str:
    """How a rendering is looked up: the messages and options as canonical JSON."""
    return json.dumps([messages, options], sort_keys=True)


def render_each_once(tokenizer: Any, conversations: Sequence[Conversation]) -> dict[str, Rendering]:
    """{conversation_key: rendering} of ``conversations`` (repeats rendered once), in one bounded batch."""
    unique: dict[str, Conversation] = {}
    for conversation in conversations:
        unique.setdefault(conversation_key(conversation.messages, conversation.options), conversation)
    return dict(zip(unique, render_conversations(tokenizer, list(unique.values()))))


def render_one(tokenizer: Any, conversation: Conversation) -> Rendering:
    """One conversation rendered here and now (the child's work)."""
    try:
        text = tokenizer.apply_chat_template(conversation.messages, tokenize=False, **conversation.options)
    except MemoryError:
        raise
    except Exception as error:  # a template is code: jinja raises TemplateError, templates raise their own
        lines = [line.strip() for line in str(error).splitlines() if line.strip()]
        return Rendering(None, lines[0] if lines else type(error).__name__)
    if not isinstance(text, str):
        return Rendering(None, f"the template rendered {type(text).__name__}, not text")
    return Rendering(text)


def render_in_child(tokenizer: Any, conversations: Sequence[Conversation], write_end: int) -> None:
    """Render every conversation and write each result to ``write_end``; never returns."""
    try:
        quiet = os.open(os.devnull, os.O_RDWR)
        for stream in (0, 1, 2):
            os.dup2(quiet, stream)
        limit_memory(MEMORY_BYTES)
        for conversation in conversations:
            try:
                rendering = render_one(tokenizer, conversation)
            except MemoryError:
                write_record(write_end, {"budget": f"more than {MEMORY_BYTES >> 20} MiB of memory"})
                break
            if rendering.text is not None and len(rendering.text) > MAX_TEXT_CHARACTERS:
                write_record(write_end, {"budget": f"a text of more than {MAX_TEXT_CHARACTERS:,} characters"})
                break
            write_record(write_end, {"text": rendering.text, "error": rendering.error})
    finally:
        os._exit(0)


def limit_memory(extra: int) -> None:
    """Cap this process's address space at its present size plus ``extra`` bytes (Linux; elsewhere nothing)."""
    if resource is None:
        return
    try:
        with open("/proc/self/statm") as handle:
            size = int(handle.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        wanted = size + extra
        if hard != resource.RLIM_INFINITY:
            wanted = min(wanted, hard)
        resource.setrlimit(resource.RLIMIT_AS, (wanted, hard))
    except (OSError, ValueError):  # no /proc (macOS: RLIMIT_AS is not enforced there anyway)
        return


def write_record(fd: int, record: dict) -> None:
    """One length-prefixed JSON record to ``fd`` (all of it)."""
    data = json.dumps(record).encode()
    view = memoryview(struct.pack(">Q", len(data)) + data)
    while view:
        view = view[os.write(fd, view):]


def read_rendering(fd: int, deadline: float) -> Rendering:
    """The next record from the child; OverBudget if it is late, missing or says a budget was passed."""
    size = struct.unpack(">Q", read_exactly(fd, 8, deadline))[0]
    if size > 8 * MAX_TEXT_CHARACTERS + 1024:  # JSON escapes at most 6 bytes a character
        raise OverBudget("a malformed answer from the renderer")
    record = json.loads(read_exactly(fd, size, deadline))
    if "budget" in record:
        raise OverBudget(record["budget"])
    return Rendering(record.get("text"), record.get("error"))


def read_exactly(fd: int, count: int, deadline: float) -> bytes:
    """``count`` bytes from ``fd`` by ``deadline``; OverBudget when time runs out or the writer is gone."""
    chunks, got = [], 0
    while got < count:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            raise OverBudget(f"more than {RENDER_SECONDS:g} s for one conversation, or "
                             f"{BATCH_SECONDS:g} s + {BATCH_SECONDS_PER_CONVERSATION:g} s a conversation in all")
        chunk = os.read(fd, min(count - got, 1 << 20))
        if not chunk:
            raise OverBudget("the renderer stopped: it ran out of memory or crashed")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def stop(pid: int) -> None:
    """The child killed if it still runs, and reaped."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
