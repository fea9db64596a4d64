//! How fast, and at what CPU cost, one data connection on loopback carries bytes through
//! rustls's own stream (with the 64 KiB read buffer transferd put in front of it) and
//! through the record layer (`shardcast_identity::records`), alternating. Issue #28.
//!
//! ```sh
//! cargo run --release -p shardcast-identity --example data_path_rate -- 2 3
//! #                                                                      GiB rounds
//! ```

use std::sync::Arc;
use std::time::Instant;

use shardcast_identity::pki::{IssueRequest, PkiDir};
use shardcast_identity::{Alpn, DataConn, Expect, Identity, Role, TlsContext, TlsFiles};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

type Read = Box<dyn AsyncRead + Unpin + Send>;
type Write = Box<dyn AsyncWrite + Unpin + Send>;

fn halves(conn: DataConn) -> (Read, Write) {
    match conn {
        DataConn::Records(r, w) => (r, w),
        DataConn::Rustls(s) => {
            let (r, w) = tokio::io::split(s);
            (Box::new(r), Box::new(w))
        }
    }
}

/// CPU seconds this process has used (user + system).
fn cpu_s() -> f64 {
    let s = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    let f: Vec<&str> = s
        .rsplit(')')
        .next()
        .unwrap_or("")
        .split_whitespace()
        .collect();
    let ticks = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    (ticks(11) + ticks(12)) / 100.0
}

async fn run(
    server: Arc<TlsContext>,
    client: Arc<TlsContext>,
    records: bool,
    bytes: u64,
) -> (f64, f64) {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let rx = tokio::spawn(async move {
        let (tcp, _) = l.accept().await.unwrap();
        tcp.set_nodelay(true).unwrap();
        let conn = if records {
            server.accept_data(tcp).await.unwrap().0
        } else {
            let tcp = tokio::io::BufReader::with_capacity(64 << 10, tcp);
            DataConn::Rustls(Box::new(server.accept(tcp, Alpn::Data).await.unwrap().0))
        };
        let (mut r, _w) = halves(conn);
        let mut buf = vec![0u8; 1 << 20];
        let mut got = 0u64;
        while got < bytes {
            let n = r.read(&mut buf).await.unwrap();
            assert!(n > 0, "the stream ended early");
            got += n as u64;
        }
    });
    let tcp = TcpStream::connect(addr).await.unwrap();
    tcp.set_nodelay(true).unwrap();
    let expect = Expect::Role(Role::Host);
    let conn = if records {
        client.connect_data(tcp, &expect).await.unwrap().0
    } else {
        let tcp = tokio::io::BufReader::with_capacity(64 << 10, tcp);
        DataConn::Rustls(Box::new(
            client.connect(tcp, Alpn::Data, &expect).await.unwrap().0,
        ))
    };
    let (_r, mut w) = halves(conn);
    let chunk: Vec<u8> = (0..1u32 << 20).map(|i| (i * 7) as u8).collect();
    let (t0, c0) = (Instant::now(), cpu_s());
    let mut sent = 0u64;
    while sent < bytes {
        w.write_all(&chunk).await.unwrap();
        sent += chunk.len() as u64;
    }
    w.flush().await.unwrap();
    rx.await.unwrap();
    (t0.elapsed().as_secs_f64(), cpu_s() - c0)
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let args: Vec<String> = std::env::args().collect();
    let gib: u64 = args.get(1).and_then(|s| s.parse().ok()).unwrap_or(1);
    let rounds: usize = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(3);
    let dir = tempfile::tempdir().unwrap();
    let pki = PkiDir::new(dir.path().join("pki"));
    pki.init("bench CA", std::time::Duration::from_secs(3600))
        .unwrap();
    let ctx = |name: &str| {
        let leaf = pki
            .issue(&IssueRequest::new(Identity::new(Role::Host, name).unwrap()))
            .unwrap();
        TlsContext::load(TlsFiles {
            ca: pki.ca().cert,
            cert: leaf.cert,
            key: leaf.key,
        })
        .unwrap()
    };
    let (server, client) = (ctx("a"), ctx("b"));
    let bytes = gib << 30;
    for round in 1..=rounds {
        for records in [false, true] {
            let (s, cpu) = run(server.clone(), client.clone(), records, bytes).await;
            println!(
                "round {round} {:>13}: {:5.2} GB/s, {:.2} CPU-s/GB (both ends)",
                if records {
                    "record layer"
                } else {
                    "rustls stream"
                },
                bytes as f64 / s / 1e9,
                cpu / (bytes as f64 / 1e9)
            );
        }
    }
}
