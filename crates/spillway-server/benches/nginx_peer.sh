# The nginx configurations of service.sh and instructions.sh, sourced by
# both: the limit_req peer (a zone that never denies, proxying to the
# upstream with pooled keep-alive connections and the X-Forwarded-* headers
# `spillway proxy` writes), and what every nginx of theirs starts with.

# Writes $1/nginx.conf for an nginx with $2 workers, its state and temporary
# files in $1, no access log and no limit on keep-alive requests; the http
# block's own lines (servers, zones, upstreams) come from standard input.
nginx_conf() {
    local dir=$1 workers=$2
    mkdir -p "$dir"
    {
        cat <<EOF
worker_processes $workers;
pid $dir/nginx.pid;
error_log $dir/error.log warn;
events { worker_connections 1024; }
http {
    access_log off;
    keepalive_requests 1000000;
    client_body_temp_path $dir; proxy_temp_path $dir;
    fastcgi_temp_path $dir; uwsgi_temp_path $dir; scgi_temp_path $dir;
EOF
        cat
        echo "}"
    } >"$dir/nginx.conf"
}

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
