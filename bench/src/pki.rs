//! The PKI of local and emulated clusters: one throw-away cluster CA per process, in a
//! private temporary directory, with a certificate per identity issued on first use. Every
//! daemon, controller and client the harness starts uses it, so benchmarks and tests run
//! with mutual TLS like production. The directory is removed when the last user drops it.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};

use anyhow::Context;
use shardcast_identity::pki::{IssueRequest, PkiDir};
use shardcast_identity::{Identity, Role, TlsContext, TlsFiles};

/// A cluster CA and the certificates issued so far.
pub struct ClusterPki {
    dir: tempfile::TempDir,
    pki: PkiDir,
    issued: Mutex<HashMap<Identity, TlsFiles>>,
    clients: Mutex<HashMap<Role, Arc<TlsContext>>>,
    signer: std::sync::OnceLock<shardcast_identity::plan::PlanSigner>,
}

impl std::fmt::Debug for ClusterPki {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClusterPki")
            .field("dir", &self.dir.path())
            .finish()
    }
}

static SHARED: Mutex<Weak<ClusterPki>> = Mutex::new(Weak::new());

impl ClusterPki {
    /// The process's cluster PKI, created on first use.
    pub fn shared() -> anyhow::Result<Arc<Self>> {
        let mut slot = SHARED
            .lock()
            .map_err(|_| anyhow::anyhow!("PKI lock poisoned"))?;
        if let Some(p) = slot.upgrade() {
            return Ok(p);
        }
        let p = Arc::new(Self::new()?);
        *slot = Arc::downgrade(&p);
        Ok(p)
    }

    /// A new CA in a fresh temporary directory.
    pub fn new() -> anyhow::Result<Self> {
        let dir = tempfile::Builder::new()
            .prefix("shardcast-pki-")
            .tempdir()
            .context("creating the PKI directory")?;
        let pki = PkiDir::new(dir.path().join("pki"));
        pki.init(
            "shardcast test cluster CA",
            shardcast_identity::pki::DEFAULT_CA_VALIDITY,
        )?;
        Ok(Self {
            dir,
            pki,
            issued: Mutex::default(),
            clients: Mutex::default(),
            signer: std::sync::OnceLock::new(),
        })
    }

    /// The PKI directory (`ca.pem`, `ca.key`, `<role>-<name>.pem/.key`).
    pub fn dir(&self) -> &std::path::Path {
        self.dir.path()
    }

    /// The CA (for issuing more, e.g. expired certificates in tests).
    pub fn pki(&self) -> &PkiDir {
        &self.pki
    }

    /// The files of `role`/`name`, issued on first use.
    pub fn files(&self, role: Role, name: &str) -> anyhow::Result<TlsFiles> {
        let id = Identity::new(role, name)?;
        let mut issued = self
            .issued
            .lock()
            .map_err(|_| anyhow::anyhow!("PKI lock poisoned"))?;
        if let Some(f) = issued.get(&id) {
            return Ok(f.clone());
        }
        let files = self.pki.issue(&IssueRequest::new(id.clone()))?;
        let f = TlsFiles {
            ca: self.pki.ca().cert,
            cert: files.cert,
            key: files.key,
        };
        issued.insert(id, f.clone());
        Ok(f)
    }

    /// Issues `role`/`name` valid for `validity` from now, in place of what was issued for
    /// it before: [`Self::files`] and [`Self::args`] give these files from then on (a
    /// certificate near its end, for the expiry warnings' tests).
    pub fn issue_valid_for(
        &self,
        role: Role,
        name: &str,
        validity: std::time::Duration,
    ) -> anyhow::Result<TlsFiles> {
        let id = Identity::new(role, name)?;
        let mut req = IssueRequest::new(id.clone());
        req.validity = validity;
        let files = self.pki.issue(&req)?;
        let f = TlsFiles {
            ca: self.pki.ca().cert,
            cert: files.cert,
            key: files.key,
        };
        self.issued
            .lock()
            .map_err(|_| anyhow::anyhow!("PKI lock poisoned"))?
            .insert(id, f.clone());
        Ok(f)
    }

    /// `--tls-ca … --tls-cert … --tls-key …` for a process with this identity.
    pub fn args(&self, role: Role, name: &str) -> anyhow::Result<Vec<String>> {
        let f = self.files(role, name)?;
        Ok(vec![
            "--tls-ca".into(),
            f.ca.display().to_string(),
            "--tls-cert".into(),
            f.cert.display().to_string(),
            "--tls-key".into(),
            f.key.display().to_string(),
        ])
    }

    /// Signs `req` as the controller would: a plan token for its model naming `head`, the
    /// `holders` a `shardcast://` fallback may point at, and every hop of its chains, each at
    /// its address, valid for [`shardcast_identity::plan::PLAN_TOKEN_TTL`], that
    /// binds the model's name (from `req.manifest`, when it carries one) on the receivers.
    /// Harnesses that start chains without a controller (data-plane benchmarks, tests)
    /// use it; hops refuse sessions without one.
    pub fn sign_chain(
        &self,
        req: &mut shardcast_protocol::agent::StartChainRequest,
        head: &shardcast_protocol::Hop,
        holders: &[shardcast_protocol::Hop],
    ) -> anyhow::Result<()> {
        let mut hosts = vec![head.clone()];
        hosts.extend_from_slice(holders);
        for c in &req.chains {
            for h in &c.hops {
                hosts.push(shardcast_protocol::Hop {
                    host: shardcast_protocol::HostId::new(&h.host_id)?,
                    addr: h.addr.clone(),
                });
            }
        }
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH)?;
        let claims = shardcast_protocol::plan::PlanClaims {
            plan: format!("harness-{}", req.session_id),
            model: req.model.parse()?,
            not_after: now.as_secs() + shardcast_identity::plan::PLAN_TOKEN_TTL.as_secs(),
            issued_at_ms: now.as_millis() as u64,
            hosts,
            name: match req.manifest.is_empty() {
                true => None,
                false => Some(
                    shardcast_protocol::codec::decode_exact::<shardcast_protocol::Manifest>(
                        req.manifest.clone().into(),
                    )?
                    .name,
                ),
            },
        };
        req.plan_token = self.sign(&claims)?;
        Ok(())
    }

    /// A plan token for `claims`, signed with this CA's controller key (loaded once).
    pub fn sign(&self, claims: &shardcast_protocol::plan::PlanClaims) -> anyhow::Result<Vec<u8>> {
        let signer = match self.signer.get() {
            Some(s) => s,
            None => {
                let s = shardcast_identity::plan::PlanSigner::load(
                    &self.files(Role::Controller, "controller")?,
                )?;
                self.signer.get_or_init(|| s)
            }
        };
        Ok(signer.sign(claims)?)
    }

    /// A client TLS context with `role` (name `test-<role>`), built once.
    pub fn client(&self, role: Role) -> anyhow::Result<Arc<TlsContext>> {
        let mut clients = self
            .clients
            .lock()
            .map_err(|_| anyhow::anyhow!("PKI lock poisoned"))?;
        if let Some(c) = clients.get(&role) {
            return Ok(c.clone());
        }
        let ctx = TlsContext::load(self.files(role, &format!("test-{role}"))?)?;
        clients.insert(role, ctx.clone());
        Ok(ctx)
    }
}
