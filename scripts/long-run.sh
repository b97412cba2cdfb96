#!/usr/bin/env bash
# Long runs (#17 item 4): `spillway serve` and `spillway proxy` (with an
# upstream the test starts on loopback), side by side under a steady load for
# 30 minutes, sampled every minute: RSS, open file descriptors (/proc/PID/fd),
# p50/p99 latency and the store's key count (/metrics). At the end it fails
# if any request failed, RSS grew more than the bound from the second quarter
# to the last, the p99 after the first quarter is over its bound, the
# descriptors are not back where they started, or the store holds more keys
# than the load uses. The load generator is Rust, in the test itself
# (crates/spillway-server/tests/process_support/load.rs); CI runs the same
# test for 60 seconds in a debug build.
#
# Usage: scripts/long-run.sh            # 30 minutes, a sample a minute
#        DURATION=600 scripts/long-run.sh   # 10 minutes
# Environment (defaults): DURATION=1800 (s), SAMPLE=60 (s), RATE=500
# (requests/s per process), RSS_MIB=16 (growth bound), P99_MS=25,
# OUT=target/long-run.log (the samples and the verdicts).
set -euo pipefail
cd "$(dirname "$0")/.."

duration=${DURATION:-1800}
sample=${SAMPLE:-60}
rate=${RATE:-500}
rss=${RSS_MIB:-16}
p99=${P99_MS:-25}
out=${OUT:-target/long-run.log}
mkdir -p "$(dirname "$out")"

cargo test --release -p spillway-server --test long_run --no-run
echo "long run: ${duration}s, a sample every ${sample}s, ${rate} req/s per process; log: $out"
SPILLWAY_LONG_RUN_SECS=$duration \
SPILLWAY_LONG_RUN_SAMPLE_SECS=$sample \
SPILLWAY_LONG_RUN_RATE=$rate \
SPILLWAY_LONG_RUN_RSS_MIB=$rss \
SPILLWAY_LONG_RUN_P99_MS=$p99 \
    cargo test --release -p spillway-server --test long_run -- --nocapture --test-threads=2 2>&1 | tee "$out"
