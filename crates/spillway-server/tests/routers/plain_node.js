// A plain Node `http` server that routes as much hand-written Node code
// does: the path from `new URL(req.url, base).pathname` (the WHATWG URL
// parser, which Deno, Bun and Cloudflare Workers share) and the virtual
// host from the `Host` header read by the same parser.
//
// The upstream protocol of tests/proxy_routers.rs: `node plain_node.js LOG`
// listens on a free loopback port, prints {"port": N} on its first line,
// appends "case<TAB>handler<TAB>method<TAB>path" to LOG for every request it
// routes (the case is the X-Case header), answers with the handler's name,
// and exits when its standard input closes.
"use strict";

const http = require("http");
const fs = require("fs");

const log = fs.openSync(process.argv[2], "a");

function handle(req, res, handler, path) {
  fs.writeSync(log, `${req.headers["x-case"]}\t${handler}\t${req.method}\t${path}\n`);
  res.setHeader("X-Handler", handler);
  res.end(handler);
}

const server = http.createServer((req, res) => {
  let path;
  let host;
  try {
    path = new URL(req.url, "http://x").pathname;
    host = new URL(`http://${req.headers.host}`).hostname;
  } catch {
    res.statusCode = 400;
    res.end("bad url");
    return;
  }
  if (host === "admin.example.com") {
    handle(req, res, "admin", path);
  } else if (req.method === "POST" && path === "/login") {
    handle(req, res, "login", path);
  } else if ((req.method === "GET" || req.method === "HEAD") && path === "/report") {
    handle(req, res, "report", path);
  } else if (req.method === "DELETE" && path === "/account") {
    handle(req, res, "account", path);
  } else {
    handle(req, res, "other", path);
  }
});

server.listen(0, "127.0.0.1", () => {
  process.stdout.write(JSON.stringify({ port: server.address().port }) + "\n");
});
process.stdin.on("end", () => process.exit(0));
process.stdin.resume();
