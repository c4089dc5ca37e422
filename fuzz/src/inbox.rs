//! Inbox ring entries: the same-host notification inbox, whose header and
//! ring every same-host sender can write, read by its owner as untrusted
//! input (`orbite_core::fuzzing::InboxBuffer` over a private buffer).
//!
//! Input: the inbox's geometry and limits, then operations: append (as
//! the owner's view, or as a sender that opens the header it finds),
//! drain, overwrite bytes or words of the header and ring as a hostile
//! sender would, and initialise again. While nobody has written the
//! buffer behind the inbox's back, a model predicts every append's outcome
//! and every drained envelope (first in, first out, nothing lost, nothing
//! twice). After a hostile write, only what must hold for any bytes is
//! checked: drained payloads within the limit, and no more envelopes out
//! of one drain than the ring can hold.

use std::collections::VecDeque;

use orbite_core::fuzzing::{INBOX_HEADER, InboxBuffer, InboxEnvelope};

use crate::input::{Input, Seed};

const EPOCH: u64 = 7;

/// Bytes an entry takes: length, epochs, endpoint, payload, padding.
fn need(e: &InboxEnvelope) -> u64 {
    (4 + 8 + 8 + 2 + e.sender_endpoint.len() + 4 + e.payload.len()).next_multiple_of(8) as u64
}

struct Model {
    /// False once the buffer was written behind the inbox's back.
    valid: bool,
    queue: VecDeque<InboxEnvelope>,
    used: u64,
    capacity: u64,
    max_payload: u64,
    budget: u64,
}

impl Model {
    fn fresh(capacity: u64, max_payload: u64, budget: u64) -> Self {
        Model { valid: true, queue: VecDeque::new(), used: 0, capacity, max_payload, budget }
    }

    fn accepts(&self, e: &InboxEnvelope) -> bool {
        let n = need(e);
        let room = self.capacity.min(self.budget);
        n <= self.capacity / 2 && e.payload.len() as u64 <= self.max_payload && n <= room && self.used + n <= room
    }
}

fn envelope(input: &mut Input<'_>) -> InboxEnvelope {
    let sender_epoch = input.u8() as u64;
    let target_epoch = if input.bool() { EPOCH } else { input.u64() };
    let ep = input.u8() as usize % 64;
    let sender_endpoint = String::from_utf8_lossy(input.bytes(ep)).into_owned();
    let n = input.u16() as usize % 3000;
    let mut payload = input.bytes(n).to_vec();
    payload.resize(n, 0xa5);
    InboxEnvelope { sender_epoch, target_epoch, sender_endpoint, payload }
}

pub fn run(data: &[u8]) {
    let mut input = Input::new(data);
    let ring = 4096 * (1 + input.u8() as usize % 4);
    let max_payload = input.u16() as u64;
    let budget = [u64::MAX, 4096, 600][input.u8() as usize % 3];
    let mut inbox = InboxBuffer::new(ring, EPOCH, max_payload, budget);
    let capacity = (inbox.len() - INBOX_HEADER) as u64;
    let mut model = Model::fresh(capacity, max_payload, budget);
    while !input.is_empty() {
        match input.u8() % 6 {
            0 => {
                let e = envelope(&mut input);
                let ok = inbox.append(&e);
                crate::trace(format_args!(
                    "append need {} payload {} -> {ok}, model used {}",
                    need(&e),
                    e.payload.len(),
                    model.used
                ));
                if model.valid {
                    assert_eq!(ok, model.accepts(&e), "append refuses exactly what the limits refuse");
                }
                if ok && model.valid {
                    model.used += need(&e);
                    model.queue.push_back(e);
                }
            }
            1 => {
                let epoch = if input.bool() { EPOCH } else { input.u64() };
                let e = envelope(&mut input);
                let r = inbox.open_and_append(epoch, &e);
                crate::trace(format_args!("open {epoch} need {} -> {r:?}, model used {}", need(&e), model.used));
                if model.valid {
                    assert_eq!(r.is_some(), epoch == EPOCH, "a sender opens the inbox of the epoch it names");
                    if let Some(ok) = r {
                        assert_eq!(ok, model.accepts(&e), "a sender's append refuses what the limits refuse");
                        if ok {
                            model.used += need(&e);
                            model.queue.push_back(e);
                        }
                    }
                }
            }
            2 => {
                let max = input.u16() as usize;
                let decline_after = input.u8() as usize;
                drain(&inbox, &mut model, max, decline_after);
                crate::trace(format_args!(
                    "drain {max} {decline_after}: model {} left, used {}",
                    model.queue.len(),
                    model.used
                ));
            }
            3 => {
                let at = input.u16() as usize % inbox.len();
                let bytes = input.chunk(16);
                let buf = inbox.bytes_mut();
                let n = bytes.len().min(buf.len() - at);
                buf[at..at + n].copy_from_slice(&bytes[..n]);
                model.valid = false;
                crate::trace(format_args!("poke {at} {bytes:?}"));
            }
            4 => {
                // Whole words of the header (positions, lock, limits) and
                // the ring's first words.
                let word = input.u8() as usize % (INBOX_HEADER / 8 + 4);
                let value = input.u64();
                inbox.bytes_mut()[word * 8..word * 8 + 8].copy_from_slice(&value.to_le_bytes());
                crate::trace(format_args!("word {word} = {value:#x}"));
                model.valid = false;
            }
            _ => {
                crate::trace(format_args!("reinit"));
                inbox.reinit(EPOCH, max_payload, budget);
                model = Model::fresh(capacity, max_payload, budget);
            }
        }
    }
    if model.valid {
        drain(&inbox, &mut model, usize::MAX, usize::MAX);
        assert!(model.queue.is_empty() && !inbox.has_entries(), "a full drain empties the inbox");
    }
}

fn drain(inbox: &InboxBuffer, model: &mut Model, max: usize, decline_after: usize) {
    let mut taken = 0usize;
    let mut bytes = 0u64;
    let mut overrun = false;
    let mut mismatch = None;
    inbox.drain(max, |e| {
        assert!(e.payload.len() <= max, "a drained payload is within the drain's limit");
        bytes += need(&e);
        if bytes > model.capacity {
            // More than the ring holds out of one drain: the consumer is
            // reading bytes it has read before.
            overrun = true;
            return false;
        }
        if taken >= decline_after {
            return false;
        }
        taken += 1;
        if model.valid {
            let expected = model.queue.pop_front();
            if expected.as_ref() != Some(&e) && mismatch.is_none() {
                mismatch = Some((expected, e));
            }
        }
        true
    });
    assert!(!overrun, "Inbox::drain gave more envelopes in one drain than its ring can hold");
    if let Some((expected, got)) = mismatch {
        panic!("drained {got:?}, the model expected {expected:?}");
    }
    if model.valid {
        // An envelope over the drain's limit does not parse: the rest of
        // the ring is dropped with it.
        if model.queue.front().is_some_and(|e| e.payload.len() > max) {
            model.queue.clear();
        }
        if model.queue.is_empty() {
            model.used = 0;
        } else {
            model.used = model.queue.iter().map(need).sum();
        }
    }
}

fn append(s: &mut Seed, sender: &str, payload: &[u8]) {
    s.u8(0).u8(1).u8(1).u8(sender.len() as u8).bytes(sender.as_bytes()).u16(payload.len() as u16).bytes(payload);
}

pub fn seeds() -> Vec<Vec<u8>> {
    let mut seeds = Vec::new();
    // Appends and drains that wrap the ring.
    let mut s = Seed::new();
    s.u8(0).u16(4096).u8(0);
    for i in 0..12u8 {
        append(&mut s, "127.0.0.1:4000", &[i; 700]);
        s.u8(2).u16(4096).u8(if i % 3 == 0 { 0 } else { 255 });
    }
    seeds.push(s.done());
    // A sender that opens the header, then a hostile tail word and a drain.
    let mut s = Seed::new();
    s.u8(1).u16(1024).u8(1);
    s.u8(1).u8(1);
    s.u8(3).u8(1).u8(1).bytes(b"s").u16(10).bytes(b"0123456789");
    append(&mut s, "h:1", b"payload");
    s.u8(4).u8(6).u64(1 << 40).u8(2).u16(1024).u8(255);
    seeds.push(s.done());
    // A corrupt length field, then reinit and a round trip.
    let mut s = Seed::new();
    s.u8(0).u16(100).u8(0);
    append(&mut s, "x", b"abc");
    s.u8(3).u16(INBOX_HEADER as u16).chunk(&[0xff, 0xff]).u8(2).u16(100).u8(255);
    s.u8(5);
    append(&mut s, "x", b"again");
    s.u8(2).u16(100).u8(255);
    seeds.push(s.done());
    seeds
}
