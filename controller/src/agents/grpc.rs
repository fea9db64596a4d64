//! The agents over gRPC: one lazily connected, mutually authenticated channel per host,
//! rebuilt when the host's heartbeat gives a new agent address. The agent protocol's
//! protobuf types are built and read here only.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};

use futures::StreamExt;
use futures::stream::BoxStream;
use shardcast_placement::Tier;
use shardcast_protocol::DataTier;
use shardcast_protocol::agent::agent_client::AgentClient;
use shardcast_protocol::agent::{self as apb};
use tonic::Code;
use tonic::transport::Channel;

use super::{
    AgentAt, Agents, Evict, Import, Imported, Load, ModelReport, StartChain, StoreFailure,
    TierReport,
};
use crate::error::{AgentError, AgentFailure};
use crate::lock;

/// Agents contacted for the first time at once: a plan's first round opens a mutually
/// authenticated connection to every receiver, and 1000 handshakes at once starved
/// heartbeats and API calls of CPU for over a second.
pub const FIRST_CONTACTS: usize = 16;

/// The hosts' agents over gRPC.
pub struct GrpcAgents {
    /// The controller's TLS identity (`None`: plaintext, insecure mode or agents on Unix
    /// sockets only).
    tls: Option<Arc<shardcast_identity::TlsContext>>,
    clients: Mutex<HashMap<String, (String, AgentClient<Channel>)>>,
    /// Agents that answered at least once, and the gate for first contacts.
    reached: Mutex<HashSet<String>>,
    first_contact: tokio::sync::Semaphore,
}

impl GrpcAgents {
    /// Agents reached with `tls` (over TCP; Unix sockets are local and plaintext).
    pub fn new(tls: Option<Arc<shardcast_identity::TlsContext>>) -> Self {
        Self {
            tls,
            clients: Mutex::default(),
            reached: Mutex::default(),
            first_contact: tokio::sync::Semaphore::new(FIRST_CONTACTS),
        }
    }

    fn client(&self, at: &AgentAt) -> Result<AgentClient<Channel>, AgentError> {
        let host = at.host.as_str();
        let mut clients = lock(&self.clients);
        if let Some((a, c)) = clients.get(host)
            && *a == at.addr
        {
            return Ok(c.clone());
        }
        // Over TCP the agent must prove it is exactly this host (a heartbeat cannot point
        // the controller at another host's agent); Unix sockets are local.
        let security = match &self.tls {
            Some(ctx) if !at.addr.starts_with("unix:") => {
                let id = shardcast_identity::Identity::new(shardcast_identity::Role::Host, host)
                    .map_err(|e| AgentError::unreachable(host, e))?;
                shardcast_identity::grpc::ClientSecurity::Tls(
                    ctx.clone(),
                    shardcast_identity::Expect::Exactly(id),
                )
            }
            _ => shardcast_identity::grpc::ClientSecurity::Plaintext,
        };
        let channel = shardcast_identity::grpc::lazy(&at.addr, security)
            .map_err(|e| AgentError::unreachable(host, e))?;
        let client = AgentClient::new(channel)
            .max_decoding_message_size(128 << 20)
            .max_encoding_message_size(128 << 20);
        clients.insert(host.to_string(), (at.addr.clone(), client.clone()));
        Ok(client)
    }

    /// A permit for calling `host`'s agent while it never answered (its first call opens
    /// the connection); `None` once it has.
    async fn first_contact_gate(&self, host: &str) -> Option<tokio::sync::SemaphorePermit<'_>> {
        if lock(&self.reached).contains(host) {
            return None;
        }
        self.first_contact.acquire().await.ok()
    }
}

/// A failed call, from the agent's gRPC status.
pub fn agent_error(host: &str, s: &tonic::Status) -> AgentError {
    let failure = match s.code() {
        Code::NotFound => AgentFailure::NotFound,
        Code::PermissionDenied | Code::Unauthenticated => AgentFailure::Refused,
        Code::InvalidArgument | Code::OutOfRange => AgentFailure::Invalid,
        Code::FailedPrecondition | Code::AlreadyExists | Code::Aborted => {
            AgentFailure::Precondition
        }
        Code::ResourceExhausted => AgentFailure::Exhausted,
        Code::Unavailable | Code::DeadlineExceeded | Code::Cancelled => AgentFailure::Unreachable,
        _ => AgentFailure::Failed,
    };
    AgentError {
        host: host.to_string(),
        failure,
        message: s.message().to_string(),
    }
}

/// The agent protocol's tier for a tier the controller plans (GPU copies are loaded from
/// the memory tier).
pub fn agent_tier(tier: Tier) -> i32 {
    apb::Tier::from(DataTier::serving(tier)) as i32
}

/// A data tier from the agent protocol's; `None` for GPU and values this controller does
/// not know.
fn data_tier(tier: i32) -> Option<DataTier> {
    DataTier::try_from(Tier::from(apb::Tier::try_from(tier).ok()?)).ok()
}

/// A model's status from the agent's answer.
pub fn model_report(resp: &apb::GetModelStatusResponse) -> ModelReport {
    ModelReport {
        tiers: resp
            .tiers
            .iter()
            .filter_map(|t| {
                Some(TierReport {
                    tier: data_tier(t.tier)?,
                    bytes_verified: t.bytes_verified,
                    complete: t.complete,
                    gpus: t.gpus.iter().map(|g| (g.state.clone(), g.bytes)).collect(),
                })
            })
            .collect(),
        store_failures: resp
            .store_failures
            .iter()
            .filter_map(|f| {
                Some(StoreFailure {
                    tier: data_tier(f.tier)?,
                    session: f.session.clone(),
                    error: f.error.clone(),
                })
            })
            .collect(),
    }
}

#[async_trait::async_trait]
impl Agents for GrpcAgents {
    async fn start_chain(&self, at: &AgentAt, chain: StartChain) -> Result<(), AgentError> {
        let mut agent = self.client(at)?;
        let req = apb::StartChainRequest {
            session_id: chain.session,
            model: chain.model,
            manifest: chain.manifest.to_vec(),
            origin: chain.origin,
            tier: agent_tier(chain.tier),
            chains: vec![apb::Chain {
                shards: chain.shards,
                hops: chain
                    .hops
                    .into_iter()
                    .map(|h| apb::Hop {
                        host_id: h.host,
                        addr: h.addr,
                    })
                    .collect(),
            }],
            plan_token: chain.plan_token,
            transport: apb::Transport::from(chain.transport) as i32,
        };
        match agent.start_chain(req).await {
            // The head already runs this session (a start retried after a lost answer).
            Err(s) if s.code() == Code::AlreadyExists => Ok(()),
            Err(s) => Err(agent_error(&at.host, &s)),
            Ok(_) => Ok(()),
        }
    }

    async fn import_model(&self, at: &AgentAt, import: Import) -> Result<Imported, AgentError> {
        let mut agent = self.client(at)?;
        let resp = agent
            .import_model(apb::ImportModelRequest {
                name: import.name,
                origin: import.origin,
                chunk_size: import.chunk_size,
                tier: agent_tier(import.tier),
                fetch: import.fetch,
                keep: import.keep,
                manifest: import.manifest,
                bind_name: import.bind_name,
            })
            .await
            .map_err(|s| agent_error(&at.host, &s))?
            .into_inner();
        Ok(Imported {
            digest: resp.digest,
            manifest: resp.manifest,
            kept: resp.kept,
            resolved_origin: resp.resolved_origin,
        })
    }

    async fn model_status(
        &self,
        at: &AgentAt,
        model: &str,
    ) -> Result<Option<ModelReport>, AgentError> {
        let mut agent = self.client(at)?;
        let gate = self.first_contact_gate(&at.host).await;
        let r = agent
            .get_model_status(apb::GetModelStatusRequest {
                model: model.to_string(),
            })
            .await;
        drop(gate);
        match r {
            Ok(resp) => {
                lock(&self.reached).insert(at.host.clone());
                Ok(Some(model_report(&resp.into_inner())))
            }
            Err(s) if s.code() == Code::NotFound => Ok(None),
            Err(s) => Err(agent_error(&at.host, &s)),
        }
    }

    async fn watch_model_status(
        &self,
        at: &AgentAt,
        model: &str,
    ) -> Result<BoxStream<'static, ModelReport>, AgentError> {
        let mut agent = self.client(at)?;
        let gate = self.first_contact_gate(&at.host).await;
        let resp = agent
            .watch_model_status(apb::GetModelStatusRequest {
                model: model.to_string(),
            })
            .await
            .map_err(|s| agent_error(&at.host, &s))?;
        drop(gate);
        lock(&self.reached).insert(at.host.clone());
        // The stream ends at the agent's first error, as a closed stream.
        Ok(resp
            .into_inner()
            .take_while(|r| std::future::ready(r.is_ok()))
            .filter_map(|r| std::future::ready(r.ok().map(|s| model_report(&s))))
            .boxed())
    }

    async fn load_model(&self, at: &AgentAt, load: Load) -> Result<(), AgentError> {
        let mut agent = self.client(at)?;
        agent
            .load_model(apb::LoadModelRequest {
                model: load.model,
                count: load.count,
                gpus: Vec::new(),
                partition: load.partition.map(|p| apb::PartitionSpec {
                    groups: p.groups,
                    complete: p.complete,
                    source: p.source,
                    label: p.label,
                }),
                heaviness: load.heaviness,
            })
            .await
            .map_err(|s| agent_error(&at.host, &s))?;
        Ok(())
    }

    async fn evict_model(&self, at: &AgentAt, evict: Evict) -> Result<u64, AgentError> {
        let mut agent = self.client(at)?;
        let resp = agent
            .evict_model(apb::EvictModelRequest {
                model: evict.model,
                tier: agent_tier(evict.tier),
                end_sessions: evict.end_sessions,
            })
            .await
            .map_err(|s| agent_error(&at.host, &s))?;
        Ok(resp.into_inner().bytes_freed)
    }

    async fn handoff(&self, at: &AgentAt, model: &str) -> Result<String, AgentError> {
        let mut agent = self.client(at)?;
        let resp = agent
            .get_handoff(apb::GetHandoffRequest {
                model: model.to_string(),
            })
            .await
            .map_err(|s| agent_error(&at.host, &s))?;
        Ok(resp.into_inner().json)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn agent_codes_map_to_failures() {
        let of = |s: tonic::Status| agent_error("h", &s).failure;
        assert_eq!(
            of(tonic::Status::unavailable("x")),
            AgentFailure::Unreachable
        );
        assert_eq!(of(tonic::Status::not_found("x")), AgentFailure::NotFound);
        assert_eq!(
            of(tonic::Status::permission_denied("x")),
            AgentFailure::Refused
        );
        assert_eq!(
            of(tonic::Status::resource_exhausted("x")),
            AgentFailure::Exhausted
        );
        assert_eq!(
            of(tonic::Status::already_exists("x")),
            AgentFailure::Precondition
        );
        assert_eq!(of(tonic::Status::internal("x")), AgentFailure::Failed);
    }

    #[test]
    fn a_status_report_keeps_data_tiers_and_their_failures_only() {
        let resp = apb::GetModelStatusResponse {
            tiers: vec![
                apb::ModelStatus {
                    tier: apb::Tier::Memory as i32,
                    bytes_verified: 7,
                    complete: false,
                    gpus: vec![apb::GpuResidency {
                        state: "loading".into(),
                        bytes: 3,
                        ..Default::default()
                    }],
                    ..Default::default()
                },
                apb::ModelStatus {
                    tier: 99,
                    bytes_verified: 1,
                    ..Default::default()
                },
            ],
            store_failures: vec![apb::StoreFailure {
                tier: apb::Tier::Disk as i32,
                error: "full".into(),
                session: "s1".into(),
            }],
        };
        let r = model_report(&resp);
        assert_eq!(
            r.tiers,
            vec![TierReport {
                tier: DataTier::Memory,
                bytes_verified: 7,
                complete: false,
                gpus: vec![("loading".into(), 3)],
            }]
        );
        assert_eq!(
            r.store_failures,
            vec![StoreFailure {
                tier: DataTier::Disk,
                session: "s1".into(),
                error: "full".into(),
            }]
        );
    }
}
