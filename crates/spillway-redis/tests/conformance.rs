//! The conformance suite on a real redis-server, standalone and as a
//! 3-master cluster: the Lua scripts must make exactly the in-memory store's
//! decisions.

use std::sync::atomic::{AtomicUsize, Ordering};

use spillway::store::{Check, Rule, Verdict};
use spillway_conformance::redis_server::{RedisCluster, RedisServer};
use spillway_conformance::{Harness, HarnessError};
use spillway_redis::{Error, RedisOptions, RedisStore, Topology};
use tokio::runtime::Runtime;

struct Redis<'rt> {
    store: RedisStore,
    runtime: &'rt Runtime,
}

impl Harness for Redis<'_> {
    fn check(&mut self, checks: &[Check<'_>], now_us: u64) -> Result<Verdict, HarnessError> {
        self.runtime
            .block_on(self.store.check_at(checks, now_us))
            .map_err(|e| match e {
                Error::Check(e) => e.into(),
                other => HarnessError::Other(other.to_string()),
            })
    }
}

fn run_suite(topology: Topology) {
    let runtime = Runtime::new().expect("a tokio runtime");
    // Each case gets its own key prefix: they share one server.
    static CASE: AtomicUsize = AtomicUsize::new(0);
    let report = spillway_conformance::run_all(|rules: Vec<Rule>| {
        let options = RedisOptions {
            key_prefix: format!("conformance:{}:", CASE.fetch_add(1, Ordering::Relaxed)),
            // Generous: a debug build on a loaded 2-core machine.
            timeout: std::time::Duration::from_secs(5),
            ..RedisOptions::default()
        };
        let store = runtime
            .block_on(RedisStore::connect(topology.clone(), rules, options))
            .expect("the store connects");
        Redis {
            store,
            runtime: &runtime,
        }
    });
    assert!(report.cases > 0);
}

#[test]
fn standalone_passes_the_conformance_suite() {
    let Some(server) = RedisServer::start() else {
        return;
    };
    run_suite(Topology::Standalone(server.url()));
}

#[test]
fn cluster_passes_the_conformance_suite() {
    let Some(cluster) = RedisCluster::start() else {
        return;
    };
    run_suite(Topology::Cluster(cluster.urls()));
}
