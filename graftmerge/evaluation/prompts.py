"""Data lines as token ids, rendered the way the model itself sees and writes them.

A ``messages`` prompt goes through the tokenizer's chat template (rendered within a budget,
in a child process: :mod:`graftmerge.formats.bounded_template`) with the generation
prompt, exactly as ``apply_chat_template(..., add_generation_prompt=True)`` tokenizes it
(rendered text, no extra special tokens). The answer is scored as the model would
produce it: the template renders the conversation again with the answer as the
assistant's turn, and the continuation is what follows the generation prompt, trailing
whitespace dropped, so it ends with the template's end-of-turn token (``<|im_end|>``,
``<|eot_id|>``, ...). Where the template puts no special token after the answer, the
tokenizer's end-of-sequence token is appended: that is how the model ends a reply.

A plain-text ``prompt`` is tokenized with the tokenizer's special tokens (BOS where it
adds one), its answer appended as written, with no end token: plain text has no end of
turn.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from graftmerge.errors import GraftError
from graftmerge.evaluation.tasks import Example, Task
from graftmerge.formats.bounded_template import Conversation, Rendering, conversation_key, render_each_once

DEFAULT_EXTRA_NEW_TOKENS = 16  # default max_new_tokens = 2 × longest continuation + this
NO_TEMPLATE_HINT = ("give the model a chat template (graftmerge eval --chat-template FILE, or a "
                    "chat_template in its tokenizer_config.json) or write the line as plain text "
                    "(\"prompt\": \"...\" instead of \"messages\")")


@dataclass(frozen=True)
class Prepared:
    """One example as token ids: a prompt, and one continuation per candidate answer."""

    where: str
    prompt_ids: tuple[int, ...]
    continuations: tuple[tuple[int, ...], ...]  # the answer (choice: every choice), end of turn included
    target: int  # index of the answer among continuations
    reply: str  # exact: what the reply must read (the answer as the template renders it), stripped
    answer: str  # contains: what the reply must contain, stripped
    end_ids: tuple[int, ...]  # the end-of-turn token ending the continuations (none for plain text)
    chat: bool


def encode(tokenizer: Any, text: str, special: bool) -> tuple[int, ...]:
    """Token ids of ``text``; with ``special`` the tokenizer adds its BOS/EOS as it does by default."""
    return tuple(tokenizer(text, add_special_tokens=special)["input_ids"])


def is_special(tokenizer: Any, token_id: int) -> bool:
    """Whether ``token_id`` is one of the tokenizer's special tokens (those a decode skips)."""
    if token_id in tokenizer.all_special_ids:
        return True
    added = getattr(tokenizer, "added_tokens_decoder", {}).get(token_id)
    return bool(added is not None and getattr(added, "special", False))


def chat_conversations(task: Task, example: Example) -> list[Conversation]:
    """The renderings :func:`prepare` needs for a chat line: the prompt, and the conversation with each answer."""
    messages = with_system(task, example)
    wanted = [(messages, True)] + [([*messages, {"role": "assistant", "content": text}], False)
                                   for text in example.choices or (example.answer,)]
    return [Conversation(turns, example.where, {"add_generation_prompt": flag}) for turns, flag in wanted]


def render_suite(tokenizer: Any, tasks) -> dict[str, Rendering]:
    """{conversation key: rendering} of every chat line of ``tasks``, rendered in one bounded batch.

    Empty when the tokenizer has no template (:func:`render` then says what to do).
    """
    if not getattr(tokenizer, "chat_template", None):
        return {}
    wanted = [conversation for task in tasks if task.lm_eval is None for example in task.examples
              if example.messages is not None for conversation in chat_conversations(task, example)]
    return render_each_once(tokenizer, wanted)


def render(tokenizer: Any, messages: list[dict], where: str, generation_prompt: bool,
           rendered: dict[str, Rendering]) -> str:
    """The chat template's text for ``messages``, from ``rendered``; GraftError when there is none or it failed."""
    if not getattr(tokenizer, "chat_template", None):
        raise GraftError(f"{where}: \"messages\" need a chat template and the model's tokenizer has none; "
                         + NO_TEMPLATE_HINT)
    rendering = rendered[conversation_key(messages, {"add_generation_prompt": generation_prompt})]
    if rendering.error is not None:
        raise GraftError(f"{where}: the chat template fails on this conversation: {rendering.error}")
    return rendering.text


def chat_prompt_and_continuation(tokenizer: Any, messages: list[dict], answer: str, where: str,
                                  rendered: dict[str, Rendering]):
    """(prompt ids, continuation ids, end-of-turn ids) of a chat line with ``answer`` as the reply."""
    prompt = render(tokenizer, messages, where, True, rendered)
    full = render(tokenizer, [*messages, {"role": "assistant", "content": answer}], where, False, rendered)
    if not full.startswith(prompt):
        raise GraftError(f"{where}: the chat template does not render the generation prompt as a prefix of "
                         "the conversation with the answer, so the answer's tokens cannot be told apart")
    continuation = list(encode(tokenizer, full[len(prompt):].rstrip(), False))
    if continuation and is_special(tokenizer, continuation[-1]):
        end = (continuation[-1],)
    elif tokenizer.eos_token_id is not None:
        end = (tokenizer.eos_token_id,)
        continuation.append(tokenizer.eos_token_id)
    else:
        end = ()
    return encode(tokenizer, prompt, False), tuple(continuation), end


def with_system(task: Task, example: Example) -> list[dict]:
    """The line's messages, the task's system message first unless the line has its own."""
    messages = list(example.messages)
    if task.system is not None and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": task.system})
    return messages


def prepare(task: Task, example: Example, tokenizer: Any, rendered: dict[str, Rendering]) -> Prepared:
    """One example as token ids; GraftError naming the line for anything the model cannot be scored on.

    ``rendered``: :func:`render_suite` of the example's task (chat lines' template renderings).
    """
    candidates = example.choices or (example.answer,)
    for text in candidates:
        if not encode(tokenizer, text, False):
            raise GraftError(f"{example.where}: the answer {text!r} tokenizes to nothing with this model's tokenizer")
    if example.messages is not None:
        messages = with_system(task, example)
        parts = [chat_prompt_and_continuation(tokenizer, messages, text, example.where, rendered)
                 for text in candidates]
        prompt, end = parts[0][0], parts[0][2]
        if any(part[0] != prompt for part in parts):
            raise GraftError(f"{example.where}: the chat template renders the prompt differently per choice")
        continuations = tuple(part[1] for part in parts)
    else:
        prompt, end = encode(tokenizer, example.prompt, True), ()
        continuations = tuple(encode(tokenizer, text, False) for text in candidates)
    if not prompt:
        raise GraftError(f"{example.where}: the prompt tokenizes to nothing (the answer's first token needs a context)")
    target = candidates.index(example.answer)
    body = continuations[target][: len(continuations[target]) - len(end)]
    reply = tokenizer.decode(list(body), skip_special_tokens=True).strip()
    return Prepared(example.where, prompt, continuations, target, reply, example.answer.strip(), end,
                    example.messages is not None)


def generation_limit(task: Task, prepared: list[Prepared]) -> int:
    """max_new_tokens of an exact/contains task: its own, else 2 × its longest continuation + 16."""
    if task.max_new_tokens is not None:
        return task.max_new_tokens
    longest = max(len(c) for example in prepared for c in example.continuations)
    return 2 * longest + DEFAULT_EXTRA_NEW_TOKENS
