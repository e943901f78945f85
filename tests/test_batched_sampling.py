"""Batched self-sampling (``--prompts``): the same tokens as one prompt at a time, whatever the batch."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from graftmerge.errors import GraftError
from graftmerge.estimate.run import EstimateSettings, estimate_fisher
from graftmerge.estimate.sampling import (
    check_sampling,
    prompt_generator,
    sample_batch,
    sample_completions,
)
from tests.helpers.estimation import load, make_model

CPU = torch.device("cpu")
PROMPTS = [[1, 2, 3, 4, 5, 6, 7], [9], [10, 11, 12], [5] * 12, [40, 41]]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("batched-sampling")
    return {
        "qwen3": make_model(root / "qwen3", tied=False),
        "gpt2": make_model(root / "gpt2", architecture="gpt2"),  # learned absolute positions
    }


@pytest.fixture(scope="module")
def model(folders):
    return load(folders["qwen3"])  # float64: padding changes no token


def generators(indices, seed=0):
    return [prompt_generator(seed, i, CPU) for i in indices]


def one_at_a_time(model, prompts, **options):
    return [
        sample_completions(model, p, generator=prompt_generator(0, i, CPU), **options)
        for i, p in enumerate(prompts)
    ]


def test_batched_equals_one_prompt_at_a_time(model):
    options = dict(samples=3, max_new_tokens=8, temperature=1.0, top_p=1.0, eos_ids=[])
    alone = one_at_a_time(model, PROMPTS, **options)
    assert all(len(c) == 8 for rows in alone for c in rows)
    assert len({c for rows in alone for c in rows}) > 10  # really sampled
    batched = sample_batch(model, PROMPTS, generators=generators(range(5)), **options)
    assert batched == alone
    # any grouping and order: each prompt's rows come from its own generator
    order = [3, 0, 4]
    mixed = sample_batch(model, [PROMPTS[i] for i in order], generators=generators(order), **options)
    assert mixed == [alone[i] for i in order]
    # top-p truncation is applied per row, same as alone
    options["top_p"] = 0.6
    assert sample_batch(model, PROMPTS, generators=generators(range(5)), **options) == (
        one_at_a_time(model, PROMPTS, **options)
    )


@pytest.mark.parametrize("architecture", ["qwen3", "gpt2"])
def test_left_padded_loop_sees_the_logits_of_an_unpadded_forward(folders, architecture):
    """Every step's logits, in every row, equal a plain forward of prompt + completion so far.

    GPT-2's learned absolute positions make this fail unless position ids skip the padding.
    """
    model = load(folders[architecture])
    seen: list[torch.Tensor] = []
    widths: list[int] = []

    def record(module, args, out):
        seen.append(out.logits[:, -1].clone())
        widths.append(out.logits.shape[1])

    hook = model.register_forward_hook(record)
    try:
        batched = sample_batch(
            model, PROMPTS, samples=2, max_new_tokens=6, temperature=1.0, top_p=1.0,
            generators=generators(range(5)), eos_ids=[],
        )  # fmt: skip
    finally:
        hook.remove()
    assert len(seen) == 6  # the prompts, then one call per sampled token but the last
    assert widths == [1] * 6  # the prompt pass keeps only the last position's logits
    for p, (prompt, rows) in enumerate(zip(PROMPTS, batched, strict=True)):
        for k, completion in enumerate(rows):
            ids = torch.tensor([prompt + list(completion)])
            with torch.no_grad():
                plain = model(input_ids=ids).logits[0, len(prompt) - 1 : -1]
            looped = torch.stack([step[2 * p + k] for step in seen])
            torch.testing.assert_close(looped, plain, rtol=0, atol=1e-10)
            # so the sampled tokens' log-probs are the unpadded model's too
            tokens = torch.tensor(completion)[:, None]
            torch.testing.assert_close(
                torch.log_softmax(looped, -1).gather(1, tokens),
                torch.log_softmax(plain, -1).gather(1, tokens),
                rtol=0,
                atol=1e-10,
            )


def test_eos_cuts_each_row_after_its_first_eos(model):
    eos = list(range(0, 128, 3))  # a third of the vocabulary: rows end at different steps
    options = dict(samples=4, max_new_tokens=10, temperature=1.0, top_p=1.0, eos_ids=eos)
    batched = sample_batch(model, PROMPTS, generators=generators(range(5)), **options)
    assert batched == one_at_a_time(model, PROMPTS, **options)
    rows = [c for group in batched for c in group]
    for completion in rows:
        assert not any(t in eos for t in completion[:-1])  # nothing after the first EOS
        assert completion[-1] in eos or len(completion) == 10  # EOS kept
    assert len({len(c) for c in rows}) > 2

    calls: list[int] = []
    hook = model.register_forward_hook(lambda *_: calls.append(1))
    try:
        everything_ends = dict(options, eos_ids=list(range(128)))
        ended = sample_batch(model, PROMPTS, generators=generators(range(5)), **everything_ends)
    finally:
        hook.remove()
    assert len(calls) == 1  # all rows finished after the first token: no second forward
    assert all(len(c) == 1 for group in ended for c in group)


def write_prompts(path, prompts):
    path.write_text("".join(json.dumps({"prompt_ids": p}) + "\n" for p in prompts))
    return path


def test_estimate_rollouts_do_not_depend_on_the_sample_batch_size(folders, tmp_path):
    prompts = write_prompts(tmp_path / "prompts.jsonl", PROMPTS + [[7, 8, 9, 10], [2] * 5])
    saved = {}
    for size in (1, 2, 5):
        saved[size] = tmp_path / f"rollouts-{size}.jsonl"
        estimate_fisher(EstimateSettings(
            model=folders["qwen3"], output=tmp_path / f"fisher-{size}", prompts=prompts,
            samples_per_prompt=2, max_new_tokens=5, sample_batch_size=size, seed=3,
            dtype="float64", save_rollouts=saved[size], progress=False,
        ))  # fmt: skip
    rows = [json.loads(line) for line in saved[1].read_text().splitlines()]
    assert [r["prompt_ids"] for r in rows[::2]] == PROMPTS + [[7, 8, 9, 10], [2] * 5]  # prompt order
    assert saved[1].read_text() == saved[2].read_text() == saved[5].read_text()


def test_bad_sample_batch_size_is_one_line(folders, tmp_path, plain_argv):
    with pytest.raises(GraftError, match=r"^--sample-batch-size must be at least 1 \(got 0\)$"):
        check_sampling(1.0, 1.0, 1, 1, 0)
    from graftmerge.cli import main

    prompts = write_prompts(tmp_path / "prompts.jsonl", PROMPTS)
    result = CliRunner().invoke(main, [
        "fisher", "estimate", str(folders["qwen3"]), "-o", str(tmp_path / "x"), "--prompts",
        str(prompts), "--sample-batch-size", "0", "--no-progress",
    ])  # fmt: skip
    assert result.exit_code == 2, result.output
    assert [line for line in result.output.splitlines() if line.startswith("error:")] == [
        "error: --sample-batch-size must be at least 1 (got 0)"
    ]
    assert not (tmp_path / "x").exists()


def test_eager_float64_padding_fails_with_advice(folders):
    from transformers import AutoModelForCausalLM

    eager = AutoModelForCausalLM.from_pretrained(
        folders["qwen3"], dtype=torch.float64, attn_implementation="eager"
    ).eval()
    options = dict(samples=1, max_new_tokens=2, temperature=1.0, top_p=1.0, eos_ids=[])
    with pytest.raises(GraftError, match="non-finite logits for left-padded prompts"):
        sample_batch(eager, PROMPTS[:2], generators=generators(range(2)), **options)
    assert len(sample_batch(eager, PROMPTS[:1], generators=generators(range(1)), **options)) == 1
