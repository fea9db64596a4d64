//! One stream of `--size` bytes over loopback through three secure transports, each end its
//! own process on a multi-threaded tokio runtime, and what each end spent in CPU per GB:
//!
//! * `quinn`: the QUIC implementation transferd uses, with the windows transferd had when
//!   this was first run (16 MiB a stream; transferd's is now packet-sized, `stream_window`);
//! * `s2n`: AWS's s2n-quic (rustls for the handshake, aws-lc for packet protection), the
//!   same windows;
//! * `tls`: rustls over TCP through tokio-rustls (plain rustls, not transferd's record layer).
//!
//! Both QUIC stacks send packets of one fixed size (`--mtu`, the IP MTU; no discovery), with
//! UDP GSO/GRO where the kernel has them and 8 MiB socket buffers. Every transport runs
//! TLS 1.3 with AES-128-GCM. The sender writes the same 1 MiB `Bytes` over and over (no copy
//! on the way in, as transferd hands quinn its chunks); the receiver copies what arrives
//! into a 1 MiB buffer (as transferd's frame reader does) and hashes nothing. The question
//! it answers (issue #28, item 3): is QUIC's cost per byte on this machine quinn's, or any
//! user-space QUIC's at this packet size?
//!
//! `quic-impls run --impls quinn,s2n,tls --rounds 3 --size 2GiB --mtu 1500 --json F`

use std::io::{BufRead, BufReader, Write};
use std::net::{SocketAddr, UdpSocket};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, anyhow, bail};
use bytes::Bytes;
use clap::{Parser, Subcommand, ValueEnum};
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const CHUNK: usize = 1 << 20;
/// transferd's QUIC windows (`transport::quic`) as of 2026-12-03's first run: per stream,
/// per connection, in flight. (Whether quinn's compaction of a lagging stream, which a
/// CPU-bound transferd hit with this window, arises here was not checked.)
const STREAM_WINDOW: u32 = 16 << 20;
const CONNECTION_WINDOW: u32 = 64 << 20;
const UDP_BUFFER: usize = 8 << 20;
const IPV4_UDP_HEADERS: u16 = 28;
const ALPN: &[u8] = b"shardcast-experiment";

#[derive(Parser)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Impl {
    Quinn,
    S2n,
    Tls,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Crypto {
    /// ring (transferd's provider) for quinn and TLS; s2n-quic always protects packets with aws-lc
    Ring,
    /// aws-lc-rs for quinn and TLS too
    AwsLc,
}

#[derive(Subcommand)]
enum Cmd {
    /// Measure: each run starts a receiving process and sends to it
    Run {
        #[arg(long, value_delimiter = ',', default_value = "quinn,s2n,tls")]
        impls: Vec<Impl>,
        /// Bytes per run (e.g. 2GiB)
        #[arg(long, default_value = "2GiB", value_parser = quic_impls::parse_size)]
        size: u64,
        /// IP MTU of every QUIC packet (the UDP payload is 28 bytes less)
        #[arg(long, default_value_t = 1500)]
        mtu: u16,
        #[arg(long, value_enum, default_value = "ring")]
        crypto: Crypto,
        /// Rounds; each round runs every implementation once, in turn
        #[arg(long, default_value_t = 3)]
        rounds: usize,
        #[arg(long)]
        json: Option<PathBuf>,
    },
    /// The receiving end (started by `run`)
    Serve {
        #[arg(long, value_enum)]
        imp: Impl,
        #[arg(long)]
        dir: PathBuf,
        #[arg(long)]
        mtu: u16,
        #[arg(long, value_enum)]
        crypto: Crypto,
    },
}

/// User and system CPU seconds of this process so far (every thread).
fn cpu_seconds() -> (f64, f64) {
    // SAFETY: getrusage fills the struct it is given; a zeroed rusage is a valid value.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: RUSAGE_SELF with a valid pointer to an rusage.
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) };
    let t = |tv: libc::timeval| tv.tv_sec as f64 + tv.tv_usec as f64 / 1e6;
    (t(ru.ru_utime), t(ru.ru_stime))
}

fn provider(crypto: Crypto) -> Arc<rustls::crypto::CryptoProvider> {
    let mut p = match crypto {
        Crypto::Ring => rustls::crypto::ring::default_provider(),
        Crypto::AwsLc => rustls::crypto::aws_lc_rs::default_provider(),
    };
    p.cipher_suites
        .retain(|s| s.suite() == rustls::CipherSuite::TLS13_AES_128_GCM_SHA256);
    Arc::new(p)
}

fn certs(dir: &Path) -> anyhow::Result<Vec<rustls::pki_types::CertificateDer<'static>>> {
    use rustls::pki_types::pem::PemObject;
    rustls::pki_types::CertificateDer::pem_file_iter(dir.join("cert.pem"))?
        .collect::<Result<_, _>>()
        .context("reading cert.pem")
}

fn server_tls(dir: &Path, crypto: Crypto) -> anyhow::Result<rustls::ServerConfig> {
    use rustls::pki_types::pem::PemObject;
    let key = rustls::pki_types::PrivateKeyDer::from_pem_file(dir.join("key.pem"))?;
    let mut cfg = rustls::ServerConfig::builder_with_provider(provider(crypto))
        .with_protocol_versions(&[&rustls::version::TLS13])?
        .with_no_client_auth()
        .with_single_cert(certs(dir)?, key)?;
    cfg.alpn_protocols = vec![ALPN.to_vec()];
    Ok(cfg)
}

fn client_tls(dir: &Path, crypto: Crypto) -> anyhow::Result<rustls::ClientConfig> {
    let mut roots = rustls::RootCertStore::empty();
    for c in certs(dir)? {
        roots.add(c)?;
    }
    let mut cfg = rustls::ClientConfig::builder_with_provider(provider(crypto))
        .with_protocol_versions(&[&rustls::version::TLS13])?
        .with_root_certificates(roots)
        .with_no_client_auth();
    cfg.alpn_protocols = vec![ALPN.to_vec()];
    Ok(cfg)
}

fn udp_socket(addr: SocketAddr) -> anyhow::Result<UdpSocket> {
    use socket2::{Domain, Protocol, Socket, Type};
    let s = Socket::new(Domain::for_address(addr), Type::DGRAM, Some(Protocol::UDP))?;
    s.set_recv_buffer_size(UDP_BUFFER)?;
    s.set_send_buffer_size(UDP_BUFFER)?;
    s.set_nonblocking(true)?;
    s.bind(&addr.into())?;
    Ok(s.into())
}

fn quinn_transport(mtu: u16) -> Arc<quinn::TransportConfig> {
    let payload = mtu - IPV4_UDP_HEADERS;
    let mut t = quinn::TransportConfig::default();
    t.stream_receive_window(quinn::VarInt::from_u32(STREAM_WINDOW))
        .receive_window(quinn::VarInt::from_u32(CONNECTION_WINDOW))
        .send_window(u64::from(CONNECTION_WINDOW))
        .initial_mtu(payload)
        .min_mtu(payload)
        .mtu_discovery_config(None);
    Arc::new(t)
}

fn quinn_endpoint(
    mtu: u16,
    server: Option<quinn::ServerConfig>,
    addr: SocketAddr,
) -> anyhow::Result<quinn::Endpoint> {
    let mut ec = quinn::EndpointConfig::default();
    ec.max_udp_payload_size(mtu - IPV4_UDP_HEADERS)?;
    Ok(quinn::Endpoint::new(
        ec,
        server,
        udp_socket(addr)?,
        Arc::new(quinn::TokioRuntime),
    )?)
}

fn s2n_io(mtu: u16, addr: SocketAddr) -> anyhow::Result<s2n_quic::provider::io::tokio::Provider> {
    Ok(s2n_quic::provider::io::tokio::Builder::default()
        .with_receive_address(addr)?
        .with_max_mtu(mtu)?
        .with_initial_mtu(mtu)?
        .with_base_mtu(mtu)?
        .with_recv_buffer_size(UDP_BUFFER)?
        .with_send_buffer_size(UDP_BUFFER)?
        .build()?)
}

fn s2n_limits() -> anyhow::Result<s2n_quic::provider::limits::Limits> {
    fn e<T, E: std::fmt::Debug>(r: Result<T, E>) -> anyhow::Result<T> {
        r.map_err(|e| anyhow!("s2n-quic limits: {e:?}"))
    }
    let l = s2n_quic::provider::limits::Limits::new();
    let l = e(l.with_data_window(u64::from(CONNECTION_WINDOW)))?;
    let l = e(l.with_bidirectional_local_data_window(u64::from(STREAM_WINDOW)))?;
    let l = e(l.with_bidirectional_remote_data_window(u64::from(STREAM_WINDOW)))?;
    e(l.with_max_send_buffer_size(CONNECTION_WINDOW))
}

/// What the receiving end reports once every byte has arrived.
struct Received {
    bytes: u64,
    user_s: f64,
    sys_s: f64,
}

/// Reads the 8-byte length and then that many bytes into a 1 MiB buffer; the CPU spent from
/// the first byte on.
async fn receive<R: tokio::io::AsyncRead + Unpin>(r: &mut R) -> anyhow::Result<Received> {
    let expect = r.read_u64().await?;
    let (u0, s0) = cpu_seconds();
    let mut buf = vec![0u8; CHUNK];
    let mut got = 0u64;
    while got < expect {
        let want = usize::try_from((expect - got).min(CHUNK as u64))?;
        let n = r.read(&mut buf[..want]).await?;
        if n == 0 {
            bail!("stream ended after {got} of {expect} bytes");
        }
        got += n as u64;
    }
    let (u1, s1) = cpu_seconds();
    Ok(Received {
        bytes: got,
        user_s: u1 - u0,
        sys_s: s1 - s0,
    })
}

async fn serve(imp: Impl, dir: &Path, mtu: u16, crypto: Crypto) -> anyhow::Result<()> {
    let any: SocketAddr = "127.0.0.1:0".parse()?;
    let announce = |a: SocketAddr| {
        println!("listening {a}");
        std::io::stdout().flush()
    };
    let r = match imp {
        Impl::Quinn => {
            let crypto =
                quinn::crypto::rustls::QuicServerConfig::try_from(server_tls(dir, crypto)?)?;
            let mut sc = quinn::ServerConfig::with_crypto(Arc::new(crypto));
            sc.transport_config(quinn_transport(mtu));
            let ep = quinn_endpoint(mtu, Some(sc), any)?;
            announce(ep.local_addr()?)?;
            let conn = ep.accept().await.context("no connection")?.await?;
            let (mut send, mut recv) = conn.accept_bi().await?;
            let r = receive(&mut recv).await?;
            send.write_all(&[1]).await?;
            send.finish()?;
            conn.closed().await;
            r
        }
        Impl::S2n => {
            let tls = s2n_quic::provider::tls::rustls::Server::builder()
                .with_certificate(
                    dir.join("cert.pem").as_path(),
                    dir.join("key.pem").as_path(),
                )
                .and_then(|b| b.with_application_protocols([ALPN].iter()))
                .and_then(|b| b.build())
                .map_err(|e| anyhow!("s2n-quic server TLS: {e}"))?;
            let mut server = s2n_quic::Server::builder()
                .with_tls(tls)?
                .with_io(s2n_io(mtu, any)?)?
                .with_limits(s2n_limits()?)?
                .start()?;
            announce(server.local_addr()?)?;
            let mut conn = server.accept().await.context("no connection")?;
            let mut stream = conn
                .accept_bidirectional_stream()
                .await?
                .context("no stream")?;
            let r = receive(&mut stream).await?;
            stream.send(Bytes::from_static(&[1])).await?;
            stream.finish()?;
            // The client closes once it has the acknowledgement.
            while let Ok(Some(_)) = conn.accept_bidirectional_stream().await {}
            r
        }
        Impl::Tls => {
            let listener = tokio::net::TcpListener::bind(any).await?;
            announce(listener.local_addr()?)?;
            let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(server_tls(dir, crypto)?));
            let (tcp, _) = listener.accept().await?;
            let mut tls = acceptor.accept(tcp).await?;
            let r = receive(&mut tls).await?;
            tls.write_all(&[1]).await?;
            tls.flush().await?;
            let mut rest = Vec::new();
            let _ = tls.read_to_end(&mut rest).await;
            r
        }
    };
    println!(
        "{}",
        json!({"bytes": r.bytes, "user_s": r.user_s, "sys_s": r.sys_s})
    );
    Ok(())
}

/// Wall time and this process's CPU from `start` to `stop`.
struct Meter {
    t0: Instant,
    u0: f64,
    s0: f64,
}

impl Meter {
    fn start() -> Self {
        let (u0, s0) = cpu_seconds();
        Self {
            t0: Instant::now(),
            u0,
            s0,
        }
    }
    /// Seconds, user CPU seconds, system CPU seconds.
    fn stop(&self) -> (f64, f64, f64) {
        let secs = self.t0.elapsed().as_secs_f64();
        let (u1, s1) = cpu_seconds();
        (secs, u1 - self.u0, s1 - self.s0)
    }
}

/// The pieces of `size` bytes: one shared 1 MiB buffer, sliced (no copy).
fn pieces(size: u64) -> impl Iterator<Item = Bytes> {
    let payload = Bytes::from(vec![0x5a_u8; CHUNK]);
    let mut left = size;
    std::iter::from_fn(move || {
        (left > 0).then(|| {
            let n = left.min(CHUNK as u64) as usize;
            left -= n as u64;
            payload.slice(..n)
        })
    })
}

/// Sends `size` bytes (the 8-byte length first) and waits for the receiver's one-byte
/// acknowledgement; returns the seconds that took and this process's CPU meanwhile.
async fn client(
    imp: Impl,
    dir: &Path,
    mtu: u16,
    crypto: Crypto,
    addr: SocketAddr,
    size: u64,
) -> anyhow::Result<(f64, f64, f64)> {
    let any: SocketAddr = "127.0.0.1:0".parse()?;
    let mut one = [0u8; 1];
    match imp {
        Impl::Quinn => {
            let mut ep = quinn_endpoint(mtu, None, any)?;
            let crypto =
                quinn::crypto::rustls::QuicClientConfig::try_from(client_tls(dir, crypto)?)?;
            let mut cc = quinn::ClientConfig::new(Arc::new(crypto));
            cc.transport_config(quinn_transport(mtu));
            ep.set_default_client_config(cc);
            let conn = ep.connect(addr, "localhost")?.await?;
            let (mut tx, mut rx) = conn.open_bi().await?;
            let m = Meter::start();
            tx.write_u64(size).await?;
            for b in pieces(size) {
                tx.write_chunk(b).await?;
            }
            tx.finish()?;
            rx.read_exact(&mut one).await?;
            let r = m.stop();
            conn.close(0u32.into(), b"done");
            ep.wait_idle().await;
            Ok(r)
        }
        Impl::S2n => {
            let tls = s2n_quic::provider::tls::rustls::Client::builder()
                .with_certificate(dir.join("cert.pem").as_path())
                .map_err(|e| anyhow!("s2n-quic client certificate: {e}"))?
                .with_application_protocols([ALPN].iter())?
                .build()
                .map_err(|e| anyhow!("s2n-quic client TLS: {e}"))?;
            let client = s2n_quic::Client::builder()
                .with_tls(tls)?
                .with_io(s2n_io(mtu, any)?)?
                .with_limits(s2n_limits()?)?
                .start()?;
            let connect = s2n_quic::client::Connect::new(addr).with_server_name("localhost");
            let mut conn = client.connect(connect).await?;
            let mut stream = conn.open_bidirectional_stream().await?;
            let m = Meter::start();
            stream.write_u64(size).await?;
            for b in pieces(size) {
                stream.send(b).await?;
            }
            stream.finish()?;
            stream.read_exact(&mut one).await?;
            let r = m.stop();
            conn.close(0u32.into());
            Ok(r)
        }
        Impl::Tls => {
            let connector = tokio_rustls::TlsConnector::from(Arc::new(client_tls(dir, crypto)?));
            let tcp = tokio::net::TcpStream::connect(addr).await?;
            tcp.set_nodelay(true)?;
            let mut tls = connector.connect("localhost".try_into()?, tcp).await?;
            let m = Meter::start();
            tls.write_u64(size).await?;
            for b in pieces(size) {
                tls.write_all(&b).await?;
            }
            tls.flush().await?;
            tls.read_exact(&mut one).await?;
            let r = m.stop();
            tls.shutdown().await?;
            Ok(r)
        }
    }
}

fn run_one(
    exe: &Path,
    imp: Impl,
    dir: &Path,
    mtu: u16,
    crypto: Crypto,
    size: u64,
) -> anyhow::Result<serde_json::Value> {
    let mut child = Command::new(exe)
        .args(["serve", "--imp", &name(imp), "--mtu", &mtu.to_string()])
        .args(["--crypto", &name(crypto), "--dir"])
        .arg(dir)
        .stdout(Stdio::piped())
        .spawn()?;
    let mut out = BufReader::new(child.stdout.take().context("child stdout")?);
    let mut line = String::new();
    out.read_line(&mut line)?;
    let addr: SocketAddr = line
        .trim()
        .strip_prefix("listening ")
        .with_context(|| format!("receiver said {line:?}"))?
        .parse()?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let sent = rt.block_on(client(imp, dir, mtu, crypto, addr, size));
    drop(rt);
    let (secs, su, ss) = match sent {
        Ok(v) => v,
        Err(e) => {
            let _ = child.kill();
            let _ = child.wait();
            return Err(e);
        }
    };
    line.clear();
    out.read_line(&mut line)?;
    let status = child.wait()?;
    if !status.success() {
        bail!("{imp:?} receiver exited with {status}");
    }
    let rx: serde_json::Value =
        serde_json::from_str(line.trim()).with_context(|| format!("receiver's report {line:?}"))?;
    let gb = size as f64 / 1e9;
    let ru = rx["user_s"].as_f64().unwrap_or(f64::NAN);
    let rs = rx["sys_s"].as_f64().unwrap_or(f64::NAN);
    if rx["bytes"].as_u64() != Some(size) {
        bail!("{imp:?} receiver got {} of {size} bytes", rx["bytes"]);
    }
    Ok(json!({
        "impl": name(imp),
        "crypto": name(crypto),
        "mtu": mtu,
        "bytes": size,
        "seconds": secs,
        "gb_per_s": gb / secs,
        "sender_cpu_s_per_gb": (su + ss) / gb,
        "sender_user_s_per_gb": su / gb,
        "receiver_cpu_s_per_gb": (ru + rs) / gb,
        "receiver_user_s_per_gb": ru / gb,
    }))
}

/// A value's name on the command line (clap's).
fn name(v: impl ValueEnum) -> String {
    v.to_possible_value()
        .map_or_else(String::new, |p| p.get_name().to_string())
}

fn main() -> anyhow::Result<()> {
    match Cli::parse().cmd {
        Cmd::Serve {
            imp,
            dir,
            mtu,
            crypto,
        } => tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build()?
            .block_on(serve(imp, &dir, mtu, crypto)),
        Cmd::Run {
            impls,
            size,
            mtu,
            crypto,
            rounds,
            json,
        } => {
            if !(1280..=9000).contains(&mtu) {
                bail!("--mtu is 1280 to 9000, got {mtu}");
            }
            if mtu > 1500 && impls.contains(&Impl::Quinn) {
                // quinn puts up to 10 datagrams in one GSO send whatever their size, over
                // the kernel's 64 KiB for one UDP send, and drops the batch (quinn issue
                // #2201); transferd caps its batches (`GsoCapped`), this experiment does not.
                bail!("quinn above --mtu 1500 needs transferd's GSO cap: use --impls s2n,tls");
            }
            let dir = std::env::temp_dir().join(format!("quic-impls-{}", std::process::id()));
            std::fs::create_dir_all(&dir)?;
            let ck = rcgen::generate_simple_self_signed(vec!["localhost".to_string()])?;
            std::fs::write(dir.join("cert.pem"), ck.cert.pem())?;
            std::fs::write(dir.join("key.pem"), ck.signing_key.serialize_pem())?;
            let exe = std::env::current_exe()?;
            let mut all = Vec::new();
            for round in 1..=rounds {
                for &imp in &impls {
                    let r = run_one(&exe, imp, &dir, mtu, crypto, size)
                        .with_context(|| format!("round {round}, {imp:?}"))?;
                    eprintln!(
                        "round {round} {:>5}: {:.3} GB/s, sender {:.2} + receiver {:.2} CPU-s/GB",
                        name(imp),
                        r["gb_per_s"].as_f64().unwrap_or(0.0),
                        r["sender_cpu_s_per_gb"].as_f64().unwrap_or(0.0),
                        r["receiver_cpu_s_per_gb"].as_f64().unwrap_or(0.0),
                    );
                    all.push(r);
                }
            }
            let _ = std::fs::remove_dir_all(&dir);
            let report = json!({ "size": size, "mtu": mtu, "crypto": name(crypto), "runs": all });
            if let Some(p) = json {
                std::fs::write(&p, serde_json::to_string_pretty(&report)?)?;
            }
            Ok(())
        }
    }
}
