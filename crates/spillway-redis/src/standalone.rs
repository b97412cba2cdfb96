//! A standalone server's connection, and what both topologies' connections
//! share: which errors mean a connection must be made again, and which
//! protocol they speak.

use std::sync::Arc;

use parking_lot::Mutex;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::{ConnectionInfo, ErrorKind, RedisError, RedisResult};

/// One server's connection manager, replaced by a new one after an error of
/// the connection's own set-up. Cloning it shares it.
///
/// The manager makes a new connection after a lost one by itself, but it
/// keeps a set-up that failed (AUTH refused while a password was being
/// rotated, say) and gives its error to every call from then on, long after
/// the server would let it in.
#[derive(Clone)]
pub(crate) struct Standalone(Arc<Node>);

struct Node {
    client: redis::Client,
    config: ConnectionManagerConfig,
    manager: Mutex<ConnectionManager>,
}

impl Standalone {
    /// Connects to the server at `url`, waiting for the connection.
    pub(crate) async fn connect(url: String, config: ConnectionManagerConfig) -> RedisResult<Self> {
        let client = redis::Client::open(url)?;
        speaks_resp2(client.get_connection_info())?;
        let manager = ConnectionManager::new_with_config(client.clone(), config.clone()).await?;
        Ok(Self(Arc::new(Node {
            client,
            config,
            manager: Mutex::new(manager),
        })))
    }

    /// Runs `call` on the connection; after an error of its set-up, the
    /// next call makes a new one.
    pub(crate) async fn run<T>(
        &self,
        call: impl AsyncFnOnce(ConnectionManager) -> RedisResult<T>,
    ) -> RedisResult<T> {
        let node = &*self.0;
        let manager = node.manager.lock().clone();
        let result = call(manager).await;
        if let Err(error) = &result
            && is_setup_error(error)
        {
            // Connects when first used: no lock is held while waiting.
            let fresh =
                ConnectionManager::new_lazy_with_config(node.client.clone(), node.config.clone());
            if let Ok(fresh) = fresh {
                *node.manager.lock() = fresh;
            }
        }
        result
    }
}

/// Whether `error` comes from a connection's own set-up (AUTH refused, a
/// bad database number), not from a server's answer to the call nor from a
/// lost connection (which the connection manager repairs itself): the
/// manager would give it to every later call, so the connection must be
/// made again.
pub(crate) fn is_setup_error(error: &RedisError) -> bool {
    !matches!(
        error.kind(),
        ErrorKind::Server(_) | ErrorKind::Extension | ErrorKind::Io
    )
}

/// Refuses a URL that asks for RESP3 (`?protocol=resp3`). Over RESP3 a
/// refused set-up (`HELLO 3 AUTH`) comes back as the server's answer
/// (WRONGPASS, or the ERR of a server at its client limit), which cannot be
/// told from an answer to a call: such a connection would never be made
/// again. The store's scripts answer the same over both protocols.
pub(crate) fn speaks_resp2(info: &ConnectionInfo) -> RedisResult<()> {
    match info.redis_settings().protocol().supports_resp3() {
        false => Ok(()),
        true => Err(RedisError::from((
            ErrorKind::InvalidClientConfig,
            "the store speaks RESP2 to Redis: leave `protocol=resp3` out of the URL",
        ))),
    }
}
