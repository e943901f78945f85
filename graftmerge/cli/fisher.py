"""``graftmerge fisher ...``: thin click wrappers over :mod:`graftmerge.estimate.run`."""

from __future__ import annotations

from pathlib import Path

import click

from graftmerge.cli import LazyGroup, report_errors
from graftmerge.cli.errors import exit_out_of_memory
from graftmerge.errors import OutOfMemory

FISHER_COMMANDS = {
    "push": ("graftmerge.cli.hub", "fisher_push",
             "Upload the Fisher cache folder PATH to the Hub model repo REPO_ID (org/name), with a model card."),
    "pull": ("graftmerge.cli.hub", "fisher_pull",
             "Download the Fisher cache REPO_ID[@REV] (also hf://org/name@rev) into the Hugging Face cache."),
    "compress": ("graftmerge.cli.fisher_compress", "fisher_compress",
                 "Copy a KFAC Fisher cache keeping only the top-K eigenvectors of each factor side."),
    "accumulate": ("graftmerge.cli.fisher_accumulate", "fisher_accumulate",
                   "Write OUT = decay·OLDER + NEWER, diagonal by diagonal (online EWC's running Fisher)."),
}


@click.group(cls=LazyGroup, lazy_commands=FISHER_COMMANDS, context_settings={"help_option_names": ["-h", "--help"]})
def fisher() -> None:
    """Retention Fisher caches of a post-trained model."""


@fisher.command("estimate")
@click.argument("model", type=click.Path(path_type=Path))
@click.option(
    "-o",
    "--output",
    required=True,
    type=click.Path(path_type=Path),
    help="Cache folder to write (e.g. fisher/NAME).",
)
@click.option(
    "--kind", type=click.Choice(["diagonal", "kfac", "both"]), default="diagonal", show_default=True
)
@click.option(
    "--rollouts",
    type=click.Path(path_type=Path),
    help="JSONL of prompt/completion, messages, or prompt_ids/completion_ids.",
)
@click.option(
    "--prompts",
    type=click.Path(path_type=Path),
    help="JSONL of prompts; completions are sampled from MODEL.",
)
@click.option("--samples-per-prompt", default=1, show_default=True)
@click.option(
    "--sample-batch-size",
    default=16,
    show_default=True,
    metavar="N",
    help="Prompts sampled together per forward (--prompts); the samples do not depend on it.",
)
@click.option("--max-new-tokens", default=256, show_default=True)
@click.option("--temperature", default=1.0, show_default=True)
@click.option("--top-p", default=1.0, show_default=True)
@click.option("--seed", default=0, show_default=True)
@click.option(
    "--save-rollouts", type=click.Path(path_type=Path), help="Keep the sampled rollouts as JSONL."
)
@click.option(
    "--modules",
    multiple=True,
    metavar="GLOB",
    help="Only parameters whose names match (repeatable).",
)
@click.option("--batch-size", default=8, show_default=True, help="Sequences per forward/backward.")
@click.option(
    "--dtype",
    default="auto",
    show_default=True,
    type=click.Choice(["auto", "float32", "float64", "bfloat16", "float16"]),
)
@click.option(
    "--accumulator-dtype",
    default="float32",
    show_default=True,
    type=click.Choice(["float32", "float64"]),
)
@click.option(
    "--truncate",
    is_flag=True,
    help="Cut sequences longer than the model's context instead of failing.",
)
@click.option(
    "--checkpoint-every",
    default=0,
    show_default=True,
    metavar="N",
    help="Save the sums every N batches; a rerun resumes.",
)
@click.option("--restart", is_flag=True, help="Ignore an existing checkpoint of this output.")
@click.option("--overwrite", is_flag=True, help="Replace an existing cache at OUTPUT.")
@click.option(
    "--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda:LOCAL_RANK if available)."
)
@click.option("--source", default=None, help="Hub id of MODEL to record in the manifest.")
@click.option(
    "--revision", default=None, help="Revision (commit) of MODEL to record in the manifest."
)
@click.option("--attn-implementation", default="sdpa", show_default=True)
@click.option(
    "--trust-remote-code",
    is_flag=True,
    help="Run MODEL's own code (its config.json's auto_map) if it needs it; only for a model you trust. "
    "Without it such a model is refused, never asked about.",
)
@click.option(
    "--fsdp",
    is_flag=True,
    help="Shard the model and the sums over the torchrun ranks with FSDP2 (opt-in; needs torchrun and --rollouts): "
    "for a post model no single device holds.",
)
@click.option(
    "--collective-timeout",
    default=1800.0,
    show_default=True,
    metavar="SECONDS",
    help="--fsdp: a collective waiting this long on a lost rank fails (no cache is written).",
)
@click.option(
    "--dry-run",
    is_flag=True,
    help="Print the memory one process, and each --fsdp rank, would need (from config.json; nothing is run).",
)
@click.option(
    "--world-size",
    type=int,
    default=None,
    metavar="N",
    help="--dry-run: the number of --fsdp ranks to plan for (default: $WORLD_SIZE, else 2).",
)
@click.option("--no-progress", is_flag=True, help="No progress bar.")
@click.option("-v", "--verbose", is_flag=True, help="Show tracebacks.")
@report_errors
def estimate(
    model: Path, output: Path, modules: tuple[str, ...], no_progress: bool, verbose: bool, **options
) -> None:
    """Estimate the retention Fisher of MODEL (a local causal-LM folder) into a cache.

    \b
    graftmerge fisher estimate ./post -o fisher/post-kfac --kind kfac --rollouts rollouts.jsonl
    torchrun --nproc-per-node 4 $(which graftmerge) fisher estimate ./post -o fisher/x ...
    """
    # lazy: the estimator loads torch and transformers; only when the command runs, so --help stays fast
    from graftmerge.estimate.run import EstimateSettings, estimate_fisher

    world_size = options.pop("world_size")
    settings = EstimateSettings(
        model=model, output=output, modules=modules, progress=not no_progress, **options
    )
    if settings.dry_run:
        import os

        from graftmerge.estimate.memory_plan import dry_run

        click.echo(dry_run(settings, world_size or int(os.environ.get("WORLD_SIZE", "2"))))
        return
    if settings.save_rollouts is not None:  # checked before any work: inputs and OUTPUT are never overwritten
        from graftmerge.formats.output_file import check_output_file

        check_output_file(settings.save_rollouts, [
            ("model", settings.model), ("prompts file", settings.prompts), ("rollouts file", settings.rollouts),
            ("output folder", settings.output)], "--save-rollouts")
    if settings.fsdp:
        from graftmerge.estimate.sharded_run import estimate_fisher_sharded

        try:
            written = estimate_fisher_sharded(settings)
        except OutOfMemory as error:
            if verbose:
                raise
            exit_out_of_memory(error)
    else:
        written = estimate_fisher(settings)
    if written is not None:
        click.echo(f"wrote {written}")
