//! The wire between queue pairs: every process that makes a queue pair
//! listens on one TCP port of all its addresses, and a queue pair's
//! number carries that port (low 16 bits) and its slot in the process
//! (bits 16 to 23). A requester reaches its remote queue pair at the IPv4
//! address of the destination GID (RoCE v2 over IPv4) and the port in its
//! number, so two processes, or two network namespaces with a route
//! between them, exchange RDMA operations as two NICs would: the
//! responder checks the rkey, its access and bounds, and its queue
//! pair's state, and touches registered memory only.
//!
//! Requests go one at a time per queue pair (a requester thread), in
//! order; a failed one moves the queue pair to ERR and flushes the rest.

use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddrV4, TcpListener, TcpStream};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use crate::abi::{IbvSge, IbvWc};
use crate::verbs::*;

/// Most bytes of one message (the InfiniBand limit).
const MAX_MESSAGE: u64 = 1 << 31;

struct Fabric {
    port: u16,
    /// Queue pairs by slot (1 to 255); `Some(None)`: reserved.
    slots: Mutex<Vec<Option<Option<Arc<QpShared>>>>>,
}

fn fabric() -> Option<&'static Fabric> {
    static F: OnceLock<Option<Fabric>> = OnceLock::new();
    F.get_or_init(|| {
        let listener = TcpListener::bind("0.0.0.0:0").ok()?;
        let port = listener.local_addr().ok()?.port();
        std::thread::Builder::new().name("verbs-shim-accept".into()).spawn(move || accept(listener)).ok()?;
        Some(Fabric { port, slots: Mutex::new(vec![None; 256]) })
    })
    .as_ref()
}

/// A new queue pair number (a free slot of this process), if any.
pub fn new_qpn() -> Option<u32> {
    let f = fabric()?;
    let mut slots = f.slots.lock().unwrap_or_else(|e| e.into_inner());
    let idx = (1..256).find(|&i| slots[i].is_none())?;
    slots[idx] = Some(None);
    Some((idx as u32) << 16 | f.port as u32)
}

pub fn register(qp: &Arc<QpShared>) {
    if let Some(f) = fabric() {
        f.slots.lock().unwrap_or_else(|e| e.into_inner())[slot(qp.qpn)] = Some(Some(qp.clone()));
    }
}

pub fn unregister(qpn: u32) {
    if let Some(f) = fabric() {
        f.slots.lock().unwrap_or_else(|e| e.into_inner())[slot(qpn)] = None;
    }
}

fn slot(qpn: u32) -> usize {
    (qpn >> 16 & 0xff) as usize
}

/// The numbers of this process's queue pairs, in slot order.
pub fn live() -> Vec<u32> {
    let Some(f) = fabric() else { return Vec::new() };
    let slots = f.slots.lock().unwrap_or_else(|e| e.into_inner());
    slots.iter().flatten().flatten().map(|q| q.qpn).collect()
}

pub fn lookup(qpn: u32) -> Option<Arc<QpShared>> {
    let f = fabric()?;
    if qpn & 0xffff != f.port as u32 {
        return None;
    }
    f.slots.lock().unwrap_or_else(|e| e.into_inner())[slot(qpn)].clone().flatten()
}

/// Accepts connections from remote requesters: each names the queue pair
/// it is for, whose responder thread then serves it.
fn accept(listener: TcpListener) {
    for stream in listener.incoming() {
        let Ok(mut stream) = stream else { continue };
        let _ = stream.set_read_timeout(Some(Duration::from_secs(2)));
        let mut hello = [0u8; 8];
        if stream.read_exact(&mut hello).is_err() {
            continue;
        }
        let qpn = u32::from_le_bytes(hello[..4].try_into().unwrap_or_default());
        let Some(qp) = lookup(qpn) else { continue };
        let _ = stream.set_read_timeout(None);
        let _ = stream.set_nodelay(true);
        let Ok(clone) = stream.try_clone() else { continue };
        // Under the threads lock: ibv_destroy_qp marks the queue pair
        // destroyed before it takes this lock to join them, so a responder
        // is either refused here or joined there.
        let mut threads = qp.threads.lock().unwrap_or_else(|e| e.into_inner());
        let st = qp.st.lock().unwrap_or_else(|e| e.into_inner());
        if st.destroyed || !matches!(st.state, QPS_RTR | QPS_RTS) {
            continue;
        }
        drop(st);
        qp.streams.lock().unwrap_or_else(|e| e.into_inner()).push(clone);
        let q = qp.clone();
        if let Ok(t) = std::thread::Builder::new().name("verbs-shim-resp".into()).spawn(move || respond(&q, stream)) {
            threads.push(t);
        }
    }
}

/// Starts a queue pair's requester thread (at RTS).
pub fn start_requester(qp: &Arc<QpShared>) {
    let q = qp.clone();
    if let Ok(t) = std::thread::Builder::new().name("verbs-shim-req".into()).spawn(move || request(&q)) {
        qp.threads.lock().unwrap_or_else(|e| e.into_inner()).push(t);
    }
}

/// A request's header: op, rkey, remote address, length, immediate.
fn header(op: i32, rkey: u32, addr: u64, len: u64, imm: u32) -> [u8; 32] {
    let mut h = [0u8; 32];
    h[0..4].copy_from_slice(&op.to_le_bytes());
    h[4..8].copy_from_slice(&rkey.to_le_bytes());
    h[8..16].copy_from_slice(&addr.to_le_bytes());
    h[16..24].copy_from_slice(&len.to_le_bytes());
    h[24..28].copy_from_slice(&imm.to_le_bytes());
    h
}

fn reply(stream: &mut TcpStream, status: i32, data: &[u8]) -> std::io::Result<()> {
    let mut h = [0u8; 16];
    h[0..4].copy_from_slice(&status.to_le_bytes());
    h[8..16].copy_from_slice(&(data.len() as u64).to_le_bytes());
    stream.write_all(&h)?;
    stream.write_all(data)
}

/// Copies `data` out to the local entries `sges` (writable, in `pd`):
/// false if one is not.
fn scatter(sges: &[IbvSge], pd: usize, data: &[u8]) -> bool {
    let r = regions().read().unwrap_or_else(|e| e.into_inner());
    let Some(found) = sges.iter().map(|s| r.local(s, pd, true)).collect::<Option<Vec<_>>>() else { return false };
    let mut at = 0usize;
    for (s, region) in sges.iter().zip(found) {
        let n = (s.length as usize).min(data.len() - at);
        // SAFETY: inside a registered, writable region (checked above),
        // which stays registered while the read lock is held.
        unsafe { std::ptr::copy_nonoverlapping(data[at..].as_ptr(), region.at(s.addr), n) };
        at += n;
    }
    true
}

/// The bytes of the local entries `sges` (in `pd`); `None` if one is not
/// registered.
fn gather(sges: &[IbvSge], pd: usize) -> Option<Vec<u8>> {
    let r = regions().read().unwrap_or_else(|e| e.into_inner());
    let mut out = Vec::with_capacity(sges.iter().map(|s| s.length as usize).sum());
    for s in sges {
        let region = r.local(s, pd, false)?;
        // SAFETY: inside a registered region (checked), registered while
        // the read lock is held.
        out.extend_from_slice(unsafe { std::slice::from_raw_parts(region.at(s.addr), s.length as usize) });
    }
    Some(out)
}

/// The requester: takes posted sends in order, runs each against the
/// remote queue pair, and completes it.
fn request(qp: &Arc<QpShared>) {
    let mut conn: Option<TcpStream> = None;
    loop {
        let (wr, state, dest, port, ack) = {
            let mut st = qp.st.lock().unwrap_or_else(|e| e.into_inner());
            loop {
                if st.destroyed {
                    return;
                }
                if let Some(wr) = st.sends.pop_front() {
                    break (wr, st.state, st.dest, st.port, st.ack_timeout);
                }
                st = qp.work.wait(st).unwrap_or_else(|e| e.into_inner());
            }
        };
        let opcode = match wr.opcode {
            WR_RDMA_READ => WC_RDMA_READ,
            WR_SEND | WR_SEND_WITH_IMM => WC_SEND,
            _ => WC_RDMA_WRITE,
        };
        let complete = |status: i32, byte_len: u32| {
            if wr.signaled || status != WC_SUCCESS {
                qp.complete_send(IbvWc {
                    wr_id: wr.wr_id,
                    status,
                    opcode,
                    byte_len,
                    qp_num: qp.qpn,
                    ..Default::default()
                });
            }
        };
        if state == QPS_ERR {
            complete(WC_WR_FLUSH_ERR, 0);
            continue;
        }
        let (injected, delay) = {
            let mut f = qp.faults.lock().unwrap_or_else(|e| e.into_inner());
            (f.next_error.take(), f.delay_ms)
        };
        if delay > 0 {
            std::thread::sleep(Duration::from_millis(delay as u64));
        }
        // A port that is down loses every request, as a link that is gone.
        let lost = (port > 0 && qp.port_down(port)).then_some(WC_RETRY_EXC_ERR);
        let result = match injected.or(lost) {
            Some(status) => Err(status),
            None => execute(qp, &mut conn, &wr, dest, ack),
        };
        let status = match result {
            Ok(n) => {
                qp.executed.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                complete(WC_SUCCESS, n);
                continue;
            }
            Err(status) => status,
        };
        complete(status, 0);
        if let Some(c) = conn.take() {
            let _ = c.shutdown(std::net::Shutdown::Both);
        }
        let mut st = qp.st.lock().unwrap_or_else(|e| e.into_inner());
        qp.to_error(&mut st);
    }
}

/// One request: the bytes it moved, or its completion status.
fn execute(
    qp: &QpShared,
    conn: &mut Option<TcpStream>,
    wr: &SendWr,
    dest: Option<(Ipv4Addr, u32)>,
    ack: Option<Duration>,
) -> Result<u32, i32> {
    let total: u64 = wr.sges.iter().map(|s| s.length as u64).sum();
    if total > MAX_MESSAGE {
        return Err(WC_LOC_LEN_ERR);
    }
    let read = wr.opcode == WR_RDMA_READ;
    // Local entries first: a bad lkey fails before anything is sent.
    let data = if read {
        let r = regions().read().unwrap_or_else(|e| e.into_inner());
        if wr.sges.iter().any(|s| r.local(s, qp.pd, true).is_none()) {
            return Err(WC_LOC_PROT_ERR);
        }
        Vec::new()
    } else {
        gather(&wr.sges, qp.pd).ok_or(WC_LOC_PROT_ERR)?
    };
    let lost = |_| WC_RETRY_EXC_ERR;
    if conn.is_none() {
        let (ip, dqpn) = dest.ok_or(WC_RETRY_EXC_ERR)?;
        let addr = SocketAddrV4::new(ip, (dqpn & 0xffff) as u16);
        let mut s = TcpStream::connect_timeout(&addr.into(), Duration::from_secs(2)).map_err(lost)?;
        let _ = s.set_nodelay(true);
        let mut hello = [0u8; 8];
        hello[..4].copy_from_slice(&dqpn.to_le_bytes());
        hello[4..].copy_from_slice(&qp.qpn.to_le_bytes());
        s.write_all(&hello).map_err(lost)?;
        if let Ok(c) = s.try_clone() {
            qp.streams.lock().unwrap_or_else(|e| e.into_inner()).push(c);
        }
        *conn = Some(s);
    }
    let s = conn.as_mut().ok_or(WC_RETRY_EXC_ERR)?;
    // A request unanswered (the peer or its link gone) within the queue
    // pair's transport timeout and retries fails with retry exceeded; its
    // bytes' own time on the wire is allowed for (as a NIC acks per
    // packet), at 1 GB/s at least.
    let allowed = ack.map(|a| a + Duration::from_nanos(total));
    let _ = s.set_read_timeout(allowed);
    let _ = s.set_write_timeout(allowed);
    s.write_all(&header(wr.opcode, wr.rkey, wr.remote_addr, total, wr.imm)).map_err(lost)?;
    s.write_all(&data).map_err(lost)?;
    let mut h = [0u8; 16];
    s.read_exact(&mut h).map_err(lost)?;
    let status = i32::from_le_bytes(h[0..4].try_into().unwrap_or_default());
    let len = u64::from_le_bytes(h[8..16].try_into().unwrap_or_default());
    let mut back = vec![0u8; len.min(MAX_MESSAGE) as usize];
    s.read_exact(&mut back).map_err(lost)?;
    if status != WC_SUCCESS {
        return Err(status);
    }
    if read && !scatter(&wr.sges, qp.pd, &back) {
        return Err(WC_LOC_PROT_ERR);
    }
    Ok(total as u32)
}

/// The responder of one connection: checks and serves each request.
fn respond(qp: &Arc<QpShared>, mut stream: TcpStream) {
    loop {
        let mut h = [0u8; 32];
        if stream.read_exact(&mut h).is_err() {
            return;
        }
        let op = i32::from_le_bytes(h[0..4].try_into().unwrap_or_default());
        let rkey = u32::from_le_bytes(h[4..8].try_into().unwrap_or_default());
        let addr = u64::from_le_bytes(h[8..16].try_into().unwrap_or_default());
        let len = u64::from_le_bytes(h[16..24].try_into().unwrap_or_default());
        let imm = u32::from_le_bytes(h[24..28].try_into().unwrap_or_default());
        if len > MAX_MESSAGE {
            let _ = reply(&mut stream, WC_REM_INV_REQ_ERR, &[]);
            return;
        }
        let mut data = Vec::new();
        if op != WR_RDMA_READ {
            data = vec![0u8; len as usize];
            if stream.read_exact(&mut data).is_err() {
                return;
            }
        }
        let (status, back) = serve(qp, op, rkey, addr, len, imm, &data);
        if status == WC_REM_ACCESS_ERR || status == WC_REM_INV_REQ_ERR {
            // A responder's error moves its queue pair to ERR too.
            let mut st = qp.st.lock().unwrap_or_else(|e| e.into_inner());
            qp.to_error(&mut st);
        }
        if reply(&mut stream, status, &back).is_err() {
            return;
        }
    }
}

/// One request at the responder: its status and, for a READ, the bytes.
fn serve(qp: &QpShared, op: i32, rkey: u32, addr: u64, len: u64, imm: u32, data: &[u8]) -> (i32, Vec<u8>) {
    let access = qp.st.lock().unwrap_or_else(|e| e.into_inner()).access;
    let denied = (WC_REM_ACCESS_ERR, Vec::new());
    match op {
        WR_RDMA_WRITE | WR_RDMA_WRITE_WITH_IMM => {
            {
                let r = regions().read().unwrap_or_else(|e| e.into_inner());
                let Some(region) = r.remote(rkey, addr, len, ACCESS_REMOTE_WRITE, qp.pd) else { return denied };
                if access & ACCESS_REMOTE_WRITE == 0 {
                    return denied;
                }
                // SAFETY: inside a registered region with remote write
                // access (checked under this lock, which keeps it).
                unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), region.at(addr), data.len()) };
            }
            if op == WR_RDMA_WRITE_WITH_IMM {
                return (receive(qp, &[], Some(imm), WC_RECV_RDMA_WITH_IMM, len), Vec::new());
            }
            (WC_SUCCESS, Vec::new())
        }
        WR_RDMA_READ => {
            let r = regions().read().unwrap_or_else(|e| e.into_inner());
            let Some(region) = r.remote(rkey, addr, len, ACCESS_REMOTE_READ, qp.pd) else { return denied };
            if access & ACCESS_REMOTE_READ == 0 {
                return denied;
            }
            // SAFETY: inside a registered region with remote read access,
            // registered while the read lock is held.
            (WC_SUCCESS, unsafe { std::slice::from_raw_parts(region.at(addr), len as usize) }.to_vec())
        }
        WR_SEND | WR_SEND_WITH_IMM => {
            let imm = (op == WR_SEND_WITH_IMM).then_some(imm);
            (receive(qp, data, imm, WC_RECV, len), Vec::new())
        }
        _ => (WC_REM_INV_REQ_ERR, Vec::new()),
    }
}

/// Consumes a posted receive for a SEND (its bytes `data`) or a WRITE
/// with immediate: the status for the requester. With none posted it
/// waits a little (RNR retries), then fails the request.
fn receive(qp: &QpShared, data: &[u8], imm: Option<u32>, opcode: i32, len: u64) -> i32 {
    let mut recv = None;
    for _ in 0..50 {
        let mut st = qp.st.lock().unwrap_or_else(|e| e.into_inner());
        if st.state == QPS_ERR || st.destroyed {
            return WC_REM_OP_ERR;
        }
        if let Some(r) = st.recvs.pop_front() {
            recv = Some(r);
            break;
        }
        drop(st);
        std::thread::sleep(Duration::from_millis(10));
    }
    let Some(r) = recv else { return WC_RNR_RETRY_EXC_ERR };
    let room: u64 = r.sges.iter().map(|s| s.length as u64).sum();
    let mut wc = IbvWc { wr_id: r.wr_id, opcode, byte_len: len as u32, qp_num: qp.qpn, ..Default::default() };
    if let Some(imm) = imm {
        wc.imm_data = imm;
        wc.wc_flags = WC_WITH_IMM;
    }
    let status = if (data.len() as u64) > room {
        wc.status = WC_LOC_LEN_ERR;
        WC_REM_INV_REQ_ERR
    } else if !scatter(&r.sges, qp.pd, data) {
        wc.status = WC_LOC_PROT_ERR;
        WC_REM_OP_ERR
    } else {
        WC_SUCCESS
    };
    qp.recv_cq().push(wc);
    status
}
