"""``graftmerge demo``: the paper's minimal model, then a complete graft on generated tiny models.

Step 0 runs the gated-linear-experts model of the paper's §3 (a few seconds): the
Eq. 1 routing ratio and SFT vs SFT + merge vs graft at matched task-B gain.
Generates post / base / base-ft Qwen3-shaped checkpoints, estimates a diagonal
retention Fisher of the post model from its own sampled rollouts (the same code
as ``graftmerge fisher estimate --prompts``), grafts the
base → base-ft delta onto post with a global ρ mask through mergekit, and
prints what changed.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import click
import yaml

from graftmerge.adapter import import_hook
from graftmerge.errors import GraftError

DEMO_CONFIG = """\
merge_method: graft
base_model: {post}
models:
  - model: {donor}
    parameters: {{role: donor}}
  - model: {donor_ft}
    parameters: {{role: donor_ft, weight: {weight}}}
parameters:
  lambda: 1.0
  rho: {rho}
  fisher: {fisher}
  rho_scope: global
dtype: float32
out_dtype: float32
"""


def write_prompts(path: Path, vocab_size: int, count: int = 8, seed: int = 0) -> Path:
    """Random token prompts: the "old task" of a model that never had one."""
    # lazy: torch only when the demo runs, so `graftmerge demo --help` stays fast
    import torch

    generator = torch.Generator().manual_seed(seed)
    lines = [json.dumps({"prompt_ids": torch.randint(0, vocab_size, (4,), generator=generator).tolist()})
             for _ in range(count)]
    path.write_text("\n".join(lines) + "\n")
    return path


@click.command("demo")
@click.option("--workdir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Keep the generated models, cache and output here, a new or empty folder (default: a temporary "
                   "folder).")
@click.option("--rho", type=float, default=0.01, show_default=True, help="Fraction of directions to protect.")
@click.option("--weight", type=float, default=0.5, show_default=True, help="λ of the grafted delta.")
@click.option("--lm", "moved", flag_value="--lm", default=None, hidden=True)
@click.option("--full", "moved", flag_value="--full", hidden=True)
def demo(workdir: Path | None, rho: float, weight: float, moved: str | None) -> None:
    """Run a tiny end-to-end graft on generated checkpoints and print what it did.

    The small-LM experiment (formerly --lm, --full) is not installed: it lives in the
    repository's experiments/ (``python -m experiments.demo --lm``).
    """
    if moved is not None:
        raise GraftError(f"the small-LM experiment ({moved}) is not part of the installed package: from a checkout "
                         f"of the repository run `python -m experiments.demo {moved}` (experiments/README.md)")
    if workdir is not None and workdir.exists() and (not workdir.is_dir() or any(workdir.iterdir())):
        raise GraftError(f"--workdir {workdir} is not an empty folder; the demo writes models, a cache and configs "
                         "there and overwrites nothing it did not create: give a new or empty folder")
    # lazy: the estimator and the model generator load torch and transformers only when the demo runs
    from graftmerge.demo.tiny_models import make_graft_inputs
    from graftmerge.estimate.run import EstimateSettings, estimate_fisher

    import_hook.install()
    with tempfile.TemporaryDirectory(prefix="graftmerge-demo-") as scratch:
        root = workdir or Path(scratch)
        root.mkdir(parents=True, exist_ok=True)
        show = _shown(root, kept=workdir is not None)
        _minimal_model(root, show, kept="" if workdir else " (in the temporary folder: --workdir DIR keeps it)")
        where = root if workdir is not None else "a temporary folder (deleted at exit; --workdir DIR keeps every file)"
        click.echo(f"1. generating tiny Qwen3-shaped checkpoints in {where}")
        paths = make_graft_inputs(root)
        click.echo("2. graftmerge fisher estimate: diagonal retention Fisher of post from 16 of its own rollouts")
        prompts = write_prompts(root / "prompts.jsonl", vocab_size=256)
        estimate_fisher(EstimateSettings(
            model=paths["post"], output=root / "fisher-post-diag", kind="diagonal", prompts=prompts,
            samples_per_prompt=2, max_new_tokens=24, overwrite=True, progress=False,
        ))
        config = root / "graft.yml"
        config.write_text(DEMO_CONFIG.format(post=paths["post"], donor=paths["donor"], donor_ft=paths["donor_ft"],
                                             weight=weight, rho=rho, fisher=root / "fisher-post-diag"))
        out = root / "grafted"
        click.echo(f"3. mergekit-yaml {show(config)} {show(out)}")
        _run_mergekit(config, out)
        _report(paths, out, root / "fisher-post-diag", weight, show)
        _suggest(config, show)


def _shown(root: Path, kept: bool):
    """How the demo prints a path of its folder: whole when the folder is kept, else relative to the temporary
    folder (which is gone once the demo ends, so a whole path would name nothing)."""

    def show(path: Path) -> str:
        return str(path) if kept else str(path.relative_to(root))

    return show


def _minimal_model(root: Path, show, kept: str) -> None:
    # lazy: the minimal model loads torch and matplotlib only when the demo runs
    from graftmerge.demo.gated_experts import (
        format_gated_experts,
        plot_gated_experts,
        run_gated_experts,
    )

    click.echo("0. the paper's minimal model (§3): two regression tasks, a gated mixture of two linear experts")
    result = run_gated_experts()
    click.echo("   " + format_gated_experts(result).replace("\n", "\n   "))
    (root / "minimal_model.json").write_text(json.dumps(result, indent=1))
    click.echo(f"   curves: {show(plot_gated_experts(result, root / 'minimal_model.png'))}{kept}")


def _suggest(config: Path, show) -> None:
    # lazy: suggesting reads the graft plan (torch, mergekit) only when the demo runs
    from graftmerge.pipeline.suggest import suggest_graft

    click.echo(f"5. graftmerge suggest {show(config)}: λ and ρ from the Fisher cache and the delta alone")
    suggestion = suggest_graft(str(config), progress=False)
    click.echo(f"   ρ = {suggestion.rho:g} ({suggestion.rho_reason}); λ = {suggestion.lam:.3g} "
               f"(predicted old-task KL {suggestion.predicted_kl:.3g} nats/token, budget {suggestion.kl_budget:g})")


def _run_mergekit(config: Path, out: Path) -> None:
    # lazy: mergekit only when the demo runs, after import_hook.install(), so run_merge is the wrapped one
    from mergekit.config import MergeConfiguration
    from mergekit.merge import run_merge
    from mergekit.options import MergeOptions

    merge_config = MergeConfiguration.model_validate(yaml.safe_load(config.read_text()))
    run_merge(merge_config, str(out), options=MergeOptions(quiet=True), config_source=config.read_text())


def _report(paths: dict, out: Path, fisher_path: Path, weight: float, show) -> None:
    # lazy: checkpoints and Fisher caches load torch only when the demo runs
    from graftmerge.formats.checkpoint import Checkpoint
    from graftmerge.formats.fisher_cache import open_fisher_cache

    post, donor, ft, grafted = (Checkpoint(p) for p in (paths["post"], paths["donor"], paths["donor_ft"], out))
    fisher = open_fisher_cache(fisher_path)
    removed = total = 0
    fisher_full = fisher_kept = 0.0
    for name in sorted(post.tensors):
        delta = weight * (ft.read(name).float() - donor.read(name).float())
        applied = grafted.read(name).float() - post.read(name).float()
        f = fisher.diagonal(name)
        removed += int(((applied == 0) & (delta != 0)).sum())
        total += delta.numel()
        fisher_full += float((f * delta.square()).sum())
        fisher_kept += float((f * applied.square()).sum())
    click.echo(f"4. grafted {len(post.tensors)} tensors into {show(out)}")
    click.echo(f"   masked {removed} of {total} coordinates ({100 * removed / total:.2f}%)")
    click.echo(f"   Fisher-weighted change ΔᵀFΔ: {fisher_full:.3e} unmasked → {fisher_kept:.3e} grafted "
               f"({100 * (1 - fisher_kept / fisher_full):.1f}% of the retention cost removed)")
