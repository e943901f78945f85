"""``graftmerge sweep CONFIG --lambda ... --rho ... -o DIR``: a grid of grafts from one read of the inputs."""

from __future__ import annotations

import click
from mergekit.options import MergeOptions, add_merge_options

from graftmerge.adapter import import_hook
from graftmerge.cli.plan import parse_values


@click.command("sweep")
@click.argument("config_file", type=click.Path(dir_okay=False))
@click.option("--lambda", "lambda_list", required=True, metavar="L1,L2,...",
              help="Comma-separated values of the config's global `lambda`, e.g. 0.25,0.5,1.")
@click.option("--rho", "rho_list", required=True, metavar="R1,R2,...",
              help="Comma-separated ρ values, each in [0, 1); 0 = no mask.")
@click.option("-o", "--output", "out_dir", required=True, type=click.Path(file_okay=False),
              help="New (or empty) folder; receives one model folder per (λ, ρ).")
@add_merge_options
def sweep(merge_options: MergeOptions, config_file: str, lambda_list: str, rho_list: str, out_dir: str) -> None:
    """Graft CONFIG once per (λ, ρ) of a grid, reading the inputs once for all of them.

    Writes OUTPUT/lambda-<λ>_rho-<ρ>/ for every pair, each number as Python
    prints it (lambda-0.5_rho-0.001, lambda-1.0_rho-0.0): a complete model
    folder as mergekit-yaml writes it (config.json, tokenizer from the post model,
    sharded safetensors and index, README.md and the grid point's
    mergekit_config.yml). Each folder's tensors are bit for bit those of
    `mergekit-yaml` run on that mergekit_config.yml with the same options.

    \b
    Shared across the grid: the reads. A global mask needs a scoring pass
    before the merge, so inputs are read twice in all (not twice per grid
    point): the scoring pass reads each tensor and its Fisher once and scores
    Δ(λ) once per λ, fixing the exact threshold of every ρ, with one rotation
    Δ̃ = UᵀΔV per KFAC weight per λ; the writing pass reads each tensor once
    and grafts it for every grid point. The config's own lambda and rho
    are replaced; its per-model weights, fisher, mask and rho_scope apply.

    \b
    Memory: about that of one merge, whatever the grid size. One tensor's
    inputs and one grid point's graft are in memory at a time; each point's
    shard being filled waits on disk, in a scratch folder next to OUTPUT, and
    is read back only to be written, one shard at a time (--async-write does
    not apply). Shards, their names and the index are those mergekit-yaml
    writes with the same --out-shard-size. Disk, besides the outputs: up to
    one shard per grid point, and with a global KFAC mask Δ̃ of every KFAC
    weight (4 bytes per entry) per λ, until the sweep ends. All folders
    appear at once, only on success.

    \b
    graftmerge sweep graft.yml --lambda 0.25,0.5,1 --rho 0,0.001,0.01 -o sweep/ --out-shard-size 500M
    """
    # lazy: the graft plan and the sweep load mergekit's merge code only when the command runs, so --help stays fast
    from graftmerge.pipeline.config_files import read_graft_config
    from graftmerge.pipeline.sweep import grid, run_sweep

    import_hook.install()
    merge_options.apply_global_options()
    lambdas = parse_values(lambda_list, "--lambda")
    rhos = parse_values(rho_list, "--rho", rho=True)
    config, source, plan = read_graft_config(config_file)
    folders = run_sweep(config, source, plan, grid(lambdas, rhos), out_dir, merge_options)
    for folder in folders:
        click.echo(f"wrote {folder}")
