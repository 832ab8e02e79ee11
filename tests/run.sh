#!/usr/bin/env bash
# The README's test command (also .ci/run's and `nox -s tests`'): every test, in two lanes at once.
#
# - The timing-sensitive files (marked `serial`: hang budgets, heartbeats, rendezvous, kills mid-save)
#   run one at a time at normal priority. Half of their wall time is waiting (for a timeout, a
#   heartbeat, a killed rank), which left a core idle when they ran after the others.
# - Every other file runs beside them, two files at a time (pytest-xdist, a file per worker), at the
#   lowest CPU priority (`nice -n 19`): it takes only the CPU the timing-sensitive lane leaves, so
#   those tests still see a quiet machine, and the idle time is used.
#
# The timing lane's output is printed after the other lane's; the exit status is non-zero if either
# lane failed. Python: $PYTHON, else .venv/bin/python, else python3.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
export OMP_NUM_THREADS=1
log=$(mktemp)
trap 'rm -f "$log"' EXIT

# no cache plugin in this lane: two pytest runs would write .pytest_cache at once
"$PY" -m pytest -q -m serial -p no:cacheprovider >"$log" 2>&1 &
timing=$!
nice -n 19 "$PY" -m pytest -q -n 2 --dist loadfile -m "not serial"
rest=$?
wait "$timing"
timed=$?
echo
echo "---- the timing-sensitive files (marked serial), run beside the others at normal priority:"
cat "$log"
if [ "$rest" -ne 0 ] || [ "$timed" -ne 0 ]; then
    echo "tests failed (other files: exit $rest; timing-sensitive files: exit $timed)"
    exit 1
fi
