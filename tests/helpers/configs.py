"""Merge configs written as YAML text: graft (with fine-tunes, or with LoRA/delta entries)
and mergekit's task_arithmetic, the reference graft at ρ = 0 must equal."""

from __future__ import annotations

from pathlib import Path


def graft_yaml(
    post, donor, fine_tunes, *, rho=0.0, fisher=None, scope="global", lam=1.0, mask=None,
    dtype="float32", out_dtype="float32", extra_global="",
) -> str:
    models = f"  - model: {donor}\n    parameters: {{role: donor}}\n"
    for path, weight in fine_tunes:
        models += f"  - model: {path}\n    parameters: {{role: donor_ft, weight: {weight}}}\n"
    params = f"  lambda: {lam}\n  rho: {rho}\n  rho_scope: {scope}\n"
    if fisher:
        params += f"  fisher: {fisher}\n"
    if mask:
        params += f"  mask: {mask}\n"
    params += extra_global
    return (
        f"merge_method: graft\nbase_model: {post}\nmodels:\n{models}parameters:\n{params}"
        f"dtype: {dtype}\nout_dtype: {out_dtype}\n"
    )


def graft_config(post: Path, entries: list[tuple[str, str, float | None]], *, lam: float = 1.0, rho: float = 0.0,
                 fisher: Path | None = None, scope: str = "global", mask: str | None = None) -> str:
    models = ""
    for model, role, weight in entries:
        weight_text = "" if weight is None else f", weight: {weight}"
        models += f"  - model: {model}\n    parameters: {{role: {role}{weight_text}}}\n"
    parameters = f"  lambda: {lam}\n  rho: {rho}\n  rho_scope: {scope}\n"
    parameters += f"  fisher: {fisher}\n" if fisher else ""
    parameters += f"  mask: {mask}\n" if mask else ""
    return (f"merge_method: graft\nbase_model: {post}\nmodels:\n{models}parameters:\n{parameters}"
            "dtype: float32\nout_dtype: float32\n")


def task_arithmetic_yaml(post, donor, fine_tunes, out_dtype) -> str:
    models = f"  - model: {post}\n    parameters: {{weight: 1.0}}\n"
    for path, weight in fine_tunes:
        models += f"  - model: {path}\n    parameters: {{weight: {weight}}}\n"
    return (
        f"merge_method: task_arithmetic\nbase_model: {donor}\nmodels:\n{models}"
        f"parameters: {{normalize: false}}\ndtype: float32\nout_dtype: {out_dtype}\n"
    )
