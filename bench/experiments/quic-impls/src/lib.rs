//! What the experiment's two programs share.

/// A byte count with an optional `KiB`, `MiB` or `GiB` suffix.
pub fn parse_size(s: &str) -> Result<u64, String> {
    let s = s.trim();
    let (num, mult) = [("GiB", 1u64 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)]
        .iter()
        .find_map(|(suf, m)| s.strip_suffix(suf).map(|n| (n, *m)))
        .unwrap_or((s, 1));
    num.trim()
        .parse::<u64>()
        .map(|n| n * mult)
        .map_err(|e| format!("{s}: {e}"))
}
