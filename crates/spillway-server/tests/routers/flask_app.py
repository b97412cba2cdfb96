"""Flask (Werkzeug's router and WSGI server) as an upstream of
tests/proxy_routers.rs: routes by method and path, and by host with
`host_matching` (the virtual host from the `Host` header, as Werkzeug
reads it without ProxyFix).

The upstream protocol: `python3 flask_app.py LOG` listens on a free
loopback port, prints {"port": N} on its first line, appends
"case<TAB>handler<TAB>method<TAB>path" to LOG for every request it routes
(the case is the X-Case header), answers with the handler's name, and
exits when its standard input closes.
"""

import json
import logging
import sys
import threading

from flask import Flask, request
from werkzeug.serving import make_server

LOG = open(sys.argv[1], "a", buffering=1)
LOCK = threading.Lock()

app = Flask(__name__, host_matching=True, static_folder=None)


def handled(name):
    with LOCK:
        LOG.write(f"{request.headers.get('X-Case')}\t{name}\t{request.method}\t{request.path}\n")
    return name, 200, {"X-Handler": name}


ANY = ["GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"]


@app.route("/", host="admin.example.com", methods=ANY)
@app.route("/<path:rest>", host="admin.example.com", methods=ANY)
def admin(rest=None):
    return handled("admin")


@app.post("/login", host="<anyhost>")
def login(anyhost):
    return handled("login")


@app.get("/report", host="<anyhost>")
def report(anyhost):
    return handled("report")


@app.delete("/account", host="<anyhost>")
def account(anyhost):
    return handled("account")


@app.route("/", host="<anyhost>", methods=ANY)
@app.route("/<path:rest>", host="<anyhost>", methods=ANY)
def other(anyhost, rest=None):
    return handled("other")


def main():
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = make_server("127.0.0.1", 0, app, threaded=True)
    print(json.dumps({"port": server.server_port}), flush=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    sys.stdin.read()


if __name__ == "__main__":
    main()
