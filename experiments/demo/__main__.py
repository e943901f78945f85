"""``python -m experiments.demo`` (from the repository's root)."""

from experiments.demo.cli import demo

demo(prog_name="python -m experiments.demo")
