//! Finding peers by name through a metadata store (etcd).
//!
//! An engine with config `metadata` (`"etcd://host:port[,host:port]"`) and
//! a `name` publishes a [`Record`] (its endpoint, epoch and the routes it
//! serves) under `/orbite/v1/engines/<name>`, attached to an etcd lease of
//! `metadata_ttl_ms` that a task of the engine keeps alive. When the engine
//! closes, it revokes the lease and the name is gone at once; when it dies,
//! the lease expires and the name is gone within the TTL. A restarted
//! engine publishes its new epoch under the same name.
//!
//! [`crate::TransferEngine::open_segment_by_name`] resolves a name and
//! opens the peer expecting the epoch it read. What the store says is a
//! peer's claim, not a proof: the endpoint is only where to dial, and the
//! epoch is checked by the peer protocol's handshake (authenticated when
//! `auth` is set), so a record that lies yields a refused open, never a
//! peer taken for another.
//!
//! Every call to the store is bounded by `metadata_timeout_ms`. The store
//! being unreachable fails a resolution with [`DiscoveryError::Unreachable`]
//! and never touches peers already open; the lease is kept alive again,
//! or granted anew and the record published again, when the store is back.
//!
//! The client (feature `etcd`) is the `etcd-client` crate over its own
//! small tokio runtime, so callers need no runtime of their own.

use serde::{Deserialize, Serialize};

/// Where names live in the store.
pub const KEY_PREFIX: &str = "/orbite/v1/engines/";

/// The largest record read from the store.
pub const MAX_RECORD_BYTES: usize = 4096;

/// The longest name.
pub const MAX_NAME_BYTES: usize = 128;

/// Discovery failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DiscoveryError {
    /// The engine has no `metadata` store configured.
    #[error("no metadata store is configured (config `metadata`)")]
    NotConfigured,
    /// This build has no metadata store client (feature `etcd`).
    #[error("metadata store {0:?} needs a build with feature etcd")]
    NotBuilt(String),
    /// The store did not answer within the bound.
    #[error("the metadata store {store} did not answer within {timeout_ms} ms: {why}")]
    Unreachable {
        /// The configured store.
        store: String,
        /// The bound.
        timeout_ms: u64,
        /// What failed.
        why: String,
    },
    /// No live engine is published under the name.
    #[error("no engine is published under the name {0:?}")]
    NotFound(String),
    /// The record under the name is not one this engine reads.
    #[error("the record under the name {name:?} is malformed: {why}")]
    Malformed {
        /// The name.
        name: String,
        /// Why.
        why: String,
    },
    /// A name that cannot be published or looked up.
    #[error("invalid engine name {0:?}: 1 to 128 bytes of letters, digits and . _ - : /")]
    InvalidName(String),
}

/// What an engine publishes under its name.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Record {
    /// Where peers dial it (`host:port`).
    pub endpoint: String,
    /// Its epoch: the identity of this run.
    pub epoch: u64,
    /// The routes it serves to peers (names as in `route`).
    pub routes: Vec<String>,
}

impl Record {
    /// The record as stored.
    pub fn to_bytes(&self) -> Vec<u8> {
        serde_json::to_vec(self).unwrap_or_default()
    }

    /// Reads a record from the store: bounded, with every field checked.
    pub fn decode(name: &str, b: &[u8]) -> Result<Record, DiscoveryError> {
        let bad = |why: String| DiscoveryError::Malformed { name: name.to_owned(), why };
        if b.len() > MAX_RECORD_BYTES {
            return Err(bad(format!("{} bytes, over {MAX_RECORD_BYTES}", b.len())));
        }
        let r: Record = serde_json::from_slice(b).map_err(|e| bad(e.to_string()))?;
        if r.epoch == 0 {
            return Err(bad("epoch 0".into()));
        }
        if r.endpoint.len() > 300 || !host_port(&r.endpoint, 300) {
            return Err(bad(format!(
                "endpoint {:?} is not host:port",
                r.endpoint.chars().take(64).collect::<String>()
            )));
        }
        if r.routes.len() > 16 || r.routes.iter().any(|x| x.len() > 16) {
            return Err(bad("too many routes, or a route name too long".into()));
        }
        Ok(r)
    }
}

/// Checks a name: 1 to 128 bytes of ASCII letters, digits and `. _ - : /`.
pub fn check_name(name: &str) -> Result<(), DiscoveryError> {
    let ok = !name.is_empty()
        && name.len() <= MAX_NAME_BYTES
        && name.bytes().all(|c| c.is_ascii_alphanumeric() || b"._-:/".contains(&c));
    if ok { Ok(()) } else { Err(DiscoveryError::InvalidName(name.chars().take(MAX_NAME_BYTES).collect())) }
}

/// Whether `hp` is `host:port`: a host of at most `max_host` ASCII letters,
/// digits and `. - [ ] :`, and a nonzero port.
fn host_port(hp: &str, max_host: usize) -> bool {
    hp.rsplit_once(':').is_some_and(|(host, port)| {
        !host.is_empty()
            && host.len() <= max_host
            && host.bytes().all(|c| c.is_ascii_alphanumeric() || b".-[]:".contains(&c))
            && port.parse::<u16>().is_ok_and(|p| p != 0)
    })
}

/// The store's client addresses in a `metadata` value
/// (`etcd://host:port[,host:port]`), as `http://host:port` each.
pub fn parse_store(metadata: &str) -> Result<Vec<String>, String> {
    let rest = metadata.strip_prefix("etcd://").ok_or("must start with etcd://")?;
    let mut out = Vec::new();
    for hp in rest.split(',') {
        if !host_port(hp, 253) {
            return Err(format!("{hp:?} is not host:port"));
        }
        out.push(format!("http://{hp}"));
    }
    if out.len() > 16 {
        return Err("at most 16 store addresses".into());
    }
    Ok(out)
}

/// The routes an engine serves to peers, as published: tcp and the
/// same-host routes always, rdma with NICs, cuda-ipc with a CUDA device.
pub fn served_routes(rdma: bool) -> Vec<String> {
    use crate::types::Route;
    Route::all()
        .into_iter()
        .filter(|r| match r {
            Route::Loopback | Route::File => false,
            Route::Rdma => rdma,
            Route::CudaIpc => cfg!(feature = "cuda") && crate::cuda::availability().is_ok(),
            Route::Tcp | Route::Shm | Route::Cma => true,
        })
        .map(|r| r.name().to_owned())
        .collect()
}

/// An engine's link to its metadata store: the directory, once started
/// (none without `metadata`).
#[derive(Default)]
pub(crate) struct Link {
    #[cfg(feature = "etcd")]
    dir: parking_lot::Mutex<Option<std::sync::Arc<Directory>>>,
}

impl Link {
    /// Connects to the store `metadata` (config `metadata`), if any, each
    /// call bounded by `timeout`, and publishes `record` under `name`, if
    /// any, with a lease of `ttl`.
    pub(crate) fn start(
        &self,
        metadata: Option<&str>,
        name: Option<&str>,
        record: Option<Record>,
        ttl: std::time::Duration,
        timeout: std::time::Duration,
    ) -> Result<(), DiscoveryError> {
        let Some(metadata) = metadata else { return Ok(()) };
        #[cfg(feature = "etcd")]
        {
            let dir = Directory::connect(metadata, timeout)?;
            if let (Some(name), Some(record)) = (name, record) {
                dir.publish(name, &record, ttl)?;
            }
            *self.dir.lock() = Some(std::sync::Arc::new(dir));
            Ok(())
        }
        #[cfg(not(feature = "etcd"))]
        {
            let _ = (name, record, ttl, timeout);
            Err(DiscoveryError::NotBuilt(metadata.to_owned()))
        }
    }

    /// Looks `name` up in the store.
    pub(crate) fn resolve(&self, name: &str) -> Result<Record, DiscoveryError> {
        #[cfg(feature = "etcd")]
        {
            let dir = self.dir.lock().clone().ok_or(DiscoveryError::NotConfigured)?;
            dir.resolve(name)
        }
        #[cfg(not(feature = "etcd"))]
        {
            let _ = name;
            Err(DiscoveryError::NotConfigured)
        }
    }

    /// Withdraws the published name and lets go of the store.
    pub(crate) fn close(&self) {
        #[cfg(feature = "etcd")]
        if let Some(dir) = self.dir.lock().take() {
            dir.withdraw();
        }
    }
}

#[cfg(feature = "etcd")]
pub use store::Directory;

#[cfg(feature = "etcd")]
mod store {
    use std::sync::Arc;
    use std::time::Duration;

    use etcd_client::{Client, ConnectOptions, PutOptions};
    use parking_lot::Mutex;

    use super::{DiscoveryError, KEY_PREFIX, Record, check_name};

    /// A connection to the store, and the name this engine holds there.
    pub struct Directory {
        /// Its own runtime; shut down without blocking on drop (which may
        /// happen inside a caller's runtime).
        rt: std::mem::ManuallyDrop<tokio::runtime::Runtime>,
        client: Client,
        store: String,
        timeout: Duration,
        held: Mutex<Option<Held>>,
    }

    /// A published name: its key, the current lease (shared with the task
    /// that keeps it alive) and that task.
    struct Held {
        key: String,
        lease: Arc<std::sync::atomic::AtomicI64>,
        keeper: tokio::task::JoinHandle<()>,
    }

    impl std::fmt::Debug for Directory {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.debug_struct("Directory").field("store", &self.store).finish()
        }
    }

    impl Directory {
        /// Connects to the store at `metadata` and checks that it answers,
        /// within `timeout`.
        pub fn connect(metadata: &str, timeout: Duration) -> Result<Directory, DiscoveryError> {
            let unreachable = |why| DiscoveryError::Unreachable { store: metadata.to_owned(), timeout_ms: 0, why };
            let urls = super::parse_store(metadata).map_err(unreachable)?;
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(1)
                .thread_name("orbite-discovery")
                .enable_all()
                .build()
                .map_err(|e| unreachable(format!("runtime: {e}")))?;
            let opts = ConnectOptions::new().with_connect_timeout(timeout).with_timeout(timeout);
            let client = run(&rt, timeout, metadata, async move {
                let mut c = Client::connect(urls, Some(opts)).await?;
                c.status().await?;
                Ok(c)
            })?;
            Ok(Directory {
                rt: std::mem::ManuallyDrop::new(rt),
                client,
                store: metadata.to_owned(),
                timeout,
                held: Mutex::new(None),
            })
        }

        /// Publishes `record` under `name` with a lease of `ttl`, kept
        /// alive (and granted anew after an outage) until [`Self::withdraw`].
        /// A record left under the name by an earlier run is replaced.
        pub fn publish(&self, name: &str, record: &Record, ttl: Duration) -> Result<(), DiscoveryError> {
            check_name(name)?;
            let key = format!("{KEY_PREFIX}{name}");
            let value = record.to_bytes();
            let ttl_s = ttl.as_secs().max(1) as i64;
            let (k, v, mut c) = (key.clone(), value.clone(), self.client.clone());
            let id =
                run(&self.rt, self.timeout, &self.store, async move { grant_and_put(&mut c, &k, &v, ttl_s).await })?;
            let lease = Arc::new(std::sync::atomic::AtomicI64::new(id));
            let keeper =
                self.rt.spawn(keep_alive(self.client.clone(), key.clone(), value, ttl_s, lease.clone(), self.timeout));
            if let Some(old) = self.held.lock().replace(Held { key, lease, keeper }) {
                old.keeper.abort();
            }
            log::info!(target: crate::logs::ENGINE, "published as {name:?} in {} (lease of {ttl_s} s)", self.store);
            Ok(())
        }

        /// Looks `name` up.
        pub fn resolve(&self, name: &str) -> Result<Record, DiscoveryError> {
            check_name(name)?;
            let key = format!("{KEY_PREFIX}{name}");
            let mut c = self.client.clone();
            let got = run(&self.rt, self.timeout, &self.store, async move {
                let r = c.get(key, None).await?;
                Ok(r.kvs().first().map(|kv| kv.value().to_vec()))
            })?;
            match got {
                None => Err(DiscoveryError::NotFound(name.to_owned())),
                Some(v) => Record::decode(name, &v),
            }
        }

        /// Withdraws the published name (revokes its lease: the record goes
        /// with it), within the bound; if the store does not answer, the
        /// lease expires within its TTL.
        pub fn withdraw(&self) {
            let Some(held) = self.held.lock().take() else { return };
            held.keeper.abort();
            let id = held.lease.load(std::sync::atomic::Ordering::Acquire);
            let mut c = self.client.clone();
            if let Err(e) = run(&self.rt, self.timeout, &self.store, async move {
                c.lease_revoke(id).await?;
                Ok(())
            }) {
                log::warn!(target: crate::logs::ENGINE, "could not withdraw {}: {e} (it expires with its lease)", held.key);
            }
        }
    }

    impl Drop for Directory {
        fn drop(&mut self) {
            self.withdraw();
            // SAFETY: taken once, here, and never used again.
            let rt = unsafe { std::mem::ManuallyDrop::take(&mut self.rt) };
            rt.shutdown_background();
        }
    }

    /// Grants a lease and puts the record under it: the lease id.
    async fn grant_and_put(c: &mut Client, key: &str, value: &[u8], ttl_s: i64) -> Result<i64, etcd_client::Error> {
        let id = c.lease_grant(ttl_s, None).await?.id();
        c.put(key, value, Some(PutOptions::new().with_lease(id))).await?;
        Ok(id)
    }

    /// Grants a lease and puts the record under it only if the name is
    /// free: `None` (the new lease revoked) if another engine published
    /// under it meanwhile, which then keeps it.
    async fn grant_and_put_if_free(
        c: &mut Client,
        key: &str,
        value: &[u8],
        ttl_s: i64,
    ) -> Result<Option<i64>, etcd_client::Error> {
        use etcd_client::{Compare, CompareOp, Txn, TxnOp};
        let id = c.lease_grant(ttl_s, None).await?.id();
        let txn = Txn::new().when([Compare::create_revision(key, CompareOp::Equal, 0)]).and_then([TxnOp::put(
            key,
            value,
            Some(PutOptions::new().with_lease(id)),
        )]);
        if c.txn(txn).await?.succeeded() {
            return Ok(Some(id));
        }
        c.lease_revoke(id).await?;
        Ok(None)
    }

    /// Why keeping a lease alive stopped.
    enum Stop {
        /// The store says the lease is gone: grant a new one.
        Expired,
        /// The store did not answer (or failed): try again.
        Away(String),
    }

    /// An error of the store, as a reason to stop: a keep-alive answered
    /// with no TTL ("lease not found" from the client) or NotFound from
    /// the store mean the lease expired; anything else, the store away.
    fn stop_for(e: etcd_client::Error) -> Stop {
        match &e {
            etcd_client::Error::LeaseKeepAliveError(why) if why.contains("not found") => Stop::Expired,
            etcd_client::Error::GRpcStatus(s) if s.code() == tonic::Code::NotFound => Stop::Expired,
            _ => Stop::Away(e.to_string()),
        }
    }

    /// Keeps the lease alive at a third of its TTL, each exchange bounded
    /// by `bound`. When the store is away, tries again every half second;
    /// when the lease expired meanwhile, grants a new one and publishes the
    /// record again, unless another engine took the name meanwhile.
    async fn keep_alive(
        mut c: Client,
        key: String,
        value: Vec<u8>,
        ttl_s: i64,
        lease: Arc<std::sync::atomic::AtomicI64>,
        bound: Duration,
    ) {
        use std::sync::atomic::Ordering;
        let period = Duration::from_millis((ttl_s as u64 * 1000 / 3).max(200));
        let mut away = false;
        loop {
            let id = lease.load(Ordering::Acquire);
            let stop = match tokio::time::timeout(bound, c.lease_keep_alive(id)).await {
                Err(_) => Stop::Away("timed out".into()),
                Ok(Err(e)) => stop_for(e),
                Ok(Ok((mut keeper, mut stream))) => loop {
                    let renewed = tokio::time::timeout(bound, async {
                        keeper.keep_alive().await?;
                        stream.message().await
                    })
                    .await;
                    match renewed {
                        Ok(Ok(Some(r))) if r.ttl() > 0 => {
                            if away {
                                log::info!(target: crate::logs::ENGINE, "metadata store: {key} kept alive again");
                                away = false;
                            }
                            tokio::time::sleep(period).await;
                        }
                        Ok(Ok(_)) => break Stop::Expired,
                        Ok(Err(e)) => break stop_for(e),
                        Err(_) => break Stop::Away("timed out".into()),
                    }
                },
            };
            match stop {
                Stop::Away(why) => {
                    if !away {
                        log::warn!(target: crate::logs::ENGINE, "metadata store: keeping {key} alive failed: {why}");
                    }
                    away = true;
                }
                Stop::Expired => {
                    match tokio::time::timeout(bound, grant_and_put_if_free(&mut c, &key, &value, ttl_s)).await {
                        Ok(Ok(Some(new))) => {
                            lease.store(new, Ordering::Release);
                            log::info!(target: crate::logs::ENGINE, "metadata store: published {key} again");
                            away = false;
                            continue;
                        }
                        Ok(Ok(None)) => {
                            // A newer run (a replacement) took the name while
                            // this one was away: it keeps it.
                            log::warn!(
                                target: crate::logs::ENGINE,
                                "metadata store: {key} was published by another engine while this one was away; \
                                 not taking it back"
                            );
                            return;
                        }
                        Ok(Err(e)) => {
                            log::debug!(target: crate::logs::ENGINE, "metadata store: publishing {key} again: {e}")
                        }
                        Err(_) => {
                            log::debug!(target: crate::logs::ENGINE, "metadata store: publishing {key} again timed out")
                        }
                    }
                }
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }

    /// Runs `f` on the directory's runtime from any thread (a caller's own
    /// runtime included), bounded by `timeout`.
    fn run<T: Send + 'static>(
        rt: &tokio::runtime::Runtime,
        timeout: Duration,
        store: &str,
        f: impl std::future::Future<Output = Result<T, etcd_client::Error>> + Send + 'static,
    ) -> Result<T, DiscoveryError> {
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        let task = rt.spawn(async move {
            let r = tokio::time::timeout(timeout, f).await;
            let _ = tx.send(r);
        });
        let fail = |why: String| DiscoveryError::Unreachable {
            store: store.to_owned(),
            timeout_ms: timeout.as_millis() as u64,
            why,
        };
        match rx.recv_timeout(timeout + Duration::from_millis(500)) {
            Ok(Ok(Ok(v))) => Ok(v),
            Ok(Ok(Err(e))) => Err(fail(e.to_string())),
            Ok(Err(_)) | Err(_) => {
                task.abort();
                Err(fail("timed out".into()))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_names_and_stores_are_checked() {
        let r = Record { endpoint: "10.0.0.1:4000".into(), epoch: 7, routes: vec!["tcp".into()] };
        assert_eq!(Record::decode("a", &r.to_bytes()), Ok(r));
        for bad in [
            &b"{}"[..],
            br#"{"endpoint":"10.0.0.1:4000","epoch":0,"routes":[]}"#,
            br#"{"endpoint":"nowhere","epoch":1,"routes":[]}"#,
            br#"{"endpoint":"10.0.0.1:4000","epoch":1,"routes":[],"extra":1}"#,
            b"\xff",
        ] {
            assert!(matches!(Record::decode("a", bad), Err(DiscoveryError::Malformed { .. })), "{bad:?}");
        }
        assert!(Record::decode("a", &vec![b' '; MAX_RECORD_BYTES + 1]).is_err());
        assert!(check_name("prefill-0/rank:3").is_ok());
        for bad in ["", "a b", "é", &"x".repeat(129)] {
            assert!(check_name(bad).is_err(), "{bad:?}");
        }
        assert_eq!(parse_store("etcd://127.0.0.1:2379,h:1").unwrap(), ["http://127.0.0.1:2379", "http://h:1"]);
        for bad in ["http://h:1", "etcd://", "etcd://h", "etcd://h:0", "etcd://h:x", "etcd://a b:1"] {
            assert!(parse_store(bad).is_err(), "{bad:?}");
        }
    }

    #[cfg(not(feature = "etcd"))]
    #[test]
    fn a_build_without_etcd_refuses_a_store() {
        let d = std::time::Duration::from_secs(1);
        let r = Link::default().start(Some("etcd://127.0.0.1:2379"), None, None, d, d);
        assert!(matches!(r, Err(DiscoveryError::NotBuilt(_))));
        assert_eq!(Link::default().resolve("x"), Err(DiscoveryError::NotConfigured));
    }
}
