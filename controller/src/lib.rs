//! # shardcast-controller
//!
//! The control plane: the FaaS above asks it for models on hosts; it decides where replicas
//! go and which hosts send to which, starts chains on the transferd agents, and watches them
//! to the end. `docs/ARCHITECTURE.md` maps the whole system.
//!
//! The core ([`core`], with [`plan`], [`inventory`], [`registry`], [`burst`]) knows none of
//! the services around it; each service holds only the handles it needs, as a trait the
//! wiring ([`services`]) implements over the core's state (ports and adapters), so the
//! dependency runs one way: services → core. The core reaches hosts through a port of its
//! own ([`agents`]).
//!
//! * [`core`]: registrations, plan creation (placement and chain plans from
//!   `shardcast-placement`), the plan runner (start chains, follow receivers, re-plan
//!   stalls), eviction; [`ops`]: its typed commands and answers.
//! * [`registry`]: the models by name, their manifests and registrations in progress, behind
//!   its own locks; [`model`]: a registered model's versioned record.
//! * [`plan`]: plans, receivers and their states as types, with pure transitions.
//! * [`agents`]: the port to the hosts' transferd agents ([`agents::Agents`]) and its gRPC
//!   adapter.
//! * [`autoscaler`]: `ReportLoad` → the autoscaling policy → scale-out / evict, with an
//!   event per decision; partition plans from profiles.
//! * [`ptables`]: partition-plan tables (and derived profiles) stored with each model.
//! * [`burst`]: partitioned bursts (`ScaleOut` with `partitions`); [`tiers`]: the memory
//!   and disk tier sweeper and GPU-slot reconciliation; [`scrape`]: load from Prometheus.
//! * [`inventory`]: hosts' heartbeats, liveness, GPU reservations; the placement view.
//! * [`state`]: the durable store behind a trait (redb by default); [`write_behind`]: the
//!   frequent, superseding writes (host reports, plan progress) committed in batches off
//!   the state lock; [`etcd`]: the store on etcd, with fenced writes; [`ha`]: leader
//!   election among replicas on etcd, the follower's read-only view (`ha::view`) and the
//!   switch in front of the services that refuses a follower's writes with the leader's
//!   address (`ha::switch`).
//! * [`events`]: the decision log; [`usage`]: last use per model (for LRU eviction).
//! * [`grpc`] and [`http`]: the two front ends over the same operations, converting at
//!   [`wire`]; [`auth`]: their method and route → permission tables; [`error`]: an error
//!   type per operation, each mapped to one gRPC code and HTTP status there and nowhere
//!   else; [`metrics`]: `/metrics` through a registry (API latency, plan and receiver time
//!   to ready, evictions, registrations, leadership), and [`exposition`] its state half,
//!   read at scrape time; [`openapi`]: the HTTP API's OpenAPI document, generated from the
//!   handlers' `#[utoipa::path]` attributes, which also register the routes (utoipa-axum).
//! * [`server`]: the `shardcast-controller` process. The `shardcast` operator CLI is its own
//!   crate (`shardcast-cli`), so it does not link the server.

#![cfg_attr(not(test), deny(clippy::unwrap_used))]

/// Locks `m`, going on through a poisoned lock (a panicked holder left the data whole:
/// every critical section here writes whole values).
pub(crate) fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

pub mod agents;
pub mod auth;
pub mod autoscaler;
pub mod burst;
pub(crate) mod clock;
pub mod core;
pub mod error;
pub mod etcd;
pub mod events;
pub mod exposition;
pub mod grpc;
pub mod ha;
pub mod http;
pub mod inventory;
pub mod metrics;
pub mod model;
pub mod openapi;
pub mod ops;
pub mod plan;
pub mod ptables;
pub mod registry;
pub mod scrape;
pub mod server;
pub mod services;
pub mod state;
pub mod tiers;
pub mod usage;
pub mod wire;
pub mod write_behind;
