#!/usr/bin/env bash
# What the default `[store] max_memory` (256 MiB) costs `spillway serve`
# against `max_memory = "none"`: the same release binary, benches/bench.toml
# (one rule) as is and with "none", alternating, ROUNDS rounds of SECONDS_ s
# of `POST /v1/check` (wrk -t1 -c50, benches/check.lua, BENCH_KEYS keys).
# Prints each run's req/s, the server's CPU time a request (user + system,
# from /proc: steadier than req/s on a shared machine) and its resident set.
#
# Run with: cargo build --release -p spillway-server --bin spillway &&
#           bash crates/spillway-server/benches/max_memory.sh
#
# Needs wrk, curl and python3. Every server started here is stopped by its
# PID.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
BIN=${BIN:-$HERE/../../../target/release/spillway}
ROUNDS=${ROUNDS:-4}
SECONDS_=${SECONDS_:-8}
D=$(mktemp -d)
pid=
trap '[ -n "$pid" ] && kill "$pid" 2>/dev/null; rm -rf "$D"' EXIT
cp "$HERE/bench.toml" "$D/default.toml"
sed 's/^max_keys = 1000000$/max_keys = 1000000\nmax_memory = "none"/' "$HERE/bench.toml" >"$D/none.toml"
grep -q 'max_memory = "none"' "$D/none.toml"
for r in $(seq "$ROUNDS"); do
  for c in default none; do
    port=$((20000 + RANDOM % 20000))
    "$BIN" serve --config "$D/$c.toml" --listen "127.0.0.1:$port" >/dev/null 2>&1 &
    pid=$!
    for _ in $(seq 50); do
      curl -s -o /dev/null "http://127.0.0.1:$port/healthz" && break
      sleep 0.1
    done
    t0=$(awk '{print $14 + $15}' "/proc/$pid/stat")
    BENCH_KEYS=${BENCH_KEYS:-10000} wrk -t1 -c50 -d"${SECONDS_}s" -s "$HERE/check.lua" \
      "http://127.0.0.1:$port/v1/check" >"$D/out" 2>&1
    t1=$(awk '{print $14 + $15}' "/proc/$pid/stat")
    rps=$(awk '/Requests\/sec/ {print $2}' "$D/out")
    reqs=$(awk '/requests in/ {print $1}' "$D/out")
    rss=$(awk '/VmRSS/ {print $2}' "/proc/$pid/status")
    cpu=$(python3 -c "print(f'{($t1 - $t0) / $(getconf CLK_TCK) / $reqs * 1e6:.2f}')")
    echo "round $r $c: $rps req/s, $cpu us CPU a request, RSS $rss kB"
    kill "$pid"
    wait "$pid" 2>/dev/null || true
    pid=
  done
done
