//! Every refusal of the session layer, mapped once to one gRPC status code
//! and one `google.rpc.ErrorInfo` reason. This table drives the gRPC
//! server (feature `grpc`), and a test checks that docs/api.md shows the
//! same table.

use super::KvError;

/// gRPC status codes (numbering fixed by gRPC).
#[repr(i32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GrpcCode {
    /// 3: the request is wrong whatever the service's state.
    InvalidArgument = 3,
    /// 5: no such session.
    NotFound = 5,
    /// 6: the idempotency key is taken.
    AlreadyExists = 6,
    /// 8: a limit of the service is reached.
    ResourceExhausted = 8,
    /// 9: the session or the service is not in a state that allows it.
    FailedPrecondition = 9,
    /// 14: try again later (or elsewhere).
    Unavailable = 14,
}

impl GrpcCode {
    /// The code's canonical name, as gRPC spells it.
    pub fn name(self) -> &'static str {
        match self {
            GrpcCode::InvalidArgument => "INVALID_ARGUMENT",
            GrpcCode::NotFound => "NOT_FOUND",
            GrpcCode::AlreadyExists => "ALREADY_EXISTS",
            GrpcCode::ResourceExhausted => "RESOURCE_EXHAUSTED",
            GrpcCode::FailedPrecondition => "FAILED_PRECONDITION",
            GrpcCode::Unavailable => "UNAVAILABLE",
        }
    }
}

/// One row of the table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StatusRow {
    /// The [`KvError`] variant.
    pub error: &'static str,
    /// The `google.rpc.ErrorInfo` reason.
    pub reason: &'static str,
    /// The status code.
    pub code: GrpcCode,
}

const fn row(error: &'static str, reason: &'static str, code: GrpcCode) -> StatusRow {
    StatusRow { error, reason, code }
}

/// The error domain of every `ErrorInfo` the service sends.
pub const ERROR_DOMAIN: &str = "orbite.kv.v1";

/// Every [`KvError`] variant, in the order docs/api.md lists them.
pub const STATUS_TABLE: &[StatusRow] = &[
    row("MissingField", "MISSING_FIELD", GrpcCode::InvalidArgument),
    row("FieldTooLong", "FIELD_TOO_LONG", GrpcCode::InvalidArgument),
    row("InvalidValue", "INVALID_VALUE", GrpcCode::InvalidArgument),
    row("TooManyRanges", "TOO_MANY_RANGES", GrpcCode::InvalidArgument),
    row("InvalidLease", "INVALID_LEASE", GrpcCode::InvalidArgument),
    row("LeaseTooLong", "LEASE_TOO_LONG", GrpcCode::InvalidArgument),
    row("IncompatibleMetadata", "INCOMPATIBLE_METADATA", GrpcCode::InvalidArgument),
    row("IdempotencyConflict", "IDEMPOTENCY_CONFLICT", GrpcCode::AlreadyExists),
    row("UnsupportedStyle", "UNSUPPORTED_STYLE", GrpcCode::FailedPrecondition),
    row("BypassNotSupported", "BYPASS_NOT_SUPPORTED", GrpcCode::FailedPrecondition),
    row("CapabilityOff", "CAPABILITY_OFF", GrpcCode::FailedPrecondition),
    row("NotFound", "SESSION_NOT_FOUND", GrpcCode::NotFound),
    row("OtherIncarnation", "OTHER_INCARNATION", GrpcCode::NotFound),
    row("Terminal", "SESSION_ENDED", GrpcCode::FailedPrecondition),
    row("WrongState", "WRONG_STATE", GrpcCode::FailedPrecondition),
    row("SessionRequired", "SESSION_REQUIRED", GrpcCode::FailedPrecondition),
    row("Engine", "ENGINE_REFUSED", GrpcCode::FailedPrecondition),
    row("NotReady", "NOT_READY", GrpcCode::Unavailable),
    row("Draining", "DRAINING", GrpcCode::Unavailable),
    row("TooManySessions", "TOO_MANY_SESSIONS", GrpcCode::ResourceExhausted),
];

impl KvError {
    /// The variant's name, as [`STATUS_TABLE`] lists it.
    pub fn variant(&self) -> &'static str {
        match self {
            KvError::MissingField(_) => "MissingField",
            KvError::FieldTooLong { .. } => "FieldTooLong",
            KvError::InvalidValue { .. } => "InvalidValue",
            KvError::TooManyRanges { .. } => "TooManyRanges",
            KvError::InvalidLease(_) => "InvalidLease",
            KvError::LeaseTooLong { .. } => "LeaseTooLong",
            KvError::IncompatibleMetadata(_) => "IncompatibleMetadata",
            KvError::IdempotencyConflict { .. } => "IdempotencyConflict",
            KvError::UnsupportedStyle(_) => "UnsupportedStyle",
            KvError::BypassNotSupported => "BypassNotSupported",
            KvError::CapabilityOff(_) => "CapabilityOff",
            KvError::NotFound(_) => "NotFound",
            KvError::OtherIncarnation { .. } => "OtherIncarnation",
            KvError::Terminal { .. } => "Terminal",
            KvError::WrongState { .. } => "WrongState",
            KvError::SessionRequired => "SessionRequired",
            KvError::Engine(_) => "Engine",
            KvError::NotReady(_) => "NotReady",
            KvError::Draining => "Draining",
            KvError::TooManySessions { .. } => "TooManySessions",
        }
    }

    /// This error's row of [`STATUS_TABLE`].
    pub fn status(&self) -> StatusRow {
        let v = self.variant();
        *STATUS_TABLE.iter().find(|r| r.error == v).expect("every variant has a row (tested)")
    }

    /// What the `ErrorInfo` metadata names: the session, its state, the
    /// field, the limit.
    pub fn metadata(&self) -> Vec<(&'static str, String)> {
        let state = |s: &super::KvSessionState| format!("{s:?}");
        match self {
            KvError::MissingField(f) => vec![("field", (*f).to_owned())],
            KvError::FieldTooLong { field, len, max } => {
                vec![("field", (*field).to_owned()), ("len", len.to_string()), ("max", max.to_string())]
            }
            KvError::InvalidValue { field, value } => vec![("field", (*field).to_owned()), ("value", value.clone())],
            KvError::TooManyRanges { count, max } => vec![("count", count.to_string()), ("max", max.to_string())],
            KvError::InvalidLease(ms) => vec![("lease_ms", ms.to_string())],
            KvError::LeaseTooLong { requested, max } => {
                vec![("lease_ms", requested.to_string()), ("max", max.to_string())]
            }
            KvError::IncompatibleMetadata(_) => vec![],
            KvError::IdempotencyConflict { key, session } => {
                vec![("idempotency_key", key.clone()), ("session_id", session.to_string())]
            }
            KvError::UnsupportedStyle(s) => vec![("style", format!("{s:?}"))],
            KvError::CapabilityOff(c) => vec![("capability", (*c).to_owned())],
            KvError::BypassNotSupported | KvError::SessionRequired | KvError::Draining | KvError::Engine(_) => vec![],
            KvError::NotFound(id) | KvError::NotReady(id) => vec![("session_id", id.to_string())],
            KvError::OtherIncarnation { session, incarnation } => {
                vec![("session_id", session.clone()), ("incarnation", format!("{incarnation:016x}"))]
            }
            KvError::Terminal { session, state: s } => {
                vec![("session_id", session.to_string()), ("state", state(s))]
            }
            KvError::WrongState { session, state: s, op } => {
                vec![("session_id", session.to_string()), ("state", state(s)), ("op", (*op).to_owned())]
            }
            KvError::TooManySessions { limit } => vec![("limit", limit.to_string())],
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// docs/api.md's status table, row by row: (error, code, reason).
    fn documented() -> Vec<(String, String, String)> {
        let doc = include_str!("../../../docs/api.md");
        let begin = doc.find("<!-- status-table:begin -->").expect("docs/api.md has the status table");
        let end = doc.find("<!-- status-table:end -->").expect("the status table ends");
        doc[begin..end]
            .lines()
            .filter(|l| l.starts_with("| `"))
            .map(|l| {
                let cells: Vec<&str> = l.split('|').map(str::trim).collect();
                (cells[1].trim_matches('`').to_owned(), cells[2].to_owned(), cells[3].to_owned())
            })
            .collect()
    }

    #[test]
    fn docs_api_md_shows_this_table() {
        let want: Vec<(String, String, String)> =
            STATUS_TABLE.iter().map(|r| (r.error.to_owned(), r.code.name().to_owned(), r.reason.to_owned())).collect();
        assert_eq!(documented(), want, "docs/api.md's status table differs from STATUS_TABLE");
    }

    #[test]
    fn every_error_has_its_row() {
        use super::super::{KvScheduleStyle, KvSessionState, SessionId};
        let id = SessionId { incarnation: 7, seq: 1 };
        let all = [
            KvError::MissingField("f"),
            KvError::FieldTooLong { field: "f", len: 2, max: 1 },
            KvError::InvalidValue { field: "f", value: "v".into() },
            KvError::TooManyRanges { count: 2, max: 1 },
            KvError::InvalidLease(0),
            KvError::LeaseTooLong { requested: 2, max: 1 },
            KvError::IncompatibleMetadata("m".into()),
            KvError::IdempotencyConflict { key: "k".into(), session: id },
            KvError::UnsupportedStyle(KvScheduleStyle::Concurrent),
            KvError::BypassNotSupported,
            KvError::CapabilityOff("session_lookup"),
            KvError::NotFound(id),
            KvError::OtherIncarnation { session: id.to_string(), incarnation: 8 },
            KvError::Terminal { session: id, state: KvSessionState::Expired },
            KvError::WrongState { session: id, state: KvSessionState::Ready, op: "o" },
            KvError::SessionRequired,
            KvError::Engine("e".into()),
            KvError::NotReady(id),
            KvError::Draining,
            KvError::TooManySessions { limit: 1 },
        ];
        assert_eq!(all.len(), STATUS_TABLE.len());
        for (e, row) in all.iter().zip(STATUS_TABLE) {
            assert_eq!(e.status(), *row, "{e:?}");
        }
        let m = KvError::Terminal { session: id, state: KvSessionState::Expired }.metadata();
        assert_eq!(m, vec![("session_id", "0000000000000007-1".to_owned()), ("state", "Expired".to_owned())]);
    }

    #[test]
    fn every_row_names_a_distinct_variant_and_reason() {
        for (i, a) in STATUS_TABLE.iter().enumerate() {
            for b in &STATUS_TABLE[i + 1..] {
                assert_ne!(a.error, b.error);
                assert_ne!(a.reason, b.reason);
            }
        }
    }
}
