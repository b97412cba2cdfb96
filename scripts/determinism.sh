#!/usr/bin/env bash
# Runs the suites that start real processes (Redis, the Redis Cluster, the
# server, the proxy, the fault harness) many times in a row with every core
# kept busy, and reports each test that failed at least once: any such test
# is a bug, in the test or in the code.
#
#   ROUNDS=20 bash scripts/determinism.sh          # the default: 20 rounds
#   BUSY=0 ROUNDS=3 bash scripts/determinism.sh    # without the busy loops
#   EXCLUDE="faults" bash scripts/determinism.sh   # without those suites
#   ONLY="faults" bash scripts/determinism.sh      # only those suites
#
# A round takes about 20 s without the fault harness, whose 11 scenarios
# add about 2.5 minutes (20 rounds: about 55 minutes).
#
# The test binaries are built once, then run directly (no cargo in the
# loop); a round's output is kept in target/determinism/ for every failure.
set -euo pipefail
cd "$(dirname "$0")/.."

rounds=${ROUNDS:-20}
busy=${BUSY:-1}
out=target/determinism
mkdir -p "$out"
export SPILLWAY_REQUIRE_REDIS=1 SPILLWAY_REQUIRE_H11=1

# The suites: spillway-redis's, and spillway-server's that start servers.
suites=(
    "spillway-redis:redis_store"
    "spillway-redis:conformance"
    "spillway-server:serve"
    "spillway-server:serve_redis"
    "spillway-server:serve_bin"
    "spillway-server:serve_security"
    "spillway-server:serve_wire"
    "spillway-server:grpc"
    "spillway-server:grpc_descriptors"
    "spillway-server:grpc_limits"
    "spillway-server:proxy"
    "spillway-server:proxy_shaping"
    "spillway-server:proxy_wire"
)
# The fault harness and the lifecycle tests, where present.
for extra in faults lifecycle shutdown reload_load long_run flood; do
    if [[ -f crates/spillway-server/tests/$extra.rs ]]; then
        suites+=("spillway-server:$extra")
    fi
done

# Suites left out by name (the part after the colon).
if [[ -n "${EXCLUDE:-}" ]]; then
    kept=()
    for suite in "${suites[@]}"; do
        if [[ " $EXCLUDE " != *" ${suite#*:} "* ]]; then
            kept+=("$suite")
        fi
    done
    suites=("${kept[@]}")
fi

# Only the suites named (the part after the colon), if any are.
if [[ -n "${ONLY:-}" ]]; then
    kept=()
    for suite in "${suites[@]}"; do
        if [[ " $ONLY " == *" ${suite#*:} "* ]]; then
            kept+=("$suite")
        fi
    done
    suites=("${kept[@]}")
fi
if [[ ${#suites[@]} -eq 0 ]]; then
    echo "no suite left to run" >&2
    exit 1
fi

declare -A binary=()
for suite in "${suites[@]}"; do
    crate=${suite%%:*}
    test=${suite#*:}
    # Cargo's own messages go to a file, shown if the build fails.
    path=$(cargo test -p "$crate" --test "$test" --no-run --message-format=json 2>"$out/build.log" |
        python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == sys.argv[1]:
        print(m["executable"])
' "$test" | tail -n 1) || path=""
    if [[ -z "$path" ]]; then
        echo "could not build $suite:" >&2
        tail -n 30 "$out/build.log" >&2
        exit 1
    fi
    binary[$suite]=$path
done

busy_pids=()
stop_busy() {
    for pid in "${busy_pids[@]}"; do
        kill "$pid" 2>/dev/null || true
    done
}
trap stop_busy EXIT
if [[ "$busy" == 1 ]]; then
    for _ in $(seq "$(nproc)"); do
        (while :; do :; done) &
        busy_pids+=($!)
    done
fi

declare -A failures=()
passed=0
started=$(date +%s)
for round in $(seq "$rounds"); do
    for suite in "${suites[@]}"; do
        crate=${suite%%:*}
        log="$out/round-$round-${suite/:/-}.log"
        # Run from the crate's directory, as cargo test does.
        if (cd "crates/$crate" && "${binary[$suite]}" >"$OLDPWD/$log" 2>&1); then
            passed=$((passed + $(grep -oE '^test result: ok\. [0-9]+ passed' "$log" | awk '{s += $4} END {print s + 0}')))
            rm -f "$log"
        else
            for name in $(grep -E '^test .* FAILED$' "$log" | awk '{print $2}'); do
                failures["$suite::$name"]=$((${failures["$suite::$name"]:-0} + 1))
            done
            if ! grep -qE '^test .* FAILED$' "$log"; then
                failures["$suite::(the binary)"]=$((${failures["$suite::(the binary)"]:-0} + 1))
            fi
        fi
    done
    echo "round $round of $rounds done ($(($(date +%s) - started)) s)"
done

echo
echo "$rounds rounds of ${#suites[@]} suites, busy loops: $busy, $(($(date +%s) - started)) s, $passed test runs passed"
if [[ ${#failures[@]} -eq 0 ]]; then
    echo "no test failed"
    exit 0
fi
echo "failed at least once (failures / rounds):"
for key in "${!failures[@]}"; do
    echo "  $key: ${failures[$key]} / $rounds"
done
echo "logs: $out/"
exit 1
