//! Validated names: model names, shard paths and host ids.
//!
//! These strings arrive from the network and from operators and end up as file-system paths
//! under the shard store, so they are checked once, on construction ("parse, don't
//! validate"): no absolute paths, no `.` or `..` components, no empty components, no NUL or
//! other control characters, no backslashes, bounded length.

use std::fmt;

/// Longest model name in bytes.
pub const MAX_MODEL_NAME_LEN: usize = 256;
/// Longest shard path in bytes.
pub const MAX_SHARD_PATH_LEN: usize = 1024;
/// Longest host id in bytes.
pub const MAX_HOST_ID_LEN: usize = 255;

/// Why a name was rejected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NameError {
    /// The name is empty.
    #[error("{kind} is empty")]
    Empty {
        /// What kind of name.
        kind: &'static str,
    },
    /// The name is longer than allowed.
    #[error("{kind} is {len} bytes long; the maximum is {max}")]
    TooLong {
        /// What kind of name.
        kind: &'static str,
        /// Its length.
        len: usize,
        /// The maximum.
        max: usize,
    },
    /// The name contains a character that is not allowed.
    #[error("{kind} {name:?} contains a forbidden character {ch:?}")]
    BadChar {
        /// What kind of name.
        kind: &'static str,
        /// The offending name.
        name: String,
        /// The offending character.
        ch: char,
    },
    /// The path is absolute, or has an empty, `.` or `..` component.
    #[error("{kind} {name:?} must be a relative path without empty, '.' or '..' components")]
    BadPath {
        /// What kind of name.
        kind: &'static str,
        /// The offending name.
        name: String,
    },
}

fn check_path(kind: &'static str, s: &str, max: usize) -> Result<(), NameError> {
    if s.is_empty() {
        return Err(NameError::Empty { kind });
    }
    if s.len() > max {
        return Err(NameError::TooLong {
            kind,
            len: s.len(),
            max,
        });
    }
    if let Some(ch) = s.chars().find(|c| c.is_control() || *c == '\\') {
        return Err(NameError::BadChar {
            kind,
            name: s.into(),
            ch,
        });
    }
    if s.starts_with('/') || s.split('/').any(|c| c.is_empty() || c == "." || c == "..") {
        return Err(NameError::BadPath {
            kind,
            name: s.into(),
        });
    }
    Ok(())
}

macro_rules! validated_string {
    ($(#[$doc:meta])* $name:ident, $kind:literal, $check:expr) => {
        $(#[$doc])*
        #[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize)]
        #[serde(transparent)]
        pub struct $name(String);

        impl $name {
            /// Validates `s` and wraps it.
            pub fn new(s: impl Into<String>) -> Result<Self, NameError> {
                let s = s.into();
                let check: fn(&str) -> Result<(), NameError> = $check;
                check(&s)?;
                Ok(Self(s))
            }

            /// The validated string.
            pub fn as_str(&self) -> &str {
                &self.0
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }

        impl std::str::FromStr for $name {
            type Err = NameError;
            fn from_str(s: &str) -> Result<Self, NameError> {
                Self::new(s)
            }
        }

        impl<'de> serde::Deserialize<'de> for $name {
            fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                let s = String::deserialize(d)?;
                Self::new(s).map_err(serde::de::Error::custom)
            }
        }
    };
}

validated_string!(
    /// A model name such as `meta-llama/Llama-3-8B`: a relative path of at most
    /// [`MAX_MODEL_NAME_LEN`] bytes.
    ModelName,
    "model name",
    |s| check_path("model name", s, MAX_MODEL_NAME_LEN)
);

validated_string!(
    /// A shard's file name relative to the model root, such as
    /// `model-00001-of-00004.safetensors`: at most [`MAX_SHARD_PATH_LEN`] bytes.
    ShardPath,
    "shard path",
    |s| check_path("shard path", s, MAX_SHARD_PATH_LEN)
);

validated_string!(
    /// A host's identity in the cluster: 1 to [`MAX_HOST_ID_LEN`] bytes of ASCII letters,
    /// digits, `.`, `-`, `_` and `:`.
    HostId,
    "host id",
    |s| {
        if s.is_empty() {
            return Err(NameError::Empty { kind: "host id" });
        }
        if s.len() > MAX_HOST_ID_LEN {
            return Err(NameError::TooLong { kind: "host id", len: s.len(), max: MAX_HOST_ID_LEN });
        }
        match s.chars().find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '_' | ':'))) {
            Some(ch) => Err(NameError::BadChar { kind: "host id", name: s.into(), ch }),
            None => Ok(()),
        }
    }
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rejects_traversal_and_absolute_paths() {
        for bad in [
            "../x",
            "a/../b",
            "/etc/passwd",
            "a//b",
            "./a",
            "a/.",
            "",
            "a\0b",
            "a\\b",
        ] {
            assert!(ShardPath::new(bad).is_err(), "{bad:?} must be rejected");
        }
        assert!(ShardPath::new("x".repeat(MAX_SHARD_PATH_LEN + 1)).is_err());
    }

    #[test]
    fn accepts_ordinary_names() {
        for good in [
            "model.safetensors",
            "sub/dir/model-00001-of-00004.safetensors",
            "..a",
        ] {
            assert_eq!(ShardPath::new(good).unwrap().as_str(), good);
        }
        assert!(ModelName::new("meta-llama/Llama-3-8B").is_ok());
        assert!(HostId::new("host-1.rack:3").is_ok());
        assert!(HostId::new("host 1").is_err());
    }

    #[test]
    fn serde_validates() {
        let err = serde_json::from_str::<ShardPath>("\"../../etc\"").unwrap_err();
        assert!(err.to_string().contains("relative path"));
    }
}
