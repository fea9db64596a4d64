//! The [`Codec`] trait and the one error type every decoder returns.
//!
//! [`Codec`] is `decode` / `encode` / `encoded_len` over `bytes::Buf` / `BufMut`; the
//! crate's readers (`get_str`, `get_bytes`, `get_array`) check each length field against its
//! maximum (`check_len`) before reading or allocating, so a short or hostile input is a
//! [`DecodeError`] (`Truncated`, `TooLong`, ...), never a panic. [`decode_exact`] also refuses
//! trailing bytes.

use bytes::{Buf, BufMut, Bytes};

/// A type with a canonical binary encoding.
pub trait Codec: Sized {
    /// Decodes one value from the front of `buf`, advancing it.
    fn decode<B: Buf>(buf: &mut B) -> Result<Self, DecodeError>;
    /// Appends the encoding of `self` to `buf`.
    fn encode<B: BufMut>(&self, buf: &mut B);
    /// Number of bytes [`Codec::encode`] writes.
    fn encoded_len(&self) -> usize;
}

/// Why a byte sequence could not be decoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    /// The input ended before the value did.
    #[error("truncated input: needed {needed} more bytes")]
    Truncated {
        /// How many more bytes the decoder needed at the point it stopped.
        needed: usize,
    },
    /// A length field exceeds the maximum allowed for that field.
    #[error("{field} length {len} exceeds the maximum {max}")]
    TooLong {
        /// Which field carried the length.
        field: &'static str,
        /// The length found on the wire.
        len: u64,
        /// The maximum allowed.
        max: u64,
    },
    /// The frame type byte is not one this version knows.
    #[error("unknown frame type 0x{0:02x}")]
    UnknownFrameType(u8),
    /// A magic number did not match.
    #[error("bad magic: expected {expected:?}")]
    BadMagic {
        /// The magic this decoder expected.
        expected: &'static [u8],
    },
    /// A format version this build does not understand.
    #[error("unsupported {what} version {version}")]
    UnsupportedVersion {
        /// What carried the version (e.g. "manifest").
        what: &'static str,
        /// The version found.
        version: u16,
    },
    /// A field holds a value outside its domain.
    #[error("invalid {field}: {reason}")]
    Invalid {
        /// Which field.
        field: &'static str,
        /// Why it is invalid.
        reason: String,
    },
    /// Bytes were left over after a complete value.
    #[error("{0} trailing bytes after a complete value")]
    TrailingBytes(usize),
}

pub(crate) fn need<B: Buf>(buf: &B, n: usize) -> Result<(), DecodeError> {
    if buf.remaining() < n {
        Err(DecodeError::Truncated {
            needed: n - buf.remaining(),
        })
    } else {
        Ok(())
    }
}

pub(crate) fn get_u8<B: Buf>(buf: &mut B) -> Result<u8, DecodeError> {
    need(buf, 1)?;
    Ok(buf.get_u8())
}

pub(crate) fn get_u16<B: Buf>(buf: &mut B) -> Result<u16, DecodeError> {
    need(buf, 2)?;
    Ok(buf.get_u16())
}

pub(crate) fn get_u32<B: Buf>(buf: &mut B) -> Result<u32, DecodeError> {
    need(buf, 4)?;
    Ok(buf.get_u32())
}

pub(crate) fn get_u64<B: Buf>(buf: &mut B) -> Result<u64, DecodeError> {
    need(buf, 8)?;
    Ok(buf.get_u64())
}

pub(crate) fn get_array<const N: usize, B: Buf>(buf: &mut B) -> Result<[u8; N], DecodeError> {
    need(buf, N)?;
    let mut out = [0u8; N];
    buf.copy_to_slice(&mut out);
    Ok(out)
}

/// Reads `u16`-length-prefixed bytes of at most `max` bytes; the length is checked before
/// anything is copied (no copy at all when `buf` is `Bytes`).
pub(crate) fn get_bytes<B: Buf>(
    buf: &mut B,
    field: &'static str,
    max: usize,
) -> Result<Bytes, DecodeError> {
    let len = get_u16(buf)? as usize;
    check_len(field, len, max)?;
    need(buf, len)?;
    Ok(buf.copy_to_bytes(len))
}

/// `TooLong` when a length or count read off the wire exceeds its field's maximum.
pub(crate) fn check_len(field: &'static str, len: usize, max: usize) -> Result<(), DecodeError> {
    if len > max {
        return Err(DecodeError::TooLong {
            field,
            len: len as u64,
            max: max as u64,
        });
    }
    Ok(())
}

/// Reads a `u16`-length-prefixed UTF-8 string of at most `max` bytes.
pub(crate) fn get_str<B: Buf>(
    buf: &mut B,
    field: &'static str,
    max: usize,
) -> Result<String, DecodeError> {
    let raw = get_bytes(buf, field, max)?;
    String::from_utf8(raw.to_vec()).map_err(|_| DecodeError::Invalid {
        field,
        reason: "not valid UTF-8".into(),
    })
}

/// Writes a `u16`-length-prefixed string. Callers guarantee `s.len() <= u16::MAX` by
/// validating names on construction.
pub(crate) fn put_str<B: BufMut>(buf: &mut B, s: &str) {
    let len = u16::try_from(s.len()).unwrap_or(u16::MAX);
    buf.put_u16(len);
    buf.put_slice(&s.as_bytes()[..len as usize]);
}

/// Encoded size of a string written by [`put_str`].
pub(crate) fn str_len(s: &str) -> usize {
    2 + s.len().min(u16::MAX as usize)
}

/// Decodes a complete value from `bytes`, rejecting trailing bytes.
pub fn decode_exact<T: Codec>(mut bytes: Bytes) -> Result<T, DecodeError> {
    let value = T::decode(&mut bytes)?;
    if bytes.has_remaining() {
        return Err(DecodeError::TrailingBytes(bytes.remaining()));
    }
    Ok(value)
}

/// Encodes a value into a fresh buffer of exactly [`Codec::encoded_len`] bytes.
pub fn encode_to_vec<T: Codec>(value: &T) -> Vec<u8> {
    let mut out = Vec::with_capacity(value.encoded_len());
    value.encode(&mut out);
    out
}
