//! Notification envelopes, in every form one takes: the wire's
//! `NotifyEnvelope` (a Notify frame's body), the C ABI's drained buffer that
//! `orbite_notif_next` walks, and the NIXL plugin's own envelope
//! ("ONF1", agent name, payload) that rides inside the payload.
//!
//! Input: any bytes, given to all three parsers; whatever one accepts must
//! encode back to the same bytes, and a walk of a drained buffer must stay
//! inside it and end exactly at its end or at a refusal.

use orbite_core::wire::{self, NotifyEnvelope};
use orbite_nixl::{ORBITE_RECORD_VERSION, OrbiteNotifView, OrbiteStatus, orbite_notif_next};

use crate::input::Seed;
use crate::plugin::{self, Outcome};

pub fn run(data: &[u8]) {
    let h = wire::header(wire::Kind::Notify, data.len(), 0, 1);
    if let Ok(wire::Message::Notify(env)) = wire::Message::decode(&h, data) {
        let mut out = Vec::new();
        wire::encode_notify(&mut out, &env);
        assert_eq!(out, data, "notify round trip");
        assert!(env.sender_endpoint.len() <= u16::MAX as usize);
    }
    walk(data);
    plugin_envelope(data);
}

/// Walks a drained-notification buffer with `orbite_notif_next`.
pub(crate) fn walk(buf: &[u8]) {
    let mut offset = 0u64;
    // Each step takes at least the 16-byte header: a walk that takes more
    // steps than that has gone around in a circle.
    for _ in 0..=buf.len() / 16 + 1 {
        let mut view = OrbiteNotifView {
            size: size_of::<OrbiteNotifView>() as u32,
            version: ORBITE_RECORD_VERSION,
            sender_epoch: 0,
            sender: std::ptr::null(),
            sender_len: 0,
            payload: std::ptr::null(),
            payload_len: 0,
        };
        let before = offset;
        // SAFETY: `buf` is readable for its length, `offset` and `view` are
        // live locals (the view's size and version set); none overlap.
        let s = unsafe { orbite_notif_next(buf.as_ptr(), buf.len(), &mut offset, &mut view) };
        match s {
            OrbiteStatus::Ok => {
                let start = buf.as_ptr() as usize;
                let end = start + buf.len();
                let inside = |p: *const u8, n: u64| (p as usize) >= start && (p as usize) + n as usize <= end;
                assert!(inside(view.sender, view.sender_len), "the sender points into the buffer");
                assert!(inside(view.payload, view.payload_len), "the payload points into the buffer");
                assert_eq!(offset, before + 16 + view.sender_len + view.payload_len, "the offset advances by one");
                assert!(offset as usize <= buf.len());
            }
            OrbiteStatus::NotFound => {
                assert_eq!(offset as usize, buf.len(), "the walk ends at the end");
                return;
            }
            OrbiteStatus::InvalidArgument => {
                assert_eq!(offset, before, "a refusal does not move the offset");
                return;
            }
            s => panic!("orbite_notif_next returned {s:?}"),
        }
    }
    panic!("orbite_notif_next did not finish a walk of {} bytes", buf.len());
}

/// The plugin's envelope: unwrap, and wrap back.
fn plugin_envelope(data: &[u8]) {
    match plugin::unwrap_notification(data) {
        None => {}
        Some(Outcome::Threw) => panic!("the plugin's unwrapNotification threw"),
        Some(Outcome::Returned(None)) => {}
        Some(Outcome::Returned(Some((agent, payload)))) => {
            assert_eq!(6 + agent + payload, data.len(), "unwrap accounts for every byte");
            let rewrapped = plugin::wrap_notification(&data[6..6 + agent], &data[6 + agent..]);
            assert_eq!(rewrapped.as_deref(), Some(data), "the plugin's envelope round trip");
        }
    }
}

/// A buffer as `orbite_notifs_drain` writes it.
fn drained(items: &[(u64, &[u8], &[u8])]) -> Vec<u8> {
    let mut out = Vec::new();
    for (epoch, sender, payload) in items {
        out.extend_from_slice(&epoch.to_ne_bytes());
        out.extend_from_slice(&(sender.len() as u32).to_ne_bytes());
        out.extend_from_slice(&(payload.len() as u32).to_ne_bytes());
        out.extend_from_slice(sender);
        out.extend_from_slice(payload);
    }
    out
}

pub fn seeds() -> Vec<Vec<u8>> {
    let mut seeds = Vec::new();
    let mut body = Vec::new();
    let env = NotifyEnvelope { sender_endpoint: "10.0.0.2:4000", sender_epoch: 1, target_epoch: 2, payload: b"done" };
    wire::encode_notify(&mut body, &env);
    seeds.push(body.clone());
    let env = NotifyEnvelope { sender_endpoint: "", sender_epoch: 0, target_epoch: 0, payload: &[0, 255, 1] };
    wire::encode_notify(&mut body, &env);
    seeds.push(body);
    seeds.push(drained(&[(5, b"127.0.0.1:1", b"first"), (6, b"", b""), (7, b"h:2", &[0xff; 40])]));
    let envelope = plugin::wrap_notification(b"agent-a", b"kv ready").unwrap_or_else(|| {
        // The plugin's documented layout, for a build without it.
        Seed::new().bytes(b"ONF1").u16(7).bytes(b"agent-a").bytes(b"kv ready").done()
    });
    seeds.push(envelope);
    seeds
}
