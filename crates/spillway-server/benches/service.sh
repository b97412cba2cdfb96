#!/usr/bin/env bash
# The service's peer comparisons, in one run, on loopback only (issue 5,
# item 10):
#
#   1. `spillway serve` POST /v1/check  vs  throttlecrab-server POST /throttle,
#      then the control: GET /healthz vs GET /health (no work on either side),
#      then the ceiling: POST /v1/check vs nginx answering every POST with
#      the same JSON, checking nothing
#   2. `spillway proxy` (a rule that never denies)  vs  nginx limit_req
#      (a zone that never denies, burst + nodelay), both in front of the
#      same upstream (a separate nginx answering "hello").
#   3. nginx with `auth_request` to `spillway serve`'s forward-auth hook
#      (examples/forward-auth/nginx.conf as it is, the same rule)  vs  nginx
#      limit_req alone, both in front of that upstream, the CPU of nginx
#      and the hook counted together; then the hook's own cost: GET
#      /v1/forward-auth as a proxy calls it vs POST /v1/check, keys spread
#      alike, on one spillway process.
#
# Run with: bash crates/spillway-server/benches/service.sh
#
# Needs wrk, nginx, curl and python3 (Debian: apt-get install -y wrk
# nginx-light curl) and cargo. Installs throttlecrab-server with
# `cargo install --locked` into target/bench-tools (not a dependency; override
# with BENCH_TOOLS=DIR) the first time: its build script needs `protoc`
# (Debian: protobuf-compiler). If it does not install, the throttlecrab
# comparison is skipped with a message.
#
# Each side is measured with the same wrk (-t$BENCH_THREADS -c$BENCH_CONNS,
# -d$BENCH_SECONDS s), the two sides alternating, $BENCH_ROUNDS rounds; the
# medians are compared, with the CPU time each server process (nginx: its
# workers too) took per request. BENCH_PARTS=check, =proxy or =hook runs one
# part; BENCH_PARTS=h2 (not run by default) measures the proxy against
# nginx limit_req over HTTP/2 without TLS with h2load (Debian:
# nghttp2-client), $BENCH_STREAMS (default 4) streams open on each
# connection. Defaults: 1 thread, 50 connections, 10 s, 3 rounds
# (about 4.5 minutes once built). Every process started here is stopped by its
# PID on exit.
#
# BENCH_PARTS=versions BENCH_OTHER=PATH compares two builds of spillway
# instead: the one built here against the binary at PATH (an older commit's,
# built in a worktree), /v1/check then the proxy, alternating as above. A
# change to a hot path is measured this way before and after.
#
# BENCH_PIN=1 keeps the load generator and the servers off each other's
# cores (taskset, util-linux): wrk on CPU 0, every server on the last CPU.
# Each server then sees one CPU: one tokio worker each, one nginx worker.
# Without it, wrk and the servers share every core, and throughput moves
# with how the scheduler spreads them (see BENCHMARKS.md).

set -euo pipefail

ROUNDS=${BENCH_ROUNDS:-3}
SECS=${BENCH_SECONDS:-10}
CONNS=${BENCH_CONNS:-50}
STREAMS=${BENCH_STREAMS:-4}
THREADS=${BENCH_THREADS:-1}
KEYS=${BENCH_KEYS:-10000}
PIN=${BENCH_PIN:-0}

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=nginx_peer.sh
source "$HERE/nginx_peer.sh"
ROOT=$(cd "$HERE/../../.." && pwd)
TARGET=${CARGO_TARGET_DIR:-$ROOT/target}
TOOLS=${BENCH_TOOLS:-$TARGET/bench-tools}
WORK=$(mktemp -d /tmp/spillway-bench.XXXXXX)
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

for tool in wrk nginx curl cargo; do
    command -v "$tool" >/dev/null || {
        echo "missing: $tool (Debian: apt-get install -y wrk nginx-light curl)" >&2
        exit 1
    }
done

if [[ $PIN == 1 ]]; then
    command -v taskset >/dev/null || {
        echo "missing: taskset (Debian: util-linux)" >&2
        exit 1
    }
    LOAD=(taskset -c 0)
    SERVE=(taskset -c "$(($(nproc) - 1))")
    NGINX_WORKERS=1
else
    LOAD=()
    SERVE=()
    NGINX_WORKERS=auto
fi

free_port() {
    python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'
}

# Waits up to 10 s for `curl ARGS...` to succeed.
wait_for() {
    for _ in $(seq 100); do
        curl -fsS -o /dev/null --max-time 1 "$@" 2>/dev/null && return 0
        sleep 0.1
    done
    echo "not answering: $*" >&2
    return 1
}

TICKS=$(getconf CLK_TCK)

# The CPU time used so far by the processes $1 (one PID, or several
# separated by spaces) and their child processes (nginx's workers), in
# clock ticks: "USER SYSTEM" (/proc/PID/stat's utime and stime).
cpu_ticks() {
    local user=0 system=0 root pid u s
    for root in $1; do
        for pid in "$root" $(pgrep -P "$root" || true); do
            read -r u s < <(awk '{print $14, $15}' "/proc/$pid/stat" 2>/dev/null || echo 0 0)
            user=$((user + u)) system=$((system + s))
        done
    done
    echo "$user $system"
}

# How many connections the upstream nginx has accepted so far (its
# stub_status), or 0 when there is none.
upstream_accepts() {
    [[ -n ${UP_STATUS:-} ]] || {
        echo 0
        return
    }
    curl -fsS --max-time 1 "$UP_STATUS" | awk 'NR == 3 {print $1}'
}

# wrk's requests/s, p99 (ms), non-2xx count, the CPU time the server
# process $BENCH_PID took per request (us; 0 without one), that time's user
# and system parts, and how many connections the upstream accepted meanwhile
# (a proxy that keeps its upstream connections alive opens about one per
# client connection, once), as "RATE P99 BAD CPU USER SYS UPCONNS".
# Throughput here moves with whatever else the shared machine runs; the CPU
# a request costs moves less.
run_wrk() {
    local out u0=0 s0=0 u1=0 s1=0 a0 a1
    [[ -n ${BENCH_PID:-} ]] && read -r u0 s0 < <(cpu_ticks "$BENCH_PID")
    a0=$(upstream_accepts)
    out=$(timeout $((SECS + 20)) "${LOAD[@]}" wrk "-t$THREADS" "-c$CONNS" "-d${SECS}s" --timeout 5s --latency "$@")
    [[ -n ${BENCH_PID:-} ]] && read -r u1 s1 < <(cpu_ticks "$BENCH_PID")
    a1=$(upstream_accepts)
    echo "$out" >>"$WORK/wrk.log"
    local rate p99 bad unit errs count cpu
    rate=$(awk '/^Requests\/sec:/ {print $2}' <<<"$out")
    p99=$(awk '$1 == "99%" {print $2}' <<<"$out")
    bad=$(awk '/Non-2xx or 3xx responses:/ {print $NF}' <<<"$out")
    errs=$(awk '/Socket errors:/ {print}' <<<"$out")
    [[ -n $errs ]] && echo "    wrk: $errs" >&2
    # p99 in milliseconds.
    unit=${p99//[0-9.]/}
    p99=${p99%"$unit"}
    case $unit in
    us) p99=$(awk -v v="$p99" 'BEGIN {print v / 1000}') ;;
    ms) ;;
    s) p99=$(awk -v v="$p99" 'BEGIN {print v * 1000}') ;;
    esac
    count=$(awk '/requests in/ {print $1}' <<<"$out")
    local per='BEGIN {print (n > 0 ? t * 1e6 / hz / n : 0)}' user system
    cpu=$(awk -v t=$((u1 - u0 + s1 - s0)) -v hz="$TICKS" -v n="${count:-0}" "$per")
    user=$(awk -v t=$((u1 - u0)) -v hz="$TICKS" -v n="${count:-0}" "$per")
    system=$(awk -v t=$((s1 - s0)) -v hz="$TICKS" -v n="${count:-0}" "$per")
    echo "${rate:-0} ${p99:-0} ${bad:-0} ${cpu} ${user} ${system} $((a1 - a0))"
}

median() {
    tr ' ' '\n' <<<"$*" | sort -g | awk '{a[NR] = $1} END {print a[int((NR + 1) / 2)]}'
}

# Alternates two sides for $ROUNDS rounds; prints the medians and the ratio.
# compare LABEL_A FUNC_A LABEL_B FUNC_B, each FUNC running `run_wrk ...`.
# The same as run_wrk, with h2load over HTTP/2 (prior knowledge):
# -c$CONNS connections, -m$STREAMS streams open on each. p99 from its
# per-request log; "non-2xx" counts failed requests too.
run_h2load() {
    local out u0=0 s0=0 u1=0 s1=0 a0 a1 log
    log=$(mktemp "$WORK/h2load.XXXXXX")
    [[ -n ${BENCH_PID:-} ]] && read -r u0 s0 < <(cpu_ticks "$BENCH_PID")
    a0=$(upstream_accepts)
    out=$(timeout $((SECS + 20)) "${LOAD[@]}" h2load -t1 "-c$CONNS" "-m$STREAMS" "-D$SECS" --log-file="$log" "$@")
    [[ -n ${BENCH_PID:-} ]] && read -r u1 s1 < <(cpu_ticks "$BENCH_PID")
    a1=$(upstream_accepts)
    echo "$out" >>"$WORK/h2load.log"
    local rate p99 bad count cpu user system
    rate=$(awk '/^finished in/ {print $4}' <<<"$out")
    count=$(awk '/^requests:/ {print $8}' <<<"$out")
    bad=$(awk '/^requests:/ {f = $10} /^status codes:/ {b = $5 + $7 + $9} END {print f + b}' <<<"$out")
    # The log's third column: each request's time in microseconds.
    p99=$(sort -n -k3,3 "$log" | awk '{v[NR] = $3} END {i = int(NR * 0.99); if (i < 1) i = 1; print v[i] / 1000}')
    rm -f "$log"
    local per='BEGIN {print (n > 0 ? t * 1e6 / hz / n : 0)}'
    cpu=$(awk -v t=$((u1 - u0 + s1 - s0)) -v hz="$TICKS" -v n="${count:-0}" "$per")
    user=$(awk -v t=$((u1 - u0)) -v hz="$TICKS" -v n="${count:-0}" "$per")
    system=$(awk -v t=$((s1 - s0)) -v hz="$TICKS" -v n="${count:-0}" "$per")
    echo "${rate:-0} ${p99:-0} ${bad:-0} ${cpu} ${user} ${system} $((a1 - a0))"
}

compare() {
    local la=$1 fa=$2 lb=$3 fb=$4
    local ra=() rb=() pa=() pb=() ca=() cb=() ua=() ub=() sa=() sb=() r p bad c u s up
    # Warm-up: 2 s each.
    local save=$SECS
    SECS=2
    "$fa" >/dev/null
    "$fb" >/dev/null
    SECS=$save
    for i in $(seq "$ROUNDS"); do
        read -r r p bad c u s up < <("$fa")
        printf '  round %d  %-24s %9.0f req/s  p99 %7.2f ms  cpu %5.1f us/req (user %.1f, system %.1f)  upstream conns %s  non-2xx %s  (load %s)\n' \
            "$i" "$la" "$r" "$p" "$c" "$u" "$s" "$up" "$bad" "$(cut -d' ' -f1 /proc/loadavg)"
        ra+=("$r") pa+=("$p") ca+=("$c") ua+=("$u") sa+=("$s")
        read -r r p bad c u s up < <("$fb")
        printf '  round %d  %-24s %9.0f req/s  p99 %7.2f ms  cpu %5.1f us/req (user %.1f, system %.1f)  upstream conns %s  non-2xx %s  (load %s)\n' \
            "$i" "$lb" "$r" "$p" "$c" "$u" "$s" "$up" "$bad" "$(cut -d' ' -f1 /proc/loadavg)"
        rb+=("$r") pb+=("$p") cb+=("$c") ub+=("$u") sb+=("$s")
    done
    local mra mrb mpa mpb mca mcb
    mra=$(median "${ra[@]}") mrb=$(median "${rb[@]}")
    mpa=$(median "${pa[@]}") mpb=$(median "${pb[@]}")
    mca=$(median "${ca[@]}") mcb=$(median "${cb[@]}")
    printf '  median   %-24s %9.0f req/s  p99 %7.2f ms  cpu %5.1f us/req (user %.1f, system %.1f)\n' \
        "$la" "$mra" "$mpa" "$mca" "$(median "${ua[@]}")" "$(median "${sa[@]}")"
    printf '  median   %-24s %9.0f req/s  p99 %7.2f ms  cpu %5.1f us/req (user %.1f, system %.1f)\n' \
        "$lb" "$mrb" "$mpb" "$mcb" "$(median "${ub[@]}")" "$(median "${sb[@]}")"
    awk -v a="$mra" -v b="$mrb" -v pa="$mpa" -v pb="$mpb" -v ca="$mca" -v cb="$mcb" -v la="$la" -v lb="$lb" \
        'BEGIN {printf "  RATIO    %s / %s: throughput %.2fx; p99 %.2f ms vs %.2f ms; cpu per request %.1f vs %.1f us\n", la, lb, a / b, pa, pb, ca, cb}'
}

echo "== $(date -u '+%Y-%m-%d %H:%M UTC'), $(nproc) CPUs, load $(cut -d' ' -f1-3 /proc/loadavg)"
echo "== wrk -t$THREADS -c$CONNS -d${SECS}s --latency, $ROUNDS rounds alternating, medians"
[[ $PIN == 1 ]] && echo "== pinned: wrk on CPU 0, the servers on CPU $(($(nproc) - 1))"

echo "== building spillway (release)"
(cd "$ROOT" && cargo build --release -p spillway-server --bin spillway --quiet)
SPILLWAY=$TARGET/release/spillway

PARTS=${BENCH_PARTS:-check,proxy,hook}

# ---- 0. this build vs another build of spillway ----------------------------
if [[ ,$PARTS, == *,versions,* ]]; then
    OTHER=${BENCH_OTHER:?BENCH_PARTS=versions needs BENCH_OTHER=path/to/another/spillway}
    UP_PORT=$(free_port)
    nginx_conf "$WORK/up" 1 <<EOF
    server {
        listen 127.0.0.1:$UP_PORT;
        location / { default_type text/plain; return 200 "hello\n"; }
        location = /upstream-status { stub_status; }
    }
EOF
UP_STATUS="http://127.0.0.1:$UP_PORT/upstream-status"
    nginx -p "$WORK/up" -c "$WORK/up/nginx.conf" -g 'daemon off;' >"$WORK/up/out.log" 2>&1 &
    PIDS+=($!)
    wait_for "http://127.0.0.1:$UP_PORT/"
    for which in new old; do
        bin=$SPILLWAY
        [[ $which == old ]] && bin=$OTHER
        port=$(free_port)
        "${SERVE[@]}" "$bin" serve --config "$HERE/bench.toml" --listen "127.0.0.1:$port" \
            >"$WORK/serve-$which.log" 2>&1 &
        PIDS+=($!)
        declare "SERVE_${which}_PID=$!" "SERVE_${which}_PORT=$port"
        wait_for "http://127.0.0.1:$port/healthz"
        port=$(free_port)
        "${SERVE[@]}" "$bin" proxy --config "$HERE/bench.toml" --listen "127.0.0.1:$port" \
            --upstream "http://127.0.0.1:$UP_PORT" >"$WORK/proxy-$which.log" 2>&1 &
        PIDS+=($!)
        declare "PROXY_${which}_PID=$!" "PROXY_${which}_PORT=$port"
        wait_for "http://127.0.0.1:$port/"
    done
    echo "== this build ($SPILLWAY) vs $OTHER"
    side_new_check() {
        BENCH_PID=$SERVE_new_PID BENCH_PATH=/v1/check BENCH_KEYS=$KEYS \
            run_wrk -s "$HERE/check.lua" "http://127.0.0.1:$SERVE_new_PORT"
    }
    side_old_check() {
        BENCH_PID=$SERVE_old_PID BENCH_PATH=/v1/check BENCH_KEYS=$KEYS \
            run_wrk -s "$HERE/check.lua" "http://127.0.0.1:$SERVE_old_PORT"
    }
    compare "new /v1/check" side_new_check "old /v1/check" side_old_check
    side_new_proxy() { BENCH_PID=$PROXY_new_PID run_wrk "http://127.0.0.1:$PROXY_new_PORT/"; }
    side_old_proxy() { BENCH_PID=$PROXY_old_PID run_wrk "http://127.0.0.1:$PROXY_old_PORT/"; }
    compare "new proxy" side_new_proxy "old proxy" side_old_proxy
    echo "== done; load $(cut -d' ' -f1-3 /proc/loadavg)"
    exit 0
fi

# ---- 1. /v1/check vs throttlecrab-server ------------------------------------
if [[ ,$PARTS, == *,check,* ]]; then

LUA=$HERE/check.lua
SW_PORT=$(free_port)
"${SERVE[@]}" "$SPILLWAY" serve --config "$HERE/bench.toml" --listen "127.0.0.1:$SW_PORT" \
    >"$WORK/spillway-serve.log" 2>&1 &
PIDS+=($!)
SW_PID=$!
wait_for "http://127.0.0.1:$SW_PORT/healthz"
echo "== spillway serve on 127.0.0.1:$SW_PORT (pid ${PIDS[-1]}); one check:"
curl -sS -i --max-time 2 -X POST -H 'content-type: application/json' \
    -d '{"rule":"bench","key":"ip=10.0.1"}' "http://127.0.0.1:$SW_PORT/v1/check" | tr -d '\r' | sed 's/^/    /'
echo

TC=$TOOLS/bin/throttlecrab-server
if [[ ! -x $TC ]]; then
    echo "== installing throttlecrab-server into $TOOLS (cargo install --locked)"
    command -v protoc >/dev/null ||
        echo "   protoc is missing (Debian: protobuf-compiler): the install will likely fail" >&2
    if ! cargo install throttlecrab-server --locked --root "$TOOLS" --quiet; then
        echo "== throttlecrab-server did not install: comparison skipped" >&2
        TC=
    fi
fi
if [[ -n $TC ]]; then
    TC_PORT=$(free_port)
    "${SERVE[@]}" "$TC" --http --http-host 127.0.0.1 --http-port "$TC_PORT" --log-level warn \
        >"$WORK/throttlecrab.log" 2>&1 &
    PIDS+=($!)
    TC_PID=$!
    wait_for "http://127.0.0.1:$TC_PORT/health"
    echo "== $("$TC" --version 2>/dev/null || echo throttlecrab-server) on 127.0.0.1:$TC_PORT (pid ${PIDS[-1]}); one check:"
    TC_BODY='{"key":"ip=10.0.%d","max_burst":1000000000,"count_per_period":1000000000,"period":60}'
    curl -sS -i --max-time 2 -X POST -H 'content-type: application/json' \
        -d "$(printf "$TC_BODY" 1)" "http://127.0.0.1:$TC_PORT/throttle" | tr -d '\r' | sed 's/^/    /'
    echo
    echo "== POST /v1/check vs POST /throttle, keys spread over $KEYS"
    side_sw() { BENCH_PID=$SW_PID BENCH_PATH=/v1/check BENCH_KEYS=$KEYS run_wrk -s "$LUA" "http://127.0.0.1:$SW_PORT"; }
    side_tc() {
        BENCH_PID=$TC_PID BENCH_PATH=/throttle BENCH_KEYS=$KEYS BENCH_BODY=$TC_BODY \
            run_wrk -s "$LUA" "http://127.0.0.1:$TC_PORT"
    }
    compare "spillway /v1/check" side_sw "throttlecrab /throttle" side_tc
    # The control: both servers answering a request that does nothing (our
    # /healthz, through the router; their /health): the two HTTP stacks
    # alone.
    echo "== control: GET /healthz vs GET /health (no rate limiting at all)"
    side_sw_health() { BENCH_PID=$SW_PID run_wrk "http://127.0.0.1:$SW_PORT/healthz"; }
    side_tc_health() { BENCH_PID=$TC_PID run_wrk "http://127.0.0.1:$TC_PORT/health"; }
    compare "spillway /healthz" side_sw_health "throttlecrab /health" side_tc_health
    # The ceiling of the measurement: nginx (a worker per CPU it may use) answering
    # every POST with the bytes of our answer, checking nothing. A ratio
    # over throttlecrab that would put us above it is out of reach for any
    # server measured this way on this machine.
    echo "== ceiling: POST /v1/check vs nginx returning the same JSON without checking"
    CEIL_PORT=$(free_port)
    CEIL_BODY=$(curl -sS --max-time 2 -X POST -d '{"rule":"bench","key":"ip=10.0.1"}' \
        "http://127.0.0.1:$SW_PORT/v1/check")
    nginx_conf "$WORK/ceil" "$NGINX_WORKERS" <<EOF
    server {
        listen 127.0.0.1:$CEIL_PORT;
        location / { default_type application/json; return 200 '$CEIL_BODY'; }
    }
EOF
    "${SERVE[@]}" nginx -p "$WORK/ceil" -c "$WORK/ceil/nginx.conf" -g 'daemon off;' >"$WORK/ceil/out.log" 2>&1 &
    PIDS+=($!)
    CEIL_PID=$!
    wait_for "http://127.0.0.1:$CEIL_PORT/"
    side_ceil() { BENCH_PID=$CEIL_PID BENCH_PATH=/v1/check BENCH_KEYS=$KEYS run_wrk -s "$LUA" "http://127.0.0.1:$CEIL_PORT"; }
    compare "spillway /v1/check" side_sw "nginx, fixed answer" side_ceil
    kill "$CEIL_PID" 2>/dev/null || true
    echo "  spillway's decisions (from /metrics):"
    curl -sS --max-time 2 "http://127.0.0.1:$SW_PORT/metrics" | grep -E '^spillway_decisions' | sed 's/^/    /' || true
fi
kill "$SW_PID" 2>/dev/null || true
fi

# ---- 2. spillway proxy vs nginx limit_req, same upstream --------------------
# The upstream and the nginx limit_req peer serve parts 2, 3 and 4.
if [[ ,$PARTS, == *,proxy,* || ,$PARTS, == *,hook,* || ,$PARTS, == *,h2,* ]]; then

UP_PORT=$(free_port)
NG_PORT=$(free_port)
NG_H2_PORT=$(free_port)
# The upstream: answers "hello" to everything.
nginx_conf "$WORK/up" 1 <<EOF
    server {
        listen 127.0.0.1:$UP_PORT;
        location / { default_type text/plain; return 200 "hello\n"; }
        location = /upstream-status { stub_status; }
    }
EOF
UP_STATUS="http://127.0.0.1:$UP_PORT/upstream-status"
# The peer: limit_req with a zone that never denies, proxying with pooled
# keep-alive connections and the X-Forwarded-* headers spillway proxy writes.
nginx_conf "$WORK/ng" "$NGINX_WORKERS" <<EOF
$(peer_http_lines "$UP_PORT")
    server {
        listen 127.0.0.1:$NG_PORT;
        # HTTP/2 without TLS (prior knowledge), for part 4.
        listen 127.0.0.1:$NG_H2_PORT http2;
        http2_max_concurrent_streams 100;
$(peer_location)
    }
EOF
# Run in the foreground (daemon off), so that $! is the master's PID.
"${SERVE[@]}" nginx -p "$WORK/up" -c "$WORK/up/nginx.conf" -g 'daemon off;' >"$WORK/up/out.log" 2>&1 &
PIDS+=($!)
"${SERVE[@]}" nginx -p "$WORK/ng" -c "$WORK/ng/nginx.conf" -g 'daemon off;' >"$WORK/ng/out.log" 2>&1 &
PIDS+=($!)
NG_PID=$!
wait_for "http://127.0.0.1:$UP_PORT/"
wait_for "http://127.0.0.1:$NG_PORT/"
fi

if [[ ,$PARTS, == *,proxy,* || ,$PARTS, == *,h2,* ]]; then
PX_PORT=$(free_port)
"${SERVE[@]}" "$SPILLWAY" proxy --config "$HERE/bench.toml" --listen "127.0.0.1:$PX_PORT" \
    --upstream "http://127.0.0.1:$UP_PORT" >"$WORK/spillway-proxy.log" 2>&1 &
PIDS+=($!)
PX_PID=$!
wait_for "http://127.0.0.1:$PX_PORT/"
echo "== upstream nginx on $UP_PORT, nginx limit_req on $NG_PORT, spillway proxy on $PX_PORT ($(nginx -v 2>&1))"
echo "  through spillway proxy:"
curl -sS -i --max-time 2 "http://127.0.0.1:$PX_PORT/" | tr -d '\r' | sed 's/^/    /'
echo "  through nginx:"
curl -sS -i --max-time 2 "http://127.0.0.1:$NG_PORT/" | tr -d '\r' | sed 's/^/    /'
fi

if [[ ,$PARTS, == *,proxy,* ]]; then
echo "== GET / through the proxy vs through nginx limit_req"
side_px() { BENCH_PID=$PX_PID run_wrk "http://127.0.0.1:$PX_PORT/"; }
side_ng() { BENCH_PID=$NG_PID run_wrk "http://127.0.0.1:$NG_PORT/"; }
compare "spillway proxy" side_px "nginx limit_req" side_ng
fi

# ---- 4. the same over HTTP/2 (prior knowledge, no TLS), h2load ------------
if [[ ,$PARTS, == *,h2,* ]]; then
command -v h2load >/dev/null || {
    echo "missing: h2load (Debian: apt-get install -y nghttp2-client)" >&2
    exit 1
}
echo "== GET / over HTTP/2: h2load -t1 -c$CONNS -m$STREAMS, the proxy vs nginx limit_req ($(h2load --version | head -1))"
side_px2() { BENCH_PID=$PX_PID run_h2load "http://127.0.0.1:$PX_PORT/"; }
side_ng2() { BENCH_PID=$NG_PID run_h2load "http://127.0.0.1:$NG_H2_PORT/"; }
compare "spillway proxy, h2" side_px2 "nginx limit_req, h2" side_ng2
fi
if [[ -n ${PX_PID:-} ]]; then
    kill "$PX_PID" 2>/dev/null || true
fi

# ---- 3. nginx + the forward-auth hook vs nginx limit_req, same upstream -----
if [[ ,$PARTS, == *,hook,* ]]; then
HK_PORT=$(free_port)
NH_PORT=$(free_port)
# The bench's rule, with nginx (and wrk, for the hook's own cost) trusted
# to describe requests.
{
    cat "$HERE/bench.toml"
    printf '\n[clients]\ntrusted_proxies = ["127.0.0.1/32"]\n'
} >"$WORK/hook.toml"
"${SERVE[@]}" "$SPILLWAY" serve --config "$WORK/hook.toml" --listen "127.0.0.1:$HK_PORT" \
    >"$WORK/spillway-hook.log" 2>&1 &
PIDS+=($!)
HK_PID=$!
wait_for "http://127.0.0.1:$HK_PORT/healthz"
# The example configuration as a user copies it, the addresses swapped, as
# many workers as the limit_req peer and no limit on keep-alive requests.
mkdir -p "$WORK/nh/tmp"
sed -e "s/127.0.0.1:8080/127.0.0.1:$HK_PORT/" -e "s/127.0.0.1:9000/127.0.0.1:$UP_PORT/" \
    -e "s/127.0.0.1:8000/127.0.0.1:$NH_PORT/" -e 's/^    access_log off;/    access_log off;\n    keepalive_requests 1000000;/' \
    "$ROOT/examples/forward-auth/nginx.conf" >"$WORK/nh/nginx.conf"
"${SERVE[@]}" nginx -p "$WORK/nh" -c "$WORK/nh/nginx.conf" -g "daemon off; worker_processes $NGINX_WORKERS;" \
    >"$WORK/nh/out.log" 2>&1 &
PIDS+=($!)
NH_PID=$!
wait_for "http://127.0.0.1:$NH_PORT/"
echo "== nginx + forward-auth hook on $NH_PORT (hook on $HK_PORT), nginx limit_req on $NG_PORT"
echo "  through nginx and the hook:"
curl -sS -i --max-time 2 "http://127.0.0.1:$NH_PORT/" | tr -d '\r' | sed 's/^/    /'
echo "== GET / through nginx + the hook (CPU: nginx and spillway) vs through nginx limit_req"
side_nh() { BENCH_PID="$NH_PID $HK_PID" run_wrk "http://127.0.0.1:$NH_PORT/"; }
side_ng() { BENCH_PID=$NG_PID run_wrk "http://127.0.0.1:$NG_PORT/"; }
compare "nginx + hook" side_nh "nginx limit_req" side_ng
echo "== the hook's own cost: GET /v1/forward-auth vs POST /v1/check, keys spread over $KEYS"
side_hook() { BENCH_PID=$HK_PID BENCH_KEYS=$KEYS run_wrk -s "$HERE/hook.lua" "http://127.0.0.1:$HK_PORT"; }
side_check() {
    BENCH_PID=$HK_PID BENCH_PATH=/v1/check BENCH_KEYS=$KEYS run_wrk -s "$HERE/check.lua" "http://127.0.0.1:$HK_PORT"
}
compare "/v1/forward-auth" side_hook "/v1/check" side_check
fi
echo "== done; load $(cut -d' ' -f1-3 /proc/loadavg)"
