//! A follower's read-only view of the stored state: loaded whole at one etcd revision,
//! then kept current by a watch whose changes are decoded and applied (`apply`).

use super::*;

/// A follower's view loaded whole, and what the watch needs to follow it.
pub struct FirstView {
    /// Ends the view's own tasks (its write-behind) once another replaces it.
    pub(super) token: CancellationToken,
    /// The etcd revision it was read at.
    pub(super) revision: i64,
}

/// The first view, before any election: the stored state at one revision, read-only.
/// Retries while etcd is unreachable, for at most `patience`.
pub async fn first_view(
    cfg: &Config,
    store: Arc<EtcdStore>,
    cancel: &CancellationToken,
    patience: Duration,
    stats: &ViewStats,
) -> anyhow::Result<(Arc<Active>, FirstView)> {
    let until = Instant::now() + patience;
    // Exponential from 250 ms to 2 s, with jitter: replicas that lost etcd together do not
    // come back to it together.
    let mut pauses = {
        use backon::BackoffBuilder as _;
        backon::ExponentialBuilder::default()
            .with_min_delay(Duration::from_millis(250))
            .with_factor(2.0)
            .with_max_delay(Duration::from_secs(2))
            .without_max_times()
            .with_jitter()
            .build()
    };
    loop {
        let token = cancel.child_token();
        match load_view(cfg, &store, token.clone()).await {
            Ok((a, revision)) => {
                stats.full_loads.fetch_add(1, Ordering::Relaxed);
                stats.revision.store(revision, Ordering::Relaxed);
                return Ok((a, FirstView { token, revision }));
            }
            Err(e) if Instant::now() < until => {
                token.cancel();
                warn!("loading the state from etcd: {e}; retrying");
                let pause = pauses.next().unwrap_or(Duration::from_secs(2));
                tokio::time::sleep(pause.min(until.saturating_duration_since(Instant::now())))
                    .await;
            }
            Err(e) => {
                token.cancel();
                anyhow::bail!("loading the state from etcd (gave up after {patience:?}): {e}")
            }
        }
    }
}

/// A read-only view of the whole state as etcd holds it now, and the revision it is at.
async fn load_view(
    cfg: &Config,
    store: &Arc<EtcdStore>,
    cancel: CancellationToken,
) -> Result<(Arc<Active>, i64), ViewError> {
    let revision = store.revision().await?;
    let cfg = cfg.clone();
    let snapshot: Arc<dyn StateStore> = Arc::new(EtcdSnapshot::new(store.clone(), revision));
    let view =
        tokio::task::spawn_blocking(move || Services::open_read_only(&cfg, snapshot, cancel))
            .await
            .map_err(|e| ViewError::Task(e.to_string()))?
            .map(Active::new)?;
    Ok((view, revision))
}

/// Why a follower's view could not be loaded or kept current.
#[derive(Debug, thiserror::Error)]
pub(super) enum ViewError {
    /// etcd did not answer.
    #[error(transparent)]
    Store(#[from] crate::state::StateError),
    /// The state did not load.
    #[error(transparent)]
    Open(#[from] ApiError),
    /// The loading task failed.
    #[error("loading the view: {0}")]
    Task(String),
}

/// A follower's view in the slot and the watch that keeps it current.
pub(super) struct FollowerView {
    pub(super) cfg: Config,
    pub(super) store: Arc<EtcdStore>,
    pub(super) slot: Slot,
    pub(super) cancel: CancellationToken,
    pub(super) stats: Arc<ViewStats>,
    /// Ends the view's tasks and its watch.
    pub(super) token: CancellationToken,
    /// The first revision the view has not seen; `None`: it must be loaded whole (there
    /// is none, a compaction overtook it, or the slot holds a leader's controller).
    pub(super) next: Option<i64>,
    pub(super) watch: Option<mpsc::Receiver<WatchEvent>>,
    /// The view was loaded and no watch has started from it yet (no need to check that
    /// etcd still has its revision).
    pub(super) fresh: bool,
    /// A broken watch was logged; quiet until it works again.
    pub(super) broken_logged: bool,
}

impl FollowerView {
    /// Loads the view whole (at one revision) into the slot.
    pub(super) async fn load(&mut self) -> Result<(), ViewError> {
        let token = self.cancel.child_token();
        match load_view(&self.cfg, &self.store, token.clone()).await {
            Ok((view, revision)) => {
                self.slot.store(view);
                self.token.cancel();
                self.token = token;
                self.next = Some(revision + 1);
                self.watch = None;
                self.fresh = true;
                self.stats.full_loads.fetch_add(1, Ordering::Relaxed);
                self.stats.revision.store(revision, Ordering::Relaxed);
                Ok(())
            }
            Err(e) => {
                token.cancel();
                Err(e)
            }
        }
    }

    /// Starts a watch from the first revision not seen, unless one runs (once per campaign
    /// round at most, so an unreachable etcd is not retried in a loop). Resuming after a
    /// break, it first checks that etcd has not gone back to an older revision (restored
    /// from a backup, or replaced): a watch from a revision that etcd has not reached would
    /// wait, silently, instead of failing; the view is then loaded whole.
    pub(super) async fn ensure_watch(&mut self) -> Result<(), ViewError> {
        let (None, Some(next)) = (&self.watch, self.next) else {
            return Ok(());
        };
        if !self.fresh {
            let now = self.store.revision().await?;
            if now < next - 1 {
                warn!(
                    now,
                    next,
                    "follower view: etcd's revision is behind the view's (etcd restored or replaced): reloading the whole state"
                );
                self.load().await?;
            }
        }
        if let Some(next) = self.next {
            self.watch = Some(self.store.watch(next, self.token.child_token()));
            self.fresh = false;
        }
        Ok(())
    }

    /// The watch's next event (pending while there is no watch).
    pub(super) async fn event(&mut self) -> Option<WatchEvent> {
        match &mut self.watch {
            Some(rx) => rx.recv().await,
            None => std::future::pending().await,
        }
    }

    /// Applies one event; whether the leader key was deleted (an election is open).
    pub(super) fn handle(&mut self, event: Option<WatchEvent>) -> bool {
        let loss = match event {
            Some(WatchEvent::Changes {
                revision,
                changes,
                leader_gone,
            }) => {
                if self.next.is_none() {
                    return false;
                }
                if self.broken_logged {
                    info!(revision, "follower view: the state watch works again");
                    self.broken_logged = false;
                }
                let n = changes.len() as u64;
                apply(&self.slot.load().ctl, changes);
                self.next = Some(revision + 1);
                self.stats.applied.fetch_add(n, Ordering::Relaxed);
                self.stats.revision.store(revision, Ordering::Relaxed);
                return leader_gone;
            }
            Some(WatchEvent::Lost(loss)) => loss,
            None => WatchLoss::Broken("the watch task ended".into()),
        };
        self.watch = None;
        match loss {
            WatchLoss::Compacted { .. } => {
                warn!("follower view: {loss}: reloading the whole state");
                self.next = None;
            }
            WatchLoss::Broken(_) => {
                if !self.broken_logged {
                    warn!(
                        next = ?self.next,
                        "follower view: {loss}; resuming from the first revision not seen"
                    );
                    self.broken_logged = true;
                }
                self.stats.resumed.fetch_add(1, Ordering::Relaxed);
            }
        }
        false
    }

    /// The slot now holds a leader's controller: stop following.
    pub(super) fn retire(&mut self) {
        self.token.cancel();
        self.watch = None;
        self.next = None;
        self.stats.revision.store(0, Ordering::Relaxed);
    }
}

/// One record of a change, decoded off the state lock.
enum Record {
    Model(String, Option<ModelRecord>),
    Manifest(String, Option<Arc<Vec<u8>>>),
    Host(String, Option<StoredHost>),
    Plan(String, Option<Plan>),
    Usage(String, Option<Vec<u8>>),
    PartitionPlans(String, Option<Vec<u8>>),
}

impl Record {
    /// Decodes as [`Services::open_read_only`] does; an unreadable record counts as
    /// gone (a load would skip it), with a warning.
    fn decode(c: Change) -> Self {
        fn read<T>(
            what: &str,
            key: &str,
            bytes: Option<Vec<u8>>,
            decode: fn(&[u8]) -> Result<T, RecordError>,
        ) -> Option<T> {
            match decode(&bytes?) {
                Ok(v) => Some(v),
                Err(e) => {
                    warn!(%key, "follower view: skipping an unreadable {what} record: {e}");
                    None
                }
            }
        }
        let Change { table, key, value } = c;
        match table {
            Table::Models => {
                let v = read("model", &key, value, ModelRecord::read);
                Self::Model(key, v)
            }
            Table::Manifests => Self::Manifest(key, value.map(Arc::new)),
            Table::Hosts => {
                let v = read("host", &key, value, crate::wire::read_host_record);
                Self::Host(key, v)
            }
            Table::Plans => {
                let v = read("plan", &key, value, crate::wire::read_plan_record);
                Self::Plan(key, v)
            }
            Table::Usage => Self::Usage(key, value),
            Table::PartitionPlans => Self::PartitionPlans(key, value),
        }
    }
}

/// Applies changes seen through the watch to a follower's read-only view, in order, the
/// state's under one lock. A changed host is up and seen now (a follower never marks
/// hosts down; its `last_seen_s` is the time since the host's record last changed). A
/// plan's watchers get each stored update, and are dropped when it ends, as the
/// leader's are.
pub(crate) fn apply(ctl: &Services, changes: Vec<Change>) {
    let records: Vec<Record> = changes.into_iter().map(Record::decode).collect();
    let now = tokio::time::Instant::now();
    let mut st = lock(&ctl.core.state);
    let mut inv = ctl.core.inventory.lock();
    for r in records {
        match r {
            Record::Model(name, m) => ctl.core.registry().apply_model(name, m),
            Record::Manifest(digest, m) => ctl.core.registry().apply_manifest(digest, m),
            Record::Host(id, Some(r)) => {
                inv.hosts.insert(id, HostEntry::restored(r, now));
            }
            Record::Host(id, None) => {
                inv.hosts.remove(&id);
            }
            Record::Plan(id, Some(p)) => {
                let running = p.running();
                match st.watchers.get(&id) {
                    Some(w) => {
                        w.send_replace(p.clone());
                    }
                    None if running => {
                        st.watchers
                            .insert(id.clone(), watch::Sender::new(p.clone()));
                    }
                    None => {}
                }
                if !running {
                    st.watchers.remove(&id);
                }
                st.insert_plan(id, p);
            }
            Record::Plan(id, None) => {
                if let Some(p) = st.plans.remove(&id) {
                    for h in &p.hosts {
                        if let Some(ids) = st.receiver_plans.get_mut(&h.host) {
                            ids.retain(|x| *x != id);
                        }
                    }
                }
                st.watchers.remove(&id);
            }
            Record::Usage(digest, v) => ctl.core.usage().apply_stored(&digest, v.as_deref()),
            Record::PartitionPlans(name, v) => ctl.tables.apply_stored(&name, v.as_deref()),
        }
    }
}

/// Logs a repeated failure once until it clears.
#[derive(Default)]
pub(super) struct Quiet(Option<String>);

impl Quiet {
    pub(super) fn warn(&mut self, msg: &str) {
        if self.0.as_deref() != Some(msg) {
            warn!("{msg}");
            self.0 = Some(msg.to_string());
        }
    }

    pub(super) fn reset(&mut self) {
        if self.0.take().is_some() {
            info!("etcd reachable again");
        }
    }
}
