"""Turn a GGUF causal LM (a llama.cpp-style file) into an ordinary Hugging Face model folder.

graft, mergekit and the Fisher estimator read config.json + safetensors; many
post-trained models are passed around as GGUF. transformers can already read and
dequantize GGUF; this module adds what a tool needs around it: every check that can
fail is made from the file's header, before the slow dequantization, and reported as
one line naming the file; the folder appears only when complete (written into a hidden
sibling, renamed on success); the input file is only ever opened read-only.

Dequantization is lossless in the sense that matters here: the folder holds exactly the
values a quantized model computes with (in float32 by default), not the pre-quantization
weights, which the GGUF no longer contains.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from graftmerge.errors import GraftError
from graftmerge.formats.gguf_header import GgufLayout, check_model_tensors, open_gguf
from graftmerge.formats.output_folder import NEW, OVERWRITE, Inputs, OutputFolder, check_not_inputs, usual_modes
from graftmerge.formats.transformers_logging import quiet_transformers

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _optional(module: str, name: str) -> Any:
    """``module.name`` where the installed transformers has it, else None (its GGUF support varies by version)."""
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return None


# Looked up once, here: a plain import would fail on the transformers versions that lack them.
# transformers' own GGUF path (architectures it packs natively, with its own dequantizer);
# without it, gguf-py dequantizes everything.
IS_GGUF_ARCH_SUPPORTED = _optional("transformers.integrations.gguf.utils", "is_gguf_arch_supported")
TRANSFORMERS_DEQUANTIZE = _optional("transformers.integrations.gguf.dequant", "dequantize")
# transformers ≥ 5.2x can keep GGUF blocks packed unless asked for plain tensors; older versions always dequantize.
GGUF_CONFIG = _optional("transformers", "GgufConfig")


@dataclass(frozen=True)
class GgufHeader:
    """What the import needs to know about a GGUF before reading any tensor data."""

    path: Path
    architecture: str
    tensor_types: dict[str, str]  # ggml type name -> the first tensor stored in it
    has_tokenizer: bool
    layout: GgufLayout | None = None  # the checked header (counts, tensor infos)


def read_gguf_header(file: str | os.PathLike) -> GgufHeader:
    """The file's architecture, tensor types and tokenizer presence; GraftError if it is no GGUF."""
    path = Path(file)
    layout = open_gguf(path)  # every count and length checked against the file before gguf-py sees it
    types: dict[str, str] = {}
    for tensor in layout.tensors:
        types.setdefault(tensor.type_name, tensor.name)
    has_tokenizer = "tokenizer.ggml.model" in layout.metadata or "tokenizer.ggml.model" in layout.arrays
    return GgufHeader(path, layout.architecture, types, has_tokenizer, layout)


def causal_lm_config(header: GgufHeader):
    """transformers' config for the GGUF; GraftError unless transformers maps it to a causal LM."""
    path = header.path
    try:
        with quiet_transformers(), _gguf_alone(path) as folder:
            config = AutoConfig.from_pretrained(folder, gguf_file=path.name, trust_remote_code=False)
    except (ValueError, KeyError, OSError, NotImplementedError) as error:
        raise GraftError(
            f"{path}: GGUF architecture {header.architecture!r} is not one transformers can load "
            f"as a causal language model ({_first_line(error)})"
        ) from error
    architectures = getattr(config, "architectures", None) or []
    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES or any(
        not name.endswith("ForCausalLM") for name in architectures
    ):
        raise GraftError(
            f"{path}: GGUF architecture {header.architecture!r} is not a causal language model "
            f"(transformers reads it as {config.model_type!r}"
            + (f", {architectures[0]}" if architectures else "")
            + "); graftmerge imports decoder-only LMs"
        )
    return config


def check_dequantizable(header: GgufHeader) -> None:
    """GraftError naming the first tensor type transformers cannot dequantize for this architecture.

    Asks the dequantizer transformers will actually use (its own for the architectures
    it packs natively, gguf-py's for the others) to unpack one block of each type.
    """
    refused = [(name, tensor) for name, tensor in header.tensor_types.items()
               if not _can_dequantize(header.architecture, name)]
    if refused:
        name, tensor = refused[0]
        readable = sorted(set(header.tensor_types) - {n for n, _ in refused})
        raise GraftError(
            f"{header.path}: transformers cannot dequantize ggml type {name} (tensor {tensor!r}"
            + (f", and {len(refused) - 1} other type(s)" if len(refused) > 1 else "")
            + "); re-quantize the model to a type it reads, e.g. Q8_0 or F16"
            + (f" (this file's other types: {', '.join(readable)})" if readable else "")
        )


def _can_dequantize(architecture: str, type_name: str) -> bool:
    """Whether the dequantizer transformers will use for ``architecture`` unpacks one block of the type."""
    qtype = GGMLQuantizationType[type_name]
    if qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16):
        return True
    _, block_bytes = GGML_QUANT_SIZES[qtype]
    block = np.zeros((1, block_bytes), dtype=np.uint8)
    try:
        native = (IS_GGUF_ARCH_SUPPORTED is not None and TRANSFORMERS_DEQUANTIZE is not None
                  and IS_GGUF_ARCH_SUPPORTED(architecture))
    except ImportError:  # transformers without its own GGUF path: gguf-py dequantizes everything
        native = False
    try:
        if native:
            TRANSFORMERS_DEQUANTIZE(torch.from_numpy(block).reshape(-1), int(qtype))
        else:
            gguf_dequantize(block, qtype)
    except (NotImplementedError, ValueError, KeyError):
        return False
    return True


def check_implied_model(header: GgufHeader, config) -> None:
    """GraftError unless the model ``config`` describes is the one the GGUF's tensors hold.

    Checked before transformers allocates anything: the token embedding and every
    declared block have tensors; the config's layers, width and vocabulary match them;
    and its parameter count (counted on the meta device, which allocates nothing) is no
    more than the tensors hold, plus an output layer tied to the embedding. A header
    that describes a 7B model over a few bytes of tensors stops here.
    """
    layout = header.layout if header.layout is not None else open_gguf(header.path)
    blocks = check_model_tensors(layout)
    embedding = layout.tensor("token_embd.weight")
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    rows = embedding.dims[1] if len(embedding.dims) > 1 else 1
    for attribute, actual, what, mismatch in (
        ("num_hidden_layers", blocks, "block(s) with tensors", lambda v, a: v > a),
        ("hidden_size", embedding.dims[0], "values per row of token_embd.weight", int.__ne__),
        ("vocab_size", rows, "rows of token_embd.weight", int.__ne__),
    ):
        value = getattr(text, attribute, None)
        if isinstance(value, int) and not isinstance(value, bool) and mismatch(value, actual):
            raise GraftError(f"{header.path}: its metadata makes {attribute} {value}, but the file has {actual} "
                             f"{what}; the metadata does not describe its tensors")
    try:
        with quiet_transformers(), torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, trust_remote_code=False)
    except Exception as error:  # noqa: BLE001 - whatever stops transformers building the model the metadata describes
        raise GraftError(f"{header.path}: transformers cannot build the model its metadata describes "
                         f"({_first_line(error)})") from error
    parameters = sum(parameter.numel() for parameter in model.parameters())
    stored = sum(tensor.elements for tensor in layout.tensors)
    if parameters > stored + embedding.elements:
        raise GraftError(
            f"{header.path}: its metadata describes a model of {parameters:,} parameters, but its tensors hold "
            f"{stored:,} values ({layout.size:,} bytes of {', '.join(sorted(header.tensor_types))}); the metadata "
            "does not describe its tensors"
        )


def import_gguf(
    file: str | os.PathLike,
    output: str | os.PathLike,
    dtype: str = "float32",
    *,
    overwrite: bool = False,
    max_shard_size: str = "500MB",
) -> Path:
    """Dequantize a GGUF causal LM into ``output`` (config, safetensors shards, tokenizer); returns it.

    ``dtype`` is what the weights are stored in: float32 keeps the dequantized values
    exactly; bfloat16/float16 round them (half the disk, and what most merges use).
    """
    if dtype not in DTYPES:
        raise GraftError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    out = Path(output)
    check_not_inputs(out, [("GGUF file", file)])  # before anything else
    header = read_gguf_header(file)
    if out.exists() and not overwrite:
        raise GraftError(f"{out} already exists; pass --overwrite to replace it")
    if out.exists() and not out.is_dir():
        raise GraftError(f"{out} exists and is not a folder; remove it or choose another output")
    config = causal_lm_config(header)
    check_dequantizable(header)
    check_implied_model(header, config)
    with staged_folder(
        out, overwrite=overwrite, inputs=[("GGUF file", header.path)]
    ) as staging:  # out locked before the slow dequantization
        model = _load_model(header, DTYPES[dtype])
        tokenizer = _load_tokenizer(header) if header.has_tokenizer else None
        try:
            model.save_pretrained(staging, max_shard_size=max_shard_size)
            if tokenizer is not None:
                tokenizer.save_pretrained(staging)
            usual_modes(staging)  # safetensors' shards are owner-only; a Hub download's are not
        except OSError as error:
            raise GraftError(f"cannot write {out}: {_first_line(error)}") from error
    return out


def _load_model(header: GgufHeader, dtype: torch.dtype):
    """The dense model (every weight dequantized), with the GGUF quantizer detached so it saves."""
    # transformers ≥ 5.2x can keep GGUF blocks packed; ask for plain tensors (older versions always dequantize)
    unpacked = {"quantization_config": GGUF_CONFIG(dequantize=True)} if GGUF_CONFIG is not None else {}
    path = header.path
    try:
        with quiet_transformers(), _gguf_alone(path) as folder:
            model, info = AutoModelForCausalLM.from_pretrained(
                folder, gguf_file=path.name, dtype=dtype, output_loading_info=True, trust_remote_code=False,
                **unpacked,
            )
    except (ValueError, NotImplementedError, KeyError, RuntimeError, OSError) as error:
        raise GraftError(f"cannot import {path}: {_first_line(error)}") from error
    missing = sorted(info.get("missing_keys") or [])
    mismatched = sorted(str(k) for k in info.get("mismatched_keys") or [])
    if missing or mismatched:
        problem = (f"it lacks {len(missing)} weight(s) the model needs (e.g. {missing[:3]})" if missing
                   else f"{len(mismatched)} weight(s) have the wrong shape (e.g. {mismatched[:3]})")
        raise GraftError(f"cannot import {path}: {problem}")
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        quantizer.remove_quantization_config(model)
    return model.eval()


def _load_tokenizer(header: GgufHeader) -> Any:
    """The GGUF's tokenizer as transformers reads it; GraftError naming the file if it cannot."""
    path = header.path
    try:
        with quiet_transformers(), _gguf_alone(path) as folder:
            return AutoTokenizer.from_pretrained(folder, gguf_file=path.name, trust_remote_code=False)
    except (ValueError, KeyError, OSError, NotImplementedError) as error:
        raise GraftError(f"cannot import the tokenizer of {path}: {_first_line(error)}") from error


@contextlib.contextmanager
def staged_folder(out: Path, overwrite: bool = True, inputs: Inputs = ()) -> Iterator[Path]:
    """A hidden sibling of ``out`` to write into; it replaces ``out`` whole only if the block succeeds.

    ``out`` is locked meanwhile; an existing one is replaced only with ``overwrite``, and a
    symbolic link at ``out`` is refused, never followed (:mod:`graftmerge.formats.output_folder`).
    """
    with OutputFolder(out, replace=OVERWRITE if overwrite else NEW, hint="pass --overwrite to replace it",
                      inputs=inputs) as output:
        yield output.staging


@contextlib.contextmanager
def _gguf_alone(path: Path) -> Iterator[str]:
    """A private folder holding only a link to the GGUF (same name), for transformers to load from.

    Given a folder and ``gguf_file``, transformers also reads the folder's own
    ``tokenizer_config.json`` and ``generation_config.json``: files of whatever else lies
    beside the GGUF (another model, a Hub repo naming remote code). The import reads the
    GGUF alone.
    """
    with tempfile.TemporaryDirectory(prefix="graftmerge-gguf-") as folder:
        (Path(folder) / path.name).symlink_to(path.resolve())
        yield folder


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
