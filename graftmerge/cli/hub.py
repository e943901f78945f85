"""``graftmerge fisher push|pull`` and ``graftmerge delta push|pull``: thin click wrappers.

One factory per direction, so a kind of artifact gets both commands from its
:class:`~graftmerge.hub.artifact_kind.ArtifactKind` alone; ``delta pull`` takes either of
two kinds (a graftmerge delta, a PEFT LoRA adapter), whichever the repo is.
"""

from __future__ import annotations

from pathlib import Path

import click

from graftmerge.cli import report_errors
from graftmerge.formats.json_file import load_json_file
from graftmerge.hub.artifact_kind import ArtifactKind
from graftmerge.hub.cards import human_bytes
from graftmerge.hub.kinds import DELTA, DELTA_KINDS, FISHER, LORA_ADAPTER
from graftmerge.hub.pull import PullResult, pull_first_kind
from graftmerge.hub.push import push_artifact
from graftmerge.hub.references import parse_hub_reference

TOKEN_HELP = "Hub token (default: $HF_TOKEN, or the one saved by `hf auth login`)."


def push_command(kind: ArtifactKind, example: str) -> click.Command:
    """``<kind> push PATH REPO_ID``: upload a local artifact folder, resumably."""

    @click.command("push", context_settings={"help_option_names": ["-h", "--help"]})
    @click.argument("path", type=click.Path(path_type=Path))
    @click.argument("repo_id")
    @click.option("--private", is_flag=True, help="Create the repo private (an existing repo keeps its visibility).")
    @click.option(
        "--revision", metavar="BRANCH", default=None, help="Push to this branch (created if missing); default main."
    )
    @click.option("--token", default=None, help=TOKEN_HELP)
    @click.option("-q", "--quiet", is_flag=True, help="No progress bar.")
    @click.option("-v", "--verbose", is_flag=True, help="Show tracebacks.")
    @report_errors
    def push(path: Path, repo_id: str, private: bool, revision: str | None, token: str | None,
             quiet: bool, verbose: bool) -> None:
        """Push, then say what was sent and how to use it (the --help text is set below, per kind)."""
        result = push_artifact(kind, path, repo_id, revision=revision, private=private, token=token,
                               progress=not quiet)
        reference = result.repo_id if result.revision == "main" else f"{result.repo_id}@{result.revision}"
        sent = sum((path / name).stat().st_size for name in result.uploaded if (path / name).exists())
        if result.commits == 0:
            click.echo(f"{reference} is up to date ({len(result.unchanged)} files already on the Hub)")
        else:
            click.echo(
                f"pushed {reference}: {len(result.uploaded)} file(s) uploaded ({human_bytes(sent)}) in "
                f"{result.commits} commit(s), {len(result.unchanged)} already there"
                + (f", {len(result.deleted)} removed" if result.deleted else "")
            )
        click.echo(f"use it: `{kind.name}: {reference}` (or `graftmerge {kind.name} pull {reference}`)")

    push.help = (
        f"Upload the {kind.label} folder PATH to the Hub model repo REPO_ID (org/name), with a model card.\n\n"
        "Re-run the same command after an interruption: files already on the Hub (same size and "
        "sha256) are skipped, each data file is its own commit, and the manifest goes in last, so "
        f"the repo reads as a {kind.label} only once it is complete.\n\n"
        f"\b\n{example}"
    )
    return push


def usage(kind: ArtifactKind, result: PullResult, use: object) -> str:
    """How a merge config names what was pulled (and, for an adapter, what it was trained on)."""
    if kind is FISHER:
        return f"use it: `fisher: {use}`"
    line = f"use it: `- model: {use}` with `parameters: {{role: delta}}`"
    if kind is LORA_ADAPTER:
        config = load_json_file(result.folder / LORA_ADAPTER.manifest_name, "adapter config")
        base = config.get("base_model_name_or_path")  # a stranger's text: shown only if plain and short
        if isinstance(base, str) and base and base.isprintable() and len(base) <= 200:
            line += f" (a LoRA of {base}: graft it onto a model post-trained from that base)"
    return line


def pull_command(kinds: ArtifactKind | tuple[ArtifactKind, ...], example: str) -> click.Command:
    """``<kind> pull REPO_ID[@REV]``: fetch into the HF cache, optionally assemble a folder.

    Several kinds: the first one the repo is (see ``pull_first_kind``); the first names the command.
    """
    kinds = kinds if isinstance(kinds, tuple) else (kinds,)
    kind, label = kinds[0], " or ".join(k.label for k in kinds)

    @click.command("pull", context_settings={"help_option_names": ["-h", "--help"]})
    @click.argument("reference", metavar="REPO_ID[@REV]")
    @click.option("-o", "--output", type=click.Path(path_type=Path), default=None,
                  help=f"Also assemble the {label} as this folder (hard links into the HF cache).")
    @click.option("--overwrite", is_flag=True, help="Replace an existing OUTPUT folder.")
    @click.option("--token", default=None, help=TOKEN_HELP)
    @click.option("-q", "--quiet", is_flag=True, help="No progress bar.")
    @click.option("-v", "--verbose", is_flag=True, help="Show tracebacks.")
    @report_errors
    def pull(reference: str, output: Path | None, overwrite: bool, token: str | None, quiet: bool,
             verbose: bool, layers: tuple[str, ...] = ()) -> None:
        """Pull, then say what was fetched and how to use it (the --help text is set below, per kind)."""
        target = parse_hub_reference(reference)
        pulled, result = pull_first_kind(kinds, target, output=output, layers=layers, token=token,
                                         overwrite=overwrite, progress=not quiet)
        click.echo(
            f"pulled {pulled.label} {target} (commit {result.commit[:12]}): {len(result.files)} data file(s), "
            f"{len(result.fetched)} downloaded, {len(result.files) - len(result.fetched)} already cached"
        )
        for name, fields in result.stripped.items():
            click.echo(f"{name}: removed {', '.join(fields)} (a pulled config never names code to run)")
        click.echo(str(result.folder))
        use = f"./{output}" if output is not None and not Path(output).is_absolute() else (output or target)
        click.echo(usage(pulled, result, use))

    if kind.select_layers is not None:
        pull = click.option(
            "--layers", "layers", multiple=True, metavar="GLOB",
            help="Only these weights (fnmatch on parameter names, repeatable); needs -o. "
                 "The other weights are then grafted unmasked.",
        )(pull)
    named = f"`{kind.name}: org/name@rev`" if kind is FISHER else "`model: org/name@rev` (role: delta)"
    adapters = (
        (
            " From a PEFT LoRA repo only adapter_config.json (checked field by field first) and "
            "adapter_model.safetensors are pulled: no base weights, no .bin, no code."
        )
        if LORA_ADAPTER in kinds
        else ""
    )
    pull.help = (
        f"Download the {label} REPO_ID[@REV] (also hf://org/name@rev) into the Hugging Face cache.\n\n"
        f"Afterwards {named} in a merge config works offline (HF_HUB_OFFLINE=1). "
        "An interrupted pull resumes (files already cached are skipped); the manifest is "
        "written last, so a half-downloaded copy is never used. Only .safetensors and .json files "
        "are pulled, links planted in the cache are refused, and a config's auto_map and "
        f"custom_pipelines are removed, so nothing pulled can make transformers run code.{adapters}\n\n"
        f"\b\n{example}"
    )
    return pull


fisher_push = push_command(
    FISHER, "graftmerge fisher push fisher/post-kfac me/post-kfac-fisher\n"
            "graftmerge fisher push fisher/post-kfac me/post-kfac-fisher --revision v2 --private",
)
fisher_pull = pull_command(
    FISHER, "graftmerge fisher pull me/post-kfac-fisher@v2\n"
            "graftmerge fisher pull me/post-kfac-fisher -o fisher/post-kfac\n"
            "graftmerge fisher pull me/post-kfac-fisher -o fisher/attn --layers 'model.layers.*.self_attn.*'",
)
delta_push = push_command(DELTA, "graftmerge delta push deltas/math me/math-delta")
delta_pull = pull_command(DELTA_KINDS, "graftmerge delta pull me/math-delta -o deltas/math\n"
                                       "graftmerge delta pull someone/llama-math-lora@v1 -o loras/math")
