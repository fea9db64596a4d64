//! A registered model as the registry keeps it (table `models`), versioned: a
//! [`ModelRecord`] is JSON with `"version": "1"` ([`MODEL_RECORD_VERSION`]); an unknown
//! version is refused by name (`RecordError`), never guessed. `read_origin` is where hosts
//! read this version from when `origin` can move (a Hub branch pinned to the commit
//! registered, `hf://org/name@<commit>`); plans, bursts and recovery use
//! [`ModelRecord::reads_from`].

use serde::{Deserialize, Serialize};
use shardcast_placement as placement;

use crate::error::RecordError;

/// The version of [`ModelRecord`]s written now.
pub const MODEL_RECORD_VERSION: &str = "1";

pub(crate) fn model_record_version() -> String {
    MODEL_RECORD_VERSION.to_string()
}

/// A registered model, as persisted (table `models`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelRecord {
    /// [`MODEL_RECORD_VERSION`]; records written before versions have none and read as
    /// version 1 (the same shape).
    #[serde(default = "model_record_version")]
    pub version: String,
    /// Name.
    pub name: String,
    /// Hex manifest digest.
    pub digest: String,
    /// Origin URI.
    pub origin: String,
    /// Chunk size.
    pub chunk_size: u32,
    /// Total bytes.
    pub total_bytes: u64,
    /// Shards: (path, size, chunks).
    pub shards: Vec<(String, u64, u32)>,
    /// Seconds since the epoch.
    pub registered_at: f64,
    /// Registered profile (JSON of `shardcast_policies::profile::ModelProfile`).
    #[serde(default)]
    pub profile: Option<String>,
    /// The origin pinned to the version that was registered, where `origin` names a
    /// movable one (`hf://org/name@<commit>` for a Hub branch): what plans, bursts and
    /// recovery read from. Empty: `origin` itself.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub read_origin: String,
}

impl ModelRecord {
    /// The origin hosts read this version from: [`Self::read_origin`], else `origin`.
    pub fn reads_from(&self) -> &str {
        if self.read_origin.is_empty() {
            &self.origin
        } else {
            &self.read_origin
        }
    }

    /// Reads a stored record; a version this controller does not know is an error naming
    /// it, not a guess.
    pub fn read(bytes: &[u8]) -> Result<Self, RecordError> {
        let m: Self = serde_json::from_slice(bytes)?;
        if m.version != MODEL_RECORD_VERSION {
            return Err(RecordError::UnknownVersion {
                what: "model",
                found: m.version,
                reads: format!("{MODEL_RECORD_VERSION:?}"),
            });
        }
        Ok(m)
    }

    pub(crate) fn spec(&self) -> placement::ModelSpec {
        placement::ModelSpec {
            key: self.digest.clone(),
            shard_bytes: self.shards.iter().map(|s| s.1).collect(),
            chunk_size: u64::from(self.chunk_size),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn model_records_are_versioned_and_unversioned_ones_still_load() {
        let old = serde_json::json!({
            "name": "org/m", "digest": "ab", "origin": "file:///m", "chunk_size": 4,
            "total_bytes": 8, "shards": [["w.bin", 8, 2]], "registered_at": 1.0
        });
        let m = ModelRecord::read(old.to_string().as_bytes()).unwrap();
        assert_eq!(m.version, MODEL_RECORD_VERSION);
        let v: serde_json::Value = serde_json::to_value(&m).unwrap();
        assert_eq!(v["version"], MODEL_RECORD_VERSION);
        let mut future = old.clone();
        future["version"] = "7".into();
        let e = ModelRecord::read(future.to_string().as_bytes()).unwrap_err();
        assert!(e.to_string().contains("\"7\""), "{e}");
    }
}
