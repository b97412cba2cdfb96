#!/usr/bin/env bash
# The fault harness's long form: the scenarios of
# crates/spillway-server/tests/faults.rs (Redis killed and restarted,
# paused, slowed, stalled and reset through a proxy; a cluster master
# killed, one master stalled, the cluster's connections reset), run longer,
# with more instances and clients, the ignored ones (which wait for store
# fixes) included, then a table of figures per fault and rule.
#
#   bash scripts/faults.sh                       # every scenario, ~7 minutes
#   SPILLWAY_FAULT_SECONDS=30 bash scripts/faults.sh redis_paused
#
# The arguments, if any, are test-name filters. The shape of a run comes from
# these variables (defaults here; the CI short form's in parentheses):
#   SPILLWAY_FAULT_SECONDS    how long each fault lasts          10 (2)
#   SPILLWAY_FAULT_INSTANCES  spillway serve processes             3 (2)
#   SPILLWAY_FAULT_KEYS       keys per rule                        3 (2)
#   SPILLWAY_FAULT_CLIENTS    clients per key                      4 (2)
#   SPILLWAY_FAULT_RATE       requests per second per client      25 (25)
#   SPILLWAY_FAULT_LIMIT      each rule's limit per 1 s window    60 (20)
#   FAULTS_RELEASE=0          test a debug build (default: release)
# Everything runs on loopback; every process it starts is stopped at the end
# of its scenario. Raw output: target/faults/output.txt.
set -uo pipefail
cd "$(dirname "$0")/.."

export SPILLWAY_REQUIRE_REDIS=1
export SPILLWAY_FAULT_SECONDS=${SPILLWAY_FAULT_SECONDS:-10}
export SPILLWAY_FAULT_INSTANCES=${SPILLWAY_FAULT_INSTANCES:-3}
export SPILLWAY_FAULT_KEYS=${SPILLWAY_FAULT_KEYS:-3}
export SPILLWAY_FAULT_CLIENTS=${SPILLWAY_FAULT_CLIENTS:-4}
export SPILLWAY_FAULT_RATE=${SPILLWAY_FAULT_RATE:-25}
export SPILLWAY_FAULT_LIMIT=${SPILLWAY_FAULT_LIMIT:-60}

profile=(--release)
if [[ ${FAULTS_RELEASE:-1} == 0 ]]; then
    profile=()
fi

out=target/faults
mkdir -p "$out"
echo "building the fault harness ${profile[*]:-(debug)}" >&2
cargo test "${profile[@]}" -p spillway-server --test faults --no-run >&2 || exit 1

echo "running: $SPILLWAY_FAULT_INSTANCES instances, $SPILLWAY_FAULT_KEYS keys per rule," \
    "$SPILLWAY_FAULT_CLIENTS clients per key at $SPILLWAY_FAULT_RATE/s," \
    "limit $SPILLWAY_FAULT_LIMIT per second, faults of $SPILLWAY_FAULT_SECONDS s" >&2
cargo test "${profile[@]}" -p spillway-server --test faults -- \
    --include-ignored --test-threads=1 --nocapture "$@" >"$out/output.txt" 2>&1
status=$?

# A table: one row per scenario and rule.
awk '
/^FAULT [^ ]+ rule=/ {
    name = $2
    row = name
    for (i = 3; i <= NF; i++) {
        split($i, kv, "=")
        if (kv[1] == "rule" || kv[1] == "policy" || kv[1] == "offered" ||
            kv[1] == "admitted" || kv[1] == "over_limit" || kv[1] == "phantom" ||
            kv[1] == "503" || kv[1] == "other_5xx" || kv[1] == "broken" ||
            kv[1] == "slow" || kv[1] == "p99" || kv[1] == "recovery") {
            v = kv[2]
            # Numbers printed after a padded "key=" land in the next field.
            if (v == "" && i < NF) { i++; v = $i }
            row = row "|" v
        }
    }
    print row
}' "$out/output.txt" >"$out/rows.txt"

{
    printf '| fault | rule | policy | offered | admitted | over limit | phantom charges | 503 | other 5xx | broken | slow | p99 | recovery |\n'
    printf '|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n'
    sed 's/|/ | /g; s/^/| /; s/$/ |/' "$out/rows.txt"
} | tee "$out/table.md"

echo
grep -E '^FAULT [^ ]+ (on|keys) ' "$out/output.txt" || true
echo
sed -n '/^failures:$/,/^test result/p' "$out/output.txt" | grep -E '^    [a-z_0-9]+$' | sed 's/^ */FAILED: /' | sort -u || true
grep -E '^test result:' "$out/output.txt" || true
if [[ $status != 0 ]]; then
    echo
    echo "some scenarios broke a promise (details in $out/output.txt):"
    grep -E '^[a-z0-9-]+: ' "$out/output.txt" | sort -u || true
fi
exit $status
