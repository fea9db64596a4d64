//! # The datacenter simulator (`shardcast-bench simulate`)
//!
//! Cold starts at a scale the emulated cluster cannot reach (Flashpoint's 200 hosts × 8
//! GPUs), decided by shardcast's own control plane, on a virtual clock.
//!
//! ## Goals
//!
//! * **The real controller, not a model of it.** The simulator opens a
//!   [`shardcast_controller::core::Controller`] with
//!   [`open_with`](shardcast_controller::core::Controller::open_with) and hands it
//!   [`agents::SimAgents`], an implementation of the controller's agent port
//!   ([`shardcast_controller::agents::Agents`]). Registration, the host inventory
//!   (heartbeats), placement and hierarchical sourcing (`shardcast-placement`), chain plans,
//!   the plan runner (starting chains, following receivers, asking GPU hosts to load,
//!   re-planning stalls) are the controller's code; the simulator only plays the hosts.
//! * **Virtual time, deterministic and fast.** Everything runs on one current-thread tokio
//!   runtime built with `start_paused(true)`: the controller's timers (poll ticks, heartbeat
//!   expiry, stall clocks — it reads `tokio::time::Instant`, so its clock is the virtual one),
//!   the hosts' heartbeats and the network's events all sleep on the paused clock, and tokio
//!   jumps it to the next timer whenever every task is idle. A burst of 200 cold starts that
//!   takes hours of virtual time runs in seconds, and the same inputs give the same report.
//!   The controller's seconds-since-the-epoch (`now_unix`: plan stamps, events, the
//!   autoscaler's state, the lost grace of hosts that stopped heartbeating) are the tokio
//!   clock too, anchored once to the system clock; only what other processes read (plan
//!   tokens, heartbeat answers) keeps the system clock.
//! * **A flow-level network** ([`net`]): Flashpoint's spine-leaf topology with max-min fair
//!   sharing over the links each flow crosses, recomputed only when a flow starts or ends;
//!   a pipelined chain is one flow through all its hops. Exact completion times come from
//!   the model, not from the timer wheel's millisecond ticks.
//! * **The thesis' parameters by default** ([`models`], [`net::Topology::flashpoint`]), each
//!   one overridable, and each assumption the thesis does not settle written down where it
//!   is made.
//!
//! Non-goals (of this step): packet-level effects (slow start, losses), CPU contention on the
//! hosts except as a per-hop rate cap, the data plane's own code (transferd's sessions are
//! tested on real sockets and namespaces).
//!
//! ## Who talks to whom
//!
//! ```text
//!  coldstart::run ─ prewarm / register / heartbeat ─► Controller (real)
//!                                                       │ agent port
//!                                                       ▼
//!        fleet heartbeats ◄── HostView ── dc::Datacenter ◄── agents::SimAgents
//!                                          │  (hosts' copies, GPU loads)
//!                                          ▼
//!                                       net::Network (flows, rates, milestones)
//! ```
//!
//! [`coldstart`] runs one burst: a fresh datacenter and controller (in-memory state,
//! [`store::MemStore`]), the hosts register by heartbeat, the model is registered (a host
//! "builds" its manifest), then a `Prewarm` of tier gpu for `N` replicas, either with
//! `sources: origin` (every host from the origin: the thesis' baseline) or the controller's
//! own plan (chains). The run ends when the controller's plan ends; each host's cold start
//! is when its GPU replica became resident, as the datacenter recorded it.
//!
//! ## Trace-driven runs
//!
//! [`workload`] runs one model under a request-rate trace for a duration of virtual time: a
//! global request queue served by the model's GPU replicas ([`serve`], exact FIFO on the
//! replica free earliest), an autoscaler ([`scalers`]: the thesis' TSK, ATL, OWK and SM*
//! baselines and shardcast's own `policies::autoscale` rule; or [`autoscaler`]: the
//! controller's `Autoscaler` service itself, acting through a simulated fleet) that scales through the
//! controller — `ScaleOut` (or a `Prewarm` with `sources: origin` for the baseline), the
//! controller's partitioned bursts (`Controller::burst` with a plan from its partition
//! tables, [`pipelines`]; the hosts load partitions and complete the model, `parts`) and
//! GPU `Evict` — and one technique per run (baseline, plus locality, plus chain
//! multicast, plus partitioning, locality and chains, combined). [`compare`] puts the
//! runs of one model, trace and autoscaler side by side with the thesis' reported
//! changes: average and p99 cold start, average and p99 end-to-end latency,
//! replica-seconds, bytes from the origin, and a timeline of replicas, queue and bytes by
//! source tier.
//!
//! ```text
//!  trace ─► serve::Serving ◄─ replicas resident ── dc::Datacenter ◄── agents::SimAgents
//!              │ queue, rates                                              ▲
//!              ▼                                                           │
//!         scalers::Scaler ── ScaleOut / Prewarm / Evict ──► Controller (real)
//! ```
//!
//! ## Plots
//!
//! [`plots`] draws SVGs from the reports (`--plots DIR`): per-host ready-time CDFs, bytes
//! by source tier (origin, peer, local: [`dc::TierBytes`]) over time, replicas and queue
//! over time. `cold-start --emulate` draws its ready-time CDF with the same function, so an
//! emulated and a simulated burst compare picture to picture.
//!
//! ## Validation against the emulated cluster
//!
//! [`params`]: `cold-start --emulate` writes the burst it ran in the simulator's terms
//! (hosts, the manifest's shards and chunk size, link and origin rates, the daemons' origin
//! parallelism) into its report; `simulate --emulated REPORT` replays it and compares the
//! per-host ready times, and a test holds them within 10 % (docs/BENCHMARKS.md).
//!
//! ## Faults
//!
//! `simulate --faults SPEC` ([`faults`]) runs a burst twice, without and with faults — a
//! host's link down for a while (a hop stalls) or a host lost — at a chain position or a
//! seeded random host. `recovery` splits the victim's chain and decides the recoveries
//! with transferd's own state machine (`transferd::chain::RecoveryMonitor`,
//! `recovery_sources`: stall timeout, upstream grace, holders above before the origin);
//! the controller notices a down host by its missing heartbeats and failing agent calls
//! and re-plans as it does. The report holds each affected host's ready time against the
//! run without faults, the origin bytes (× the model) and the events; [`fault_plot`] draws
//! the fault timeline; [`fault_replay`] replays a `faults --emulate` report.
//!
//! ## Inputs
//!
//! [`models`]: the six models of the thesis' Table 3.1 with their cold-start phases and
//! (estimated) layer profiles; a replica serves `1 / exec_s` requests a second at batch 1.
//! [`trace`]: the Azure Functions 2019 per-minute counts and seeded generators with the
//! thesis' Twitter and Azure statistics.

pub mod agents;
pub mod autoscaler;
pub mod coldstart;
pub mod compare;
pub mod dc;
pub mod fault_plot;
pub mod fault_replay;
pub mod faults;
pub mod models;
pub mod net;
pub mod params;
mod parts;
pub mod pipelines;
pub mod plots;
mod recovery;
pub mod scalers;
pub mod serve;
pub mod store;
pub mod trace;
mod views;
pub mod workload;

/// A fresh current-thread tokio runtime whose clock starts paused (the module docs:
/// "Virtual time"): each simulated run ([`coldstart::run`], [`workload::run`]) blocks on
/// one. Build it on a thread that is not running a runtime.
pub fn paused_runtime() -> std::io::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .start_paused(true)
        .build()
}
