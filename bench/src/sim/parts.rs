//! Partitioned loads on the simulated hosts: what a host does with a `LoadModel` that
//! names a partition (the controller's partitioned burst, `shardcast_controller::burst`),
//! and the tensor index its hand-off answers (what the partition tables read when a model
//! has no registered profile).
//!
//! ## What the real agent does, and what is simulated of it
//!
//! transferd's `gpu::load_partition` (Flashpoint §4.2.5, "model completion"): it fetches
//! the safetensors headers from the partition's source, reads the tensor index, picks the
//! tensors of the named layer groups, and starts one load whose partition goes first; the
//! data plane fetches the partition's chunks first, then (with `complete`) every other
//! chunk, from the same source (a peer holding the model, else the origin). The GPU reports
//! `partition-live` once its partition is loaded, `resident` once the whole model is.
//!
//! Here, with the phases the simulator uses for every cold start ([`super::models::Phases`]:
//! network, then load into host memory, then the host-to-GPU copy), each phase's time from
//! the bytes it moves:
//!
//! 1. **The partition's bytes** (the groups' tensors in [`tensor_index`]) arrive as one flow
//!    from the source (the flow network shares the source's uplink and the origin with
//!    every other flow). A host that already holds a complete copy fetches nothing.
//! 2. **The partition's load**: `startup_s(part bytes)` from when its bytes are there; then
//!    it is live.
//! 3. **The rest's bytes** (model minus partition) are fetched from the same source right
//!    after the partition's, overlapping the partition's load; when they are there the
//!    host's copy in memory is complete.
//! 4. **The rest's load**: `startup_s(rest bytes)` from when both the rest is there and the
//!    partition's load has ended; then the GPU holds the whole model (resident).
//!
//! Not modelled: the headers' own fetch (kilobytes), streaming a chunk to the GPU while the
//! next one arrives (every cold start in the simulator downloads, then loads).
//!
//! A partition fetched from a peer that no longer holds a complete copy fails, as the real
//! fetch would: at the start the `LoadModel` call fails (the controller's burst records the
//! part as not started); for the rest, the load is marked failed (the burst's runner sees
//! `failed`).
//!
//! ## The tensor index
//!
//! A simulated model has no files; its index is built from its profile
//! ([`SimModel::profile`]): each layer group `layer.{i}` is one tensor per shard it lies
//! in, named `layer.{i}.s{shard}.weight` (`shardcast_policies::profile::group_of` maps it
//! back to `layer.{i}`), dtype `U8`, laid out in group order through the manifest's shards
//! in the region layout gpu-loader uses ([`Layout::new`]). Offsets leave out the shards'
//! safetensors headers. The hand-off is gpu-loader's own [`Handoff`] type, kind
//! `memory-file` (no files: `file` is empty), as a real host answers from its memory tier.

use std::collections::BTreeSet;

use gpu_loader::handoff::{Handoff, HandoffShard};
use gpu_loader::index::{Layout, TensorEntry};
use shardcast_controller::agents::Partition;
use shardcast_controller::error::AgentFailure;
use shardcast_controller::plan::GpuState;
use shardcast_policies::profile::group_of;

use super::dc::{Copy, Dc, Delivery, GpuDue, GpuLoadSim, HostReady, Incoming};
use super::models::{Phases, SimModel, shard_path};
use super::net::{Endpoint, FlowId, FlowSpec};

/// A partitioned load's progress (module docs: phases 1–4).
#[derive(Debug, Clone)]
pub(super) struct PartLoad {
    /// `r.k/p`, as the burst labels it.
    pub(super) label: String,
    /// The layer groups of the partition.
    pub(super) groups: Vec<String>,
    /// Bytes of the partition's tensors.
    pub(super) part_bytes: u64,
    /// Bytes of the rest (0 without completion).
    pub(super) rest_bytes: u64,
    /// Keep loading the rest once the partition is live.
    pub(super) complete: bool,
    /// Where the host fetches what it lacks.
    pub(super) source: Endpoint,
    /// (start, end) of the partition's load, once its bytes are on the host.
    pub(super) part_window: Option<(f64, f64)>,
    /// When the partition went live.
    pub(super) live_at: Option<f64>,
    /// Why the load failed.
    pub(super) failed: Option<String>,
}

/// A simulated model's tensor index (module docs) and the layout it lies in.
pub(super) fn tensor_index(
    model: &SimModel,
    shard_sizes: &[u64],
    phases: &Phases,
) -> (Layout, Vec<TensorEntry>) {
    let count = shard_sizes.len();
    let layout = Layout::new(
        &shard_sizes
            .iter()
            .enumerate()
            .map(|(i, s)| (shard_path(i, count), *s))
            .collect::<Vec<_>>(),
    );
    let mut tensors = Vec::new();
    // (shard, bytes used in it)
    let (mut shard, mut used) = (0usize, 0u64);
    for group in model.profile(phases).groups {
        let mut left = group.weight_bytes;
        while left > 0 && shard < count {
            let room = shard_sizes[shard] - used;
            if room == 0 {
                shard += 1;
                used = 0;
                continue;
            }
            let n = left.min(room);
            let slot = &layout.shards[shard];
            tensors.push(TensorEntry {
                name: format!("{}.s{shard}.weight", group.name),
                dtype: "U8".into(),
                shape: vec![usize::try_from(n).unwrap_or(usize::MAX)],
                offset: slot.offset + used,
                nbytes: n,
                shard: slot.path.clone(),
            });
            used += n;
            left -= n;
        }
    }
    (layout, tensors)
}

/// `host:port` of a `shardcast://` source, or `None` for another URI (an origin).
fn peer_addr(source: &str) -> Option<&str> {
    source.strip_prefix("shardcast://")
}

impl Dc {
    /// The hand-off document of `model` (digest or name) on host `h`, in the real agent's
    /// order: while a partition is live on a GPU (and the whole model is not yet), the
    /// GPU manager's answer — the partition's tensors, with its label; else the whole
    /// index when the host's copy in memory is complete; else not available.
    pub(super) fn handoff_json(
        &self,
        h: usize,
        model: &str,
    ) -> Result<String, (AgentFailure, String)> {
        let digest = match self.catalogue.contains_key(model) {
            true => model.to_string(),
            false => self.by_name.get(model).cloned().ok_or_else(|| {
                (
                    AgentFailure::NotFound,
                    format!("model {model:?} is not known on this host"),
                )
            })?,
        };
        let cat = &self.catalogue[&digest];
        let host = &self.hosts[h];
        let complete = host
            .copies
            .get(&digest)
            .is_some_and(|c| c.complete_at.is_some());
        let loads = host.gpus.get(&digest).into_iter().flatten();
        let live_part = loads
            .filter(|g| !g.resident)
            .filter_map(|g| g.part.as_ref())
            .find(|p| p.live_at.is_some() && p.failed.is_none());
        let partition = match (live_part, complete) {
            (Some(p), _) => Some(p),
            (None, true) => None,
            (None, false) => {
                return Err((
                    AgentFailure::Precondition,
                    format!("model {digest} is not complete in this host's memory tier"),
                ));
            }
        };
        let (layout, mut tensors) = tensor_index(&cat.model, &cat.shard_sizes, &self.cfg.phases);
        if let Some(p) = partition {
            let wanted: BTreeSet<&str> = p.groups.iter().map(String::as_str).collect();
            tensors.retain(|t| wanted.contains(group_of(&t.name).as_str()));
        }
        let h = Handoff {
            model: digest,
            name: cat.model.name.to_string(),
            kind: "memory-file".into(),
            devices: Vec::new(),
            shards: layout
                .shards
                .iter()
                .map(|s| HandoffShard {
                    path: s.path.clone(),
                    file: String::new(),
                    offset: s.offset,
                    size: s.size,
                })
                .collect(),
            tensors,
            partition: partition.map(|p| p.label.clone()),
        };
        serde_json::to_string(&h).map_err(|e| (AgentFailure::Failed, e.to_string()))
    }

    /// Host `h` loads `part` of `digest` onto `count` GPUs, asked at `now` (module docs).
    /// Errors as the real agent's: an unknown model, no layer group or an unknown one, no
    /// source, a peer source without a complete copy.
    pub(super) fn start_partition_load(
        &mut self,
        h: usize,
        digest: &str,
        count: u32,
        part: &Partition,
        now: f64,
    ) -> Result<(), (AgentFailure, String)> {
        let cat = self
            .catalogue
            .get(digest)
            .ok_or_else(|| (AgentFailure::NotFound, format!("model {digest} is unknown")))?;
        if part.groups.is_empty() {
            return Err((
                AgentFailure::Invalid,
                "a partition needs at least one layer group".into(),
            ));
        }
        let (_, tensors) = tensor_index(&cat.model, &cat.shard_sizes, &self.cfg.phases);
        let known: BTreeSet<String> = tensors.iter().map(|t| group_of(&t.name)).collect();
        let unknown: Vec<&String> = part.groups.iter().filter(|g| !known.contains(*g)).collect();
        if !unknown.is_empty() {
            return Err((
                AgentFailure::Invalid,
                format!(
                    "unknown layer groups {unknown:?}; this model has {} groups",
                    known.len()
                ),
            ));
        }
        let wanted: BTreeSet<&str> = part.groups.iter().map(String::as_str).collect();
        let part_bytes: u64 = tensors
            .iter()
            .filter(|t| wanted.contains(group_of(&t.name).as_str()))
            .map(|t| t.nbytes)
            .sum();
        let total = cat.model.bytes;
        let rest_bytes = if part.complete {
            total.saturating_sub(part_bytes)
        } else {
            0
        };
        let source = match peer_addr(&part.source) {
            _ if part.source.is_empty() => {
                return Err((
                    AgentFailure::Invalid,
                    "a simulated partition needs a source (no chain brings it)".into(),
                ));
            }
            Some(addr) => {
                let peer = self
                    .hosts
                    .iter()
                    .position(|x| format!("sim:{}:data", x.id) == addr)
                    .ok_or_else(|| {
                        (
                            AgentFailure::Unreachable,
                            format!("fetching headers: no host at {addr}"),
                        )
                    })?;
                Endpoint::Host(peer)
            }
            None => Endpoint::Origin,
        };
        let holds = |dc: &Self, i: usize| {
            dc.hosts[i]
                .copies
                .get(digest)
                .is_some_and(|c| c.complete_at.is_some())
        };
        let local = holds(self, h);
        if let (false, Endpoint::Host(peer)) = (local, source)
            && !holds(self, peer)
        {
            return Err((
                AgentFailure::Unreachable,
                format!(
                    "fetching headers: {} holds no complete copy of {digest}",
                    self.hosts[peer].id
                ),
            ));
        }
        let startup = |b: u64| self.cfg.phases.startup_s(b);
        let (part_s, rest_s) = (startup(part_bytes), startup(rest_bytes));
        let id = self.next_load;
        self.next_load += 1;
        let source_name = match source {
            Endpoint::Origin => "origin".to_string(),
            Endpoint::Host(i) => self.hosts[i].id.clone(),
        };
        let host = &mut self.hosts[h];
        let requested_at = host
            .expected
            .get_mut(digest)
            .and_then(std::collections::VecDeque::pop_front)
            .unwrap_or(now);
        let shards = self.catalogue[digest].shard_sizes.len();
        let copy = host
            .copies
            .entry(digest.to_string())
            .or_insert_with(|| Copy {
                shards_done: vec![false; shards],
                source: source_name.clone(),
                ..Copy::default()
            });
        let complete_at = copy.complete_at;
        let mut load = PartLoad {
            label: part.label.clone(),
            groups: part.groups.clone(),
            part_bytes,
            rest_bytes,
            complete: part.complete,
            source,
            part_window: None,
            live_at: None,
            failed: None,
        };
        let mut window = None;
        let mut due = Vec::new();
        if local {
            // Everything is in host memory: the partition loads now, the rest after it.
            let live = now + part_s;
            load.part_window = Some((now, live));
            due.push((live, true));
            if part.complete {
                window = Some((live, live + rest_s));
                due.push((live + rest_s, false));
            }
        }
        host.gpus
            .entry(digest.to_string())
            .or_default()
            .push(GpuLoadSim {
                id,
                count,
                asked_at: now,
                requested_at,
                window,
                resident: false,
                source: if local {
                    "local".into()
                } else {
                    source_name.clone()
                },
                part: Some(load),
            });
        let host_id = host.id.clone();
        for (at, live) in due {
            self.gpu_due.push(GpuDue {
                at,
                host: h,
                digest: digest.to_string(),
                id,
                live,
            });
        }
        let r = self
            .ready
            .entry((digest.to_string(), h))
            .or_insert_with(|| HostReady {
                host: host_id,
                copy_s: complete_at,
                load_asked_s: None,
                gpu_s: None,
                source: if local { "local".into() } else { source_name },
            });
        r.load_asked_s.get_or_insert(now);
        if !local {
            self.start_part_fetch(now, digest, source, h, part_bytes, id)
                .map_err(|e| (AgentFailure::Failed, e.to_string()))?;
        }
        self.hosts[h].changed.send_modify(|v| *v += 1);
        Ok(())
    }

    /// One flow of `bytes` of `digest` from `source` to host `h`, feeding load `load`.
    fn start_part_fetch(
        &mut self,
        now: f64,
        digest: &str,
        source: Endpoint,
        h: usize,
        bytes: u64,
        load: u64,
    ) -> Result<FlowId, super::dc::FlowError> {
        if bytes == 0 {
            return Err(super::dc::FlowError::NothingToSend);
        }
        let from_origin = source == Endpoint::Origin;
        let (flow, reached) = self.net.add_flow(
            now,
            FlowSpec {
                segments: vec![(source, Endpoint::Host(h))],
                cap_bps: if from_origin {
                    None
                } else {
                    self.cfg.hop_cap_bps
                },
                milestones: vec![bytes as f64],
            },
        )?;
        self.deliveries.insert(
            flow,
            Delivery {
                digest: digest.to_string(),
                receivers: vec![h],
                shards: Vec::new(),
                waiters: Vec::new(),
                source,
                need: vec![bytes as f64],
                gate: None,
                lags: vec![0.0],
                from_origin,
                reached: 0,
                part: Some(load),
            },
        );
        if let Some(c) = self.hosts[h].copies.get_mut(digest) {
            c.incoming.push(Incoming {
                flow,
                lag: 0.0,
                bytes: bytes as f64,
            });
        }
        self.apply(reached);
        Ok(flow)
    }

    /// The bytes of a partitioned load's fetch `flow` are on host `h` at `at`: the
    /// partition's (its load starts; the rest's fetch starts) or the rest's (the copy is
    /// complete; the rest's load is scheduled).
    pub(super) fn part_arrived(
        &mut self,
        h: usize,
        digest: &str,
        flow: FlowId,
        load: u64,
        at: f64,
    ) {
        let phases = self.cfg.phases;
        let host = &mut self.hosts[h];
        let Some(copy) = host.copies.get_mut(digest) else {
            return;
        };
        copy.incoming.retain(|i| i.flow != flow);
        let Some(g) = host
            .gpus
            .get_mut(digest)
            .and_then(|loads| loads.iter_mut().find(|g| g.id == load))
        else {
            // The load was stopped: the bytes stay, nothing follows.
            host.changed.send_modify(|v| *v += 1);
            return;
        };
        let Some(p) = g.part.as_mut() else {
            return;
        };
        let mut due = Vec::new();
        let mut fetch_rest = None;
        match p.part_window {
            None => {
                copy.partial_bytes += p.part_bytes;
                let start = at.max(g.asked_at);
                let end = start + phases.startup_s(p.part_bytes);
                p.part_window = Some((start, end));
                due.push((end, true));
                if p.complete && p.rest_bytes > 0 {
                    fetch_rest = Some((p.source, p.rest_bytes));
                } else if p.complete {
                    // The partition is the whole model.
                    copy.shards_done.iter_mut().for_each(|d| *d = true);
                    copy.partial_bytes = 0;
                    copy.complete_at = Some(at);
                    g.window = Some((end, end));
                    due.push((end, false));
                }
            }
            Some((_, part_end)) => {
                copy.shards_done.iter_mut().for_each(|d| *d = true);
                copy.partial_bytes = 0;
                copy.complete_at.get_or_insert(at);
                let start = at.max(part_end);
                let end = start + phases.startup_s(p.rest_bytes);
                g.window = Some((start, end));
                due.push((end, false));
                if let Some(r) = self.ready.get_mut(&(digest.to_string(), h)) {
                    r.copy_s.get_or_insert(at);
                }
            }
        }
        host.changed.send_modify(|v| *v += 1);
        for (t, live) in due {
            self.gpu_due.push(GpuDue {
                at: t,
                host: h,
                digest: digest.to_string(),
                id: load,
                live,
            });
        }
        let Some((source, bytes)) = fetch_rest else {
            return;
        };
        let source_holds = match source {
            Endpoint::Origin => true,
            Endpoint::Host(i) => self.hosts[i]
                .copies
                .get(digest)
                .is_some_and(|c| c.complete_at.is_some()),
        };
        let r = if source_holds {
            self.start_part_fetch(at, digest, source, h, bytes, load)
                .map(|_| ())
                .map_err(|e| e.to_string())
        } else {
            Err("the source no longer holds a complete copy".to_string())
        };
        if let Err(why) = r
            && let Some(p) = self.hosts[h]
                .gpus
                .get_mut(digest)
                .and_then(|loads| loads.iter_mut().find(|g| g.id == load))
                .and_then(|g| g.part.as_mut())
        {
            p.failed = Some(format!("fetching the rest: {why}"));
            self.hosts[h].changed.send_modify(|v| *v += 1);
        }
    }

    /// A partitioned load's partition is loaded (`due.live`): it serves.
    pub(super) fn part_live(&mut self, due: &GpuDue) {
        let host = &mut self.hosts[due.host];
        if let Some(p) = host
            .gpus
            .get_mut(&due.digest)
            .and_then(|loads| loads.iter_mut().find(|g| g.id == due.id))
            .and_then(|g| g.part.as_mut())
            && p.live_at.is_none()
            && p.failed.is_none()
        {
            p.live_at = Some(due.at);
            host.changed.send_modify(|v| *v += 1);
        }
    }
}

/// The state and loaded bytes of a partitioned load `g` of a `total`-byte model at `now`.
pub(super) fn part_gpu_state(
    g: &GpuLoadSim,
    p: &PartLoad,
    total: u64,
    now: f64,
) -> (GpuState, u64) {
    let frac = |w: Option<(f64, f64)>| match w {
        Some((start, end)) if end > start => ((now - start) / (end - start)).clamp(0.0, 1.0),
        Some((_, end)) => f64::from(u8::from(now >= end)),
        None => 0.0,
    };
    if p.failed.is_some() {
        (GpuState::Failed, 0)
    } else if g.resident {
        (GpuState::Resident, total)
    } else if p.live_at.is_some() {
        let rest = p.rest_bytes as f64 * frac(g.window);
        (GpuState::PartitionLive, p.part_bytes + rest as u64)
    } else {
        let part = p.part_bytes as f64 * frac(p.part_window);
        (GpuState::Loading, part as u64)
    }
}

/// Whether a partitioned load still moves bytes (the watch pushes progress meanwhile).
pub(super) fn part_moving(g: &GpuLoadSim, p: &PartLoad) -> bool {
    !g.resident && p.failed.is_none() && (p.complete || p.live_at.is_none())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sim::models;

    #[tokio::test(start_paused = true)]
    async fn a_partition_the_host_cannot_load_is_refused_as_the_real_agent_refuses_it() {
        use crate::sim::agents::SimAgents;
        use crate::sim::dc::{Datacenter, DcConfig, ORIGIN_PARALLEL};
        use crate::sim::net::Topology;
        use shardcast_controller::agents::{AgentAt, Agents, Load};

        let cfg = DcConfig {
            topology: Topology {
                hosts: 3,
                ..Topology::flashpoint()
            },
            gpus_per_host: 1,
            gpu_memory: 24 << 30,
            host_memory: 200 << 30,
            phases: Phases::flashpoint(),
            chunk_size: 1 << 20,
            hop_cap_bps: None,
            origin_parallel: ORIGIN_PARALLEL,
            progress_period: std::time::Duration::from_secs(2),
        };
        let gpt2 = models::find("gpt2-xl").unwrap().clone();
        let dc = Datacenter::new(cfg, std::slice::from_ref(&gpt2)).unwrap();
        let digest = dc.digest_of("gpt2-xl").unwrap();
        let agents = SimAgents::new(dc.clone());
        let at = AgentAt {
            host: "h0001".into(),
            addr: "sim:h0001:agent".into(),
        };
        let load = |groups: &[&str], source: &str| Load {
            model: digest.clone(),
            count: 1,
            heaviness: String::new(),
            partition: Some(Partition {
                groups: groups.iter().map(|g| g.to_string()).collect(),
                complete: true,
                source: source.into(),
                label: "1.1/2".into(),
            }),
        };
        let refused = |r: Result<(), shardcast_controller::error::AgentError>| {
            let e = r.unwrap_err();
            (e.failure, e.message)
        };
        let (f, why) = refused(agents.load_model(&at, load(&[], "s3://m")).await);
        assert_eq!(f, AgentFailure::Invalid, "{why}");
        let (f, why) = refused(agents.load_model(&at, load(&["layer.50"], "s3://m")).await);
        assert!(
            f == AgentFailure::Invalid && why.contains("layer.50"),
            "{why}"
        );
        let (f, why) = refused(agents.load_model(&at, load(&["layer.0"], "")).await);
        assert_eq!(f, AgentFailure::Invalid, "{why}");
        // A peer without a complete copy: the headers cannot be fetched.
        let peer = "shardcast://sim:h0002:data";
        let (f, why) = refused(agents.load_model(&at, load(&["layer.0"], peer)).await);
        assert_eq!(f, AgentFailure::Unreachable, "{why}");
        let (f, _) = refused(
            agents
                .load_model(&at, load(&["layer.0"], "shardcast://nowhere"))
                .await,
        );
        assert_eq!(f, AgentFailure::Unreachable);
        // Nothing was started by the refusals; the hand-off is not available yet.
        assert!(dc.replicas(&digest).is_empty());
        assert_eq!(
            agents.handoff(&at, &digest).await.unwrap_err().failure,
            AgentFailure::Precondition
        );
        // From the origin it starts: the partition's bytes first (1/50 of the model).
        agents
            .load_model(&at, load(&["layer.0"], "s3://bucket/gpt2-xl"))
            .await
            .unwrap();
        let groups = dc.replicas(&digest);
        assert_eq!(groups.len(), 1);
        assert_eq!(
            (groups[0].partition.as_str(), groups[0].source.as_str()),
            ("1.1/2", "origin")
        );
    }

    #[test]
    fn the_tensor_index_covers_the_model_by_group_and_shard() {
        let t5 = models::find("t5-3b").unwrap();
        let phases = Phases::flashpoint();
        let sizes = t5.shard_sizes();
        let (layout, tensors) = tensor_index(t5, &sizes, &phases);
        assert_eq!(tensors.iter().map(|t| t.nbytes).sum::<u64>(), t5.bytes);
        // Every group of the profile, in order, under its own name.
        let groups: Vec<String> = tensors.iter().map(|t| group_of(&t.name)).collect();
        let mut distinct = groups.clone();
        distinct.dedup();
        let profile: Vec<String> = t5
            .profile(&phases)
            .groups
            .into_iter()
            .map(|g| g.name)
            .collect();
        assert_eq!(distinct, profile);
        // Tensors fill each shard exactly, back to back from its region offset.
        for (i, slot) in layout.shards.iter().enumerate() {
            let mine: Vec<&TensorEntry> = tensors.iter().filter(|t| t.shard == slot.path).collect();
            assert_eq!(mine.iter().map(|t| t.nbytes).sum::<u64>(), sizes[i]);
            let mut at = slot.offset;
            for t in mine {
                assert_eq!(t.offset, at);
                at += t.nbytes;
            }
        }
        // Two shard boundaries inside groups: 55 groups, 57 tensors.
        assert_eq!(tensors.len(), 57);
        // What the controller derives from it is the registered profile's grouping.
        let named: Vec<(String, u64)> =
            tensors.iter().map(|t| (t.name.clone(), t.nbytes)).collect();
        let derived =
            shardcast_policies::profile::profile_from_tensors("t5-3b", &named, &Default::default());
        let derived: Vec<(String, u64)> = derived
            .groups
            .into_iter()
            .map(|g| (g.name, g.weight_bytes))
            .collect();
        let registered: Vec<(String, u64)> = t5
            .profile(&phases)
            .groups
            .into_iter()
            .map(|g| (g.name, g.weight_bytes))
            .collect();
        assert_eq!(derived, registered);
    }
}
