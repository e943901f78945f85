"""The global threshold pass alone, and its parts, in-process on an existing graft config (CPU).

Times, for the config's plan (best of --repeats, each a fresh pass over the files):
  * read: Δ of every row block (donor, fine-tunes, deltas, as the merge forms it), and the Fisher;
  * read + score: the same with F ⊙ Δ² for diagonal Fishers, every block's scores kept;
  * search: the exact radix search over those kept scores alone (no reading);
  * the pass as graft runs it (read-ahead thread + search, masks kept for the merge).
The sum of the parts against the pass shows what the two threads overlap on this machine.

    python benchmarks/bench_threshold_pass.py graft.yml [--repeats 3]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from graftmerge.formats.rotation_store import RotationStore
from graftmerge.math.global_threshold import ThresholdSearch
from graftmerge.math.scores import diagonal_scores
from graftmerge.math.selection import masked_count
from graftmerge.pipeline.config_files import read_graft_config
from graftmerge.pipeline.graft_plan import GraftInputs
from graftmerge.pipeline.threshold_pass import compute_global_threshold


def best(repeats: int, run) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", type=Path, help="a graft config with a global mask (rho > 0, fisher)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    inputs = GraftInputs.open(read_graft_config(str(args.config))[2])
    names = inputs.ranked_names()
    blocks = [(name, rows) for name in names for rows in inputs.row_blocks(name)]
    diagonal = all(inputs.fisher_kind(name) == "diagonal" for name in names)
    total = sum(inputs.direction_count(name) for name in names)

    def read() -> None:
        for name, rows in blocks:
            inputs.read_delta(name, "cpu", rows)
            inputs.tensor_fisher(name, rows)

    def scores() -> list:
        return [diagonal_scores(inputs.tensor_fisher(name, rows).diagonal, inputs.read_delta(name, "cpu", rows),
                                in_place=True) for name, rows in blocks]

    def whole_pass() -> None:
        with tempfile.TemporaryDirectory() as scratch:
            compute_global_threshold(inputs, progress=False, rotations=RotationStore(scratch))

    print(
        f"{len(names)} ranked tensors, {len(blocks)} row blocks, {total / 1e9:.3f}B directions; best of {args.repeats}"
    )
    print(f"  read Δ and Fisher          {best(args.repeats, read):6.2f} s")
    if diagonal:
        print(f"  read + score (all kept)    {best(args.repeats, scores):6.2f} s")
        kept = scores()

        def search() -> None:
            found = ThresholdSearch(k=masked_count(inputs.plan.rho, total), total=total, keep_positions=True)
            for (name, _), block in zip(blocks, kept):
                found.add_coarse(name, block)
            found.result()

        print(f"  search alone               {best(args.repeats, search):6.2f} s")
        del kept
    print(f"  the pass (as graft runs it) {best(args.repeats, whole_pass):5.2f} s")


if __name__ == "__main__":
    main()
