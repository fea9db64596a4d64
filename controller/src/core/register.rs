//! The model registry: the origin allow-list, registrations (a job per name and origin,
//! the manifest built by a live transferd), model records, names and their status.
//!
//! `RegisterModel` checks the origin against `--origin-allow`, then asks a live transferd,
//! which checks its own list, to build the manifest and keep what it reads
//! (`--register-keep-copy`: the kept copy counts as a holder at once, so registering and
//! the first prewarm read the origin once). When the host resolved the origin to the same
//! Hub repository at a full commit, and that is allowed, the commit becomes the record's
//! `read_origin` (through `OriginLocation::pins`), so later readers get the registered
//! version after the branch moves. Each registration is a job of its own: callers wait for
//! it or not (`no_wait`), a caller that goes away does not stop it, the same name and origin
//! joins it, and `ListModels` lists it under `registering`.

use super::*;

impl Controller {
    /// Checks an origin against the allow-list: a malformed URI is `INVALID_ARGUMENT`, one
    /// outside the list `PERMISSION_DENIED` (counted and logged with the origin).
    pub fn check_origin(&self, origin: &str) -> Result<(), RegisterError> {
        use shardcast_protocol::origin_policy::PolicyError;
        match self.cfg.origins.check(origin) {
            Ok(_) => Ok(()),
            Err(e @ (PolicyError::Invalid { .. } | PolicyError::UnsupportedScheme { .. })) => {
                Err(RegisterError::OriginInvalid(e.to_string()))
            }
            Err(e) => {
                self.origin_refused
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                warn!(%origin, "origin refused by policy: {e}");
                Err(RegisterError::OriginRefused(e.to_string()))
            }
        }
    }

    /// Registrations refused by the origin allow-list so far.
    pub fn origin_refusals(&self) -> u64 {
        self.origin_refused
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Registers a model by reading its origin through a live transferd.
    /// `RegisterModel`: checks the request, then registers as a job of its own (a caller
    /// that goes away does not stop it; the same name and origin again joins it) and waits
    /// for it unless `no_wait`.
    pub async fn register_model(
        self: &Arc<Self>,
        req: Register,
    ) -> Result<Registered, RegisterError> {
        let name = ModelName::new(&req.name).map_err(|e| RegisterError::BadName {
            name: req.name.clone(),
            why: e.to_string(),
        })?;
        let origin = req.origin.trim().to_string();
        let no_wait = req.no_wait;
        let mut outcome = {
            let mut regs = lock(&self.registry.jobs);
            match regs.get(name.as_str()) {
                Some(r) if r.info.origin == origin => r.outcome.clone(),
                Some(r) => {
                    return Err(RegisterError::InProgress {
                        name: name.to_string(),
                        origin: r.info.origin.clone(),
                        via: r.info.via_host.clone(),
                    });
                }
                None => {
                    // Checked here so a bad request is answered at once, not by the job.
                    let profile = if req.profile_json.trim().is_empty() {
                        None
                    } else {
                        parse_profile(&req.profile_json).map_err(RegisterError::BadProfile)?;
                        Some(req.profile_json.clone())
                    };
                    self.check_origin(&origin)?;
                    let via = self.registration_host(&req.via_host)?;
                    let (tx, rx) = watch::channel(None);
                    regs.insert(
                        name.to_string(),
                        crate::registry::Job {
                            info: RegistrationJob {
                                name: name.to_string(),
                                origin: origin.clone(),
                                via_host: via.clone(),
                                started_at: now_unix(),
                            },
                            outcome: rx.clone(),
                        },
                    );
                    self.cfg.metrics.registration_started();
                    let me = self.clone();
                    let (job_name, job_model) = (name.to_string(), name.clone());
                    let (job_origin, chunk_size) = (origin.clone(), req.chunk_size);
                    tokio::spawn(async move {
                        let r = me
                            .register_now(job_model, job_origin, profile, chunk_size, via)
                            .await;
                        if let Err(e) = &r {
                            warn!(model = %job_name, "registration failed: {e}");
                        }
                        lock(&me.registry.jobs).remove(&job_name);
                        me.cfg.metrics.registration_ended(r.is_ok());
                        tx.send_replace(Some(r));
                    });
                    rx
                }
            }
        };
        if no_wait {
            return Ok(Registered::Started {
                name: name.to_string(),
                origin,
            });
        }
        let r = outcome
            .wait_for(Option::is_some)
            .await
            .map_err(|_| RegisterError::Lost)?
            .clone();
        r.unwrap_or(Err(RegisterError::Lost)).map(Registered::Done)
    }

    /// The host that reads the origin: `wanted` if given (it must be up), else any live
    /// host.
    pub(super) fn registration_host(&self, wanted: &str) -> Result<String, HostUnavailable> {
        let inv = self.inventory.lock();
        if wanted.is_empty() {
            return inv
                .hosts
                .values()
                .find(|h| h.up)
                .map(|h| h.report.host_id.clone())
                .ok_or(HostUnavailable::NoLiveHost);
        }
        match inv.hosts.get(wanted) {
            None => Err(HostUnavailable::Unknown(wanted.to_string())),
            Some(h) if !h.up => Err(HostUnavailable::Down(wanted.to_string())),
            Some(h) => Ok(h.report.host_id.clone()),
        }
    }

    /// The registration itself: `via` builds the manifest (and keeps the copy), then the
    /// model is recorded.
    pub(super) async fn register_now(
        &self,
        name: ModelName,
        origin: String,
        profile_json: Option<String>,
        chunk_size: u32,
        via: String,
    ) -> Result<ModelEntry, RegisterError> {
        info!(model = %name, %origin, via = %via, "registering: building the manifest");
        let read_error = |agent| RegisterError::OriginRead {
            origin: origin.clone(),
            agent,
        };
        let at = self.agent_at(&via).map_err(read_error)?;
        let import = crate::agents::Import {
            name: name.to_string(),
            origin: origin.clone(),
            chunk_size,
            tier: Tier::Memory,
            fetch: false,
            manifest: Vec::new(),
            bind_name: None,
            // The host keeps what it reads to build the manifest, so a prewarm that
            // follows is served from it: the origin is read once, not twice.
            keep: self.cfg.register_keeps_copy,
        };
        let resp = self
            .agents
            .import_model(&at, import)
            .await
            .map_err(read_error)?;
        let bad = |why: String| RegisterError::BadManifest {
            via: via.clone(),
            why,
        };
        let manifest: Manifest =
            decode_exact(resp.manifest.clone().into()).map_err(|e| bad(e.to_string()))?;
        let digest = manifest.digest().to_hex();
        if digest != resp.digest {
            return Err(bad(format!(
                "its digest is {digest} but it said {}",
                resp.digest
            )));
        }
        let mut record = ModelRecord {
            version: MODEL_RECORD_VERSION.to_string(),
            name: name.to_string(),
            digest: digest.clone(),
            origin,
            chunk_size: manifest.chunk_size,
            total_bytes: manifest.total_bytes(),
            shards: manifest
                .shards
                .iter()
                .map(|s| (s.path.to_string(), s.size, s.chunks.len() as u32))
                .collect(),
            registered_at: now_unix(),
            profile: profile_json,
            read_origin: String::new(),
        };
        if !resp.resolved_origin.is_empty() {
            match pinned_origin(&record.origin, &resp.resolved_origin) {
                Some(pinned) if self.cfg.origins.check(&pinned).is_ok() => {
                    info!(model = %name, origin = %record.origin, reads_from = %pinned, "origin pinned to the version registered");
                    record.read_origin = pinned;
                }
                _ => {
                    warn!(model = %name, origin = %record.origin, resolved = %resp.resolved_origin, via = %via, "ignoring a resolved origin that is not the same repository at a commit, or is outside the allow-list");
                }
            }
        }
        let with_profile = record.profile.is_some();
        // The host keeps the copy: a prewarm made as soon as the model is registered must
        // see it (its next heartbeat says so too), not plan a second read of the origin.
        if resp.kept
            && let Some(h) = self.inventory.lock().hosts.get_mut(&via)
        {
            h.mark_complete(&digest, name.as_str(), DataTier::Memory, record.total_bytes);
        }
        let total_bytes = record.total_bytes;
        let shards = record.shards.len();
        let (info, changed) = self
            .registry
            .record(self.store.as_ref(), record, Arc::new(resp.manifest))
            .map_err(|e| RegisterError::Store(e.to_string()))?;
        if !changed {
            return Ok(info);
        }
        info!(model = %name, %digest, bytes = total_bytes, shards, kept_on = %if resp.kept { via.as_str() } else { "-" }, "model registered");
        // Plans are precomputed and stored with the model (Flashpoint §4.2.2).
        if with_profile && let Some(hook) = self.after_register.get() {
            hook(name.to_string()).await;
        }
        Ok(info)
    }

    /// Every registered model (manifests left out).
    pub fn list_models(&self) -> Models {
        Models {
            models: self.registry.all(),
            registering: self.registry.jobs(),
        }
    }

    /// One model, with its manifest.
    pub fn get_model(&self, key: &str) -> Result<ModelEntry, LookupError> {
        self.registry.entry(key)
    }

    /// Where a model is.
    pub fn get_status(&self, key: &str) -> Result<Whereabouts, LookupError> {
        let m = self.registry.model(key)?;
        let st = lock(&self.state);
        let inv = self.inventory.lock();
        let mut hosts = Vec::new();
        for h in inv.hosts.values() {
            let mem = h.holding(&m.digest, DataTier::Memory);
            let disk = h.holding(&m.digest, DataTier::Disk);
            let gpus = h.gpu_reserved.get(&m.digest).copied().unwrap_or(0);
            if mem.is_none() && disk.is_none() && gpus == 0 {
                continue;
            }
            hosts.push(Holder {
                host: h.report.host_id.clone(),
                up: h.up,
                memory: mem.is_some_and(|x| x.complete),
                disk: disk.is_some_and(|x| x.complete),
                memory_bytes: mem.map(|x| x.bytes_verified).unwrap_or(0),
                disk_bytes: disk.map(|x| x.bytes_verified).unwrap_or(0),
                gpus,
            });
        }
        let mut plans: Vec<String> = st
            .plans
            .values()
            .filter(|p| p.digest == m.digest && p.running())
            .map(|p| p.id.clone())
            .collect();
        plans.sort();
        Ok(Whereabouts {
            model: m,
            hosts,
            plans,
        })
    }
}

/// The pinned form of `origin` a host resolved it to, if it is one: the same Hub
/// repository at a full commit ([`OriginLocation::pins`]). Anything else is not taken from
/// a host.
pub(super) fn pinned_origin(origin: &str, resolved: &str) -> Option<String> {
    let origin = OriginLocation::parse(origin).ok()?;
    OriginLocation::parse(resolved)
        .ok()
        .filter(|r| r.pins(&origin))
        .map(|_| resolved.to_string())
}

/// Parses a registered profile (`RegisterModel.profile_json`).
pub fn parse_profile(json: &str) -> Result<shardcast_policies::profile::ModelProfile, String> {
    let p: shardcast_policies::profile::ModelProfile =
        serde_json::from_str(json).map_err(|e| e.to_string())?;
    p.validate().map_err(|e| e.to_string())?;
    if p.groups.len() > 100_000 {
        warn!("a profile with {} groups", p.groups.len());
    }
    Ok(p)
}
