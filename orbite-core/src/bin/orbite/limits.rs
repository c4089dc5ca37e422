//! The machine's limits, measured in the run beside the routes: copying
//! with as many threads as the route has workers, one process_vm_writev
//! loop, one and N loopback TCP streams, and the raw TCP round trip of a
//! 4 KiB write answered by 16 bytes. Every data row of `orbite bench` is
//! reported against one of them (`x_limit`).

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

use orbite_core::{HostMemory, Op};

use crate::error::{Doing, Error};
use crate::measure::{memcpy_blocks, timed};
use crate::rig::MIB;

/// Splits `blocks` into `parts` runs of consecutive blocks with about the
/// same bytes each (never an empty run unless there are fewer blocks).
pub fn split_even(blocks: &[(u64, u64, u64)], parts: usize) -> Vec<&[(u64, u64, u64)]> {
    let total: u64 = blocks.iter().map(|b| b.2).sum();
    let parts = parts.max(1) as u64;
    let mut out = Vec::new();
    let (mut start, mut acc) = (0usize, 0u64);
    for (i, b) in blocks.iter().enumerate() {
        acc += b.2;
        let cut = total * (out.len() as u64 + 1) / parts;
        if acc >= cut && (out.len() as u64) < parts - 1 {
            out.push(&blocks[start..=i]);
            start = i + 1;
        }
    }
    if start < blocks.len() || out.is_empty() {
        out.push(&blocks[start..]);
    }
    out
}

/// Copies `blocks` (`(src_off, dst_off, len)`) from `src` to `dst` with
/// `threads` threads, each taking one run of consecutive blocks, one
/// `memcpy` per block ([`memcpy_blocks`]): the copy limit of a route with
/// that many workers. Returns seconds.
pub fn memcpy_threads(src: &HostMemory, dst: &HostMemory, blocks: &[(u64, u64, u64)], threads: usize) -> f64 {
    let runs = split_even(blocks, threads);
    let start = Instant::now();
    std::thread::scope(|s| {
        let mut runs = runs.into_iter();
        let mine = runs.next().unwrap_or(&[]);
        for run in runs {
            s.spawn(move || memcpy_blocks(src, dst, run));
        }
        memcpy_blocks(src, dst, mine);
    });
    start.elapsed().as_secs_f64()
}

/// One `process_vm_writev` (or `readv`) loop, one thread, up to 1024 iovecs
/// per call: `blocks` are `(local_off, remote_addr, len)`, local offsets
/// into `local`, remote addresses in process `pid`. Returns seconds, or an
/// error if the kernel refused or moved less.
pub fn cma_loop(pid: i32, op: Op, local: &HostMemory, blocks: &[(u64, u64, u64)]) -> Result<f64, Error> {
    let base = local.as_ptr() as usize;
    let start = Instant::now();
    for chunk in blocks.chunks(1024) {
        let l: Vec<libc::iovec> = chunk
            .iter()
            .map(|&(o, _, n)| libc::iovec { iov_base: (base + o as usize) as *mut libc::c_void, iov_len: n as usize })
            .collect();
        let r: Vec<libc::iovec> = chunk
            .iter()
            .map(|&(_, a, n)| libc::iovec { iov_base: a as *mut libc::c_void, iov_len: n as usize })
            .collect();
        let want: u64 = chunk.iter().map(|b| b.2).sum();
        // SAFETY: local iovecs address the bench's own live allocation in
        // bounds; remote ones are checked by the kernel.
        let got = unsafe {
            match op {
                Op::Write => libc::process_vm_writev(pid, l.as_ptr(), l.len() as u64, r.as_ptr(), r.len() as u64, 0),
                Op::Read => libc::process_vm_readv(pid, l.as_ptr(), l.len() as u64, r.as_ptr(), r.len() as u64, 0),
            }
        };
        if got < 0 || got as u64 != want {
            let source = std::io::Error::last_os_error();
            return Err(Error::ProcessVm { op, moved: got, wanted: want, source });
        }
    }
    Ok(start.elapsed().as_secs_f64())
}

/// [`cma_loop`] with `threads` threads, each taking one run of
/// consecutive blocks: what the kernel's cross-memory copy reaches with as
/// many threads as the route has workers. Returns seconds.
pub fn cma_threads(
    pid: i32,
    op: Op,
    local: &HostMemory,
    blocks: &[(u64, u64, u64)],
    threads: usize,
) -> Result<f64, Error> {
    let runs = split_even(blocks, threads);
    let start = Instant::now();
    std::thread::scope(|s| {
        let mut runs = runs.into_iter();
        let mine = runs.next().unwrap_or(&[]);
        let others: Vec<_> = runs.map(|run| s.spawn(move || cma_loop(pid, op, local, run))).collect();
        cma_loop(pid, op, local, mine)?;
        others.into_iter().try_for_each(|h| h.join().map_err(|_| Error::Panicked("a copy thread"))?.map(drop))
    })?;
    Ok(start.elapsed().as_secs_f64())
}

/// `streams` loopback TCP streams in parallel, each writing 1 MiB buffers
/// with blocking I/O for `dur`, each read by its own thread. Returns the
/// bytes all receivers got per second (1e9 = 1 GB/s) and whether every
/// byte sent arrived.
///
/// With `region` 0 every stream sends one 1 MiB buffer over and over and
/// reads into another, so both stay in cache: the most loopback TCP moves
/// here. With `region` > 0 the streams share out `region` bytes of
/// distinct memory on each side and cycle through their slices, as a
/// route moving a workload of that size does: past the last-level cache
/// the kernel's copies then go to memory.
pub fn tcp_streams(streams: usize, dur: Duration, region: u64) -> Result<(f64, bool), Error> {
    let slice = (region / streams.max(1) as u64 / MIB).max(1) * MIB;
    let listener = TcpListener::bind("127.0.0.1:0").doing("listen on loopback")?;
    let addr = listener.local_addr().doing("read the loopback listener's address")?;
    let mut senders = Vec::new();
    let mut readers = Vec::new();
    for _ in 0..streams {
        let c = TcpStream::connect(addr).doing("connect a loopback stream")?;
        let (s, _) = listener.accept().doing("accept a loopback stream")?;
        readers.push(std::thread::spawn(move || -> std::io::Result<(u64, Instant)> {
            let mut s = s;
            // Touched up front, so that no page fault is timed.
            let mut buf = vec![1u8; slice as usize];
            let (mut got, mut at) = (0u64, 0usize);
            loop {
                let end = (at + MIB as usize).min(buf.len());
                let n = s.read(&mut buf[at..end])?;
                if n == 0 {
                    return Ok((got, Instant::now()));
                }
                got += n as u64;
                at = if at + n == buf.len() { 0 } else { at + n };
            }
        }));
        senders.push(c);
    }
    let start = Instant::now();
    let writers: Vec<_> = senders
        .into_iter()
        .map(|mut c| {
            std::thread::spawn(move || -> std::io::Result<u64> {
                let buf = vec![0x5Au8; slice as usize];
                let (mut sent, mut at) = (0u64, 0usize);
                while start.elapsed() < dur {
                    c.write_all(&buf[at..at + MIB as usize])?;
                    sent += MIB;
                    at = (at + MIB as usize) % buf.len();
                }
                Ok(sent)
            })
        })
        .collect();
    let mut sent = 0u64;
    for w in writers {
        sent += w.join().map_err(|_| Error::Panicked("a sender"))?.doing("send on a loopback stream")?;
    }
    let (mut got, mut end) = (0u64, start);
    for r in readers {
        let (n, at) = r.join().map_err(|_| Error::Panicked("a receiver"))?.doing("receive on a loopback stream")?;
        got += n;
        end = end.max(at);
    }
    Ok((got as f64 / (end - start).as_secs_f64(), got == sent))
}

/// The raw TCP round trip over loopback: a 4 KiB write answered by 16
/// bytes, TCP_NODELAY on both ends, blocking I/O, `iters` times after a
/// warm-up. Returns the samples in seconds.
pub fn round_trips(iters: usize) -> Result<Vec<f64>, Error> {
    let listener = TcpListener::bind("127.0.0.1:0").doing("listen on loopback")?;
    let addr = listener.local_addr().doing("read the loopback listener's address")?;
    let server = std::thread::spawn(move || -> std::io::Result<()> {
        let (mut s, _) = listener.accept()?;
        s.set_nodelay(true)?;
        let mut req = [0u8; 4096];
        loop {
            if let Err(e) = s.read_exact(&mut req) {
                return if e.kind() == std::io::ErrorKind::UnexpectedEof { Ok(()) } else { Err(e) };
            }
            s.write_all(&req[..16])?;
        }
    });
    let mut c = TcpStream::connect(addr).doing("connect to the echo server")?;
    c.set_nodelay(true).doing("set TCP_NODELAY")?;
    let req = [0xA5u8; 4096];
    let mut answer = [0u8; 16];
    let samples = timed(iters, || {
        let t0 = Instant::now();
        c.write_all(&req).doing("send a request to the echo server")?;
        c.read_exact(&mut answer).doing("read the echo server's answer")?;
        Ok(t0.elapsed().as_secs_f64())
    })?;
    drop(c);
    server.join().map_err(|_| Error::Panicked("the echo server"))?.doing("run the echo server")?;
    Ok(samples)
}

/// Peak resident memory of this process (VmHWM), in bytes.
pub fn peak_rss() -> u64 {
    status_kib("VmHWM:") * 1024
}

fn status_kib(key: &str) -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| s.lines().find(|l| l.starts_with(key)).and_then(|l| l.split_whitespace().nth(1)?.parse().ok()))
        .unwrap_or(0)
}

/// Starts a new peak: the kernel sets VmHWM back to the current resident
/// size (`clear_refs` 5). False if it refused.
pub fn reset_peak_rss() -> bool {
    std::fs::write("/proc/self/clear_refs", "5").is_ok()
}

#[cfg(test)]
mod tests {
    use super::split_even;

    #[test]
    fn runs_cover_every_block_once_with_even_bytes() {
        let blocks: Vec<(u64, u64, u64)> = (0..64).map(|i| (i * 16, i * 16, 16)).collect();
        let runs = split_even(&blocks, 2);
        assert_eq!(runs.iter().map(|r| r.len()).collect::<Vec<_>>(), [32, 32]);
        let one = [(0u64, 0u64, 1u64 << 20)];
        assert_eq!(split_even(&one, 4).concat(), one);
        assert_eq!(split_even(&[], 2).concat(), []);
        let odd: Vec<(u64, u64, u64)> = (0..5).map(|i| (i, i, 1)).collect();
        assert_eq!(split_even(&odd, 3).concat(), odd);
    }
}
