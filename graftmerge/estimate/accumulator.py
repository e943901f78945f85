"""Hook a causal LM and accumulate retention-Fisher sums batch by batch.

One forward and one backward per batch. Every parameter is frozen; the gradient flows
through the activations only (the input embedding's output is made a leaf that
requires grad), and forward hooks / output-gradient hooks capture what each layer
saw. From those captures :mod:`per_sequence_gradients` squares every sequence's
parameter gradient into the sums (for the diagonal) and :mod:`kfac_factors` adds a aᵀ
and g gᵀ (for KFAC). The weight-gradient matmuls of a plain backward are never run;
ours take their place. Batches are right-padded: sequence n's real tokens are its first
S_n positions, and nothing is read past them.

Accumulators hold *sums* in ``dtype`` (float32 or float64): ``diagonal[name]``
(Σ_n (∇L_n)²), ``rows[name]`` / ``columns[name]`` (the P and Q sums of the stored
weight's dim 0 and dim 1), and the counts. A full (d × d) factor sum is kept on and
above its diagonal blocks while batches come in; :meth:`FisherAccumulator.state_dict`
and :meth:`FisherAccumulator.means` fill in the rest first. ``means`` divides.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from graftmerge.errors import GraftError
from graftmerge.estimate import kfac_factors, per_sequence_gradients
from graftmerge.estimate.batching import Batch
from graftmerge.estimate.retention_loss import summed_sequence_losses

KINDS = ("diagonal", "kfac", "both")
MAX_CHUNK_ELEMENTS = per_sequence_gradients.MAX_BLOCK_ELEMENTS  # gradient block made at once
MAX_FULL_FACTOR = 32768  # a KFAC side larger than this is kept diagonal
_Use = (
    per_sequence_gradients.LinearUse
    | per_sequence_gradients.DenseUse
    | per_sequence_gradients.EmbeddingUse
)


@dataclass
class _ModulePlan:
    """What to capture at one module: its diagonal parameters and KFAC sides."""

    name: str
    module: nn.Module
    kind: str  # "linear", "embedding" or "generic"
    diagonal: dict[str, nn.Parameter] = field(default_factory=dict)  # local name → parameter
    kfac: str | None = None  # canonical weight name with KFAC factors
    rows_diagonal: bool = False  # P side kept as a vector (lm_head vocabulary)
    columns_diagonal: bool = False


class FisherAccumulator:
    """Retention-Fisher sums of ``model`` over the batches fed to :meth:`accumulate`."""

    def __init__(
        self,
        model: nn.Module,
        *,
        kind: str = "diagonal",
        modules: Sequence[str] = (),
        dtype: torch.dtype = torch.float32,
        max_chunk_elements: int = MAX_CHUNK_ELEMENTS,
        max_full_factor: int = MAX_FULL_FACTOR,
    ):
        if kind not in KINDS:
            raise GraftError(f"unknown Fisher kind {kind!r}; choose one of {', '.join(KINDS)}")
        self.model = model
        self.kind = kind
        self.dtype = dtype
        self.max_chunk_elements = max_chunk_elements
        self.device = next(model.parameters()).device
        self.names = self._canonical_names(model)
        selected = self._selected(model, modules)
        owners = self._owner_counts(model)
        output_embeddings = (
            model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        )
        self.plans: list[_ModulePlan] = []
        self.diagonal: dict[str, torch.Tensor] = {}
        self.rows: dict[str, torch.Tensor] = {}
        self.columns: dict[str, torch.Tensor] = {}
        self.kfac_kind: dict[str, str] = {}  # weight name → "linear" or "embedding"
        for module_name, module in model.named_modules():
            local = {n: p for n, p in module.named_parameters(recurse=False) if id(p) in selected}
            if not local:
                continue
            self.plans.append(
                self._plan(module_name, module, local, owners, output_embeddings, max_full_factor)
            )
        self.sequences = 0
        self.tokens = 0
        self.completion_tokens = 0
        self._batch: Batch | None = None
        self._replaying = False
        self._handles: list = []

    # -- setup --------------------------------------------------------------
    @staticmethod
    def _canonical_names(model: nn.Module) -> dict[int, str]:
        """id(parameter) → its first name (a tied weight keeps the name saved in the checkpoint)."""
        names: dict[int, str] = {}
        for name, parameter in model.named_parameters(remove_duplicate=False):
            names.setdefault(id(parameter), name)
        return names

    def _selected(self, model: nn.Module, modules: Sequence[str]) -> dict[int, str]:
        """id → name of the floating parameters ``--modules`` picks (all when empty); none is an error."""
        selected = {
            id(p): name
            for p, name in ((p, self.names[id(p)]) for p in model.parameters())
            if p.is_floating_point()
            and (not modules or any(fnmatch.fnmatchcase(name, g) for g in modules))
        }
        if not selected:
            raise GraftError(
                f"--modules {' '.join(modules)} matches no floating parameter of the model"
            )
        return selected

    @staticmethod
    def _owner_counts(model: nn.Module) -> dict[int, int]:
        """id(parameter) → how many modules hold it (more than one: a tied weight)."""
        owners: dict[int, int] = {}
        for module in model.modules():
            for parameter in module.parameters(recurse=False):
                owners[id(parameter)] = owners.get(id(parameter), 0) + 1
        return owners

    def _plan(
        self,
        module_name: str,
        module: nn.Module,
        local: dict[str, nn.Parameter],
        owners: dict[int, int],
        output_embeddings: nn.Module | None,
        max_full_factor: int,
    ) -> _ModulePlan:
        """What to capture at one module; allocates its zeroed sums (KFAC sides, then diagonals)."""
        module_kind = (
            "linear"
            if isinstance(module, nn.Linear)
            else "embedding"
            if isinstance(module, nn.Embedding)
            else "generic"
        )
        plan = _ModulePlan(module_name, module, module_kind)
        weight = local.get("weight")
        wants_kfac = (
            self.kind in ("kfac", "both")
            and module_kind in ("linear", "embedding")
            and weight is not None
            and owners[id(weight)] == 1  # a tied embedding / lm_head uses the diagonal
        )
        if wants_kfac:
            plan.kfac = self.names[id(weight)]
            rows, columns = weight.shape
            plan.rows_diagonal = (
                module_kind == "embedding"
                or module is output_embeddings
                or rows > max_full_factor
            )
            plan.columns_diagonal = module_kind == "linear" and columns > max_full_factor
            self.kfac_kind[plan.kfac] = module_kind
            self.rows[plan.kfac] = self._zeros((rows,) if plan.rows_diagonal else (rows, rows))
            self.columns[plan.kfac] = self._zeros(
                (columns,) if plan.columns_diagonal else (columns, columns)
            )
        for local_name, parameter in local.items():
            if self.kind == "kfac" and plan.kfac is not None and local_name == "weight":
                continue
            name = self.names[id(parameter)]
            plan.diagonal[local_name] = parameter
            if name not in self.diagonal:  # a tied weight: one sum for all its modules
                self.diagonal[name] = self._zeros(tuple(parameter.shape))
        if module_kind == "linear" and set(plan.diagonal) - {"weight", "bias"}:
            raise GraftError(
                f"module {module_name!r} has parameters besides weight/bias; cannot estimate"
            )
        return plan

    def _zeros(self, shape: tuple[int, ...]) -> torch.Tensor:
        return torch.zeros(shape, dtype=self.dtype, device=self.device)

    def __enter__(self) -> FisherAccumulator:
        for parameter in self.model.parameters():
            parameter.requires_grad_(False)
        for plan in self.plans:
            self._handles.append(plan.module.register_forward_hook(self._forward_hook(plan)))
        embeddings = self.model.get_input_embeddings()
        if not any(plan.module is embeddings for plan in self.plans):
            self._handles.append(embeddings.register_forward_hook(self._forward_hook(None)))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    # -- one batch ----------------------------------------------------------
    def accumulate(self, batch: Batch) -> None:
        """Add one right-padded batch (forward + backward through activations)."""
        if not self._handles:
            raise RuntimeError("use FisherAccumulator as a context manager")
        batch = batch.to(self.device)
        self._batch = batch
        self._lengths = _right_padded_lengths(batch)
        self._rows = kfac_factors.token_rows(batch.token_mask)
        self._pending: dict[int, list[_Use]] = {}
        self._uses: dict[int, int] = {}
        self._pending_input: tuple[torch.Tensor, list[torch.Tensor]] | None = None
        try:
            with torch.enable_grad():
                logits = self.model(
                    input_ids=batch.input_ids,
                    attention_mask=batch.attention_mask,
                    position_ids=batch.position_ids,
                    use_cache=False,
                ).logits
                self._flush_input()  # the last layer input's a aᵀ, before the backward
                summed_sequence_losses(logits, batch.input_ids, batch.completion_mask).backward()
            if self._pending:
                missing = sorted(self.names[pid] for pid in self._pending)
                raise GraftError(
                    f"no gradient reached {missing[:3]}; are these parameters used by the loss?"
                )
        finally:
            self._batch = None
            self._pending = {}
            self._pending_input = None
        self.sequences += batch.sequences
        self.tokens += batch.tokens
        self.completion_tokens += int(batch.completion_mask.sum())

    def _forward_hook(self, plan: _ModulePlan | None):
        def hook(module: nn.Module, args: tuple, output):
            """Capture the module's input and hook its output's gradient (skipped while replaying)."""
            if self._replaying or self._batch is None:
                return None
            if not isinstance(output, torch.Tensor):
                raise GraftError(
                    f"module {plan.name if plan else module!r} returns {type(output).__name__}, not a tensor"
                )
            replaced = not output.requires_grad
            if replaced:  # the input embedding: start the gradient here, params stay frozen
                output = output.detach().requires_grad_()
            if plan is not None:
                self._capture(plan, args, output)
            return output if replaced else None

        return hook

    def _capture(self, plan: _ModulePlan, args: tuple, output: torch.Tensor) -> None:
        batch = self._batch
        if len(args) != 1 or not isinstance(args[0], torch.Tensor):
            raise GraftError(
                f"module {plan.name!r} is called with {len(args)} positional inputs; cannot estimate"
            )
        x = args[0]
        per_token = plan.kind in ("linear", "embedding")
        expected = tuple(batch.input_ids.shape) if per_token else tuple(batch.input_ids.shape[:1])
        if tuple(x.shape[: len(expected)]) != expected:
            raise GraftError(
                f"module {plan.name!r} sees input of shape {tuple(x.shape)}, not (sequences, tokens, ...): "
                "per-sequence statistics need layers applied sequence-wise"
            )
        if plan.kfac is not None:
            if plan.kind == "embedding":
                self.rows[plan.kfac] += kfac_factors.token_count(
                    x, self._rows, plan.module.num_embeddings, self.dtype
                )
                self._factor_done(self.rows, plan.kfac)
            elif plan.columns_diagonal:
                self.columns[plan.kfac] += kfac_factors.squared_sum(
                    x.detach(), self._rows, self.dtype
                )
                self._factor_done(self.columns, plan.kfac)
            else:
                self._input_factor(x, plan.kfac)
        for parameter in plan.diagonal.values():
            self._uses[id(parameter)] = self._uses.get(id(parameter), 0) + 1
        saved = x.detach() if plan.diagonal else None
        output.register_hook(lambda g: self._backward(plan, saved, g))

    def _input_factor(self, x: torch.Tensor, key: str) -> None:
        """Add a aᵀ of layer input ``x`` to ``columns[key]``, once for all consecutive modules reading ``x``.

        q/k/v (gate/up) read one input tensor (the same object): its product is taken once,
        when another input arrives or the forward ends, and added to each sum, so those sums
        stay bit-identical and the cache stores the factor once. A lone reader gets the
        product straight into its sum.
        """
        if self._pending_input is not None and self._pending_input[0] is x:
            self._pending_input[1].append(key)
            return
        self._flush_input()
        self._pending_input = (x, [key])

    def _flush_input(self) -> None:
        """Take the pending input's a aᵀ: straight into its one sum, or once for several."""
        if self._pending_input is None:
            return
        x, keys = self._pending_input
        self._pending_input = None
        rows = kfac_factors.masked_rows(x.detach(), self._rows, self.dtype)
        if len(keys) == 1:
            kfac_factors.add_covariance(self.columns[keys[0]], rows)
            self._factor_done(self.columns, keys[0])
            return
        shared = rows.new_zeros(self.columns[keys[0]].shape)
        kfac_factors.add_covariance(shared, rows)
        for key in keys:
            kfac_factors.add_upper(self.columns[key], shared)
            self._factor_done(self.columns, key)

    def _backward(self, plan: _ModulePlan, x: torch.Tensor | None, g: torch.Tensor) -> None:
        rows, dtype = self._rows, self.dtype
        g = g.detach()
        if plan.kfac is not None:
            if plan.kind == "embedding":
                kfac_factors.add_covariance(
                    self.columns[plan.kfac], kfac_factors.masked_rows(g, rows, dtype)
                )
                self._factor_done(self.columns, plan.kfac)
            elif plan.rows_diagonal:
                self.rows[plan.kfac] += kfac_factors.squared_sum(g, rows, dtype)
                self._factor_done(self.rows, plan.kfac)
            else:
                kfac_factors.add_covariance(
                    self.rows[plan.kfac], kfac_factors.masked_rows(g, rows, dtype)
                )
                self._factor_done(self.rows, plan.kfac)
        if not plan.diagonal:
            return
        if plan.kind == "linear":
            a, g = x.to(dtype), g.to(dtype)
            for local_name, parameter in plan.diagonal.items():
                use = (
                    per_sequence_gradients.LinearUse(a, g)
                    if local_name == "weight"
                    else per_sequence_gradients.DenseUse(
                        per_sequence_gradients.linear_bias_gradients(g, self._lengths)
                    )
                )
                self._contribute(parameter, use)
        elif plan.kind == "embedding":
            self._contribute(
                plan.diagonal["weight"], per_sequence_gradients.EmbeddingUse(x, g.to(dtype))
            )
        else:
            parameters = {n: p.detach() for n, p in plan.module.named_parameters(recurse=False)}
            self._replaying = True
            try:
                grads = per_sequence_gradients.module_parameter_gradients(
                    plan.module, parameters, x, g
                )
            finally:
                self._replaying = False
            for local_name, parameter in plan.diagonal.items():
                use = per_sequence_gradients.DenseUse(grads[local_name].to(dtype))
                self._contribute(parameter, use)

    def _contribute(self, parameter: nn.Parameter, use: _Use) -> None:
        """Collect a parameter's per-sequence gradient parts; square once all its uses have reported."""
        key = id(parameter)
        parts = self._pending.setdefault(key, [])
        parts.append(use)
        if len(parts) < self._uses[key]:
            return  # a tied weight: wait for its other use
        del self._pending[key]
        per_sequence_gradients.add_squared_gradients(
            self.diagonal[self.names[key]], parts, self._lengths, self.max_chunk_elements
        )
        self._diagonal_done(self.names[key])

    def _factor_done(self, sums: dict[str, torch.Tensor], key: str) -> None:
        """This batch's part of one KFAC side sum is in ``sums[key]`` (a sharded run reduces it here)."""

    def _diagonal_done(self, name: str) -> None:
        """This batch's part of ``diagonal[name]`` is in (a sharded run reduce-scatters it here)."""

    # -- results ------------------------------------------------------------
    def _complete_factors(self) -> None:
        """Full factor sums are kept on and above their diagonal blocks; fill them in to be read."""
        for total in (*self.rows.values(), *self.columns.values()):
            if total.dim() == 2:
                kfac_factors.mirror(total)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """All sums as one flat dict of tensors (for checkpoints and all-reduce)."""
        self._complete_factors()
        state = {f"diagonal/{k}": v for k, v in self.diagonal.items()}
        state.update({f"rows/{k}": v for k, v in self.rows.items()})
        state.update({f"columns/{k}": v for k, v in self.columns.items()})
        state["counts"] = torch.tensor(
            [self.sequences, self.tokens, self.completion_tokens],
            dtype=torch.float64,
            device=self.device,
        )
        return state

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Set the sums from :meth:`state_dict` output in place; GraftError if it is another run's."""
        mine = self.state_dict()
        if set(state) != set(mine):
            raise GraftError("the checkpoint holds other accumulators than this run needs")
        for key, value in state.items():
            if key != "counts":
                mine[key].copy_(value)
        self.sequences, self.tokens, self.completion_tokens = (
            int(v) for v in state["counts"].tolist()
        )

    def means(self) -> tuple[dict[str, torch.Tensor], dict[str, tuple[torch.Tensor, torch.Tensor]]]:
        """(diagonal Fisher by name, (P, Q) by weight name) with the normalisations of docs/math.md#the-estimator."""
        if self.sequences == 0:
            raise GraftError("no sequences were accumulated")
        self._complete_factors()
        diagonal = {name: total / self.sequences for name, total in self.diagonal.items()}
        kfac = {}
        for name, module_kind in self.kfac_kind.items():
            if module_kind == "embedding":  # rows: one-hot input side, columns: gradient side
                kfac[name] = (self.rows[name] / self.tokens, self.columns[name] / self.sequences)
            else:
                kfac[name] = (self.rows[name] / self.sequences, self.columns[name] / self.tokens)
        return diagonal, kfac

    def diagonal_sides(self) -> list[str]:
        """KFAC sides stored as vectors (``name:rows`` / ``name:columns``), for the manifest."""
        sides = []
        for plan in self.plans:
            if plan.kfac is not None:
                sides += [f"{plan.kfac}:rows"] * plan.rows_diagonal + [
                    f"{plan.kfac}:columns"
                ] * plan.columns_diagonal
        return sides


def _right_padded_lengths(batch: Batch) -> list[int]:
    """S_n of every sequence; GraftError unless each one's real tokens come first (right padding)."""
    lengths = batch.token_mask.sum(dim=1)
    positions = torch.arange(batch.token_mask.shape[1], device=lengths.device)
    if not torch.equal(batch.token_mask, positions < lengths[:, None]):
        raise GraftError("the batch is not right-padded; build it with estimate.batching.pad_batch")
    return lengths.tolist()
