"""Finite in, finite out: the checks on what a graft computes, and the one line naming the culprit.

A graft checks two kinds of tensor, both of which it forms anyway, with one cheap reduction
each (:func:`graftmerge.math.finite.fits`):

- every **score** tensor (the threshold pass, ``plan``, ``sweep``, the kernel's own
  scoring): a score ``F·Δ²`` or ``σ d Δ̃²`` is finite only when Δ, the rotation
  Δ̃ = UᵀΔV and the score itself are, so a NaN or Inf never reaches the threshold search
  and never spends mask budget;
- every **result** the kernel hands to mergekit's writer, in the post model's dtype and
  cast to the output dtype: anything non-finite in an input, a LoRA product, a KFAC
  back-rotation or θpost + Δ' shows up there (a diagonal mask could zero a non-finite
  coordinate, so Δ under a diagonal mask is checked before it is masked).

Only when a check fails is the culprit looked for (:func:`nonfinite_error`): an input file
changed under the merge (its pinned identity) is named first; else each input's tensor is
read again and checked whole, then each term of Δ, then the rotation, and the error names
the tensor and the input it came from.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from graftmerge.errors import GraftError
from graftmerge.math.donor_delta import compute_dtype, donor_delta
from graftmerge.math.finite import all_finite, fits, largest_magnitude
from graftmerge.pipeline.graft_plan import GraftInputs

_HINT = "; fix that input, or lower lambda / the weight"


def check_scores(inputs: GraftInputs, name: str, scores: torch.Tensor, rows: tuple[int, int] | None = None,
                 rotated: torch.Tensor | None = None) -> None:
    """GraftError naming the culprit unless every score of ``name`` (its ``rows``) is finite."""
    if not all_finite(scores):
        raise nonfinite_error(inputs, name, rows, rotated=rotated, stage="scores")


def check_delta(inputs: GraftInputs, name: str, delta: torch.Tensor, rows: tuple[int, int] | None = None) -> None:
    """GraftError naming the culprit unless Δ of ``name`` is finite (before a diagonal mask may zero a value)."""
    if not all_finite(delta):
        raise nonfinite_error(inputs, name, rows, stage="delta")


def check_result(inputs: GraftInputs, name: str, result: torch.Tensor, out_dtype: torch.dtype | None,
                 given: Sequence[torch.Tensor | None]) -> None:
    """GraftError naming the culprit unless the kernel's ``result`` is finite, also cast to ``out_dtype``.

    ``given``: the kernel's inputs as mergekit handed them (post, donor, fine-tunes, deltas).
    """
    if not fits(result, out_dtype):
        raise nonfinite_error(inputs, name, None, given=given, out_dtype=out_dtype, result=result)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _sources(inputs: GraftInputs, with_post: bool) -> list:
    """The inputs in the order the kernel takes them: post (when asked), donor, fine-tunes, deltas."""
    sources = [inputs.post] if with_post else []
    sources += [inputs.donor] if inputs.donor is not None else []
    return sources + list(inputs.fine_tunes) + list(inputs.deltas)


def nonfinite_error(inputs: GraftInputs, name: str, rows: tuple[int, int] | None, *, stage: str = "result",
                    given: Sequence[torch.Tensor | None] | None = None, rotated: torch.Tensor | None = None,
                    out_dtype: torch.dtype | None = None, result: torch.Tensor | None = None) -> GraftError:
    """The one line saying where a non-finite value in tensor ``name`` came from (a failure path: slow is fine).

    ``stage``: what failed its check, ``scores``, ``delta`` or ``result`` (the kernel's output).
    """
    inputs.check_unchanged()  # a file rewritten under the merge is the cause, whatever it now holds
    where = f"tensor {name!r}" + (f" (rows {rows[0]}:{rows[1]})" if rows is not None else "")
    dtype = inputs.working_dtype(name)
    sources = _sources(inputs, with_post=stage == "result")
    if given is not None and inputs.donor is None:
        given = [given[0], *given[2:]]  # the kernel's donor slot is None with deltas only
    for index, source in enumerate(sources):
        problem = _input_problem(source, name, rows, dtype, given[index] if given is not None else None)
        if problem:
            return GraftError(problem)
    problem = _delta_problem(inputs, name, rows, dtype, where)
    if problem:
        return GraftError(problem)
    terms = _term_labels(inputs)
    if stage == "delta":  # Δ was not finite, yet every input read again is: it changed under the merge
        return GraftError(f"{where}: Δ from {terms} was not finite, but its inputs read again are: did an input "
                          "change during the merge? Run it again")
    if stage == "scores":
        if rotated is not None and not all_finite(rotated):
            return GraftError(f"{where}: its KFAC rotation Δ̃ = UᵀΔV overflows float32 (Δ from {terms} is finite, "
                              f"largest |Δ| {_largest(inputs, name, rows):.3g}){_HINT}")
        return GraftError(f"{where}: its Fisher scores overflow float32 (Δ from {terms} is finite, largest |Δ| "
                          f"{_largest(inputs, name, rows):.3g}, but too large to rank){_HINT}")
    return GraftError(_result_problem(inputs, name, where, dtype, given, out_dtype, result))


def _largest(inputs: GraftInputs, name: str, rows: tuple[int, int] | None) -> float:
    return largest_magnitude(inputs.read_delta(name, rows=rows))


def _term_labels(inputs: GraftInputs) -> str:
    """The inputs Δ is made of, by their labels."""
    return ", ".join(source.label for source in [*inputs.fine_tunes, *inputs.deltas])


def _input_problem(source, name: str, rows: tuple[int, int] | None, dtype: torch.dtype,
                   given: torch.Tensor | None) -> str | None:
    """What is wrong with ``source``'s tensor ``name``, or None: stored NaN/Inf, a LoRA product, or the cast."""
    if name not in source.tensors or not source.tensors[name].is_floating:
        return None
    if given is not None and all_finite(given):
        return None
    try:
        raw = source.read(name, rows)  # a delta folder and an adapter's factors say so themselves
    except GraftError as error:
        return str(error)
    if not all_finite(raw):
        if getattr(source, "bound", None) is not None:
            return adapter_problem(source, name, rows)
        return (f"{source.label}: tensor {name!r} contains NaN or Inf ({source.tensors[name].file or 'in memory'}); "
                "a graft would write it into the model: repair or replace that input")
    if not fits(raw, dtype):
        return (f"{source.label}: tensor {name!r} has values beyond {_dtype_name(dtype)}'s range (largest |x| "
                f"{largest_magnitude(raw):.3g}), the dtype this merge computes in; set a wider `dtype:`")
    return None


def adapter_problem(source, name: str, rows: tuple[int, int] | None = None) -> str:
    """Why a LoRA source (``LoraDelta``: Δ = s·B·A; ``LoraFineTune``: base + s·B·A) is not finite for ``name``."""
    adapter, weight = source.adapter, source.bound.get(name)
    where = f"{source.label}: tensor {name!r}"
    under = getattr(source, "base", None) or (getattr(source, "donor", None) if weight and weight.full_key else None)
    if under is not None and not all_finite(under.read(name, rows).float()):
        return f"{under.label}: tensor {name!r} contains NaN or Inf, or values beyond float32's range"
    keys = [weight.full_key] if weight is not None and weight.full_key else []
    if weight is not None and weight.module is not None:
        lora = adapter.modules[weight.module]
        keys += [lora.a_key, lora.b_key]
    for key in keys:
        stored = adapter.read(key)  # NaN or Inf as stored: a GraftError naming the key
        if not all_finite(stored.float()):
            return (f"{adapter.file or adapter.label}: adapter tensor {key!r} has values beyond float32's range "
                    f"(largest |x| {largest_magnitude(stored):.3g}, stored as {_dtype_name(stored.dtype)}); "
                    "a graft computes Δ in float32")
    if weight is not None and weight.module is not None:
        lora = adapter.modules[weight.module]
        if not all_finite(adapter.product(weight.module, weight.transposed)):
            return (f"{where}: the LoRA product scaling·B·A of module {weight.module} overflows float32 "
                    f"(scaling = {lora.scaling:.3g}); the adapter's factors or lora_alpha are too large")
    return f"{where}: the base tensor plus the adapter's Δ overflows float32; the adapter's Δ is too large"


def _delta_problem(inputs: GraftInputs, name: str, rows: tuple[int, int] | None, dtype: torch.dtype,
                   where: str) -> str | None:
    """Which term of Δ = Σ λ_i (θft_i − θdonor) + Σ λ_j δ_j overflows, its inputs all finite; None if Δ is finite."""
    read = lambda source: source.read(name, rows).to(dtype=dtype)  # noqa: E731
    plan = inputs.plan
    donor = read(inputs.donor) if inputs.donor is not None else None
    terms = [(ft, lam, [read(ft)], []) for ft, lam in zip(inputs.fine_tunes, plan.lambdas_for(name))]
    terms += [(delta, lam, [], [read(delta)]) for delta, lam in zip(inputs.deltas, plan.delta_lambdas_for(name))]
    for source, lam, fine_tunes, deltas in terms:
        term = donor_delta(donor, fine_tunes, [lam] * len(fine_tunes), deltas, [lam] * len(deltas))
        if not all_finite(term):
            what = "λ·weight · (θft − θdonor)" if fine_tunes else "λ·weight · δ"
            against = f" against {inputs.donor.label}" if fine_tunes else ""
            return (f"{where}: {what} of {source.label}{against} overflows {_dtype_name(term.dtype)} "
                    f"(λ·weight = {lam:.3g}){_HINT}")
    delta = inputs.read_delta(name, rows=rows)
    if not all_finite(delta):
        return (f"{where}: the sum Δ of {_term_labels(inputs)} overflows {_dtype_name(delta.dtype)} "
                f"(each term is finite){_HINT}")
    return None


def _result_problem(inputs: GraftInputs, name: str, where: str, dtype: torch.dtype,
                    given: Sequence[torch.Tensor | None] | None, out_dtype: torch.dtype | None,
                    result: torch.Tensor | None) -> str:
    """Δ is finite: θpost + Δ' left a dtype's range, or (KFAC) removing the masked part overflowed."""
    post = given[0] if given else inputs.post.read(name).to(dtype)
    delta = inputs.read_delta(name)
    unmasked = delta.add_(post.to(device=delta.device, dtype=delta.dtype))
    terms = _term_labels(inputs)
    for target in (compute_dtype(dtype), dtype, out_dtype):
        if target is not None and not fits(unmasked, target):
            return (f"{where}: θpost + Δ has values beyond {_dtype_name(target)}'s range (largest |x| "
                    f"{largest_magnitude(unmasked):.3g}; {inputs.post.label}, Δ from {terms}){_HINT}, "
                    "or use a wider `dtype:` / `out_dtype:`")
    if inputs.plan.masked and inputs.fisher_kind(name) == "kfac":
        return (f"{where}: removing the masked KFAC directions U(1_S ⊙ Δ̃)Vᵀ from Δ (from {terms}) overflows "
                f"float32{_HINT}")
    largest = largest_magnitude(result) if result is not None else float("nan")
    return f"{where}: the graft's result is not finite (largest |x| {largest:.3g}; Δ from {terms}){_HINT}"
