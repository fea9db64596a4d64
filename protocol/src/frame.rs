//! Hop-to-hop wire frames.
//!
//! Every frame is `len: u32 BE | type: u8 | body`, where `len` counts the type byte and the
//! body. [`FrameHeader::parse`] checks the type and the length against that type's maximum
//! *before* the body is read, so a peer can never make us allocate more than
//! [`FrameType::max_body_len`]. The byte layout of every body is in `docs/PROTOCOL.md`.
//!
//! The frames: `Hello` (version and host id, each side must name its certificate's host),
//! `Manifest`, `Open` (session header: session, model, shard, chunk range, tier, fallback
//! origin, the downstream hops, the live holders upstream, the transport, and the
//! controller's plan token),
//! `Accept` (a [`crate::ChunkSet`] of what the hop holds), `Chunk`, `Ack`, `Nack` (a hash
//! mismatch: send it again), `Progress` (relayed up from every hop), `Fetch` (a pull of a
//! chunk range from a holder), `Done`, `Keepalive` (a sender with nothing to send, so the
//! receiver's stall timer sees it alive) and `Error` ([`ErrorCode`]). `Frame::decode_body`
//! splits a chunk's payload off the body as `Bytes` (no copy).

use bytes::{Buf, BufMut, Bytes};

use crate::chunkset::ChunkSet;
use crate::codec::{self, Codec, DecodeError, get_array, get_str, get_u8, get_u16, get_u32};
use crate::manifest::{MAX_CHUNK_SIZE, MAX_MANIFEST_LEN, Manifest, ModelDigest};
use crate::name::{HostId, MAX_HOST_ID_LEN};
use crate::pieces::{MAX_PIECES, PIECE_SIZE, PieceCv};
use crate::tier::DataTier;

/// Magic at the start of a `Hello` body.
pub const HELLO_MAGIC: &[u8; 4] = b"SHCS";
/// Bytes in a frame header (length + type).
pub const HEADER_LEN: usize = 5;
/// Most downstream hops a session header may list.
pub const MAX_HOPS: usize = 1024;
/// Most upstream hops (holders above the receiver) a session header may list.
pub const MAX_UPSTREAM_HOPS: usize = 64;
/// Longest hop address (`host:port`) in bytes.
pub const MAX_ADDR_LEN: usize = 255;
/// Longest origin URI in bytes.
pub const MAX_URI_LEN: usize = 4096;
/// Longest error message in bytes.
pub const MAX_MESSAGE_LEN: usize = 4096;
/// Bound on the bodies of small control frames.
const MAX_CONTROL_LEN: usize = 64 << 10;

/// A 128-bit session id chosen by whoever plans the chain.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SessionId(pub [u8; 16]);

impl SessionId {
    /// Lower-case hex, 32 characters.
    pub fn to_hex(&self) -> String {
        hex::encode(self.0)
    }
}

impl std::fmt::Display for SessionId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.to_hex())
    }
}

impl std::fmt::Debug for SessionId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SessionId({})", self.to_hex())
    }
}

impl std::str::FromStr for SessionId {
    type Err = DecodeError;
    fn from_str(s: &str) -> Result<Self, DecodeError> {
        let mut out = [0u8; 16];
        hex::decode_to_slice(s, &mut out).map_err(|e| DecodeError::Invalid {
            field: "session id",
            reason: format!("expected 32 hex characters: {e}"),
        })?;
        Ok(Self(out))
    }
}

/// The one-byte code of a session's store tier in `Open`.
fn tier_to_u8(t: DataTier) -> u8 {
    match t {
        DataTier::Memory => 0,
        DataTier::Disk => 1,
    }
}

fn tier_from_u8(v: u8) -> Result<DataTier, DecodeError> {
    match v {
        0 => Ok(DataTier::Memory),
        1 => Ok(DataTier::Disk),
        other => Err(DecodeError::Invalid {
            field: "tier",
            reason: format!("{other}"),
        }),
    }
}

crate::named_enum! {
    /// How a hop reaches the next one: chosen per cluster by the controller, overridable per
    /// plan, carried in every `Open` so each hop dials its downstream the same way.
    #[derive(Default)]
    HopTransport {
        /// TCP (with mutual TLS unless the daemons run `insecure_plaintext`).
        #[default]
        Tcp = "tcp",
        /// QUIC (over UDP, mutual TLS 1.3 with the same certificates), one connection per
        /// pair of hosts and one stream per (session, shard).
        Quic = "quic",
    }
}

/// The one-byte code of a session's hop transport in `Open`.
fn transport_to_u8(t: HopTransport) -> u8 {
    match t {
        HopTransport::Tcp => 0,
        HopTransport::Quic => 1,
    }
}

fn transport_from_u8(v: u8) -> Result<HopTransport, DecodeError> {
    match v {
        0 => Ok(HopTransport::Tcp),
        1 => Ok(HopTransport::Quic),
        other => Err(DecodeError::Invalid {
            field: "transport",
            reason: format!("{other}"),
        }),
    }
}

/// One downstream hop of a chain.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hop {
    /// The hop's host id (checked against its `Hello`).
    pub host: HostId,
    /// Where its transferd listens, `host:port`.
    pub addr: String,
}

/// Opens a chain session on a connection: what to send and who comes after the receiver.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SessionHeader {
    /// The session id, shared by every hop of the chain.
    pub session: SessionId,
    /// The model version.
    pub model: ModelDigest,
    /// Shard index within the manifest.
    pub shard: u32,
    /// First chunk of the range.
    pub start: u32,
    /// One past the last chunk of the range.
    pub end: u32,
    /// Tier the receiver stores into.
    pub tier: DataTier,
    /// Where a hop may fetch missing chunks if its upstream vanishes (`file://`,
    /// `http(s)://`, or empty for none).
    pub origin: String,
    /// The hops after the receiver, in order. The receiver forwards to the first one that
    /// accepts and passes the rest on.
    pub downstream: Vec<Hop>,
    /// The controller's signed plan token (`crate::plan`): which model, hosts and expiry the
    /// session is authorised for. Every hop verifies it and passes it on unchanged. Empty
    /// only between daemons running with `insecure_plaintext`.
    pub token: Bytes,
    /// The hosts above the receiver that hold (or are receiving) the range, nearest first:
    /// the sender, then its own upstream list, at most [`MAX_UPSTREAM_HOPS`]. A hop whose
    /// upstream stalls or vanishes pulls what it lacks from these before it reads the
    /// origin. Encoded after the token (protocol version 3).
    pub upstream: Vec<Hop>,
    /// How the receiver dials its downstream hops (and the holders it pulls from).
    /// Encoded last, one byte (protocol version 4).
    pub transport: HopTransport,
}

/// Error codes carried by [`Frame::Error`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorCode {
    /// The peer's protocol version is not supported.
    UnsupportedVersion,
    /// A frame could not be decoded.
    Malformed,
    /// A frame type this version does not know.
    UnknownFrameType,
    /// The model digest is unknown here and no manifest was sent.
    UnknownModel,
    /// A name or path was rejected.
    InvalidName,
    /// A chunk or shard index is out of range, or not held here.
    NoSuchChunk,
    /// The receiver refuses the session (shutting down, over capacity).
    Refused,
    /// The store could not write (disk full, I/O error).
    Storage,
    /// Frames arrived in an order the protocol does not allow.
    ProtocolViolation,
    /// Anything else.
    Internal,
    /// The session already has a live upstream: the `Open` comes from a host that was
    /// bypassed (stopped or cut off) and is back; it should not feed this hop a second copy.
    AlreadyFed,
    /// A holder answering `Fetch` holds only part of the span and receives none of the
    /// rest: pulling again brings nothing new, so the puller goes to its next source at once.
    /// It ends the answer in place of `Done`, after every chunk of the span it holds.
    NotReceiving,
    /// A code this build does not know.
    Other(u16),
}

impl ErrorCode {
    /// The wire value.
    pub fn to_u16(self) -> u16 {
        match self {
            Self::UnsupportedVersion => 1,
            Self::Malformed => 2,
            Self::UnknownFrameType => 3,
            Self::UnknownModel => 4,
            Self::InvalidName => 5,
            Self::NoSuchChunk => 6,
            Self::Refused => 7,
            Self::Storage => 8,
            Self::ProtocolViolation => 9,
            Self::Internal => 10,
            Self::AlreadyFed => 11,
            Self::NotReceiving => 12,
            Self::Other(v) => v,
        }
    }

    /// From the wire value; unknown values are kept as [`ErrorCode::Other`].
    pub fn from_u16(v: u16) -> Self {
        match v {
            1 => Self::UnsupportedVersion,
            2 => Self::Malformed,
            3 => Self::UnknownFrameType,
            4 => Self::UnknownModel,
            5 => Self::InvalidName,
            6 => Self::NoSuchChunk,
            7 => Self::Refused,
            8 => Self::Storage,
            9 => Self::ProtocolViolation,
            10 => Self::Internal,
            11 => Self::AlreadyFed,
            12 => Self::NotReceiving,
            v => Self::Other(v),
        }
    }
}

/// The type byte of a frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum FrameType {
    /// [`Frame::Hello`]
    Hello = 0x01,
    /// [`Frame::Manifest`]
    Manifest = 0x02,
    /// [`Frame::Open`]
    Open = 0x03,
    /// [`Frame::Accept`]
    Accept = 0x04,
    /// [`Frame::Chunk`]
    Chunk = 0x05,
    /// [`Frame::Ack`]
    Ack = 0x06,
    /// [`Frame::Progress`]
    Progress = 0x07,
    /// [`Frame::Fetch`]
    Fetch = 0x08,
    /// [`Frame::Done`]
    Done = 0x09,
    /// [`Frame::Nack`]
    Nack = 0x0a,
    /// [`Frame::Keepalive`]
    Keepalive = 0x0b,
    /// [`Frame::ChunkHead`]
    ChunkHead = 0x0c,
    /// [`Frame::Piece`]
    Piece = 0x0d,
    /// [`Frame::Error`]
    Error = 0x0f,
}

impl FrameType {
    /// Parses a type byte.
    pub fn from_u8(v: u8) -> Result<Self, DecodeError> {
        Ok(match v {
            0x01 => Self::Hello,
            0x02 => Self::Manifest,
            0x03 => Self::Open,
            0x04 => Self::Accept,
            0x05 => Self::Chunk,
            0x06 => Self::Ack,
            0x07 => Self::Progress,
            0x08 => Self::Fetch,
            0x09 => Self::Done,
            0x0a => Self::Nack,
            0x0b => Self::Keepalive,
            0x0c => Self::ChunkHead,
            0x0d => Self::Piece,
            0x0f => Self::Error,
            other => return Err(DecodeError::UnknownFrameType(other)),
        })
    }

    /// The largest body this frame type may carry.
    pub fn max_body_len(self) -> usize {
        match self {
            Self::Manifest => MAX_MANIFEST_LEN,
            Self::Chunk => MAX_CHUNK_SIZE as usize + 12,
            Self::Piece => PIECE_SIZE + 16,
            Self::ChunkHead => 10 + MAX_PIECES * 32,
            // 2 MiB bitmap for the largest shard + range.
            Self::Accept => (crate::manifest::MAX_CHUNKS_PER_SHARD / 8) as usize + 8,
            // Hops: each at most 2 + 255 + 2 + 255 bytes.
            Self::Open => {
                16 + 32
                    + 13
                    + 2
                    + MAX_URI_LEN
                    + 2
                    + MAX_HOPS * 514
                    + 4
                    + crate::plan::MAX_TOKEN_LEN
                    + 2
                    + MAX_UPSTREAM_HOPS * 514
                    + 1
            }
            _ => MAX_CONTROL_LEN,
        }
    }
}

/// A parsed frame header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FrameHeader {
    /// The frame's type.
    pub ty: FrameType,
    /// Length of the body that follows (excluding the type byte).
    pub body_len: usize,
}

impl FrameHeader {
    /// Parses and bounds-checks the 5 header bytes. An unknown type or a length above the
    /// type's maximum is an error, reported before anything is allocated for the body.
    pub fn parse(header: [u8; HEADER_LEN]) -> Result<Self, DecodeError> {
        let len = u32::from_be_bytes([header[0], header[1], header[2], header[3]]) as usize;
        let ty = FrameType::from_u8(header[4])?;
        if len == 0 {
            return Err(DecodeError::Invalid {
                field: "frame length",
                reason: "0 (must count the type byte)".into(),
            });
        }
        let body_len = len - 1;
        if body_len > ty.max_body_len() {
            return Err(DecodeError::TooLong {
                field: "frame",
                len: body_len as u64,
                max: ty.max_body_len() as u64,
            });
        }
        Ok(Self { ty, body_len })
    }
}

/// A hop-to-hop protocol frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Frame {
    /// First frame in each direction: protocol version and host identity.
    Hello {
        /// Protocol version spoken by the sender.
        version: u16,
        /// The sender's host id.
        host: HostId,
    },
    /// A model manifest; the receiver checks its digest against the following `Open`.
    Manifest(Manifest),
    /// Opens a chain session.
    Open(SessionHeader),
    /// The receiver accepts a session and says which chunks of the range it already holds.
    Accept {
        /// Chunks already verified at the receiver (sent chunks skip these).
        have: ChunkSet,
    },
    /// One chunk of data.
    Chunk {
        /// Shard index.
        shard: u32,
        /// Chunk index within the shard.
        index: u32,
        /// The chunk's bytes.
        data: Bytes,
    },
    /// A chunk about to be sent in pieces (`crate::pieces`, protocol version 7): its pieces'
    /// BLAKE3 chaining values, which the receiver checks against the manifest's hash of the
    /// chunk before it takes any piece. Answered like a `Chunk` (`Ack` or `Nack`), once.
    ChunkHead {
        /// Shard index.
        shard: u32,
        /// Chunk index within the shard.
        index: u32,
        /// One CV per piece, in order.
        cvs: Vec<PieceCv>,
    },
    /// One piece of a chunk announced by a `ChunkHead` on the same connection.
    Piece {
        /// Shard index.
        shard: u32,
        /// Chunk index within the shard.
        index: u32,
        /// Piece number within the chunk.
        piece: u32,
        /// The piece's bytes.
        data: Bytes,
    },
    /// The receiver verified and stored a chunk (flow control: frees a window slot).
    Ack {
        /// Shard index.
        shard: u32,
        /// Chunk index.
        index: u32,
    },
    /// The receiver dropped a chunk that failed verification; the sender sends it again
    /// (frees a window slot like `Ack`).
    Nack {
        /// Shard index.
        shard: u32,
        /// Chunk index.
        index: u32,
    },
    /// A hop's progress, relayed upstream to the head.
    Progress {
        /// The hop reporting.
        host: HostId,
        /// Shard index.
        shard: u32,
        /// Chunks of the session's range verified there.
        verified: u32,
        /// Chunks in the session's range.
        total: u32,
    },
    /// Pull request: send these chunks that you hold (answered by `Chunk` frames and `Done`).
    Fetch {
        /// The model version.
        model: ModelDigest,
        /// Shard index.
        shard: u32,
        /// First chunk.
        start: u32,
        /// One past the last chunk.
        end: u32,
    },
    /// The sender has nothing more to send on this connection; as a reply, the receiver
    /// holds the whole range verified.
    Done,
    /// A sender that has had nothing to send for a while says it is alive (it waits for its
    /// own upstream), so its receiver can tell a starved upstream from a stalled one. Empty
    /// body.
    Keepalive,
    /// An error; the connection closes after it.
    Error {
        /// What went wrong, machine-readable.
        code: ErrorCode,
        /// What went wrong, for a person.
        message: String,
    },
}

impl Frame {
    /// The frame's type byte.
    pub fn ty(&self) -> FrameType {
        match self {
            Self::Hello { .. } => FrameType::Hello,
            Self::Manifest(_) => FrameType::Manifest,
            Self::Open(_) => FrameType::Open,
            Self::Accept { .. } => FrameType::Accept,
            Self::Chunk { .. } => FrameType::Chunk,
            Self::ChunkHead { .. } => FrameType::ChunkHead,
            Self::Piece { .. } => FrameType::Piece,
            Self::Ack { .. } => FrameType::Ack,
            Self::Nack { .. } => FrameType::Nack,
            Self::Progress { .. } => FrameType::Progress,
            Self::Fetch { .. } => FrameType::Fetch,
            Self::Done => FrameType::Done,
            Self::Keepalive => FrameType::Keepalive,
            Self::Error { .. } => FrameType::Error,
        }
    }

    /// An error frame.
    pub fn error(code: ErrorCode, message: impl Into<String>) -> Self {
        let mut message = message.into();
        if message.len() > MAX_MESSAGE_LEN {
            let mut cut = MAX_MESSAGE_LEN;
            while !message.is_char_boundary(cut) {
                cut -= 1;
            }
            message.truncate(cut);
        }
        Self::Error { code, message }
    }

    fn body_len(&self) -> usize {
        match self {
            Self::Hello { host, .. } => 4 + 2 + codec::str_len(host.as_str()),
            Self::Manifest(m) => m.encoded_len(),
            Self::Open(h) => {
                16 + 32
                    + 4
                    + 4
                    + 4
                    + 1
                    + codec::str_len(&h.origin)
                    + 2
                    + h.downstream
                        .iter()
                        .map(|hop| codec::str_len(hop.host.as_str()) + codec::str_len(&hop.addr))
                        .sum::<usize>()
                    + 4
                    + h.token.len()
                    + 2
                    + h.upstream
                        .iter()
                        .map(|hop| codec::str_len(hop.host.as_str()) + codec::str_len(&hop.addr))
                        .sum::<usize>()
                    + 1
            }
            Self::Accept { have } => have.encoded_len(),
            Self::Chunk { data, .. } => 4 + 4 + 4 + data.len(),
            Self::ChunkHead { cvs, .. } => 4 + 4 + 2 + 32 * cvs.len(),
            Self::Piece { data, .. } => 4 + 4 + 4 + 4 + data.len(),
            Self::Ack { .. } | Self::Nack { .. } => 8,
            Self::Progress { host, .. } => codec::str_len(host.as_str()) + 12,
            Self::Fetch { .. } => 32 + 12,
            Self::Done | Self::Keepalive => 0,
            Self::Error { message, .. } => 2 + codec::str_len(message),
        }
    }

    /// Encodes only the body (what follows the header).
    fn encode_body<B: BufMut>(&self, buf: &mut B) {
        match self {
            Self::Hello { version, host } => {
                buf.put_slice(HELLO_MAGIC);
                buf.put_u16(*version);
                codec::put_str(buf, host.as_str());
            }
            Self::Manifest(m) => m.encode(buf),
            Self::Open(h) => {
                buf.put_slice(&h.session.0);
                buf.put_slice(&h.model.0);
                buf.put_u32(h.shard);
                buf.put_u32(h.start);
                buf.put_u32(h.end);
                buf.put_u8(tier_to_u8(h.tier));
                codec::put_str(buf, &h.origin);
                buf.put_u16(h.downstream.len() as u16);
                for hop in &h.downstream {
                    codec::put_str(buf, hop.host.as_str());
                    codec::put_str(buf, &hop.addr);
                }
                buf.put_u32(h.token.len() as u32);
                buf.put_slice(&h.token);
                let upstream = &h.upstream[..h.upstream.len().min(MAX_UPSTREAM_HOPS)];
                buf.put_u16(upstream.len() as u16);
                for hop in upstream {
                    codec::put_str(buf, hop.host.as_str());
                    codec::put_str(buf, &hop.addr);
                }
                buf.put_u8(transport_to_u8(h.transport));
            }
            Self::Accept { have } => have.encode(buf),
            Self::Chunk { shard, index, data } => {
                buf.put_u32(*shard);
                buf.put_u32(*index);
                buf.put_u32(data.len() as u32);
                buf.put_slice(data);
            }
            Self::ChunkHead { shard, index, cvs } => {
                buf.put_u32(*shard);
                buf.put_u32(*index);
                buf.put_u16(cvs.len() as u16);
                for cv in cvs {
                    buf.put_slice(cv);
                }
            }
            Self::Piece {
                shard,
                index,
                piece,
                data,
            } => {
                buf.put_u32(*shard);
                buf.put_u32(*index);
                buf.put_u32(*piece);
                buf.put_u32(data.len() as u32);
                buf.put_slice(data);
            }
            Self::Ack { shard, index } | Self::Nack { shard, index } => {
                buf.put_u32(*shard);
                buf.put_u32(*index);
            }
            Self::Progress {
                host,
                shard,
                verified,
                total,
            } => {
                codec::put_str(buf, host.as_str());
                buf.put_u32(*shard);
                buf.put_u32(*verified);
                buf.put_u32(*total);
            }
            Self::Fetch {
                model,
                shard,
                start,
                end,
            } => {
                buf.put_slice(&model.0);
                buf.put_u32(*shard);
                buf.put_u32(*start);
                buf.put_u32(*end);
            }
            Self::Done | Self::Keepalive => {}
            Self::Error { code, message } => {
                buf.put_u16(code.to_u16());
                codec::put_str(buf, message);
            }
        }
    }

    /// Encodes a `Chunk` frame's header and fixed fields without copying the payload, so a
    /// sender can write `prefix` then the payload (e.g. straight from a memory map).
    pub fn chunk_prefix(shard: u32, index: u32, len: usize) -> [u8; HEADER_LEN + 12] {
        let mut out = [0u8; HEADER_LEN + 12];
        let frame_len = (1 + 12 + len) as u32;
        out[..4].copy_from_slice(&frame_len.to_be_bytes());
        out[4] = FrameType::Chunk as u8;
        out[5..9].copy_from_slice(&shard.to_be_bytes());
        out[9..13].copy_from_slice(&index.to_be_bytes());
        out[13..17].copy_from_slice(&(len as u32).to_be_bytes());
        out
    }

    /// Encodes a `Piece` frame's header and fixed fields without copying the payload (as
    /// [`Frame::chunk_prefix`]).
    pub fn piece_prefix(shard: u32, index: u32, piece: u32, len: usize) -> [u8; HEADER_LEN + 16] {
        let mut out = [0u8; HEADER_LEN + 16];
        let frame_len = (1 + 16 + len) as u32;
        out[..4].copy_from_slice(&frame_len.to_be_bytes());
        out[4] = FrameType::Piece as u8;
        out[5..9].copy_from_slice(&shard.to_be_bytes());
        out[9..13].copy_from_slice(&index.to_be_bytes());
        out[13..17].copy_from_slice(&piece.to_be_bytes());
        out[17..21].copy_from_slice(&(len as u32).to_be_bytes());
        out
    }

    /// Decodes a body of type `ty`. The body must be consumed exactly.
    pub fn decode_body(ty: FrameType, mut body: Bytes) -> Result<Self, DecodeError> {
        let b = &mut body;
        let frame = match ty {
            FrameType::Hello => {
                let magic: [u8; 4] = get_array(b)?;
                if &magic != HELLO_MAGIC {
                    return Err(DecodeError::BadMagic {
                        expected: HELLO_MAGIC,
                    });
                }
                let version = get_u16(b)?;
                Self::Hello {
                    version,
                    host: get_host(b)?,
                }
            }
            FrameType::Manifest => Self::Manifest(Manifest::decode(b)?),
            FrameType::Open => {
                let session = SessionId(get_array(b)?);
                let model = ModelDigest(get_array(b)?);
                let shard = get_u32(b)?;
                let start = get_u32(b)?;
                let end = get_u32(b)?;
                if end < start {
                    return Err(DecodeError::Invalid {
                        field: "chunk range",
                        reason: format!("{start}..{end} is inverted"),
                    });
                }
                let tier = tier_from_u8(get_u8(b)?)?;
                let origin = get_str(b, "origin", MAX_URI_LEN)?;
                let downstream = get_hops(b, "downstream hops", MAX_HOPS)?;
                let n = get_u32(b)? as usize;
                if n > crate::plan::MAX_TOKEN_LEN {
                    return Err(DecodeError::TooLong {
                        field: "plan token",
                        len: n as u64,
                        max: crate::plan::MAX_TOKEN_LEN as u64,
                    });
                }
                codec::need(b, n)?;
                let token = b.copy_to_bytes(n);
                let upstream = get_hops(b, "upstream hops", MAX_UPSTREAM_HOPS)?;
                let transport = transport_from_u8(get_u8(b)?)?;
                Self::Open(SessionHeader {
                    session,
                    model,
                    shard,
                    start,
                    end,
                    tier,
                    origin,
                    downstream,
                    token,
                    upstream,
                    transport,
                })
            }
            FrameType::Accept => Self::Accept {
                have: ChunkSet::decode(b)?,
            },
            FrameType::Chunk => {
                let shard = get_u32(b)?;
                let index = get_u32(b)?;
                let len = get_u32(b)? as usize;
                if len > MAX_CHUNK_SIZE as usize {
                    return Err(DecodeError::TooLong {
                        field: "chunk",
                        len: len as u64,
                        max: MAX_CHUNK_SIZE.into(),
                    });
                }
                codec::need(b, len)?;
                Self::Chunk {
                    shard,
                    index,
                    data: b.split_to(len),
                }
            }
            FrameType::ChunkHead => {
                let shard = get_u32(b)?;
                let index = get_u32(b)?;
                let n = get_u16(b)? as usize;
                codec::check_len("piece hashes", n, MAX_PIECES)?;
                let mut cvs = Vec::with_capacity(n);
                for _ in 0..n {
                    cvs.push(get_array(b)?);
                }
                Self::ChunkHead { shard, index, cvs }
            }
            FrameType::Piece => {
                let shard = get_u32(b)?;
                let index = get_u32(b)?;
                let piece = get_u32(b)?;
                let len = get_u32(b)? as usize;
                codec::check_len("piece", len, PIECE_SIZE)?;
                codec::need(b, len)?;
                Self::Piece {
                    shard,
                    index,
                    piece,
                    data: b.split_to(len),
                }
            }
            FrameType::Ack => Self::Ack {
                shard: get_u32(b)?,
                index: get_u32(b)?,
            },
            FrameType::Nack => Self::Nack {
                shard: get_u32(b)?,
                index: get_u32(b)?,
            },
            FrameType::Progress => Self::Progress {
                host: get_host(b)?,
                shard: get_u32(b)?,
                verified: get_u32(b)?,
                total: get_u32(b)?,
            },
            FrameType::Fetch => {
                let model = ModelDigest(get_array(b)?);
                let shard = get_u32(b)?;
                let start = get_u32(b)?;
                let end = get_u32(b)?;
                if end < start {
                    return Err(DecodeError::Invalid {
                        field: "chunk range",
                        reason: format!("{start}..{end} is inverted"),
                    });
                }
                Self::Fetch {
                    model,
                    shard,
                    start,
                    end,
                }
            }
            FrameType::Done => Self::Done,
            FrameType::Keepalive => Self::Keepalive,
            FrameType::Error => Self::Error {
                code: ErrorCode::from_u16(get_u16(b)?),
                message: get_str(b, "error message", MAX_MESSAGE_LEN)?,
            },
        };
        if body.has_remaining() {
            return Err(DecodeError::TrailingBytes(body.remaining()));
        }
        Ok(frame)
    }
}

/// A `u16` count of hops, at most `max`, each a host id and an address.
fn get_hops<B: Buf>(b: &mut B, field: &'static str, max: usize) -> Result<Vec<Hop>, DecodeError> {
    let n = get_u16(b)? as usize;
    codec::check_len(field, n, max)?;
    let mut hops = Vec::with_capacity(n);
    for _ in 0..n {
        let host = get_host(b)?;
        let addr = get_str(b, "hop address", MAX_ADDR_LEN)?;
        hops.push(Hop { host, addr });
    }
    Ok(hops)
}

fn get_host<B: Buf>(b: &mut B) -> Result<HostId, DecodeError> {
    let s = get_str(b, "host id", MAX_HOST_ID_LEN)?;
    HostId::new(s).map_err(|e| DecodeError::Invalid {
        field: "host id",
        reason: e.to_string(),
    })
}

impl Codec for Frame {
    /// Decodes one whole frame (header and body) from the front of `buf`.
    fn decode<B: Buf>(buf: &mut B) -> Result<Self, DecodeError> {
        let header = FrameHeader::parse(get_array(buf)?)?;
        codec::need(buf, header.body_len)?;
        let body = buf.copy_to_bytes(header.body_len);
        Self::decode_body(header.ty, body)
    }

    fn encode<B: BufMut>(&self, buf: &mut B) {
        buf.put_u32((1 + self.body_len()) as u32);
        buf.put_u8(self.ty() as u8);
        self.encode_body(buf);
    }

    fn encoded_len(&self) -> usize {
        HEADER_LEN + self.body_len()
    }
}
