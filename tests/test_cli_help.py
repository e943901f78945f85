"""``graftmerge --help`` is instant and truthful: no heavy import, summaries equal the commands' own."""

from __future__ import annotations

import importlib
import subprocess
import sys

import click
import pytest

from graftmerge.cli import LazyGroup, main


def lazy_groups(group: click.Group, path: str = "graftmerge"):
    """Every LazyGroup reachable from ``group`` (loading its lazy commands), with its command path."""
    yield path, group
    for name in group.list_commands(None):
        command = group.get_command(None, name)
        if isinstance(command, LazyGroup):
            yield from lazy_groups(command, f"{path} {name}")


def test_stored_summaries_equal_each_commands_short_help():
    checked = 0
    for path, group in lazy_groups(main):
        for name, (module, attribute, summary) in group.lazy_commands.items():
            command = getattr(importlib.import_module(module), attribute)
            assert summary == command.get_short_help_str(limit=10**6), f"{path} {name}: update the stored summary"
            checked += 1
    assert checked >= 10


@pytest.mark.parametrize("words", [[], ["fisher"], ["delta"]])
def test_group_help_imports_nothing_heavy(words):
    code = (
        "import sys\nfrom graftmerge.cli import main\n"
        f"try:\n    main({words + ['--help']!r}, standalone_mode=False)\nexcept SystemExit:\n    pass\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'transformers', 'mergekit', 'safetensors'}))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    assert lines[-1] == "[]", lines[-1]
    listed = "\n".join(lines[:-1])
    group = main if not words else main.get_command(None, words[0])
    for name in group.list_commands(None):
        assert f"  {name}" in listed, f"{name} missing from --help"
