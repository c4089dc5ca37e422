//! `orbite._orbite`: the engine for Python (pyo3, abi3 from CPython 3.9).
//! The Python package `orbite` re-exports it with type stubs.
//!
//! Memory a caller registers is any writable, C-contiguous buffer (numpy
//! arrays, bytearrays, memoryviews): the registration holds the buffer
//! (so the memory stays valid) until the engine lets go of it, after the
//! last transfer that may touch it retired. Waits and copies release the
//! GIL.

use std::time::Duration;

use orbite_core::{
    Desc, Error, MemoryRange, Op, Permission, RegistrationId, RemoteSegment, Target, TransferEngine, TransferSpec,
    TransferStatus,
};
use pyo3::create_exception;
use pyo3::exceptions::PyException;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

create_exception!(_orbite, OrbiteError, PyException, "An error of the engine.");
create_exception!(_orbite, ConfigError, OrbiteError, "A configuration the engine refuses.");
create_exception!(_orbite, MemoryError, OrbiteError, "Memory that cannot be registered.");
create_exception!(_orbite, TransferError, OrbiteError, "A transfer the engine refuses.");
create_exception!(_orbite, PeerError_, OrbiteError, "A peer that cannot be reached or used.");
create_exception!(_orbite, ResourceExhausted, OrbiteError, "A budget of the engine is full.");
create_exception!(_orbite, Closed, OrbiteError, "The engine is closed.");

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
        _ => OrbiteError::new_err(text),
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

    /// Registers `length` bytes at address `address` of this process;
    /// `keep` is held until the engine lets go of the memory (after the
    /// last transfer that may touch it retired); `remote`: "none", "read"
    /// or "readwrite", what peers may do with it. Returns its id. The
    /// package's `Engine.register` finds the address of a buffer.
    #[pyo3(signature = (address, length, keep, remote="readwrite"))]
    fn register_address(
        &self,
        py: Python<'_>,
        address: usize,
        length: usize,
        keep: PyObject,
        remote: &str,
    ) -> PyResult<u64> {
        let permission = match remote {
            "none" => Permission::LocalOnly,
            "read" => Permission::RemoteRead,
            "readwrite" => Permission::RemoteReadWrite,
            other => return Err(MemoryError::new_err(format!("remote is none, read or readwrite, not {other:?}"))),
        };
        if address == 0 || length == 0 {
            return Err(MemoryError::new_err("a null or empty range"));
        }
        // SAFETY: the caller's promise (the package's `register` takes the
        // address of a writable buffer whose export `keep` holds); the
        // registration holds `keep` until the engine lets go of the range.
        let range = unsafe { MemoryRange::borrowed(address as *mut u8, length, permission) };
        let range = range.with_owner_release(Box::new(move || Python::with_gil(|_| drop(keep))));
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
        let t = Duration::from_secs_f64(timeout.max(0.0));
        let seg = py.allow_threads(|| self.inner.open_segment(endpoint, epoch, t)).map_err(err)?;
        Ok(Peer { seg })
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
        Ok(Transfer { inner: std::sync::Mutex::new(Some(t)) })
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

/// An opened peer.
#[pyclass(module = "orbite._orbite", frozen)]
struct Peer {
    seg: RemoteSegment,
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
}

/// A prepared transfer.
#[pyclass(module = "orbite._orbite")]
struct Transfer {
    inner: std::sync::Mutex<Option<orbite_core::Transfer>>,
}

impl Transfer {
    fn with<T>(&self, f: impl FnOnce(&orbite_core::Transfer) -> PyResult<T>) -> PyResult<T> {
        let g = self.inner.lock().map_err(|_| OrbiteError::new_err("poisoned"))?;
        let t = g.as_ref().ok_or_else(|| TransferError::new_err("the transfer was released"))?;
        f(t)
    }
}

/// A retired execution's outcome as a dict.
fn outcome(py: Python<'_>, status: TransferStatus) -> PyResult<Option<PyObject>> {
    let TransferStatus::Retired(r) = status else { return Ok(None) };
    let d = PyDict::new(py);
    d.set_item("code", format!("{:?}", r.outcome.code))?;
    d.set_item("success", r.outcome.is_success())?;
    d.set_item("transferred_prefix", r.outcome.transferred_prefix)?;
    d.set_item("transferred_bytes", r.outcome.transferred_bytes)?;
    d.set_item("total_bytes", r.outcome.total_bytes)?;
    d.set_item("remote_effect", format!("{:?}", r.outcome.remote_effect))?;
    d.set_item("execution", r.receipt.execution)?;
    Ok(Some(d.into_any().unbind()))
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
    fn check(&self, py: Python<'_>) -> PyResult<Option<PyObject>> {
        let status = self.with(|t| Ok(py.allow_threads(|| t.check())))?;
        outcome(py, status)
    }

    /// Waits (without the GIL) until the execution retired or `timeout`
    /// seconds passed: the outcome, or None.
    #[pyo3(signature = (timeout=30.0))]
    fn wait(&self, py: Python<'_>, timeout: f64) -> PyResult<Option<PyObject>> {
        let d = Duration::from_secs_f64(timeout.max(0.0));
        let status = self.with(|t| Ok(py.allow_threads(|| t.wait(d))))?;
        outcome(py, status)
    }

    /// Releases it (refused while an execution is active).
    fn release(&self) -> PyResult<()> {
        let mut g = self.inner.lock().map_err(|_| OrbiteError::new_err("poisoned"))?;
        let t = g.take().ok_or_else(|| TransferError::new_err("the transfer was released"))?;
        match t.release() {
            Ok(()) => Ok(()),
            Err(refused) => {
                let why = refused.error.to_string();
                *g = Some(refused.transfer);
                Err(TransferError::new_err(why))
            }
        }
    }
}

#[pymodule]
fn _orbite(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add_class::<Engine>()?;
    m.add_class::<Peer>()?;
    m.add_class::<Transfer>()?;
    m.add("OrbiteError", py.get_type::<OrbiteError>())?;
    m.add("ConfigError", py.get_type::<ConfigError>())?;
    m.add("MemoryError", py.get_type::<MemoryError>())?;
    m.add("TransferError", py.get_type::<TransferError>())?;
    m.add("PeerError", py.get_type::<PeerError_>())?;
    m.add("ResourceExhausted", py.get_type::<ResourceExhausted>())?;
    m.add("Closed", py.get_type::<Closed>())?;
    Ok(())
}
