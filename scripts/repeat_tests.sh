#!/usr/bin/env bash
# Run a test file N times in a row, stopping at the first failure: the stability proof for tests
# that start processes (tests/test_distributed.py). One line per run goes to stdout.
#
#   bash scripts/repeat_tests.sh 20 tests/test_distributed.py
#
# Each run has a 30-minute bound on top of the tests' own timeouts; logs go to $LOGS (default
# a temporary directory, printed first).
set -uo pipefail
cd "$(dirname "$0")/.."
N=${1:?usage: repeat_tests.sh N TEST_PATH...}; shift
LOGS=${LOGS:-$(mktemp -d)}
echo "logs in $LOGS, commit $(git rev-parse --short HEAD)"
for i in $(seq 1 "$N"); do
    start=$(date +%s)
    timeout 1800 .venv/bin/python -m pytest -q -x -p no:cacheprovider "$@" > "$LOGS/run_$i.log" 2>&1
    rc=$?
    echo "run $i rc=$rc $(( $(date +%s) - start ))s $(tail -1 "$LOGS/run_$i.log") $(date -u +%H:%M)"
    [ $rc -ne 0 ] && exit $rc
done
echo "$N consecutive runs passed"
