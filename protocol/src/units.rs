//! Human-friendly sizes and rates, as operators write them in flags and config files.
//!
//! Sizes: `4096`, `512KiB`, `1MiB`, `1.5GiB`, `1GB` (decimal), `64M` (binary, like `ls`).
//! Rates: `1Gbit`, `500Mbit`, `1gbps` (bits per second, decimal), `125MB/s`, `100MiB/s`
//! (bytes per second); `0`, `none` or `unlimited` mean no limit.

/// Parses a byte size. Binary units (KiB, MiB, GiB, TiB, and bare K/M/G/T) are powers of
/// 1024; decimal units (KB, MB, GB, TB) are powers of 1000.
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let num: f64 = num
        .parse()
        .map_err(|_| format!("invalid size {s:?}: expected e.g. 512MiB"))?;
    let mult: f64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "k" | "kib" => 1024.0,
        "m" | "mib" => 1024f64.powi(2),
        "g" | "gib" => 1024f64.powi(3),
        "t" | "tib" => 1024f64.powi(4),
        "kb" => 1e3,
        "mb" => 1e6,
        "gb" => 1e9,
        "tb" => 1e12,
        other => return Err(format!("invalid size {s:?}: unknown unit {other:?}")),
    };
    let v = num * mult;
    if !v.is_finite() || v < 0.0 || v > u64::MAX as f64 {
        return Err(format!("invalid size {s:?}: out of range"));
    }
    Ok(v.round() as u64)
}

/// Parses a rate into bytes per second; `None` means unlimited. Units ending in `bit` or
/// `bps` are bits per second (`1Gbit`, `1gbps`); units ending in an upper-case `B` are bytes
/// per second (`125MB/s`, `100MiB/s`); a bare number is bytes per second.
pub fn parse_rate(s: &str) -> Result<Option<u64>, String> {
    let t = s.trim();
    if matches!(
        t.to_ascii_lowercase().as_str(),
        "0" | "none" | "unlimited" | "off"
    ) {
        return Ok(None);
    }
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let num: f64 = num
        .parse()
        .map_err(|_| format!("invalid rate {s:?}: expected e.g. 1Gbit"))?;
    let unit = unit.trim().trim_end_matches("/s");
    let lower = unit.to_ascii_lowercase();
    let (prefix, bits) = if let Some(p) = lower.strip_suffix("bit").or(lower.strip_suffix("bps")) {
        (p.to_string(), true)
    } else if let Some(p) = unit.strip_suffix('B') {
        (p.to_ascii_lowercase(), false)
    } else if unit.is_empty() {
        (String::new(), false)
    } else {
        return Err(format!(
            "invalid rate {s:?}: use e.g. 1Gbit, 500Mbps, 125MB/s or 100MiB/s"
        ));
    };
    let mult = match prefix.as_str() {
        "" => 1.0,
        "k" => 1e3,
        "m" => 1e6,
        "g" => 1e9,
        "ki" => 1024.0,
        "mi" => 1024f64.powi(2),
        "gi" => 1024f64.powi(3),
        other => return Err(format!("invalid rate {s:?}: unknown prefix {other:?}")),
    };
    let bytes_per_s = num * mult / if bits { 8.0 } else { 1.0 };
    if !bytes_per_s.is_finite() || bytes_per_s < 1.0 {
        return Err(format!("invalid rate {s:?}: must be at least 1 byte/s"));
    }
    Ok(Some(bytes_per_s.round() as u64))
}

/// Formats bytes with a binary unit, e.g. `512.0 MiB`.
pub fn format_bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = n as f64;
    let mut i = 0;
    while v >= 1024.0 && i < UNITS.len() - 1 {
        v /= 1024.0;
        i += 1;
    }
    if i == 0 {
        format!("{n} B")
    } else {
        format!("{v:.1} {}", UNITS[i])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("4096").unwrap(), 4096);
        assert_eq!(parse_size("512MiB").unwrap(), 512 << 20);
        assert_eq!(parse_size("1GiB").unwrap(), 1 << 30);
        assert_eq!(parse_size("64M").unwrap(), 64 << 20);
        assert_eq!(parse_size("1GB").unwrap(), 1_000_000_000);
        assert_eq!(parse_size("1.5KiB").unwrap(), 1536);
        assert!(parse_size("12 parsecs").is_err());
        assert!(parse_size("").is_err());
    }

    #[test]
    fn rates() {
        assert_eq!(parse_rate("1Gbit").unwrap(), Some(125_000_000));
        assert_eq!(parse_rate("1gbps").unwrap(), Some(125_000_000));
        assert_eq!(parse_rate("500Mbit").unwrap(), Some(62_500_000));
        assert_eq!(parse_rate("125MB/s").unwrap(), Some(125_000_000));
        assert_eq!(parse_rate("100MiB/s").unwrap(), Some(100 << 20));
        assert_eq!(parse_rate("unlimited").unwrap(), None);
        assert_eq!(parse_rate("0").unwrap(), None);
        assert!(parse_rate("fast").is_err());
    }
}
