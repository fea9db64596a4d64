//! transferd with GPUs: streamed loading onto simulated GPUs while a chain is still
//! delivering, byte-exact regions, the hand-off opened by the Python example, and a host
//! without a CUDA driver that keeps working.

use std::time::{Duration, Instant};

use shardcast_bench::cluster::{Daemon, DaemonOpts};
use shardcast_bench::synth::{self, SynthSpec};
use shardcast_protocol::Manifest;
use shardcast_protocol::agent::{
    Chain, GetHandoffRequest, GetModelStatusRequest, GpuStatusRequest, ImportModelRequest,
    LoadModelRequest, PartitionSpec, StartChainRequest, Tier,
};
use shardcast_protocol::codec::{decode_exact, encode_to_vec};

/// A synthetic safetensors model in a scratch directory, and its `file://` URI.
fn synthetic_origin(total_bytes: u64, shards: usize, seed: u64) -> (tempfile::TempDir, String) {
    let origin = shardcast_tests::origin_dir();
    synth::generate(
        origin.path(),
        &SynthSpec {
            total_bytes,
            shards,
            seed,
        },
    )
    .unwrap();
    let uri = format!("file://{}", origin.path().display());
    (origin, uri)
}

/// The agent's `GpuStatus`.
async fn gpu_status(
    agent: &mut shardcast_protocol::agent::agent_client::AgentClient<tonic::transport::Channel>,
) -> shardcast_protocol::agent::GpuStatusResponse {
    agent
        .gpu_status(GpuStatusRequest {})
        .await
        .unwrap()
        .into_inner()
}

async fn daemon(root: &std::path::Path, name: &str, extra: &[&str]) -> Daemon {
    let mut o = DaemonOpts::local(name);
    o.extra_args.extend(shardcast_tests::allow_args(&[]));
    let mut rest = extra.iter();
    while let Some(a) = rest.next() {
        if *a == "--egress-rate" {
            o.egress_rate = rest.next().unwrap().to_string();
        } else {
            o.extra_args.push(a.to_string());
        }
    }
    Daemon::start(&root.join(name), o).await.unwrap()
}

async fn import(d: &Daemon, origin: &str, fetch: bool, manifest: Vec<u8>) -> (String, Manifest) {
    let r = d
        .agent()
        .await
        .unwrap()
        .import_model(ImportModelRequest {
            name: "test/gpu-model".into(),
            origin: origin.into(),
            chunk_size: 256 << 10,
            tier: Tier::Memory as i32,
            fetch,
            keep: false,
            manifest,
            bind_name: None,
        })
        .await
        .unwrap()
        .into_inner();
    (r.digest, decode_exact(r.manifest.into()).unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn simulated_gpus_load_while_the_chain_delivers_and_hand_off() {
    let (origin, uri) = synthetic_origin(24 << 20, 2, 5);
    let root = tempfile::tempdir().unwrap();
    // 24 MiB at 8 MB/s: about 3 s of delivery for the load to overlap, even on a busy
    // machine where each status call takes a while.
    let source = daemon(root.path(), "source", &["--egress-rate", "8MB/s"]).await;
    let gpu = daemon(
        root.path(),
        "gpu-host",
        &[
            "--gpu-backend",
            "simulated",
            "--sim-gpus",
            "2",
            "--sim-gpu-memory",
            "256MiB",
            "--sim-pcie-rate",
            "400MB/s",
            "--sim-nvlink-rate",
            "1GB/s",
        ],
    )
    .await;
    let (digest, manifest) = import(&source, &uri, true, vec![]).await;
    // The GPU host learns the manifest, then the chain starts and the load with it.
    import(&gpu, &uri, false, encode_to_vec(&manifest)).await;
    let mut agent = gpu.agent().await.unwrap();
    let st = gpu_status(&mut agent).await;
    assert_eq!(st.devices.len(), 2, "{st:?}");
    assert!(
        st.devices
            .iter()
            .all(|d| d.kind == "simulated" && d.name.starts_with("simulated"))
    );
    assert!(st.note.contains("SIMULATED"), "{}", st.note);
    let mut req = StartChainRequest {
        session_id: String::new(),
        model: digest.clone(),
        manifest: vec![],
        origin: uri.clone(),
        tier: Tier::Memory as i32,
        chains: vec![Chain {
            shards: vec![],
            hops: vec![gpu.hop()],
        }],
        plan_token: Vec::new(),
        ..Default::default()
    };
    source.sign_chain(&mut req, &[]).unwrap();
    source
        .agent()
        .await
        .unwrap()
        .start_chain(req)
        .await
        .unwrap();
    let t0 = Instant::now();
    let loaded = agent
        .load_model(whole_load(&digest, 2))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(loaded.gpus.len(), 2);
    // While the chain is running, bytes already land on the GPUs.
    let mut saw_partial = false;
    // What each poll saw, for the message if no overlap was seen.
    let mut seen = Vec::new();
    let resident = loop {
        let st = gpu_status(&mut agent).await;
        let m = st
            .models
            .iter()
            .find(|m| m.model == digest)
            .unwrap()
            .clone();
        if m.state == "resident" {
            break m;
        }
        assert_ne!(m.state, "failed", "{m:?}");
        if m.gpus.iter().any(|g| g.bytes > 0 && g.bytes < g.total) {
            saw_partial = true;
        }
        let bytes: Vec<u64> = m.gpus.iter().map(|g| g.bytes).collect();
        seen.push((t0.elapsed().as_millis(), m.state.clone(), bytes));
        assert!(t0.elapsed() < Duration::from_secs(60), "{m:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert!(
        saw_partial,
        "the load did not overlap the transfer; polls (ms, state, bytes per GPU): {seen:?}"
    );
    assert!(
        resident
            .gpus
            .iter()
            .all(|g| g.bytes == g.total && g.device_kind == "simulated")
    );

    // The hand-off: each GPU's region holds every shard byte for byte.
    let h = agent
        .get_handoff(GetHandoffRequest {
            model: digest.clone(),
        })
        .await
        .unwrap()
        .into_inner();
    let h: serde_json::Value = serde_json::from_str(&h.json).unwrap();
    assert_eq!(h["kind"], "simulated");
    assert!(!h["tensors"].as_array().unwrap().is_empty());
    for dev in h["devices"].as_array().unwrap() {
        let path = dev["handle"]["path"].as_str().unwrap();
        let base = dev["handle"]["offset"].as_u64().unwrap();
        let gpu_mem = std::fs::read(path).unwrap();
        for s in h["shards"].as_array().unwrap() {
            let want = std::fs::read(origin.path().join(s["path"].as_str().unwrap())).unwrap();
            let at = (base + s["offset"].as_u64().unwrap()) as usize;
            assert!(
                gpu_mem[at..at + want.len()] == want[..],
                "{} on {path}",
                s["path"]
            );
        }
    }
    // The Python example opens the hand-off through the admin endpoint and checks tensors.
    if std::process::Command::new("python3")
        .arg("--version")
        .output()
        .is_ok()
    {
        python_handoff_check(&gpu, "test/gpu-model").await;
    } else {
        eprintln!("SKIPPED: the Python hand-off check: python3 is not installed");
    }
    // Loading again is a no-op (already resident on the same GPUs).
    let again = agent
        .load_model(whole_load(&digest, 2))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(again.gpus, loaded.gpus);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_model_in_the_memory_tier_is_registered_ahead_so_its_first_gpu_load_pins_nothing() {
    let (_origin, uri) = synthetic_origin(12 << 20, 2, 13);
    let root = tempfile::tempdir().unwrap();
    let sim = ["--gpu-backend", "simulated", "--sim-gpus", "1"];
    let d = daemon(root.path(), "ahead", &sim).await;
    let mut agent = d.agent().await.unwrap();
    let (digest, manifest) = import(&d, &uri, true, vec![]).await;
    d.verify_copy(&manifest).unwrap();
    let size: u64 = manifest.shards.iter().map(|s| s.size).sum();
    // Registered within one sweep period (5 s) of landing, with no load asked for.
    let t0 = Instant::now();
    loop {
        let st = gpu_status(&mut agent).await;
        assert_eq!(st.register_ahead, "on");
        if st.registered_host_bytes == size {
            break;
        }
        assert!(st.registered_host_bytes < size, "{st:?}");
        assert!(t0.elapsed() < Duration::from_secs(20), "{st:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let metrics = d.metrics().await.unwrap();
    assert!(
        metrics.contains(&format!(
            "shardcast_gpu_registered_host_bytes{{host=\"ahead\"}} {size}\n"
        )),
        "{metrics}"
    );
    // The first load copies from those registrations: every segment was pinned already.
    agent.load_model(whole_load(&digest, 1)).await.unwrap();
    let (m, _) = until_resident(&d, &digest).await;
    assert_eq!(m.host_path, "registered", "{m:?}");
    assert!(m.segments > 0 && m.segments_reused == m.segments, "{m:?}");

    // Off: nothing is registered before a load, which then pins every segment itself.
    let mut args = sim.to_vec();
    args.extend(["--register-ahead", "false"]);
    let off = daemon(root.path(), "no-ahead", &args).await;
    let (digest, manifest) = import(&off, &uri, true, vec![]).await;
    off.verify_copy(&manifest).unwrap();
    let mut agent = off.agent().await.unwrap();
    let st = gpu_status(&mut agent).await;
    assert_eq!(
        (st.register_ahead.as_str(), st.registered_host_bytes),
        ("off", 0)
    );
    agent.load_model(whole_load(&digest, 1)).await.unwrap();
    let (m, _) = until_resident(&off, &digest).await;
    assert_eq!(m.host_path, "registered", "{m:?}");
    assert!(m.segments > 0 && m.segments_reused == 0, "{m:?}");

    // Fresh shards staged (what `auto` picks with register-ahead on; here with it off, so
    // nothing registers them before the load): the load stages, pins nothing, says why.
    let mut args = sim.to_vec();
    args.extend(["--register-ahead", "false", "--fresh-mappings", "stage"]);
    let staged = daemon(root.path(), "stage-fresh", &args).await;
    let (digest, manifest) = import(&staged, &uri, true, vec![]).await;
    staged.verify_copy(&manifest).unwrap();
    let mut agent = staged.agent().await.unwrap();
    agent.load_model(whole_load(&digest, 1)).await.unwrap();
    let (m, _) = until_resident(&staged, &digest).await;
    assert_eq!(m.host_path, "staging", "{m:?}");
    assert!(
        m.host_path_reason
            .contains("not registered yet (fresh = stage)"),
        "{m:?}"
    );
    assert_eq!(gpu_status(&mut agent).await.registered_host_bytes, 0);
}

/// A shard's destination is registered with the GPUs as its session starts (issue #28):
/// a receiver with register-ahead on (a simulated GPU) and its ingress capped holds every
/// byte of the model registered while its copy is still far from complete, written into
/// spares of its memory reserve; once complete, its first load copies from those
/// registrations without pinning anything.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shard_being_received_is_registered_with_the_gpus_as_its_session_starts() {
    const MIB: u64 = 1 << 20;
    let c = shardcast_tests::TestCluster::start(1, 12 * MIB, 2, |i, o| {
        if i == 1 {
            o.sim_gpus(1, "1GiB");
            // 12 MiB at 24 Mbit/s: about 4 s.
            o.ingress_rate = "24Mbit".into();
            o.extra_args.extend([
                "--memory-reserve".into(),
                (16 * MIB).to_string(),
                "--memory-reserve-spare".into(),
                (8 * MIB).to_string(),
            ]);
        }
    })
    .await
    .unwrap();
    let r = &c.daemons[1];
    let mut agent = r.agent().await.unwrap();
    shardcast_tests::wait_stats(r, Duration::from_secs(30), |st| {
        st.memory_reserve_bytes >= 16 * MIB
    })
    .await;
    let (digest, manifest) = c.import_on_source().await.unwrap();
    let size = manifest.total_bytes();
    c.start_chain(0, &digest, &[1], &c.origin_uri)
        .await
        .unwrap();
    let t0 = Instant::now();
    let verified_when_registered = loop {
        let st = gpu_status(&mut agent).await;
        assert_eq!(st.register_ahead, "on");
        if st.registered_host_bytes == size {
            break r.model_progress(&mut agent, &digest).await.unwrap();
        }
        assert!(t0.elapsed() < Duration::from_secs(30), "{st:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert!(
        !verified_when_registered.1 && verified_when_registered.0 < size / 2,
        "registered only after {verified_when_registered:?} of {size} bytes"
    );
    c.wait(&[1], &digest, Duration::from_secs(60))
        .await
        .unwrap();
    r.verify_copy(&manifest).unwrap();
    assert!(r.stats().await.unwrap().memory_reserve_taken_bytes > 0);
    agent.load_model(whole_load(&digest, 1)).await.unwrap();
    let (m, _) = until_resident(r, &digest).await;
    assert_eq!(m.host_path, "registered", "{m:?}");
    assert!(m.segments > 0 && m.segments_reused == m.segments, "{m:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_cuda_driver_the_daemon_keeps_working() {
    if gpu_loader_driver_present() {
        eprintln!("SKIPPED: this host has a CUDA driver");
        return;
    }
    let (_origin, uri) = synthetic_origin(2 << 20, 1, 9);
    let root = tempfile::tempdir().unwrap();
    let d = daemon(root.path(), "cuda-host", &["--gpu-backend", "cuda"]).await;
    let mut agent = d.agent().await.unwrap();
    let st = gpu_status(&mut agent).await;
    assert!(st.devices.is_empty());
    assert!(st.note.contains("no CUDA driver"), "{}", st.note);
    let (digest, manifest) = import(&d, &uri, true, vec![]).await;
    d.verify_copy(&manifest).unwrap();
    let e = agent.load_model(whole_load(&digest, 1)).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::FailedPrecondition, "{e:?}");
    assert!(e.message().contains("no GPUs"), "{e:?}");
    // The hand-off falls back to the memory-tier files.
    let h = agent
        .get_handoff(GetHandoffRequest { model: digest })
        .await
        .unwrap()
        .into_inner();
    let h: serde_json::Value = serde_json::from_str(&h.json).unwrap();
    assert_eq!(h["kind"], "memory-file");
}

const SIM_GPU: [&str; 10] = [
    "--gpu-backend",
    "simulated",
    "--sim-gpus",
    "2",
    "--sim-gpu-memory",
    "256MiB",
    "--sim-pcie-rate",
    "200MB/s",
    "--sim-nvlink-rate",
    "1GB/s",
];

/// Polls `host` until `digest` is resident (or fails), noting whether the partition was seen
/// live before the whole model was there.
async fn until_resident(d: &Daemon, digest: &str) -> (shardcast_protocol::agent::GpuModel, bool) {
    let mut agent = d.agent().await.unwrap();
    let t0 = Instant::now();
    let mut saw_live = false;
    loop {
        let st = gpu_status(&mut agent).await;
        let m = st
            .models
            .iter()
            .find(|m| m.model == digest)
            .unwrap()
            .clone();
        assert_ne!(m.state, "failed", "{m:?}");
        if m.state == "partition-live" {
            saw_live = true;
        }
        if m.state == "resident" {
            return (m, saw_live);
        }
        assert!(t0.elapsed() < Duration::from_secs(60), "{m:?}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Bytes of the memory tier's verified chunks of `digest` on `d`.
async fn verified_bytes(d: &Daemon, digest: &str, chunk: u64) -> u64 {
    let st = d
        .agent()
        .await
        .unwrap()
        .get_model_status(GetModelStatusRequest {
            model: digest.into(),
        })
        .await
        .unwrap()
        .into_inner();
    st.tiers
        .iter()
        .flat_map(|t| t.shards.iter())
        .map(|s| (u64::from(s.verified) * chunk).min(s.size))
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn partitions_load_from_a_peer_first_then_complete_to_full_replicas() {
    let (origin, uri) = synthetic_origin(24 << 20, 2, 11);
    let root = tempfile::tempdir().unwrap();
    let holder = daemon(root.path(), "holder", &["--egress-rate", "64MB/s"]).await;
    let (digest, manifest) = import(&holder, &uri, true, vec![]).await;
    let encoded = encode_to_vec(&manifest);
    let chunk = u64::from(manifest.chunk_size);
    let hosts = [
        daemon(root.path(), "gpu-a", &SIM_GPU).await,
        daemon(root.path(), "gpu-b", &SIM_GPU).await,
        daemon(root.path(), "gpu-c", &SIM_GPU).await,
    ];
    for h in &hosts {
        import(h, &uri, false, encoded.clone()).await;
    }
    let source = format!("shardcast://{}", holder.data_addr);
    // Layer groups as `shardcast plan` names them; the synthetic model is Llama-shaped.
    let layers = layer_groups(origin.path(), &manifest);
    assert!(layers.len() >= 8, "{layers:?}");
    let half = layers.len() / 2;
    let groups = [
        std::iter::once("pre".to_string())
            .chain(layers[..half].iter().cloned())
            .collect::<Vec<_>>(),
        layers[half..]
            .iter()
            .cloned()
            .chain(std::iter::once("post".to_string()))
            .collect::<Vec<_>>(),
    ];
    // Unknown layer groups are refused up front, and nothing is loaded.
    let e = hosts[0]
        .agent()
        .await
        .unwrap()
        .load_model(LoadModelRequest {
            heaviness: String::new(),
            model: digest.clone(),
            count: 1,
            gpus: vec![],
            partition: Some(PartitionSpec {
                groups: vec!["model.layers.999".into()],
                complete: true,
                source: source.clone(),
                label: String::new(),
            }),
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
    assert!(e.message().contains("model.layers.999"), "{e:?}");

    // Hosts a and b each load one half first, from the holder, then complete.
    for (h, (g, label)) in hosts.iter().zip(groups.iter().zip(["1/2", "2/2"])) {
        let r = h
            .agent()
            .await
            .unwrap()
            .load_model(LoadModelRequest {
                heaviness: String::new(),
                model: digest.clone(),
                count: 2,
                gpus: vec![],
                partition: Some(PartitionSpec {
                    groups: g.clone(),
                    complete: true,
                    source: source.clone(),
                    label: label.into(),
                }),
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(r.gpus.len(), 2);
    }
    // Host c loads the second half only (no completion): its data plane fetches only
    // the headers and that partition's chunks.
    hosts[2]
        .agent()
        .await
        .unwrap()
        .load_model(LoadModelRequest {
            heaviness: String::new(),
            model: digest.clone(),
            count: 1,
            gpus: vec![],
            partition: Some(PartitionSpec {
                groups: groups[1].clone(),
                complete: false,
                source: source.clone(),
                label: "2/2 only".into(),
            }),
        })
        .await
        .unwrap();

    for h in &hosts[..2] {
        let (m, _) = until_resident(h, &digest).await;
        let live = m.partition_live_s.expect("the partition went live");
        assert!(live < m.elapsed_s, "{m:?}");
        assert!(m.partition_complete && m.partition_bytes < manifest.total_bytes());
        assert!(m.gpus.iter().all(|g| g.bytes == g.total));
        // Completed: a full replica in the store and on every GPU, byte for byte.
        h.verify_copy(&manifest).unwrap();
        let hd = h
            .agent()
            .await
            .unwrap()
            .get_handoff(GetHandoffRequest {
                model: digest.clone(),
            })
            .await
            .unwrap()
            .into_inner();
        let hd: serde_json::Value = serde_json::from_str(&hd.json).unwrap();
        assert!(hd.get("partition").is_none(), "completed: {hd}");
        for dev in hd["devices"].as_array().unwrap() {
            let mem = std::fs::read(dev["handle"]["path"].as_str().unwrap()).unwrap();
            let base = dev["handle"]["offset"].as_u64().unwrap();
            for s in hd["shards"].as_array().unwrap() {
                let want = std::fs::read(origin.path().join(s["path"].as_str().unwrap())).unwrap();
                let at = (base + s["offset"].as_u64().unwrap()) as usize;
                assert!(mem[at..at + want.len()] == want[..], "{}", s["path"]);
            }
        }
    }
    let (m, _) = until_resident(&hosts[2], &digest).await;
    assert!(!m.partition_complete);
    let fetched = verified_bytes(&hosts[2], &digest, chunk).await;
    assert!(
        fetched < manifest.total_bytes() * 3 / 4,
        "a partition-only host fetched {fetched} of {} bytes",
        manifest.total_bytes()
    );
    // Its hand-off lists exactly the partition's tensors, each byte-exact in the packed
    // region.
    let hd = hosts[2]
        .agent()
        .await
        .unwrap()
        .get_handoff(GetHandoffRequest {
            model: digest.clone(),
        })
        .await
        .unwrap()
        .into_inner();
    let hd: serde_json::Value = serde_json::from_str(&hd.json).unwrap();
    assert_eq!(hd["partition"], "2/2 only");
    let tensors = hd["tensors"].as_array().unwrap();
    assert!(!tensors.is_empty());
    let dev = &hd["devices"][0];
    let mem = std::fs::read(dev["handle"]["path"].as_str().unwrap()).unwrap();
    let base = dev["handle"]["offset"].as_u64().unwrap() as usize;
    for t in tensors {
        let name = t["name"].as_str().unwrap();
        let g = shardcast_policies::profile::group_of(name);
        assert!(groups[1].contains(&g), "{name} is not in the partition");
        let bytes = std::fs::read(origin.path().join(t["shard"].as_str().unwrap())).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let want = st.tensor(name).unwrap();
        let at = base + t["offset"].as_u64().unwrap() as usize;
        assert_eq!(&mem[at..at + want.data().len()], want.data(), "{name}");
    }
}

/// Whether the CUDA driver library loads here (wherever the system keeps it).
fn gpu_loader_driver_present() -> bool {
    gpu_loader::cuda::driver_available().is_ok()
}

/// Runs the Python example against `d`'s hand-off of `model`; it checks every tensor
/// against the memory-tier files (over CUDA IPC when the hand-off is `cuda-ipc`).
async fn python_handoff_check(d: &Daemon, model: &str) -> String {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../examples/python/handoff.py");
    let script = std::env::var("SHARDCAST_HANDOFF_PY").unwrap_or_else(|_| script.into());
    let out = tokio::process::Command::new("python3")
        .arg(script)
        .args(d.handoff_py_args().unwrap())
        .arg("--model")
        .arg(model)
        .output()
        .await
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        out.status.success() && stdout.starts_with("OK "),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

/// On a host with a CUDA driver and PyTorch: a whole model and a partition with completion
/// load onto the real GPUs, and every tensor read back through the CUDA IPC hand-off is
/// byte-exact. Not run in CI (no GPU): `cargo test -p shardcast-tests --test cluster -- --ignored gpu::`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a CUDA GPU and PyTorch"]
async fn cuda_loads_are_byte_exact_through_the_ipc_handoff() {
    if !gpu_loader_driver_present() {
        eprintln!("SKIPPED: no CUDA driver on this host");
        return;
    }
    let root = tempfile::tempdir().unwrap();
    let gpu = daemon(root.path(), "cuda-host", &["--gpu-backend", "cuda"]).await;
    let st = gpu
        .agent()
        .await
        .unwrap()
        .gpu_status(GpuStatusRequest {})
        .await
        .unwrap()
        .into_inner();
    assert!(!st.devices.is_empty(), "{}", st.note);
    assert!(st.devices.iter().all(|d| d.kind == "cuda"), "{st:?}");
    eprintln!(
        "GPUs: {:?}",
        st.devices.iter().map(|d| &d.name).collect::<Vec<_>>()
    );

    // A whole model, fetched from the origin, then loaded.
    let (_a, uri_a) = synthetic_origin(96 << 20, 2, 21);
    let (digest, manifest) = import(&gpu, &uri_a, true, vec![]).await;
    gpu.verify_copy(&manifest).unwrap();
    let t0 = Instant::now();
    gpu.agent()
        .await
        .unwrap()
        .load_model(whole_load(&digest, 1))
        .await
        .unwrap();
    let (m, _) = until_resident(&gpu, &digest).await;
    eprintln!(
        "whole model resident in {:.3} s ({m:?})",
        t0.elapsed().as_secs_f64()
    );
    assert!(
        m.gpus
            .iter()
            .all(|g| g.device_kind == "cuda" && g.bytes == g.total)
    );
    let out = python_handoff_check(&gpu, &digest).await;
    assert!(out.contains("cuda-ipc"), "{out}");

    // A partition from a peer first, then completion, onto the same GPU.
    let (origin_b, uri_b) = synthetic_origin(96 << 20, 2, 22);
    let holder = daemon(root.path(), "holder", &[]).await;
    let (digest_b, manifest_b) = import(&holder, &uri_b, true, vec![]).await;
    import(&gpu, &uri_b, false, encode_to_vec(&manifest_b)).await;
    let mut groups = layer_groups(origin_b.path(), &manifest_b);
    groups.truncate(groups.len() / 4);
    assert!(!groups.is_empty());
    gpu.agent()
        .await
        .unwrap()
        .load_model(LoadModelRequest {
            heaviness: String::new(),
            model: digest_b.clone(),
            count: 1,
            gpus: vec![],
            partition: Some(PartitionSpec {
                groups,
                complete: true,
                source: format!("shardcast://{}", holder.data_addr),
                label: "1/4".into(),
            }),
        })
        .await
        .unwrap();
    let (m, _) = until_resident(&gpu, &digest_b).await;
    eprintln!(
        "partition live after {:?} s, complete in {:.3} s",
        m.partition_live_s, m.elapsed_s
    );
    assert!(
        m.partition_live_s.is_some_and(|s| s <= m.elapsed_s),
        "{m:?}"
    );
    assert!(m.partition_complete);
    gpu.verify_copy(&manifest_b).unwrap();
    let out = python_handoff_check(&gpu, &digest_b).await;
    assert!(out.contains("cuda-ipc"), "{out}");
}

/// `LoadModel` for the whole model onto `count` GPUs the host chooses.
fn whole_load(digest: &str, count: u32) -> LoadModelRequest {
    LoadModelRequest {
        heaviness: String::new(),
        model: digest.to_string(),
        count,
        gpus: vec![],
        partition: None,
    }
}

/// The `model.layers.N` groups of a model in `origin`, by layer number, as `shardcast plan`
/// names them.
fn layer_groups(origin: &std::path::Path, manifest: &Manifest) -> Vec<String> {
    let mut names: Vec<String> = Vec::new();
    for s in manifest
        .shards
        .iter()
        .filter(|s| s.path.as_str().ends_with(".safetensors"))
    {
        let bytes = std::fs::read(origin.join(s.path.as_str())).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        for n in st.names() {
            let g = shardcast_policies::profile::group_of(n);
            if g.starts_with("model.layers.") && !names.contains(&g) {
                names.push(g);
            }
        }
    }
    names.sort_by_key(|g| g.rsplit('.').next().unwrap().parse::<u32>().unwrap());
    names
}
