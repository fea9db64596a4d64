//! `shardcast certs …`: the cluster CA, certificates and bearer tokens, on local files (no
//! controller involved). No `--json`: each prints what it wrote.

use std::time::Duration;

use crate::args::CertsCommand;
use crate::error::{CliError, usage};

/// Runs one `certs` action.
pub(crate) fn run(action: CertsCommand) -> Result<(), CliError> {
    use shardcast_identity::Identity;
    use shardcast_identity::pki::{IssueRequest, PkiDir};
    let days = |d: u64| Duration::from_secs(d.saturating_mul(24 * 3600));
    let identity = |role: &str, name: &str| -> Result<Identity, CliError> {
        let role = role.parse().map_err(|e| usage(format!("--role: {e}")))?;
        Identity::new(role, name).map_err(|e| usage(format!("--name: {e}")))
    };
    let fail = |e: shardcast_identity::IdentityError| CliError {
        exit: 1,
        message: e.to_string(),
    };
    match action {
        CertsCommand::Init { dir, name, days: d } => {
            let files = PkiDir::new(&dir).init(&name, days(d)).map_err(fail)?;
            println!(
                "created CA {} (key {})",
                files.cert.display(),
                files.key.display()
            );
        }
        CertsCommand::Issue {
            dir,
            role,
            name,
            dns,
            ip,
            days: d,
        } => {
            let mut req = IssueRequest::new(identity(&role, &name)?);
            req.dns.extend(dns);
            req.ips.extend(ip);
            req.validity = days(d);
            let files = PkiDir::new(&dir).issue(&req).map_err(fail)?;
            println!(
                "issued {} for {} (key {})",
                files.cert.display(),
                req.identity.uri(),
                files.key.display()
            );
        }
        CertsCommand::Rotate { dir, cert, days: d } => {
            let files = shardcast_identity::pki::CertFiles {
                key: cert.with_extension("key"),
                cert,
            };
            PkiDir::new(&dir).rotate(&files, days(d)).map_err(fail)?;
            println!("rotated {}", files.cert.display());
        }
        CertsCommand::Token { role, name } => {
            let id = identity(&role, &name)?;
            if matches!(
                id.role,
                shardcast_identity::Role::Host | shardcast_identity::Role::Controller
            ) {
                return Err(usage(
                    "tokens are for HTTP clients (admin, platform, read); hosts and the controller use certificates",
                ));
            }
            let (token, line) = shardcast_identity::token::generate(&id);
            println!("token: {token}");
            println!("tokens-file line: {line}");
        }
    }
    Ok(())
}
