#!/usr/bin/env bash
# The long form of the parser property tests (issue 17, item 8): every
# property of every parser of untrusted input, with CASES cases each
# (default 5000; CI runs 100 to 300). Prints each target's time.
#
#   scripts/parsers-long-run.sh          # 5000 cases per property
#   CASES=20000 scripts/parsers-long-run.sh
set -euo pipefail
cd "$(dirname "$0")/.."
export PROPTEST_CASES="${CASES:-5000}"
echo "PROPTEST_CASES=$PROPTEST_CASES"
run() {
    local started=$SECONDS
    cargo test -q "$@"
    echo "== $* : $((SECONDS - started)) s"
}
# Build first, so that the times are the tests'.
cargo test -q --no-run -p spillway-sim -p spillway-server -p spillway-tower
run -p spillway-sim --test trace_properties
run -p spillway-server --test parsers
run -p spillway-tower --test middleware parsed_headers
