"""``graftmerge import-gguf`` on hostile GGUF files: one line, exit 2, seconds, bounded memory.

Each file is written byte by byte here (a GGUF writer would refuse to write most of
them) and handed to the real console script in a process of its own, whose peak RSS is
measured (``ru_maxrss`` of a wrapper's only child; the wrapper kills it past a guard
well above the bound, so a regression fails the test instead of taking the machine).
A tiny but complete llama built the same way imports, so the refusals are about the
one defect each file has.
"""

from __future__ import annotations

import json
import os
import stat
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from tests.helpers.models import read_model, tree_digest
from tests.helpers.runners import BIN, run_cli

PEAK_RSS_LIMIT_MB = 1024
SECONDS_LIMIT = 60  # a refusal takes a few seconds (most of it importing torch); generous for a busy machine
GUARD_MB = 3072  # the wrapper kills the command past this

U32, F32, STRING, ARRAY, U64 = 4, 6, 8, 9, 10
GGML_F32 = 0
WIDTH, FFN, VOCAB = 32, 64, 16


# --- GGUF bytes, written by hand -------------------------------------------------------------


def gguf_str(text: str) -> bytes:
    raw = text.encode()
    return struct.pack("<Q", len(raw)) + raw


def kv_u32(key: str, value: int) -> bytes:
    return gguf_str(key) + struct.pack("<II", U32, value)


def kv_f32(key: str, value: float) -> bytes:
    return gguf_str(key) + struct.pack("<If", F32, value)


def kv_str(key: str, value: str) -> bytes:
    return gguf_str(key) + struct.pack("<I", STRING) + gguf_str(value)


def tensor_info(name: str, dims: tuple[int, ...], offset: int, ggml_type: int = GGML_F32) -> bytes:
    return gguf_str(name) + struct.pack(f"<I{len(dims)}QIQ", len(dims), *dims, ggml_type, offset)


def gguf_file(path: Path, kvs: list[bytes], infos: list[bytes] = (), data: bytes = b"", *,
              tensor_count: int | None = None, kv_count: int | None = None) -> Path:
    """A GGUF v3: header (counts default to what is given), metadata, tensor infos, padding to 32, data."""
    head = b"GGUF" + struct.pack("<IQQ", 3, len(infos) if tensor_count is None else tensor_count,
                                 len(kvs) if kv_count is None else kv_count)
    head += b"".join(kvs) + b"".join(infos)
    if infos:
        head += b"\0" * (-len(head) % 32)
    path.write_bytes(head + data)
    return path


def llama_metadata(blocks: int = 1, width: int = WIDTH, ffn: int = FFN) -> list[bytes]:
    return [
        kv_str("general.architecture", "llama"), kv_u32("llama.block_count", blocks),
        kv_u32("llama.context_length", 64), kv_u32("llama.embedding_length", width),
        kv_u32("llama.feed_forward_length", ffn), kv_u32("llama.attention.head_count", 2),
        kv_u32("llama.attention.head_count_kv", 2), kv_f32("llama.attention.layer_norm_rms_epsilon", 1e-5),
        kv_u32("llama.vocab_size", VOCAB),
    ]


def llama_tensors(blocks: int = 1) -> dict[str, tuple[int, ...]]:
    """GGUF name -> ggml dims (fastest first) of a complete tiny llama."""
    shapes = {"token_embd.weight": (WIDTH, VOCAB), "output_norm.weight": (WIDTH,)}
    for block in range(blocks):
        for part in ("attn_q", "attn_k", "attn_v", "attn_output"):
            shapes[f"blk.{block}.{part}.weight"] = (WIDTH, WIDTH)
        shapes[f"blk.{block}.ffn_gate.weight"] = (WIDTH, FFN)
        shapes[f"blk.{block}.ffn_up.weight"] = (WIDTH, FFN)
        shapes[f"blk.{block}.ffn_down.weight"] = (FFN, WIDTH)
        shapes[f"blk.{block}.attn_norm.weight"] = (WIDTH,)
        shapes[f"blk.{block}.ffn_norm.weight"] = (WIDTH,)
    return shapes


def llama_file(path: Path, kvs: list[bytes] | None = None, blocks: int = 1) -> Path:
    """A complete tiny llama (F32, random values, 32-byte aligned tensors)."""
    generator = np.random.default_rng(0)
    infos, data = [], b""
    for name, dims in llama_tensors(blocks).items():
        infos.append(tensor_info(name, dims, len(data)))
        data += (generator.standard_normal(int(np.prod(dims))) * 0.1).astype("<f4").tobytes()
        data += b"\0" * (-len(data) % 32)
    return gguf_file(path, llama_metadata(blocks) if kvs is None else kvs, infos, data)


def hostile(kind: str, root: Path) -> tuple[Path, str]:
    """(file, a phrase its one-line error must contain) for each kind of hostile GGUF."""
    path = root / f"{kind.replace(' ', '-')}.gguf"
    arch = kv_str("general.architecture", "llama")
    if kind == "huge key length":
        path.write_bytes(b"GGUF" + struct.pack("<IQQQ", 3, 0, 1, 2**62) + b"general.architecture")  # a 2⁶²-byte key
        return path, "metadata key 0 at offset 32 is 4611686018427387904 bytes long"
    if kind == "huge string length":
        template = gguf_str("tokenizer.chat_template") + struct.pack("<IQ", STRING, 2**62) + b"{{ messages }}"
        return gguf_file(path, [arch, template]), "the value of 'tokenizer.chat_template' would take 461168601842738"
    if kind == "huge array count":  # the 98-byte kind that made gguf-py allocate gigabytes
        array = gguf_str("tokenizer.ggml.scores") + struct.pack("<IIQ", ARRAY, F32, 2**40)
        return gguf_file(path, [arch, array]), "claims 1099511627776 elements"
    if kind == "huge string array":
        array = gguf_str("tokenizer.ggml.tokens") + struct.pack("<IIQ", ARRAY, STRING, 3_000_000)
        return gguf_file(path, [arch, array]), "would take 24000000 bytes"
    if kind == "nested arrays":
        array = gguf_str("tokenizer.ggml.merges") + struct.pack("<IIQIQ", ARRAY, ARRAY, 2**20, ARRAY, 2**20)
        return gguf_file(path, [arch, array]), "array of arrays"
    if kind == "huge tensor count":
        return gguf_file(path, [arch], tensor_count=2**40), "claims 1099511627776 tensors"
    if kind == "many tensors in few bytes":
        return gguf_file(
            path, [arch], tensor_count=60_000
        ), "the header's 60000 tensors (at least 33 bytes each) would take"
    if kind == "huge key count":
        return gguf_file(path, [arch], kv_count=2**50), "claims 1125899906842624 metadata keys"
    if kind == "huge dims":
        info = tensor_info("token_embd.weight", (2**32, 2**32, 2**32, 2**20), 0)
        return gguf_file(path, [arch], [info], b"\0" * 64), "ends past the end"
    if kind == "too many dims":
        return gguf_file(path, [arch], [gguf_str("token_embd.weight") + struct.pack("<I", 2**31)]), \
            "has 2147483648 dimensions"
    if kind == "tensor offset past EOF":
        info = tensor_info("token_embd.weight", (WIDTH, VOCAB), 2**40)
        return gguf_file(path, [arch], [info], b"\0" * 64), "ends past the end"
    if kind == "overlapping tensors":
        infos = [
            tensor_info("token_embd.weight", (WIDTH, VOCAB), 0),
            tensor_info("blk.0.attn_norm.weight", (WIDTH,), 1024),
        ]
        return gguf_file(path, [arch], infos, b"\0" * (WIDTH * VOCAB * 4)), "overlap"
    if kind == "llama with no tensors":
        return gguf_file(path, [arch]), "no token embedding"
    if kind == "100 layers, tensors for 1":
        return llama_file(path, llama_metadata(blocks=100)), "block_count = 100, but it holds tensors for 1 block"
    if kind == "a 10-billion-parameter config over tiny tensors":
        return llama_file(path, llama_metadata(ffn=10**8)), "describes a model of 9,600,"
    if kind == "a vocabulary far larger than its model":
        tokens = gguf_str("tokenizer.ggml.tokens") + struct.pack("<IIQ", ARRAY, STRING, 100_000)
        tokens += (struct.pack("<Q", 1) + b"a") * 100_000
        return llama_file(path, llama_metadata() + [tokens]), "hold 100,000 strings, more than its tensors' 10,848"
    if kind == "more tokens than embedding rows":
        tokens = [chr(ord("a") + i % 26) * (1 + i // 26) for i in range(1000)]
        return llama_file(path, llama_metadata() + [str_array("tokenizer.ggml.tokens", tokens)]), \
            "tokenizer.ggml.tokens has 1,000 entries, but its tokenizer has 1,000 tokens and token_embd.weight 16 rows"
    if kind == "width not the embedding's":
        return llama_file(path, llama_metadata(width=4096)), "hidden_size 4096, but the file has 32"
    raise AssertionError(kind)


HOSTILE = [
    "huge key length",
    "huge string length",
    "huge array count",
    "huge string array",
    "nested arrays",
    "huge tensor count",
    "many tensors in few bytes",
    "huge key count",
    "huge dims",
    "too many dims",
    "tensor offset past EOF",
    "overlapping tensors",
    "llama with no tensors",
    "100 layers, tensors for 1",
    "a 10-billion-parameter config over tiny tensors",
    "width not the embedding's",
    "a vocabulary far larger than its model",
    "more tokens than embedding rows",
]

# Runs COMMAND as its only child; reports exit status, stderr, seconds and the child's peak RSS.
MEASURE = textwrap.dedent("""
    import json, resource, subprocess, sys, tempfile, time
    guard_kb, command = int(sys.argv[1]) * 1024, sys.argv[2:]
    start = time.monotonic()
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        child = subprocess.Popen(command, stdout=out, stderr=err, text=True)
        killed = False
        while child.poll() is None:
            try:
                with open(f"/proc/{child.pid}/status") as status:
                    rss = next((int(l.split()[1]) for l in status if l.startswith("VmRSS:")), 0)
            except OSError:
                rss = 0
            if rss > guard_kb:
                child.kill()
                killed = True
            time.sleep(0.02)
        seconds = time.monotonic() - start
        err.seek(0)
        out.seek(0)
        peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
        print(json.dumps({"returncode": child.returncode, "stderr": err.read(), "stdout": out.read(),
                          "seconds": seconds, "peak_mb": peak, "killed": killed}))
""")


def measured(*command: str) -> dict:
    """Run a console script of this environment as a measured subprocess."""
    result = subprocess.run([sys.executable, "-c", MEASURE, str(GUARD_MB), str(BIN / command[0]), *command[1:]],
                            capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


@pytest.mark.parametrize("kind", HOSTILE)
def test_hostile_gguf_is_refused_in_one_line_fast_in_bounded_memory(tmp_path, kind):
    file, phrase = hostile(kind, tmp_path)
    out = tmp_path / "out"
    before = tree_digest(tmp_path)
    result = measured("graftmerge", "import-gguf", str(file), "-o", str(out))
    report = f"{kind}: {file.stat().st_size} bytes, peak RSS {result['peak_mb']:.0f} MB, {result['seconds']:.1f} s"
    print(report)
    assert not result["killed"], report
    lines = result["stderr"].strip().splitlines()
    assert result["returncode"] == 2, (report, result["stderr"][-3000:])
    assert len(lines) == 1 and lines[0].startswith("error: ") and str(file) in lines[0], lines
    assert phrase in lines[0], lines[0]
    assert result["peak_mb"] < PEAK_RSS_LIMIT_MB, report
    assert result["seconds"] < SECONDS_LIMIT, report
    assert not os.path.lexists(out) and tree_digest(tmp_path) == before  # no output, no staging left


def test_the_tiny_llama_the_refusals_start_from_imports(tmp_path):
    file = llama_file(tmp_path / "tiny.gguf")
    result = run_cli("graftmerge", "import-gguf", str(file), "-o", str(tmp_path / "out"))
    assert result.returncode == 0, result.stderr[-3000:]
    weights = read_model(tmp_path / "out")
    assert weights["model.embed_tokens.weight"].shape == (VOCAB, WIDTH)
    assert weights["model.layers.0.mlp.down_proj.weight"].shape == (WIDTH, FFN)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["num_hidden_layers"] == 1 and "auto_map" not in config


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_imported_files_have_a_normal_files_modes(tmp_path, umask):
    """Weights as readable as the folder's other files and a Hub download's: 0666 / 0777 less the umask
    (safetensors alone writes its shards owner-only)."""
    file = llama_file(tmp_path / "tiny.gguf", llama_metadata() + tokenizer_metadata())
    previous = os.umask(umask)
    try:
        result = run_cli("graftmerge", "import-gguf", str(file), "-o", str(tmp_path / "out"))
    finally:
        os.umask(previous)
    assert result.returncode == 0, result.stderr[-3000:]
    modes = {path.name: stat.S_IMODE(path.stat().st_mode) for path in (tmp_path / "out").iterdir()}
    assert any(name.endswith(".safetensors") for name in modes) and "tokenizer.json" in modes
    assert modes == dict.fromkeys(modes, 0o666 & ~umask)
    assert stat.S_IMODE((tmp_path / "out").stat().st_mode) == 0o777 & ~umask


def test_overwrite_refuses_a_symlink_at_the_output(tmp_path):
    file = llama_file(tmp_path / "tiny.gguf")
    target = tmp_path / "elsewhere"
    target.mkdir()
    (target / "keep.txt").write_text("mine")
    (tmp_path / "out").symlink_to(target, target_is_directory=True)
    before = tree_digest(target)
    result = run_cli("graftmerge", "import-gguf", str(file), "-o", str(tmp_path / "out"), "--overwrite")
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "symbolic link" in lines[0], lines[0]
    assert (tmp_path / "out").is_symlink() and tree_digest(target) == before


def str_array(key: str, values: list[str]) -> bytes:
    return gguf_str(key) + struct.pack("<IIQ", ARRAY, STRING, len(values)) + b"".join(gguf_str(v) for v in values)


def i32_array(key: str, values: list[int]) -> bytes:
    return gguf_str(key) + struct.pack(f"<IIQ{len(values)}i", ARRAY, 5, len(values), *values)


def tokenizer_metadata() -> list[bytes]:
    """A byte-level BPE tokenizer of VOCAB tokens (one merge) that transformers builds from a GGUF."""
    tokens = ["<s>", "</s>", *"abcdefghijklm", "ab"]
    return [kv_str("tokenizer.ggml.model", "gpt2"), str_array("tokenizer.ggml.tokens", tokens),
            i32_array("tokenizer.ggml.token_type", [3, 3] + [1] * (VOCAB - 2)),
            str_array("tokenizer.ggml.merges", ["a b"]),
            kv_u32("tokenizer.ggml.bos_token_id", 0), kv_u32("tokenizer.ggml.eos_token_id", 1)]


def test_files_beside_the_gguf_are_not_read(tmp_path):
    """Given the GGUF's folder, transformers would read the tokenizer_config.json there: another model's, or
    one naming code (then, not trusted, it refuses the import after the slow part)."""
    file = llama_file(tmp_path / "tiny.gguf", llama_metadata() + tokenizer_metadata())
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.123, "max_length": 7}))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"auto_map": {"AutoTokenizer": ["evil.T", None]},
                                                                 "chat_template": "evil {{ messages }}"}))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "evil", "auto_map": {"AutoConfig": "evil.C"}}))
    (tmp_path / "evil.py").write_text(f"open({str(tmp_path / 'MARKER')!r}, 'w').write('ran')\n")
    result = run_cli("graftmerge", "import-gguf", str(file), "-o", str(tmp_path / "out"))
    assert result.returncode == 0, result.stderr[-3000:]
    written = " ".join(path.read_text() for path in (tmp_path / "out").glob("*.json"))
    assert "0.123" not in written and "auto_map" not in written and "evil" not in written
    assert not (tmp_path / "MARKER").exists()
    assert json.loads((tmp_path / "out" / "tokenizer.json").read_text())["model"]["merges"] == [["a", "b"]]
