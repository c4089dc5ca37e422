//! The peer protocol as state machines (sans-IO, in the manner of
//! quinn-proto): they take bytes and events and say what to send and what
//! completed; they own no socket or thread and read no clock. `tcp` drives
//! them over sockets.

pub(crate) mod client;
pub(crate) mod server;
