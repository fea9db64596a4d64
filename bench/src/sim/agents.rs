//! The agent port of the simulated hosts: [`SimAgents`] implements the controller's
//! [`Agents`] over the [`Datacenter`] (module docs of [`super::dc`] say what each call does
//! to a host).

use std::sync::Arc;

use futures::stream::BoxStream;
use shardcast_controller::agents::{
    AgentAt, Agents, Evict, Import, Imported, Load, ModelReport, StartChain,
};
use shardcast_controller::error::{AgentError, AgentFailure};
use tokio::sync::oneshot;

use super::dc::Datacenter;
use super::net::Endpoint;

/// The agent port of the simulated hosts.
pub struct SimAgents {
    dc: Arc<Datacenter>,
}

impl SimAgents {
    /// The agents of `dc`'s hosts.
    pub fn new(dc: Arc<Datacenter>) -> Self {
        Self { dc }
    }
}

#[async_trait::async_trait]
impl Agents for SimAgents {
    async fn start_chain(&self, at: &AgentAt, chain: StartChain) -> Result<(), AgentError> {
        let head = self.dc.host(at)?;
        let now = self.dc.now();
        let mut dc = self.dc.synced();
        if let Some(e) = dc.faults.unreachable(head) {
            return Err(e);
        }
        if !dc.sessions.insert(chain.session.clone()) {
            return Ok(());
        }
        let mut hops = Vec::with_capacity(chain.hops.len());
        for hop in &chain.hops {
            let i = dc.index.get(&hop.host).copied().ok_or_else(|| {
                agent_error(
                    &at.host,
                    AgentFailure::Invalid,
                    format!("unknown hop {}", hop.host),
                )
            })?;
            // A hop that is down never answers the head's `Open`: the head moves on down
            // its list (the controller re-plans the host once it is back).
            if !dc.faults.is_down(i) {
                hops.push(i);
            }
        }
        let holds = dc.hosts[head]
            .copies
            .get(&chain.model)
            .is_some_and(|c| c.complete_at.is_some());
        let (source, receivers) = if holds {
            (Endpoint::Host(head), hops)
        } else {
            (
                Endpoint::Origin,
                std::iter::once(head).chain(hops).collect(),
            )
        };
        // A receiver already being filled (a fault's recovery under way when the controller
        // re-plans it) keeps that one feed: the simulator sends a host's bytes once (see
        // `recovery`'s module docs). The head of an origin chain stays: the hops need it.
        let receivers: Vec<usize> = receivers
            .into_iter()
            .filter(|&r| !dc.being_filled(r, &chain.model))
            .collect();
        if receivers.is_empty() {
            return Ok(());
        }
        dc.note_chain(now, &chain.model, &receivers, source);
        dc.start_delivery(now, &chain.model, source, receivers, chain.shards)
            .map_err(|e| agent_error(&at.host, AgentFailure::Invalid, e.to_string()))?;
        drop(dc);
        self.dc.wake.notify_one();
        Ok(())
    }

    async fn import_model(&self, at: &AgentAt, import: Import) -> Result<Imported, AgentError> {
        // Only the name and whether to fetch matter here; the rest (the manifest the
        // controller sends, 350 kB for T5-3B) is dropped now, not held for the download.
        let Import {
            name,
            fetch,
            manifest,
            ..
        } = import;
        drop(manifest);
        let h = self.dc.host(at)?;
        self.dc.reachable(h)?;
        let digest = self.dc.lock().by_name.get(&name).cloned().ok_or_else(|| {
            agent_error(
                &at.host,
                AgentFailure::NotFound,
                format!("{name} is not in the simulator's catalogue"),
            )
        })?;
        if fetch {
            let (tx, rx) = oneshot::channel();
            {
                let now = self.dc.now();
                let mut dc = self.dc.synced();
                // A host already filling its copy (a recovery after a fault) does not read
                // the same chunks twice: the download joins the fill in progress (transferd
                // claims each chunk once per store) and answers when that flow ends.
                let feeding = dc.hosts[h]
                    .copies
                    .get(&digest)
                    .filter(|c| c.complete_at.is_none())
                    .and_then(|c| c.incoming.first())
                    .map(|i| i.flow);
                let flow = match feeding {
                    Some(flow) => flow,
                    // Held for the hop that feeds it: its bytes come with that hop's.
                    None if dc.being_filled(h, &digest) => {
                        drop(dc);
                        let manifest = self.dc.lock().catalogue[&digest].manifest.clone();
                        return Ok(Imported {
                            digest,
                            manifest,
                            kept: false,
                            resolved_origin: String::new(),
                        });
                    }
                    None => dc
                        .start_delivery(now, &digest, Endpoint::Origin, vec![h], Vec::new())
                        .map_err(|e| agent_error(&at.host, AgentFailure::Failed, e.to_string()))?,
                };
                if let Some(d) = dc.deliveries.get_mut(&flow) {
                    d.waiters.push(tx);
                }
            }
            self.dc.wake.notify_one();
            rx.await.map_err(|_| {
                agent_error(&at.host, AgentFailure::Failed, "the download was dropped")
            })?;
        }
        // Copied only now: 200 downloads in flight need not hold 200 manifests.
        let manifest = self.dc.lock().catalogue[&digest].manifest.clone();
        Ok(Imported {
            digest,
            manifest,
            kept: false,
            resolved_origin: String::new(),
        })
    }

    async fn model_status(
        &self,
        at: &AgentAt,
        model: &str,
    ) -> Result<Option<ModelReport>, AgentError> {
        let h = self.dc.host(at)?;
        self.dc.reachable(h)?;
        let now = self.dc.now();
        Ok(self.dc.synced().report(h, model, now))
    }

    async fn watch_model_status(
        &self,
        at: &AgentAt,
        model: &str,
    ) -> Result<BoxStream<'static, ModelReport>, AgentError> {
        let h = self.dc.host(at)?;
        self.dc.reachable(h)?;
        let rx = self.dc.lock().hosts[h].changed.subscribe();
        let period = self.dc.lock().cfg.progress_period;
        let state = (self.dc.clone(), rx, None::<ModelReport>, model.to_string());
        let stream = futures::stream::unfold(state, move |(dc, mut rx, last, model)| async move {
            loop {
                let now = dc.now();
                let (report, moving) = {
                    let d = dc.synced();
                    // A host that went down says nothing more: the stream ends.
                    if d.faults.is_down(h) {
                        return None;
                    }
                    (d.report(h, &model, now), d.moving(h, &model))
                };
                rx.borrow_and_update();
                if let Some(r) = report
                    && last.as_ref() != Some(&r)
                {
                    return Some((r.clone(), (dc, rx, Some(r), model)));
                }
                if moving {
                    tokio::select! {
                        c = rx.changed() => if c.is_err() { return None },
                        _ = dc.sleep_to_grid(period) => {}
                    }
                } else if rx.changed().await.is_err() {
                    return None;
                }
            }
        });
        Ok(Box::pin(stream))
    }

    async fn load_model(&self, at: &AgentAt, load: Load) -> Result<(), AgentError> {
        let h = self.dc.host(at)?;
        self.dc.reachable(h)?;
        let now = self.dc.now();
        let mut dc = self.dc.synced();
        match &load.partition {
            Some(part) => dc
                .start_partition_load(h, &load.model, load.count, part, now)
                .map_err(|(failure, why)| agent_error(&at.host, failure, why))?,
            None => dc
                .start_gpu_load(h, &load.model, load.count, now)
                .map_err(|(failure, why)| agent_error(&at.host, failure, why))?,
        }
        drop(dc);
        self.dc.wake.notify_one();
        Ok(())
    }

    async fn evict_model(&self, at: &AgentAt, evict: Evict) -> Result<u64, AgentError> {
        let h = self.dc.host(at)?;
        self.dc.reachable(h)?;
        Ok(self.dc.synced().evict_copy(h, &evict.model))
    }

    async fn handoff(&self, at: &AgentAt, model: &str) -> Result<String, AgentError> {
        let h = self.dc.host(at)?;
        self.dc
            .synced()
            .handoff_json(h, model)
            .map_err(|(failure, why)| agent_error(&at.host, failure, why))
    }
}

fn agent_error(host: &str, failure: AgentFailure, message: impl Into<String>) -> AgentError {
    AgentError {
        host: host.to_string(),
        failure,
        message: message.into(),
    }
}
