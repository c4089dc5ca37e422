//! `orbite._orbite`: the engine for Python (pyo3, abi3 from CPython 3.9).
//! The Python package `orbite` re-exports it with type stubs.
//!
//! Memory a caller registers is any writable, C-contiguous buffer (numpy
//! arrays, bytearrays, memoryviews): the registration holds the buffer
//! (so the memory stays valid) until the engine lets go of it, after the
//! last transfer that may touch it retired. Waits and copies release the
//! GIL.

use std::sync::Arc;
use std::time::Duration;

use orbite_core::{
    Desc, Error, ExecutionPhase, HostMemory, MemoryRange, Op, Permission, RegistrationId, RemoteSegment, Target,
    TransferEngine, TransferResult, TransferSpec, TransferStatus,
};
use pyo3::create_exception;
use pyo3::exceptions::PyException;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

create_exception!(_orbite, OrbiteError, PyException, "An error of the engine.");
create_exception!(_orbite, ConfigError, OrbiteError, "A configuration the engine refuses.");
create_exception!(_orbite, MemoryError, OrbiteError, "Memory that cannot be registered.");
create_exception!(_orbite, TransferError, OrbiteError, "A transfer the engine refuses.");
/// `PeerError` in a module of its own: its name is the Python class's,
/// and orbite_core has a `PeerError` too.
mod peer_error {
    pyo3::create_exception!(_orbite, PeerError, super::OrbiteError, "A peer that cannot be reached or used.");
}
use peer_error::PeerError as PeerError_;
create_exception!(_orbite, ResourceExhausted, OrbiteError, "A budget of the engine is full.");
create_exception!(_orbite, Closed, OrbiteError, "The engine is closed.");
create_exception!(
    _orbite,
    DiscoveryError,
    PeerError_,
    "A name that cannot be published or resolved in the metadata store (etcd)."
);

/// The Python exception of an engine error.
fn err(e: Error) -> PyErr {
    let text = e.to_string();
    match e {
        Error::Config(_) => ConfigError::new_err(text),
        Error::Registry(_) | Error::NotSupported(_) => MemoryError::new_err(text),
        Error::Batch(_) => TransferError::new_err(text),
        Error::Peer(_) => PeerError_::new_err(text),
        Error::ResourceExhausted { .. } => ResourceExhausted::new_err(text),
        Error::Closed => Closed::new_err(text),
        Error::Discovery(_) => DiscoveryError::new_err(text),
        _ => OrbiteError::new_err(text),
    }
}

/// A timeout in seconds as a duration: negative and NaN are zero, and
/// anything over a day (infinity included) is a day.
fn seconds(timeout: f64) -> Duration {
    Duration::from_secs_f64(if timeout.is_nan() { 0.0 } else { timeout.clamp(0.0, 86_400.0) })
}

/// The permission named by `remote`.
fn permission(remote: &str) -> PyResult<Permission> {
    match remote {
        "none" => Ok(Permission::LocalOnly),
        "read" => Ok(Permission::RemoteRead),
        "readwrite" => Ok(Permission::RemoteReadWrite),
        other => Err(MemoryError::new_err(format!("remote is none, read or readwrite, not {other:?}"))),
    }
}

/// A transfer engine (the package's `orbite.Engine` adds `register`).
#[pyclass(module = "orbite._orbite", frozen, subclass)]
struct Engine {
    inner: TransferEngine,
}

#[pymethods]
impl Engine {
    /// `config`: None (defaults), a dict, or a JSON string
    /// (docs/configuration.md).
    #[new]
    #[pyo3(signature = (config=None))]
    fn new(py: Python<'_>, config: Option<&Bound<'_, PyAny>>) -> PyResult<Self> {
        let json = match config {
            None => "{}".to_owned(),
            Some(c) if c.is_instance_of::<PyDict>() => {
                py.import("json")?.call_method1("dumps", (c,))?.extract::<String>()?
            }
            Some(c) => c.extract::<String>().map_err(|_| ConfigError::new_err("config is a dict or a JSON string"))?,
        };
        let inner = py.allow_threads(|| TransferEngine::from_json(&json)).map_err(err)?;
        Ok(Engine { inner })
    }

    /// The endpoint peers dial (`host:port`), if the engine listens.
    #[getter]
    fn endpoint(&self) -> Option<String> {
        self.inner.endpoint()
    }

    /// The engine's identity for this run.
    #[getter]
    fn epoch(&self) -> u64 {
        self.inner.source_epoch()
    }

    /// Registers `length` bytes at address `address`: of this process's
    /// memory when `device` is None (checked now to be mapped readable and
    /// writable), else of CUDA device `device` (checked with the driver to
    /// lie inside one allocation of it). `keep` is held until the engine
    /// lets go of the memory (after the last transfer that may touch it
    /// retired); `remote`: "none", "read" or "readwrite", what peers may do
    /// with it. Returns its id. The package's `Engine.register` finds the
    /// address of a buffer, an array or a tensor.
    #[pyo3(signature = (address, length, keep, remote="readwrite", device=None))]
    fn register_address(
        &self,
        py: Python<'_>,
        address: u64,
        length: u64,
        keep: PyObject,
        remote: &str,
        device: Option<u32>,
    ) -> PyResult<u64> {
        let permission = permission(remote)?;
        if address == 0 || length == 0 {
            return Err(MemoryError::new_err("a null or empty range"));
        }
        let range = match device {
            None => {
                orbite_core::memory::check_mapped(address, length, true).map_err(|e| err(e.into()))?;
                let len = usize::try_from(length).map_err(|_| MemoryError::new_err("length too large"))?;
                // SAFETY: the range is mapped, readable and writable now
                // (checked above); the caller's promise (the package's
                // `register` takes the address of a writable buffer whose
                // export `keep` holds) keeps it so until the registration
                // lets go of `keep`.
                unsafe { MemoryRange::borrowed(address as *mut u8, len, permission) }
            }
            // SAFETY: the driver checks the range is one allocation of the
            // device; `keep` (the tensor) keeps the allocation alive until
            // the engine lets go of it.
            Some(d) => py
                .allow_threads(|| unsafe { MemoryRange::cuda_borrowed(d, address, length, permission) })
                .map_err(|e| err(e.into()))?,
        };
        let range = range.with_owner_release(Box::new(move || Python::with_gil(|_| drop(keep))));
        let ids = py.allow_threads(|| self.inner.register_memory_ranges(vec![range])).map_err(err)?;
        Ok(ids[0].to_raw())
    }

    /// Allocates `nbytes` of zeroed, page-aligned host memory charged to
    /// this engine; `shared`: a sealed memfd that same-host peers map and
    /// copy into one-sided (the shm route), else private memory. The
    /// package's `Engine.allocate` returns it as an array.
    #[pyo3(signature = (nbytes, shared=true))]
    fn allocate_host(&self, py: Python<'_>, nbytes: usize, shared: bool) -> PyResult<HostBuffer> {
        let mem = py
            .allow_threads(|| {
                if shared { self.inner.allocate_shm_memory(nbytes) } else { self.inner.allocate_host_memory(nbytes) }
            })
            .map_err(err)?;
        Ok(HostBuffer { mem })
    }

    /// Registers `length` bytes at `offset` of an allocation of this
    /// engine (so a shared one is offered to same-host peers as such).
    #[pyo3(signature = (buffer, offset, length, remote="readwrite"))]
    fn register_host(
        &self,
        py: Python<'_>,
        buffer: &HostBuffer,
        offset: usize,
        length: usize,
        remote: &str,
    ) -> PyResult<u64> {
        let range = MemoryRange::host(&buffer.mem, offset, length, permission(remote)?).map_err(|e| err(e.into()))?;
        let ids = py.allow_threads(|| self.inner.register_memory_ranges(vec![range])).map_err(err)?;
        Ok(ids[0].to_raw())
    }

    /// Deregisters (fences at once; the buffer is let go of after the last
    /// transfer that may touch it retired).
    fn deregister(&self, py: Python<'_>, registration: u64) -> PyResult<()> {
        py.allow_threads(|| self.inner.deregister(RegistrationId::from_raw(registration))).map_err(err)
    }

    /// Opens a peer engine at `endpoint` (`epoch`: the one expected).
    #[pyo3(signature = (endpoint, epoch=None, timeout=10.0))]
    fn open_peer(&self, py: Python<'_>, endpoint: &str, epoch: Option<u64>, timeout: f64) -> PyResult<Peer> {
        let t = seconds(timeout);
        let seg = py.allow_threads(|| self.inner.open_segment(endpoint, epoch, t)).map_err(err)?;
        Ok(Peer { seg, engine: self.inner.clone() })
    }

    /// Opens the peer published under `name` in the metadata store (config
    /// `metadata`, feature `etcd`), expecting the epoch published there.
    #[pyo3(signature = (name, timeout=10.0))]
    fn open_peer_by_name(&self, py: Python<'_>, name: &str, timeout: f64) -> PyResult<Peer> {
        let t = seconds(timeout);
        let seg = py.allow_threads(|| self.inner.open_segment_by_name(name, t)).map_err(err)?;
        Ok(Peer { seg, engine: self.inner.clone() })
    }

    /// What is published under `name` in the metadata store: a dict of
    /// `endpoint`, `epoch` and `routes` (the peer's claim, checked only
    /// when it is opened).
    fn resolve_name<'py>(&self, py: Python<'py>, name: &str) -> PyResult<Bound<'py, PyDict>> {
        let r = py.allow_threads(|| self.inner.resolve_name(name)).map_err(err)?;
        let d = PyDict::new(py);
        d.set_item("endpoint", r.endpoint)?;
        d.set_item("epoch", r.epoch)?;
        d.set_item("routes", r.routes)?;
        Ok(d)
    }

    /// Prepares a transfer: `op` "read" or "write", `local` and `remote`
    /// lists of `(registration, offset, length)`, `peer` (None: this
    /// engine), an optional notification (bytes) for the peer once every
    /// byte landed.
    #[pyo3(signature = (op, local, remote, peer=None, notification=None))]
    fn prepare(
        &self,
        py: Python<'_>,
        op: &str,
        local: Vec<(u64, u64, u64)>,
        remote: Vec<(u64, u64, u64)>,
        peer: Option<&Peer>,
        notification: Option<Vec<u8>>,
    ) -> PyResult<Transfer> {
        let op = match op {
            "read" => Op::Read,
            "write" => Op::Write,
            other => return Err(TransferError::new_err(format!("op is read or write, not {other:?}"))),
        };
        let descs = |v: Vec<(u64, u64, u64)>| -> Vec<Desc> {
            v.into_iter().map(|(r, o, l)| Desc::new(RegistrationId::from_raw(r), o, l)).collect()
        };
        let (l, r) = (descs(local), descs(remote));
        let target = match peer {
            Some(p) => Target::Peer(&p.seg),
            None => Target::Loopback,
        };
        let mut spec = TransferSpec::new(op, &l, &r, target);
        spec.notification = notification.as_deref();
        let t = py.allow_threads(|| self.inner.prepare(&spec)).map_err(err)?;
        Ok(Transfer { inner: std::sync::Mutex::new(Some(Arc::new(t))) })
    }

    /// Sends `payload` to `peer` as a notification.
    fn notify(&self, py: Python<'_>, peer: &Peer, payload: Vec<u8>) -> PyResult<()> {
        py.allow_threads(|| self.inner.notify(&peer.seg, &payload)).map_err(err)
    }

    /// Takes the notifications received: `(sender endpoint, sender epoch,
    /// payload)` each.
    fn notifications<'py>(&self, py: Python<'py>) -> Vec<(String, u64, Bound<'py, PyBytes>)> {
        self.inner
            .take_notifications()
            .into_iter()
            .map(|n| (n.sender_endpoint, n.sender_epoch, PyBytes::new(py, &n.payload)))
            .collect()
    }

    /// Closes the engine (drains what runs, within its close timeout).
    fn close(&self, py: Python<'_>) {
        py.allow_threads(|| drop(self.inner.close()));
    }
}

/// Host memory this engine allocated (freed after the last array over it
/// and the last registration of it are gone).
#[pyclass(module = "orbite._orbite", frozen)]
struct HostBuffer {
    mem: HostMemory,
}

#[pymethods]
impl HostBuffer {
    /// Its address in this process.
    #[getter]
    fn address(&self) -> usize {
        self.mem.as_ptr() as usize
    }

    /// Its length in bytes.
    #[getter]
    fn nbytes(&self) -> usize {
        self.mem.len()
    }

    /// The name of its shared file, if it is shared.
    #[getter]
    fn shared_name(&self) -> Option<String> {
        self.mem.shared_name().map(str::to_owned)
    }
}

/// An opened peer.
#[pyclass(module = "orbite._orbite", frozen)]
struct Peer {
    seg: RemoteSegment,
    engine: TransferEngine,
}

#[pymethods]
impl Peer {
    #[getter]
    fn endpoint(&self) -> String {
        self.seg.endpoint().to_owned()
    }

    #[getter]
    fn epoch(&self) -> u64 {
        self.seg.epoch()
    }

    /// The peer's registration covering `address..address + length` in
    /// the peer's address space (`device`: a CUDA ordinal for its device
    /// memory), as `(registration, offset, length)`; None if no
    /// registration of the peer this engine knows of covers it.
    /// The view is refreshed first if the peer announced changes.
    #[pyo3(signature = (address, length, device=None))]
    fn range_at(
        &self,
        py: Python<'_>,
        address: u64,
        length: u64,
        device: Option<u32>,
    ) -> PyResult<Option<(u64, u64, u64)>> {
        let found = py
            .allow_threads(|| self.engine.find_remote_registration(&self.seg, address, length, |r| r.device == device));
        match found {
            Ok(r) => Ok(Some((r.id.to_raw(), address - r.addr, length))),
            Err(Error::Peer(orbite_core::PeerError::RangeNotRegistered { .. })) => Ok(None),
            Err(e) => Err(err(e)),
        }
    }

    /// Why the peer is lost, if it is.
    #[getter]
    fn lost(&self) -> Option<String> {
        self.seg.lost()
    }
}

/// A prepared transfer.
#[pyclass(module = "orbite._orbite")]
struct Transfer {
    /// Taken out by `release`. The lock is held only to clone or take the
    /// handle, never across a wait: a thread waiting without the GIL must
    /// not hold what a thread holding the GIL waits for.
    inner: std::sync::Mutex<Option<Arc<orbite_core::Transfer>>>,
}

impl Transfer {
    fn with<T>(&self, f: impl FnOnce(&orbite_core::Transfer) -> PyResult<T>) -> PyResult<T> {
        let t = {
            let g = self.inner.lock().map_err(|_| OrbiteError::new_err("poisoned"))?;
            g.clone().ok_or_else(|| TransferError::new_err("the transfer was released"))?
        };
        f(&t)
    }
}

/// A retired execution: its logical outcome and its retirement receipt.
/// Also readable as a mapping (`outcome["success"]`).
#[pyclass(module = "orbite._orbite", frozen, get_all)]
struct Outcome {
    /// How it ended: "Success", "Failed", "Cancelled", "Expired", ...
    code: String,
    /// Whether every byte landed.
    success: bool,
    /// Bytes known landed contiguously from the start.
    transferred_prefix: u64,
    /// All bytes known landed.
    transferred_bytes: u64,
    /// Bytes the transfer covers.
    total_bytes: u64,
    /// What the destination experienced: "None", "Complete", "Unknown", ...
    remote_effect: String,
    /// The execution's sequence number (1 for the first post).
    execution: u64,
    /// Tasks started, all ended (the receipt).
    tasks_started: u32,
    /// Tasks never started and never to be (the receipt).
    tasks_never_started: u32,
}

#[pymethods]
impl Outcome {
    fn __getitem__<'py>(slf: &Bound<'py, Self>, key: &str) -> PyResult<Bound<'py, PyAny>> {
        const KEYS: [&str; 9] = [
            "code",
            "success",
            "transferred_prefix",
            "transferred_bytes",
            "total_bytes",
            "remote_effect",
            "execution",
            "tasks_started",
            "tasks_never_started",
        ];
        if !KEYS.contains(&key) {
            return Err(pyo3::exceptions::PyKeyError::new_err(key.to_owned()));
        }
        slf.getattr(key)
    }

    fn __repr__(&self) -> String {
        format!(
            "Outcome(code={:?}, transferred_bytes={}, total_bytes={}, remote_effect={:?}, execution={})",
            self.code, self.transferred_bytes, self.total_bytes, self.remote_effect, self.execution
        )
    }
}

impl From<TransferResult> for Outcome {
    fn from(r: TransferResult) -> Self {
        Outcome {
            code: format!("{:?}", r.outcome.code),
            success: r.outcome.is_success(),
            transferred_prefix: r.outcome.transferred_prefix,
            transferred_bytes: r.outcome.transferred_bytes,
            total_bytes: r.outcome.total_bytes,
            remote_effect: format!("{:?}", r.outcome.remote_effect),
            execution: r.receipt.execution,
            tasks_started: r.receipt.tasks_started,
            tasks_never_started: r.receipt.tasks_never_started,
        }
    }
}

/// The outcome of a retired execution, else None.
fn outcome(status: TransferStatus) -> Option<Outcome> {
    status.result().map(Outcome::from)
}

/// A status as a word.
fn status_word(status: &TransferStatus) -> &'static str {
    match status {
        TransferStatus::NotPosted => "not_posted",
        TransferStatus::InProgress { phase: ExecutionPhase::Queued, .. } => "queued",
        TransferStatus::InProgress { phase: ExecutionPhase::Running, .. } => "running",
        TransferStatus::InProgress { phase: ExecutionPhase::Draining, .. } => "draining",
        TransferStatus::Retired(_) => "retired",
    }
}

#[pymethods]
impl Transfer {
    /// The route it takes and why: `(route, reason)`.
    #[getter]
    fn route(&self) -> PyResult<(String, String)> {
        self.with(|t| Ok((t.route().route.name().to_owned(), t.route().reason.clone())))
    }

    /// Starts an execution.
    fn post(&self, py: Python<'_>) -> PyResult<()> {
        self.with(|t| py.allow_threads(|| t.post()).map_err(err))
    }

    /// One progress step: the outcome once retired, else None.
    fn check(&self, py: Python<'_>) -> PyResult<Option<Outcome>> {
        let status = self.with(|t| Ok(py.allow_threads(|| t.check())))?;
        Ok(outcome(status))
    }

    /// Where it stands, without driving progress: "not_posted", "queued",
    /// "running", "draining" or "retired".
    #[getter]
    fn status(&self) -> PyResult<&'static str> {
        self.with(|t| Ok(status_word(&t.status())))
    }

    /// `await transfer` (asyncio): the outcome of the execution posted,
    /// waited for on a thread of its own without the GIL.
    fn __await__<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyAny>> {
        let py = slf.py();
        py.import("orbite._aio")?.call_method1("wait", (slf,))?.call_method0("__await__")
    }

    /// Waits (without the GIL) until the execution retired or `timeout`
    /// seconds passed: the outcome, or None.
    #[pyo3(signature = (timeout=30.0))]
    fn wait(&self, py: Python<'_>, timeout: f64) -> PyResult<Option<Outcome>> {
        let d = seconds(timeout);
        let status = self.with(|t| Ok(py.allow_threads(|| t.wait(d))))?;
        Ok(outcome(status))
    }

    /// Releases it (refused while an execution is active). A thread
    /// whose wait or await just ended may still hold it for a moment: that
    /// is waited out, for at most a second.
    fn release(&self, py: Python<'_>) -> PyResult<()> {
        let deadline = std::time::Instant::now() + Duration::from_secs(1);
        loop {
            {
                let mut g = self.inner.lock().map_err(|_| OrbiteError::new_err("poisoned"))?;
                let t = g.as_ref().ok_or_else(|| TransferError::new_err("the transfer was released"))?;
                if Arc::strong_count(t) == 1 {
                    let t = g.take().and_then(Arc::into_inner).ok_or_else(|| OrbiteError::new_err("lost"))?;
                    return match t.release() {
                        Ok(()) => Ok(()),
                        Err(refused) => {
                            let why = refused.error.to_string();
                            *g = Some(Arc::new(refused.transfer));
                            Err(TransferError::new_err(why))
                        }
                    };
                }
                if matches!(t.status(), TransferStatus::InProgress { .. }) || std::time::Instant::now() > deadline {
                    return Err(TransferError::new_err(
                        "the transfer is active, or in use by another thread (a wait or an await)",
                    ));
                }
            }
            py.allow_threads(|| std::thread::sleep(Duration::from_millis(1)));
        }
    }
}

#[pymodule]
fn _orbite(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add_class::<Engine>()?;
    m.add_class::<Peer>()?;
    m.add_class::<Transfer>()?;
    m.add_class::<Outcome>()?;
    m.add_class::<HostBuffer>()?;
    m.add("OrbiteError", py.get_type::<OrbiteError>())?;
    m.add("ConfigError", py.get_type::<ConfigError>())?;
    m.add("MemoryError", py.get_type::<MemoryError>())?;
    m.add("TransferError", py.get_type::<TransferError>())?;
    m.add("PeerError", py.get_type::<PeerError_>())?;
    m.add("ResourceExhausted", py.get_type::<ResourceExhausted>())?;
    m.add("Closed", py.get_type::<Closed>())?;
    m.add("DiscoveryError", py.get_type::<DiscoveryError>())?;
    Ok(())
}
