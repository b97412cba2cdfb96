#!/usr/bin/env bash
# The long forms of the key-flood tests (#17 item 3), in release:
# 10 million distinct keys against the in-memory store in process, under
# both on_full policies, and 1 million through a real `spillway serve`
# process (SPILLWAY_FLOOD_KEYS overrides the count). Each prints its
# figures (keys held, bytes counted, resident-set growth) and asserts the
# bounds docs/server.md states. About two minutes on 2 cores.
#
# Run with: bash scripts/flood.sh
set -euo pipefail
cd "$(dirname "$0")/.."

cargo test -p spillway --release --test flood -- --ignored --nocapture
SPILLWAY_FLOOD_KEYS="${SPILLWAY_FLOOD_KEYS:-1000000}" \
    cargo test -p spillway-server --release --test serve_flood -- --nocapture
