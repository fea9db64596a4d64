//! Human-friendly sizes and rates, as operators write them in flags and config files.
//!
//! Sizes: `4096`, `512KiB`, `1MiB`, `1.5GiB`, `1GB` (decimal), `64M` (binary, like `ls`).
//! Rates: `1Gbit`, `500Mbit`, `1gbps` (bits per second, decimal), `125MB/s`, `100MiB/s`
//! (bytes per second); `0`, `none` or `unlimited` mean no limit.
//! Durations: `10s`, `500ms`, `2m`, `1.5h` ([`parse_duration`]); the config keys that hold
//! one keep their unit suffix (`stall_timeout_ms`) and take a bare number in that unit, or a
//! duration with its own unit (serde modules [`millis`] and [`seconds`]). Sizes in config
//! files take a number of bytes or a size with a unit ([`size`], [`opt_size`]).

/// `t` split where its number (digits and a decimal point) ends: the number and its unit.
fn number_and_unit(t: &str) -> (&str, &str) {
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    t.split_at(split)
}

/// Parses a byte size. Binary units (KiB, MiB, GiB, TiB, and bare K/M/G/T) are powers of
/// 1024; decimal units (KB, MB, GB, TB) are powers of 1000.
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let (num, unit) = number_and_unit(t);
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
    let (num, unit) = number_and_unit(t);
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

/// Parses a duration: a number with a unit, `ns`, `us`, `ms`, `s`, `m` (or `min`), `h` or
/// `d` (`10s`, `500ms`, `2m`, `1.5h`); a bare number has no unit and is refused (the caller
/// knows which unit its bare numbers are in).
pub fn parse_duration(s: &str) -> Result<std::time::Duration, String> {
    let t = s.trim();
    let (num, unit) = number_and_unit(t);
    let num: f64 = num
        .parse()
        .map_err(|_| format!("invalid duration {s:?}: expected e.g. 10s, 500ms or 2m"))?;
    let secs: f64 = match unit.trim().to_ascii_lowercase().as_str() {
        "ns" => 1e-9,
        "us" | "µs" => 1e-6,
        "ms" => 1e-3,
        "s" | "sec" | "secs" => 1.0,
        "m" | "min" | "mins" => 60.0,
        "h" => 3600.0,
        "d" => 86_400.0,
        "" => {
            return Err(format!(
                "invalid duration {s:?}: give a unit, e.g. 10s or 500ms"
            ));
        }
        other => return Err(format!("invalid duration {s:?}: unknown unit {other:?}")),
    };
    let v = num * secs;
    if !v.is_finite() || v < 0.0 || v > u64::MAX as f64 / 1e9 {
        return Err(format!("invalid duration {s:?}: out of range"));
    }
    Ok(std::time::Duration::from_nanos((v * 1e9).round() as u64))
}

/// Formats a size exactly, with the largest binary unit that divides it (`4GiB`, `1536`),
/// so that [`parse_size`] reads it back unchanged.
pub fn format_size_exact(n: u64) -> String {
    for (shift, unit) in [(40, "TiB"), (30, "GiB"), (20, "MiB"), (10, "KiB")] {
        if n != 0 && n % (1u64 << shift) == 0 {
            return format!("{}{unit}", n >> shift);
        }
    }
    n.to_string()
}

/// A whole number from a config value: an integer, or text with a unit through `parse`.
struct WholeVisitor<F> {
    expecting: &'static str,
    parse: F,
}

impl<F: Fn(&str) -> Result<u64, String>> serde::de::Visitor<'_> for WholeVisitor<F> {
    type Value = u64;
    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.expecting)
    }
    fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<u64, E> {
        Ok(v)
    }
    fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<u64, E> {
        u64::try_from(v).map_err(|_| E::custom(format!("{v} is negative")))
    }
    fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<u64, E> {
        match v.trim().parse::<u64>() {
            Ok(n) => Ok(n),
            Err(_) => (self.parse)(v).map_err(E::custom),
        }
    }
}

/// A duration as a whole number of `unit`s (a bare number is already in that unit).
fn duration_in<'de, D: serde::Deserializer<'de>>(
    d: D,
    unit: std::time::Duration,
    name: &'static str,
) -> Result<u64, D::Error> {
    d.deserialize_any(WholeVisitor {
        expecting: "a number or a duration such as \"10s\" or \"500ms\"",
        parse: |s: &str| {
            let v = parse_duration(s)?;
            let n = v.as_nanos() / unit.as_nanos();
            if n * unit.as_nanos() != v.as_nanos() {
                return Err(format!("{s:?} is not a whole number of {name}"));
            }
            u64::try_from(n).map_err(|_| format!("{s:?} is out of range"))
        },
    })
}

/// Serde for a `u64` of milliseconds (`#[serde(with = "units::millis")]`): `2000`, `"2000"`,
/// `"2s"` and `"2000ms"` are the same value; written back as a number.
pub mod millis {
    /// Reads milliseconds, or a duration with its unit.
    pub fn deserialize<'de, D: serde::Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
        super::duration_in(d, std::time::Duration::from_millis(1), "milliseconds")
    }
    /// Writes the number of milliseconds.
    pub fn serialize<S: serde::Serializer>(v: &u64, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_u64(*v)
    }
}

/// Serde for a `u64` of seconds (`#[serde(with = "units::seconds")]`): `30`, `"30"`, `"30s"`
/// and `"1m"` (60) are accepted; `"1500ms"` is refused (not whole seconds).
pub mod seconds {
    /// Reads seconds, or a duration with its unit.
    pub fn deserialize<'de, D: serde::Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
        super::duration_in(d, std::time::Duration::from_secs(1), "seconds")
    }
    /// Writes the number of seconds.
    pub fn serialize<S: serde::Serializer>(v: &u64, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_u64(*v)
    }
}

/// Serde for a size in bytes (`#[serde(with = "units::size")]`): a number of bytes or a size
/// with its unit (`"4GiB"`, [`parse_size`]); written back as [`format_size_exact`] does.
pub mod size {
    /// Reads bytes, or a size with its unit.
    pub fn deserialize<'de, D: serde::Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
        d.deserialize_any(super::WholeVisitor {
            expecting: "a number of bytes or a size such as \"4GiB\"",
            parse: super::parse_size,
        })
    }
    /// Writes the size with its largest exact binary unit.
    pub fn serialize<S: serde::Serializer>(v: &u64, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&super::format_size_exact(*v))
    }
}

/// [`size`] for an optional size (`#[serde(default, with = "units::opt_size")]`).
pub mod opt_size {
    /// Reads bytes, or a size with its unit.
    pub fn deserialize<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
        super::size::deserialize(d).map(Some)
    }
    /// Writes the size with its largest exact binary unit (`None` is skipped by the caller's
    /// `skip_serializing_if`, or written as nothing).
    pub fn serialize<S: serde::Serializer>(v: &Option<u64>, s: S) -> Result<S::Ok, S::Error> {
        match v {
            Some(v) => super::size::serialize(v, s),
            None => s.serialize_none(),
        }
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

    #[test]
    fn durations() {
        use std::time::Duration;
        assert_eq!(parse_duration("10s").unwrap(), Duration::from_secs(10));
        assert_eq!(parse_duration("500ms").unwrap(), Duration::from_millis(500));
        assert_eq!(parse_duration("2m").unwrap(), Duration::from_secs(120));
        assert_eq!(parse_duration("1.5h").unwrap(), Duration::from_secs(5400));
        assert_eq!(
            parse_duration(" 250 us ").unwrap(),
            Duration::from_micros(250)
        );
        for bad in ["10", "", "fast", "10 parsecs", "-1s", "1e999s"] {
            assert!(parse_duration(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn exact_sizes_read_back() {
        for n in [0, 1, 1536, 4 << 30, (1 << 40) * 3, 512 << 20, 1_000_000_000] {
            assert_eq!(parse_size(&format_size_exact(n)).unwrap(), n, "{n}");
        }
        assert_eq!(format_size_exact(4 << 30), "4GiB");
        assert_eq!(format_size_exact(1_000_000_000), "1000000000");
    }
}
