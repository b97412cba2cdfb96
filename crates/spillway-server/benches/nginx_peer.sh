# The nginx limit_req peer of service.sh and instructions.sh, sourced by
# both: a limit_req zone that never denies, proxying to the upstream with
# pooled keep-alive connections and the X-Forwarded-* headers `spillway
# proxy` writes.

# Prints the peer's lines for the http block, for an upstream on port $1.
# Its keep-alive pool has room for every request in flight (HTTP/2:
# connections x streams), so that none opens an upstream connection of its
# own.
peer_http_lines() {
    cat <<LINES
    limit_req_zone \$binary_remote_addr zone=perip:10m rate=1000000r/s;
    upstream hello { server 127.0.0.1:$1; keepalive 512; }
LINES
}

# Prints the peer's location for a server block.
peer_location() {
    cat <<'LINES'
        location / {
            limit_req zone=perip burst=1000000 nodelay;
            proxy_pass http://hello;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_set_header Host $host;
            proxy_set_header X-Forwarded-For $proxy_add_x_forwarded_for;
            proxy_set_header X-Forwarded-Host $host;
            proxy_set_header X-Forwarded-Proto $scheme;
        }
LINES
}
