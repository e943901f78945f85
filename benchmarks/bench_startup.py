"""Start-up cost of the import hook that makes stock `mergekit-yaml` know `graft`.

graftmerge_hook.pth runs at every interpreter start. Measured here: the self+cumulative
import time of graftmerge modules in `python -X importtime -c pass` (median of 20), next
to the median wall time of `python -c pass` itself.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time


def main() -> None:
    hook_us, walls = [], []
    for _ in range(20):
        start = time.perf_counter()
        result = subprocess.run([sys.executable, "-X", "importtime", "-c", "pass"], capture_output=True, text=True)
        walls.append(time.perf_counter() - start)
        total = 0
        for line in result.stderr.splitlines():
            parts = line.split("|")
            if len(parts) == 3 and parts[2].strip() in ("graftmerge", "graftmerge.adapter.import_hook"):
                total = max(total, int(parts[1]))  # cumulative µs of the outermost graftmerge import
        hook_us.append(total)
    print(f"python -c pass: {statistics.median(walls) * 1e3:.1f} ms wall (median of 20)")
    print(f"graftmerge hook import: {statistics.median(hook_us) / 1e3:.2f} ms (limit 20 ms)")


if __name__ == "__main__":
    main()
