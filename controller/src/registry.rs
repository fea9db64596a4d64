//! The registry: the models by name (the current version of each), their manifests by
//! digest, and the registrations in progress. It owns its data behind its own locks, and
//! they are leaves: nothing else is locked while one is held, so any part of the
//! controller may ask it anything at any time. Answers are copies.
//!
//! The registration operation itself (`RegisterModel`: allow-list, the job, a host
//! building the manifest) is `crate::core`'s; it records the result here.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};

use tokio::sync::watch;
use tracing::warn;

use crate::error::{LookupError, RegisterError};
use crate::lock;
use crate::model::ModelRecord;
use crate::ops::{ModelEntry, RegistrationJob};
use crate::state::{StateError, StateStore, Table};

/// Models and manifests.
#[derive(Default)]
struct Records {
    /// By name (the current version).
    models: BTreeMap<String, ModelRecord>,
    /// By digest.
    manifests: HashMap<String, Arc<Vec<u8>>>,
}

impl Records {
    fn find(&self, key: &str) -> Option<&ModelRecord> {
        self.models.get(key).or_else(|| self.by_digest(key))
    }

    fn by_digest(&self, digest: &str) -> Option<&ModelRecord> {
        self.models.values().find(|m| m.digest == digest)
    }
}

/// A registration in progress: who reads the origin, and its outcome once it ends.
pub(crate) struct Job {
    pub(crate) info: RegistrationJob,
    pub(crate) outcome: watch::Receiver<Option<Result<ModelEntry, RegisterError>>>,
}

/// The model registry.
#[derive(Default)]
pub struct Registry {
    records: Mutex<Records>,
    /// Registrations in progress, by model name.
    pub(crate) jobs: Mutex<HashMap<String, Job>>,
}

impl Registry {
    /// The registry as stored (unreadable model records are skipped with a warning).
    pub fn restore(store: &dyn StateStore) -> Result<Self, StateError> {
        let mut r = Records::default();
        for (name, bytes) in store.list(Table::Models)? {
            match ModelRecord::read(&bytes) {
                Ok(m) => {
                    r.models.insert(name, m);
                }
                Err(e) => warn!(model = %name, "skipping unreadable model record: {e}"),
            }
        }
        for (digest, bytes) in store.list(Table::Manifests)? {
            r.manifests.insert(digest, Arc::new(bytes));
        }
        Ok(Self {
            records: Mutex::new(r),
            jobs: Mutex::default(),
        })
    }

    /// The model `key` names: a name, else a digest of a current version.
    pub fn model(&self, key: &str) -> Result<ModelRecord, LookupError> {
        if key.is_empty() {
            return Err(LookupError::NoKey);
        }
        lock(&self.records)
            .find(key)
            .cloned()
            .ok_or_else(|| LookupError::UnknownModel(key.to_string()))
    }

    /// The model whose current version is `digest`.
    pub fn by_digest(&self, digest: &str) -> Option<ModelRecord> {
        lock(&self.records).by_digest(digest).cloned()
    }

    /// The name whose current version is `digest`.
    pub fn name_of(&self, digest: &str) -> Option<String> {
        lock(&self.records)
            .by_digest(digest)
            .map(|m| m.name.clone())
    }

    /// How many names are registered.
    pub fn count(&self) -> usize {
        lock(&self.records).models.len()
    }

    /// A manifest by digest.
    pub fn manifest(&self, digest: &str) -> Option<Arc<Vec<u8>>> {
        lock(&self.records).manifests.get(digest).cloned()
    }

    /// The model `key` names, with its manifest.
    pub fn entry(&self, key: &str) -> Result<ModelEntry, LookupError> {
        let record = self.model(key)?;
        let manifest = self.manifest(&record.digest);
        Ok(ModelEntry { record, manifest })
    }

    /// Every model, by name.
    pub fn all(&self) -> Vec<ModelRecord> {
        lock(&self.records).models.values().cloned().collect()
    }

    /// (name, digest) of the current version of each of `names` that is registered.
    pub fn bindings<'a>(&self, names: impl IntoIterator<Item = &'a str>) -> Vec<(String, String)> {
        let r = lock(&self.records);
        names
            .into_iter()
            .filter_map(|n| r.models.get(n))
            .map(|m| (m.name.clone(), m.digest.clone()))
            .collect()
    }

    /// Records a registration: stores the manifest and the record, then makes it the
    /// name's current version. A registration that changes nothing (same version, origin
    /// and profile) stores nothing and answers the record kept. `Err` where the store
    /// refused (nothing changed then).
    pub fn record(
        &self,
        store: &dyn StateStore,
        record: ModelRecord,
        manifest: Arc<Vec<u8>>,
    ) -> Result<(ModelEntry, bool), StateError> {
        let mut r = lock(&self.records);
        if let Some(old) = r.models.get(&record.name)
            && old.digest == record.digest
            && old.origin == record.origin
            && old.read_origin == record.read_origin
            && old.profile == record.profile
        {
            return Ok((
                ModelEntry {
                    record: old.clone(),
                    manifest: Some(manifest),
                },
                false,
            ));
        }
        store.put(Table::Manifests, &record.digest, &manifest)?;
        let json = serde_json::to_vec(&record).map_err(StateError::from_display)?;
        store.put(Table::Models, &record.name, &json)?;
        r.manifests.insert(record.digest.clone(), manifest.clone());
        r.models.insert(record.name.clone(), record.clone());
        Ok((
            ModelEntry {
                record,
                manifest: Some(manifest),
            },
            true,
        ))
    }

    /// Sets (or with `None` removes) a name's record, as a follower sees it stored.
    pub fn apply_model(&self, name: String, record: Option<ModelRecord>) {
        let mut r = lock(&self.records);
        match record {
            Some(m) => r.models.insert(name, m),
            None => r.models.remove(&name),
        };
    }

    /// Sets (or with `None` removes) a manifest, as a follower sees it stored.
    pub fn apply_manifest(&self, digest: String, manifest: Option<Arc<Vec<u8>>>) {
        let mut r = lock(&self.records);
        match manifest {
            Some(m) => r.manifests.insert(digest, m),
            None => r.manifests.remove(&digest),
        };
    }

    /// The registrations in progress, by name.
    pub fn jobs(&self) -> Vec<RegistrationJob> {
        let mut v: Vec<_> = lock(&self.jobs).values().map(|j| j.info.clone()).collect();
        v.sort_by(|a, b| a.name.cmp(&b.name));
        v
    }
}
