//! `faults`: what one fault costs the healthy hosts of a prewarm, on the emulated cluster.
//!
//! Each trial builds a fresh cluster (hosts in network namespaces with capped links, an
//! origin server in one more namespace, a controller), registers a synthetic model, and
//! prewarms every host through the API (one chain from the origin). `at` after the prewarm
//! call one host of the chain — its head, a middle hop or its tail — suffers a fault:
//!
//! * `kill` (or `restart`): SIGKILL (by PID), restarted 3 s later;
//! * `stop`: SIGSTOP (alive but silent) for 8 s, then SIGCONT;
//! * `link-down`: its switch port down for 8 s, then up;
//! * `corrupt`: one byte flipped at rest in its memory-tier copy (in the first chunk);
//! * `fill`: another process fills the file system of its memory tier (every host's
//!   memory tier is then a tmpfs of its own, with room for the model and 64 MiB more) for
//!   8 s, then frees it;
//! * `two`: two victims in the same chain at once: the host at the position is killed
//!   (restarted 3 s later) and its downstream neighbour (upstream, at the tail) stopped for
//!   8 s.
//!
//! A trial records when every healthy host held a verified copy (the ready time, taken on
//! the caller's side by polling `GetPlan` every 50 ms), divided by the same size's no-fault
//! ready time; whether every healthy host's copy is byte-exact; and whether the plan's
//! final report is true: after the plan ends (and a settle period in which a victim that
//! recovers may report itself), every host the plan calls `done` holds an exact copy and
//! every host with an exact copy is called `done`; and whether the victim itself ended with
//! an exact copy (`victims_complete`: a killed and restarted host within the controller's
//! lost grace is re-planned and resumes).

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use indicatif::ProgressBar;
use serde::Serialize;
use shardcast_protocol::Manifest;
use shardcast_protocol::controller::{EvictRequest, PlanStatus, PrewarmRequest, WatchPlanRequest};

use crate::cluster::{Daemon, flip_byte};
use crate::managed::{EmulatedCluster, origin_model, ready_times};
use crate::scenario::MODEL_NAME;

/// A fault to inject.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Fault {
    /// No fault (the baseline).
    None,
    /// SIGKILL, restarted 3 s later.
    Kill,
    /// SIGSTOP for 8 s, then SIGCONT.
    Stop,
    /// The host's switch port down for 8 s.
    LinkDown,
    /// One byte flipped at rest in the host's memory-tier copy.
    Corrupt,
    /// A kill (as `Kill`) and a stop (as `Stop`) of two neighbours in the same chain.
    Two,
    /// The host's memory-tier file system filled by another process for 8 s.
    Fill,
    /// The host's certificate re-issued (a new key) and the daemon told with `SIGHUP`.
    Rotate,
    /// SIGTERM as an operator stops a host (transferd drains: it finishes its sessions and
    /// starts none), started again 3 s after it exits.
    Term,
    /// Every host in turn, in chain order from the head, stopped as `term` and started
    /// again as soon as it exited: a rolling upgrade during the prewarm (the position is
    /// ignored; every host is a victim, and all of them count for the ready time).
    Rolling,
}

impl std::str::FromStr for Fault {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Ok(match s {
            "none" => Self::None,
            "kill" | "restart" => Self::Kill,
            "stop" => Self::Stop,
            "link-down" => Self::LinkDown,
            "corrupt" => Self::Corrupt,
            "two" => Self::Two,
            "fill" => Self::Fill,
            "rotate" => Self::Rotate,
            "term" => Self::Term,
            "rolling" => Self::Rolling,
            other => {
                return Err(format!(
                    "unknown fault {other:?}; expected kill (or restart), stop, link-down, corrupt, two, fill, rotate, term or rolling"
                ));
            }
        })
    }
}

/// Where in the chain the faulty host is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Position {
    /// The first hop (fed by the origin).
    Head,
    /// The hop in the middle.
    Middle,
    /// The last hop.
    Tail,
}

impl std::str::FromStr for Position {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Ok(match s {
            "head" => Self::Head,
            "middle" => Self::Middle,
            "tail" => Self::Tail,
            other => {
                return Err(format!(
                    "unknown position {other:?}; expected head, middle or tail"
                ));
            }
        })
    }
}

/// Options of `faults`.
#[derive(Debug, Clone)]
pub struct FaultsOpts {
    /// Hosts prewarmed (all of them).
    pub hosts: usize,
    /// Model size.
    pub size: u64,
    /// Safetensors shards.
    pub shards: usize,
    /// Host link rate, bytes/s.
    pub rate: u64,
    /// Origin server rate, bytes/s.
    pub origin_rate: u64,
    /// Faults to inject.
    pub faults: Vec<Fault>,
    /// Positions to inject them at.
    pub positions: Vec<Position>,
    /// Trials per fault × position (and of the no-fault baseline).
    pub trials: usize,
    /// When the fault strikes, after the prewarm call.
    pub at: Duration,
    /// Per-trial limit.
    pub timeout: Duration,
    /// Extra transferd arguments for every host (to try other timeouts).
    pub daemon_args: Vec<String>,
}

/// One trial.
#[derive(Debug, Clone, Serialize)]
pub struct FaultTrial {
    /// The fault.
    pub fault: Fault,
    /// Where (`None` for the baseline).
    pub position: Option<Position>,
    /// The host that suffered it (for `two`, both: `killed,stopped`).
    pub host: String,
    /// Prewarm call → every healthy host holds a verified copy, seconds.
    pub ready_s: f64,
    /// The median no-fault ready time of the same run.
    pub no_fault_s: f64,
    /// ready_s / no_fault_s.
    pub ratio: f64,
    /// Every healthy host's copy is byte-exact.
    pub exact: bool,
    /// The plan's final report matches what every host really holds: each host `done`
    /// exactly when its copy is byte-exact, and the plan `done`, `partial` or `failed` as
    /// all, some or none of them are.
    pub status_true: bool,
    /// Every host asked for, the victim included, ended with a byte-exact copy (after the
    /// settle period: within the plan, or by the victim's own recovery).
    pub victims_complete: bool,
    /// Bytes still in the hosts' memory tiers after `Evict` of the model from every host
    /// (all of them, complete or partial copies, recovery state and staging): 0 when evict
    /// frees every byte. `None` when the evict call itself failed (`evict_error` says why).
    pub bytes_left_after_evict: Option<u64>,
    /// Why the evict call failed, if it did.
    pub evict_error: Option<String>,
    /// The plan's final state and message, and each host's state.
    pub plan: String,
    /// Bytes the origin served from the prewarm call until the plan settled (the model is
    /// `bytes`: more means some of it was read from the origin again, by a host below a
    /// failed one or by a re-planned victim).
    pub origin_bytes: u64,
}

/// The `faults` report.
#[derive(Debug, Clone, Serialize)]
pub struct FaultsReport {
    /// Hosts.
    pub hosts: usize,
    /// Model bytes.
    pub bytes: u64,
    /// Host link rate, bits/s.
    pub rate_bits_per_s: u64,
    /// When faults struck, seconds after the prewarm call.
    pub at_s: f64,
    /// The no-fault ready times.
    pub no_fault_s: Vec<f64>,
    /// Every trial with a fault.
    pub results: Vec<FaultTrial>,
}

/// Runs `faults`: the no-fault baseline, then each fault × position × trial.
pub async fn run_faults(opts: &FaultsOpts) -> anyhow::Result<FaultsReport> {
    if opts.hosts < 3 {
        bail!("--hosts must be at least 3 (a head, a middle hop and a tail)");
    }
    let (origin_dir, model) = origin_model(opts.size, opts.shards)?;
    let mut baseline = Vec::new();
    for trial in 0..opts.trials.max(1) {
        let t = run_trial(opts, origin_dir.path(), Fault::None, None).await?;
        eprintln!("no fault, trial {}: ready in {:.2} s", trial + 1, t.ready_s);
        if !t.exact || !t.status_true {
            bail!("the no-fault baseline is not exact and true: {}", t.plan);
        }
        baseline.push(t.ready_s);
    }
    let mut sorted = baseline.clone();
    sorted.sort_by(f64::total_cmp);
    let no_fault_s = sorted[sorted.len() / 2];
    let mut results = Vec::new();
    for &fault in opts.faults.iter().filter(|f| **f != Fault::None) {
        // A rolling restart takes every host, from the head: positions do not apply.
        let positions = match fault {
            Fault::Rolling => &[Position::Head][..],
            _ => &opts.positions[..],
        };
        for &position in positions {
            for trial in 0..opts.trials.max(1) {
                let mut t = run_trial(opts, origin_dir.path(), fault, Some(position)).await?;
                t.no_fault_s = no_fault_s;
                t.ratio = t.ready_s / no_fault_s;
                eprintln!(
                    "{fault:?} at the {position:?} ({}), trial {}: ready in {:.2} s = {:.2} × no fault, exact {}, status true {}, victims complete {}, origin bytes {}, bytes left after evict {}",
                    t.host,
                    trial + 1,
                    t.ready_s,
                    t.ratio,
                    t.exact,
                    t.status_true,
                    t.victims_complete,
                    t.origin_bytes,
                    match (&t.bytes_left_after_evict, &t.evict_error) {
                        (Some(b), _) => b.to_string(),
                        (None, e) =>
                            format!("unknown (evict failed: {})", e.as_deref().unwrap_or("?")),
                    }
                );
                results.push(t);
            }
        }
    }
    Ok(FaultsReport {
        hosts: opts.hosts,
        bytes: model.total_bytes,
        rate_bits_per_s: opts.rate * 8,
        at_s: opts.at.as_secs_f64(),
        no_fault_s: baseline,
        results,
    })
}

async fn run_trial(
    opts: &FaultsOpts,
    origin_dir: &Path,
    fault: Fault,
    position: Option<Position>,
) -> anyhow::Result<FaultTrial> {
    let mut c = EmulatedCluster::start(
        opts.hosts,
        opts.rate,
        opts.origin_rate,
        origin_dir,
        "faults",
        &opts.daemon_args,
        (fault == Fault::Fill).then_some(opts.size + FILL_MARGIN),
    )
    .await?;
    let mut api = c.controller.client().await?;
    let EmulatedCluster {
        daemons,
        net,
        manifest,
        origin,
        ..
    } = &mut c;
    let (net, manifest, origin) = (&*net, &*manifest, &*origin);
    let origin_before = origin.bytes_sent();
    let t0 = Instant::now();
    let accepted = api
        .prewarm(PrewarmRequest {
            model: MODEL_NAME.into(),
            replicas: opts.hosts as u32,
            tier: shardcast_protocol::controller::Tier::Memory as i32,
            ..Default::default()
        })
        .await
        .context("Prewarm")?
        .into_inner();
    let chain = accepted
        .chains
        .first()
        .map(|c| c.hops.clone())
        .unwrap_or_default();
    // The victim's index in the chain, and for `two` its neighbour's.
    let at = match position {
        _ if fault == Fault::None => None,
        None => None,
        Some(Position::Head) => Some(0),
        Some(Position::Middle) => Some(chain.len() / 2),
        Some(Position::Tail) => Some(chain.len().saturating_sub(1)),
    };
    let mut victims = Vec::new();
    if fault == Fault::Rolling {
        victims = chain.clone();
    } else if let Some(i) = at {
        victims.push(chain.get(i).cloned().context("the plan has no chain")?);
        if fault == Fault::Two {
            let j = if i + 1 < chain.len() {
                i + 1
            } else {
                i.saturating_sub(1)
            };
            anyhow::ensure!(j != i, "`two` needs a chain of at least two hosts");
            victims.push(chain[j].clone());
        }
    }
    let index = |h: &String| {
        daemons
            .iter()
            .position(|d| d.host_id.as_str() == h.as_str())
    };
    let vis: Vec<usize> = victims.iter().filter_map(index).collect();
    anyhow::ensure!(
        vis.len() == victims.len(),
        "a victim is not one of the cluster's hosts"
    );
    // The fault, in the background of the plan's progress.
    let hidden = ProgressBar::hidden();
    let waiting = ready_times(&mut api, &accepted.plan_id, t0, opts.timeout, &hidden);
    let strike = async {
        let Some(&vi) = vis.first() else {
            return Ok::<_, anyhow::Error>(());
        };
        tokio::time::sleep_until((t0 + opts.at).into()).await;
        match fault {
            Fault::None => {}
            Fault::Kill => restart_after(&mut daemons[vi], RESTART_AFTER).await?,
            Fault::Stop => stop_for(&daemons[vi], SILENT_FOR).await?,
            Fault::Two => {
                let (killed, stopped) = pair_mut(daemons, vi, vis[1]);
                let (k, s) = tokio::join!(
                    restart_after(killed, RESTART_AFTER),
                    stop_for(stopped, SILENT_FOR)
                );
                k?;
                s?;
            }
            Fault::LinkDown => {
                net.set_link(vi, false)?;
                tokio::time::sleep(SILENT_FOR).await;
                net.set_link(vi, true)?;
            }
            Fault::Corrupt => flip_byte(&daemons[vi].memory_shard_path(manifest, 0), 100)?,
            Fault::Fill => fill_for(&daemons[vi].memory_dir, SILENT_FOR).await?,
            Fault::Rotate => daemons[vi].rotate_certificate()?,
            Fault::Term => terminate_and_restart(&mut daemons[vi], RESTART_AFTER).await?,
            Fault::Rolling => {
                for &i in &vis {
                    terminate_and_restart(&mut daemons[i], Duration::ZERO).await?;
                }
            }
        }
        Ok(())
    };
    let (ended, struck) = tokio::join!(waiting, strike);
    struck?;
    let (_, ready) = ended?;
    // A corrupt copy is repaired in place, and in a rolling restart every host is a
    // victim: there, every host counts for the ready time.
    let healthy = |h: &str| {
        matches!(fault, Fault::Corrupt | Fault::Rolling) || !victims.iter().any(|v| v == h)
    };
    let ready_s = daemons
        .iter()
        .map(|d| d.host_id.as_str())
        .filter(|h| healthy(h))
        .map(|h| ready.iter().find(|(x, _)| x == h).map(|r| r.1))
        .try_fold(0.0f64, |acc, t| t.map(|t| acc.max(t)));
    let exact = daemons
        .iter()
        .filter(|d| healthy(d.host_id.as_str()))
        .all(|d| d.verify_copy(manifest).is_ok());
    // A victim that recovers reports itself through its heartbeats: give it the time to.
    let final_status = settle(&mut api, &accepted.plan_id, daemons, manifest).await?;
    // The origin's stats file is rewritten every 100 ms.
    tokio::time::sleep(Duration::from_millis(250)).await;
    let origin_bytes = origin.bytes_sent().saturating_sub(origin_before);
    let status_true = report_is_true(&final_status, daemons, manifest);
    let victims_complete = daemons.iter().all(|d| d.verify_copy(manifest).is_ok());
    let plan = format!(
        "{} {:?}: {}",
        final_status.state().label(),
        final_status.message,
        final_status
            .hosts
            .iter()
            .map(|h| format!("{}={}", h.host, h.state))
            .collect::<Vec<_>>()
            .join(" ")
    );
    let (bytes_left_after_evict, evict_error) = match evict_everywhere(&mut api).await {
        Ok(()) => {
            let mut left = 0;
            for d in daemons.iter() {
                left += d.memory_tier_bytes()?;
            }
            (Some(left), None)
        }
        Err(e) => (None, Some(format!("{e:#}"))),
    };
    drop(c);
    Ok(FaultTrial {
        fault,
        position,
        host: victims.join(","),
        ready_s: ready_s.unwrap_or(f64::INFINITY),
        no_fault_s: 0.0,
        ratio: 0.0,
        exact: exact && ready_s.is_some(),
        status_true,
        victims_complete,
        bytes_left_after_evict,
        evict_error,
        plan,
        origin_bytes,
    })
}

/// `Evict` of the model's memory-tier copies from every host that has any.
async fn evict_everywhere(
    api: &mut shardcast_protocol::controller::controller_client::ControllerClient<
        tonic::transport::Channel,
    >,
) -> anyhow::Result<()> {
    api.evict(EvictRequest {
        model: MODEL_NAME.into(),
        tier: shardcast_protocol::controller::Tier::Memory as i32,
        hosts: Vec::new(),
    })
    .await
    .context("Evict")?;
    Ok(())
}

/// How long a killed host stays down before it is started again.
const RESTART_AFTER: Duration = Duration::from_secs(3);
/// How long a stopped host stays stopped, and a cut link cut.
const SILENT_FOR: Duration = Duration::from_secs(8);

/// SIGKILL, then the same daemon started again `after` later.
async fn restart_after(d: &mut Daemon, after: Duration) -> anyhow::Result<()> {
    d.kill().await;
    tokio::time::sleep(after).await;
    d.restart().await
}

/// SIGTERM, as an operator stops the host, then waits for it to exit (it drains first:
/// up to its `drain_grace_ms`, 20 s by default, and 5 s to wind down; killed after 30 s),
/// and starts it again `after` it exited.
async fn terminate_and_restart(d: &mut Daemon, after: Duration) -> anyhow::Result<()> {
    d.signal("TERM")?;
    if d.wait_exit(STOP_LIMIT).await?.is_none() {
        eprintln!(
            "{} did not exit within {STOP_LIMIT:?} of SIGTERM; killing it",
            d.host_id
        );
    }
    tokio::time::sleep(after).await;
    d.restart().await
}

/// The longest a stopped daemon is given to exit before it is killed (its default drain
/// grace, 20 s, and 5 s to wind down, with a margin).
const STOP_LIMIT: Duration = Duration::from_secs(30);

/// SIGSTOP, then SIGCONT `for_` later.
async fn stop_for(d: &Daemon, for_: Duration) -> anyhow::Result<()> {
    d.signal("STOP")?;
    tokio::time::sleep(for_).await;
    d.signal("CONT")
}

/// Room a `fill` trial's tmpfs memory tiers have beyond the model.
const FILL_MARGIN: u64 = 64 << 20;

/// Another process's file filling the file system of `tier` (until `ENOSPC`), removed
/// `for_` later.
async fn fill_for(tier: &Path, for_: Duration) -> anyhow::Result<()> {
    let path = tier.join("filled-by-another-process");
    let p = path.clone();
    let filled = tokio::task::spawn_blocking(move || -> anyhow::Result<u64> {
        use std::io::Write;
        let mut f =
            std::fs::File::create(&p).with_context(|| format!("creating {}", p.display()))?;
        let block = vec![0x5au8; 1 << 20];
        let mut n = 0;
        while f.write_all(&block).is_ok() {
            n += block.len() as u64;
        }
        Ok(n)
    })
    .await??;
    eprintln!("fill: {filled} bytes written to {}", path.display());
    tokio::time::sleep(for_).await;
    std::fs::remove_file(&path).with_context(|| format!("removing {}", path.display()))
}

/// Two distinct elements of a slice, both mutable (`slice::get_disjoint_mut` is newer than
/// the workspace's MSRV, 1.85).
fn pair_mut<T>(v: &mut [T], a: usize, b: usize) -> (&mut T, &mut T) {
    assert_ne!(a, b, "pair_mut of one element");
    if a < b {
        let (x, y) = v.split_at_mut(b);
        (&mut x[a], &mut y[0])
    } else {
        let (x, y) = v.split_at_mut(a);
        (&mut y[0], &mut x[b])
    }
}

/// Waits (up to 30 s) until the plan's report agrees with the hosts' real copies, and
/// returns the last report either way.
async fn settle(
    api: &mut shardcast_protocol::controller::controller_client::ControllerClient<
        tonic::transport::Channel,
    >,
    plan: &str,
    daemons: &[Daemon],
    manifest: &Manifest,
) -> anyhow::Result<PlanStatus> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let s = api
            .get_plan(WatchPlanRequest {
                plan_id: plan.to_string(),
            })
            .await
            .context("GetPlan")?
            .into_inner();
        if report_is_true(&s, daemons, manifest) || Instant::now() >= deadline {
            return Ok(s);
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// Whether a plan's report is what the hosts really hold: each host `done` exactly when
/// its copy is byte-exact, and the plan `done` when every host's is, `partial` when only
/// some are, `failed` when none is.
fn report_is_true(s: &PlanStatus, daemons: &[Daemon], manifest: &Manifest) -> bool {
    let mut exact = 0;
    let hosts_true = daemons.iter().all(|d| {
        let holds = d.verify_copy(manifest).is_ok();
        exact += usize::from(holds);
        s.hosts
            .iter()
            .find(|h| h.host == d.host_id.as_str())
            .is_some_and(|h| h.state().label() == "done")
            == holds
    });
    let outcome = match exact {
        0 => "failed",
        n if n == daemons.len() => "done",
        _ => "partial",
    };
    hosts_true && s.state().label() == outcome
}
