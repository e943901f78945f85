#!/usr/bin/env bash
# mergekit's own test suite, from the sdist of the installed version, run with graftmerge
# installed: a registered merge method must keep the engine's whole contract.
# The sdist leaves out tests/common.py, which six of its modules import (test_basic_merges among
# them); scripts/mergekit_suite_common.py is graftmerge's own version of it, copied in, so they run.
# A test that fails with graftmerge's hook is run again without it (graftmerge_hook.pth's finder
# removed before mergekit is imported): only a failure that goes away there is graftmerge's, and
# fails this script; one that fails both ways is mergekit's own, and is reported.
# Usage: bash scripts/mergekit_suite.sh [pytest args]   (after scripts/install.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
py=$root/.venv/bin/python
version=$($py -c "import importlib.metadata as m; print(m.version('mergekit'))")
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
.venv/bin/pip download -q --no-deps --no-binary :all: "mergekit==$version" -d "$work" 2>&1 | grep -v "^WARNING: Location" || true
tar -xzf "$work"/mergekit-"$version".tar.gz -C "$work"
# Prove graft, fisher and regmean are registered in this interpreter, or the suite would not cover them.
$py -c "from mergekit import merge_methods; [merge_methods.get(m) for m in ('graft', 'fisher', 'regmean')]"
cd "$work/mergekit-$version"
cp "$root/scripts/mergekit_suite_common.py" tests/common.py
# A regular package, found before graftmerge's own tests/ (an editable install puts its checkout on sys.path).
touch tests/__init__.py
# The run without the hook: this plugin loads before any test module, removes the finder and checks
# that graft is then unknown to mergekit.
cat > without_graftmerge_hook.py <<'PY'
import sys

assert "mergekit" not in sys.modules, "mergekit was imported before the hook could be removed"
sys.meta_path[:] = [finder for finder in sys.meta_path if type(finder).__name__ != "_PostImportFinder"]
from mergekit import merge_methods  # noqa: E402

try:
    merge_methods.get("graft")
except Exception:
    pass
else:
    raise SystemExit("graft is still registered: the run without graftmerge's hook would not be one")
PY
# The installed mergekit is tested (not the sdist's copy): run from a folder without it on sys.path.
rm -rf mergekit
export HF_HUB_OFFLINE=1
set +e
"$py" -m pytest -q -o cache_dir="$work/cache" tests "$@"
status=$?
set -e
[ "$status" -eq 0 ] && exit 0
cp "$work/cache/v/cache/lastfailed" "$work/with-hook.json" 2>/dev/null || { echo "mergekit's suite did not run"; exit "$status"; }
echo "== the failures again, without graftmerge's hook"
"$py" -m pytest -q -o cache_dir="$work/cache" -p without_graftmerge_hook --last-failed tests "$@" || true
"$py" - "$work/with-hook.json" "$work/cache/v/cache/lastfailed" <<'PY'
import json, pathlib, sys
with_hook = set(json.loads(pathlib.Path(sys.argv[1]).read_text()))
without = pathlib.Path(sys.argv[2])
also_without = set(json.loads(without.read_text())) if without.exists() else set()
ours = sorted(with_hook - also_without)
for test in sorted(with_hook & also_without):
    print(f"fails without graftmerge too (mergekit's own): {test}")
for test in ours:
    print(f"fails only with graftmerge's hook: {test}")
sys.exit(1 if ours else 0)
PY
