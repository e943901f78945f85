"""``fisher estimate --dry-run``: the memory each process of a run would need, from the config alone.

The model is built on the meta device (no weights read), and the accumulator plans its
sums on it, so every size below is the run's own: parameter shapes, which weights get a
diagonal or KFAC sides, the model and accumulator dtypes. Per rank under ``--fsdp``
(rank 0, whose dim-0 shards are the largest):

- model shard: every parameter's ``ceil(rows / world)`` rows;
- unsharded weights: the root's parameters (embeddings, final norm, ``lm_head``: FSDP2
  keeps the root unsharded from forward to the end of backward) plus two decoder layers
  (the one running and the one prefetched), each twice (the all-gather buffer and the
  unsharded parameters copied out of it);
- diagonal shard: the rank's rows of every diagonal sum; diagonal working set: the
  largest parameter's full-size batch buffer, twice (buffer and its padded copy);
- KFAC sides owned: the sides balanced over ranks by size (a side shared by q/k/v or
  gate/up is counted once per weight here, so this is an upper bound), plus the largest
  side's batch buffer, twice;
- activations: a rough bound for one batch (``batch × tokens``, every layer's saved
  inputs and the float32 logits);
- runtime: this process's own resident memory (Python, torch, transformers), which
  every rank also pays;
- checkpoint pages: one process loads with ``from_pretrained``, whose memory-mapped
  safetensors pages stay resident (measured: the one-process peak is the model, the
  sums, the runtime and the files' size again); ``--fsdp`` reads row slices and closes
  each file, so its ranks do not keep them.

One process without ``--fsdp`` needs the whole model, every sum and every side.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from torch import nn

from graftmerge.errors import GraftError
from graftmerge.estimate.accumulator import FisherAccumulator
from graftmerge.estimate.model_loading import causal_lm_config, tokenizer_loader
from graftmerge.estimate.rollouts import read_rollouts
from graftmerge.estimate.sharded_loading import build_meta_model, decoder_layers, model_dtype
from graftmerge.math.ownership import balanced_owners, shard_rows

GIB = 1 << 30
TOKENS_WITHOUT_ROLLOUTS = 512


def resident_bytes() -> int:
    """This process's resident set size (Linux /proc; 0 where unknown)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _rows_bytes(shape: tuple[int, ...], world_size: int, itemsize: int) -> int:
    """Bytes of one rank's dim-0 shard of a tensor of ``shape``."""
    return shard_rows(shape[0], world_size) * math.prod(shape[1:]) * itemsize if shape else itemsize


def memory_plan(model: nn.Module, *, world_size: int, kind: str, accumulator_dtype: torch.dtype,
                batch_size: int, tokens: int, runtime: int, file_bytes: int = 0) -> dict[str, int]:
    """Bytes per component for one rank of ``world_size`` (1: one process, nothing sharded)."""
    accumulator = FisherAccumulator(model, kind=kind, dtype=accumulator_dtype)  # meta sums: shapes only
    mb = next(model.parameters()).element_size()
    ab = torch.empty((), dtype=accumulator_dtype).element_size()
    parameters = dict(model.named_parameters())
    layers = decoder_layers(model)
    layer_bytes = max(sum(p.numel() for p in layer.parameters()) for layer in layers) * mb
    in_layers = {id(p) for layer in layers for p in layer.parameters()}
    root_bytes = sum(p.numel() for p in parameters.values() if id(p) not in in_layers) * mb
    sides = [t.numel() * ab for t in (*accumulator.rows.values(), *accumulator.columns.values())]
    owners = balanced_owners(sides, world_size)
    owned = max(sum(size for size, owner in zip(sides, owners, strict=True) if owner == r) for r in range(world_size))
    diagonal = list(accumulator.diagonal.values())
    config = model.config.get_text_config()
    hidden = config.hidden_size
    inner = getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None) or 4 * hidden
    per_token = len(layers) * (6 * hidden + 3 * inner) * mb + config.vocab_size * (mb + 8)
    plan = {
        "model" if world_size == 1 else "model shard": sum(_rows_bytes(tuple(p.shape), world_size, mb)
                                                          for p in parameters.values()),
        "unsharded weights": 0 if world_size == 1 else root_bytes + 4 * layer_bytes,
        "diagonal sums" if world_size == 1 else "diagonal shard": sum(
            _rows_bytes(tuple(t.shape), world_size, ab) for t in diagonal),
        "diagonal working set": 0 if world_size == 1 or not diagonal else 2 * max(t.numel() for t in diagonal) * ab,
        "KFAC sides" if world_size == 1 else "KFAC sides owned": owned,
        "KFAC working set": 0 if world_size == 1 or not sides else 2 * max(sides),
        "activations (one batch)": batch_size * tokens * per_token,
        "runtime (python, torch)": runtime,
        "checkpoint pages (load)": file_bytes if world_size == 1 else 0,
    }
    return plan


def dry_run_report(settings, config, world_size: int, tokens: int | None) -> str:
    """The table ``--dry-run`` prints: one process, and one rank of ``world_size`` under --fsdp."""
    model = build_meta_model(Path(settings.model), config, dtype=model_dtype(config, settings.dtype),
                             attn_implementation=settings.attn_implementation,
                             trust_remote_code=settings.trust_remote_code)
    accumulator_dtype = {"float32": torch.float32, "float64": torch.float64}[settings.accumulator_dtype]
    runtime = resident_bytes()
    file_bytes = sum(f.stat().st_size for f in Path(settings.model).glob("*.safetensors"))
    assumed = tokens is None
    options = {"kind": settings.kind, "accumulator_dtype": accumulator_dtype, "batch_size": settings.batch_size,
               "tokens": TOKENS_WITHOUT_ROLLOUTS if assumed else tokens, "runtime": runtime,
               "file_bytes": file_bytes}
    single = memory_plan(model, world_size=1, **options)
    sharded = memory_plan(model, world_size=world_size, **options)
    count = sum(p.numel() for p in model.parameters())
    lines = [f"{settings.model}: {count / 1e6:.1f}M parameters, {str(model_dtype(config, settings.dtype))[6:]}, "
             f"--kind {settings.kind}, sums in {settings.accumulator_dtype}, --batch-size {settings.batch_size}, "
             f"{options['tokens']} tokens per sequence" + (" (assumed: no --rollouts)" if assumed else " (longest)")]
    lines.append(f"{'':28}{'1 process':>12}{f'--fsdp, each of {world_size}':>22}")
    for (label, one), (_, each) in zip(single.items(), sharded.items(), strict=True):
        label = label.replace(" shard", "").replace(" owned", "").replace(" sums", "")
        lines.append(f"{label:28}{one / GIB:>10.2f} G{each / GIB:>20.2f} G")
    lines.append(f"{'peak (sum)':28}{sum(single.values()) / GIB:>10.2f} G{sum(sharded.values()) / GIB:>20.2f} G")
    return "\n".join(lines)


def dry_run(settings, world_size: int) -> str:
    """``--dry-run``: the report for ``settings`` (the longest of ``--rollouts`` if given); nothing is loaded."""
    if world_size < 1:
        raise GraftError(f"--world-size must be at least 1, not {world_size}")
    config = causal_lm_config(settings.model, trust_remote_code=settings.trust_remote_code)
    tokens = None
    if settings.rollouts is not None:
        rollouts, _ = read_rollouts(settings.rollouts, tokenizer_loader(
            settings.model, trust_remote_code=settings.trust_remote_code))
        tokens = max((r.length for r in rollouts), default=None)
    return dry_run_report(settings, config, world_size, tokens)
