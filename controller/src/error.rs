//! API errors: one type for both front ends. Each maps to a precise gRPC code and an HTTP
//! status, with a message a person can act on. A request that fails validation changes
//! nothing: every check runs before any state is written or any transfer starts.

use axum::http::StatusCode;
use tonic::Code;

/// An error answered to an API caller.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{message}")]
pub struct ApiError {
    /// gRPC code.
    pub code: Code,
    /// What went wrong and what to do about it.
    pub message: String,
}

impl ApiError {
    fn new(code: Code, message: impl Into<String>) -> Self {
        Self {
            code,
            message: message.into(),
        }
    }
    /// Malformed input.
    pub fn invalid(message: impl Into<String>) -> Self {
        Self::new(Code::InvalidArgument, message)
    }
    /// Unknown model, host or plan.
    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new(Code::NotFound, message)
    }
    /// More than the cluster can take.
    pub fn exhausted(message: impl Into<String>) -> Self {
        Self::new(Code::ResourceExhausted, message)
    }
    /// No live host, or a dependency (origin, agent) cannot be reached.
    pub fn unavailable(message: impl Into<String>) -> Self {
        Self::new(Code::Unavailable, message)
    }
    /// The request is valid but the system is not in a state to do it.
    pub fn precondition(message: impl Into<String>) -> Self {
        Self::new(Code::FailedPrecondition, message)
    }
    /// No identity was presented (no client certificate, no valid bearer token).
    pub fn unauthenticated(message: impl Into<String>) -> Self {
        Self::new(Code::Unauthenticated, message)
    }
    /// The caller's role lacks the permission, or policy forbids the request (an origin
    /// outside the allow-list).
    pub fn permission_denied(message: impl Into<String>) -> Self {
        Self::new(Code::PermissionDenied, message)
    }
    /// A bug or a failing disk.
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(Code::Internal, message)
    }

    /// The name of the code as in gRPC (`NOT_FOUND`), used in JSON error bodies.
    pub fn code_name(&self) -> &'static str {
        code_name(self.code)
    }

    /// The HTTP status for the HTTP/JSON API.
    pub fn http_status(&self) -> StatusCode {
        match self.code {
            Code::InvalidArgument | Code::OutOfRange => StatusCode::BAD_REQUEST,
            Code::NotFound => StatusCode::NOT_FOUND,
            Code::Unauthenticated => StatusCode::UNAUTHORIZED,
            Code::PermissionDenied => StatusCode::FORBIDDEN,
            Code::AlreadyExists | Code::Aborted => StatusCode::CONFLICT,
            Code::ResourceExhausted => StatusCode::INSUFFICIENT_STORAGE,
            Code::FailedPrecondition => StatusCode::PRECONDITION_FAILED,
            Code::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
            Code::DeadlineExceeded => StatusCode::GATEWAY_TIMEOUT,
            _ => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }
}

pub use shardcast_protocol::code_name;

impl From<ApiError> for tonic::Status {
    fn from(e: ApiError) -> Self {
        Self::new(e.code, e.message)
    }
}

impl From<crate::state::StateError> for ApiError {
    fn from(e: crate::state::StateError) -> Self {
        Self::internal(e.to_string())
    }
}

impl axum::response::IntoResponse for ApiError {
    fn into_response(self) -> axum::response::Response {
        let body = serde_json::json!({
            "error": { "code": self.code_name(), "message": self.message }
        });
        (self.http_status(), axum::Json(body)).into_response()
    }
}
