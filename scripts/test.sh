#!/usr/bin/env bash
# Set everything up, then run the test suite.
#
#   bash scripts/test.sh                 every test (about 50 minutes on 2 cores), in three phases,
#                                        fastest first so a unit failure shows in minutes:
#     1. every test not marked `slow` on both cores (pytest-xdist, a file per worker): unit tests and
#        single-process integration tests, whose outcome does not depend on the machine's load;
#     2. the `slow` tests not marked `long`, one at a time: a few real peers whose matchmaking windows,
#        deadlines and record lifetimes decide what happens, so they get the machine to themselves;
#     3. the `long` tests, one at a time: whole scenarios of a minute or more each (home networks behind NAT,
#        relays, attacks over many rounds, monitoring, fragments, codecs end to end).
#   bash scripts/test.sh --quick         phases 1 and 2 (about 10 minutes): what .ci/run runs today.
#   bash scripts/test.sh --long          phase 3 only.
#   bash scripts/test.sh PYTEST_ARGS...  plain pytest with those arguments (e.g. tests/unit -x).
#
# Extra pytest options for every phase of a whole run: P2P_DILOCO_PYTEST_OPTS (e.g. "-q --durations=15").
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
py=.venv/bin/python
mode=all
case "${1:-}" in
    --quick) mode=quick; shift ;;
    --long) mode=long; shift ;;
    --all) mode=all; shift ;;
esac
if [ "$mode" = all ] && [ $# -gt 0 ]; then
    exec "$py" -m pytest "$@"
fi
read -r -a opts <<< "${P2P_DILOCO_PYTEST_OPTS:-}"
status=0
# every phase collects tests: pytest's exit code 5 ("no test collected") fails the run like any other
run() { "$py" -m pytest "$@" "${opts[@]}" || { rc=$?; [ "$rc" = 5 ] && echo "test.sh: no test collected by: $*" >&2; status=$rc; }; }
if [ "$mode" != long ]; then
    run -n 2 --dist loadfile -m "not slow"
    run -m "slow and not long"
fi
if [ "$mode" != quick ]; then
    run -m "slow and long"
fi
exit "$status"
