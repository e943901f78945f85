"""Model cards (README.md) for graftmerge artifacts pushed to the Hub.

Pure functions from a manifest to markdown: the card says what the artifact is, for
which model, from which data, how big, and how to use it, so a repo is useful to
someone who finds it on the Hub without graftmerge's docs.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import yaml

from graftmerge.errors import GraftError
from graftmerge.hub.references import parse_hub_reference

MAX_LISTED_ITEMS = 6  # long lists in estimator settings are shortened to this many items


def hub_model_id(source: Any) -> str | None:
    """``source`` when it names a Hub model (``org/name``), else None (a local path, nothing)."""
    if not isinstance(source, str) or source.startswith(("hf://", ".", "/", "~")):
        return None
    try:
        reference = parse_hub_reference(source)
    except GraftError:
        return None
    return reference.repo_id if reference.revision is None else None


def front_matter(metadata: Mapping[str, Any]) -> str:
    """The YAML block the Hub reads (base_model, library_name, tags)."""
    return "---\n" + yaml.safe_dump(dict(metadata), sort_keys=False, allow_unicode=True) + "---\n"


def human_bytes(size: int) -> str:
    """``size`` in decimal units (``1.5 MB``), as the Hub shows file sizes."""
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if size < 1000 or unit == "TB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    raise AssertionError("unreachable")


def _flatten(record: Any, prefix: str = "") -> list[tuple[str, str]]:
    """Nested settings as ``a.b: value`` rows; long lists shortened."""
    if isinstance(record, Mapping):
        rows = []
        for key, value in record.items():
            rows += _flatten(value, f"{prefix}{key}.")
        return rows
    if isinstance(record, list) and len(record) > MAX_LISTED_ITEMS:
        shown = ", ".join(map(str, record[:MAX_LISTED_ITEMS]))
        record = f"[{shown}, … {len(record) - MAX_LISTED_ITEMS} more]"
    elif isinstance(record, list):
        record = json.dumps(record)
    return [(prefix.rstrip("."), str(record))]


def _escape(cell: str) -> str:
    return cell.replace("|", "\\|").replace("\n", " ")


def _table(rows: list[tuple[str, str]], header: tuple[str, str]) -> str:
    if not rows:
        return "_(none recorded)_\n"
    lines = [f"| {header[0]} | {header[1]} |", "|---|---|"]
    lines += [f"| `{key}` | {_escape(value)} |" for key, value in rows]
    return "\n".join(lines) + "\n"


def _metadata(base_model: str | None, tags: list[str]) -> dict[str, Any]:
    """The front matter's fields; ``base_model`` only when the artifact's model is on the Hub."""
    metadata: dict[str, Any] = {}
    if base_model:
        metadata["base_model"] = base_model
    metadata["library_name"] = "graftmerge"
    metadata["tags"] = tags
    return metadata


def render_fisher_card(
    manifest: Mapping[str, Any], repo_id: str, revision: str | None, file_sizes: Mapping[str, int]
) -> str:
    """README.md of a Fisher cache repo: front matter, retention data, counts, sizes, usage."""
    model = manifest.get("model", {})
    entries: Mapping[str, Mapping[str, Any]] = manifest.get("entries", {})
    kind = manifest.get("kind", "unknown")
    base_model = hub_model_id(model.get("source"))
    tags = ["graftmerge", "fisher", "retention-fisher"]
    tags += {"diagonal": ["diagonal"], "kfac": ["kfac"], "mixed": ["kfac", "diagonal"]}.get(kind, [])
    reference = repo_id if revision in (None, "main") else f"{repo_id}@{revision}"
    subject = base_model or model.get("source", "an unnamed model")
    model_revision = f" (revision `{model['revision']}`)" if model.get("revision") else ""
    return (
        front_matter(_metadata(base_model, tags))
        + f"\n# Retention Fisher of {subject}\n\n"
        f"A **{kind}** retention Fisher cache (graftmerge cache format v{manifest.get('format_version')}) "
        f"of `{subject}`{model_revision}: how sensitive the post-trained model's behaviour on its own "
        "rollouts is to each direction of its weights. graftmerge's `graft` merge method "
        "([grafting](https://arxiv.org/abs/2610.05872)) reads it to keep a grafted fine-tuning "
        "delta out of the directions the model needs most.\n\n"
        + _fisher_records(manifest, entries, file_sizes)
        + _fisher_usage(base_model, reference, entries)
    )


def _fisher_records(manifest: Mapping[str, Any], entries: Mapping[str, Mapping[str, Any]],
                    file_sizes: Mapping[str, int]) -> str:
    """The data digests, estimator settings and sizes: what a reader needs to trust the cache."""
    model = manifest.get("model", {})
    estimator = manifest.get("estimator", {})
    data = estimator.get("data", {}) if isinstance(estimator, Mapping) else {}
    digests = [(key, value) for key, value in _flatten(data) if key.endswith("sha256") or key == "token_sha256"]
    settings = [(key, value) for key, value in _flatten(estimator) if not key.startswith("data.")]
    counts = _flatten(manifest.get("counts", {}))
    n_kfac = sum(1 for e in entries.values() if "kfac" in e)
    n_diagonal = sum(1 for e in entries.values() if "diagonal" in e)
    total = sum(file_sizes.values())
    return (
        "## Retention data\n\n"
        + _table(digests, ("data", "sha256"))
        + "\n### Estimator settings\n\n"
        + _table(settings, ("setting", "value"))
        + "\n## Size\n\n"
        + _table(counts, ("count", "value"))
        + f"\n- weights with Fisher entries: {len(entries)} ({n_kfac} KFAC, {n_diagonal} diagonal)\n"
        f"- post model tensors fingerprinted: {len(model.get('tensors', {}))}\n"
        f"- files: {len(file_sizes)} safetensors shard(s) + `fisher_manifest.json`, {human_bytes(total)} in all\n\n"
    )


def _fisher_usage(base_model: str | None, reference: str, entries: Mapping[str, Any]) -> str:
    """A merge config and pull commands naming this repo, so the card can be copied from."""
    example_layer = "model.layers.0.*" if any(n.startswith("model.layers.0.") for n in entries) else next(
        iter(sorted(entries)), "model.layers.0.*")
    return (
        "## Use it in a merge\n\n"
        "```yaml\n"
        "merge_method: graft\n"
        f"base_model: {base_model or './post'}   # the post model this cache was estimated on\n"
        "models:\n"
        "  - model: ./base\n"
        "    parameters: {role: donor}\n"
        "  - model: ./base-ft\n"
        "    parameters: {role: donor_ft}\n"
        "parameters:\n"
        "  rho: 0.01\n"
        f"  fisher: {reference}\n"
        "```\n\n"
        "`fisher:` takes `org/name@revision` (or `hf://org/name@revision`); offline "
        "(`HF_HUB_OFFLINE=1`) it is read from the local Hugging Face cache. Download it ahead:\n\n"
        "```bash\n"
        f"graftmerge fisher pull {reference}                          # into the Hugging Face cache\n"
        f"graftmerge fisher pull {reference} -o fisher/mine --layers '{example_layer}'   # only some weights\n"
        "```\n\n"
        "A cache is refused by a merge whose `base_model` has other tensor names or shapes. It is data "
        "only (safetensors shards and a JSON manifest): `graftmerge fisher pull` fetches nothing else.\n"
    )


def render_delta_card(
    manifest: Mapping[str, Any], repo_id: str, revision: str | None, file_sizes: Mapping[str, int]
) -> str:
    """README.md of a delta repo: front matter and a summary of the manifest's own records."""
    model = manifest.get("model", {}) if isinstance(manifest.get("model"), Mapping) else {}
    base_model = hub_model_id(model.get("source")) or hub_model_id(manifest.get("base_model"))
    reference = repo_id if revision in (None, "main") else f"{repo_id}@{revision}"
    summary = [
        (key, value)
        for key, value in _flatten({k: v for k, v in manifest.items() if k not in ("files", "tensors", "entries")})
        if not key.startswith("model.tensors")
    ]
    return (
        front_matter(_metadata(base_model, ["graftmerge", "delta"]))
        + f"\n# graftmerge delta{f' for {base_model}' if base_model else ''}\n\n"
        "A precomputed fine-tuning delta (θft − θdonor) in graftmerge's delta format, to be "
        "grafted onto a post-trained model with graftmerge's `graft` merge method.\n\n"
        "## Records\n\n"
        + _table(summary, ("field", "value"))
        + f"\n- files: {len(file_sizes)} data file(s) + `delta_manifest.json`, {human_bytes(sum(file_sizes.values()))} in all\n\n"
        "## Download\n\n"
        "```bash\n"
        f"graftmerge delta pull {reference} -o deltas/mine\n"
        "```\n\n"
        "The repo holds data only: safetensors shards, their index, the donor's `config.json` "
        "(so mergekit can load the delta as a model) and the manifest. graftmerge pushes and pulls "
        "`config.json` without `auto_map` or `custom_pipelines`, the fields that make transformers "
        "import code, so a pulled delta never runs anyone's code, even under `--trust-remote-code`.\n"
    )
