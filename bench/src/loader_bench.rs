//! `shardcast-bench loader`: the GPU loader's stages alone and together.
//!
//! Each stage is timed on its own: the network (chunks verified at `--net-rate`), PCIe
//! (host → first GPU with every chunk already verified), NVLink (first GPU → second GPU,
//! peer copies). Then the streamed pipeline runs all three at once: chunks arrive at the
//! network rate while they are copied to the first GPU and peer-copied to the second.
//! `overlap_efficiency` = pipeline time / slowest stage time (1.0 = perfect overlap; the sum
//! of the stages would be the no-overlap case).
//!
//! On a CUDA machine (`--backend cuda`) the report also gives the pipeline's host → device
//! rate next to a plain pinned `cuMemcpyHtoD` peak measured in the same run.
//!
//! The model's shard files are written to a memory-backed directory (`/dev/shm` by default,
//! `--model-dir`) and mapped, which is what transferd's memory tier is, so by default the
//! loader takes its registered path (DMA straight from the mapped files); `--host-path
//! staging` forces the staging ring. The report says which path ran (and why, after a
//! fallback) and how long registering the mappings took.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, bail};
use gpu_loader::cuda::{self, CudaDevice, CudaOptions};
use gpu_loader::device::{Device, DeviceKind};
use gpu_loader::index::{Layout, LoadMap, tensor_index, tensor_ranges};
use gpu_loader::loader::{HostPath, LoadOptions, LoadProgress, LoadReport, Target, load, load_map};
use gpu_loader::mapped::MappedFile;
use gpu_loader::pool::GpuPool;
use gpu_loader::sim::{self, SimOptions};
use gpu_loader::source::PacedSource;
use serde::Serialize;

use crate::synth::{self, SynthSpec};

/// Options of `loader`.
#[derive(Debug, Clone)]
pub struct LoaderOpts {
    /// `simulated` or `cuda`.
    pub backend: String,
    /// Model bytes.
    pub size: u64,
    /// Safetensors shards.
    pub shards: usize,
    /// GPUs (the pipeline uses two when there are two: PCIe to the first, NVLink to the second).
    pub gpus: u32,
    /// Network (chunk arrival) rate, bytes/s.
    pub net_rate: u64,
    /// Simulated PCIe rate, bytes/s.
    pub pcie_rate: u64,
    /// Simulated NVLink rate, bytes/s.
    pub nvlink_rate: u64,
    /// Staging buffers.
    pub staging_buffers: usize,
    /// Bytes per staging buffer.
    pub staging_size: usize,
    /// Threads filling staging buffers.
    pub fill_threads: usize,
    /// Partitions for the partitioned-load measurement (0 or 1: skipped).
    pub partitions: u32,
    /// The host path to ask for: registered (falls back to staging if registration fails)
    /// or staging.
    pub host_path: HostPath,
    /// Copy streams per GPU on the registered path.
    pub copy_streams: usize,
    /// Bytes registered at a time on the registered path.
    pub register_segment: u64,
    /// Least bytes per copy on the registered path.
    pub copy_size: usize,
    /// Keep registrations between loads (as transferd does while a shard stays in the
    /// memory tier): the PCIe pass then reuses what its first pass registered.
    pub keep_registrations: bool,
    /// Register the mappings ahead of the first load (with the kept registrations) and time
    /// the pinning alone.
    pub register_ahead: bool,
    /// What the streamed pipeline does with its fresh mappings (the PCIe passes always
    /// register theirs, so the PCIe stage is the registered path's).
    pub fresh: gpu_loader::loader::FreshMappings,
    /// Where to write the model's shard files (memory-backed; `None`: `/dev/shm` when it
    /// exists, else the temp dir).
    pub model_dir: Option<PathBuf>,
}

/// A partitioned load with completion on one GPU, every chunk already in host memory
/// (Flashpoint's setting: the partition cuts the PCIe load).
#[derive(Debug, Clone, Serialize)]
pub struct PartitionFigures {
    /// Partitions the layer groups were cut into (equal bytes, in layer order).
    pub partitions: u32,
    /// The measured partition: the last one (the final layers, `post`).
    pub layer_groups: usize,
    /// Its bytes.
    pub partition_bytes: u64,
    /// Start → the partition on the GPU (`partition-live`), seconds.
    pub live_s: f64,
    /// Start → the full replica (model completion), seconds.
    pub complete_s: f64,
    /// live_s / complete_s (≈ partition bytes / model bytes when the order works).
    pub live_fraction: f64,
    /// Every byte of the completed region matched the source.
    pub verified: bool,
}

/// One stage timed alone.
#[derive(Debug, Clone, Serialize)]
pub struct Stage {
    /// `network`, `pcie` or `nvlink`.
    pub stage: String,
    /// Seconds.
    pub seconds: f64,
    /// Bytes per second.
    pub bytes_per_s: f64,
}

/// CUDA-only figures.
#[derive(Debug, Clone, Serialize)]
pub struct CudaFigures {
    /// Plain pinned `cuMemcpyHtoD`, best of 3, bytes/s.
    pub peak_htod_bps: f64,
    /// The pipeline's host → device rate (chunks all verified), bytes/s.
    pub pipeline_htod_bps: f64,
    /// pipeline / peak (target ≥ 0.9).
    pub ratio: f64,
    /// Host path of the PCIe pass the rate is of.
    pub host_path: HostPath,
    /// The first PCIe pass's rate (the first load of the mappings: registering them is
    /// included unless `--keep-registrations false` makes every load register), bytes/s.
    pub first_load_htod_bps: f64,
    /// first_load_htod_bps / peak.
    pub first_load_ratio: f64,
    /// Transfer-size calibration (Torpor's elbow) and write-combined vs portable pinned.
    pub calibration: cuda::Calibration,
}

/// The `loader` report.
#[derive(Debug, Clone, Serialize)]
pub struct LoaderReport {
    /// `simulated` or `cuda`: simulated figures are not GPU measurements.
    pub backend: String,
    /// Device names.
    pub devices: Vec<String>,
    /// Model bytes.
    pub bytes: u64,
    /// Staging buffers × size.
    pub staging: String,
    /// Where the model's shard files were (mapped read-only by the source).
    pub model_dir: String,
    /// Host path asked for (`--host-path`).
    pub host_path_requested: HostPath,
    /// Host path that ran in the PCIe pass (`registered` or `staging`).
    pub host_path: HostPath,
    /// Why staging ran instead of the registered path.
    pub fallback_reason: Option<String>,
    /// Seconds registering the mappings took in the PCIe pass (all pinner threads, mostly
    /// overlapped with the copies).
    pub register_s: f64,
    /// Seconds the PCIe pass's fillers waited for registrations (summed over fillers).
    pub waited_for_register_s: f64,
    /// Copy streams per GPU used in the PCIe pass.
    pub copy_streams: usize,
    /// The PCIe pass's loader report (the second load of the same mapped files: with
    /// kept registrations, nothing left to register).
    pub pcie_report: LoadReport,
    /// The first PCIe pass's loader report (warms the page cache and the allocator; on the
    /// registered path it registers the mappings, unless they were registered ahead).
    pub pcie_first_report: LoadReport,
    /// With `--register-ahead`: seconds registering every mapping took before the first
    /// load, with no copy running (pinning alone).
    pub register_ahead_s: Option<f64>,
    /// What the streamed pipeline did with its fresh mappings (`register` or `stage`; its
    /// report's `host_path` says which path ran).
    pub fresh: gpu_loader::loader::FreshMappings,
    /// The streamed pipeline's loader report.
    pub pipeline_report: LoadReport,
    /// Stages alone.
    pub stages: Vec<Stage>,
    /// The streamed pipeline (all stages at once), seconds.
    pub pipeline_s: f64,
    /// The slowest stage alone, seconds.
    pub bound_s: f64,
    /// The stages one after the other, seconds.
    pub sum_s: f64,
    /// pipeline_s / bound_s (target ≤ 1.10).
    pub overlap_efficiency: f64,
    /// Simulated only: bytes / the slowest configured rate (what the stages would take at
    /// exactly their configured rates), and pipeline_s over it.
    pub configured_bound_s: Option<f64>,
    /// pipeline_s / configured_bound_s.
    pub overlap_vs_configured: Option<f64>,
    /// Every byte on every GPU matched the source.
    pub verified: bool,
    /// CUDA only.
    pub cuda: Option<CudaFigures>,
    /// The partitioned load, when asked for.
    pub partition: Option<PartitionFigures>,
}

/// The model: shard files in a memory-backed directory, mapped.
struct Model {
    dir: tempfile::TempDir,
    /// (name, file) per shard, for sources.
    files: Vec<(String, PathBuf)>,
    /// (name, map) per shard, for checking what landed.
    maps: Vec<(String, Arc<MappedFile>)>,
}

fn model(opts: &LoaderOpts) -> anyhow::Result<Model> {
    let parent = match &opts.model_dir {
        Some(d) => d.clone(),
        None if Path::new("/dev/shm").is_dir() => PathBuf::from("/dev/shm"),
        None => std::env::temp_dir(),
    };
    let dir = tempfile::Builder::new()
        .prefix("shardcast-loader-model-")
        .tempdir_in(&parent)
        .with_context(|| format!("a model directory in {}", parent.display()))?;
    let m = synth::generate(
        dir.path(),
        &SynthSpec {
            total_bytes: opts.size,
            shards: opts.shards,
            seed: 3,
        },
    )
    .with_context(|| {
        format!(
            "writing the model into {} (too small? pick another with --model-dir)",
            parent.display()
        )
    })?;
    let files: Vec<(String, PathBuf)> = m
        .files
        .iter()
        .map(|(name, _)| (name.clone(), dir.path().join(name)))
        .collect();
    let maps = files
        .iter()
        .map(|(name, path)| {
            let map = MappedFile::open(path).with_context(|| format!("mapping {name}"))?;
            Ok((name.clone(), map))
        })
        .collect::<anyhow::Result<_>>()?;
    Ok(Model { dir, files, maps })
}

impl Model {
    fn source(&self, chunk: u32) -> anyhow::Result<Arc<PacedSource>> {
        PacedSource::from_files(self.files.clone(), chunk).context("mapping the model's files")
    }
}

struct Gpus {
    devices: Vec<Arc<dyn Device>>,
    pools: Vec<GpuPool>,
    cuda: Vec<Arc<CudaDevice>>,
    _dir: Option<tempfile::TempDir>,
}

fn open(opts: &LoaderOpts, region: u64) -> anyhow::Result<Gpus> {
    let (devices, cuda, dir): (Vec<Arc<dyn Device>>, Vec<Arc<CudaDevice>>, _) =
        match opts.backend.as_str() {
            "simulated" => {
                let dir = tempfile::Builder::new()
                    .prefix("shardcast-simgpu-")
                    .tempdir_in(if std::path::Path::new("/dev/shm").is_dir() {
                        "/dev/shm"
                    } else {
                        "/tmp"
                    })?;
                let mut o = SimOptions::new(dir.path(), opts.gpus, region * 2 + (64 << 20));
                o.pcie_bps = opts.pcie_rate;
                o.nvlink_bps = opts.nvlink_rate;
                let d = sim::devices(&o)?;
                (
                    d.into_iter().map(|d| d as Arc<dyn Device>).collect(),
                    Vec::new(),
                    Some(dir),
                )
            }
            "cuda" => {
                let d = cuda::devices(&CudaOptions::default())
                    .map_err(|e| anyhow::anyhow!("--backend cuda: {e}"))?;
                if d.is_empty() {
                    bail!("--backend cuda: the driver reports no GPUs");
                }
                let d: Vec<_> = d.into_iter().take(opts.gpus.max(1) as usize).collect();
                (
                    d.iter().map(|d| d.clone() as Arc<dyn Device>).collect(),
                    d,
                    None,
                )
            }
            other => bail!("--backend must be simulated or cuda, got {other:?}"),
        };
    // Budgets only: each run's region is allocated when its targets are made.
    let pools = devices
        .iter()
        .map(|d| GpuPool::new(d.clone(), region + (16 << 20)))
        .collect();
    Ok(Gpus {
        devices,
        pools,
        cuda,
        _dir: dir,
    })
}

fn targets(g: &mut Gpus, label: &str, n: usize, total: u64) -> anyhow::Result<Vec<Target>> {
    let mut out = Vec::new();
    for (d, p) in g.devices.iter().zip(g.pools.iter_mut()).take(n) {
        for r in p.regions() {
            p.evict(&r.model)?;
        }
        out.push(Target {
            device: d.clone(),
            span: p.reserve(label, total)?,
        });
    }
    Ok(out)
}

fn verify(
    targets: &[Target],
    layout: &Layout,
    data: &[(String, Arc<MappedFile>)],
) -> anyhow::Result<bool> {
    for t in targets {
        for (slot, (_, map)) in layout.shards.iter().zip(data) {
            let bytes = map.as_slice();
            let got = t
                .device
                .read(t.span.sub(slot.offset, bytes.len() as u64)?)?;
            if got != bytes {
                return Ok(false);
            }
        }
    }
    Ok(true)
}

/// Runs the loader benchmark.
pub fn run(opts: &LoaderOpts) -> anyhow::Result<LoaderReport> {
    // Before writing the model (gigabytes): a host without the driver fails at once.
    if opts.backend == "cuda" {
        cuda::driver_available().map_err(|e| anyhow::anyhow!("--backend cuda: {e}"))?;
    }
    let m = model(opts)?;
    let data = &m.maps;
    let bytes: u64 = data.iter().map(|d| d.1.as_slice().len() as u64).sum();
    let layout = Layout::new(
        &data
            .iter()
            .map(|(p, d)| (p.clone(), d.as_slice().len() as u64))
            .collect::<Vec<_>>(),
    );
    let mut g = open(opts, layout.total)?;
    let two = g.devices.len() >= 2;
    let lopts = LoadOptions {
        staging_buffers: opts.staging_buffers,
        staging_size: opts.staging_size,
        fill_threads: opts.fill_threads,
        register_host: opts.host_path == HostPath::Registered,
        copy_streams: opts.copy_streams,
        register_segment: opts.register_segment,
        copy_size: opts.copy_size,
        registrations: opts
            .keep_registrations
            .then(gpu_loader::loader::RegistrationCache::new),
        ..LoadOptions::default()
    };
    let chunk = 1 << 20;
    let mut stages = Vec::new();
    let stage = |name: &str, s: f64| Stage {
        stage: name.into(),
        seconds: s,
        bytes_per_s: bytes as f64 / s.max(1e-9),
    };

    // Network alone.
    let src = m.source(chunk)?;
    let net_s = src
        .deliver(opts.net_rate, None)
        .join()
        .map_err(|_| anyhow::anyhow!("network pacer panicked"))?;
    stages.push(stage("network", net_s));
    eprintln!("network alone: {net_s:.3} s");

    // PCIe alone: every chunk already verified, one GPU. The first pass warms the host's
    // allocator and page cache (this VM pays heavily for first-touch pages) and, on the
    // registered path, registers the mappings (kept for the second pass, as transferd keeps
    // them while the shards stay in the memory tier); it is reported on its own.
    let src = m.source(chunk)?;
    src.deliver(0, None)
        .join()
        .map_err(|_| anyhow::anyhow!("pacer panicked"))?;
    let register_ahead_s = if opts.register_ahead {
        let cache = lopts
            .registrations
            .as_ref()
            .context("--register-ahead needs kept registrations (--keep-registrations true)")?;
        anyhow::ensure!(
            lopts.register_host,
            "--register-ahead needs the registered path (--host-path registered)"
        );
        let dev = g.devices.first().context("no device")?.clone();
        let t0 = Instant::now();
        let never = || false;
        // The source's own mappings: registrations are kept per mapping.
        use gpu_loader::loader::ChunkSource;
        for (i, shard) in src.shards().iter().enumerate() {
            let path = &shard.path;
            let mem = src.host_memory(i).context("an unmapped shard")?;
            cache
                .register_ahead(&mem, opts.register_segment, &*dev, &never)
                .with_context(|| format!("registering {path} ahead"))?;
        }
        let s = t0.elapsed().as_secs_f64();
        eprintln!(
            "registered ahead: {s:.3} s ({:.1} GB/s pinning alone)",
            bytes as f64 / s / 1e9
        );
        Some(s)
    } else {
        None
    };
    let mut reps = Vec::new();
    for pass in ["first", "pcie"] {
        let t = targets(&mut g, pass, 1, layout.total)?;
        let p = LoadProgress::new(bytes, &[t[0].device.info().index]);
        reps.push(load(&*src, &layout, &t, &lopts, &p)?);
    }
    let pcie_rep = reps.pop().context("no PCIe pass ran")?;
    let first_rep = reps.pop().context("no first PCIe pass ran")?;
    eprintln!(
        "pcie, first load of the mapping: {:.3} s, host path {} (registering {:.3} s)",
        first_rep.elapsed_s, first_rep.host_path, first_rep.register_s
    );
    stages.push(stage("pcie", pcie_rep.elapsed_s));
    eprintln!(
        "pcie alone: {:.3} s, host path {} (registering {:.3} s, waited for it {:.3} s, {} copy streams, {}){}",
        pcie_rep.elapsed_s,
        pcie_rep.host_path,
        pcie_rep.register_s,
        pcie_rep.waited_for_register_s,
        pcie_rep.copy_streams,
        match (pcie_rep.numa_node, &pcie_rep.numa_reason) {
            (Some(n), _) => format!("fillers and staging on NUMA node {n}"),
            (None, Some(why)) => format!("not placed on a NUMA node: {why}"),
            (None, None) => "not placed on a NUMA node".into(),
        },
        pcie_rep
            .fallback_reason
            .as_deref()
            .map(|r| format!(", fell back: {r}"))
            .unwrap_or_default()
    );
    let pcie_bps = bytes as f64 / pcie_rep.elapsed_s;

    // NVLink alone: the region of GPU 0 peer-copied to GPU 1 in staging-sized pieces.
    if two {
        let t = targets(&mut g, "nvlink", 2, layout.total)?;
        let piece = opts.staging_size as u64;
        let t0 = Instant::now();
        let mut waits = Vec::new();
        let mut off = 0;
        while off < layout.total {
            let len = piece.min(layout.total - off);
            waits.push(t[1].device.copy_peer(
                t[1].span.sub(off, len)?,
                &*t[0].device,
                t[0].span.sub(off, len)?,
            )?);
            off += len;
        }
        for w in waits {
            w.wait()?;
        }
        let s = t0.elapsed().as_secs_f64() * bytes as f64 / layout.total as f64;
        stages.push(stage("nvlink", s));
        eprintln!("nvlink alone: {s:.3} s");
    }

    // Everything at once.
    let n = if two { 2 } else { 1 };
    let t = targets(&mut g, "pipeline", n, layout.total)?;
    let src = m.source(chunk)?;
    let gpus: Vec<u32> = t.iter().map(|t| t.device.info().index).collect();
    let p = LoadProgress::new(bytes, &gpus);
    let t0 = Instant::now();
    let pacer = src.deliver(opts.net_rate, None);
    let streamed = LoadOptions {
        fresh: opts.fresh,
        ..lopts.clone()
    };
    let rep = load(&*src, &layout, &t, &streamed, &p)?;
    let pipeline_s = t0.elapsed().as_secs_f64();
    let _ = pacer.join();
    eprintln!("pipeline: {pipeline_s:.3} s ({rep:?})");
    let verified = verify(&t, &layout, data)?;

    let partition = if opts.partitions > 1 {
        Some(partitioned(&mut g, &m, &layout, &lopts, opts.partitions)?)
    } else {
        None
    };

    let bound_s = stages.iter().map(|s| s.seconds).fold(0.0, f64::max);
    let sum_s = stages.iter().map(|s| s.seconds).sum();
    let configured = g.cuda.is_empty().then(|| {
        let slowest = if two {
            opts.net_rate.min(opts.pcie_rate).min(opts.nvlink_rate)
        } else {
            opts.net_rate.min(opts.pcie_rate)
        };
        bytes as f64 / slowest.max(1) as f64
    });
    let cuda = match g.cuda.first() {
        Some(dev) => {
            let peak = cuda::peak_htod(dev, opts.staging_size.max(64 << 20), 3)?;
            let calibration = cuda::calibrate(dev, &cuda::default_sizes(), 256 << 20)?;
            Some(CudaFigures {
                peak_htod_bps: peak,
                pipeline_htod_bps: pcie_bps,
                ratio: pcie_bps / peak,
                host_path: pcie_rep.host_path,
                first_load_htod_bps: bytes as f64 / first_rep.elapsed_s,
                first_load_ratio: bytes as f64 / first_rep.elapsed_s / peak,
                calibration,
            })
        }
        None => None,
    };
    Ok(LoaderReport {
        backend: match g.devices.first().map(|d| d.info().kind) {
            Some(DeviceKind::Cuda) => "cuda".into(),
            _ => "simulated".into(),
        },
        devices: g.devices.iter().map(|d| d.info().name.clone()).collect(),
        bytes,
        staging: format!(
            "{} × {} B, {} fill threads; registered path: copies of at least {} B",
            opts.staging_buffers,
            opts.staging_size,
            opts.fill_threads,
            opts.copy_size.max(opts.staging_size)
        ),
        model_dir: m.dir.path().display().to_string(),
        host_path_requested: opts.host_path,
        host_path: pcie_rep.host_path,
        fallback_reason: pcie_rep.fallback_reason.clone(),
        register_s: pcie_rep.register_s,
        waited_for_register_s: pcie_rep.waited_for_register_s,
        copy_streams: pcie_rep.copy_streams,
        stages,
        pipeline_s,
        bound_s,
        sum_s,
        overlap_efficiency: pipeline_s / bound_s.max(1e-9),
        configured_bound_s: configured,
        overlap_vs_configured: configured.map(|b| pipeline_s / b),
        verified,
        cuda,
        partition,
        pcie_report: pcie_rep,
        pcie_first_report: first_rep,
        register_ahead_s,
        fresh: opts.fresh,
        pipeline_report: rep,
    })
}

/// Cuts the model's layer groups into `p` parts of about equal bytes (in layer order) and
/// loads the last part first, then the rest, onto one GPU.
fn partitioned(
    g: &mut Gpus,
    m: &Model,
    layout: &Layout,
    lopts: &LoadOptions,
    p: u32,
) -> anyhow::Result<PartitionFigures> {
    use shardcast_policies::profile::{Bandwidths, group_of, profile_from_tensors};
    let data = &m.maps;
    let index = tensor_index(layout, |i, off, len| {
        Ok(data[i].1.as_slice()[off as usize..off as usize + len].to_vec())
    })?;
    let tensors: Vec<(String, u64)> = index.iter().map(|t| (t.name.clone(), t.nbytes)).collect();
    let profile = profile_from_tensors("bench", &tensors, &Bandwidths::default());
    let total: u64 = profile.groups.iter().map(|g| g.weight_bytes).sum();
    let share = total.div_ceil(u64::from(p));
    // The groups of the last part: from the end, until a share of the bytes.
    let mut part = Vec::new();
    let mut got = 0u64;
    for grp in profile.groups.iter().rev() {
        if got >= share {
            break;
        }
        got += grp.weight_bytes;
        part.push(grp.name.clone());
    }
    let ranges = tensor_ranges(layout, &index, |n| part.contains(&group_of(n)));
    let map = LoadMap::partition(layout, &ranges, true);
    let src = m.source(1 << 20)?;
    src.deliver(0, None)
        .join()
        .map_err(|_| anyhow::anyhow!("pacer panicked"))?;
    let t = targets(g, "partition", 1, layout.total)?;
    let prog = LoadProgress::with_first(map.bytes, map.first_bytes, &[t[0].device.info().index]);
    let rep = load_map(&*src, layout, &map, &t, lopts, &prog)?;
    eprintln!(
        "partition {p}/{p} ({} groups, {} B): live {:.3} s, complete {:.3} s",
        part.len(),
        map.first_bytes,
        rep.first_s,
        rep.elapsed_s
    );
    Ok(PartitionFigures {
        partitions: p,
        layer_groups: part.len(),
        partition_bytes: map.first_bytes,
        live_s: rep.first_s,
        complete_s: rep.elapsed_s,
        live_fraction: rep.first_s / rep.elapsed_s.max(1e-9),
        verified: verify(&t, layout, data)?,
    })
}
