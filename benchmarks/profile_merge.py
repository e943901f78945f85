"""Where one in-process graft merge spends its time: wall seconds inside named functions (CPU).

torch.profiler misses the threshold pass's background thread, so this wraps the
functions below with timers instead. Threads overlap: the per-function sums can exceed
the wall, and a function waiting for the CPU counts that wait.

``--skip-eigenvector-check`` replaces the orthonormality check and its record lookup
(hashing included) with nothing, to measure what they cost in a merge; results are
otherwise unchanged.

    python benchmarks/profile_merge.py graft.yml [--skip-eigenvector-check]
"""

from __future__ import annotations

import argparse
import collections
import functools
import shutil
import tempfile
import threading
import time
from pathlib import Path

from mergekit.merge import run_merge
from mergekit.options import MergeOptions

import graftmerge.formats.fisher_cache as fisher_cache
import graftmerge.formats.rotation_store as rotation_store
import graftmerge.math.global_threshold as global_threshold
import graftmerge.pipeline.graft as graft
import graftmerge.pipeline.graft_kernel as graft_kernel
import graftmerge.pipeline.graft_plan as graft_plan
import graftmerge.pipeline.threshold_pass as threshold_pass
from graftmerge.adapter import import_hook
from graftmerge.pipeline.config_files import read_graft_config

WATCHED = [
    (threshold_pass, "compute_global_threshold"), (threshold_pass, "_score_block"),
    (graft_kernel, "graft"), (graft_kernel, "remove_masked_pairs"), (graft_kernel, "remove_masked_coordinates"),
    (graft_plan.GraftInputs, "read_delta"), (graft_kernel, "read_fisher"),
    (fisher_cache.FisherCache, "kfac"), (fisher_cache, "orthonormal_digest"), (fisher_cache, "check_orthonormal"),
    (global_threshold.ThresholdSearch, "add_coarse"), (global_threshold.ThresholdSearch, "result"),
    (rotation_store.RotationStore, "save_pairs"), (rotation_store.RotationStore, "load_pairs"),
    # issue 24's checks: finite results, pinned inputs, loadable inputs
    (graft_kernel, "fits"), (graft_plan.GraftInputs, "check_unchanged"), (graft, "check_mergekit_inputs"),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", type=Path)
    parser.add_argument("--skip-eigenvector-check", action="store_true")
    args = parser.parse_args()
    seconds: collections.Counter[str] = collections.Counter()
    calls: collections.Counter[str] = collections.Counter()
    lock = threading.Lock()

    def timed(owner, name: str) -> None:
        original = getattr(owner, name)
        label = f"{getattr(owner, '__name__', owner).split('.')[-1]}.{name}"

        @functools.wraps(original)
        def wrapper(*positional, **keywords):
            start = time.perf_counter()
            try:
                return original(*positional, **keywords)
            finally:
                with lock:
                    seconds[label] += time.perf_counter() - start
                    calls[label] += 1

        setattr(owner, name, wrapper)

    for owner, name in WATCHED:
        timed(owner, name)
    if args.skip_eigenvector_check:
        fisher_cache.FisherCache._check_eigenvectors = lambda self, vectors, where, identity=None: None
    import_hook.install()
    config = read_graft_config(str(args.config))[0]
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch) / "out"
        start = time.perf_counter()
        run_merge(config, str(out), options=MergeOptions(quiet=True, out_shard_size=500_000_000))
        wall = time.perf_counter() - start
        shutil.rmtree(out, ignore_errors=True)
    print(f"merge in process: {wall:.1f} s wall (imports excluded)")
    for label, total in seconds.most_common():
        print(f"  {label:42s} {total:7.2f} s  {calls[label]:5d} calls")


if __name__ == "__main__":
    main()
