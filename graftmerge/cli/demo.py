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

import dataclasses
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
              help="Keep the generated models, cache and output here (default: a temporary folder).")
@click.option("--rho", type=float, default=0.01, show_default=True, help="Fraction of directions to protect.")
@click.option("--weight", type=float, default=0.5, show_default=True, help="λ of the grafted delta.")
@click.option("--lm", "size", flag_value="quick", default=None,
              help="Instead: train a small LM here and compare SFT, SFT + merge and grafts (~2.5 min on 2 cores).")
@click.option("--full", "size", flag_value="full", help="The --lm comparison at full size, 3 seeds, masks also at λ 1.5 and 2 (~20–25 min on 2 cores).")
@click.option("--tiny", "size", flag_value="tiny", hidden=True)
@click.option("--replay", type=float, default=None,
              help="With --lm/--full: task-A replay examples per new-fact example while learning the new "
                   "facts [default: 0.25]. 0 = SFT sees no task A at all, and forgets it.")
def demo(workdir: Path | None, rho: float, weight: float, size: str | None, replay: float | None) -> None:
    """Run a tiny end-to-end graft on generated checkpoints and print what it did.

    With --lm (or --full) it trains its own small Qwen3 instead: pretraining (the donor),
    post-training on an old task, new facts learned by SFT of the post model and by
    fine-tuning the donor; then SFT + merging and grafts (no mask, diagonal, KFAC, and
    `graftmerge suggest`'s point) through mergekit, scored on both tasks. Writes
    results.json and pareto.png to --workdir.
    """
    if replay is not None and size is None:
        raise GraftError("--replay applies to the small-LM comparison: add --lm or --full")
    if replay is not None and not 0 <= replay <= 10:
        raise GraftError(f"--replay {replay:g}: expected task-A replay examples per new-fact example in [0, 10]")
    if size is not None:
        _lm_demo(workdir, size, replay)
        return
    # lazy: the estimator and the model generator load torch and transformers only when the demo runs
    from graftmerge.estimate.run import EstimateSettings, estimate_fisher
    from graftmerge.testing.tiny_models import make_graft_inputs

    import_hook.install()
    with tempfile.TemporaryDirectory(prefix="graftmerge-demo-") as scratch:
        root = workdir or Path(scratch)
        root.mkdir(parents=True, exist_ok=True)
        _minimal_model(root)
        click.echo(f"1. generating tiny Qwen3-shaped checkpoints in {root}")
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
        click.echo(f"3. mergekit-yaml {config} {out}")
        _run_mergekit(config, out)
        _report(paths, out, root / "fisher-post-diag", weight)
        _suggest(config)


def _lm_demo(workdir: Path | None, size: str, replay: float | None) -> None:
    # lazy: transformers and the LM demo (torch, matplotlib) load only when --lm/--full runs
    import transformers

    from graftmerge.demo import lm_pipeline

    transformers.utils.logging.disable_progress_bar()
    settings = {"quick": lm_pipeline.QUICK, "full": lm_pipeline.FULL, "tiny": lm_pipeline.TINY}[size]
    if replay is not None:
        settings = dataclasses.replace(settings, replay=replay)
    with tempfile.TemporaryDirectory(prefix="graftmerge-demo-lm-") as scratch:
        root = workdir or Path(scratch)
        root.mkdir(parents=True, exist_ok=True)
        click.echo(f"training a small LM and comparing SFT, merging and grafts in {root} "
                   f"(task-A replay {settings.replay:g} per new example)")
        results = lm_pipeline.run_lm_demo(settings, root, echo=click.echo)
        click.echo(lm_pipeline.format_table(results["rows"]))
        for label, key in (("best graft", "best_graft"), ("best SFT + merge", "best_sft_merge")):
            row = results[key]
            click.echo(f"   {label} by (old + new)/2: {row['method']} λ {row['lam']:.3g} ρ {row['rho']}: "
                       f"old {row['old']:.3f}, new {row['new']:.3f}")
        for mask, landing in results["suggestion_vs_sweep"].items():
            click.echo(f"   suggest {mask} vs the best of its own ρ sweep by (old + new)/2: "
                       f"{landing['suggested']:.3f} vs {landing['best']:.3f} (ρ {landing['best_rho']:g}); "
                       f"predicted old-task KL {landing['predicted_kl']:.2g} nats/token, "
                       f"measured old-task NLL increase {landing['measured_nll_increase']:.2g}")
        click.echo(f"   λ = 0 merges score exactly as θpost: {results['lambda0_equals_post']}")
        if workdir is None:
            click.echo("   results.json and pareto.png were written to a temporary folder, removed now: "
                       "add --workdir DIR to keep them")
        else:
            click.echo(f"   results: {root / 'results.json'}, plot: {root / 'pareto.png'}")


def _minimal_model(root: Path) -> None:
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
    click.echo(f"   curves: {plot_gated_experts(result, root / 'minimal_model.png')}")


def _suggest(config: Path) -> None:
    # lazy: suggesting reads the graft plan (torch, mergekit) only when the demo runs
    from graftmerge.pipeline.suggest import suggest_graft

    click.echo(f"5. graftmerge suggest {config}: λ and ρ from the Fisher cache and the delta alone")
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


def _report(paths: dict, out: Path, fisher_path: Path, weight: float) -> None:
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
    click.echo(f"4. grafted {len(post.tensors)} tensors into {out}")
    click.echo(f"   masked {removed} of {total} coordinates ({100 * removed / total:.2f}%)")
    click.echo(f"   Fisher-weighted change ΔᵀFΔ: {fisher_full:.3e} unmasked → {fisher_kept:.3e} grafted "
               f"({100 * (1 - fisher_kept / fisher_full):.1f}% of the retention cost removed)")
