"""Starlette (the router under FastAPI) on uvicorn as an upstream of
tests/proxy_routers.rs: routes by method and path (uvicorn decodes the
path; Starlette adds HEAD to GET routes) and by host with a `Host` route
(the `Host` header without its port).

The upstream protocol: `python3 starlette_app.py LOG` listens on a free
loopback port, prints {"port": N} on its first line, appends
"case<TAB>handler<TAB>method<TAB>path" to LOG for every request it routes
(the case is the X-Case header), answers with the handler's name, and
exits when its standard input closes.
"""

import asyncio
import json
import socket
import sys
import threading

import uvicorn
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Host, Route, Router

LOG = open(sys.argv[1], "a", buffering=1)
ANY = ["GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"]


def handler(name):
    async def handle(request):
        LOG.write(f"{request.headers.get('x-case')}\t{name}\t{request.method}\t{request.url.path}\n")
        return PlainTextResponse(name, headers={"X-Handler": name})

    return handle


app = Starlette(
    routes=[
        Host(
            "admin.example.com",
            app=Router(routes=[Route("/{rest:path}", handler("admin"), methods=ANY)]),
        ),
        Route("/login", handler("login"), methods=["POST"]),
        Route("/report", handler("report"), methods=["GET"]),
        Route("/account", handler("account"), methods=["DELETE"]),
        Route("/{rest:path}", handler("other"), methods=ANY),
    ]
)


def main():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    print(json.dumps({"port": sock.getsockname()[1]}), flush=True)
    config = uvicorn.Config(app, http="h11", log_level="error", lifespan="off")
    server = uvicorn.Server(config)
    threading.Thread(target=lambda: asyncio.run(server.serve(sockets=[sock])), daemon=True).start()
    sys.stdin.read()


if __name__ == "__main__":
    main()
