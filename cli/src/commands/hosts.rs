//! `shardcast hosts`: every host the controller knows and what it last reported.

use shardcast_protocol::controller::{GpuLoad, ListHostsRequest, ListHostsResponse};
use shardcast_protocol::units::format_bytes;

use crate::client::Client;
use crate::error::CliError;
use crate::output::{Output, up_down};
use crate::table::table_or;

/// The host table's columns.
const HEADERS: [&str; 10] = [
    "HOST",
    "STATE",
    "SEEN",
    "RACK",
    "DATA",
    "MEM FREE",
    "DISK FREE",
    "GPUS RSV",
    "COPIES",
    "GPU LOADS",
];
/// Lists the hosts.
pub(crate) async fn run(c: &mut Client, out: Output) -> Result<ListHostsResponse, CliError> {
    let r = c.list_hosts(ListHostsRequest {}).await?.into_inner();
    out.show(&r, render);
    Ok(r)
}

/// What `hosts` prints: a row per host, or `no hosts`.
pub(crate) fn render(r: &ListHostsResponse) -> String {
    let rows = r.hosts.iter().map(|h| {
        let rep = h.report.clone().unwrap_or_default();
        let complete = rep.holdings.iter().filter(|m| m.complete).count();
        vec![
            rep.host_id.clone(),
            // A draining host is up, but nothing new goes there.
            if h.up && rep.draining {
                "draining".to_string()
            } else {
                up_down(h.up)
            },
            format!("{:.1}s", h.last_seen_s),
            rep.rack,
            rep.data_addr,
            format!(
                "{}/{}",
                format_bytes(rep.mem_free),
                format_bytes(rep.mem_capacity)
            ),
            format!(
                "{}/{}",
                format_bytes(rep.disk_free),
                format_bytes(rep.disk_capacity)
            ),
            format!("{}/{}", h.gpus_reserved, rep.gpus.len()),
            complete.to_string(),
            gpu_loads_summary(&rep.gpu_loads),
        ]
    });
    table_or(&HEADERS, rows, "no hosts")
}

/// "2 resident, 1 failed": the models on a host's GPUs by state ("-" when none).
fn gpu_loads_summary(loads: &[GpuLoad]) -> String {
    let parts: Vec<String> = ["loading", "partition-live", "resident", "failed"]
        .iter()
        .filter_map(|state| {
            let n = loads.iter().filter(|l| l.state == *state).count();
            (n > 0).then(|| format!("{n} {state}"))
        })
        .collect();
    if parts.is_empty() {
        "-".into()
    } else {
        parts.join(", ")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use shardcast_protocol::controller::{Gpu, HostReport, HostState};

    fn host(id: &str, rack: &str, up: bool, gpus: usize, loads: &[&str]) -> HostState {
        HostState {
            up,
            last_seen_s: 0.42,
            gpus_reserved: 1,
            report: Some(HostReport {
                host_id: id.into(),
                rack: rack.into(),
                data_addr: format!("10.0.0.{}:7400", id.len()),
                mem_free: 3 << 30,
                mem_capacity: 4 << 30,
                disk_free: 100 << 30,
                disk_capacity: 200 << 30,
                gpus: vec![Gpu::default(); gpus],
                gpu_loads: loads
                    .iter()
                    .map(|s| GpuLoad {
                        state: (*s).into(),
                        ..Default::default()
                    })
                    .collect(),
                ..Default::default()
            }),
        }
    }

    #[test]
    fn two_hosts_under_the_headers_in_aligned_columns() {
        let r = ListHostsResponse {
            hosts: vec![
                host("gpu-1", "r1", true, 8, &["resident", "resident", "failed"]),
                host("cpu-host-22", "rack-12", false, 0, &[]),
            ],
        };
        let text = render(&r);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 3, "{text}");
        let headers = HEADERS;
        // Every header in order, and each row's cells start where their header does.
        let starts: Vec<usize> = headers
            .iter()
            .map(|h| lines[0].find(h).unwrap_or_else(|| panic!("{h}: {text}")))
            .collect();
        assert!(starts.windows(2).all(|w| w[0] < w[1]), "{text}");
        let cells = |line: &str| -> Vec<String> {
            starts
                .iter()
                .enumerate()
                .map(|(i, &s)| {
                    let end = starts
                        .get(i + 1)
                        .copied()
                        .unwrap_or(line.len())
                        .min(line.len());
                    line.get(s..end).unwrap_or("").trim().to_string()
                })
                .collect()
        };
        assert_eq!(
            cells(lines[1]),
            [
                "gpu-1",
                "up",
                "0.4s",
                "r1",
                "10.0.0.5:7400",
                &format!("{}/{}", format_bytes(3 << 30), format_bytes(4 << 30)),
                &format!("{}/{}", format_bytes(100 << 30), format_bytes(200 << 30)),
                "1/8",
                "0",
                "2 resident, 1 failed",
            ]
        );
        assert_eq!(
            cells(lines[2]),
            [
                "cpu-host-22",
                "DOWN",
                "0.4s",
                "rack-12",
                "10.0.0.11:7400",
                &format!("{}/{}", format_bytes(3 << 30), format_bytes(4 << 30)),
                &format!("{}/{}", format_bytes(100 << 30), format_bytes(200 << 30)),
                "1/0",
                "0",
                "-",
            ]
        );
        // Two spaces between the widest cell of a column and the next column.
        assert_eq!(starts[1], "cpu-host-22".len() + 2, "{text}");
        assert!(!text.lines().any(|l| l.ends_with(' ')), "{text}");
    }

    #[test]
    fn no_hosts_says_so() {
        assert_eq!(render(&ListHostsResponse::default()), "no hosts\n");
    }

    #[test]
    fn gpu_loads_are_summarised_by_state() {
        let l = |state: &str| GpuLoad {
            state: state.into(),
            ..Default::default()
        };
        assert_eq!(gpu_loads_summary(&[]), "-");
        assert_eq!(
            gpu_loads_summary(&[l("failed"), l("resident"), l("resident")]),
            "2 resident, 1 failed"
        );
    }
}
