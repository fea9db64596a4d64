//! `shardcast evict MODEL`: remove a model's copy in a tier from its holders (or the named
//! hosts).

use shardcast_protocol::controller::{EvictRequest, EvictResponse};
use shardcast_protocol::units::format_bytes;

use super::tier_arg;
use crate::args::EvictArgs;
use crate::client::Client;
use crate::error::CliError;
use crate::output::Output;

/// Evicts; which hosts freed how much, and which are down and wait for their return.
pub(crate) async fn run(
    args: EvictArgs,
    c: &mut Client,
    out: Output,
) -> Result<EvictResponse, CliError> {
    let EvictArgs { model, hosts, tier } = args;
    let r = c
        .evict(EvictRequest {
            model,
            hosts,
            tier: tier_arg(&tier)?,
        })
        .await?
        .into_inner();
    out.show(&r, render);
    Ok(r)
}

/// What `evict` prints.
pub(crate) fn render(r: &EvictResponse) -> String {
    let mut s = String::new();
    if r.evicted.is_empty() && r.pending.is_empty() {
        s.push_str("nothing to evict\n");
    }
    if !r.evicted.is_empty() {
        s.push_str(&format!(
            "evicted from {}: {} freed\n",
            r.evicted.join(", "),
            format_bytes(r.bytes_freed)
        ));
    }
    if !r.pending.is_empty() {
        s.push_str(&format!(
            "pending on {} (down): evicted when they heartbeat again\n",
            r.pending.join(", ")
        ));
    }
    s
}
