"""``graftmerge fisher estimate`` end to end: real files, the cache it writes, bad input."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from graftmerge.cli import main
from graftmerge.formats.fisher_cache import open_fisher_cache
from tests.helpers.estimation import (
    brute_force_diagonal,
    brute_force_kfac,
    caches_close,
    load,
    make_model,
    random_rollouts,
    save_tiny_tokenizer,
    write_jsonl,
)

pytestmark = pytest.mark.usefixtures("plain_argv")  # pytest's own flags must not reach report_errors' -v


@pytest.fixture(scope="module")
def post(tmp_path_factory):
    folder = make_model(tmp_path_factory.mktemp("model") / "post", tied=False)
    save_tiny_tokenizer(folder)
    return folder


def estimate(*args: str):
    return CliRunner().invoke(main, ["fisher", "estimate", *map(str, args), "--no-progress"])


def test_estimate_writes_a_cache_equal_to_brute_force(post, tmp_path):
    rollouts = random_rollouts(6, seed=1, vocab=128)
    data = write_jsonl(tmp_path / "rollouts.jsonl", rollouts)
    output = tmp_path / "fisher" / "post-both"
    result = estimate(
        post,
        "-o",
        output,
        "--kind",
        "both",
        "--rollouts",
        data,
        "--batch-size",
        "4",
        "--accumulator-dtype",
        "float64",
        "--dtype",
        "float64",
        "--revision",
        "abc123",
    )
    assert result.exit_code == 0, result.output
    cache = open_fisher_cache(output)
    model = load(post)
    diagonal, kfac = brute_force_diagonal(model, rollouts), brute_force_kfac(model, rollouts)
    for name in cache.names("diagonal"):
        torch.testing.assert_close(
            cache.diagonal(name).double(), diagonal[name], rtol=1e-4, atol=1e-12
        )
    down = cache.kfac("model.layers.1.mlp.down_proj.weight")
    reference = kfac["model.layers.1.mlp.down_proj"]
    torch.testing.assert_close(
        (down.U @ torch.diag(down.S) @ down.U.T).double(), reference["P"], rtol=1e-4, atol=1e-9
    )
    torch.testing.assert_close(
        (down.V @ torch.diag(down.D) @ down.V.T).double(), reference["Q"], rtol=1e-4, atol=1e-7
    )
    embedding = cache.kfac("model.embed_tokens.weight")
    assert embedding.U is None and embedding.V is not None  # one-hot rows: diagonal side
    torch.testing.assert_close(
        embedding.S.double(), reference_p := kfac["model.embed_tokens"]["P"], rtol=1e-5, atol=0
    )
    assert float(reference_p.sum()) == pytest.approx(1.0)

    manifest = cache.manifest
    assert manifest["model"]["revision"] == "abc123"
    assert manifest["model"]["tensors"]["lm_head.weight"]["shape"] == [128, 32]
    counts = manifest["counts"]
    assert counts["sequences"] == 6 and counts["tokens"] == sum(r.length for r in rollouts)
    assert counts["completion_tokens"] == sum(len(r.completion_ids) for r in rollouts)
    estimator = manifest["estimator"]
    assert estimator["tool"].startswith("graftmerge ") and estimator["kind"] == "both"
    assert (
        len(estimator["data"]["rollouts_file_sha256"]) == 64
        and len(estimator["data"]["token_sha256"]) == 64
    )
    # q/k/v share one stored input factor, gate/up another
    entries = manifest["entries"]
    columns = {
        entries[f"model.layers.0.self_attn.{p}_proj.weight"]["kfac"]["columns"] for p in "qkv"
    }
    assert len(columns) == 1
    assert not list(output.parent.glob(".*"))  # no partial folder or checkpoint left behind


def test_text_and_chat_rollouts_are_tokenised_like_pre_tokenised_ones(post, tmp_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(post)
    texts = [("the cat sat on", "the mat </s>"), ("a dog ran", "home fast and slow </s>")]
    chats = [
        [
            {"role": "user", "content": "is the cat red"},
            {"role": "assistant", "content": "the cat is blue"},
        ]
    ]
    with open(tmp_path / "text.jsonl", "w") as handle:
        for prompt, completion in texts:
            handle.write(json.dumps({"prompt": prompt, "completion": completion}) + "\n")
        for messages in chats:
            handle.write(json.dumps({"messages": messages}) + "\n")
    with open(tmp_path / "ids.jsonl", "w") as handle:
        for prompt, completion in texts:
            ids = {
                "prompt_ids": tokenizer(prompt)["input_ids"],
                "completion_ids": tokenizer(completion)["input_ids"],
            }
            handle.write(json.dumps(ids) + "\n")
        prompt = "<user> is the cat red </s> <assistant>"
        ids = {
            "prompt_ids": tokenizer(prompt)["input_ids"],
            "completion_ids": tokenizer("the cat is blue </s>")["input_ids"],
        }
        handle.write(json.dumps(ids) + "\n")
    for name in ("text", "ids"):
        result = estimate(post, "-o", tmp_path / name, "--rollouts", tmp_path / f"{name}.jsonl")
        assert result.exit_code == 0, result.output
    hashes = [
        open_fisher_cache(tmp_path / n).manifest["estimator"]["data"]["token_sha256"]
        for n in ("text", "ids")
    ]
    assert hashes[0] == hashes[1]
    caches_close(tmp_path / "text", tmp_path / "ids", rtol=0)


def write_lines(path, *lines: str):
    path.write_text("".join(line + "\n" for line in lines))
    return path


GOOD = json.dumps({"prompt_ids": [1, 2], "completion_ids": [3]})


@pytest.mark.parametrize(
    ("lines", "extra", "message"),
    [
        ((GOOD, "{not json"), (), r"rollouts.jsonl:2: invalid JSON"),
        (("", "  "), (), r"rollouts file .* is empty"),
        (
            (json.dumps({"prompt_ids": [1], "completion_ids": []}),),
            (),
            r"no usable rollouts: all 1 have an empty completion",
        ),
        (
            (json.dumps({"prompt_ids": [1] * 600, "completion_ids": [2]}),),
            (),
            r"rollouts.jsonl:1: sequence of 601 tokens is longer than the model's context \(512\); pass --truncate",
        ),
        (
            (json.dumps({"prompt_ids": [1], "completion_ids": [999]}),),
            (),
            r"token id 999 is outside the model's vocabulary",
        ),
        ((json.dumps({"text": "hello"}),), (), r"rollouts.jsonl:1: expected keys"),
        ((GOOD,), ("--kind", "fancy"), r"Invalid value for '--kind'"),
    ],
    ids=[
        "invalid-json",
        "empty-file",
        "empty-completions",
        "too-long",
        "bad-token",
        "unknown-keys",
        "bad-kind",
    ],
)
def test_bad_rollouts_fail_with_one_line_and_write_nothing(post, tmp_path, lines, extra, message):
    data = write_lines(tmp_path / "rollouts.jsonl", *lines)
    result = estimate(post, "-o", tmp_path / "fisher" / "x", "--rollouts", data, *extra)
    assert result.exit_code == 2, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 or "Usage" in result.output
    assert __import__("re").search(message, result.output), result.output
    assert not (tmp_path / "fisher").exists() or not any((tmp_path / "fisher").iterdir())


def test_empty_completions_are_skipped_and_counted_and_truncate_cuts(post, tmp_path):
    data = write_lines(
        tmp_path / "rollouts.jsonl",
        GOOD,
        json.dumps({"prompt_ids": [5, 6], "completion_ids": []}),
        json.dumps({"prompt_ids": [1] * 500, "completion_ids": [2] * 20}),
    )
    result = estimate(post, "-o", tmp_path / "x", "--rollouts", data, "--truncate")
    assert result.exit_code == 0, result.output
    counts = open_fisher_cache(tmp_path / "x").manifest["counts"]
    assert counts["skipped_empty_completion"] == 1 and counts["truncated"] == 1
    assert counts["sequences"] == 2 and counts["tokens"] == 3 + 512


def test_bad_models_and_missing_tokenizer(post, tmp_path):
    from transformers import ViTConfig

    data = write_lines(tmp_path / "rollouts.jsonl", GOOD)
    (tmp_path / "empty").mkdir()
    result = estimate(tmp_path / "empty", "-o", tmp_path / "x", "--rollouts", data)
    assert result.exit_code == 2 and "is not a Hugging Face model folder" in result.output
    ViTConfig().save_pretrained(tmp_path / "vit")
    result = estimate(tmp_path / "vit", "-o", tmp_path / "x", "--rollouts", data)
    assert (
        result.exit_code == 2
        and "is not a causal language model (model_type 'vit')" in result.output
    )
    bare = make_model(tmp_path / "bare")
    text = write_lines(tmp_path / "text.jsonl", json.dumps({"prompt": "the", "completion": "cat"}))
    result = estimate(bare, "-o", tmp_path / "x", "--rollouts", text)
    assert result.exit_code == 2 and "has no tokenizer; text rollouts" in result.output, (
        result.output
    )
    result = estimate(post, "-o", tmp_path / "x", "--rollouts", data, "--prompts", data)
    assert result.exit_code == 2 and "exactly one of --rollouts" in result.output
    assert not (tmp_path / "x").exists()
    (tmp_path / "x").mkdir()
    result = estimate(post, "-o", tmp_path / "x", "--rollouts", data)
    assert result.exit_code == 2 and "already exists; pass --overwrite" in result.output
