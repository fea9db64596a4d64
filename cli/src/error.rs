//! A CLI failure and its exit status.

use shardcast_protocol::code_name;

/// Exit status of a plan that ended `partial`: some requested hosts hold no verified copy.
pub const EXIT_PARTIAL: i32 = 7;

/// A CLI failure with its exit status.
#[derive(Debug)]
pub struct CliError {
    /// Exit status.
    pub exit: i32,
    /// Message for stderr.
    pub message: String,
}

impl From<tonic::Status> for CliError {
    fn from(s: tonic::Status) -> Self {
        let exit = match s.code() {
            tonic::Code::InvalidArgument => 2,
            tonic::Code::NotFound => 3,
            tonic::Code::ResourceExhausted => 4,
            tonic::Code::Unavailable => 5,
            _ => 1,
        };
        Self {
            exit,
            message: format!("{}: {}", code_name(s.code()), s.message()),
        }
    }
}

/// An invalid argument (exit status 2).
pub(crate) fn usage(message: impl Into<String>) -> CliError {
    CliError {
        exit: 2,
        message: message.into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exit_codes_follow_grpc_codes() {
        let e: CliError = tonic::Status::not_found("x").into();
        assert_eq!(e.exit, 3);
        assert!(e.message.starts_with("NOT_FOUND: x"));
        let e: CliError = tonic::Status::resource_exhausted("x").into();
        assert_eq!(e.exit, 4);
    }
}
