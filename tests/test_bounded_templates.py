"""Chat templates render within a budget (docs/security.md, class 18).

A model folder's template is code: loops without end, gigabyte strings, huge powers and
texts past the size bound are one ``error:`` line naming the template's file, and the
renderer is gone afterwards. Controls: an honest template renders exactly what the
tokenizer's own ``apply_chat_template`` renders; a template that raises, and the sandbox
escapes jinja2 already blocks, stay per-line errors; the real SmolLM2 template is
compared in tests/test_evaluation_smollm2.py.
"""

from __future__ import annotations

import json
import os
import re
import shutil

import pytest

from graftmerge.errors import GraftError
from graftmerge.estimate.rollouts import read_prompts, read_rollouts
from graftmerge.evaluation import Evaluator, load_tasks, load_tokenizer
from graftmerge.formats import bounded_template
from graftmerge.formats.bounded_template import Conversation, render_conversations
from tests.helpers.runners import error_line, run_cli
from tests.helpers.tiny_tokenizer import save_tiny_chat_model

MEMORY = r"more than 1024 MiB of memory|renderer stopped|more than 1 s"  # or slow enough to run out of time first
ENDLESS = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
HOSTILE = {  # case: (template, what the budget error says)
    "nested loops": (ENDLESS, r"more than 1 s for one conversation"),
    "huge power": ("{{ (7 ** (10 ** 8)) % 2 }}", r"more than 1 s for one conversation"),  # one C-level step
    "gigabyte string": ("{{ 'x' * 10000000000 }}", MEMORY),
    "doubling namespace": ("{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}"
                           "{% endfor %}{{ ns.s|length }}", MEMORY),
    "long text": ("{% for i in range(20000) %}{{ 'y' * 1000 }}{% endfor %}",
                  r"a text of more than 16,777,216 characters"),
}
LINES = [{"messages": [{"role": "user", "content": f"Question {i}?"}], "answer": f"Answer {i}."} for i in range(3)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("templates")
    model = save_tiny_chat_model(root / "model", architecture="llama", seed=2)
    (root / "d.jsonl").write_text("".join(json.dumps(line) + "\n" for line in LINES))
    (root / "tasks.yml").write_text("tasks:\n  - {name: chat, role: old, metric: nll, data: d.jsonl}\n")
    return {"root": root, "model": model, "tokenizer": load_tokenizer(model)}


@pytest.fixture
def quick_budget(monkeypatch):
    monkeypatch.setattr(bounded_template, "RENDER_SECONDS", 1.0)


def with_template(tiny, folder, template: str):
    shutil.copytree(tiny["model"], folder)
    (folder / "chat_template.jinja").write_text(template)
    return folder


def children() -> set[int]:
    """This process's child processes (a killed renderer must not be left behind)."""
    tasks = f"/proc/{os.getpid()}/task"
    found = set()
    for thread in os.listdir(tasks):
        with open(f"{tasks}/{thread}/children") as handle:
            found |= {int(pid) for pid in handle.read().split()}
    return found


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_a_template_past_its_budget_is_one_line_naming_its_file(tiny, tmp_path, quick_budget, case):
    template, expected = HOSTILE[case]
    folder = with_template(tiny, tmp_path / "model", "{{ bos_token }}" + template)
    before = children()
    with pytest.raises(GraftError) as raised:
        Evaluator(load_tasks(tiny["root"] / "tasks.yml"), load_tokenizer(folder), progress=False)
    message = str(raised.value)
    assert message.startswith(f"{folder / 'chat_template.jinja'}: the chat template ran past its budget"), message
    assert re.search(expected, message) and "d.jsonl:1" in message, message
    assert children() == before


def test_the_eval_command_says_it_in_one_line(tiny, tmp_path, quick_budget):
    folder = with_template(tiny, tmp_path / "model", ENDLESS)
    line = error_line(run_cli("graftmerge", "eval", str(folder), "--tasks", str(tiny["root"] / "tasks.yml"),
                              "--no-progress"))
    assert f"{folder / 'chat_template.jinja'}: the chat template ran past its budget" in line, line
    (tmp_path / "endless.jinja").write_text(ENDLESS)  # a template given instead of the folder's is named too
    line = error_line(run_cli("graftmerge", "eval", str(tiny["model"]), "--tasks", str(tiny["root"] / "tasks.yml"),
                              "--chat-template", str(tmp_path / "endless.jinja"), "--no-progress"))
    assert f"{tmp_path / 'endless.jinja'}: the chat template ran past its budget" in line, line


def test_an_honest_template_renders_what_the_tokenizer_renders(tiny):
    tokenizer = tiny["tokenizer"]
    conversations = [Conversation([{"role": "system", "content": "Be brief."}, *line["messages"]], "x", {flag: True})
                     for line in LINES for flag in ("add_generation_prompt", "continue_final_message")]
    conversations += [Conversation([{"role": "user", "content": "Zürich — 東京 \u0000 {{ not code }}"}], "y", {})]
    got = render_conversations(tokenizer, conversations)
    expected = [tokenizer.apply_chat_template(c.messages, tokenize=False, **c.options) for c in conversations]
    assert [g.text for g in got] == expected and not any(g.error for g in got)
    assert render_conversations(tokenizer, []) == []


@pytest.mark.parametrize("template, expected", [
    ("{{ raise_exception('only user turns, please') }}", r"fails on this conversation: only user turns, please"),
    ("{{ ''.__class__.__mro__[1].__subclasses__() }}", r"fails on this conversation: .*unsafe|access to attribute"),
    ("{{ cycler.__init__.__globals__.os.system('echo hi') }}", r"fails on this conversation: .*unsafe|attribute"),
])
def test_a_template_that_raises_or_escapes_stays_a_per_line_error(tiny, tmp_path, template, expected):
    folder = with_template(tiny, tmp_path / "model", template)
    with pytest.raises(GraftError, match=r"d\.jsonl:1: the chat template fails on this conversation"):
        Evaluator(load_tasks(tiny["root"] / "tasks.yml"), load_tokenizer(folder), progress=False)
    rendering = render_conversations(load_tokenizer(folder), [Conversation(LINES[0]["messages"], "x", {})])[0]
    assert rendering.text is None and re.search(expected, "fails on this conversation: " + rendering.error)


def test_fisher_estimate_chat_lines_are_rendered_within_the_same_budget(tiny, tmp_path, quick_budget):
    """Prompts and rollouts files with ``messages`` lines: the model's template, bounded; honest ones unchanged."""
    tokenizer = tiny["tokenizer"]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"messages": line["messages"]}) + "\n" for line in LINES))
    rollouts = tmp_path / "rollouts.jsonl"
    rollouts.write_text("".join(json.dumps({"messages": [*line["messages"], {"role": "assistant",
                                                                             "content": line["answer"]}]}) + "\n"
                                for line in LINES))
    expected = [tuple(tokenizer(tokenizer.apply_chat_template(line["messages"], tokenize=False,
                                                              add_generation_prompt=True),
                                add_special_tokens=False)["input_ids"]) for line in LINES]
    assert [ids for _, ids in read_prompts(prompts, lambda: tokenizer)] == expected
    assert [r.prompt_ids for r in read_rollouts(rollouts, lambda: tokenizer)[0]] == expected
    folder = with_template(tiny, tmp_path / "model", ENDLESS)
    hostile = load_tokenizer(folder)
    for reader, data in ((read_prompts, prompts), (read_rollouts, rollouts)):
        with pytest.raises(GraftError, match=rf"^{re.escape(str(folder / 'chat_template.jinja'))}: the chat template "
                                             rf"ran past its budget .* rendering {re.escape(str(data))}:1;"):
            reader(data, lambda: hostile)
    raising = load_tokenizer(with_template(tiny, tmp_path / "raising", "{{ raise_exception('no') }}"))
    with pytest.raises(GraftError, match=r"prompts\.jsonl:1: the chat template fails on this conversation: no"):
        read_prompts(prompts, lambda: raising)
