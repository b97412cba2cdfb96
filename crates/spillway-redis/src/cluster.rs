//! Redis Cluster: the key-to-slot mapping, so a request's checks can be
//! grouped into one script call per slot (a script may only touch keys of
//! one slot), and the store's own routing of those calls.
//!
//! The store routes its calls itself, rather than through redis-rs's
//! cluster client, so that one node's trouble stays that node's. That
//! client runs every request through one task, which stops sending to any
//! node while it rebuilds its slot map, and rebuilds it holding a lock
//! that every request needs: while a master was failing over, calls to the
//! healthy masters waited past the store's timeout (the fault harness's
//! `cluster_master_killed` found it). Here each node has its own
//! connection (redis-rs's [`ConnectionManager`], which reconnects by
//! itself and never sends a command twice), the slot map is swapped
//! whole, and a new one is fetched in the background: no call waits for
//! another node, or for a refresh.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use futures_util::StreamExt;
use futures_util::stream::FuturesUnordered;
use parking_lot::{Mutex, RwLock};
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::{
    ConnectionAddr, ConnectionInfo, ErrorKind, FromRedisValue, IntoConnectionInfo, RedisError,
    RedisResult, ServerErrorKind, Value,
};
use tokio::time::Instant;

use crate::standalone::{is_setup_error, speaks_resp2};

/// The number of slots of a Redis Cluster.
const SLOTS: usize = 16384;

/// How many times a call may be sent again after the cluster said it did
/// not run it (a redirection, a slot being moved, a failover under way).
const RESENDS: u32 = 4;

/// The least time between two fetches of the slot map: errors during a
/// failover ask for one on every call.
const REFRESH_GAP: Duration = Duration::from_millis(100);

/// How many nodes a fetch of the slot map asks at once: a majority of
/// them agreeing ends it.
const ASKED: usize = 7;

/// A node's address: host and port.
type Addr = (String, u16);

/// Which master serves each slot.
struct SlotMap {
    /// The masters.
    nodes: Vec<Addr>,
    /// For each slot, its master's index in `nodes`; [`NONE`] if none.
    owners: Box<[u16]>,
}

/// No master serves the slot.
const NONE: u16 = u16::MAX;

impl SlotMap {
    /// Whether both maps give every slot the same master.
    fn same_as(&self, other: &Self) -> bool {
        (0..SLOTS).all(|slot| {
            let slot = u16::try_from(slot).unwrap_or(u16::MAX);
            self.master(slot) == other.master(slot)
        })
    }

    fn master(&self, slot: u16) -> Option<&Addr> {
        match self.owners[usize::from(slot)] {
            NONE => None,
            i => self.nodes.get(usize::from(i)),
        }
    }

    /// For each master, the lowest slot it serves, in ascending order: a
    /// name for each master that a slot map fetched later still gives it,
    /// unless the cluster moved that slot.
    fn first_slots(&self) -> Vec<u16> {
        let mut first = vec![NONE; self.nodes.len()];
        for (slot, &owner) in self.owners.iter().enumerate() {
            if let Some(f) = first.get_mut(usize::from(owner))
                && *f == NONE
            {
                *f = u16::try_from(slot).unwrap_or(NONE);
            }
        }
        first.retain(|&f| f != NONE);
        first.sort_unstable();
        first
    }

    /// The map after a MOVED: `slot` served by `addr`.
    fn moved(&self, slot: u16, addr: &Addr) -> Self {
        let mut nodes = self.nodes.clone();
        let index = match nodes.iter().position(|n| n == addr) {
            Some(i) => i,
            None => {
                nodes.push(addr.clone());
                nodes.len() - 1
            }
        };
        let mut owners = self.owners.clone();
        // At most SLOTS masters, far below NONE.
        owners[usize::from(slot)] = u16::try_from(index).unwrap_or(NONE);
        Self { nodes, owners }
    }

    /// The map in a `CLUSTER SLOTS` reply from `asked` (whose host stands
    /// in for a master announced with an empty one); `None` if the reply
    /// is not one, or names no master.
    fn parse(reply: &Value, asked: &str) -> Option<Self> {
        let Value::Array(ranges) = reply else {
            return None;
        };
        let mut nodes: Vec<Addr> = Vec::new();
        let mut owners = vec![NONE; SLOTS].into_boxed_slice();
        for range in ranges {
            let Value::Array(fields) = range else {
                return None;
            };
            let [start, end, master, ..] = fields.as_slice() else {
                return None;
            };
            let (Value::Int(start), Value::Int(end), Value::Array(master)) = (start, end, master)
            else {
                return None;
            };
            let [host, Value::Int(port), ..] = master.as_slice() else {
                return None;
            };
            let host = match host {
                // An endpoint announced as unknown: the node asked.
                Value::Nil => asked,
                host => text(host)?,
            };
            let host = match host {
                "" => asked,
                // An endpoint the node does not know: no usable master.
                "?" => continue,
                host => host,
            };
            let addr = (host.to_string(), u16::try_from(*port).ok()?);
            let (start, end) = (usize::try_from(*start).ok()?, usize::try_from(*end).ok()?);
            if start > end || end >= SLOTS {
                return None;
            }
            let index = match nodes.iter().position(|n| *n == addr) {
                Some(i) => i,
                None => {
                    nodes.push(addr);
                    nodes.len() - 1
                }
            };
            owners[start..=end].fill(u16::try_from(index).ok()?);
        }
        (!nodes.is_empty()).then_some(Self { nodes, owners })
    }
}

fn text(value: &Value) -> Option<&str> {
    match value {
        Value::BulkString(bytes) => std::str::from_utf8(bytes).ok(),
        Value::SimpleString(s) => Some(s),
        Value::VerbatimString { text, .. } => Some(text),
        _ => None,
    }
}

/// The slot maps the nodes asked have answered, and how many gave each.
#[derive(Default)]
struct Votes(Vec<(SlotMap, usize)>);

impl Votes {
    /// Counts `map`; how many nodes have given it so far.
    fn add(&mut self, map: SlotMap) -> usize {
        match self.0.iter_mut().find(|(view, _)| view.same_as(&map)) {
            Some((_, votes)) => {
                *votes += 1;
                *votes
            }
            None => {
                self.0.push((map, 1));
                1
            }
        }
    }

    /// The map most nodes gave; of those, the first answered.
    fn winner(self) -> Option<SlotMap> {
        let mut best: Option<(SlotMap, usize)> = None;
        for (view, votes) in self.0 {
            if best.as_ref().is_none_or(|(_, most)| votes > *most) {
                best = Some((view, votes));
            }
        }
        best.map(|(map, _)| map)
    }
}

/// A Redis Cluster, as the store talks to it. Cloning it shares it.
#[derive(Clone)]
pub(crate) struct Cluster {
    shared: Arc<Shared>,
}

struct Shared {
    /// The first node's URL, whose settings (user, password, protocol)
    /// every node's connection takes.
    template: ConnectionInfo,
    /// The nodes the store was given, asked for the map when the known
    /// masters cannot answer.
    seeds: Vec<Addr>,
    config: ConnectionManagerConfig,
    /// How long a fetch of the slot map may wait for one node.
    ask_within: Duration,
    map: RwLock<Arc<SlotMap>>,
    connections: Mutex<HashMap<Addr, ConnectionManager>>,
    refreshing: AtomicBool,
    last_refresh: Mutex<Option<Instant>>,
    /// Fetches so far: where the next one starts in the list of nodes to
    /// ask, when there are more than [`ASKED`].
    fetches: AtomicUsize,
}

/// Clears the flag of a fetch under way when the fetch ends, however it
/// ends: made before its task is spawned and moved into it, so that a task
/// dropped before it first ran (a runtime shutting down) clears it too.
struct Fetching(Arc<Shared>);

impl Drop for Fetching {
    fn drop(&mut self) {
        self.0.refreshing.store(false, Ordering::Release);
    }
}

impl Cluster {
    /// Reaches the cluster through `urls` (some of its nodes) and fetches
    /// its slot map, within `within` (and so does every later fetch).
    pub(crate) async fn connect(
        urls: Vec<String>,
        config: ConnectionManagerConfig,
        within: Duration,
    ) -> RedisResult<Self> {
        let infos = urls
            .into_iter()
            .map(IntoConnectionInfo::into_connection_info)
            .collect::<RedisResult<Vec<_>>>()?;
        let seeds = infos
            .iter()
            .map(|info| match info.addr() {
                ConnectionAddr::Tcp(host, port) => Ok((host.clone(), *port)),
                _ => Err(RedisError::from((
                    ErrorKind::InvalidClientConfig,
                    "a cluster node's URL must be redis://host:port",
                ))),
            })
            .collect::<RedisResult<Vec<_>>>()?;
        let template = infos.into_iter().next().ok_or_else(|| {
            RedisError::from((ErrorKind::InvalidClientConfig, "no cluster node given"))
        })?;
        speaks_resp2(&template)?;
        let cluster = Self {
            shared: Arc::new(Shared::new(template, seeds, config, within)),
        };
        cluster.shared.refresh().await?;
        Ok(cluster)
    }

    /// Each master's lowest slot, ascending (see `SlotMap::first_slots`).
    pub(crate) fn master_slots(&self) -> Vec<u16> {
        self.shared.map.read().first_slots()
    }

    /// [`run`](Self::run) within `within`. A call with no answer in time
    /// asks for a new slot map, as a connection's own timeout does: a
    /// master that hangs rather than refuses (stopped, cut off) is failed
    /// over by the cluster, and no node redirects the calls still sent to
    /// it.
    pub(crate) async fn run_within<T: FromRedisValue>(
        &self,
        within: Duration,
        slot: u16,
        script: Option<&redis::ScriptInvocation<'_>>,
        command: impl Fn() -> redis::Cmd,
    ) -> Result<RedisResult<T>, tokio::time::error::Elapsed> {
        let answered = tokio::time::timeout(within, self.run(slot, script, command)).await;
        if answered.is_err() {
            self.shared.clone().refresh_soon();
        }
        answered
    }

    /// Runs `script` (or `command`, when there is no script or it must be
    /// sent with ASKING) on the master of `slot`, sending it again only
    /// when a node answered that it did not run it: MOVED and ASK (to the
    /// node they name), TRYAGAIN, CLUSTERDOWN, MASTERDOWN, LOADING and
    /// READONLY (after a short wait). A lost connection or a timeout is
    /// never followed by a second send: the script may have run.
    async fn run<T: FromRedisValue>(
        &self,
        slot: u16,
        script: Option<&redis::ScriptInvocation<'_>>,
        command: impl Fn() -> redis::Cmd,
    ) -> RedisResult<T> {
        let shared = &self.shared;
        let mut redirect: Option<(Addr, bool)> = None;
        let mut resends = 0;
        loop {
            let (addr, asking) = match redirect.take() {
                Some(target) => target,
                None => match shared.map.read().master(slot) {
                    Some(addr) => (addr.clone(), false),
                    None => {
                        shared.clone().refresh_soon();
                        return Err(RedisError::from((
                            ErrorKind::ClusterConnectionNotFound,
                            "no master serves the slot",
                            format!("slot {slot}"),
                        )));
                    }
                },
            };
            let mut connection = shared.connection(&addr)?;
            let result = if asking {
                let mut pipe = redis::pipe();
                pipe.cmd("ASKING").ignore();
                pipe.add_command(command());
                pipe.query_async::<(T,)>(&mut connection)
                    .await
                    .map(|(reply,)| reply)
            } else if let Some(script) = script {
                script.invoke_async(&mut connection).await
            } else {
                command().query_async(&mut connection).await
            };
            let error = match result {
                Ok(reply) => return Ok(reply),
                Err(error) => error,
            };
            let kind = error.kind();
            let retry = match kind {
                ErrorKind::Server(ServerErrorKind::Moved | ServerErrorKind::Ask) => {
                    match redirect_target(&error, &addr) {
                        Some(target) => {
                            let moved = kind == ErrorKind::Server(ServerErrorKind::Moved);
                            if moved {
                                shared.moved(slot, &target);
                            }
                            redirect = Some((target, !moved));
                            true
                        }
                        None => {
                            // A redirect to no node: the map may name one.
                            shared.clone().refresh_soon();
                            false
                        }
                    }
                }
                ErrorKind::Server(server) if is_changing(server) => {
                    if kind != ErrorKind::Server(ServerErrorKind::TryAgain) {
                        shared.clone().refresh_soon();
                    }
                    if resends < RESENDS {
                        tokio::time::sleep(Duration::from_millis(2 << resends)).await;
                    }
                    true
                }
                ErrorKind::Server(_) | ErrorKind::Extension => false,
                ErrorKind::Io => {
                    shared.clone().refresh_soon();
                    false
                }
                _ => {
                    // An error of the connection's own set-up (see
                    // `is_setup_error`): the next call makes a new one.
                    debug_assert!(is_setup_error(&error));
                    shared.forget(&addr);
                    shared.clone().refresh_soon();
                    false
                }
            };
            if !retry || resends >= RESENDS {
                return Err(error);
            }
            resends += 1;
        }
    }
}

impl Shared {
    /// The connection to `addr`, made (without waiting for it) if there is
    /// none yet.
    fn connection(&self, addr: &Addr) -> RedisResult<ConnectionManager> {
        let mut connections = self.connections.lock();
        if let Some(c) = connections.get(addr) {
            return Ok(c.clone());
        }
        let info = self
            .template
            .clone()
            .set_addr(ConnectionAddr::Tcp(addr.0.clone(), addr.1));
        let client = redis::Client::open(info)?;
        let made = ConnectionManager::new_lazy_with_config(client, self.config.clone())?;
        connections.insert(addr.clone(), made.clone());
        Ok(made)
    }

    /// A cluster not yet asked for its map, which serves no slot.
    fn new(
        template: ConnectionInfo,
        seeds: Vec<Addr>,
        config: ConnectionManagerConfig,
        ask_within: Duration,
    ) -> Self {
        Self {
            template,
            seeds,
            config,
            ask_within,
            map: RwLock::new(Arc::new(SlotMap {
                nodes: Vec::new(),
                owners: vec![NONE; SLOTS].into_boxed_slice(),
            })),
            connections: Mutex::new(HashMap::new()),
            refreshing: AtomicBool::new(false),
            last_refresh: Mutex::new(None),
            fetches: AtomicUsize::new(0),
        }
    }

    /// Drops the connection to `addr`: the next call makes a new one.
    fn forget(&self, addr: &Addr) {
        self.connections.lock().remove(addr);
    }

    /// The map after a MOVED to `addr` for `slot`, at once; a fetch of the
    /// whole map soon.
    fn moved(self: &Arc<Self>, slot: u16, addr: &Addr) {
        if self.map.read().master(slot) == Some(addr) {
            // Another call put it in already.
            return;
        }
        {
            let mut map = self.map.write();
            let next = map.moved(slot, addr);
            *map = Arc::new(next);
        }
        self.clone().refresh_soon();
    }

    /// Fetches the slot map in the background, unless a fetch is under
    /// way; at most one per [`REFRESH_GAP`].
    fn refresh_soon(self: Arc<Self>) {
        if self.refreshing.swap(true, Ordering::AcqRel) {
            return;
        }
        let fetching = Fetching(self);
        tokio::spawn(async move {
            let shared = &fetching.0;
            let last = *shared.last_refresh.lock();
            if let Some(last) = last {
                tokio::time::sleep_until(last + REFRESH_GAP).await;
            }
            // A failed fetch is tried again on the next error.
            let _ = shared.refresh().await;
        });
    }

    /// Asks the known masters and the seeds (at most [`ASKED`] of them,
    /// taken in turn) for the slot map, all at once, and puts in the map a
    /// majority of them agree on, or, at the deadline, the map most of
    /// those that answered gave. Not the first answer: a master cut off
    /// from the rest of the cluster still answers, with the map from
    /// before its replica took over. Connections to nodes no longer in the
    /// map are dropped.
    async fn refresh(&self) -> RedisResult<()> {
        *self.last_refresh.lock() = Some(Instant::now());
        let deadline = Instant::now() + self.ask_within;
        let mut candidates = self.map.read().nodes.clone();
        for seed in &self.seeds {
            if !candidates.contains(seed) {
                candidates.push(seed.clone());
            }
        }
        if candidates.len() > ASKED {
            let start = self.fetches.fetch_add(1, Ordering::Relaxed) % candidates.len();
            candidates.rotate_left(start);
            candidates.truncate(ASKED);
        }
        let majority = candidates.len() / 2 + 1;
        let mut asks: FuturesUnordered<_> = candidates
            .iter()
            .map(|addr| self.ask_for_map(addr))
            .collect();
        // Each map answered, and how many nodes answered it.
        let mut votes = Votes::default();
        let mut last_error = None;
        while let Ok(Some(answer)) = tokio::time::timeout_at(deadline, asks.next()).await {
            match answer {
                Ok(map) => {
                    if votes.add(map) >= majority {
                        break;
                    }
                }
                Err(e) => last_error = Some(e),
            }
        }
        drop(asks);
        let Some(map) = votes.winner() else {
            return Err(last_error.unwrap_or_else(|| {
                RedisError::from((ErrorKind::Io, "no node answered CLUSTER SLOTS in time"))
            }));
        };
        self.connections
            .lock()
            .retain(|a, _| map.nodes.contains(a) || self.seeds.contains(a));
        *self.map.write() = Arc::new(map);
        Ok(())
    }

    /// The slot map as `addr` sees it.
    async fn ask_for_map(&self, addr: &Addr) -> RedisResult<SlotMap> {
        let mut connection = self.connection(addr)?;
        let reply: Value = redis::cmd("CLUSTER")
            .arg("SLOTS")
            .query_async(&mut connection)
            .await?;
        SlotMap::parse(&reply, &addr.0).ok_or_else(|| {
            RedisError::from((ErrorKind::Parse, "CLUSTER SLOTS answered no slot map"))
        })
    }
}

/// Whether a server's error says the cluster is changing under the call (a
/// failover, a resharding, a node loading its data): the script did not
/// run, and the same call may succeed in a moment.
pub(crate) fn is_changing(kind: ServerErrorKind) -> bool {
    matches!(
        kind,
        ServerErrorKind::TryAgain
            | ServerErrorKind::ClusterDown
            | ServerErrorKind::MasterDown
            | ServerErrorKind::BusyLoading
            | ServerErrorKind::ReadOnly
    )
}

/// The cluster slot of `key`: CRC16 (XMODEM) of its hash tag, mod 16384.
pub(crate) fn slot(key: &[u8]) -> u16 {
    let tagged = key
        .iter()
        .position(|&b| b == b'{')
        .and_then(|open| {
            let rest = &key[open + 1..];
            rest.iter()
                .position(|&b| b == b'}')
                .filter(|&close| close > 0)
                .map(|close| &rest[..close])
        })
        .unwrap_or(key);
    crc16(tagged) % 16384
}

fn crc16(data: &[u8]) -> u16 {
    let mut crc: u16 = 0;
    for &byte in data {
        crc ^= u16::from(byte) << 8;
        for _ in 0..8 {
            crc = if crc & 0x8000 != 0 {
                (crc << 1) ^ 0x1021
            } else {
                crc << 1
            };
        }
    }
    crc
}

/// `host:port` (the host may be an IPv6 address).
/// Where a MOVED or ASK error sends its call, `sender` being the node that
/// answered; `None` if it names no node to send to. `MOVED 3999 :6381`
/// names no host: the sender does not know its peer's, which is then taken
/// to be the sender's own. `MOVED 3999 ?:6381` (a peer announced by a
/// hostname it has not got) names none at all, as in `CLUSTER SLOTS`.
fn redirect_target(error: &RedisError, sender: &Addr) -> Option<Addr> {
    let (host, port) = split_host(error.redirect_node()?.0)?;
    match host.as_str() {
        "" => Some((sender.0.clone(), port)),
        "?" => None,
        _ => Some((host, port)),
    }
}

fn split_host(address: &str) -> Option<Addr> {
    let (host, port) = address.rsplit_once(':')?;
    let host = host.trim_start_matches('[').trim_end_matches(']');
    Some((host.to_string(), port.parse().ok()?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_match_redis() {
        // The CRC16/XMODEM check value of "123456789" is 0x31C3; the
        // cluster test compares more keys with CLUSTER KEYSLOT.
        assert_eq!(slot(b"foo"), 12182);
        assert_eq!(slot(b"123456789"), 12739);
        assert_eq!(slot(b"{user1000}.following"), slot(b"user1000"));
        // An empty tag is not a tag.
        assert_eq!(slot(b"{}foo"), crc16(b"{}foo") % 16384);
    }

    fn bulk(s: &str) -> Value {
        Value::BulkString(s.as_bytes().to_vec())
    }

    fn range(start: i64, end: i64, host: Value, port: i64) -> Value {
        Value::Array(vec![
            Value::Int(start),
            Value::Int(end),
            Value::Array(vec![host, Value::Int(port), bulk("id")]),
        ])
    }

    #[test]
    fn slot_maps_read_what_cluster_slots_answers() {
        let reply = Value::Array(vec![
            range(0, 5460, bulk("10.0.0.1"), 7000),
            // Announced as unknown, or empty: the node asked.
            range(5461, 10922, Value::Nil, 7001),
            range(10923, 16000, bulk(""), 7002),
            // No usable endpoint: those slots have no master.
            range(16001, 16383, bulk("?"), 7003),
        ]);
        let map = SlotMap::parse(&reply, "asked").expect("a map");
        assert_eq!(map.master(0), Some(&("10.0.0.1".into(), 7000)));
        assert_eq!(map.master(5461), Some(&("asked".into(), 7001)));
        assert_eq!(map.master(16000), Some(&("asked".into(), 7002)));
        assert_eq!(map.master(16383), None);
        assert!(map.same_as(&SlotMap::parse(&reply, "asked").unwrap()));
        assert!(!map.same_as(&map.moved(0, &("10.0.0.2".into(), 7000))));
    }

    #[test]
    fn the_map_most_nodes_give_wins_not_the_first() {
        let reply = Value::Array(vec![range(0, 16383, bulk("old"), 7000)]);
        let stale = SlotMap::parse(&reply, "asked").unwrap();
        let promoted = || stale.moved(0, &("new".into(), 7001));
        let mut votes = Votes::default();
        // A master cut off from the cluster answers first, with its map
        // from before its replica took over; two other nodes agree.
        assert_eq!(votes.add(SlotMap::parse(&reply, "asked").unwrap()), 1);
        assert_eq!(votes.add(promoted()), 1);
        assert_eq!(votes.add(promoted()), 2);
        let winner = votes.winner().unwrap();
        assert_eq!(winner.master(0), Some(&("new".into(), 7001)));
        // A tie goes to the first answered.
        let mut votes = Votes::default();
        votes.add(promoted());
        votes.add(SlotMap::parse(&reply, "asked").unwrap());
        assert_eq!(
            votes.winner().unwrap().master(0),
            Some(&("new".into(), 7001))
        );
        assert!(Votes::default().winner().is_none());
    }

    #[test]
    fn a_reply_that_is_no_slot_map_is_refused() {
        let host = || bulk("h");
        for reply in [
            Value::Nil,
            Value::Int(1),
            Value::Array(vec![]),
            Value::Array(vec![Value::Int(0)]),
            Value::Array(vec![range(10, 5, host(), 1)]),
            Value::Array(vec![range(0, 16384, host(), 1)]),
            Value::Array(vec![range(-1, 5, host(), 1)]),
            Value::Array(vec![range(0, 5, host(), 70000)]),
            Value::Array(vec![range(0, 5, Value::Int(3), 1)]),
            Value::Array(vec![range(0, 5, bulk("?"), 1)]),
        ] {
            assert!(SlotMap::parse(&reply, "asked").is_none(), "{reply:?}");
        }
    }

    #[test]
    fn redirect_addresses_split_at_the_last_colon() {
        assert_eq!(
            split_host("127.0.0.1:7000"),
            Some(("127.0.0.1".into(), 7000))
        );
        assert_eq!(split_host("[::1]:7001"), Some(("::1".into(), 7001)));
        assert_eq!(split_host("nowhere"), None);
        assert_eq!(split_host(":7002"), Some(("".into(), 7002)));
    }

    /// A fetch whose task is dropped before it first runs (its runtime
    /// shut down) leaves no fetch marked under way: before, the flag was
    /// cleared only by a task that had started, and a flag left set would
    /// stop every later fetch.
    #[test]
    fn a_fetch_dropped_before_it_ran_leaves_none_under_way() {
        let template = "redis://127.0.0.1:1".into_connection_info().expect("a URL");
        let shared = Arc::new(Shared::new(
            template,
            vec![("127.0.0.1".into(), 1)],
            ConnectionManagerConfig::new(),
            Duration::from_secs(1),
        ));
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("a runtime");
        // The spawned fetch is not polled: the future given to block_on is
        // ready at once, and the runtime is dropped with the task unrun.
        runtime.block_on(async { shared.clone().refresh_soon() });
        assert!(shared.refreshing.load(Ordering::Acquire), "under way");
        drop(runtime);
        assert!(!shared.refreshing.load(Ordering::Acquire), "cleared");
    }

    #[test]
    fn a_redirect_without_a_host_is_to_the_senders() {
        let sender: Addr = ("10.0.0.5".into(), 7000);
        let redirect = |kind, detail: &str| {
            RedisError::from((ErrorKind::Server(kind), "redirected", detail.to_string()))
        };
        let moved = |detail| redirect(ServerErrorKind::Moved, detail);
        assert_eq!(
            redirect_target(&moved("3999 :6381"), &sender),
            Some(("10.0.0.5".into(), 6381))
        );
        assert_eq!(
            redirect_target(&moved("3999 10.0.0.6:6381"), &sender),
            Some(("10.0.0.6".into(), 6381))
        );
        assert_eq!(
            redirect_target(&redirect(ServerErrorKind::Ask, "12 [::1]:7001"), &sender),
            Some(("::1".into(), 7001))
        );
        // Not a redirect, or one that names no node: nowhere to go.
        assert_eq!(redirect_target(&moved("3999"), &sender), None);
        assert_eq!(redirect_target(&moved("3999 ?:6381"), &sender), None);
        let try_again = redirect(ServerErrorKind::TryAgain, "3999 :6381");
        assert_eq!(redirect_target(&try_again, &sender), None);
    }
}
