//! Emulated clusters: one network namespace per host on this machine, joined by a bridge.
//!
//! ```text
//!   host ns "shcbench-<pid>-<n>-h0"        switch ns "shcbench-<pid>-<n>-sw"
//!   ┌──────────────────────────┐           ┌──────────────────────────────┐
//!   │ lo (up)                  │           │                              │
//!   │ eth0 10.233.77.1/24 ─────┼── veth ───┼─ p0 ─┐                       │
//!   │   egress: [netem] → tbf  │           │  egress: tbf (h0's ingress)  │
//!   └──────────────────────────┘           │       ├── br0 (no address)   │
//!   host ns "…-h1"  eth0 10.233.77.2 ──────┼─ p1 ─┘                       │
//!                                          └──────────────────────────────┘
//! ```
//!
//! * **Isolation.** Every link is created directly inside the namespaces (`ip -n H link add eth0
//!   type veth peer name pI netns SW`), the bridge lives in its own switch namespace, and the
//!   only addresses are in [`SUBNET`] on the hosts' `eth0` (links get no IPv6 link-local
//!   address either, so no neighbour discovery chatter crosses the shaped links). The root namespace gets no link,
//!   address or route, so nothing sent inside can leave the machine. Two runs (or two
//!   [`EmulatedNet`]s in one process) use the same /24 in disjoint namespaces, so they never
//!   see each other.
//! * **Names.** Namespaces are named `shcbench-<pid>-<n>-{sw,hI}` (`n` counts the nets this
//!   process created), which keeps runs apart and lets [`EmulatedNet::cleanup_stale`] recognise
//!   leftovers of a dead process.
//! * **Shaping.** A host's egress is capped by a `tbf` on its `eth0`, its ingress by a `tbf` on
//!   the egress of its switch-side peer `pI`; both count link-layer bytes, so TCP goodput is
//!   about 95% of the cap (1448 payload bytes per 1514-byte frame). An optional `netem` delay
//!   sits in front of the host-side `tbf`: every packet a host sends is held for `delay`, so
//!   host-to-host latency is `delay` one way and `2 × delay` round trip.
//! * **Teardown.** Deleting the namespaces (hosts first, then the switch) destroys every veth
//!   and qdisc with them. [`EmulatedNet`] does it on drop and on [`EmulatedNet::teardown`];
//!   [`install_signal_teardown`] does it for every namespace of this process on SIGINT, SIGTERM
//!   or SIGHUP before exiting. A process that dies without either (SIGKILL, `process::exit`)
//!   leaves namespaces that the next run's [`EmulatedNet::cleanup_stale`] removes.
//!
//! Every external command is bounded by [`COMMAND_TIMEOUT`], and a failure names the command
//! line and its stderr.

use std::ffi::OsStr;
use std::fmt::Write as _;
use std::net::Ipv4Addr;
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, anyhow, bail, ensure};

/// Prefix of every namespace this tool creates; followed by the creating process's PID.
const NS_PREFIX: &str = "shcbench-";

/// The one private /24 used inside the namespaces; host `i` is `.i+1`.
pub const SUBNET: [u8; 3] = [10, 233, 77];

/// Most hosts in one net: the /24 minus network, broadcast and a few spare addresses.
pub const MAX_HOSTS: usize = 250;

/// Highest rate accepted, in bytes per second (100 Gbit/s): beyond what veth pairs reach and
/// far below where the tc rate in bits would overflow.
const MAX_RATE: u64 = 100_000_000_000 / 8;

/// Longest any single `ip`/`tc` command may run before it is killed and reported; they normally
/// take milliseconds.
pub const COMMAND_TIMEOUT: Duration = Duration::from_secs(20);

/// Counts nets created by this process, so concurrent ones get distinct names.
static NEXT_NET: AtomicU32 = AtomicU32::new(0);

/// A set of emulated hosts, each in its own network namespace, joined by a bridge.
///
/// Dropping it deletes every namespace it created; it never kills processes (callers own what
/// they started with [`EmulatedNet::command`]).
#[derive(Debug)]
pub struct EmulatedNet {
    switch_ns: String,
    host_ns: Vec<String>,
    /// Namespaces that currently exist, in creation order.
    created: Vec<String>,
    rate: Option<u64>,
    delay: Option<Duration>,
}

impl EmulatedNet {
    /// Creates `hosts` network namespaces, each with a veth into a bridge in a separate switch
    /// namespace, with each host's egress and ingress capped at `rate` bytes per second (`None`:
    /// uncapped) and, with `delay`, every packet a host sends delayed by that much.
    ///
    /// If any step fails, everything created so far is deleted before the error is returned.
    ///
    /// # Errors
    ///
    /// `hosts` is 0 or above [`MAX_HOSTS`], `rate` is 0 or above 100 Gbit/s, or an `ip`/`tc`
    /// command fails (the error names it and its stderr); a delay needs the kernel's `netem`
    /// qdisc (see [`netem_available`]).
    pub fn create(
        hosts: usize,
        rate: Option<u64>,
        delay: Option<Duration>,
    ) -> anyhow::Result<Self> {
        ensure!(
            (1..=MAX_HOSTS).contains(&hosts),
            "an emulated net has 1 to {MAX_HOSTS} hosts, asked for {hosts}"
        );
        if let Some(r) = rate {
            ensure!(
                (1..=MAX_RATE).contains(&r),
                "rate must be between 1 and {MAX_RATE} bytes/s, got {r}"
            );
        }
        let tag = format!(
            "{NS_PREFIX}{}-{}",
            std::process::id(),
            NEXT_NET.fetch_add(1, Ordering::Relaxed)
        );
        let mut net = Self {
            switch_ns: format!("{tag}-sw"),
            host_ns: (0..hosts).map(|i| format!("{tag}-h{i}")).collect(),
            created: Vec::with_capacity(hosts + 1),
            rate,
            delay,
        };
        if let Err(e) = net.build() {
            net.teardown();
            return Err(e.context(format!("creating emulated net {tag} ({hosts} hosts)")));
        }
        Ok(net)
    }

    fn build(&mut self) -> anyhow::Result<()> {
        let sw = self.switch_ns.clone();
        self.add_ns(&sw)?;
        ip(&["-n", &sw, "link", "set", "lo", "up"])?;
        ip(&[
            "-n",
            &sw,
            "link",
            "add",
            "br0",
            "type",
            "bridge",
            "stp_state",
            "0",
            "forward_delay",
            "0",
        ])?;
        ip(&["-n", &sw, "link", "set", "br0", "addrgenmode", "none"])?;
        ip(&["-n", &sw, "link", "set", "br0", "up"])?;
        for i in 0..self.host_ns.len() {
            let h = self.host_ns[i].clone();
            let peer = format!("p{i}");
            let addr = format!("{}/24", self.host_ip(i));
            self.add_ns(&h)?;
            ip(&["-n", &h, "link", "set", "lo", "up"])?;
            ip(&[
                "-n", &h, "link", "add", "eth0", "type", "veth", "peer", "name", &peer, "netns",
                &sw,
            ])?;
            ip(&["-n", &h, "link", "set", "eth0", "addrgenmode", "none"])?;
            ip(&["-n", &sw, "link", "set", &peer, "addrgenmode", "none"])?;
            ip(&["-n", &sw, "link", "set", &peer, "master", "br0"])?;
            ip(&["-n", &sw, "link", "set", &peer, "up"])?;
            ip(&["-n", &h, "addr", "add", &addr, "dev", "eth0"])?;
            ip(&["-n", &h, "link", "set", "eth0", "up"])?;
            self.shape(&h, &sw, &peer)?;
        }
        Ok(())
    }

    /// Installs the qdiscs of one host: [netem →] tbf on its `eth0`, tbf on its switch port.
    fn shape(&self, host_ns: &str, switch_ns: &str, peer: &str) -> anyhow::Result<()> {
        let mut tbf_parent = vec!["root".to_owned()];
        if let Some(delay) = self.delay {
            let us = delay.as_micros().max(1).to_string();
            // Enough packets to hold a full second of a 10 Gbit/s link's delayed traffic.
            tc(&[
                "-n",
                host_ns,
                "qdisc",
                "add",
                "dev",
                "eth0",
                "root",
                "handle",
                "1:",
                "netem",
                "delay",
                &format!("{us}us"),
                "limit",
                "1000000",
            ])
            .context("adding the delay (needs the kernel's netem qdisc, CONFIG_NET_SCH_NETEM)")?;
            tbf_parent = vec!["parent".to_owned(), "1:1".to_owned()];
        }
        let Some(rate) = self.rate else {
            return Ok(());
        };
        let tbf = tbf_args(rate, self.delay.unwrap_or_default());
        let mut egress = vec!["-n", host_ns, "qdisc", "add", "dev", "eth0"];
        egress.extend(tbf_parent.iter().map(String::as_str));
        egress.extend(["handle", "10:", "tbf"]);
        egress.extend(tbf.iter().map(String::as_str));
        tc(&egress)?;
        let mut ingress = vec!["-n", switch_ns, "qdisc", "add", "dev", peer, "root", "tbf"];
        ingress.extend(tbf.iter().map(String::as_str));
        tc(&ingress)?;
        Ok(())
    }

    fn add_ns(&mut self, name: &str) -> anyhow::Result<()> {
        ip(&["netns", "add", name])?;
        self.created.push(name.to_owned());
        Ok(())
    }

    /// Takes host `i`'s switch port down (`up` false) or up again: its link is cut, both
    /// ways, without the host noticing a local interface change.
    pub fn set_link(&self, i: usize, up: bool) -> anyhow::Result<()> {
        ensure!(i < self.host_ns.len(), "no host {i} in this net");
        let port = format!("p{i}");
        ip(&[
            "-n",
            &self.switch_ns,
            "link",
            "set",
            &port,
            if up { "up" } else { "down" },
        ])?;
        Ok(())
    }

    /// Drops `per_10000` / 10 000 of the packets host `i` sends, chosen at random per
    /// packet; 0 removes the loss. Needs `nft` ([`loss_available`]); it works without the
    /// kernel's `netem`.
    ///
    /// The rule sits in the switch namespace, on the bridge's forward path for IPv4 frames
    /// arriving from host `i`'s port, and the host's `eth0` has its TCP and UDP
    /// segmentation offloads turned off (`ethtool`), so that GSO cuts super-packets into
    /// wire-sized frames before they leave and one drop is one lost frame (not a 64 KiB
    /// burst). That software segmentation costs some CPU a NIC would save. The drops are
    /// counted ([`Self::dropped`]).
    pub fn set_loss(&self, i: usize, per_10000: u32) -> anyhow::Result<()> {
        ensure!(i < self.host_ns.len(), "no host {i} in this net");
        ensure!(
            per_10000 <= 10_000,
            "a loss is at most 10000 per 10000, got {per_10000}"
        );
        let table = format!("{LOSS_TABLE}_{i}");
        // Idempotent: the table is replaced as a whole.
        let _ = nft(&self.switch_ns, &["delete", "table", "bridge", &table]);
        // Wire-sized frames out of the host, so that one drop loses one frame: with the
        // veth's TCP and UDP segmentation offloads off, the kernel cuts the stacks' 64 KiB
        // super-packets in software (GSO) just before the device, as a NIC would in
        // hardware; the stacks above still build and acknowledge them whole.
        let offload = if per_10000 == 0 { "on" } else { "off" };
        in_ns(
            &self.host_ns[i],
            "ethtool",
            &["-K", "eth0", "tso", offload, "tx-udp-segmentation", offload],
        )?;
        if per_10000 == 0 {
            return Ok(());
        }
        add_loss_rule(&self.switch_ns, &table, &format!("p{i}"), per_10000)
    }

    /// Frames host `i`'s loss rule ([`Self::set_loss`]) has dropped so far (0 without one).
    pub fn dropped(&self, i: usize) -> anyhow::Result<u64> {
        ensure!(i < self.host_ns.len(), "no host {i} in this net");
        let table = format!("{LOSS_TABLE}_{i}");
        let Ok(listing) = nft(&self.switch_ns, &["list", "table", "bridge", &table]) else {
            return Ok(0);
        };
        Ok(parse_dropped(&listing))
    }

    /// Number of hosts.
    pub fn hosts(&self) -> usize {
        self.host_ns.len()
    }

    /// The cap on each host's egress and ingress in bytes per second, if any.
    pub fn rate(&self) -> Option<u64> {
        self.rate
    }

    /// The delay added to every packet a host sends, if any.
    pub fn delay(&self) -> Option<Duration> {
        self.delay
    }

    /// Address of host `i` (`10.233.77.{i+1}`), reachable from every other host.
    ///
    /// For `i` at or past [`Self::hosts`] the address is in the subnet but unassigned.
    pub fn host_ip(&self, i: usize) -> Ipv4Addr {
        let last = u8::try_from(i + 1).unwrap_or(u8::MAX);
        Ipv4Addr::new(SUBNET[0], SUBNET[1], SUBNET[2], last)
    }

    /// Name of host `i`'s network namespace, for `ip netns exec` and the like.
    ///
    /// # Panics
    ///
    /// If `i` is not below [`Self::hosts`], like slice indexing.
    pub fn ns_name(&self, i: usize) -> &str {
        &self.host_ns[i]
    }

    /// Sets the MTU of every link: each host's `eth0`, its switch port and the bridge (e.g.
    /// 9000 for a jumbo-frame network).
    ///
    /// # Errors
    ///
    /// `mtu` is outside 1280..=65535 (IPv6's minimum to a veth's maximum), or an `ip`
    /// command fails.
    pub fn set_mtu(&self, mtu: u32) -> anyhow::Result<()> {
        ensure!(
            (1280..=65535).contains(&mtu),
            "an emulated link's MTU is 1280 to 65535 bytes, asked for {mtu}"
        );
        let m = mtu.to_string();
        for (i, h) in self.host_ns.iter().enumerate() {
            ip(&["-n", h, "link", "set", "eth0", "mtu", &m])?;
            ip(&[
                "-n",
                &self.switch_ns,
                "link",
                "set",
                &format!("p{i}"),
                "mtu",
                &m,
            ])?;
        }
        ip(&["-n", &self.switch_ns, "link", "set", "br0", "mtu", &m])?;
        Ok(())
    }

    /// Sets the TCP congestion control every host's new connections use
    /// (`net.ipv4.tcp_congestion_control` in its namespace; a namespace starts with the
    /// machine's). Call it before the daemons connect.
    ///
    /// # Errors
    ///
    /// `name` is not one the kernel offers (`net.ipv4.tcp_available_congestion_control`), or
    /// `sysctl` fails.
    pub fn set_congestion(&self, name: &str) -> anyhow::Result<()> {
        let offered =
            std::fs::read_to_string("/proc/sys/net/ipv4/tcp_available_congestion_control")
                .context("reading the kernel's TCP congestion controls")?;
        ensure!(
            offered.split_whitespace().any(|c| c == name),
            "TCP congestion control {name:?} is not offered by this kernel (it offers: {})",
            offered.trim()
        );
        // A namespace other than the machine's may only pick one the machine allows.
        let allowed = std::fs::read_to_string("/proc/sys/net/ipv4/tcp_allowed_congestion_control")
            .context("reading the TCP congestion controls namespaces may use")?;
        ensure!(
            allowed.split_whitespace().any(|c| c == name),
            "TCP congestion control {name:?} is not allowed in a network namespace here \
             (net.ipv4.tcp_allowed_congestion_control: {}); allow it first, e.g. \
             `sysctl -w net.ipv4.tcp_allowed_congestion_control=\"{} {name}\"`",
            allowed.trim(),
            allowed.trim()
        );
        let setting = format!("net.ipv4.tcp_congestion_control={name}");
        for h in &self.host_ns {
            in_ns(h, "sysctl", &["-q", "-w", &setting])?;
        }
        Ok(())
    }

    /// Name of the switch namespace holding the bridge and the ingress shapers.
    pub fn switch_ns_name(&self) -> &str {
        &self.switch_ns
    }

    /// A command that runs `program` inside host `i`'s namespace (`ip netns exec <ns> program`).
    /// `ip` execs the program, so the child's PID is the program's.
    ///
    /// # Panics
    ///
    /// If `i` is not below [`Self::hosts`].
    pub fn command(&self, i: usize, program: impl AsRef<OsStr>) -> Command {
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", self.ns_name(i)]).arg(program);
        cmd
    }

    /// Deletes every namespace this net created (and with them its links and qdiscs).
    ///
    /// Idempotent. Processes still running inside keep their (now unnamed) namespace alive until
    /// they exit; this kills nothing. Failures are logged, not returned, so it can run on drop.
    pub fn teardown(&mut self) {
        while let Some(name) = self.created.pop() {
            if let Err(e) = delete_ns(&name) {
                tracing::warn!(namespace = %name, error = %format!("{e:#}"), "teardown failed");
            }
        }
    }

    /// Deletes namespaces left behind by earlier runs of this tool whose process is gone, and
    /// returns how many it deleted. Namespaces of live processes (this one included) are kept.
    ///
    /// # Errors
    ///
    /// `ip netns list` or an `ip netns del` fails.
    pub fn cleanup_stale() -> anyhow::Result<usize> {
        let mut deleted = 0;
        for name in list_ns()? {
            let Some(pid) = owner_pid(&name) else {
                continue;
            };
            if pid == std::process::id() || std::path::Path::new(&format!("/proc/{pid}")).exists() {
                continue;
            }
            delete_ns(&name)?;
            deleted += 1;
        }
        Ok(deleted)
    }
}

impl Drop for EmulatedNet {
    fn drop(&mut self) {
        self.teardown();
    }
}

/// The tbf arguments (after `tbf`) for a cap of `rate` bytes/s on a path with `delay` added.
fn tbf_args(rate: u64, delay: Duration) -> Vec<String> {
    // Burst: at least two 64 KiB GSO super-packets, so tbf never has to segment or drop one,
    // and at least 2 ms at the rate so timer slack does not cost throughput. It lets through at
    // most that much above the rate, which averages out within milliseconds.
    let burst = (rate / 500).max(128 << 10);
    // Queue: 20 ms at the rate plus the round trip that `delay` adds (the bandwidth-delay
    // product), so a TCP flow through the cap keeps it busy even right after a loss.
    let queue_time = Duration::from_millis(20) + 2 * delay;
    let limit = ((u128::from(rate) * queue_time.as_micros()) / 1_000_000)
        .max(u128::from(4 * burst))
        .min(u128::from(u32::MAX));
    vec![
        "rate".into(),
        format!("{}bit", u128::from(rate) * 8),
        "burst".into(),
        burst.to_string(),
        "limit".into(),
        limit.to_string(),
    ]
}

/// The PID a namespace name of this tool encodes, if it is one.
fn owner_pid(name: &str) -> Option<u32> {
    name.strip_prefix(NS_PREFIX)?
        .split('-')
        .next()?
        .parse()
        .ok()
}

/// Names of all named network namespaces.
fn list_ns() -> anyhow::Result<Vec<String>> {
    let out = ip(&["netns", "list"])?;
    Ok(out
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .map(str::to_owned)
        .collect())
}

fn delete_ns(name: &str) -> anyhow::Result<()> {
    ip(&["netns", "del", name]).map(drop)
}

/// Deletes every namespace this process created; returns how many.
fn delete_own_namespaces() -> anyhow::Result<usize> {
    let mut names: Vec<String> = list_ns()?
        .into_iter()
        .filter(|n| owner_pid(n) == Some(std::process::id()))
        .collect();
    // Hosts before their switch, as teardown does.
    names.sort_by_key(|n| n.ends_with("-sw"));
    let mut deleted = 0;
    for name in names {
        match delete_ns(&name) {
            Ok(()) => deleted += 1,
            Err(e) => eprintln!("shardcast-bench: {e:#}"),
        }
    }
    Ok(deleted)
}

fn ip(args: &[&str]) -> anyhow::Result<String> {
    run_checked("ip", args)
}

fn tc(args: &[&str]) -> anyhow::Result<String> {
    run_checked("tc", args)
}

/// The nftables tables [`EmulatedNet::set_loss`] installs in the switch namespace, one per
/// host (`shardcast_loss_<i>`).
const LOSS_TABLE: &str = "shardcast_loss";

/// `program args` inside namespace `ns`.
fn in_ns(ns: &str, program: &str, args: &[&str]) -> anyhow::Result<String> {
    let mut all = vec!["netns", "exec", ns, program];
    all.extend_from_slice(args);
    run_checked("ip", &all)
}

/// `nft args` inside namespace `ns`.
fn nft(ns: &str, args: &[&str]) -> anyhow::Result<String> {
    in_ns(ns, "nft", args)
}

/// Adds, in namespace `ns`, the bridge table `table` whose forward chain drops
/// `per_10000` (1..=10000) / 10 000 of the IPv4 frames arriving from port `port`, counted.
fn add_loss_rule(ns: &str, table: &str, port: &str, per_10000: u32) -> anyhow::Result<()> {
    ensure!(
        (1..=10_000).contains(&per_10000),
        "a loss rule drops 1 to 10000 per 10000"
    );
    nft(ns, &["add", "table", "bridge", table])?;
    nft(
        ns,
        &[
            "add", "chain", "bridge", table, "forward", "{", "type", "filter", "hook", "forward",
            "priority", "0", ";", "policy", "accept", ";", "}",
        ],
    )?;
    // IPv4 frames only (ARP passes, so a host stays reachable at any loss). numgen yields
    // 0..=9999, and nft refuses a bound outside that range: `<=` the last.
    let last = (per_10000 - 1).to_string();
    nft(
        ns,
        &[
            "add", "rule", "bridge", table, "forward", "iifname", port, "ether", "type", "ip",
            "numgen", "random", "mod", "10000", "<=", &last, "counter", "drop",
        ],
    )?;
    Ok(())
}

/// The packets counted by the loss rule in `nft list table`'s output
/// (`… counter packets 12 bytes 18000 drop`).
fn parse_dropped(listing: &str) -> u64 {
    listing
        .lines()
        .filter(|l| l.contains("drop"))
        .filter_map(|l| {
            let mut words = l.split_whitespace();
            words.find(|w| *w == "packets")?;
            words.next()?.parse::<u64>().ok()
        })
        .sum()
}

/// Runs `program args`, bounded by [`COMMAND_TIMEOUT`], and returns its stdout; a failure names
/// the command line and its stderr.
fn run_checked(program: &str, args: &[&str]) -> anyhow::Result<String> {
    let line = std::iter::once(program)
        .chain(args.iter().copied())
        .collect::<Vec<_>>()
        .join(" ");
    // Files rather than pipes: the child can never block on a full pipe while we poll it.
    let stdout = tempfile::tempfile().context("creating a temporary file")?;
    let stderr = tempfile::tempfile().context("creating a temporary file")?;
    let mut child = Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .stdout(stdout.try_clone().context("cloning a file handle")?)
        .stderr(stderr.try_clone().context("cloning a file handle")?)
        .spawn()
        .with_context(|| format!("`{line}` could not start"))?;
    let deadline = Instant::now() + COMMAND_TIMEOUT;
    let status = loop {
        if let Some(status) = child
            .try_wait()
            .with_context(|| format!("waiting for `{line}`"))?
        {
            break status;
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            bail!("`{line}` did not finish within {COMMAND_TIMEOUT:?} and was killed");
        }
        std::thread::sleep(Duration::from_millis(2));
    };
    let read = |mut f: std::fs::File| -> String {
        use std::io::{Read, Seek};
        let mut s = String::new();
        let _ = f.rewind().and_then(|()| f.read_to_string(&mut s));
        s
    };
    if !status.success() {
        let err = read(stderr);
        bail!("`{line}` failed ({status}): {}", err.trim());
    }
    Ok(read(stdout))
}

/// Creates a throwaway namespace, runs `probe` with its name, and deletes it again.
fn with_probe_ns(probe: impl FnOnce(&str) -> anyhow::Result<()>) -> anyhow::Result<()> {
    let name = format!(
        "{NS_PREFIX}{}-probe{}",
        std::process::id(),
        NEXT_NET.fetch_add(1, Ordering::Relaxed)
    );
    ip(&["netns", "add", &name])?;
    let result = probe(&name);
    let deleted = delete_ns(&name);
    result.and(deleted)
}

/// Why an emulated facility cannot be used on this host: the reason a test or the bench
/// prints as it skips. Cloned out of a once-per-process probe.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Unavailable {
    /// The process's effective uid could not be read.
    #[error("{0}")]
    Uid(String),
    /// Not root.
    #[error("emulated nets need root (network namespaces, tc); running as uid {0}")]
    NotRoot(u32),
    /// Namespaces, veth pairs, bridges or `tc tbf` failed.
    #[error("emulated nets unavailable: {0}")]
    Nets(String),
    /// No `netem` qdisc.
    #[error("netem delay unavailable (CONFIG_NET_SCH_NETEM?): {0}")]
    Netem(String),
    /// No `nft`/`ethtool`, or the kernel's bridge nf_tables lacks `numgen`.
    #[error(
        "packet loss unavailable (nft from Debian's nftables and ethtool; the kernel's bridge nf_tables with numgen): {0}"
    )]
    Loss(String),
    /// No tmpfs could be mounted ([`crate::cluster::TmpfsMount::available`]).
    #[error("{0}")]
    Tmpfs(String),
}

/// Whether emulated nets can be created here: `Ok` if this process is root and `ip netns`,
/// veth pairs, bridges and `tc tbf` work; otherwise the reason, for a caller to print as it
/// skips. The check runs once per process.
///
/// # Errors
///
/// The reason emulated nets are unavailable.
pub fn available() -> Result<(), Unavailable> {
    static RESULT: OnceLock<Result<(), Unavailable>> = OnceLock::new();
    RESULT
        .get_or_init(|| {
            let euid = effective_uid().map_err(|e| Unavailable::Uid(format!("{e:#}")))?;
            if euid != 0 {
                return Err(Unavailable::NotRoot(euid));
            }
            with_probe_ns(|ns| {
                ip(&["-n", ns, "link", "add", "br0", "type", "bridge"])?;
                ip(&[
                    "-n", ns, "link", "add", "eth0", "type", "veth", "peer", "name", "p0",
                ])?;
                ip(&["-n", ns, "link", "set", "p0", "master", "br0"])?;
                tc(&[
                    "-n", ns, "qdisc", "add", "dev", "eth0", "root", "tbf", "rate", "1gbit",
                    "burst", "131072", "limit", "1000000",
                ])?;
                Ok(())
            })
            .map_err(|e| Unavailable::Nets(format!("{e:#}")))
        })
        .clone()
}

/// Whether the kernel has the `netem` qdisc that [`EmulatedNet::create`] needs for a delay:
/// `Ok`, or the reason. Checked once per process, after [`available`].
///
/// # Errors
///
/// The reason delays are unavailable.
pub fn netem_available() -> Result<(), Unavailable> {
    static RESULT: OnceLock<Result<(), Unavailable>> = OnceLock::new();
    RESULT
        .get_or_init(|| {
            available()?;
            with_probe_ns(|ns| {
                tc(&[
                    "-n", ns, "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms",
                ])
                .map(drop)
            })
            .map_err(|e| Unavailable::Netem(format!("{e:#}")))
        })
        .clone()
}

/// Whether [`EmulatedNet::set_loss`] works here (emulated nets, `ethtool`, and `nft` with
/// the kernel's bridge nf_tables and `numgen`): `Ok`, or the reason. Checked once per process.
///
/// # Errors
///
/// The reason packet loss cannot be emulated.
pub fn loss_available() -> Result<(), Unavailable> {
    static RESULT: OnceLock<Result<(), Unavailable>> = OnceLock::new();
    RESULT
        .get_or_init(|| {
            available()?;
            with_probe_ns(|ns| {
                run_checked("ethtool", &["--version"])?;
                add_loss_rule(ns, LOSS_TABLE, "p0", 1)
            })
            .map_err(|e| Unavailable::Loss(format!("{e:#}")))
        })
        .clone()
}

fn effective_uid() -> anyhow::Result<u32> {
    let status =
        std::fs::read_to_string("/proc/self/status").context("reading /proc/self/status")?;
    let line = status
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))
        .ok_or_else(|| anyhow!("/proc/self/status has no Uid line"))?;
    // Fields: real, effective, saved, filesystem.
    line.split_whitespace()
        .nth(1)
        .and_then(|u| u.parse().ok())
        .ok_or_else(|| anyhow!("cannot parse Uid line {line:?}"))
}

/// Makes SIGINT, SIGTERM and SIGHUP tear down every namespace this process created, then exit
/// with status 128 + the signal number.
///
/// Design: a dedicated thread runs a small current-thread tokio runtime that only waits for
/// the signals. On one it runs `before_teardown` (for example to kill the caller's children
/// inside the namespaces), deletes every namespace named after this process's PID, and calls
/// `std::process::exit`. Going by name rather than through the [`EmulatedNet`] values means the
/// handler needs no lock and works however the nets are owned; a net dropped concurrently just
/// finds its namespaces gone. Once installed, these signals no longer kill the process
/// directly. The handlers are registered before this returns.
///
/// # Errors
///
/// It was already installed in this process, or the signal handlers could not be registered.
pub fn install_signal_teardown(
    before_teardown: impl FnOnce() + Send + 'static,
) -> anyhow::Result<()> {
    static INSTALLED: AtomicBool = AtomicBool::new(false);
    ensure!(
        !INSTALLED.swap(true, Ordering::SeqCst),
        "signal teardown is already installed"
    );
    let (ready_tx, ready_rx) = std::sync::mpsc::sync_channel::<anyhow::Result<()>>(1);
    let spawned = std::thread::Builder::new()
        .name("shcbench-signals".into())
        .spawn(move || {
            let runtime = match tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            {
                Ok(rt) => rt,
                Err(e) => {
                    let _ = ready_tx.send(Err(anyhow!(e).context("building the signal runtime")));
                    return;
                }
            };
            let signo = runtime.block_on(async move {
                use tokio::signal::unix::{SignalKind, signal};
                let registered = (|| {
                    Ok::<_, std::io::Error>((
                        signal(SignalKind::interrupt())?,
                        signal(SignalKind::terminate())?,
                        signal(SignalKind::hangup())?,
                    ))
                })();
                let (mut int, mut term, mut hup) = match registered {
                    Ok(s) => s,
                    Err(e) => {
                        let _ = ready_tx.send(Err(anyhow!(e).context("registering signals")));
                        return None;
                    }
                };
                let _ = ready_tx.send(Ok(()));
                tokio::select! {
                    _ = int.recv() => Some(libc::SIGINT),
                    _ = term.recv() => Some(libc::SIGTERM),
                    _ = hup.recv() => Some(libc::SIGHUP),
                }
            });
            let Some(signo) = signo else {
                return;
            };
            let mut msg = format!("shardcast-bench: signal {signo}, tearing down emulated nets");
            before_teardown();
            match delete_own_namespaces() {
                Ok(n) => {
                    let _ = write!(msg, ": deleted {n} namespace(s)");
                }
                Err(e) => {
                    let _ = write!(msg, ": {e:#}");
                }
            }
            eprintln!("{msg}");
            std::process::exit(128 + signo);
        });
    let result = spawned.context("spawning the signal thread").and_then(|_| {
        ready_rx
            .recv_timeout(Duration::from_secs(10))
            .context("the signal thread did not start")?
    });
    if result.is_err() {
        INSTALLED.store(false, Ordering::SeqCst);
    }
    result
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;
    use std::io::{Read, Write};
    use std::net::{SocketAddr, TcpListener, TcpStream};
    use std::process::{Child, Output};
    use std::sync::atomic::AtomicU64;
    use std::sync::{Arc, Mutex, MutexGuard};

    use super::*;

    /// Environment variable that turns [`tcp_role_helper`] into a TCP sender or receiver when
    /// this test binary is re-run inside a namespace.
    const ROLE_ENV: &str = "SHCBENCH_NETNS_ROLE";

    /// Rate measurements run one at a time: they would share the two CPUs and each other's caps.
    fn measure_lock() -> MutexGuard<'static, ()> {
        static LOCK: Mutex<()> = Mutex::new(());
        LOCK.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn skip() -> bool {
        match available() {
            Ok(()) => false,
            Err(reason) => {
                eprintln!("skipping: {reason}");
                true
            }
        }
    }

    /// A child killed and reaped on drop, so no failing assertion leaves it running.
    struct ChildGuard(Option<Child>);

    impl ChildGuard {
        fn wait_bounded(mut self, limit: Duration) -> Output {
            let mut child = self.0.take().expect("child present until waited");
            let deadline = Instant::now() + limit;
            loop {
                if child.try_wait().expect("try_wait").is_some() {
                    return child.wait_with_output().expect("collect output");
                }
                if Instant::now() >= deadline {
                    let _ = child.kill();
                    let out = child.wait_with_output().expect("collect output");
                    panic!(
                        "child did not finish within {limit:?}; stdout: {} stderr: {}",
                        String::from_utf8_lossy(&out.stdout),
                        String::from_utf8_lossy(&out.stderr)
                    );
                }
                std::thread::sleep(Duration::from_millis(10));
            }
        }
    }

    impl Drop for ChildGuard {
        fn drop(&mut self) {
            if let Some(mut c) = self.0.take() {
                let _ = c.kill();
                let _ = c.wait();
            }
        }
    }

    /// On drop, deletes every namespace named after process `pid` (a child this test started).
    struct SweepNamespacesOf(u32);

    impl Drop for SweepNamespacesOf {
        fn drop(&mut self) {
            for n in list_ns().unwrap_or_default() {
                if owner_pid(&n) == Some(self.0) {
                    let _ = delete_ns(&n);
                }
            }
        }
    }

    /// Re-runs this test binary inside host `i` as `role`, with `env` for its parameters.
    fn spawn_role(net: &EmulatedNet, i: usize, role: &str, env: &[(&str, String)]) -> ChildGuard {
        let exe = std::env::current_exe().expect("current_exe");
        let mut cmd = net.command(i, exe);
        cmd.args([
            "--exact",
            "netns::tests::tcp_role_helper",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(ROLE_ENV, role)
        .envs(env.iter().map(|(k, v)| (k, v)))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
        ChildGuard(Some(cmd.spawn().expect("spawn helper")))
    }

    fn result_line(out: &Output, tag: &str) -> Vec<f64> {
        let stdout = String::from_utf8_lossy(&out.stdout);
        let line = stdout
            .lines()
            .find_map(|l| l.split_once(tag).map(|(_, rest)| rest))
            .unwrap_or_else(|| {
                panic!(
                    "no {tag} line; status {} stdout: {stdout} stderr: {}",
                    out.status,
                    String::from_utf8_lossy(&out.stderr)
                )
            });
        line.split_whitespace()
            .map(|v| v.parse().expect("number"))
            .collect()
    }

    fn env(k: &str) -> String {
        std::env::var(k).unwrap_or_else(|_| panic!("{k} set by the parent test"))
    }

    fn env_ms(k: &str) -> Duration {
        Duration::from_millis(env(k).parse().expect("milliseconds"))
    }

    /// Not a test of its own (ignored, so it never counts as a pass): [`spawn_role`] runs it
    /// with `--ignored` inside a namespace, with [`ROLE_ENV`] naming the role it plays.
    ///
    /// * `recv`: accept `CONNS` connections on `ADDR`, wait `WARMUP_MS`, count bytes received
    ///   over `MEASURE_MS`, print `RESULT <total B/s> <per-connection B/s>...` and exit.
    /// * `send`: connect to `ADDR` (retrying while the receiver starts), print
    ///   `CONNECTED <connect µs>`, write until `DURATION_MS` is over or the peer goes away.
    #[test]
    #[ignore = "a child-process role of the netns tests, started by spawn_role"]
    fn tcp_role_helper() {
        let role = std::env::var(ROLE_ENV).expect("started by spawn_role with a role");
        let addr: SocketAddr = env("ADDR").parse().expect("ADDR");
        match role.as_str() {
            "recv" => {
                let conns: usize = env("CONNS").parse().expect("CONNS");
                let listener = TcpListener::bind(addr).expect("bind");
                listener.set_nonblocking(true).expect("nonblocking");
                let accept_deadline = Instant::now() + Duration::from_secs(15);
                let counters: Vec<Arc<AtomicU64>> =
                    (0..conns).map(|_| Arc::new(AtomicU64::new(0))).collect();
                for counter in &counters {
                    let stream = loop {
                        match listener.accept() {
                            Ok((s, _)) => break s,
                            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                                assert!(Instant::now() < accept_deadline, "no sender came");
                                std::thread::sleep(Duration::from_millis(5));
                            }
                            Err(e) => panic!("accept: {e}"),
                        }
                    };
                    let counter = Arc::clone(counter);
                    std::thread::spawn(move || {
                        let mut stream = stream;
                        stream.set_nonblocking(false).expect("blocking");
                        stream
                            .set_read_timeout(Some(Duration::from_secs(5)))
                            .expect("timeout");
                        let mut buf = vec![0u8; 256 << 10];
                        while let Ok(n @ 1..) = stream.read(&mut buf) {
                            counter.fetch_add(n as u64, Ordering::Relaxed);
                        }
                    });
                }
                std::thread::sleep(env_ms("WARMUP_MS"));
                let snap = |c: &[Arc<AtomicU64>]| -> Vec<u64> {
                    c.iter().map(|a| a.load(Ordering::Relaxed)).collect()
                };
                let (t0, c0) = (Instant::now(), snap(&counters));
                std::thread::sleep(env_ms("MEASURE_MS"));
                let (t1, c1) = (Instant::now(), snap(&counters));
                let secs = (t1 - t0).as_secs_f64();
                let per: Vec<f64> = c0
                    .iter()
                    .zip(&c1)
                    .map(|(a, b)| (b - a) as f64 / secs)
                    .collect();
                let total: f64 = per.iter().sum();
                let per: Vec<String> = per.iter().map(|r| format!("{r:.0}")).collect();
                println!("RESULT {total:.0} {}", per.join(" "));
                std::io::stdout().flush().expect("flush");
                // Readers are blocked in read(); end the process rather than join them.
                std::process::exit(0);
            }
            "send" => {
                let deadline = Instant::now() + env_ms("DURATION_MS");
                let (mut stream, took) = loop {
                    let start = Instant::now();
                    match TcpStream::connect_timeout(&addr, Duration::from_secs(2)) {
                        Ok(s) => break (s, start.elapsed()),
                        Err(e) => {
                            assert!(Instant::now() < deadline, "connect {addr}: {e}");
                            std::thread::sleep(Duration::from_millis(20));
                        }
                    }
                };
                println!("CONNECTED {}", took.as_micros());
                stream
                    .set_write_timeout(Some(Duration::from_secs(5)))
                    .expect("timeout");
                let buf = vec![0x5au8; 1 << 20];
                while Instant::now() < deadline {
                    if stream.write_all(&buf).is_err() {
                        break;
                    }
                }
            }
            other => panic!("unknown role {other}"),
        }
    }

    /// Runs `senders` (host indices) against a receiver in host `receiver` and returns
    /// (total bytes/s, per-sender bytes/s, connect times in µs).
    fn measure(net: &EmulatedNet, senders: &[usize], receiver: usize) -> (f64, Vec<f64>, Vec<f64>) {
        let addr = format!("{}:5201", net.host_ip(receiver));
        let (warmup, window) = (1500u64, 3000u64);
        let recv = spawn_role(
            net,
            receiver,
            "recv",
            &[
                ("ADDR", addr.clone()),
                ("CONNS", senders.len().to_string()),
                ("WARMUP_MS", warmup.to_string()),
                ("MEASURE_MS", window.to_string()),
            ],
        );
        let sends: Vec<ChildGuard> = senders
            .iter()
            .map(|&s| {
                spawn_role(
                    net,
                    s,
                    "send",
                    &[
                        ("ADDR", addr.clone()),
                        ("DURATION_MS", (warmup + window + 3000).to_string()),
                    ],
                )
            })
            .collect();
        let out = recv.wait_bounded(Duration::from_secs(30));
        assert!(out.status.success(), "receiver failed: {out:?}");
        let r = result_line(&out, "RESULT ");
        let connects = sends
            .into_iter()
            .map(|s| result_line(&s.wait_bounded(Duration::from_secs(30)), "CONNECTED ")[0])
            .collect();
        (r[0], r[1..].to_vec(), connects)
    }

    fn own_namespaces(net: &EmulatedNet) -> BTreeSet<String> {
        let tag = net.switch_ns_name().trim_end_matches("sw");
        list_ns()
            .expect("list")
            .into_iter()
            .filter(|n| n.starts_with(tag))
            .collect()
    }

    /// What the root namespace exposes: link names, addresses and routes.
    fn root_view() -> String {
        let links = ip(&["-o", "link", "show"]).expect("links");
        let names: Vec<&str> = links
            .lines()
            .filter_map(|l| l.split(':').nth(1))
            .map(str::trim)
            .collect();
        format!(
            "{names:?}\n{}\n{}",
            ip(&["-o", "addr", "show"]).expect("addrs"),
            ip(&["route", "show", "table", "all"]).expect("routes")
        )
    }

    #[test]
    fn bad_arguments_are_errors() {
        assert!(EmulatedNet::create(0, None, None).is_err());
        assert!(EmulatedNet::create(MAX_HOSTS + 1, None, None).is_err());
        assert!(EmulatedNet::create(2, Some(0), None).is_err());
        assert!(EmulatedNet::create(2, Some(u64::MAX), None).is_err());
    }

    #[test]
    fn tbf_parameters_scale_with_rate() {
        let args = tbf_args(125_000_000, Duration::ZERO);
        assert_eq!(
            args,
            [
                "rate",
                "1000000000bit",
                "burst",
                "250000",
                "limit",
                "2500000"
            ]
        );
        let slow = tbf_args(1_000, Duration::ZERO);
        assert_eq!(slow[3], (128 << 10).to_string());
        assert_eq!(slow[5], (4 * (128 << 10)).to_string());
        assert_eq!(owner_pid("shcbench-123-4-h0"), Some(123));
        assert_eq!(owner_pid("shcbench-x-4-h0"), None);
        assert_eq!(owner_pid("other-123"), None);
    }

    #[test]
    fn create_isolates_and_teardown_leaves_nothing() {
        if skip() {
            return;
        }
        let root_before = root_view();
        let mut net = EmulatedNet::create(3, None, None).expect("create");
        let expected: BTreeSet<String> = (0..3)
            .map(|i| net.ns_name(i).to_owned())
            .chain([net.switch_ns_name().to_owned()])
            .collect();
        assert_eq!(own_namespaces(&net), expected);
        assert_eq!(root_view(), root_before, "root namespace untouched");
        // Each host has lo up and exactly its address; the switch has no address at all.
        let addrs = ip(&["-n", net.ns_name(1), "-4", "-o", "addr", "show"]).expect("addrs");
        assert!(
            addrs.contains("lo") && addrs.contains("127.0.0.1"),
            "{addrs}"
        );
        assert!(
            addrs.contains("eth0") && addrs.contains("10.233.77.2/24"),
            "{addrs}"
        );
        let sw = ip(&["-n", net.switch_ns_name(), "-o", "addr", "show"]).expect("addrs");
        assert!(
            sw.lines().all(|l| l.starts_with("1: lo ")),
            "only the switch's loopback has addresses: {sw}"
        );
        let host = ip(&["-n", net.ns_name(0), "-o", "addr", "show", "dev", "eth0"]).expect("addrs");
        assert_eq!(
            host.lines().count(),
            1,
            "eth0 has only its IPv4 address: {host}"
        );
        // Hosts reach each other over the bridge (loopback inside a host works too).
        let guard = measure_lock();
        let (rate, _, _) = measure(&net, &[0], 2);
        assert!(rate > 10e6, "uncapped rate {rate}");
        drop(guard);
        net.teardown();
        net.teardown();
        assert!(own_namespaces(&net).is_empty());
        assert_eq!(root_view(), root_before);
    }

    fn assert_capped(cap: u64) {
        let _guard = measure_lock();
        let net = EmulatedNet::create(2, Some(cap), None).expect("create");
        let (rate, _, _) = measure(&net, &[0], 1);
        let ratio = rate / cap as f64;
        eprintln!(
            "shaping: cap {:.0} Mbit/s, TCP goodput {:.1} Mbit/s ({:.1}% of cap)",
            cap as f64 * 8e-6,
            rate * 8e-6,
            ratio * 100.0
        );
        // The cap must hold (never above it); how close TCP gets to it depends on what else
        // the machine runs, so that figure is printed and recorded in docs/BENCHMARKS.md,
        // and only a usable link (half the cap) is asserted.
        assert!((0.5..=1.05).contains(&ratio), "goodput {rate} vs cap {cap}");
        let mut net = net;
        net.teardown();
        assert!(own_namespaces(&net).is_empty());
    }

    #[test]
    fn shaping_reaches_200_mbit() {
        if skip() {
            return;
        }
        assert_capped(200_000_000 / 8);
    }

    #[test]
    fn shaping_reaches_1_gbit() {
        if skip() {
            return;
        }
        assert_capped(1_000_000_000 / 8);
    }

    #[test]
    fn two_senders_share_the_receivers_ingress_cap() {
        if skip() {
            return;
        }
        let cap = 400_000_000 / 8;
        let _guard = measure_lock();
        let net = EmulatedNet::create(3, Some(cap), None).expect("create");
        let (total, per, _) = measure(&net, &[0, 1], 2);
        eprintln!(
            "shaping: two senders into one {:.0} Mbit/s ingress: {:.1} Mbit/s total ({:.1} + {:.1})",
            cap as f64 * 8e-6,
            total * 8e-6,
            per[0] * 8e-6,
            per[1] * 8e-6
        );
        let ratio = total / cap as f64;
        assert!((0.90..=1.05).contains(&ratio), "total {total} vs cap {cap}");
        for r in per {
            assert!(r > 0.2 * cap as f64, "a sender starved: {r}");
        }
    }

    #[test]
    fn drop_counts_are_read_from_the_loss_rule() {
        let listing = "table bridge shardcast_loss_0 {\n\tchain forward {\n\t\ttype filter hook forward priority filter; policy accept;\n\t\tiifname \"p0\" ether type ip numgen random mod 10000 <= 99 counter packets 12 bytes 18000 drop\n\t}\n}\n";
        assert_eq!(parse_dropped(listing), 12);
        assert_eq!(parse_dropped("table bridge shardcast_loss_0 {\n}\n"), 0);
        assert_eq!(parse_dropped("counter packets x drop"), 0);
    }

    #[test]
    fn loss_drops_and_counts_what_a_host_sends_and_can_be_lifted() {
        if skip() {
            return;
        }
        if let Err(reason) = loss_available() {
            eprintln!("skipping: {reason}");
            return;
        }
        let net = EmulatedNet::create(2, None, None).expect("create");
        assert!(net.set_loss(0, 10_001).is_err());
        assert!(net.set_loss(5, 10).is_err());
        let to = net.host_ip(1);
        let send = |n: u32| {
            // bash's /dev/udp: one datagram per redirection, no other tool needed.
            let script = format!("for i in $(seq {n}); do echo x > /dev/udp/{to}/9; done");
            let out = net
                .command(0, "bash")
                .args(["-c", &script])
                .output()
                .expect("run bash in the namespace");
            assert!(out.status.success(), "{out:?}");
        };
        net.set_loss(0, 10_000).expect("all lost");
        send(40);
        assert_eq!(net.dropped(0).unwrap(), 40);
        assert_eq!(net.dropped(1).unwrap(), 0, "host 1 has no loss rule");
        net.set_loss(0, 5_000).expect("half lost");
        send(400);
        let half = net.dropped(0).unwrap();
        assert!((100..300).contains(&half), "{half} of 400 dropped at 50%");
        net.set_loss(0, 0).expect("lifted");
        assert_eq!(net.dropped(0).unwrap(), 0);
    }

    #[test]
    fn delay_is_added_or_refused_clearly() {
        if skip() {
            return;
        }
        let delay = Duration::from_millis(20);
        if let Err(reason) = netem_available() {
            let err = EmulatedNet::create(2, Some(1 << 20), Some(delay)).expect_err("no netem");
            let msg = format!("{err:#}");
            assert!(msg.contains("netem") && msg.contains("tc -n"), "{msg}");
            eprintln!("skipping delay measurement: {reason}");
            return;
        }
        let _guard = measure_lock();
        let net = EmulatedNet::create(2, Some(100_000_000 / 8), Some(delay)).expect("create");
        let (rate, _, connects) = measure(&net, &[0], 1);
        // connect() takes one round trip: 2 × delay.
        let rtt = connects[0] / 1e6;
        eprintln!(
            "delay: connect took {rtt:.3} s, rate {:.1} Mbit/s",
            rate * 8e-6
        );
        assert!((0.039..0.060).contains(&rtt), "connect {rtt} s");
        assert!(rate > 0.8 * 100e6 / 8.0, "rate {rate}");
    }

    #[test]
    fn cleanup_stale_removes_dead_runs_only() {
        if skip() {
            return;
        }
        // A PID that certainly belonged to a process that has exited.
        let mut dead = Command::new("true").spawn().expect("spawn true");
        let dead_pid = dead.id();
        dead.wait().expect("wait true");
        let stale = format!("{NS_PREFIX}{dead_pid}-0-sw");
        ip(&["netns", "add", &stale]).expect("add stale");
        let live = EmulatedNet::create(1, None, None).expect("create");
        let removed = EmulatedNet::cleanup_stale();
        let names = list_ns().expect("list");
        if names.contains(&stale) {
            let _ = delete_ns(&stale);
        }
        assert!(removed.expect("cleanup") >= 1);
        assert!(!names.contains(&stale), "stale namespace removed");
        assert!(names.iter().any(|n| n == live.ns_name(0)), "live net kept");
    }

    #[test]
    fn signal_tears_down_before_exit() {
        if skip() {
            return;
        }
        if std::env::var(ROLE_ENV).as_deref() == Ok("signal") {
            // Child: create a net, install the teardown, report, then wait to be signalled.
            let net = EmulatedNet::create(2, Some(1 << 20), None).expect("create");
            install_signal_teardown(|| eprintln!("before teardown")).expect("install");
            assert!(
                install_signal_teardown(|| ()).is_err(),
                "second install refused"
            );
            println!("READY {} {}", net.ns_name(0), net.switch_ns_name());
            std::io::stdout().flush().expect("flush");
            std::thread::sleep(Duration::from_secs(20));
            panic!("no signal came");
        }
        let exe = std::env::current_exe().expect("current_exe");
        let mut child = Command::new(exe)
            .args([
                "--exact",
                "netns::tests::signal_tears_down_before_exit",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(ROLE_ENV, "signal")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn");
        let pid = child.id();
        let mut stdout = child.stdout.take().expect("stdout");
        // Dropped after `guard` kills the child: removes what a failed run left behind.
        let _sweep = SweepNamespacesOf(pid);
        let guard = ChildGuard(Some(child));
        // Read until the READY line (bounded: the child panics after 20 s and closes stdout).
        let reader = std::thread::spawn(move || {
            let mut seen = String::new();
            let mut buf = [0u8; 512];
            while let Ok(n @ 1..) = stdout.read(&mut buf) {
                seen.push_str(&String::from_utf8_lossy(&buf[..n]));
                if seen
                    .find("READY ")
                    .is_some_and(|at| seen[at..].contains('\n'))
                {
                    break;
                }
            }
            seen
        });
        let seen = reader.join().expect("reader");
        let names: Vec<String> = seen
            .lines()
            .find_map(|l| l.split_once("READY ").map(|(_, rest)| rest))
            .unwrap_or_else(|| panic!("child never got ready: {seen}"))
            .split_whitespace()
            .map(str::to_owned)
            .collect();
        assert!(list_ns().expect("list").contains(&names[0]));
        run_checked("kill", &["-TERM", &pid.to_string()]).expect("signal child");
        let out = guard.wait_bounded(Duration::from_secs(30));
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(128 + libc::SIGTERM), "{stderr}");
        assert!(stderr.contains("before teardown"), "{stderr}");
        let after = list_ns().expect("list");
        for n in &names {
            assert!(!after.contains(n), "{n} deleted on signal");
        }
        assert!(
            !after.iter().any(|n| owner_pid(n) == Some(pid)),
            "nothing of the child left: {after:?}"
        );
    }
}
