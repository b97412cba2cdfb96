// Express 4 as it is commonly deployed behind a proxy: `trust proxy` on
// (the host and client come from X-Forwarded-*), virtual hosts by
// `req.hostname`, method-override from the usual headers, the query and a
// form body, and routes matched by Express's own router.
//
// The upstream protocol of tests/proxy_routers.rs: `node express_app.js LOG`
// listens on a free loopback port, prints {"port": N} on its first line,
// appends "case<TAB>handler<TAB>method<TAB>path" to LOG for every request it
// routes (the case is the X-Case header), answers with the handler's name,
// and exits when its standard input closes.
"use strict";

const express = require("express");
const methodOverride = require("method-override");
const fs = require("fs");

const log = fs.openSync(process.argv[2], "a");

function handler(name) {
  return (req, res) => {
    fs.writeSync(log, `${req.get("x-case")}\t${name}\t${req.method}\t${req.path}\n`);
    res.set("X-Handler", name);
    res.send(name);
  };
}

const app = express();
app.set("trust proxy", true);
app.use(express.urlencoded({ extended: false }));
app.use(methodOverride("X-HTTP-Method-Override"));
app.use(methodOverride("X-HTTP-Method"));
app.use(methodOverride("X-Method-Override"));
app.use(methodOverride("_method"));
app.use(
  methodOverride((req) => {
    if (req.body && typeof req.body === "object" && "_method" in req.body) {
      const method = req.body._method;
      delete req.body._method;
      return method;
    }
    return undefined;
  }),
);
app.use((req, res, next) => {
  if (req.hostname === "admin.example.com") {
    handler("admin")(req, res);
  } else {
    next();
  }
});
app.post("/login", handler("login"));
app.get("/report", handler("report"));
app.delete("/account", handler("account"));
app.all("*", handler("other"));

const server = app.listen(0, "127.0.0.1", () => {
  process.stdout.write(JSON.stringify({ port: server.address().port }) + "\n");
});
process.stdin.on("end", () => process.exit(0));
process.stdin.resume();
