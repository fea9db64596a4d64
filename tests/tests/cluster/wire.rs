//! Hostile peers on the data port: malformed frames get an `Error` frame and a closed
//! connection, and the daemon keeps serving everyone else.

use shardcast_protocol::codec::Codec;
use shardcast_protocol::{
    DataTier, ErrorCode, Frame, HostId, ModelDigest, PROTOCOL_VERSION, SessionHeader, SessionId,
};
use shardcast_tests::{Stream, TestCluster, hello, read_frames, tls_connect};
use tokio::io::AsyncWriteExt;

async fn connect_and_hello(addr: std::net::SocketAddr) -> Stream {
    let mut s = tls_connect(addr, "attacker").await.unwrap();
    s.write_all(&hello("attacker")).await.unwrap();
    s
}

fn error_code(frames: &[Frame]) -> Option<ErrorCode> {
    frames.iter().find_map(|f| match f {
        Frame::Error { code, .. } => Some(*code),
        _ => None,
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_frames_are_refused_and_the_daemon_keeps_serving() {
    let c = TestCluster::start(1, 4 * 1024 * 1024, 1, |_, _| {})
        .await
        .unwrap();
    let addr = c.daemons[1].data_addr;

    // A frame claiming 4 GiB.
    let mut s = connect_and_hello(addr).await;
    s.write_all(&[0xff, 0xff, 0xff, 0xff, 0x05]).await.unwrap();
    assert_eq!(
        error_code(&read_frames(&mut s).await),
        Some(ErrorCode::Malformed)
    );

    // An unknown frame type.
    let mut s = connect_and_hello(addr).await;
    s.write_all(&[0, 0, 0, 1, 0x7e]).await.unwrap();
    assert_eq!(
        error_code(&read_frames(&mut s).await),
        Some(ErrorCode::UnknownFrameType)
    );

    // Another protocol version.
    let mut s = tls_connect(addr, "future").await.unwrap();
    let mut out = Vec::new();
    Frame::Hello {
        version: PROTOCOL_VERSION + 7,
        host: HostId::new("future").unwrap(),
    }
    .encode(&mut out);
    s.write_all(&out).await.unwrap();
    assert_eq!(
        error_code(&read_frames(&mut s).await),
        Some(ErrorCode::UnsupportedVersion)
    );

    // A session whose `Open` is followed by another model's manifest, and one whose `Open`
    // is followed by something else.
    let (_, other) = c.import_on_source().await.unwrap();
    let open = |out: &mut Vec<u8>| {
        Frame::Open(SessionHeader {
            session: SessionId([1; 16]),
            model: ModelDigest([9; 32]),
            shard: 0,
            start: 0,
            end: 1,
            tier: DataTier::Memory,
            origin: String::new(),
            downstream: vec![],
            token: shardcast_tests::plan_token(ModelDigest([9; 32]), &["attacker", "recv-1"]),
            upstream: Vec::new(),
            transport: Default::default(),
        })
        .encode(out)
    };
    let mut s = connect_and_hello(addr).await;
    let mut out = Vec::new();
    open(&mut out);
    Frame::Manifest(other).encode(&mut out);
    s.write_all(&out).await.unwrap();
    assert_eq!(
        error_code(&read_frames(&mut s).await),
        Some(ErrorCode::UnknownModel)
    );
    let mut s = connect_and_hello(addr).await;
    let mut out = Vec::new();
    open(&mut out);
    Frame::Keepalive.encode(&mut out);
    s.write_all(&out).await.unwrap();
    assert_eq!(
        error_code(&read_frames(&mut s).await),
        Some(ErrorCode::ProtocolViolation)
    );

    // Garbage, then a peer that vanishes mid-frame.
    let mut s = connect_and_hello(addr).await;
    s.write_all(&[0, 0, 0, 50, 0x05, 1, 2, 3]).await.unwrap();
    drop(s);

    // The daemon still takes part in a chain.
    c.serves_a_chain().await.unwrap();
}
