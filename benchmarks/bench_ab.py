"""A/B of two versions of graftmerge on one merge config, with a peer config in the same rounds (CPU).

The other version (``--old``, any git revision of this repository) is checked out in a
temporary git worktree and put first on ``PYTHONPATH`` of its runs, so the same
environment (torch, mergekit, the `.pth` hook) runs both. Every run is a fresh
`mergekit-yaml` process with an empty threshold cache, rounds interleaved (old, new,
peer); prints each run, then medians, per-run ratios to the peer's median, and the paired
per-round difference new − old. On a shared or small machine the spread is the result:
a difference inside it is no difference.

    python benchmarks/bench_ab.py --old HEAD~1 --config graft.yml --peer ta.yml [--repeats 4]
                                  [--cache-dir DIR]

This is how the two designs tried and reverted were measured (docs/performance.md).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import tempfile
from pathlib import Path

from common import BIN, timed_run

REPOSITORY = Path(__file__).resolve().parent.parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--old", required=True, help="git revision of the version to compare against")
    parser.add_argument("--config", type=Path, required=True, help="the merge config both versions run")
    parser.add_argument("--peer", type=Path, help="a config run in the same rounds (e.g. task_arithmetic)")
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--cache-dir", type=Path, help="GRAFTMERGE_CACHE_DIR of every run (default: a fresh folder)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        old_tree = scratch / "old"
        subprocess.run(["git", "-C", str(REPOSITORY), "worktree", "add", "--detach", "-q", str(old_tree), args.old],
                       check=True)
        try:
            runs = {"old": (args.config, str(old_tree)), "new": (args.config, str(REPOSITORY))}
            if args.peer is not None:
                runs["peer"] = (args.peer, str(REPOSITORY))
            env = {"GRAFTMERGE_NO_THRESHOLD_CACHE": "1",
                   "GRAFTMERGE_CACHE_DIR": str(args.cache_dir or scratch / "user-cache")}
            walls: dict[str, list[float]] = {name: [] for name in runs}
            for repeat in range(args.repeats):
                for name, (config, code) in runs.items():
                    out = scratch / "out"
                    shutil.rmtree(out, ignore_errors=True)
                    python_path = os.pathsep.join(filter(None, [code, os.environ.get("PYTHONPATH")]))
                    wall, rss = timed_run([str(BIN / "mergekit-yaml"), str(config), str(out), "--quiet"],
                                          env={**env, "PYTHONPATH": python_path})
                    walls[name].append(wall)
                    print(f"  round {repeat + 1} {name:5s} {wall:7.1f} s  {rss:8.0f} MB", flush=True)
        finally:
            subprocess.run(["git", "-C", str(REPOSITORY), "worktree", "remove", "--force", str(old_tree)], check=False)
    peer = statistics.median(walls["peer"]) if "peer" in walls else None
    print(f"\nmedians of {args.repeats} (old = {args.old}, new = the working tree)")
    for name, values in walls.items():
        ratio = "" if peer is None else (f"  ÷ peer {statistics.median(values) / peer:5.2f} "
                                         f"(runs {min(values) / peer:.2f}–{max(values) / peer:.2f})")
        print(f"  {name:5s} {statistics.median(values):7.1f} s{ratio}")
    differences = [new - old for new, old in zip(walls["new"], walls["old"])]
    spread = statistics.stdev(differences) if len(differences) > 1 else 0.0
    print(f"  new − old per round: {statistics.fmean(differences):+.1f} ± {spread:.1f} s "
          f"(new faster in {sum(d < 0 for d in differences)}/{len(differences)})")


if __name__ == "__main__":
    main()
