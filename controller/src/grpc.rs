//! The gRPC front end: `Controller` and `Inventory` services over [`crate::core`] (through
//! the [`crate::services::Services`] a replica serves, converting at [`crate::wire`]);
//! `WatchPlan` streams the plan's status on every change.

use std::pin::Pin;
use std::sync::Arc;

use futures::Stream;
use shardcast_protocol::controller::controller_server::Controller as ControllerApi;
use shardcast_protocol::controller::inventory_server::Inventory;
use shardcast_protocol::controller::{
    EvictRequest, EvictResponse, GetModelRequest, GetPartitionPlanRequest, GetStatusRequest,
    HeartbeatResponse, HostReport, ListEventsRequest, ListEventsResponse, ListHostsRequest,
    ListHostsResponse, ListModelsRequest, ListModelsResponse, ListPlansRequest, ListPlansResponse,
    ModelInfo, ModelStatus, PartitionPlanResponse, PlanAccepted, PlanStatus, PrewarmRequest,
    RegisterModelRequest, ReportLoadRequest, ReportLoadResponse, ScaleOutRequest, WatchPlanRequest,
};
use tonic::{Request, Response, Status};

use crate::core::{Controller, now_unix};
use crate::services::Services;
use crate::wire::plan_status;
use shardcast_protocol::controller::PlanState;

/// Both gRPC services share one controller.
#[derive(Clone)]
pub struct GrpcApi(pub Arc<Services>);

/// The `Controller` gRPC service over `c` (messages up to 128 MiB: manifests).
pub fn controller_service(
    c: Arc<Services>,
) -> shardcast_protocol::controller::controller_server::ControllerServer<GrpcApi> {
    shardcast_protocol::controller::controller_server::ControllerServer::new(GrpcApi(c))
        .max_decoding_message_size(128 << 20)
        .max_encoding_message_size(128 << 20)
}

/// The `Inventory` gRPC service (heartbeats) over `c`.
pub fn inventory_service(
    c: Arc<Services>,
) -> shardcast_protocol::controller::inventory_server::InventoryServer<GrpcApi> {
    shardcast_protocol::controller::inventory_server::InventoryServer::new(GrpcApi(c))
}

type PlanStream = Pin<Box<dyn Stream<Item = Result<PlanStatus, Status>> + Send>>;

/// Every plan as callers see it, newest first.
pub fn list_plans(c: &Controller) -> ListPlansResponse {
    let now = now_unix();
    ListPlansResponse {
        plans: c.list_plans(|p| plan_status(p, now)),
    }
}

/// A stream of a plan's status: now, then on every change, ending after the final state.
pub fn plan_updates(c: &Controller, id: &str) -> Result<PlanStream, crate::error::ApiError> {
    let (first, rx) = c.watch_plan(id)?;
    let first = plan_status(&first, now_unix());
    let Some(rx) = rx else {
        return Ok(Box::pin(futures::stream::iter([Ok(first)])));
    };
    Ok(Box::pin(futures::stream::unfold(
        (Some(first), rx, false),
        |(first, mut rx, done)| async move {
            if done {
                return None;
            }
            let status = match first {
                Some(f) => f,
                None => {
                    // A value sent just before the plan ended is still seen here.
                    rx.changed().await.ok()?;
                    plan_status(&rx.borrow_and_update(), now_unix())
                }
            };
            let ended = status.state() != PlanState::Running;
            Some((Ok(status), (None, rx, ended)))
        },
    )))
}

impl GrpcApi {
    /// Times a call to `method` (`shardcast_api_request_seconds`, `crate::metrics`).
    fn timer(&self, method: &'static str) -> crate::metrics::ApiTimer {
        self.0
            .core
            .config()
            .metrics
            .time("grpc", method.to_string())
    }
}

#[tonic::async_trait]
impl ControllerApi for GrpcApi {
    async fn register_model(
        &self,
        request: Request<RegisterModelRequest>,
    ) -> Result<Response<ModelInfo>, Status> {
        let _timer = self.timer("RegisterModel");
        Ok(Response::new(
            self.0
                .core
                .register_model(crate::wire::register(request.into_inner()))
                .await?
                .into(),
        ))
    }

    async fn list_models(
        &self,
        _request: Request<ListModelsRequest>,
    ) -> Result<Response<ListModelsResponse>, Status> {
        let _timer = self.timer("ListModels");
        Ok(Response::new(self.0.core.list_models().into()))
    }

    async fn get_model(
        &self,
        request: Request<GetModelRequest>,
    ) -> Result<Response<ModelInfo>, Status> {
        let _timer = self.timer("GetModel");
        Ok(Response::new(
            self.0.core.get_model(&request.into_inner().model)?.into(),
        ))
    }

    async fn prewarm(
        &self,
        request: Request<PrewarmRequest>,
    ) -> Result<Response<PlanAccepted>, Status> {
        let _timer = self.timer("Prewarm");
        Ok(Response::new(
            self.0
                .core
                .prewarm(crate::wire::prewarm(request.into_inner())?)?
                .into(),
        ))
    }

    async fn scale_out(
        &self,
        request: Request<ScaleOutRequest>,
    ) -> Result<Response<PlanAccepted>, Status> {
        let _timer = self.timer("ScaleOut");
        Ok(Response::new(
            self.0
                .scale_out(crate::wire::scale_out(request.into_inner())?)
                .await?
                .into(),
        ))
    }

    async fn evict(
        &self,
        request: Request<EvictRequest>,
    ) -> Result<Response<EvictResponse>, Status> {
        let _timer = self.timer("Evict");
        Ok(Response::new(
            self.0
                .core
                .evict(crate::wire::evict(request.into_inner())?)
                .await?
                .into(),
        ))
    }

    type WatchPlanStream = PlanStream;

    async fn watch_plan(
        &self,
        request: Request<WatchPlanRequest>,
    ) -> Result<Response<Self::WatchPlanStream>, Status> {
        let _timer = self.timer("WatchPlan");
        Ok(Response::new(plan_updates(
            &self.0.core,
            &request.into_inner().plan_id,
        )?))
    }

    async fn get_plan(
        &self,
        request: Request<WatchPlanRequest>,
    ) -> Result<Response<PlanStatus>, Status> {
        let _timer = self.timer("GetPlan");
        Ok(Response::new(plan_status(
            &self.0.core.get_plan(&request.into_inner().plan_id)?,
            now_unix(),
        )))
    }

    async fn list_plans(
        &self,
        _request: Request<ListPlansRequest>,
    ) -> Result<Response<ListPlansResponse>, Status> {
        let _timer = self.timer("ListPlans");
        Ok(Response::new(list_plans(&self.0.core)))
    }

    async fn get_status(
        &self,
        request: Request<GetStatusRequest>,
    ) -> Result<Response<ModelStatus>, Status> {
        let _timer = self.timer("GetStatus");
        Ok(Response::new(
            self.0.core.get_status(&request.into_inner().model)?.into(),
        ))
    }

    async fn list_hosts(
        &self,
        _request: Request<ListHostsRequest>,
    ) -> Result<Response<ListHostsResponse>, Status> {
        let _timer = self.timer("ListHosts");
        Ok(Response::new(crate::wire::host_list(
            self.0.core.list_hosts(),
        )))
    }

    async fn report_load(
        &self,
        request: Request<ReportLoadRequest>,
    ) -> Result<Response<ReportLoadResponse>, Status> {
        let _timer = self.timer("ReportLoad");
        let decision = self
            .0
            .autoscaler
            .report_load(crate::wire::report_load(request.into_inner())?)
            .await?;
        Ok(Response::new(ReportLoadResponse {
            decision: Some(decision.into()),
        }))
    }

    async fn list_events(
        &self,
        request: Request<ListEventsRequest>,
    ) -> Result<Response<ListEventsResponse>, Status> {
        let _timer = self.timer("ListEvents");
        let r = request.into_inner();
        Ok(Response::new(crate::wire::event_list(
            self.0.events().list(&r.model, r.limit as usize),
        )))
    }

    async fn get_partition_plan(
        &self,
        request: Request<GetPartitionPlanRequest>,
    ) -> Result<Response<PartitionPlanResponse>, Status> {
        let _timer = self.timer("GetPartitionPlan");
        Ok(Response::new(
            self.0
                .tables
                .partition_plan(crate::wire::partition_plan_query(request.into_inner()))
                .await?
                .into(),
        ))
    }
}

#[tonic::async_trait]
impl Inventory for GrpcApi {
    async fn heartbeat(
        &self,
        request: Request<HostReport>,
    ) -> Result<Response<HeartbeatResponse>, Status> {
        let _timer = self.timer("Heartbeat");
        let peer = shardcast_identity::grpc::peer_of(&request);
        let report = request.into_inner();
        crate::auth::check_heartbeat(&peer, &report.host_id)?;
        Ok(Response::new(
            self.0
                .core
                .heartbeat(crate::wire::host_view(report)?)?
                .into(),
        ))
    }
}
