#!/usr/bin/env bash
# Set everything up, then run the test suite.
#
#   bash scripts/test.sh                 the whole suite, in two phases (what CI runs):
#     1. every test not marked `slow` on both cores (pytest-xdist, a file per worker): unit tests and
#        single-process integration tests, whose outcome does not depend on the machine's load;
#     2. the `slow` tests, one at a time: several real peers whose matchmaking windows, deadlines and record
#        lifetimes decide what happens, so they get the machine to themselves.
#   bash scripts/test.sh PYTEST_ARGS...  plain pytest with those arguments (e.g. tests/unit -x).
#
# Extra pytest options for both phases of a whole run: P2P_DILOCO_PYTEST_OPTS (e.g. "-q --durations=15").
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
py=.venv/bin/python
if [ $# -gt 0 ]; then
    exec "$py" -m pytest "$@"
fi
read -r -a opts <<< "${P2P_DILOCO_PYTEST_OPTS:-}"
status=0
# exit code 5 is "no test collected" (a filtered-out phase), not a failure
"$py" -m pytest -n 2 --dist loadfile -m "not slow" "${opts[@]}" || { rc=$?; [ "$rc" = 5 ] || status=$rc; }
"$py" -m pytest -m slow "${opts[@]}" || { rc=$?; [ "$rc" = 5 ] || status=$rc; }
exit "$status"
