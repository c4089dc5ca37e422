//! Reading structured values out of a fuzz input, and writing them for
//! seeds in the same layout.
//!
//! Reads past the end give zeros (and empty slices) rather than failing,
//! so that every input means something and a short input is just a
//! sequence that stops early.

/// A cursor over a fuzz input.
#[derive(Debug, Clone)]
pub struct Input<'a> {
    rest: &'a [u8],
}

impl<'a> Input<'a> {
    /// A cursor at the start of `data`.
    pub fn new(data: &'a [u8]) -> Self {
        Input { rest: data }
    }

    /// True once every byte was read.
    pub fn is_empty(&self) -> bool {
        self.rest.is_empty()
    }

    /// Bytes not read yet.
    pub fn len(&self) -> usize {
        self.rest.len()
    }

    /// The next byte (0 past the end).
    pub fn u8(&mut self) -> u8 {
        self.take_array::<1>()[0]
    }

    /// The next little-endian u16.
    pub fn u16(&mut self) -> u16 {
        u16::from_le_bytes(self.take_array())
    }

    /// The next little-endian u32.
    pub fn u32(&mut self) -> u32 {
        u32::from_le_bytes(self.take_array())
    }

    /// The next little-endian u64.
    pub fn u64(&mut self) -> u64 {
        u64::from_le_bytes(self.take_array())
    }

    /// The next byte's low bit.
    pub fn bool(&mut self) -> bool {
        self.u8() & 1 == 1
    }

    /// Up to `n` bytes (fewer at the end).
    pub fn bytes(&mut self, n: usize) -> &'a [u8] {
        let n = n.min(self.rest.len());
        let (head, tail) = self.rest.split_at(n);
        self.rest = tail;
        head
    }

    /// A length-prefixed (u16) slice, at most `max` bytes long.
    pub fn chunk(&mut self, max: usize) -> &'a [u8] {
        let n = self.u16() as usize;
        self.bytes(n.min(max))
    }

    /// Everything left.
    pub fn rest(&mut self) -> &'a [u8] {
        self.bytes(self.rest.len())
    }

    fn take_array<const N: usize>(&mut self) -> [u8; N] {
        let mut out = [0u8; N];
        let b = self.bytes(N);
        out[..b.len()].copy_from_slice(b);
        out
    }
}

/// Builds an input in the layout [`Input`] reads.
#[derive(Debug, Clone, Default)]
pub struct Seed(pub Vec<u8>);

impl Seed {
    /// An empty seed.
    pub fn new() -> Self {
        Seed(Vec::new())
    }

    /// Appends a byte.
    pub fn u8(&mut self, v: u8) -> &mut Self {
        self.0.push(v);
        self
    }

    /// Appends a little-endian u16.
    pub fn u16(&mut self, v: u16) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }

    /// Appends a little-endian u32.
    pub fn u32(&mut self, v: u32) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }

    /// Appends a little-endian u64.
    pub fn u64(&mut self, v: u64) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }

    /// Appends raw bytes.
    pub fn bytes(&mut self, b: &[u8]) -> &mut Self {
        self.0.extend_from_slice(b);
        self
    }

    /// Appends a length-prefixed (u16) slice.
    pub fn chunk(&mut self, b: &[u8]) -> &mut Self {
        self.u16(b.len() as u16).bytes(b)
    }

    /// The bytes.
    pub fn done(&mut self) -> Vec<u8> {
        std::mem::take(&mut self.0)
    }
}
