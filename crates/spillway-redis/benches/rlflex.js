// rate-limiter-flexible's RateLimiterRedis (over ioredis) against a
// redis-server this script starts on a free loopback port with the flags the
// Rust bench's server gets: 50 concurrent callers, keys spread over 100 000,
// a quota that never denies (the same work as our `fixed_window` row:
// rate-limiter-flexible's Redis limiter is a fixed window in one Lua script).
//
// Run with (node 18+; the packages are installed outside the repository):
//   npm install --prefix target/bench-tools/rlflex rate-limiter-flexible ioredis
//   NODE_PATH=target/bench-tools/rlflex/node_modules \
//     node crates/spillway-redis/benches/rlflex.js
// right after `cargo bench -p spillway-redis --bench redis`, whose
// fixed_window figure it is compared with. SPILLWAY_BENCH_REQUESTS sets the
// requests (default 200 000, as the Rust bench).
'use strict';

const { spawn } = require('node:child_process');
const fs = require('node:fs');
const net = require('node:net');
const os = require('node:os');
const path = require('node:path');
const Redis = require('ioredis');
const { RateLimiterRedis } = require('rate-limiter-flexible');

const CONCURRENCY = 50;
const KEYSPACE = 100000;
const REQUESTS = Number(process.env.SPILLWAY_BENCH_REQUESTS || 200000);

function freePort() {
  return new Promise((resolve, reject) => {
    const s = net.createServer();
    s.listen(0, '127.0.0.1', () => {
      const { port } = s.address();
      s.close(() => resolve(port));
    });
    s.on('error', reject);
  });
}

async function run(limiter, requests) {
  const perTask = Math.floor(requests / CONCURRENCY);
  let denied = 0;
  const started = process.hrtime.bigint();
  await Promise.all(
    Array.from({ length: CONCURRENCY }, async (_, t) => {
      // xorshift, as the Rust bench.
      let x = BigInt(t + 1) * 0x9e3779b97f4a7c15n & 0xffffffffffffffffn;
      for (let i = 0; i < perTask; i++) {
        x ^= (x << 13n) & 0xffffffffffffffffn;
        x ^= x >> 7n;
        x ^= (x << 17n) & 0xffffffffffffffffn;
        try {
          await limiter.consume(`k${x % BigInt(KEYSPACE)}`, 1);
        } catch (e) {
          if (e instanceof Error) throw e;
          denied++;
        }
      }
    }),
  );
  const secs = Number(process.hrtime.bigint() - started) / 1e9;
  return { rate: (perTask * CONCURRENCY) / secs, denied };
}

async function main() {
  // SPILLWAY_REDIS_PORT: a server already running (the Rust bench's), else
  // one started here.
  const given = Number(process.env.SPILLWAY_REDIS_PORT || 0);
  const port = given || await freePort();
  let stop = () => {};
  if (!given) {
    const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'rlflex-redis-'));
    const server = spawn('redis-server', [
      '--port', String(port), '--bind', '127.0.0.1',
      '--save', '', '--appendonly', 'no', '--loglevel', 'warning', '--dir', dir,
    ], { stdio: 'ignore' });
    stop = () => {
      server.kill('SIGTERM');
      fs.rmSync(dir, { recursive: true, force: true });
    };
  }
  process.on('exit', () => stop());
  // A hard bound on the whole run.
  setTimeout(() => { console.error('timed out'); process.exit(2); }, 300000).unref();
  try {
    // Wait for the server to accept connections, then connect once.
    for (let i = 0; ; i++) {
      const up = await new Promise((resolve) => {
        const c = net.connect(port, '127.0.0.1', () => { c.destroy(); resolve(true); });
        c.on('error', () => resolve(false));
      });
      if (up) break;
      if (i > 100) throw new Error(`redis-server did not start on ${port}`);
      await new Promise((r) => setTimeout(r, 100));
    }
    const client = new Redis({ host: '127.0.0.1', port });
    const limiter = new RateLimiterRedis({
      storeClient: client,
      points: 1000000,
      duration: 3600,
      keyPrefix: 'rlflx',
    });
    await run(limiter, CONCURRENCY * 100); // warm-up (script load, JIT)
    const { rate, denied } = await run(limiter, REQUESTS);
    const v = (p) => require(`${p}/package.json`).version;
    console.log(
      `rate-limiter-flexible ${v('rate-limiter-flexible')} (ioredis ${v('ioredis')}, node ${process.version}): ` +
      `${CONCURRENCY} concurrent callers, ${REQUESTS} requests, keys over ${KEYSPACE}: ` +
      `${rate.toFixed(0)} decisions/s, ${denied} denied`,
    );
    client.disconnect();
  } finally {
    stop();
  }
}

main().catch((e) => { console.error(e); process.exit(1); });
