//! Little-endian bytes: the one bounds-checked reader, and the writer
//! helpers, that every codec of OrbiTE shares (the wire frames, segment
//! descriptors and deltas, the same-host inbox, the C ABI's metadata).
//!
//! Nothing here panics on any input: every read checks that the bytes are
//! there (with checked arithmetic) and returns [`Short`] when they are not,
//! which each codec maps to its own error. The reader allocates nothing and
//! is meant for hot paths too.
//!
//! A leaf module: it imports nothing of the crate.
//!
//! ```
//! use orbite_core::codec::{self, Reader, Short};
//!
//! let mut out = Vec::new();
//! codec::put_u16(&mut out, 7);
//! codec::put_u64(&mut out, 1 << 40);
//! out.extend_from_slice(b"tail");
//! let mut r = Reader::new(&out);
//! assert_eq!(r.u16(), Ok(7));
//! assert_eq!(r.u64(), Ok(1 << 40));
//! assert_eq!(r.u32(), Ok(u32::from_le_bytes(*b"tail")));
//! assert_eq!(r.u8(), Err(Short));
//! ```

/// A read needed more bytes than were left.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, thiserror::Error)]
#[error("fewer bytes left than a read needs")]
pub struct Short;

/// Reads little-endian values front to back from a byte slice.
///
/// A read that fails ([`Short`]) consumes nothing.
#[derive(Debug, Clone, Copy)]
pub struct Reader<'a> {
    whole: &'a [u8],
    rest: &'a [u8],
}

impl<'a> Reader<'a> {
    /// A reader at the start of `bytes`.
    pub const fn new(bytes: &'a [u8]) -> Self {
        Reader { whole: bytes, rest: bytes }
    }

    /// Bytes read so far.
    pub const fn position(&self) -> usize {
        // `rest` is always a suffix of `whole`: this never underflows.
        self.whole.len() - self.rest.len()
    }

    /// Bytes left.
    pub const fn remaining(&self) -> usize {
        self.rest.len()
    }

    /// True when every byte was read.
    pub const fn is_empty(&self) -> bool {
        self.rest.is_empty()
    }

    /// The next `n` bytes.
    #[inline]
    pub fn take(&mut self, n: usize) -> Result<&'a [u8], Short> {
        let (head, tail) = self.rest.split_at_checked(n).ok_or(Short)?;
        self.rest = tail;
        Ok(head)
    }

    /// The next `N` bytes, as an array.
    #[inline]
    pub fn array<const N: usize>(&mut self) -> Result<[u8; N], Short> {
        let (head, tail) = self.rest.split_first_chunk::<N>().ok_or(Short)?;
        self.rest = tail;
        Ok(*head)
    }

    /// The next byte.
    #[inline]
    pub fn u8(&mut self) -> Result<u8, Short> {
        self.array::<1>().map(|[b]| b)
    }

    /// The next little-endian `u16`.
    #[inline]
    pub fn u16(&mut self) -> Result<u16, Short> {
        self.array().map(u16::from_le_bytes)
    }

    /// The next little-endian `u32`.
    #[inline]
    pub fn u32(&mut self) -> Result<u32, Short> {
        self.array().map(u32::from_le_bytes)
    }

    /// The next little-endian `u64`.
    #[inline]
    pub fn u64(&mut self) -> Result<u64, Short> {
        self.array().map(u64::from_le_bytes)
    }

    /// Every byte left (the reader is then empty).
    #[inline]
    pub fn rest(&mut self) -> &'a [u8] {
        std::mem::take(&mut self.rest)
    }
}

/// Appends `v`, little endian.
#[inline]
pub fn put_u16(out: &mut Vec<u8>, v: u16) {
    out.extend_from_slice(&v.to_le_bytes());
}

/// Appends `v`, little endian.
#[inline]
pub fn put_u32(out: &mut Vec<u8>, v: u32) {
    out.extend_from_slice(&v.to_le_bytes());
}

/// Appends `v`, little endian.
#[inline]
pub fn put_u64(out: &mut Vec<u8>, v: u64) {
    out.extend_from_slice(&v.to_le_bytes());
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn reads_front_to_back_and_a_short_read_consumes_nothing() {
        let mut out = Vec::new();
        out.push(0xAB);
        put_u16(&mut out, 0x0102);
        put_u32(&mut out, 0x0304_0506);
        put_u64(&mut out, 0x0708_090A_0B0C_0D0E);
        out.extend_from_slice(b"xyz");
        let mut r = Reader::new(&out);
        assert_eq!((r.position(), r.remaining()), (0, 18));
        assert_eq!(r.u8(), Ok(0xAB));
        assert_eq!(r.u16(), Ok(0x0102));
        assert_eq!(r.u32(), Ok(0x0304_0506));
        assert_eq!(r.u64(), Ok(0x0708_090A_0B0C_0D0E));
        assert_eq!((r.position(), r.remaining()), (15, 3));
        assert_eq!(r.u32(), Err(Short));
        assert_eq!(r.take(4), Err(Short));
        assert_eq!(r.take(usize::MAX), Err(Short));
        assert_eq!(r.array::<4>(), Err(Short));
        assert_eq!(r.position(), 15, "failed reads consume nothing");
        assert_eq!(r.array::<2>(), Ok(*b"xy"));
        assert_eq!(r.rest(), b"z");
        assert!(r.is_empty());
        assert_eq!(r.rest(), b"");
        assert_eq!(r.take(0), Ok(&[][..]));
        assert_eq!(r.u8(), Err(Short));
        assert_eq!(Short.to_string(), "fewer bytes left than a read needs");
    }

    /// One read of a random sequence.
    #[derive(Debug, Clone, Copy)]
    enum Read {
        Take(usize),
        U8,
        U16,
        U32,
        U64,
        Array3,
        Rest,
    }

    fn read() -> impl Strategy<Value = Read> {
        prop_oneof![
            (0usize..40).prop_map(Read::Take),
            any::<usize>().prop_map(Read::Take),
            Just(Read::U8),
            Just(Read::U16),
            Just(Read::U32),
            Just(Read::U64),
            Just(Read::Array3),
            Just(Read::Rest),
        ]
    }

    proptest! {
        /// Any reads of any bytes never panic, return what
        /// `from_le_bytes` of the same bytes gives, and fail exactly when
        /// too few bytes are left, consuming nothing then.
        #[test]
        fn any_reads_of_any_bytes_agree_with_from_le_bytes(
            bytes in prop::collection::vec(any::<u8>(), 0..64),
            reads in prop::collection::vec(read(), 0..24),
        ) {
            let mut r = Reader::new(&bytes);
            let mut pos = 0usize;
            for read in reads {
                prop_assert_eq!(r.position(), pos);
                prop_assert_eq!(r.remaining(), bytes.len() - pos);
                let left = &bytes[pos..];
                let need = match read {
                    Read::Take(n) => n,
                    Read::U8 => 1,
                    Read::U16 => 2,
                    Read::U32 => 4,
                    Read::U64 => 8,
                    Read::Array3 => 3,
                    Read::Rest => left.len(),
                };
                let fits = need <= left.len();
                let ok = match read {
                    Read::Take(n) => {
                        let got = r.take(n);
                        prop_assert_eq!(got.ok(), left.get(..n));
                        got.is_ok()
                    }
                    Read::U8 => {
                        let got = r.u8();
                        prop_assert_eq!(got.ok(), left.first().copied());
                        got.is_ok()
                    }
                    Read::U16 => {
                        let got = r.u16();
                        let want = left.get(..2).map(|s| u16::from_le_bytes([s[0], s[1]]));
                        prop_assert_eq!(got.ok(), want);
                        got.is_ok()
                    }
                    Read::U32 => {
                        let got = r.u32();
                        let want = left.get(..4).map(|s| u32::from_le_bytes(s.try_into().unwrap()));
                        prop_assert_eq!(got.ok(), want);
                        got.is_ok()
                    }
                    Read::U64 => {
                        let got = r.u64();
                        let want = left.get(..8).map(|s| u64::from_le_bytes(s.try_into().unwrap()));
                        prop_assert_eq!(got.ok(), want);
                        got.is_ok()
                    }
                    Read::Array3 => {
                        let got = r.array::<3>();
                        prop_assert_eq!(got.ok(), left.get(..3).map(|s| [s[0], s[1], s[2]]));
                        got.is_ok()
                    }
                    Read::Rest => {
                        prop_assert_eq!(r.rest(), left);
                        true
                    }
                };
                prop_assert_eq!(ok, fits);
                if ok {
                    pos += need;
                }
            }
            prop_assert_eq!(r.position(), pos);
        }
    }
}
