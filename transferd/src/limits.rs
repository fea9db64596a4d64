//! Limits on the data port: connection caps (in total and per peer IP), the timeouts of
//! each connection phase (handshake, peer idle, write drain) and `frame_memory`, the bytes
//! frames in flight may hold (`wire::FrameBudget`). (The open-file limit is raised at start
//! by `shardcast_identity::process::raise_nofile_limit`.)
//!
//! Who uses what: the accept loop in [`crate::daemon`] asks [`ConnLimits::admit`] for a
//! [`ConnPermit`] before it spawns a connection's task (refused connections are closed at
//! once and counted); the permit lives as long as the task. The timeouts in [`Limits`] are
//! applied by [`crate::chain`] (the `Hello` exchange) and [`crate::wire`] (silence between
//! or inside frames, writes that do not drain). Every refusal and timeout is a counter on
//! `/metrics` ([`crate::admin`]).

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Limits of the data port. Defaults are documented in `transferd.example.toml`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Limits {
    /// Time an accepted connection has to complete the `Hello` exchange. Rationale: a
    /// live peer sends `Hello` at once; 10 s covers a loaded host, while a port scanner
    /// or a stalled client gives its slot back quickly.
    pub handshake_timeout: Duration,
    /// Longest silence from a connected peer while this host waits for its next frame or
    /// the rest of a frame. Rationale: an upstream sends chunks as fast as they reach it,
    /// so silence means its own source stalled; 60 s rides out a slow origin read and
    /// still frees the session for recovery from the fallback source.
    pub peer_idle_timeout: Duration,
    /// Longest a single write may wait for the peer to drain it. Rationale: one chunk
    /// (1 MiB by default) drains in well under a second even at 100 Mbit/s.
    pub write_timeout: Duration,
    /// Connections open at once on the data port.
    pub max_connections: usize,
    /// Connections open at once from one IP address. Rationale: an upstream opens one
    /// connection per (session, shard), so this must exceed the shard count of the largest
    /// model times the sessions one peer runs to this host at once.
    pub max_connections_per_ip: usize,
    /// Hop sessions (session × shard) held at once. Rationale: each holds a shard file
    /// and a few tasks; a peer sending `Open`s with new session ids must not grow the
    /// table without bound. 4096 covers a thousand concurrent sessions of 4-shard models.
    pub max_sessions: usize,
    /// Bytes of frame bodies (chunks being received and not yet verified and stored) held
    /// at once across every connection; a frame that does not fit waits for room.
    /// Rationale: a hop keeps `pipeline_depth` chunks in flight per upstream connection,
    /// so 512 MiB covers 128 such connections of 1 MiB chunks, while 8192 connections ×
    /// 16 MiB frames could otherwise ask for 128 GiB.
    pub frame_memory: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            handshake_timeout: Duration::from_secs(10),
            peer_idle_timeout: Duration::from_secs(60),
            write_timeout: Duration::from_secs(30),
            max_connections: 8192,
            max_connections_per_ip: 1024,
            max_sessions: 4096,
            frame_memory: 512 << 20,
        }
    }
}

/// Why a connection was refused at accept.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LimitError {
    /// The daemon already holds its maximum of connections.
    #[error("{limit} data-plane connections are open (max_connections); refusing more")]
    Total {
        /// The cap.
        limit: usize,
    },
    /// This peer address already holds its maximum of connections.
    #[error(
        "{ip} already has {limit} data-plane connections open (max_connections_per_ip); refusing more"
    )]
    PerPeer {
        /// The peer's address.
        ip: IpAddr,
        /// The cap.
        limit: usize,
    },
}

/// Counters of the limits, for `/metrics`.
#[derive(Debug, Default)]
pub struct LimitStats {
    /// Connections refused because the total cap was reached.
    pub refused_total_cap: AtomicU64,
    /// Connections refused because the per-IP cap was reached.
    pub refused_per_ip_cap: AtomicU64,
}

/// Open data-plane connections, in total and per peer IP. The per-IP table holds only
/// addresses with an open connection, so it is bounded by `max_connections`.
#[derive(Debug)]
pub struct ConnLimits {
    max_total: usize,
    max_per_ip: usize,
    open: Mutex<Open>,
    /// Refusal counters.
    pub stats: LimitStats,
}

#[derive(Debug, Default)]
struct Open {
    total: usize,
    per_ip: HashMap<IpAddr, usize>,
}

/// One admitted connection; gives its slot back when dropped.
#[derive(Debug)]
pub struct ConnPermit {
    limits: Arc<ConnLimits>,
    ip: IpAddr,
}

impl ConnLimits {
    /// Caps from `limits`.
    pub fn new(limits: &Limits) -> Arc<Self> {
        Arc::new(Self {
            max_total: limits.max_connections.max(1),
            max_per_ip: limits.max_connections_per_ip.max(1),
            open: Mutex::default(),
            stats: LimitStats::default(),
        })
    }

    /// Admits a connection from `ip`, or refuses it (counted) when a cap is reached.
    pub fn admit(self: &Arc<Self>, ip: IpAddr) -> Result<ConnPermit, LimitError> {
        // A poisoned lock only means a panic between two plain integer updates.
        let mut open = self.open.lock().unwrap_or_else(|e| e.into_inner());
        if open.total >= self.max_total {
            self.stats.refused_total_cap.fetch_add(1, Ordering::Relaxed);
            return Err(LimitError::Total {
                limit: self.max_total,
            });
        }
        let n = open.per_ip.entry(ip).or_default();
        if *n >= self.max_per_ip {
            self.stats
                .refused_per_ip_cap
                .fetch_add(1, Ordering::Relaxed);
            return Err(LimitError::PerPeer {
                ip,
                limit: self.max_per_ip,
            });
        }
        *n += 1;
        open.total += 1;
        Ok(ConnPermit {
            limits: self.clone(),
            ip,
        })
    }

    /// Connections open now.
    pub fn open(&self) -> usize {
        self.open.lock().map(|o| o.total).unwrap_or(0)
    }

    /// Peer addresses with at least one open connection.
    pub fn peers(&self) -> usize {
        self.open.lock().map(|o| o.per_ip.len()).unwrap_or(0)
    }
}

impl Drop for ConnPermit {
    fn drop(&mut self) {
        let mut open = self.limits.open.lock().unwrap_or_else(|e| e.into_inner());
        open.total = open.total.saturating_sub(1);
        if let Some(n) = open.per_ip.get_mut(&self.ip) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                open.per_ip.remove(&self.ip);
            }
        }
    }
}

/// Admits a connection from `peer` (`ip:port` as the transport reports it; an address
/// that does not parse counts against `0.0.0.0`).
pub fn admit(limits: &Arc<ConnLimits>, peer: &str) -> Result<ConnPermit, LimitError> {
    let ip = peer
        .parse::<std::net::SocketAddr>()
        .map(|a| a.ip())
        .unwrap_or(IpAddr::from([0, 0, 0, 0]));
    limits.admit(ip)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn caps_in_total_and_per_ip_and_slots_come_back() {
        let limits = ConnLimits::new(&Limits {
            max_connections: 3,
            max_connections_per_ip: 2,
            ..Limits::default()
        });
        let a: IpAddr = "10.0.0.1".parse().unwrap();
        let b: IpAddr = "10.0.0.2".parse().unwrap();
        let p1 = limits.admit(a).unwrap();
        let _p2 = limits.admit(a).unwrap();
        assert!(matches!(limits.admit(a), Err(LimitError::PerPeer { .. })));
        let _p3 = limits.admit(b).unwrap();
        assert!(matches!(limits.admit(b), Err(LimitError::Total { .. })));
        assert_eq!(limits.open(), 3);
        drop(p1);
        assert_eq!(limits.open(), 2);
        let _p4 = limits.admit(b).unwrap();
        assert_eq!(limits.stats.refused_per_ip_cap.load(Ordering::Relaxed), 1);
        assert_eq!(limits.stats.refused_total_cap.load(Ordering::Relaxed), 1);
        drop(_p4);
        drop(_p3);
        drop(_p2);
        assert_eq!(limits.open(), 0);
        assert_eq!(limits.peers(), 0, "the per-IP table forgets closed peers");
    }
}
