//! Transfer-time estimates for pipelined chains.
//!
//! A chain is cut-through: each hop forwards a chunk as soon as it has verified it, so every
//! hop finishes about `S / B + (hops - 1) * chunk / B` after the start, where `B` is the
//! chain's bottleneck rate (the source's read rate or the slowest hop's NIC) — the chain fill
//! is one chunk per hop, independent of the model size. A star from one source would take
//! `hops * S / B` instead.
//!
//! The model ignores per-chunk verification cost, TCP ramp-up and cross-traffic; it is for
//! *comparing* plans, not for promising deadlines. Where one host's link is shared between
//! several chains of the same plan (a source heading several chains, a receiver in every
//! stripe of a striped plan), the callers pass that host's fair share of its rate.

/// Estimated seconds for one chain: `bytes / bottleneck` plus the chain fill
/// `(hops - 1) * chunk_size / bottleneck`, where the bottleneck is the lowest of
/// `source_bps` (the origin's read rate, or a peer's NIC, or the lower of its NIC and the
/// disk read rate for a disk source) and every hop's NIC rate in `hop_nic_bps` (one entry
/// per hop).
///
/// Returns 0 when nothing moves (no hops or no bytes). A zero rate is treated as 1 byte/s, so
/// the result is always finite. The fill uses at most `bytes` per hop (a chunk never exceeds
/// the data).
pub fn estimate_chain_s(bytes: u64, source_bps: u64, hop_nic_bps: &[u64], chunk_size: u64) -> f64 {
    if hop_nic_bps.is_empty() || bytes == 0 {
        return 0.0;
    }
    let bottleneck = hop_nic_bps
        .iter()
        .copied()
        .fold(source_bps, u64::min)
        .max(1) as f64;
    let fill_hops = (hop_nic_bps.len() - 1) as f64;
    (bytes as f64 + fill_hops * chunk_size.min(bytes) as f64) / bottleneck
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nothing_moves_is_zero() {
        assert_eq!(estimate_chain_s(100, 10, &[], 1), 0.0);
        assert_eq!(estimate_chain_s(0, 10, &[10, 10], 1), 0.0);
    }

    #[test]
    fn bottleneck_and_fill() {
        // Source 100 B/s, hops 50 and 200: bottleneck 50. 1000 B + 1 fill chunk of 10 B.
        let s = estimate_chain_s(1000, 100, &[50, 200], 10);
        assert!((s - 1010.0 / 50.0).abs() < 1e-9);
        // Source is the bottleneck.
        let s = estimate_chain_s(1000, 10, &[50], 10);
        assert!((s - 100.0).abs() < 1e-9);
    }

    #[test]
    fn zero_rates_stay_finite() {
        let s = estimate_chain_s(u64::MAX, 0, &[0, 0, 0], u64::MAX);
        assert!(s.is_finite() && s > 0.0);
    }

    #[test]
    fn fill_capped_by_bytes() {
        let s = estimate_chain_s(10, 10, &[10, 10, 10], 1_000_000);
        assert!((s - 3.0).abs() < 1e-9);
    }
}
