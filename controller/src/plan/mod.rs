//! Plans and their receivers as the controller's core holds them: typed states, the
//! transitions a receiver goes through as pure functions of what its host reports, and the
//! versioned record a plan is persisted as. The wire messages (`PlanStatus`,
//! `HostProgress`, `PlanAccepted`) are made from these only at the edge, in
//! [`crate::wire`].
//!
//! A receiver's life:
//!
//! ```text
//!   pending ──bytes──▶ receiving ──complete──▶ done
//!      │                   │   └─(tier gpu: data complete, GPUs loading)─▶ loading ──resident──▶ done
//!      │                   │
//!      └───────────────────┴──▶ lost (stopped heartbeating) | failed (GPU load failed,
//!                                 no progress after the re-plans)
//!   local (held it already) · joined (receiving it in another plan) ──re-plan──▶ receiving
//!   lost | failed ──heartbeat reports a complete copy──▶ done
//! ```

use serde::{Deserialize, Serialize};
use shardcast_placement::Tier;

pub use shardcast_protocol::named::UnknownName;
pub(crate) use shardcast_protocol::named_enum;

named_enum! {
    /// Where a plan is.
    PlanState {
        /// Some receiver is still in progress.
        Running = "running",
        /// Ended with every receiver holding a copy.
        Done = "done",
        /// Ended with some receivers holding a copy and the others given up (lost or
        /// failed): what a platform that asked for N replicas and got fewer must see.
        Partial = "partial",
        /// Ended with none holding a copy.
        Failed = "failed",
    }
}

named_enum! {
    /// How a plan moves the model.
    PlanKind {
        /// A prewarm or scale-out moved by chain plans.
        Chains = "chains",
        /// A partitioned burst: each host loads its partition first, then the rest.
        Burst = "burst",
    }
}

named_enum! {
    /// Where one receiver of a plan is.
    ReceiverState {
        /// Its chain has not delivered anything yet.
        Pending = "pending",
        /// Bytes are arriving.
        Receiving = "receiving",
        /// It receives the model in another plan in flight.
        Joined = "joined",
        /// Tier gpu: the data is here, the GPUs are loading it (or a burst partition loads).
        Loading = "loading",
        /// It holds a verified copy (and, tier gpu, its GPUs hold it).
        Done = "done",
        /// It held the model before the plan.
        Local = "local",
        /// It stopped heartbeating during the plan.
        Lost = "lost",
        /// It cannot finish (a GPU load failed, no progress after the re-plans, a part that
        /// did not start).
        Failed = "failed",
    }
}

impl ReceiverState {
    /// Still moving: the plan waits for it.
    pub fn is_active(self) -> bool {
        matches!(
            self,
            Self::Pending | Self::Receiving | Self::Joined | Self::Loading
        )
    }

    /// It holds a copy now.
    pub fn holds_copy(self) -> bool {
        matches!(self, Self::Done | Self::Local)
    }

    /// The plan gave up on it.
    pub fn gave_up(self) -> bool {
        matches!(self, Self::Lost | Self::Failed)
    }

    /// Data still to arrive counts against the host's free space.
    pub fn awaits_data(self) -> bool {
        matches!(self, Self::Pending | Self::Receiving)
    }
}

named_enum! {
    /// Where a receiver's GPUs are with the model (tier gpu), summed over its GPUs.
    GpuState {
        /// Some GPU is still loading.
        Loading = "loading",
        /// Every GPU holds at least its partition (bursts).
        PartitionLive = "partition-live",
        /// Every GPU holds the whole model.
        Resident = "resident",
        /// A load failed.
        Failed = "failed",
        /// The host has no GPU backend (or refused the load): the model is in its memory
        /// tier.
        Unavailable = "unavailable",
    }
}

impl GpuState {
    /// One state for a host from its GPUs' own (the agent's `GpuLoad.state` names):
    /// failed if any failed, resident if all are, partition-live if all are at least
    /// that, else loading. `None` without GPUs.
    pub fn of_gpus<'a>(states: impl IntoIterator<Item = &'a str>) -> Option<Self> {
        let mut any = false;
        let (mut failed, mut all_resident, mut all_live) = (false, true, true);
        for s in states {
            any = true;
            failed |= s == "failed";
            all_resident &= s == "resident";
            all_live &= s == "resident" || s == "partition-live";
        }
        any.then_some(if failed {
            Self::Failed
        } else if all_resident {
            Self::Resident
        } else if all_live {
            Self::PartitionLive
        } else {
            Self::Loading
        })
    }

    /// The GPUs serve the model (or the host has none to load onto).
    pub fn serves(self) -> bool {
        matches!(self, Self::Resident | Self::Unavailable)
    }
}

/// One receiver of a plan.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ReceiverProgress {
    /// Host id.
    pub host: String,
    /// Where it is.
    pub state: ReceiverState,
    /// Verified bytes on the host.
    pub bytes: u64,
    /// The model's size.
    pub total: u64,
    /// Host id of its chain's source, `origin`, `local`, `peer` or the other plan's id.
    pub source: String,
    /// Why it is not moving, or a note on how it ended.
    pub error: String,
    /// GPU slots reserved on it (tier gpu).
    pub gpus: u32,
    /// Tier gpu: bytes on its GPUs (summed).
    pub gpu_bytes: u64,
    /// Tier gpu: its GPUs' state.
    pub gpu_state: Option<GpuState>,
    /// Bursts: its partition (`r.k/p`).
    pub partition: String,
    /// Bursts: seconds from the plan's start until its partition was live (0 until then).
    pub live_s: f64,
    /// Seconds from the plan's start until it held a verified copy (0 until then).
    pub done_s: f64,
    /// When it was marked `lost` (Unix seconds; 0: it is not lost).
    #[serde(default)]
    pub lost_at: f64,
    /// Re-plans of it in a row without progress in between (see [`Self::replanned`]).
    #[serde(default)]
    pub fruitless_replans: u32,
    /// Its bytes when it was last re-planned.
    #[serde(default)]
    pub bytes_at_replan: u64,
    /// Lost because its host's store refused the data (no room): re-planned only once the
    /// host reports room for the rest ([`Self::room_for_rest`]).
    #[serde(default)]
    pub awaits_room: bool,
}

impl ReceiverProgress {
    /// A receiver in `state` with nothing moved yet.
    pub fn new(host: impl Into<String>, state: ReceiverState) -> Self {
        Self {
            host: host.into(),
            state,
            bytes: 0,
            total: 0,
            source: String::new(),
            error: String::new(),
            gpus: 0,
            gpu_bytes: 0,
            gpu_state: None,
            partition: String::new(),
            live_s: 0.0,
            done_s: 0.0,
            lost_at: 0.0,
            fruitless_replans: 0,
            bytes_at_replan: 0,
            awaits_room: false,
        }
    }

    /// Whether it may be re-planned once more with a budget of `max` re-plans without
    /// progress: a receiver that moved bytes since its last re-plan starts a new count (a
    /// host restarted during a rolling restart, then stalled by the next host's restart,
    /// is not failed for it); one that did not is failed after `max` in a row. Counts this
    /// re-plan when it may.
    pub fn replanned(&mut self, max: u32) -> bool {
        let moved = self.moved();
        if moved > self.bytes_at_replan {
            self.fruitless_replans = 0;
        }
        if self.fruitless_replans >= max {
            return false;
        }
        self.fruitless_replans += 1;
        self.bytes_at_replan = moved;
        true
    }

    /// Progress, as the stall clock counts it: data-plane bytes plus GPU bytes.
    pub fn moved(&self) -> u64 {
        self.bytes.saturating_add(self.gpu_bytes)
    }

    /// The host stopped heartbeating. True when this changed the receiver.
    pub fn lose(&mut self, why: &str, now: f64) -> bool {
        let before = (self.state, self.error.len());
        if self.state != ReceiverState::Lost {
            self.lost_at = now;
        }
        self.state = ReceiverState::Lost;
        if self.error != why {
            self.error = why.to_string();
        }
        before != (self.state, self.error.len())
    }

    /// Marked `lost` less than `grace` seconds before `now`: a running plan waits for it.
    pub fn awaits_return(&self, now: f64, grace: f64) -> bool {
        self.state == ReceiverState::Lost && self.lost_at > 0.0 && now - self.lost_at < grace
    }

    /// Its host is back within the grace (or, for a receiver whose store refused the data,
    /// has room again) and was re-planned: receiving again.
    pub fn come_back(&mut self) {
        self.state = ReceiverState::Receiving;
        self.error = match self.awaits_room {
            true => "the host's store has room again; resuming from its verified chunks",
            false => "the host returned after it was lost; resuming from its verified chunks",
        }
        .into();
        self.lost_at = 0.0;
        self.awaits_room = false;
    }

    /// Back (or with room again), but held back at `now` so as not to read the origin
    /// beside the plan's other receivers: its grace starts again, and its note says why.
    pub fn defer_return(&mut self, now: f64) {
        const WHY: &str = "; back, waiting for a peer's complete copy rather than reading the origin beside the plan's other receivers";
        self.lost_at = now;
        if !self.error.ends_with(WHY) {
            self.error.push_str(WHY);
        }
    }

    /// Its host's store refused the data (`observe` failed it saying why) and the plan
    /// waits up to `grace` seconds: lost, awaiting room, from `now`. The host's verified
    /// chunks stay; once it reports room for the rest it is re-planned and resumes.
    fn wait_for_room(&mut self, now: f64, grace: f64) {
        if self.state != ReceiverState::Failed || grace <= 0.0 {
            return;
        }
        self.state = ReceiverState::Lost;
        self.lost_at = now;
        self.awaits_room = true;
        self.error = format!(
            "{}; the plan waits up to {grace:.0}s for room on the host",
            self.error
        );
    }

    /// Whether `free` bytes in the plan's tier (the host's report) hold the rest of the
    /// copy; always for a receiver not awaiting room.
    pub fn room_for_rest(&self, free: u64) -> bool {
        !self.awaits_room || free >= self.total.saturating_sub(self.bytes)
    }

    /// Its agent did not answer (the host still heartbeats): only the note changes; the
    /// stall clock decides. True when the note changed.
    pub fn unanswered(&mut self, why: String) -> bool {
        let changed = self.error != why;
        self.error = why;
        changed
    }

    /// One report of a chain plan's receiver: `seen` is what its agent says; `gpu_refused`
    /// is why the host could not be asked to load (tier gpu); `round` the plan's tier and
    /// clock. Tier gpu receivers with GPU slots are done only once their GPUs serve the
    /// model; a receiver whose store refused the data waits for room within the lost grace.
    /// True when something changed.
    pub fn observe(&mut self, seen: &Seen, gpu_refused: Option<&str>, round: &Round) -> bool {
        let Round {
            tier,
            total,
            elapsed,
            now,
            lost_grace,
        } = *round;
        let before = self.clone();
        self.error = gpu_refused.unwrap_or_default().to_string();
        let complete = if tier == Tier::Gpu && self.gpus > 0 {
            let (gb, gs) = match (gpu_refused, seen.gpu) {
                (Some(_), _) => (0, Some(GpuState::Unavailable)),
                (None, Some((b, s))) => (b, Some(s)),
                (None, None) => (0, None),
            };
            self.gpu_bytes = gb;
            self.gpu_state = gs;
            if seen.complete && gs == Some(GpuState::Failed) {
                self.state = ReceiverState::Failed;
                self.error = "loading onto the GPUs failed (see the host's GpuStatus)".into();
                false
            } else {
                let serves = gs.is_some_and(GpuState::serves);
                if seen.complete && !serves {
                    self.state = ReceiverState::Loading;
                }
                seen.complete && serves
            }
        } else {
            seen.complete
        };
        if let Some(t) = total {
            self.total = t;
        }
        self.bytes = seen.bytes;
        if complete {
            self.state = ReceiverState::Done;
            self.bytes = self.total;
            if before.state != ReceiverState::Done {
                self.done_s = elapsed.max(0.0);
            }
        } else if let Some(why) = seen.store_failure() {
            // Its store cannot take the copy: said at once, not after the stall clock; the
            // plan waits for room within its lost grace (failed without one).
            self.state = ReceiverState::Failed;
            self.error = format!("the host's store refused the data: {why}");
            self.wait_for_room(now, lost_grace);
        } else if self.state == ReceiverState::Pending && seen.bytes > 0 {
            self.state = ReceiverState::Receiving;
        }
        *self != before
    }

    /// One report of a burst host (loading its partition, then the rest). True when
    /// something changed.
    pub fn observe_burst(&mut self, seen: &Seen, elapsed: f64) -> bool {
        let before = self.clone();
        self.error.clear();
        self.bytes = seen.bytes;
        if let Some((bytes, gs)) = seen.gpu {
            self.gpu_bytes = bytes;
            if matches!(gs, GpuState::PartitionLive | GpuState::Resident) && self.live_s == 0.0 {
                self.live_s = elapsed.max(f64::MIN_POSITIVE);
            }
            match gs {
                GpuState::Failed => {
                    self.state = ReceiverState::Failed;
                    self.error = "loading the partition failed (see the host's GpuStatus)".into();
                }
                GpuState::Resident if seen.complete => {
                    self.state = ReceiverState::Done;
                    self.bytes = self.total;
                }
                _ => {}
            }
            self.gpu_state = Some(gs);
        }
        *self != before
    }

    /// A heartbeat shows the host holds a complete copy (resident on its GPUs when
    /// `resident`, for tier gpu): a receiver the plan gave up on is done again. Returns the
    /// state it had when it recovered.
    pub fn recover(&mut self, tier: Tier, resident: bool, elapsed: f64) -> Option<ReceiverState> {
        if !self.state.gave_up() || (tier == Tier::Gpu && self.gpus > 0 && !resident) {
            return None;
        }
        let was = std::mem::replace(&mut self.state, ReceiverState::Done);
        self.bytes = self.total;
        self.done_s = elapsed.max(0.0);
        self.error = format!("completed after it was marked {was} (seen in its heartbeat)");
        Some(was)
    }
}

/// A plan's round, as [`ReceiverProgress::observe`] needs it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Round {
    /// The plan's tier.
    pub tier: Tier,
    /// The model's size, if known.
    pub total: Option<u64>,
    /// The plan's age, seconds.
    pub elapsed: f64,
    /// Now, seconds since the epoch.
    pub now: f64,
    /// How long the plan waits for a lost receiver, seconds.
    pub lost_grace: f64,
}

/// What a receiver's agent reports about the model (polled or pushed).
#[derive(Debug, Default, Clone, PartialEq)]
pub struct Seen {
    /// Verified bytes in the plan's data tier.
    pub bytes: u64,
    /// Every chunk verified there.
    pub complete: bool,
    /// Tier gpu: bytes on its GPUs and their state, when it has GPUs loading the model.
    pub gpu: Option<(u64, GpuState)>,
    /// Why the host's store refused the model's data in the plan's tier (no room, a write
    /// the file system failed), by session (hex): its last session of the model there.
    /// After [`Seen::for_sessions`], only those in the plan's own sessions.
    pub store_failures: Vec<(String, String)>,
}

impl Seen {
    /// Keeps only the store refusals in a session of `sessions` (a plan's own; an older
    /// plan's refusal is not this one's).
    pub fn for_sessions<'a>(mut self, sessions: impl Iterator<Item = &'a str>) -> Self {
        // Nothing to filter (every report but a refusal): the plan runner calls this for
        // every receiver on every round, and hashing a plan's sessions each time made a
        // round O(receivers x chains) — 40,000 hashes a round for 200 hosts each fed by the
        // origin (found by the simulator, `shardcast-bench simulate`).
        if self.store_failures.is_empty() {
            return self;
        }
        let sessions: std::collections::HashSet<&str> = sessions.collect();
        self.store_failures
            .retain(|(s, _)| sessions.contains(s.as_str()));
        self
    }

    /// Why the host's store refused the data, if it did.
    pub fn store_failure(&self) -> Option<&str> {
        self.store_failures.first().map(|(_, why)| why.as_str())
    }
}

/// One chain of a plan, as planned (what callers see).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChainSummary {
    /// Host id of the source, or `origin`.
    pub source: String,
    /// `memory`, `disk` or `origin`.
    pub source_tier: String,
    /// Receivers in order.
    pub hops: Vec<String>,
    /// Shards (empty = all).
    pub shards: Vec<u32>,
    /// Bytes it moves.
    pub bytes: u64,
    /// Its estimate.
    pub estimate_s: f64,
}

/// One chain as started on the data plane.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChainRun {
    /// Host whose agent heads the chain.
    pub head: String,
    /// Session id (hex), chosen by the controller.
    pub session: String,
    /// Receivers after the head.
    pub hops: Vec<String>,
    /// Shards (empty = all).
    pub shards: Vec<u32>,
    /// Fetch from the origin (the head is the only receiver, or the head is a receiver).
    pub from_origin: bool,
    /// Started on the agent.
    pub started: bool,
    /// Why starting it failed.
    pub error: String,
}

/// A plan: what it moves where, its receivers, and the chains started for it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Plan {
    /// Id (hex).
    pub id: String,
    /// Model name.
    pub model: String,
    /// Hex manifest digest.
    pub digest: String,
    /// Target tier.
    pub tier: Tier,
    /// Where it is.
    pub state: PlanState,
    /// Chains or a burst.
    pub kind: PlanKind,
    /// Its receivers.
    pub hosts: Vec<ReceiverProgress>,
    /// Estimated seconds until every receiver holds a copy.
    pub estimate_s: f64,
    /// A note for callers (re-plans, hosts it finished without).
    pub message: String,
    /// Chains as planned.
    pub chains: Vec<ChainSummary>,
    /// Chains started (or to start).
    pub runs: Vec<ChainRun>,
    /// Times stalled receivers were re-planned.
    pub replans: u32,
    /// Seconds since the epoch when it was made.
    pub created_at: f64,
    /// Seconds since the epoch when it ended.
    pub ended_at: Option<f64>,
    /// Bursts: seconds until every started partition was live (0 until then).
    pub live_s: f64,
    /// Origin URI (every hop's fallback).
    pub origin: String,
    /// How its chains' hops dial each other (records from before transports: TCP).
    #[serde(default)]
    pub transport: shardcast_protocol::HopTransport,
}

impl Plan {
    /// A running plan of `kind` with these receivers, made at `created_at` (seconds since
    /// the epoch); no chains, runs or estimate yet (set them with struct update syntax).
    pub fn started(
        id: impl Into<String>,
        (model, digest): (impl Into<String>, impl Into<String>),
        tier: Tier,
        kind: PlanKind,
        hosts: Vec<ReceiverProgress>,
        origin: impl Into<String>,
        created_at: f64,
    ) -> Self {
        Self {
            id: id.into(),
            model: model.into(),
            digest: digest.into(),
            tier,
            state: PlanState::Running,
            kind,
            hosts,
            estimate_s: 0.0,
            message: String::new(),
            chains: Vec::new(),
            runs: Vec::new(),
            replans: 0,
            created_at,
            ended_at: None,
            live_s: 0.0,
            origin: origin.into(),
            transport: shardcast_protocol::HopTransport::Tcp,
        }
    }

    /// Still running.
    pub fn running(&self) -> bool {
        self.state == PlanState::Running
    }

    /// Seconds from its start to its end, or to `now` while it runs.
    pub fn elapsed_s(&self, now: f64) -> f64 {
        (self.ended_at.unwrap_or(now) - self.created_at).max(0.0)
    }

    /// Its receiver on `host`.
    pub fn receiver_mut(&mut self, host: &str) -> Option<&mut ReceiverProgress> {
        self.hosts.iter_mut().find(|h| h.host == host)
    }

    /// Ends the plan once no receiver is active: `done` when every receiver holds a copy,
    /// `partial` when some do and the others gave up (lost or failed), `failed` when none
    /// does; the message names the ones it finished without. True when it ended now.
    /// Called again on an ended plan (a receiver completed after it was marked lost), it
    /// recomputes the outcome and keeps the end time.
    pub fn settle(&mut self, now: f64) -> bool {
        self.settle_after(now, 0.0)
    }

    /// [`Plan::settle`], but a receiver lost less than `grace` seconds ago keeps the plan
    /// running: its host may come back and be re-planned.
    pub fn settle_after(&mut self, now: f64, grace: f64) -> bool {
        if self.hosts.iter().any(|h| {
            h.state.is_active() || (self.state == PlanState::Running && h.awaits_return(now, grace))
        }) {
            return false;
        }
        let any_ok = self.hosts.iter().any(|h| h.state.holds_copy());
        let lost: Vec<&str> = self
            .hosts
            .iter()
            .filter(|h| h.state.gave_up())
            .map(|h| h.host.as_str())
            .collect();
        let was_running = self.running();
        if !lost.is_empty() {
            self.message = format!("finished without {}: see their errors", lost.join(", "));
        } else if self.message.starts_with("finished without") {
            self.message.clear();
        }
        self.state = match (any_ok, lost.is_empty()) {
            (false, _) => PlanState::Failed,
            (true, true) => PlanState::Done,
            (true, false) => PlanState::Partial,
        };
        if self.ended_at.is_none() {
            self.ended_at = Some(now);
        }
        was_running
    }
}

/// A plan just made: its id, estimate, chains and receivers (what `Prewarm` and `ScaleOut`
/// answer).
#[derive(Debug, Clone, PartialEq)]
pub struct Accepted {
    /// The plan's id.
    pub plan_id: String,
    /// Estimated seconds until every receiver holds a copy.
    pub estimate_s: f64,
    /// Chains as planned (none for a burst).
    pub chains: Vec<ChainSummary>,
    /// Its receivers and how they get the model.
    pub hosts: Vec<ReceiverProgress>,
}

/// A plan as persisted: versioned, so a later layout can still read this one.
#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "version")]
pub enum StoredPlan {
    /// The first typed layout.
    #[serde(rename = "1")]
    V1(Plan),
}

/// [`StoredPlan`] by reference, for saving without a copy (the same JSON).
#[derive(Debug, Serialize)]
#[serde(tag = "version")]
pub enum StoredPlanRef<'a> {
    /// The first typed layout.
    #[serde(rename = "1")]
    V1(&'a Plan),
}

impl From<Plan> for StoredPlan {
    fn from(p: Plan) -> Self {
        Self::V1(p)
    }
}

impl StoredPlan {
    /// The plan in it.
    pub fn into_plan(self) -> Plan {
        match self {
            Self::V1(p) => p,
        }
    }

    /// A stored plan record in the typed layout (`crate::wire::read_plan_record` reads
    /// the legacy one too).
    pub fn decode(bytes: &[u8]) -> Result<Plan, crate::error::RecordError> {
        Ok(serde_json::from_slice::<Self>(bytes).map(Self::into_plan)?)
    }
}

#[cfg(test)]
mod tests;
