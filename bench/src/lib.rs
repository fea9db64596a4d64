//! # shardcast-bench
//!
//! The demo and the benchmarks of shardcast (results in `docs/BENCHMARKS.md`):
//!
//! * [`cluster`]: real `transferd` processes on loopback or in namespaces.
//! * [`control`]: a `shardcast-controller` process with daemons reporting to it.
//! * [`ha`]: controller replicas on a real etcd, with a partitioning relay (`failover`).
//! * [`faults`]: one fault (kill, stop, link down, corruption) × chain position on the
//!   emulated cluster, against the no-fault ready time (`faults`).
//! * [`loader_bench`]: the GPU loader's stages alone and overlapped (`loader`).
//! * [`managed`]: the `demo` and `cold-start` scenarios, through the controller's API.
//! * [`netns`]: emulated clusters (network namespaces, a bridge, `tc` rate caps).
//! * [`synth`]: synthetic safetensors models.
//! * [`origin_server`]: a rate-capped HTTP origin standing in for cloud storage.
//! * [`origin_bench`]: one model read from the HTTP origin and from S3-compatible servers
//!   (moto, s3rver), on loopback or across one emulated link, next to iperf3 (`origin`).
//! * [`scenario`]: the `demo` and `chain` scenarios and their reports.
//! * [`swarm`]: many simulated hosts in one process (real heartbeats, real agent API, no
//!   bytes moved): a load generator for the controller.
//! * [`scale`]: the `scale` benchmark: a real controller under a swarm of 1000 hosts.
//! * [`sim`]: the datacenter simulator (`simulate`): the real controller on a paused clock
//!   driving simulated hosts over a flow-level network.

pub mod cluster;
pub mod control;
pub mod faults;
pub mod ha;
pub mod loader_bench;
pub mod managed;
pub mod netns;
pub mod origin_bench;
pub mod origin_server;
pub mod pki;
pub mod scale;
pub mod scenario;
pub mod sim;
pub mod swarm;
pub mod synth;
