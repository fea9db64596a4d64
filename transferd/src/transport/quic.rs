//! QUIC between hops, over quinn: one connection per pair of hosts, one bidirectional
//! stream per (session, shard), the same frames as over TCP.
//!
//! - **Identity.** The connection's TLS 1.3 handshake uses this host's certificate and the
//!   cluster CA ([`TlsContext::server_config`] / [`TlsContext::client_config`], ALPN
//!   `shardcast/1`): the server requires a client certificate of the CA, and the dialler
//!   checks the server's identity against the hop its plan names, exactly as over TCP. A
//!   peer without a certificate is refused in the handshake, before any stream exists.
//!   Certificate reloads reach the listener ([`Quic::follow_reloads`]) and every new dial.
//! - **Connections.** [`Quic::connect`] keeps up to `quic_connections` (default 1)
//!   connections per (address, expected host), its lanes, and opens a stream for each
//!   session, shard and stripe on the next lane in turn. One connection is driven by one
//!   task: on a 16-core host one connection carried 0.6–0.7 GB/s whether it held one stream
//!   or eight (docs/BENCHMARKS.md); lanes spread a hop's streams over cores, at one
//!   handshake and one congestion controller per lane. Not the default: on a rate-capped
//!   emulated link four lanes lost 5.7% of the datagrams in one of two runs where one
//!   connection loses under 5% (`emulated_quic_chain_over_jumbo_frames…`), and what they
//!   gain on a many-core host is not measured yet. A connection
//!   whose peer died closes within [`IDLE_TIMEOUT`] (keep-alives every [`KEEP_ALIVE`]) and
//!   the next dial makes a new one; [`Quic::forget`] drops one at once when a stream on it
//!   failed its `Hello`.
//! - **Tuning** (the constants below, with their reasons): windows sized for high
//!   bandwidth-delay links, a stream's kept under quinn's compaction threshold in packets
//!   ([`stream_window`]), Cubic congestion control (as Linux TCP) starting from ten packets
//!   of the path's size ([`initial_window`], as TCP's ten segments), MTU discovery up to a
//!   1500-byte Ethernet frame ([`MTU_CEILING`]), UDP buffers of [`UDP_BUFFER`], GSO/GRO
//!   whenever the kernel offers them (quinn-udp probes; [`Offload`] says what this host
//!   got). The socket is wrapped (`GsoCapped`) so that no GSO batch exceeds one
//!   `sendmsg`'s 64 KiB, which quinn-udp would drop silently.
//! - **Jumbo frames.** A declared path MTU (`quic_path_mtu`) sends packets of that size from
//!   the first, with no discovery and no fallback; each dial and accept first checks the
//!   kernel's route MTU toward the peer (`IP_MTU` through rustix) and refuses with both
//!   figures.
//! - **Restarts.** The stateless-reset key is derived from the host key, so a restarted
//!   peer resets stale connections; the server configuration is rebuilt on certificate
//!   reload.
//! - **Statistics.** [`ConnTotals`] sums quinn's per-connection figures over live and closed
//!   connections (datagrams and bytes sent, transmits, packets declared lost, congestion
//!   events, the largest path MTU reached) for `/metrics`.
//! - **Copies.** The receiver's kernel copies datagrams out (`recvmmsg`, coalesced by GRO),
//!   quinn decrypts each packet in place and keeps stream data as slices of the datagram
//!   buffer, and [`QuicStream`]'s read copies it once into the frame's buffer: with BLAKE3
//!   and the store's `pwrite`, 3 copies and 2 passes, per packet (about 1453 bytes of
//!   payload, 8596 with jumbo frames) rather than per 16 KiB TLS record. The sender hands
//!   each payload to quinn as its `Bytes` (`write_chunk`); quinn copies it into datagrams,
//!   encrypts, and sends with GSO. Reading with `read_chunk` instead (no reassembly copy)
//!   was weighed and not built: BLAKE3 over packet-sized pieces loses its multi-chunk SIMD
//!   and costs more than the copy saves (`benches/chunk_hash.rs`: 316 µs per MiB more,
//!   against 230–300 µs for the copy; docs/BENCHMARKS.md).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use futures::future::BoxFuture;
use quinn::crypto::rustls::{QuicClientConfig, QuicServerConfig};
use shardcast_identity::tls::identity_of;
use shardcast_identity::{Alpn, Identity, Peer, Role, TlsContext};
use shardcast_protocol::HostId;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use super::CONNECT_TIMEOUT;
use crate::store::lock;
use crate::wire::{FrameSink, Halves};

/// Largest receive window of one stream, one (session, shard, stripe). Rationale: at
/// 100 Gbit/s and a 1 ms datacenter round trip (queueing included) the bandwidth-delay
/// product is 12.5 MB, and the chain keeps at most `window` (16 by default) 1 MiB chunks
/// unacknowledged: 16 MiB lets one stream run at line rate with the chain's window, not
/// QUIC's, as the limit. Packets of less than jumbo size get less ([`stream_window`]).
pub const STREAM_WINDOW: u32 = 16 << 20;
/// Packets' worth of data one stream's receive window holds at most ([`stream_window`]).
/// Rationale, measured (docs/BENCHMARKS.md, issue #28, nineteenth session): quinn keeps the
/// data a reader has not taken yet as one slice per packet, and once a stream holds more
/// than 2048 of them (`COMPACT_THRESHOLD` in quinn-proto 0.11's assembler) it copies them
/// all into one new buffer, of megabytes, which the allocator takes fresh from the kernel:
/// a second copy of every byte a busy reader lags by, and a page fault per 4 KiB. On a
/// loopback hop at 1472-byte packets that was 28 % of the receiver's CPU under perf; a
/// window of fewer packets than the threshold never reaches it (the receiver spent 16 %
/// less CPU per GB and the hop moved 15 % more). 1536 leaves a quarter for frames shorter
/// than a packet.
pub const STREAM_WINDOW_PACKETS: u32 = 1536;
/// Packets a new connection may send before its first acknowledgement: Cubic's initial
/// window is this many packets of the path's size ([`initial_window`]). Rationale, measured
/// (docs/BENCHMARKS.md, issue #28, twentieth session): quinn's default is 12 000 bytes
/// whatever the packet size (RFC 9002 §7.2's ten packets, capped at 14 720 bytes for the
/// Internet), which is one and a third packets of 8972 bytes. Slow start from there sends
/// one or two packets a round trip, and a lone packet waits out the receiver's delayed
/// acknowledgement (25 ms): on the emulated cluster with jumbo frames the first chunk of a
/// fresh 8-receiver chain reached the last receiver after 0.21–0.25 s, about 30 ms a hop,
/// against 0.05–0.07 s over TCP, whose initial window is ten segments of its own MSS (89 KB
/// on the same links). Ten packets of the declared size, as TCP: 0.07–0.09 s, and a 16 MiB
/// chain in 0.21–0.23 s instead of 0.33–0.39 (TCP 0.17–0.19). At 1472-byte packets it is
/// RFC 9002's 14 720 bytes, and nothing measurable changed.
pub const INITIAL_WINDOW_PACKETS: u64 = 10;
/// Receive window of a connection (every stream between two hosts). Rationale: four shards
/// streaming at once at [`STREAM_WINDOW`]; it also bounds what one authenticated peer can make
/// this host buffer ahead of the frame budget.
pub const CONNECTION_WINDOW: u32 = 64 << 20;
/// Bytes in flight on one connection, every stream together: the same as the receive window.
pub const SEND_WINDOW: u64 = CONNECTION_WINDOW as u64;
/// Streams a peer may have open at once on one connection. Rationale: one per (session,
/// shard) an upstream runs to this host, the same bound as `max_connections_per_ip` for TCP.
pub const MAX_STREAMS: u32 = 1024;
/// Keep-alive period of an idle connection. Rationale: a few bytes a second keep an idle
/// connection (and any NAT or firewall state) alive, so the next session reuses it.
pub const KEEP_ALIVE: Duration = Duration::from_secs(1);
/// The round trip a connection assumes until it has measured one (the handshake's). quinn's
/// default is RFC 9002's 333 ms, meant for the Internet: a handshake packet lost then waits
/// a probe timeout of three times that, 1 s and then 2 s, so two losses in the handshake
/// outlast the 2 s a forwarder gives a new hop to answer, and a live host was skipped
/// (found on the emulated cluster at 10–15 % loss, and once at 2 % in CI). Hosts of one
/// cluster are a millisecond or less apart: 20 ms puts the handshake's probes 60 ms apart
/// (doubling), and a real round trip longer than that costs a few repeated handshake
/// packets, not a failure. The first sample replaces it.
pub const INITIAL_RTT: Duration = Duration::from_millis(20);
/// A connection that hears nothing for this long is closed, with its streams. Rationale:
/// five missed keep-alives; a peer that was killed or restarted is forgotten within 5 s,
/// while the chain's own stall detection (2 s) has long since bypassed it.
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(5);
/// Largest UDP payload MTU discovery probes for, and the largest this endpoint accepts
/// (advertised to peers). Rationale, measured (docs/BENCHMARKS.md, issue #16 step 4): a
/// 1500-byte Ethernet frame less the IPv4 and UDP headers. An earlier ceiling of 8952 (jumbo
/// frames) never took effect, because quinn's endpoint default capped the accepted payload
/// at 1472; raised for real, on loopback, quinn's black-hole detection took the congestion
/// losses of large packets for a black hole and fell back to 1200-byte packets for the rest
/// of the transfer, and with a short cool-down the large packets were lost 3× as often.
pub const MTU_CEILING: u16 = 1472;
/// Bytes of an IPv4 frame's MTU that are headers, not UDP payload (IPv4 20 + UDP 8).
pub const IPV4_UDP_HEADERS: u16 = 28;
/// The same over IPv6 (IPv6 40 + UDP 8).
pub const IPV6_UDP_HEADERS: u16 = 48;
/// Smallest `quic_path_mtu` accepted: QUIC's own minimum UDP payload (RFC 9000 §14).
pub const MIN_PATH_MTU: u16 = 1200;
/// Largest `quic_path_mtu` accepted: the largest UDP payload QUIC can advertise.
pub const MAX_PATH_MTU: u16 = 65527;
/// Socket buffer sizes asked for. Rationale: a window's worth of datagrams can arrive while
/// the endpoint task is busy; the kernel default (about 208 KiB) drops packets at Gbit/s
/// rates. The kernel caps the value at `net.core.{r,w}mem_max`; [`Offload`] reports what
/// was granted.
pub const UDP_BUFFER: usize = 8 << 20;
/// SNI sent by clients (servers are identified by their certificate's identity, not a name).
const SERVER_NAME: &str = "shardcast.cluster";

/// What this host's UDP socket got from the kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct Offload {
    /// Datagrams sent per `sendmsg` with UDP GSO (1: none).
    pub gso_segments: usize,
    /// Datagrams received per `recvmsg` with UDP GRO (1: none).
    pub gro_segments: usize,
    /// Receive buffer in bytes.
    pub recv_buffer: usize,
    /// Send buffer in bytes.
    pub send_buffer: usize,
}

/// Counters of the QUIC endpoint (exported on `/metrics`).
#[derive(Debug, Default)]
pub struct QuicStats {
    /// Connections this host dialled.
    pub dialled: AtomicU64,
    /// Connections accepted (handshake completed).
    pub accepted: AtomicU64,
    /// Incoming connections refused in the handshake (no certificate, another CA,
    /// expired, not a `host`) or that did not finish it in time.
    pub refused: AtomicU64,
    /// Streams opened on this host's connections (one per session and shard sent).
    pub streams_opened: AtomicU64,
    /// Streams accepted from peers.
    pub streams_accepted: AtomicU64,
    /// Dialled connections reused for a new stream.
    pub reused: AtomicU64,
    /// Dials and incoming connections refused because this host's route to the peer
    /// carries less than the declared `quic_path_mtu`.
    pub path_mtu_refused: AtomicU64,
    /// What quinn counts on this host's connections, live and closed.
    pub conns: Arc<ConnTotals>,
}

/// quinn's per-connection statistics summed over this host's QUIC connections: those that
/// have closed (added when they close) and those still open (read when asked).
#[derive(Debug, Default)]
pub struct ConnTotals {
    closed: Mutex<QuicTotals>,
    live: Mutex<Vec<quinn::Connection>>,
}

/// Sums of quinn's connection statistics ([`ConnTotals::totals`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct QuicTotals {
    /// UDP datagrams received.
    pub rx_datagrams: u64,
    /// UDP datagrams sent.
    pub tx_datagrams: u64,
    /// Bytes in them (UDP payload).
    pub tx_bytes: u64,
    /// Transmits that carried them (one `sendmsg` each): datagrams per transmit above 1
    /// means GSO worked. (quinn counts receives per packet, not per call, so GRO does not
    /// show in its statistics.)
    pub tx_ios: u64,
    /// Packets declared lost.
    pub lost_packets: u64,
    /// Congestion events (the window was cut).
    pub congestion_events: u64,
    /// The largest UDP payload any connection's MTU discovery reached, bytes.
    pub max_mtu: u64,
}

impl QuicTotals {
    fn add(&mut self, st: &quinn::ConnectionStats) {
        self.rx_datagrams += st.udp_rx.datagrams;
        self.tx_datagrams += st.udp_tx.datagrams;
        self.tx_bytes += st.udp_tx.bytes;
        self.tx_ios += st.udp_tx.ios;
        self.lost_packets += st.path.lost_packets;
        self.congestion_events += st.path.congestion_events;
        self.max_mtu = self.max_mtu.max(u64::from(st.path.current_mtu));
    }
}

impl ConnTotals {
    /// Counts `conn` from now on: live until it closes, then in the closed totals (spawns
    /// the watcher, so it needs a runtime).
    fn watch(self: &Arc<Self>, conn: &quinn::Connection) {
        lock(&self.live).push(conn.clone());
        let (me, conn) = (self.clone(), conn.clone());
        tokio::spawn(async move {
            conn.closed().await;
            let st = conn.stats();
            // Moved from live to closed under both locks, so a reader never counts it
            // twice or not at all.
            let mut live = lock(&me.live);
            live.retain(|c| c.stable_id() != conn.stable_id());
            lock(&me.closed).add(&st);
            drop(live);
            debug!(
                rx_datagrams = st.udp_rx.datagrams,
                tx_datagrams = st.udp_tx.datagrams,
                tx_ios = st.udp_tx.ios,
                lost_packets = st.path.lost_packets,
                congestion_events = st.path.congestion_events,
                mtu = st.path.current_mtu,
                rtt_us = st.path.rtt.as_micros() as u64,
                "QUIC connection closed"
            );
        });
    }

    /// The sums over every connection, live and closed.
    pub fn totals(&self) -> QuicTotals {
        let live = lock(&self.live);
        let mut t = *lock(&self.closed);
        for c in live.iter() {
            t.add(&c.stats());
        }
        t
    }
}

/// Why an incoming QUIC connection was not established.
#[derive(Debug, thiserror::Error)]
pub enum QuicAcceptError {
    /// The handshake failed (no certificate, another CA, expired, wrong protocol…).
    #[error("QUIC handshake failed: {0}")]
    Handshake(#[from] quinn::ConnectionError),
    /// The handshake did not finish in time.
    #[error("QUIC handshake timed out after {0:?}")]
    Timeout(Duration),
    /// The peer's certificate holds no usable identity, or not a host's.
    #[error("peer certificate: {0}")]
    Identity(#[from] PeerIdentityError),
    /// This host's route to the peer carries less than the declared `quic_path_mtu` (or
    /// could not be asked).
    #[error("{0}")]
    PathMtu(#[source] std::io::Error),
}

/// Why a QUIC peer's certificate chain gives no identity this host accepts.
#[derive(Debug, thiserror::Error)]
pub enum PeerIdentityError {
    /// No certificate chain.
    #[error("the peer presented no certificate")]
    NoCertificate,
    /// The leaf certificate names no valid identity.
    #[error(transparent)]
    Certificate(#[from] shardcast_identity::IdentityError),
    /// The identity is not the one dialled.
    #[error(transparent)]
    Unexpected(#[from] shardcast_identity::tls::TlsError),
    /// The peer is not a host.
    #[error("{0} is not a host")]
    NotHost(Identity),
}

/// A route whose MTU cannot carry the declared `quic_path_mtu`; says what to change.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "quic_path_mtu {declared} needs an MTU of {needed} bytes toward {peer}, but this \
     host's route to it has {route_mtu}: lower quic_path_mtu to {} or raise the link's MTU",
    .route_mtu.saturating_sub(*.headers)
)]
pub struct PathMtuError {
    /// The peer.
    pub peer: SocketAddr,
    /// The declared UDP payload size.
    pub declared: u16,
    /// The MTU that payload needs with the headers.
    pub needed: u32,
    /// The MTU of this host's route to the peer.
    pub route_mtu: u32,
    /// IP and UDP header bytes.
    pub headers: u32,
}

/// A connection slot: dials to one (address, host) are serialised, so sessions that start
/// together share one connection instead of racing to make several. The connection is held
/// with its server's identity, checked once when it was dialled.
type Slot = Arc<tokio::sync::Mutex<Option<(quinn::Connection, Identity)>>>;

/// Held connection slots, and when slots of closed connections were last dropped.
struct Conns {
    /// By the address as plans name it, the host expected there, and the lane.
    slots: HashMap<(String, Option<HostId>, usize), Slot>,
    swept: std::time::Instant,
}

/// This host's QUIC endpoint: the listener on the data port's number (UDP) and the dialler.
pub struct Quic {
    endpoint: quinn::Endpoint,
    tls: Arc<TlsContext>,
    transport: Arc<quinn::TransportConfig>,
    /// The declared path MTU (`quic_path_mtu`), checked against the route to each peer.
    path_mtu: Option<u16>,
    /// Held connections by the address as plans name it (`host:port`, a name or an IP),
    /// the host expected there, and the lane (`0..lanes`).
    conns: Mutex<Conns>,
    /// Connections kept to each peer (`quic_connections`); streams take them in turn.
    lanes: usize,
    /// The next stream's lane (taken modulo `lanes`).
    next_lane: AtomicU64,
    offload: Offload,
    /// Counters.
    pub stats: QuicStats,
}

impl std::fmt::Debug for Quic {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Quic")
            .field("local", &self.endpoint.local_addr().ok())
            .field("offload", &self.offload)
            .finish()
    }
}

/// The transport parameters of every connection (see the constants for the values).
/// `path_mtu`: the UDP payload size the operator declares every path carries (jumbo
/// frames); packets start at that size and never fall below it, and discovery is off. Why
/// not discover it: on a congested link quinn's black-hole detection takes the losses of
/// large packets for a black hole and drops to 1200 bytes for the rest of the transfer
/// (BENCHMARKS, issue #16 step 4), so only a declared size holds jumbo packets under load.
fn transport_config(path_mtu: Option<u16>) -> quinn::TransportConfig {
    let payload = path_mtu.unwrap_or(MTU_CEILING);
    let stream = stream_window(payload);
    let mut cubic = quinn::congestion::CubicConfig::default();
    cubic.initial_window(initial_window(payload));
    let mut t = quinn::TransportConfig::default();
    t.congestion_controller_factory(Arc::new(cubic));
    t.stream_receive_window(quinn::VarInt::from_u32(stream))
        .receive_window(quinn::VarInt::from_u32(CONNECTION_WINDOW))
        .send_window(SEND_WINDOW)
        .max_concurrent_bidi_streams(quinn::VarInt::from_u32(MAX_STREAMS))
        .max_concurrent_uni_streams(quinn::VarInt::from_u32(0))
        .initial_rtt(INITIAL_RTT)
        .keep_alive_interval(Some(KEEP_ALIVE))
        .max_idle_timeout(Some(
            quinn::IdleTimeout::try_from(IDLE_TIMEOUT).expect("5 s is a valid idle timeout"),
        ));
    match path_mtu {
        Some(m) => {
            t.initial_mtu(m).min_mtu(m).mtu_discovery_config(None);
        }
        None => {
            let mut mtu = quinn::MtuDiscoveryConfig::default();
            mtu.upper_bound(MTU_CEILING);
            t.mtu_discovery_config(Some(mtu));
        }
    }
    t
}

/// The receive window of one stream whose packets carry at most `payload` bytes of UDP
/// payload: [`STREAM_WINDOW_PACKETS`] packets' worth, at most [`STREAM_WINDOW`]. 2.2 MB at
/// 1472-byte packets (one stream then runs at up to 17 Gbit/s over a 1 ms round trip, and a
/// hop's stripes each have their own), 13.8 MB at 8972.
pub fn stream_window(payload: u16) -> u32 {
    (STREAM_WINDOW_PACKETS * u32::from(payload)).min(STREAM_WINDOW)
}

/// Cubic's initial window, in bytes, for packets of at most `payload` bytes of UDP payload:
/// [`INITIAL_WINDOW_PACKETS`] packets (14 720 bytes at 1472, 89 720 at 8972).
pub fn initial_window(payload: u16) -> u64 {
    INITIAL_WINDOW_PACKETS * u64::from(payload)
}

fn server_config(
    tls: &TlsContext,
    transport: &Arc<quinn::TransportConfig>,
) -> std::io::Result<quinn::ServerConfig> {
    let crypto = QuicServerConfig::try_from(tls.server_config(Alpn::Data))
        .map_err(|e| std::io::Error::other(format!("QUIC server TLS configuration: {e}")))?;
    let mut cfg = quinn::ServerConfig::with_crypto(Arc::new(crypto));
    cfg.transport_config(transport.clone());
    // Hosts do not move: a packet from another address is not this connection's.
    cfg.migration(false);
    Ok(cfg)
}

/// A UDP socket bound to `addr` with [`UDP_BUFFER`]-sized buffers (as far as the kernel
/// grants them).
fn udp_socket(addr: SocketAddr) -> std::io::Result<std::net::UdpSocket> {
    use socket2::{Domain, Protocol, Socket, Type};
    let socket = Socket::new(Domain::for_address(addr), Type::DGRAM, Some(Protocol::UDP))?;
    // Best effort: the kernel clamps, and a smaller buffer only costs drops, not function.
    let _ = socket.set_recv_buffer_size(UDP_BUFFER);
    let _ = socket.set_send_buffer_size(UDP_BUFFER);
    socket.set_nonblocking(true)?;
    socket.bind(&addr.into())?;
    Ok(socket.into())
}

/// Checks that this host's route to `peer` carries datagrams of `declared` bytes of UDP
/// payload (`quic_path_mtu`), as the kernel knows it (`IP_MTU` of a socket connected to the
/// peer: the interface's or route's MTU, or a smaller path MTU it has learnt). Why: with
/// the path MTU declared, discovery is off, and a packet larger than the route carries is
/// refused by the kernel with `EMSGSIZE`, which quinn-udp swallows; the connection would hang
/// until its idle timeout with nothing said. Paths beyond this host's first hop are the
/// operator's promise.
///
/// # Errors
///
/// The route's MTU is too small (the message says both figures), or the kernel could not
/// say (no route).
fn check_route_mtu(peer: SocketAddr, declared: u16) -> std::io::Result<()> {
    let local: SocketAddr = if peer.is_ipv4() {
        (std::net::Ipv4Addr::UNSPECIFIED, 0).into()
    } else {
        (std::net::Ipv6Addr::UNSPECIFIED, 0).into()
    };
    let probe = std::net::UdpSocket::bind(local)?;
    probe.connect(peer)?;
    let (route, headers) = if peer.is_ipv4() {
        (rustix::net::sockopt::ip_mtu(&probe)?, IPV4_UDP_HEADERS)
    } else {
        (rustix::net::sockopt::ipv6_mtu(&probe)?, IPV6_UDP_HEADERS)
    };
    path_mtu_fits(peer, declared, route, u32::from(headers)).map_err(std::io::Error::other)
}

/// Whether a route of `route_mtu` bytes carries `declared` bytes of UDP payload after
/// `headers` bytes of IP and UDP headers; the refusal says what to change.
fn path_mtu_fits(
    peer: SocketAddr,
    declared: u16,
    route_mtu: u32,
    headers: u32,
) -> Result<(), PathMtuError> {
    let needed = u32::from(declared) + headers;
    if route_mtu >= needed {
        return Ok(());
    }
    Err(PathMtuError {
        peer,
        declared,
        needed,
        route_mtu,
        headers,
    })
}

/// The most UDP payload one `sendmsg` may carry over IPv4 (65535 less the IPv4 and UDP
/// headers): a GSO batch is one UDP datagram to the kernel until the device cuts it.
const MAX_GSO_BYTES: usize = 65507;

/// How many datagrams of `payload` bytes one GSO send may carry.
fn gso_segments_for(payload: u16) -> usize {
    (MAX_GSO_BYTES / usize::from(payload.max(1))).max(1)
}

/// quinn's UDP socket with its GSO batches capped at what one `sendmsg` can carry.
///
/// Why: quinn batches up to 10 datagrams per send whatever their size, and quinn-udp treats
/// the kernel's `EMSGSIZE` as an MTU probe's expected failure, so it drops the whole batch
/// without a word (quinn issue #2201, a fix in PR #2653 not merged). With jumbo packets
/// (`quic_path_mtu` 8972) a batch of 10 is 89 KB, over the 64 KiB limit: on the emulated
/// cluster a third of all packets vanished that way (BENCHMARKS, issue #16 step 5). At
/// quinn's default packet size (1472 bytes, 10 per batch) the cap changes nothing.
#[derive(Debug)]
struct GsoCapped {
    inner: Arc<dyn quinn::AsyncUdpSocket>,
    max_segments: usize,
}

impl quinn::AsyncUdpSocket for GsoCapped {
    fn create_io_poller(self: Arc<Self>) -> Pin<Box<dyn quinn::UdpPoller>> {
        self.inner.clone().create_io_poller()
    }

    fn try_send(&self, transmit: &quinn::udp::Transmit<'_>) -> std::io::Result<()> {
        self.inner.try_send(transmit)
    }

    fn poll_recv(
        &self,
        cx: &mut Context<'_>,
        bufs: &mut [std::io::IoSliceMut<'_>],
        meta: &mut [quinn::udp::RecvMeta],
    ) -> Poll<std::io::Result<usize>> {
        self.inner.poll_recv(cx, bufs, meta)
    }

    fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.inner.local_addr()
    }

    fn max_transmit_segments(&self) -> usize {
        self.inner.max_transmit_segments().min(self.max_segments)
    }

    fn max_receive_segments(&self) -> usize {
        self.inner.max_receive_segments()
    }

    fn may_fragment(&self) -> bool {
        self.inner.may_fragment()
    }
}

/// The key of this host's stateless-reset tokens, derived from its private key (BLAKE3 in
/// derive-key mode: one-way, and distinct from every other use of the key). A restarted
/// transferd derives the same key, so a peer still holding a connection to its previous
/// run gets a valid stateless reset (RFC 9000 §10.3) at its next packet and dials anew at
/// once, instead of waiting out [`IDLE_TIMEOUT`] — as TCP learns from a reset. A new key
/// file changes the key; connections from before it then end by the idle timeout.
fn reset_key(tls: &TlsContext) -> std::io::Result<Arc<dyn quinn::crypto::HmacKey>> {
    let path = &tls.files().key;
    let secret = std::fs::read(path)
        .map_err(|e| std::io::Error::new(e.kind(), format!("reading {}: {e}", path.display())))?;
    let key = blake3::derive_key("shardcast 2026-11 QUIC stateless reset key", &secret);
    Ok(Arc::new(ring::hmac::Key::new(
        ring::hmac::HMAC_SHA256,
        &key,
    )))
}

/// The host identity in a QUIC connection's peer certificate chain.
fn peer_identity(conn: &quinn::Connection) -> Result<Identity, PeerIdentityError> {
    let certs = conn
        .peer_identity()
        .and_then(|any| {
            any.downcast::<Vec<rustls::pki_types::CertificateDer<'static>>>()
                .ok()
        })
        .ok_or(PeerIdentityError::NoCertificate)?;
    let leaf = certs.first().ok_or(PeerIdentityError::NoCertificate)?;
    Ok(identity_of(leaf)?)
}

impl Quic {
    /// Binds the endpoint (UDP) on `addr`, serving and dialling with `tls`'s identity.
    /// `path_mtu`: the UDP payload size every path is declared to carry (`quic_path_mtu`),
    /// or `None` to discover it up to [`MTU_CEILING`].
    /// `lanes`: the connections kept to each peer (`quic_connections`, at least 1), which
    /// the streams to that peer take in turn.
    pub fn bind(
        addr: SocketAddr,
        tls: Arc<TlsContext>,
        path_mtu: Option<u16>,
        lanes: usize,
    ) -> std::io::Result<Arc<Self>> {
        let socket = udp_socket(addr)
            .map_err(|e| std::io::Error::new(e.kind(), format!("QUIC listener {addr}: {e}")))?;
        let sref = socket2::SockRef::from(&socket);
        let (recv_buffer, send_buffer) = (
            sref.recv_buffer_size().unwrap_or(0),
            sref.send_buffer_size().unwrap_or(0),
        );
        let state = quinn::udp::UdpSocketState::new((&socket).into())?;
        let offload = Offload {
            gso_segments: state.max_gso_segments(),
            gro_segments: state.gro_segments(),
            recv_buffer,
            send_buffer,
        };
        let transport = Arc::new(transport_config(path_mtu));
        let mut endpoint_config = quinn::EndpointConfig::new(reset_key(&tls)?);
        // The largest datagram this endpoint accepts, advertised to peers as the
        // `max_udp_payload_size` transport parameter: the same ceiling as MTU discovery's
        // (a larger discovery bound alone has no effect), or the declared path MTU.
        let max_payload = path_mtu.map_or(MTU_CEILING, |m| m.max(MTU_CEILING));
        endpoint_config
            .max_udp_payload_size(max_payload)
            .map_err(|e| std::io::Error::other(format!("QUIC max UDP payload: {e}")))?;
        let runtime = Arc::new(quinn::TokioRuntime);
        let socket = Arc::new(GsoCapped {
            inner: quinn::Runtime::wrap_udp_socket(&*runtime, socket)?,
            max_segments: gso_segments_for(max_payload),
        });
        let endpoint = quinn::Endpoint::new_with_abstract_socket(
            endpoint_config,
            Some(server_config(&tls, &transport)?),
            socket,
            runtime,
        )?;
        Ok(Arc::new(Self {
            endpoint,
            tls,
            transport,
            path_mtu,
            conns: Mutex::new(Conns {
                slots: HashMap::new(),
                swept: std::time::Instant::now(),
            }),
            lanes: lanes.max(1),
            next_lane: AtomicU64::new(0),
            offload,
            stats: QuicStats::default(),
        }))
    }

    /// The bound UDP address.
    pub fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.endpoint.local_addr()
    }

    /// What the kernel granted the socket.
    pub fn offload(&self) -> Offload {
        self.offload
    }

    /// Rebuilds the listener's TLS configuration after every certificate reload, until
    /// `cancel`.
    pub fn follow_reloads(self: &Arc<Self>, cancel: CancellationToken) {
        let me = self.clone();
        let mut reloads = self.tls.watch_reloads();
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    _ = cancel.cancelled() => return,
                    changed = reloads.changed() => if changed.is_err() { return },
                }
                match server_config(&me.tls, &me.transport) {
                    Ok(cfg) => me.endpoint.set_server_config(Some(cfg)),
                    Err(e) => warn!("QUIC listener keeps its previous certificate: {e}"),
                }
            }
        });
    }

    /// Opens a stream to the hop at `addr` (`host:port`, UDP), on the connection already
    /// held to it in the next lane or a new one; the server must be a `host`, exactly
    /// `expect` when given. Successive streams to one peer take the lanes in turn, so a
    /// hop's shards and stripes are spread over `lanes` connections, each with its own
    /// driver task (its encryption on its own core) and congestion controller.
    pub async fn connect(
        &self,
        addr: &str,
        expect: Option<&HostId>,
    ) -> std::io::Result<(QuicStream, Peer)> {
        let lane = (self.next_lane.fetch_add(1, Ordering::Relaxed) % self.lanes as u64) as usize;
        let slot = {
            let mut conns = lock(&self.conns);
            // Slots of closed connections (and failed dials) go, at most once per idle
            // timeout: a connection closes within that anyway, and a dial does not scan
            // every peer's slot.
            if conns.swept.elapsed() >= IDLE_TIMEOUT {
                conns.slots.retain(|_, s| {
                    s.try_lock()
                        .map_or(true, |c| c.as_ref().is_some_and(|(c, _)| live(c)))
                });
                conns.swept = std::time::Instant::now();
            }
            conns
                .slots
                .entry((addr.to_string(), expect.cloned(), lane))
                .or_default()
                .clone()
        };
        let mut held = slot.lock().await;
        // The held connection first; if it is gone (it cannot open a stream), one new one.
        if let Some((conn, id)) = held.as_ref().filter(|(c, _)| live(c)) {
            match self.open_stream(addr, conn, id).await {
                Ok(s) => {
                    self.stats.reused.fetch_add(1, Ordering::Relaxed);
                    return Ok(s);
                }
                Err(e) if e.kind() == std::io::ErrorKind::TimedOut => return Err(e),
                Err(e) => debug!(%addr, "held QUIC connection is gone ({e}); dialling again"),
            }
        }
        let (conn, id) = self.dial(addr, expect).await?;
        *held = Some((conn.clone(), id.clone()));
        self.open_stream(addr, &conn, &id).await
    }

    /// A new stream on `conn`, whose server is `id`.
    async fn open_stream(
        &self,
        addr: &str,
        conn: &quinn::Connection,
        id: &Identity,
    ) -> std::io::Result<(QuicStream, Peer)> {
        match tokio::time::timeout(CONNECT_TIMEOUT, conn.open_bi()).await {
            Ok(Ok((send, recv))) => {
                self.stats.streams_opened.fetch_add(1, Ordering::Relaxed);
                Ok((QuicStream { send, recv }, Peer::Cert(id.clone())))
            }
            Ok(Err(e)) => Err(std::io::Error::other(format!("{addr}: {e}"))),
            Err(_) => Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!(
                    "{addr}: no QUIC stream within {CONNECT_TIMEOUT:?} (the peer's stream limit)"
                ),
            )),
        }
    }

    /// A new connection to `addr`, its server checked against `expect`; returns it with the
    /// server's identity.
    async fn dial(
        &self,
        addr: &str,
        expect: Option<&HostId>,
    ) -> std::io::Result<(quinn::Connection, Identity)> {
        let target = resolve(addr).await?;
        if let Some(m) = self.path_mtu
            && let Err(e) = check_route_mtu(target, m)
        {
            self.stats.path_mtu_refused.fetch_add(1, Ordering::Relaxed);
            warn!(%addr, "QUIC dial refused: {e}");
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!("{addr}: {e}"),
            ));
        }
        let crypto = QuicClientConfig::try_from(self.tls.client_config(Alpn::Data))
            .map_err(|e| std::io::Error::other(format!("QUIC client TLS configuration: {e}")))?;
        let mut cfg = quinn::ClientConfig::new(Arc::new(crypto));
        cfg.transport_config(self.transport.clone());
        let connecting = self
            .endpoint
            .connect_with(cfg, target, SERVER_NAME)
            .map_err(|e| std::io::Error::other(format!("{addr}: {e}")))?;
        let conn = match tokio::time::timeout(CONNECT_TIMEOUT, connecting).await {
            Err(_) => {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!("QUIC connect to {addr} timed out after {CONNECT_TIMEOUT:?}"),
                ));
            }
            Ok(Err(e)) => {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::PermissionDenied,
                    format!("{addr}: QUIC handshake: {e}"),
                ));
            }
            Ok(Ok(c)) => c,
        };
        let expect = super::expect_host(expect)?;
        let checked = peer_identity(&conn).and_then(|id| {
            expect
                .check(&id)
                .map(|()| id)
                .map_err(PeerIdentityError::from)
        });
        let id = match checked {
            Ok(id) => id,
            Err(e) => {
                self.tls
                    .stats
                    .connect_refused
                    .fetch_add(1, Ordering::Relaxed);
                conn.close(quinn::VarInt::from_u32(1), b"wrong peer");
                return Err(std::io::Error::new(
                    std::io::ErrorKind::PermissionDenied,
                    format!("{addr}: {e}"),
                ));
            }
        };
        self.stats.dialled.fetch_add(1, Ordering::Relaxed);
        self.stats.conns.watch(&conn);
        debug!(%addr, "QUIC connection up");
        Ok((conn, id))
    }

    /// Closes and drops the connections held to `addr` (a stream on one failed its `Hello`:
    /// the peer may have restarted behind the same address).
    pub fn forget(&self, addr: &str) {
        let mut conns = lock(&self.conns);
        conns.slots.retain(|(a, _, _), slot| {
            let same = a == addr;
            if same
                && let Ok(mut held) = slot.try_lock()
                && let Some((c, _)) = held.take()
            {
                c.close(quinn::VarInt::from_u32(2), b"stream failed");
            }
            !same
        });
    }

    /// The next incoming connection attempt; `None` once the endpoint is closed.
    pub async fn incoming(&self) -> Option<quinn::Incoming> {
        self.endpoint.accept().await
    }

    /// Completes an incoming connection's handshake within `limit` and returns it with the
    /// peer's identity, which must be a `host`'s.
    pub async fn establish(
        &self,
        incoming: quinn::Incoming,
        limit: Duration,
    ) -> Result<(quinn::Connection, Identity), QuicAcceptError> {
        if let Some(m) = self.path_mtu
            && let Err(e) = check_route_mtu(incoming.remote_address(), m)
        {
            self.stats.path_mtu_refused.fetch_add(1, Ordering::Relaxed);
            incoming.refuse();
            return Err(QuicAcceptError::PathMtu(e));
        }
        let result = async {
            let connecting = incoming.accept()?;
            let conn = tokio::time::timeout(limit, connecting)
                .await
                .map_err(|_| QuicAcceptError::Timeout(limit))??;
            let id = peer_identity(&conn)?;
            if id.role != Role::Host {
                conn.close(quinn::VarInt::from_u32(1), b"not a host");
                return Err(PeerIdentityError::NotHost(id).into());
            }
            Ok((conn, id))
        }
        .await;
        match &result {
            Ok((conn, _)) => {
                self.stats.accepted.fetch_add(1, Ordering::Relaxed);
                self.stats.conns.watch(conn);
            }
            Err(_) => {
                self.stats.refused.fetch_add(1, Ordering::Relaxed);
            }
        }
        result
    }

    /// Closes every connection (shutdown).
    pub fn close(&self) {
        self.endpoint
            .close(quinn::VarInt::from_u32(0), b"shutting down");
    }

    /// Logs where it listens and what the socket got.
    pub fn log_ready(&self) {
        let o = self.offload;
        info!(
            addr = ?self.endpoint.local_addr().ok(),
            gso_segments = o.gso_segments,
            gro_segments = o.gro_segments,
            recv_buffer = o.recv_buffer,
            send_buffer = o.send_buffer,
            "QUIC listening"
        );
        if o.recv_buffer < UDP_BUFFER {
            info!(
                granted = o.recv_buffer,
                asked = UDP_BUFFER,
                "the kernel capped the QUIC receive buffer (raise net.core.rmem_max for high-rate links)"
            );
        }
    }
}

/// A connection that has not closed.
fn live(c: &quinn::Connection) -> bool {
    c.close_reason().is_none()
}

async fn resolve(addr: &str) -> std::io::Result<SocketAddr> {
    tokio::net::lookup_host(addr)
        .await
        .map_err(|e| std::io::Error::new(e.kind(), format!("resolving {addr}: {e}")))?
        .next()
        .ok_or_else(|| {
            std::io::Error::new(
                std::io::ErrorKind::NotFound,
                format!("{addr} resolves to no address"),
            )
        })
}

/// One bidirectional QUIC stream as a byte stream: what a session runs over.
pub struct QuicStream {
    send: quinn::SendStream,
    recv: quinn::RecvStream,
}

impl QuicStream {
    /// Joins a stream's two halves.
    pub fn new(send: quinn::SendStream, recv: quinn::RecvStream) -> Self {
        Self { send, recv }
    }
}

/// A QUIC stream's two directions are separate objects already: framed without tokio's
/// split lock, and with a write half that takes chunk payloads as `Bytes`.
impl From<QuicStream> for Halves {
    fn from(s: QuicStream) -> Self {
        Self {
            read: Box::new(s.recv),
            write: Box::new(s.send),
        }
    }
}

/// quinn's send buffer keeps `Bytes` as they are until the peer acknowledges them: a
/// chunk's payload (for a source, a slice of the shard's mapping) is packetised and
/// encrypted from there, with no copy into a fresh allocation first. (`poll_write` copies
/// each write into a new `Bytes`: for 1 MiB chunks, a fresh 1 MiB allocation whose pages
/// the kernel faults in and zeroes, then a copy.)
impl FrameSink for quinn::SendStream {
    fn write_bytes(&mut self, data: Bytes) -> BoxFuture<'_, std::io::Result<()>> {
        Box::pin(async move { self.write_chunk(data).await.map_err(std::io::Error::from) })
    }
}

impl AsyncRead for QuicStream {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.recv).poll_read(cx, buf)
    }
}

impl AsyncWrite for QuicStream {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        AsyncWrite::poll_write(Pin::new(&mut self.send), cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        AsyncWrite::poll_flush(Pin::new(&mut self.send), cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        AsyncWrite::poll_shutdown(Pin::new(&mut self.send), cx)
    }
}

#[cfg(test)]
mod tests {
    use shardcast_identity::TlsFiles;
    use shardcast_identity::pki::{IssueRequest, PkiDir};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;

    fn host(pki: &PkiDir, name: &str) -> Arc<TlsContext> {
        let f = pki
            .issue(&IssueRequest::new(Identity::new(Role::Host, name).unwrap()))
            .unwrap();
        TlsContext::load(TlsFiles {
            ca: pki.ca().cert,
            cert: f.cert,
            key: f.key,
        })
        .unwrap()
    }

    /// A test CA in a temporary directory (kept as long as the directory).
    fn test_pki() -> (tempfile::TempDir, PkiDir) {
        let dir = tempfile::tempdir().unwrap();
        let pki = PkiDir::new(dir.path());
        pki.init("test CA", Duration::from_secs(3600)).unwrap();
        (dir, pki)
    }

    /// Host `b` serving [`echo`] and host `a` to dial it, both on loopback with `path_mtu`
    /// and `lanes`: (server, client).
    fn echo_pair(pki: &PkiDir, path_mtu: Option<u16>, lanes: usize) -> (Arc<Quic>, Arc<Quic>) {
        let bind = |name| {
            Quic::bind(
                "127.0.0.1:0".parse().unwrap(),
                host(pki, name),
                path_mtu,
                lanes,
            )
            .unwrap()
        };
        let (server, client) = (bind("b"), bind("a"));
        echo(server.clone());
        (server, client)
    }

    /// Echoes the first four bytes of every stream the endpoint accepts; a stream that
    /// starts with `bulk` is read to its end first.
    fn echo(server: Arc<Quic>) {
        tokio::spawn(async move {
            while let Some(incoming) = server.incoming().await {
                let Ok((conn, _)) = server.establish(incoming, Duration::from_secs(5)).await else {
                    continue;
                };
                tokio::spawn(async move {
                    while let Ok((mut send, mut recv)) = conn.accept_bi().await {
                        tokio::spawn(async move {
                            let mut buf = [0u8; 4];
                            if recv.read_exact(&mut buf).await.is_err() {
                                return;
                            }
                            if &buf == b"bulk" {
                                let mut sink = tokio::io::sink();
                                if tokio::io::copy(&mut recv, &mut sink).await.is_err() {
                                    return;
                                }
                            }
                            let _ = send.write_all(&buf).await;
                        });
                    }
                });
            }
        });
    }

    /// Sends `ping` on a stream to [`echo`] and checks it comes back.
    async fn ping(s: &mut (impl tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin)) {
        s.write_all(b"ping").await.unwrap();
        let mut back = [0u8; 4];
        s.read_exact(&mut back).await.unwrap();
        assert_eq!(&back, b"ping");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn streams_share_a_connection_and_forget_closes_it_by_the_name_dialled() {
        let (_dir, pki) = test_pki();
        let (server, client) = echo_pair(&pki, None, 1);
        // By name, as a plan may give it: the same connection for both streams.
        let addr = format!("localhost:{}", server.local_addr().unwrap().port());
        let b: HostId = "b".parse().unwrap();
        for _ in 0..2 {
            let (mut s, peer) = client.connect(&addr, Some(&b)).await.unwrap();
            assert_eq!(peer, Peer::Cert(Identity::new(Role::Host, "b").unwrap()));
            ping(&mut s).await;
        }
        assert_eq!(client.stats.dialled.load(Ordering::Relaxed), 1);
        assert_eq!(client.stats.reused.load(Ordering::Relaxed), 1);
        // Forgotten by the name it was dialled with: the next stream dials anew.
        client.forget(&addr);
        let (mut s, _) = client.connect(&addr, Some(&b)).await.unwrap();
        s.write_all(b"pong").await.unwrap();
        let mut back = [0u8; 4];
        s.read_exact(&mut back).await.unwrap();
        assert_eq!(client.stats.dialled.load(Ordering::Relaxed), 2);
        // Another host behind that address is refused by name.
        let c: HostId = "c".parse().unwrap();
        match client.connect(&addr, Some(&c)).await {
            Err(e) => assert_eq!(e.kind(), std::io::ErrorKind::PermissionDenied, "{e}"),
            Ok(_) => panic!("host b was taken for host c"),
        }
    }

    /// With two lanes, streams to one peer alternate between two connections: four streams,
    /// two dials and two reuses; each connection carries its streams' bytes intact.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn streams_to_one_peer_take_the_lanes_in_turn() {
        let (_dir, pki) = test_pki();
        let (server, client) = echo_pair(&pki, None, 2);
        let addr = server.local_addr().unwrap().to_string();
        let b: HostId = "b".parse().unwrap();
        let mut streams = Vec::new();
        for i in 0..4u8 {
            let (mut s, _) = client.connect(&addr, Some(&b)).await.unwrap();
            s.write_all(&[i; 4]).await.unwrap();
            streams.push(s);
        }
        for (i, s) in streams.iter_mut().enumerate() {
            let mut back = [0u8; 4];
            s.read_exact(&mut back).await.unwrap();
            assert_eq!(back, [i as u8; 4]);
        }
        assert_eq!(client.stats.dialled.load(Ordering::Relaxed), 2);
        assert_eq!(client.stats.reused.load(Ordering::Relaxed), 2);
        // Forgetting the address drops every lane's connection.
        client.forget(&addr);
        assert!(lock(&client.conns).slots.is_empty());
    }

    /// A UDP relay on loopback between one client and `server` that drops the client's
    /// first `drop` datagrams and passes everything else both ways; returns its address.
    async fn lossy_relay(server: SocketAddr, drop: usize) -> SocketAddr {
        let relay = Arc::new(tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap());
        let addr = relay.local_addr().unwrap();
        tokio::spawn(async move {
            let (mut client, mut dropped) = (None, 0);
            let mut buf = vec![0u8; 65536];
            // Ends with the test's runtime.
            while let Ok((n, from)) = relay.recv_from(&mut buf).await {
                if from == server {
                    if let Some(c) = client {
                        let _ = relay.send_to(&buf[..n], c).await;
                    }
                } else if dropped < drop {
                    dropped += 1;
                } else {
                    client = Some(from);
                    let _ = relay.send_to(&buf[..n], server).await;
                }
            }
        });
        addr
    }

    /// A handshake whose first flight is lost (the Initial and both of its probes) still
    /// completes well within the 2 s a forwarder gives a new hop (`ChainConfig`'s
    /// `stall_timeout`): with quinn's default initial RTT of 333 ms the probes wait 1 s and
    /// then 2 s, and the hop was skipped as dead; with [`INITIAL_RTT`] they wait 60 and
    /// 120 ms.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_handshake_that_loses_its_first_flight_completes_within_the_setup_bound() {
        let (_dir, pki) = test_pki();
        let (server, client) = echo_pair(&pki, None, 1);
        let relay = lossy_relay(server.local_addr().unwrap(), 3)
            .await
            .to_string();
        let b: HostId = "b".parse().unwrap();
        let t0 = std::time::Instant::now();
        let connect = client.connect(&relay, Some(&b));
        let (mut s, _) = tokio::time::timeout(Duration::from_secs(2), connect)
            .await
            .expect("the handshake outlasted a forwarder's setup bound")
            .unwrap();
        let took = t0.elapsed();
        ping(&mut s).await;
        eprintln!("handshake with its first flight lost: {took:?}");
    }

    /// A declared path MTU is used from the first packet (no discovery climbing to it), on
    /// both sides; undeclared, discovery stops at [`MTU_CEILING`] although loopback carries
    /// far more.
    #[test]
    fn a_declared_path_mtu_must_fit_the_route_to_the_peer() {
        let peer: SocketAddr = "10.0.0.2:7400".parse().unwrap();
        assert!(path_mtu_fits(peer, 8972, 9000, 28).is_ok());
        assert!(path_mtu_fits(peer, 1472, 1500, 28).is_ok());
        let e = path_mtu_fits(peer, 8972, 1500, 28).unwrap_err();
        assert_eq!((e.needed, e.route_mtu), (9000, 1500));
        let e = e.to_string();
        assert!(e.contains("quic_path_mtu 8972 needs an MTU of 9000 bytes toward 10.0.0.2:7400"));
        assert!(e.contains("has 1500: lower quic_path_mtu to 1472"), "{e}");
        let v6: SocketAddr = "[fd00::2]:7400".parse().unwrap();
        assert!(path_mtu_fits(v6, 8952, 9000, 48).is_ok());
        assert!(path_mtu_fits(v6, 8972, 9000, 48).is_err());
        // Loopback's route, as the kernel reports it (65535 through IP_MTU), carries jumbo packets.
        check_route_mtu("127.0.0.1:7400".parse().unwrap(), 8972).unwrap();
        let e = check_route_mtu("127.0.0.1:7400".parse().unwrap(), 65527).unwrap_err();
        assert!(e.to_string().contains("quic_path_mtu 65527"), "{e}");
    }

    #[test]
    fn a_stream_window_holds_fewer_packets_than_quinn_compacts_at() {
        // quinn-proto 0.11's assembler copies a stream's buffered data into one new buffer
        // once it holds more than 2048 pieces; full packets at the window never get there.
        const QUINN_COMPACT_THRESHOLD: u32 = 2048;
        // Stream data a packet carries at least: the payload less a short header with an
        // 8-byte connection ID and a 4-byte packet number, the AEAD tag and a stream
        // frame's type, ID, offset and length.
        let data = |payload: u16| u32::from(payload) - (1 + 8 + 4) - 16 - (1 + 8 + 8 + 8);
        for payload in [MIN_PATH_MTU, 1452, MTU_CEILING, 4000, 8972] {
            let w = stream_window(payload);
            assert!(
                w.div_ceil(data(payload)) < QUINN_COMPACT_THRESHOLD,
                "{payload}: a {w}-byte window holds {} packets",
                w.div_ceil(data(payload))
            );
        }
        assert_eq!(stream_window(MTU_CEILING), 1536 * 1472);
        assert_eq!(stream_window(8972), 1536 * 8972);
        // Jumbo enough packets reach the bandwidth-delay ceiling.
        assert_eq!(stream_window(MAX_PATH_MTU), STREAM_WINDOW);
    }

    /// A new connection's congestion window starts at ten packets of the path's size, not
    /// at quinn's 12 000 bytes (under two jumbo packets).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_new_connection_may_send_ten_packets_of_the_paths_size_at_once() {
        let (_dir, pki) = test_pki();
        let b: HostId = "b".parse().unwrap();
        for (declared, payload) in [(Some(8972), 8972), (None, MTU_CEILING)] {
            let (server, client) = echo_pair(&pki, declared, 1);
            let addr = server.local_addr().unwrap().to_string();
            let (mut s, _) = client.connect(&addr, Some(&b)).await.unwrap();
            ping(&mut s).await;
            let slots: Vec<Slot> = client
                .conns
                .lock()
                .unwrap()
                .slots
                .values()
                .cloned()
                .collect();
            assert_eq!(slots.len(), 1);
            let cwnd = slots[0].lock().await.as_ref().unwrap().0.stats().path.cwnd;
            assert_eq!(initial_window(payload), 10 * u64::from(payload));
            // At least the initial window (slow start may have grown it by the bytes acked).
            assert!(
                cwnd >= initial_window(payload),
                "declared {declared:?}: window {cwnd} bytes, want {} or more",
                initial_window(payload)
            );
        }
    }

    #[test]
    fn gso_batches_fit_one_sendmsg() {
        assert_eq!(gso_segments_for(1472), 44);
        assert_eq!(gso_segments_for(8972), 7);
        assert!(gso_segments_for(8972) * 8972 <= MAX_GSO_BYTES);
        assert_eq!(gso_segments_for(65527), 1);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_declared_path_mtu_is_used_at_once_and_discovery_stops_at_the_ceiling() {
        let (_dir, pki) = test_pki();
        let b: HostId = "b".parse().unwrap();
        for (declared, want) in [(Some(8952), 8952), (None, u64::from(MTU_CEILING))] {
            let (server, client) = echo_pair(&pki, declared, 1);
            let addr = server.local_addr().unwrap().to_string();
            let (mut s, _) = client.connect(&addr, Some(&b)).await.unwrap();
            ping(&mut s).await;
            if declared.is_some() {
                // At once: no probe has had time to run.
                assert_eq!(client.stats.conns.totals().max_mtu, want);
            }
            // A bulk send in jumbo packets: GSO batches over 64 KiB would be dropped whole
            // by the kernel (and silently by quinn-udp); capped, next to nothing is lost.
            let (mut bulk, _) = client.connect(&addr, Some(&b)).await.unwrap();
            bulk.write_all(b"bulk").await.unwrap();
            bulk.write_all(&vec![7u8; 2 << 20]).await.unwrap();
            bulk.shutdown().await.unwrap();
            let mut back = [0u8; 4];
            bulk.read_exact(&mut back).await.unwrap();
            let t = client.stats.conns.totals();
            assert!(
                t.lost_packets * 20 < t.tx_datagrams,
                "{} of {} datagrams lost",
                t.lost_packets,
                t.tx_datagrams
            );
            // Never above the ceiling or the declared size, however long discovery runs.
            let deadline = std::time::Instant::now() + Duration::from_secs(5);
            while client.stats.conns.totals().max_mtu < want && std::time::Instant::now() < deadline
            {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
            assert_eq!(
                client.stats.conns.totals().max_mtu,
                want,
                "declared {declared:?}"
            );
        }
    }
}
