//! proptest strategies that generate only *valid* protocol values: names through their
//! validating constructors, manifests through `Manifest::new`, chunk sets through
//! `ChunkSet::new` + `insert`, and strings within the limits the decoders enforce.

use bytes::Bytes;
use proptest::collection::{btree_set, vec};
use proptest::prelude::*;
use shardcast_protocol::frame::{MAX_ADDR_LEN, MAX_HOPS, MAX_MESSAGE_LEN, MAX_URI_LEN};
use shardcast_protocol::manifest::{MAX_CHUNK_SIZE, MIN_CHUNK_SIZE};
use shardcast_protocol::{
    ChunkHash, ChunkSet, DataTier, ErrorCode, Frame, Hop, HostId, Manifest, ModelDigest, ModelName,
    SessionHeader, SessionId, ShardEntry, ShardPath,
};

/// Host ids: the full allowed alphabet, short and (sometimes) maximal lengths.
pub(crate) fn host_id() -> impl Strategy<Value = HostId> {
    prop_oneof![
        8 => "[A-Za-z0-9._:-]{1,40}",
        1 => "[A-Za-z0-9._:-]{250,255}",
    ]
    .prop_map(|s| HostId::new(s).expect("regex yields valid host ids"))
}

/// One path component: ASCII, spaces, dots (`.` and `..` are filtered out by the
/// constructor) and multi-byte UTF-8.
const COMPONENT: &str = "[A-Za-z0-9 ._~+=@,-]{1,12}|[a-zé模型ü]{1,6}";

fn path_string(max_components: usize) -> impl Strategy<Value = String> {
    vec(
        proptest::string::string_regex(COMPONENT).expect("valid regex"),
        1..=max_components,
    )
    .prop_map(|parts| parts.join("/"))
}

/// Model names such as `org/model-7b`, including non-ASCII ones.
pub(crate) fn model_name() -> impl Strategy<Value = ModelName> {
    path_string(4).prop_filter_map("not a valid model name", |s| ModelName::new(s).ok())
}

/// Shard paths such as `sub/dir/model-00001-of-00004.safetensors`.
pub(crate) fn shard_path() -> impl Strategy<Value = ShardPath> {
    path_string(5).prop_filter_map("not a valid shard path", |s| ShardPath::new(s).ok())
}

fn hash32() -> impl Strategy<Value = [u8; 32]> {
    any::<[u8; 32]>()
}

/// Manifest chunk sizes: the bounds, the default and arbitrary values in between.
pub(crate) fn chunk_size() -> impl Strategy<Value = u32> {
    prop_oneof![
        Just(MIN_CHUNK_SIZE),
        Just(MAX_CHUNK_SIZE),
        Just(1 << 20),
        MIN_CHUNK_SIZE..=MAX_CHUNK_SIZE,
    ]
}

/// A shard of `chunk_size`-byte chunks with 0 to 12 chunks, the last one full or short.
fn shard_entry(path: ShardPath, chunk_size: u32) -> impl Strategy<Value = ShardEntry> {
    (
        0u64..=12,
        1..=u64::from(chunk_size),
        hash32(),
        vec(hash32(), 12),
    )
        .prop_map(move |(n, last, hash, hashes)| {
            let size = if n == 0 {
                0
            } else {
                (n - 1) * u64::from(chunk_size) + last
            };
            let chunks = hashes.into_iter().take(n as usize).map(ChunkHash).collect();
            ShardEntry {
                path: path.clone(),
                size,
                hash: ChunkHash(hash),
                chunks,
            }
        })
}

/// Valid manifests with 0 to 6 shards with distinct paths, in arbitrary order.
pub(crate) fn manifest() -> impl Strategy<Value = Manifest> {
    (model_name(), chunk_size(), btree_set(shard_path(), 0..6))
        .prop_flat_map(|(name, chunk_size, paths)| {
            let shards: Vec<_> = paths
                .into_iter()
                .map(|p| shard_entry(p, chunk_size))
                .collect();
            // `btree_set` yields sorted paths; shuffle, since the order of shards matters.
            (Just(name), Just(chunk_size), shards.prop_shuffle())
        })
        .prop_map(|(name, chunk_size, shards)| {
            Manifest::new(name, chunk_size, shards).expect("generated manifest is valid")
        })
}

/// Chunk sets over ranges of 0 to 300 chunks, anywhere in `u32` (including the very top),
/// with an arbitrary subset held.
pub(crate) fn chunk_set() -> impl Strategy<Value = ChunkSet> {
    (
        prop_oneof![Just(0u32), any::<u32>(), Just(u32::MAX - 300)],
        0u32..=300,
    )
        .prop_flat_map(|(start, n)| {
            let start = start.min(u32::MAX - n);
            (Just(start), Just(n), vec(any::<bool>(), n as usize))
        })
        .prop_map(|(start, n, held)| {
            let mut set = ChunkSet::new(start, start + n);
            for (i, h) in held.into_iter().enumerate() {
                if h {
                    assert!(set.insert(start + i as u32));
                }
            }
            set
        })
}

/// `start..end` with `start <= end`.
fn range() -> impl Strategy<Value = (u32, u32)> {
    (any::<u32>(), any::<u32>()).prop_map(|(a, b)| (a.min(b), a.max(b)))
}

fn tier() -> impl Strategy<Value = DataTier> {
    prop_oneof![Just(DataTier::Memory), Just(DataTier::Disk)]
}

fn hop() -> impl Strategy<Value = Hop> {
    let addr = prop_oneof![
        4 => "[a-z0-9.-]{1,40}:[0-9]{1,5}",
        1 => "\\[[0-9a-f:]{2,39}\\]:[0-9]{1,5}",
        1 => proptest::string::string_regex(&format!("[a-z]{{{MAX_ADDR_LEN}}}")).expect("regex"),
    ];
    (host_id(), addr).prop_map(|(host, addr)| Hop { host, addr })
}

fn origin() -> impl Strategy<Value = String> {
    prop_oneof![
        Just(String::new()),
        "file:///[a-z0-9/._-]{1,60}",
        "https?://[a-z0-9.-]{1,30}(:[0-9]{1,5})?/[a-zA-Z0-9/._%-]{0,60}",
        proptest::string::string_regex(&format!("[a-z]{{{MAX_URI_LEN}}}")).expect("regex"),
    ]
}

/// Session headers with 0 to 8 downstream hops (and, rarely, the maximum of 1024).
pub(crate) fn session_header() -> impl Strategy<Value = SessionHeader> {
    let hops = prop_oneof![
        20 => vec(hop(), 0..8),
        1 => vec(
            ("[a-z0-9]{1,8}", "[a-z0-9.]{1,12}:[0-9]{1,5}").prop_map(|(h, addr)| Hop {
                host: HostId::new(h).expect("valid host id"),
                addr,
            }),
            MAX_HOPS,
        ),
    ];
    (
        any::<[u8; 16]>(),
        hash32(),
        any::<u32>(),
        range(),
        tier(),
        origin(),
        hops,
        (
            proptest::collection::vec(any::<u8>(), 0..64),
            vec(hop(), 0..4),
            any::<bool>(),
        ),
    )
        .prop_map(
            |(
                session,
                model,
                shard,
                (start, end),
                tier,
                origin,
                downstream,
                (token, upstream, quic),
            )| {
                SessionHeader {
                    session: SessionId(session),
                    model: ModelDigest(model),
                    shard,
                    start,
                    end,
                    tier,
                    origin,
                    downstream,
                    token: bytes::Bytes::from(token),
                    upstream,
                    transport: if quic {
                        shardcast_protocol::HopTransport::Quic
                    } else {
                        shardcast_protocol::HopTransport::Tcp
                    },
                }
            },
        )
}

/// Error codes: every known code and unknown ones, always in their canonical form
/// (`ErrorCode::from_u16`), since `Other(v)` for a known `v` is not canonical.
pub(crate) fn error_code() -> impl Strategy<Value = ErrorCode> {
    prop_oneof![1u16..=11, any::<u16>(), Just(0u16), Just(u16::MAX)].prop_map(ErrorCode::from_u16)
}

/// Error messages: empty, short Unicode, and up to the maximum length.
fn message() -> impl Strategy<Value = String> {
    prop_oneof![
        Just(String::new()),
        ".{0,80}",
        proptest::string::string_regex(&format!("[a-z]{{{MAX_MESSAGE_LEN}}}")).expect("regex"),
    ]
}

/// Chunk payloads: empty, small, and a few KiB.
pub(crate) fn chunk_data() -> impl Strategy<Value = Bytes> {
    prop_oneof![
        Just(Vec::new()),
        vec(any::<u8>(), 0..64),
        vec(any::<u8>(), 0..8192)
    ]
    .prop_map(Bytes::from)
}

/// Every frame variant, each with random valid contents.
pub(crate) fn frame() -> impl Strategy<Value = Frame> {
    prop_oneof![
        (any::<u16>(), host_id()).prop_map(|(version, host)| Frame::Hello { version, host }),
        manifest().prop_map(Frame::Manifest),
        session_header().prop_map(Frame::Open),
        chunk_set().prop_map(|have| Frame::Accept { have }),
        (any::<u32>(), any::<u32>(), chunk_data()).prop_map(|(shard, index, data)| Frame::Chunk {
            shard,
            index,
            data
        }),
        (any::<u32>(), any::<u32>()).prop_map(|(shard, index)| Frame::Ack { shard, index }),
        (any::<u32>(), any::<u32>()).prop_map(|(shard, index)| Frame::Nack { shard, index }),
        (host_id(), any::<u32>(), any::<u32>(), any::<u32>()).prop_map(
            |(host, shard, verified, total)| Frame::Progress {
                host,
                shard,
                verified,
                total
            }
        ),
        (hash32(), any::<u32>(), range()).prop_map(|(model, shard, (start, end))| {
            Frame::Fetch {
                model: ModelDigest(model),
                shard,
                start,
                end,
            }
        }),
        Just(Frame::Done),
        Just(Frame::Keepalive),
        (any::<u32>(), any::<u32>(), vec(any::<[u8; 32]>(), 0..8))
            .prop_map(|(shard, index, cvs)| Frame::ChunkHead { shard, index, cvs }),
        (any::<u32>(), any::<u32>(), any::<u32>(), chunk_data()).prop_map(
            |(shard, index, piece, data)| Frame::Piece {
                shard,
                index,
                piece,
                data
            }
        ),
        (error_code(), message()).prop_map(|(code, message)| Frame::Error { code, message }),
    ]
}
