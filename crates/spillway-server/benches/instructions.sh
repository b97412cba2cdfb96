#!/usr/bin/env bash
# User-space instructions a proxied request costs `spillway proxy`, counted
# by valgrind's callgrind: repeatable for the same binary and load, whatever
# else the machine is doing, where wrk's rates move by several percent from
# run to run. A change to the proxy's path is measured this way before and
# after, beside service.sh's rates.
#
#   bash crates/spillway-server/benches/instructions.sh [OTHER_SPILLWAY]
#
# The proxy (with benches/bench.toml, in front of an nginx answering
# "hello") runs under callgrind twice, loaded by `wrk -t1 -c10` for
# $BENCH_SHORT (default 5) then $BENCH_LONG (default 20) seconds; the count
# a request is the difference of the two runs' instructions over the
# difference of their requests, so that start and stop cancel out. With
# OTHER_SPILLWAY (another commit's binary, built in a worktree), that binary
# is measured the same way and the ratio printed. Needs valgrind, wrk,
# nginx and curl (Debian: valgrind wrk nginx-light curl). Every process
# started here is stopped by its PID on exit.

set -euo pipefail

SHORT=${BENCH_SHORT:-5}
LONG=${BENCH_LONG:-20}
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=nginx_peer.sh
source "$HERE/nginx_peer.sh"
ROOT=$(cd "$HERE/../../.." && pwd)
TARGET=${CARGO_TARGET_DIR:-$ROOT/target}
WORK=$(mktemp -d /tmp/spillway-instructions.XXXXXX)
PIDS=()

cleanup() {
    for pid in "${PIDS[@]}"; do
        kill "$pid" 2>/dev/null || true
    done
    for pid in "${PIDS[@]}"; do
        wait "$pid" 2>/dev/null || true
    done
    rm -rf "$WORK"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

for tool in valgrind wrk nginx curl cargo; do
    command -v "$tool" >/dev/null || {
        echo "missing: $tool (Debian: apt-get install -y valgrind wrk nginx-light curl)" >&2
        exit 1
    }
done

free_port() {
    python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'
}

(cd "$ROOT" && cargo build --release -q -p spillway-server)
SPILLWAY=$TARGET/release/spillway

UP_PORT=$(free_port)
nginx_conf "$WORK/up" 1 <<EOF
    server {
        listen 127.0.0.1:$UP_PORT;
        location / { default_type text/plain; return 200 "hello\n"; }
    }
EOF
nginx -p "$WORK/up" -c "$WORK/up/nginx.conf" -g 'daemon off;' >"$WORK/up/out.log" 2>&1 &
PIDS+=($!)

# Starts the server to measure on port $2 under callgrind, writing its
# profile to $3: `nginx` (the peer: limit_req in front of the same
# upstream, as benches/service.sh configures it, in one process) or a
# spillway binary. Its PID is left in MEASURED.
start_measured() {
    local bin=$1 port=$2 out=$3
    if [[ $bin == nginx ]]; then
        local dir=$WORK/ng.$port
        nginx_conf "$dir" 1 <<EOF
$(peer_http_lines "$UP_PORT")
    server {
        listen 127.0.0.1:$port;
$(peer_location)
    }
EOF
        # One process: the worker's work and the master's together.
        valgrind --tool=callgrind --callgrind-out-file="$out" nginx -p "$dir" \
            -c "$dir/nginx.conf" -g 'daemon off; master_process off;' \
            >"$dir/out.log" 2>&1 &
    else
        valgrind --tool=callgrind --callgrind-out-file="$out" "$bin" proxy \
            --config "$HERE/bench.toml" --listen "127.0.0.1:$port" \
            --upstream "http://127.0.0.1:$UP_PORT" >"$WORK/proxy.$port.log" 2>&1 &
    fi
    MEASURED=$!
}

# Prints "instructions requests" for one run of $1 (see start_measured)
# under load for $2 s.
run() {
    local bin=$1 secs=$2 port out pid
    port=$(free_port)
    out=$WORK/cg.$port
    start_measured "$bin" "$port" "$out"
    pid=$MEASURED
    PIDS+=("$pid")
    for _ in $(seq 1 200); do
        curl -s -o /dev/null "http://127.0.0.1:$port/" && break
        sleep 0.2
    done
    local requests
    requests=$(wrk -t1 -c10 -d"${secs}s" "http://127.0.0.1:$port/" |
        awk '/requests in/ { print $1 }')
    kill -TERM "$pid"
    wait "$pid" 2>/dev/null || true
    local ir
    ir=$(awk '/^(summary|totals):/ { print $2; exit }' "$out")
    echo "$ir $requests"
}

# Prints the instructions a request of binary $1.
per_request() {
    local a b
    read -r -a a <<<"$(run "$1" "$SHORT")"
    read -r -a b <<<"$(run "$1" "$LONG")"
    python3 -c "print(round((${b[0]} - ${a[0]}) / (${b[1]} - ${a[1]})))"
}

this=$(per_request "$SPILLWAY")
echo "this build ($SPILLWAY): $this instructions a proxied request"
if [[ $# -ge 1 ]]; then
    other=$(per_request "$1")
    echo "other ($1): $other instructions a proxied request"
    python3 -c "print(f'this / other: {$this / $other:.3f}')"
fi
if [[ ${BENCH_NGINX:-1} == 1 ]]; then
    peer=$(per_request nginx)
    echo "nginx limit_req (the peer): $peer instructions a proxied request"
    python3 -c "print(f'this / nginx: {$this / $peer:.3f}')"
fi
