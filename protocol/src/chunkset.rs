//! [`ChunkSet`]: which chunks of a contiguous range are present, as a bitmap.
//!
//! It is the `Accept` frame's "what I already hold": a hop answers an `Open` with the chunks
//! of the range it has verified, and the sender sends only the missing ones.

use bytes::{Buf, BufMut};

use crate::codec::{Codec, DecodeError, get_u32, need};
use crate::manifest::MAX_CHUNKS_PER_SHARD;

/// A set of chunk indices within `start..end`, stored as one bit per chunk.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ChunkSet {
    start: u32,
    end: u32,
    bits: Vec<u8>,
    /// Indices in the set (the bits set), kept so that [`ChunkSet::len`] and
    /// [`ChunkSet::is_full`] need no pass over the bitmap: a sender's window asks
    /// `is_full` on every wake-up.
    count: u32,
}

impl ChunkSet {
    /// An empty set over `start..end`. An inverted range is treated as empty.
    pub fn new(start: u32, end: u32) -> Self {
        let end = end.max(start);
        Self {
            start,
            end,
            bits: vec![0; (end - start).div_ceil(8) as usize],
            count: 0,
        }
    }

    /// The range this set covers.
    pub fn range(&self) -> std::ops::Range<u32> {
        self.start..self.end
    }

    /// Adds `index`; indices outside the range are ignored. Returns whether it was new.
    pub fn insert(&mut self, index: u32) -> bool {
        if !self.range().contains(&index) {
            return false;
        }
        let i = (index - self.start) as usize;
        let (byte, mask) = (i / 8, 1u8 << (i % 8));
        let new = self.bits[byte] & mask == 0;
        self.bits[byte] |= mask;
        self.count += u32::from(new);
        new
    }

    /// Whether `index` is in the set.
    pub fn contains(&self, index: u32) -> bool {
        if !self.range().contains(&index) {
            return false;
        }
        let i = (index - self.start) as usize;
        self.bits[i / 8] & (1 << (i % 8)) != 0
    }

    /// Number of indices in the set.
    pub fn len(&self) -> u32 {
        self.count
    }

    /// Whether the set holds no index.
    pub fn is_empty(&self) -> bool {
        self.count == 0
    }

    /// Whether every index of the range is in the set.
    pub fn is_full(&self) -> bool {
        self.len() == self.end - self.start
    }

    /// The indices of the range that are *not* in the set, in ascending order.
    pub fn missing(&self) -> impl Iterator<Item = u32> + '_ {
        self.range().filter(|i| !self.contains(*i))
    }

    /// The indices in the set, in ascending order.
    pub fn iter(&self) -> impl Iterator<Item = u32> + '_ {
        self.range().filter(|i| self.contains(*i))
    }
}

impl Codec for ChunkSet {
    fn decode<B: Buf>(buf: &mut B) -> Result<Self, DecodeError> {
        let start = get_u32(buf)?;
        let end = get_u32(buf)?;
        if end < start {
            return Err(DecodeError::Invalid {
                field: "chunk set",
                reason: format!("range {start}..{end} is inverted"),
            });
        }
        let n = end - start;
        if n > MAX_CHUNKS_PER_SHARD {
            return Err(DecodeError::TooLong {
                field: "chunk set",
                len: n.into(),
                max: MAX_CHUNKS_PER_SHARD.into(),
            });
        }
        let nbytes = n.div_ceil(8) as usize;
        need(buf, nbytes)?;
        let mut bits = vec![0u8; nbytes];
        buf.copy_to_slice(&mut bits);
        // Bits past the end of the range must be zero so that equal sets encode equally.
        if n % 8 != 0 {
            let last = bits[nbytes - 1];
            if last >> (n % 8) != 0 {
                return Err(DecodeError::Invalid {
                    field: "chunk set",
                    reason: "bits set past the end of the range".into(),
                });
            }
        }
        let count = bits.iter().map(|b| b.count_ones()).sum();
        Ok(Self {
            start,
            end,
            bits,
            count,
        })
    }

    fn encode<B: BufMut>(&self, buf: &mut B) {
        buf.put_u32(self.start);
        buf.put_u32(self.end);
        buf.put_slice(&self.bits);
    }

    fn encoded_len(&self) -> usize {
        8 + self.bits.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn insert_contains_missing() {
        let mut s = ChunkSet::new(10, 21);
        assert!(s.insert(10));
        assert!(!s.insert(10));
        assert!(s.insert(20));
        assert!(!s.insert(21));
        assert!(!s.insert(9));
        assert_eq!(s.len(), 2);
        assert_eq!(s.missing().count(), 9);
        assert_eq!(s.iter().collect::<Vec<_>>(), vec![10, 20]);
        assert!(!s.is_full());
    }

    #[test]
    fn the_kept_count_agrees_with_the_bits_through_inserts_and_a_decode() {
        let mut s = ChunkSet::new(5, 22);
        assert!(s.is_empty());
        for i in [5, 9, 9, 13, 21, 22, 4, 12, 13] {
            s.insert(i);
            assert_eq!(s.len() as usize, s.iter().count());
            assert!(!s.is_empty());
        }
        assert_eq!(s.len(), 5);
        let mut wire = Vec::new();
        s.encode(&mut wire);
        let d = ChunkSet::decode(&mut bytes::Bytes::from(wire)).unwrap();
        assert_eq!(d, s);
        assert_eq!(d.len(), 5);
        for i in 5..22 {
            s.insert(i);
        }
        assert!(s.is_full());
        assert_eq!(s.len(), 17);
        let mut wire = Vec::new();
        s.encode(&mut wire);
        assert!(
            ChunkSet::decode(&mut bytes::Bytes::from(wire))
                .unwrap()
                .is_full()
        );
        assert!(ChunkSet::new(7, 7).is_full() && ChunkSet::new(7, 7).is_empty());
    }
}
