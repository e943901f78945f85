"""``graftmerge import-gguf``: thin click wrapper over :func:`graftmerge.formats.gguf_import.import_gguf`."""

from __future__ import annotations

from pathlib import Path

import click

from graftmerge.cli import report_errors


@click.command("import-gguf")
@click.argument("file", type=click.Path(path_type=Path))
@click.option("-o", "--output", required=True, type=click.Path(path_type=Path),
              help="Model folder to write (config.json, safetensors shards, tokenizer).")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16", "float16"]), default="float32",
              show_default=True,
              help="Stored weight dtype. float32 keeps the dequantized values exactly; "
                   "bfloat16/float16 round them.")
@click.option("--max-shard-size", default="500MB", show_default=True, help="Largest safetensors shard.")
@click.option("--overwrite", is_flag=True, help="Replace an existing folder at OUTPUT.")
@click.option("-v", "--verbose", is_flag=True, help="Show tracebacks.")
@report_errors
def import_gguf(file: Path, output: Path, dtype: str, max_shard_size: str, overwrite: bool,
                verbose: bool) -> None:
    """Dequantize a GGUF causal LM (llama.cpp format) into a Hugging Face model folder.

    The folder is what `graftmerge fisher estimate` and `mergekit-yaml` read: config.json,
    sharded safetensors, the tokenizer with its chat template, generation_config.json.
    The weights are the values the quantized model computes with; the GGUF no longer
    holds the original ones. Checks the file (GGUF, every count and length of its
    header against its size, a causal-LM architecture transformers knows, quantization
    types it can dequantize, tensors that make the model its metadata describes) before
    the slow part; OUTPUT appears only when complete.

    \b
    graftmerge import-gguf SmolLM2-135M-Instruct.Q4_1.gguf -o ./post
    graftmerge import-gguf model.Q8_0.gguf -o ./post --dtype bfloat16 --overwrite
    """
    # lazy: both only when the command runs, so --help stays fast; the header check needs only gguf-py and
    # numpy, so a bad file is refused in a fraction of a second, before torch and transformers load
    from graftmerge.formats.gguf_header import open_gguf
    from graftmerge.formats.output_folder import check_not_inputs

    check_not_inputs(output, [("GGUF file", file)])  # OUTPUT may not hold (or be) the GGUF
    open_gguf(file)
    from graftmerge.formats.gguf_import import import_gguf as run_import

    written = run_import(file, output, dtype, overwrite=overwrite, max_shard_size=max_shard_size)
    shards = sorted(p.name for p in written.glob("*.safetensors"))
    tokenizer = "with tokenizer" if (written / "tokenizer_config.json").exists() else "no tokenizer in the GGUF"
    click.echo(f"wrote {written} ({len(shards)} safetensors shard(s), {dtype}, {tokenizer})")
