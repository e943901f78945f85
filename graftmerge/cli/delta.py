"""``graftmerge delta ...``: thin click wrappers over :mod:`graftmerge.delta`."""

from __future__ import annotations

import json
from pathlib import Path

import click

from graftmerge.cli import LazyGroup, report_errors
from graftmerge.errors import GraftError

DELTA_COMMANDS = {
    "push": ("graftmerge.cli.hub", "delta_push",
             "Upload the delta folder PATH to the Hub model repo REPO_ID (org/name), with a model card."),
    "pull": ("graftmerge.cli.hub", "delta_pull",
             "Download the delta or PEFT LoRA adapter REPO_ID[@REV] (also hf://org/name@rev) into the Hugging Face "
             "cache."),
}


@click.group(cls=LazyGroup, lazy_commands=DELTA_COMMANDS, context_settings={"help_option_names": ["-h", "--help"]})
def delta() -> None:
    """Grafts as files: a delta Δ = weight·(θft − θdonor), like a LoRA adapter but full-rank.

    \b
    graftmerge delta extract ./base ./base-ft -o deltas/math    write Δ once
    graftmerge delta stats deltas/math --fisher fisher/post-diag --plot math.png

    \b
    Graft it onto a post-trained model (no donor or donor_ft needed):
      models:
        - model: ./deltas/math
          parameters: {role: delta, weight: 0.5}
    """


@delta.command("extract")
@click.argument("donor", type=click.Path(path_type=Path))
@click.argument("donor_ft", type=click.Path(path_type=Path))
@click.option("-o", "--output", required=True, type=click.Path(path_type=Path),
              help="Delta folder to create (must not exist).")
@click.option("--weight", default=1.0, show_default=True, type=float,
              help="Scale baked into Δ. Keep 1 and set `weight:` in the graft config instead: "
                   "then a float32 delta grafts bit-identically to donor + donor_ft.")
@click.option("--dtype", default="float32", show_default=True, type=click.Choice(["float32", "bfloat16"]),
              help="Stored precision of Δ (or of the LoRA factors); bfloat16 halves the size and rounds.")
@click.option("--shard-size", default=None, metavar="SIZE",
              help="Largest shard file, e.g. 500MB, 2GB (the default), 1GiB. Not with --rank.")
@click.option("--rank", default=None, metavar="K",
              help="Write a PEFT LoRA adapter instead: each weight's Δ truncated to rank K by SVD "
                   "(a K above the weight's smaller side keeps it exactly). Norms and biases are dropped; "
                   "lora_manifest.json and the output say how much of Δ each tensor kept.")
@click.option("--no-embeddings", is_flag=True,
              help="With --rank: no adapters on embedding layers (for runtimes that load Linear adapters only); "
                   "their Δ is reported as dropped.")
@click.option("-q", "--quiet", is_flag=True, help="No progress bar.")
@click.option("-v", "--verbose", is_flag=True, help="Show tracebacks.")
@report_errors
def extract(donor: Path, donor_ft: Path, output: Path, weight: float, dtype: str, shard_size: str | None,
            rank: str | None, no_embeddings: bool, quiet: bool, verbose: bool) -> None:
    """Write Δ = WEIGHT·(DONOR_FT − DONOR) to OUTPUT, one tensor at a time.

    OUTPUT gets sharded safetensors keyed by the model's parameter names, an
    index, the donor's config.json (so mergekit loads it as a model) and
    delta_manifest.json: both sources' fingerprints (tensor names, shapes,
    dtypes and a sampled content digest), the weight and the dtype. A graft
    that also names a `role: donor` checks the delta was made from it.
    The folder appears only when complete.

    With --rank K, OUTPUT is a PEFT LoRA adapter of DONOR (adapter_config.json,
    adapter_model.safetensors) that PeftModel.from_pretrained loads and graft
    takes as `role: delta`, plus lora_manifest.json.
    """
    # lazy: extraction loads torch and safetensors; only when the command runs, so --help stays fast
    from graftmerge.pipeline.delta_extract import extract_delta, extract_lora, extraction_summary

    if rank is None:
        if no_embeddings:
            raise GraftError("--no-embeddings goes with --rank (a full delta keeps every tensor)")
        path = extract_delta(donor, donor_ft, output, weight=weight, dtype=dtype, shard_bytes=shard_size,
                             progress=not quiet)
        click.echo(f"wrote delta {path}")
        return
    if shard_size is not None:
        raise GraftError("--shard-size does not apply with --rank: a PEFT adapter is one file")
    extraction = extract_lora(donor, donor_ft, output, rank=rank, weight=weight, dtype=dtype,
                              embeddings=not no_embeddings, progress=not quiet)
    for line in extraction_summary(extraction):
        click.echo(line)
    click.echo(f"wrote LoRA adapter {extraction.path}")


@delta.command("stats")
@click.argument("delta_folder", metavar="DELTA", type=click.Path(path_type=Path))
@click.option("--fisher", type=click.Path(path_type=Path),
              help="Fisher cache of the post model: adds the Fisher-weighted columns.")
@click.option("--base", type=click.Path(path_type=Path),
              help="For a PEFT LoRA folder: the model it was trained on (tensor names, shapes, donor).")
@click.option("--top", default=0.01, show_default=True, type=float,
              help="Fraction of coordinates counted as most sensitive (largest Fisher values).")
@click.option("--plot", type=click.Path(dir_okay=False, path_type=Path), help="Save a PNG plot here.")
@click.option("--json", "json_file", type=click.Path(dir_okay=False, path_type=Path),
              help="Save every number as JSON here.")
@click.option("--blocks-only", is_flag=True, help="Print per-block rows only (not every tensor).")
@click.option("-q", "--quiet", is_flag=True, help="No progress bar.")
@click.option("-v", "--verbose", is_flag=True, help="Show tracebacks.")
@report_errors
def stats(delta_folder: Path, fisher: Path | None, base: Path | None, top: float, plot: Path | None,
          json_file: Path | None, blocks_only: bool, quiet: bool, verbose: bool) -> None:
    """Where DELTA writes: L2 norms per tensor and per block; with --fisher, how sensitive.

    \b
    Columns, per tensor and per transformer block:
      L2 norm              ‖Δ‖₂ (blocks: norms combined in quadrature)
      F·Δ²                 Fisher-weighted size Σ_j F_j Δ_j²
      in own top 1%        share of F·Δ² on the tensor's own 1% of coordinates with the largest F
      in model top 1%      share of F·Δ² on the whole model's 1% of coordinates with the largest F
    The whole-delta "model top" share is the paper's Fig. 8 (right): how much of
    an update lands on the post model's most sensitive coordinates. A weight
    with only KFAC factors uses the diagonal of its KFAC Fisher, diag(P) diag(Q)ᵀ.
    DELTA may be a PEFT LoRA folder (adapter_config.json); then --base is needed.
    """
    # lazy: the report loads torch and matplotlib; only when the command runs, so --help stays fast
    from graftmerge.formats.output_file import check_output_file, replacing, write_output_file
    from graftmerge.pipeline.delta_report import compute_stats, format_table, plot_stats

    inputs = [("delta", delta_folder), ("Fisher cache", fisher), ("base model", base)]
    for option, path in (("--plot", plot), ("--json", json_file)):
        if path is not None:
            check_output_file(path, inputs, option)  # before any work: inputs are never modified
    result = compute_stats(delta_folder, fisher, top=top, progress=not quiet, base=base)
    click.echo(format_table(result, tensors=not blocks_only))
    if plot is not None:
        with replacing(plot, inputs, "--plot") as temporary:
            plot_stats(result, temporary)
        click.echo(f"wrote plot {plot}")
    if json_file is not None:
        write_output_file(json_file, json.dumps(result.to_json(), indent=1).encode(), inputs, "--json")
        click.echo(f"wrote {json_file}")

