//! deploy/kubernetes: every overlay rendered (by a small renderer for the subset of
//! kustomize the files use, always; and by `kubectl kustomize` when kubectl is on PATH,
//! whose output must match), then every daemon container checked against the daemon: its
//! flags and variables through the daemon's clap command and loader, its ports against
//! the listeners it will bind, probes, Services and ServiceMonitors against those ports,
//! mounts against the paths in its settings, and the pod's privileges against what the
//! daemon needs (and no more).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;

use serde::Deserialize;
use serde_json::{Map, Value, json};

use super::daemons::{self, Daemon, Listener};
use super::{deploy, documented_image, env_file, workspace_version};

/// What the downward API gives, in the checks.
const SAMPLE_NODE: &str = "node-1";
const SAMPLE_NODE_IP: &str = "10.0.0.1";
const SAMPLE_POD: &str = "pod-0";
const SAMPLE_POD_IP: &str = "10.0.0.2";

/// Every YAML document of `text` (empty documents skipped), as JSON values.
fn parse_docs(text: &str, what: &str) -> Result<Vec<Value>, String> {
    let mut out = Vec::new();
    for doc in yaml_serde::Deserializer::from_str(text) {
        let v = Value::deserialize(doc).map_err(|e| format!("{what}: {e}"))?;
        if !v.is_null() {
            out.push(v);
        }
    }
    Ok(out)
}

fn s<'a>(v: &'a Value, pointer: &str) -> Option<&'a str> {
    v.pointer(pointer).and_then(Value::as_str)
}

fn list<'a>(v: &'a Value, pointer: &str) -> &'a [Value] {
    v.pointer(pointer)
        .and_then(Value::as_array)
        .map_or(&[], Vec::as_slice)
}

/// The keys of a kustomization this renderer models; any other key is refused, so a file
/// that starts using one is not checked by half.
const KUSTOMIZATION_KEYS: &[&str] = &[
    "apiVersion",
    "kind",
    "namespace",
    "resources",
    "configMapGenerator",
    "patches",
];

/// Kinds without a namespace.
const CLUSTER_SCOPED: &[&str] = &[
    "Namespace",
    "ClusterRole",
    "ClusterRoleBinding",
    "RuntimeClass",
    "PriorityClass",
];

/// Renders the kustomization in `dir` like `kustomize build` for the features in
/// [`KUSTOMIZATION_KEYS`] (generated ConfigMaps keep their names: no hash suffix), and
/// records every file it read in `used`.
fn render(dir: &Path, used: &mut BTreeSet<PathBuf>) -> Result<Vec<Value>, String> {
    let kpath = dir.join("kustomization.yaml");
    let text = std::fs::read_to_string(&kpath).map_err(|e| format!("{}: {e}", kpath.display()))?;
    used.insert(canonical(&kpath));
    let k = parse_docs(&text, &kpath.display().to_string())?
        .pop()
        .ok_or_else(|| format!("{}: empty", kpath.display()))?;
    let at = |m: &str| format!("{}: {m}", kpath.display());
    for key in k.as_object().map(Map::keys).into_iter().flatten() {
        if !KUSTOMIZATION_KEYS.contains(&key.as_str()) {
            return Err(at(&format!(
                "`{key}` is not modelled by the deploy checks' renderer (tests/tests/cluster/deploy/kube.rs): teach it, or keep to {KUSTOMIZATION_KEYS:?}"
            )));
        }
    }
    let file = |rel: &str, used: &mut BTreeSet<PathBuf>| -> Result<(PathBuf, String), String> {
        let p = dir.join(rel);
        let t = std::fs::read_to_string(&p).map_err(|e| at(&format!("{rel}: {e}")))?;
        used.insert(canonical(&p));
        Ok((p, t))
    };
    let mut out = Vec::new();
    for r in list(&k, "/resources") {
        let rel = r
            .as_str()
            .ok_or_else(|| at("a resource that is not a path"))?;
        let p = dir.join(rel);
        if p.is_dir() {
            out.extend(render(&p, used)?);
        } else {
            let (p, t) = file(rel, used)?;
            out.extend(parse_docs(&t, &p.display().to_string())?);
        }
    }
    for g in list(&k, "/configMapGenerator") {
        let name = s(g, "/name").ok_or_else(|| at("a generator without a name"))?;
        let mut data = Map::new();
        for e in list(g, "/envs") {
            let rel = e.as_str().ok_or_else(|| at("envs: not a path"))?;
            let (p, t) = file(rel, used)?;
            for (k, v) in env_file(&t).map_err(|e| format!("{}: {e}", p.display()))? {
                data.insert(k, Value::String(v));
            }
        }
        for l in list(g, "/literals") {
            let (k, v) = l
                .as_str()
                .and_then(|l| l.split_once('='))
                .ok_or_else(|| at("literals: not KEY=VALUE"))?;
            data.insert(k.into(), Value::String(v.into()));
        }
        let existing = out
            .iter_mut()
            .find(|o| s(o, "/kind") == Some("ConfigMap") && s(o, "/metadata/name") == Some(name));
        match (s(g, "/behavior").unwrap_or("create"), existing) {
            ("create", None) => out.push(json!({
                "apiVersion": "v1", "kind": "ConfigMap",
                "metadata": {"name": name}, "data": data,
            })),
            ("merge", Some(cm)) => {
                let d = cm
                    .pointer_mut("/data")
                    .and_then(Value::as_object_mut)
                    .ok_or_else(|| at(&format!("ConfigMap {name} has no data")))?;
                d.extend(data);
            }
            ("replace", Some(cm)) => cm["data"] = Value::Object(data),
            (b, found) => {
                return Err(at(&format!(
                    "configMapGenerator {name}: behavior {b} with {} existing ConfigMap",
                    if found.is_some() { "an" } else { "no" }
                )));
            }
        }
    }
    if let Some(ns) = s(&k, "/namespace") {
        for o in &mut out {
            if !CLUSTER_SCOPED.contains(&s(o, "/kind").unwrap_or("")) {
                o["metadata"]["namespace"] = Value::String(ns.into());
            }
        }
    }
    for p in list(&k, "/patches") {
        let docs = match (s(p, "/path"), s(p, "/patch")) {
            (Some(rel), None) => {
                let (path, t) = file(rel, used)?;
                parse_docs(&t, &path.display().to_string())?
            }
            (None, Some(inline)) => parse_docs(inline, "inline patch")?,
            _ => return Err(at("a patch needs exactly one of path and patch")),
        };
        for doc in docs {
            let kind = s(p, "/target/kind").or(s(&doc, "/kind"));
            let name = s(p, "/target/name").or(s(&doc, "/metadata/name"));
            let target = out
                .iter_mut()
                .find(|o| s(o, "/kind") == kind && s(o, "/metadata/name") == name)
                .ok_or_else(|| {
                    at(&format!(
                        "a patch for {kind:?} {name:?}, which is not rendered"
                    ))
                })?;
            merge(target, &doc, "");
        }
    }
    Ok(out)
}

/// `p` with `..` resolved (for comparing the files read with the files there).
fn canonical(p: &Path) -> PathBuf {
    std::fs::canonicalize(p).unwrap_or_else(|_| p.to_path_buf())
}

/// The key that identifies an element of the list in field `field`, for a strategic merge.
fn merge_key(field: &str) -> Option<&'static str> {
    match field {
        "containers" | "initContainers" | "volumes" | "env" | "imagePullSecrets" => Some("name"),
        "volumeMounts" => Some("mountPath"),
        _ => None,
    }
}

/// A strategic-merge patch: maps merged key by key (`null` deletes a key), lists of named
/// things merged element by element, any other value replaced.
fn merge(base: &mut Value, patch: &Value, field: &str) {
    match (base, patch) {
        (Value::Object(b), Value::Object(p)) => {
            for (k, v) in p {
                if v.is_null() {
                    b.remove(k);
                } else if let Some(bv) = b.get_mut(k) {
                    merge(bv, v, k);
                } else {
                    b.insert(k.clone(), v.clone());
                }
            }
        }
        (Value::Array(b), Value::Array(p)) if merge_key(field).is_some() => {
            let key = merge_key(field).unwrap_or("name");
            for item in p {
                match b.iter_mut().find(|x| x.get(key) == item.get(key)) {
                    Some(x) => merge(x, item, field),
                    None => b.push(item.clone()),
                }
            }
        }
        (b, p) => *b = p.clone(),
    }
}

/// What a container runs with: its variables (in the order Kubernetes defines them, each
/// value with `$(VAR)` expanded) and its arguments, from the rendered objects.
struct Environment {
    vars: BTreeMap<String, String>,
    /// Variables some other value refers to as `$(NAME)`.
    referenced: BTreeSet<String>,
    args: Vec<String>,
}

/// `$(NAME)` in `v` replaced by `defined[NAME]`; an undefined name is an error (Kubernetes
/// would leave `$(NAME)` in the value).
fn expand(
    v: &str,
    defined: &BTreeMap<String, String>,
    referenced: &mut BTreeSet<String>,
) -> Result<String, String> {
    let mut out = String::new();
    let mut rest = v;
    while let Some(i) = rest.find("$(") {
        out.push_str(&rest[..i]);
        let after = &rest[i + 2..];
        let end = after
            .find(')')
            .ok_or_else(|| format!("unclosed $( in {v:?}"))?;
        let name = &after[..end];
        let value = defined
            .get(name)
            .ok_or_else(|| format!("{v:?} refers to $({name}), defined nowhere before it"))?;
        referenced.insert(name.to_string());
        out.push_str(value);
        rest = &after[end + 1..];
    }
    out.push_str(rest);
    Ok(out)
}

fn environment(objects: &[Value], container: &Value) -> Result<Environment, String> {
    let mut vars = BTreeMap::new();
    let mut referenced = BTreeSet::new();
    for from in list(container, "/envFrom") {
        let name = s(from, "/configMapRef/name")
            .ok_or_else(|| "envFrom: only configMapRef is modelled".to_string())?;
        let cm = objects
            .iter()
            .find(|o| s(o, "/kind") == Some("ConfigMap") && s(o, "/metadata/name") == Some(name))
            .ok_or_else(|| format!("envFrom: no ConfigMap {name}"))?;
        for (k, v) in cm
            .pointer("/data")
            .and_then(Value::as_object)
            .into_iter()
            .flatten()
        {
            vars.insert(k.clone(), v.as_str().unwrap_or_default().to_string());
        }
    }
    for e in list(container, "/env") {
        let name = s(e, "/name").ok_or_else(|| "env: an entry without a name".to_string())?;
        let value = if let Some(v) = s(e, "/value") {
            expand(v, &vars, &mut referenced)?
        } else if let Some(field) = s(e, "/valueFrom/fieldRef/fieldPath") {
            match field {
                "spec.nodeName" => SAMPLE_NODE.into(),
                "status.hostIP" => SAMPLE_NODE_IP.into(),
                "status.podIP" => SAMPLE_POD_IP.into(),
                "metadata.name" => SAMPLE_POD.into(),
                other => return Err(format!("env {name}: fieldRef {other} is not modelled")),
            }
        } else if e.pointer("/valueFrom/secretKeyRef").is_some() {
            "secret".into()
        } else {
            return Err(format!("env {name}: no value, fieldRef or secretKeyRef"));
        };
        vars.insert(name.to_string(), value);
    }
    let mut args = Vec::new();
    for a in list(container, "/command")
        .iter()
        .skip(1)
        .chain(list(container, "/args"))
    {
        let a = a.as_str().ok_or("an argument that is not a string")?;
        args.push(expand(a, &vars, &mut referenced)?);
    }
    Ok(Environment {
        vars,
        referenced,
        args,
    })
}

/// A workload's pod template and replicas.
struct Workload<'a> {
    id: String,
    object: &'a Value,
    pod: &'a Value,
    labels: &'a Map<String, Value>,
}

fn workloads(objects: &[Value]) -> Vec<Workload<'_>> {
    objects
        .iter()
        .filter(|o| {
            matches!(
                s(o, "/kind"),
                Some("Deployment" | "DaemonSet" | "StatefulSet")
            )
        })
        .filter_map(|o| {
            Some(Workload {
                id: format!("{}/{}", s(o, "/kind")?, s(o, "/metadata/name")?),
                object: o,
                pod: o.pointer("/spec/template/spec")?,
                labels: o.pointer("/spec/template/metadata/labels")?.as_object()?,
            })
        })
        .collect()
}

/// `selector` (a map of labels) matches `labels`.
fn selects(selector: Option<&Value>, labels: &Map<String, Value>) -> bool {
    selector
        .and_then(Value::as_object)
        .is_some_and(|sel| !sel.is_empty() && sel.iter().all(|(k, v)| labels.get(k) == Some(v)))
}

/// A container port: (name, number, protocol).
type Port = (Option<String>, u16, String);

fn ports(container: &Value) -> Vec<Port> {
    list(container, "/ports")
        .iter()
        .filter_map(|p| {
            Some((
                s(p, "/name").map(str::to_string),
                u16::try_from(p.pointer("/containerPort")?.as_u64()?).ok()?,
                s(p, "/protocol").unwrap_or("TCP").to_string(),
            ))
        })
        .collect()
}

/// A port reference (a number or a container port's name) as a number.
fn resolve_port(r: Option<&Value>, ports: &[Port]) -> Option<u16> {
    match r? {
        Value::Number(n) => n.as_u64().and_then(|n| u16::try_from(n).ok()),
        Value::String(name) => ports
            .iter()
            .find(|(n, _, _)| n.as_deref() == Some(name))
            .map(|p| p.1),
        _ => None,
    }
}

/// A Kubernetes memory quantity in bytes.
fn quantity(q: &str) -> Option<u64> {
    let units = [
        ("Ki", 1u64 << 10),
        ("Mi", 1 << 20),
        ("Gi", 1 << 30),
        ("Ti", 1 << 40),
        ("k", 1_000),
        ("M", 1_000_000),
        ("G", 1_000_000_000),
        ("T", 1_000_000_000_000),
    ];
    for (suffix, mult) in units {
        if let Some(n) = q.strip_suffix(suffix) {
            return n.parse::<u64>().ok().map(|n| n * mult);
        }
    }
    q.parse().ok()
}

/// `path` lies at or beneath `dir`.
fn beneath(path: &str, dir: &str) -> bool {
    Path::new(path).starts_with(Path::new(dir))
}

/// One daemon container, checked: the errors, and a summary of what it runs with (to
/// compare two renderers).
#[derive(Debug, PartialEq)]
struct Checked {
    daemon: Daemon,
    settings: toml::Table,
    replicas: Option<u64>,
    volumes: Value,
    http_port: Option<u16>,
    insecure: bool,
}

/// Checks every daemon container of `objects`; returns the errors and, per container
/// (`Kind/name/container`), what it runs with.
fn check(objects: &[Value], image: &str) -> (Vec<String>, BTreeMap<String, Checked>) {
    let mut errors = Vec::new();
    let mut out = BTreeMap::new();
    for w in workloads(objects) {
        for c in list(w.pod, "/containers") {
            let id = format!("{}/{}", w.id, s(c, "/name").unwrap_or("?"));
            let mut err = |m: String| errors.push(format!("{id}: {m}"));
            if s(c, "/image") != Some(image) {
                err(format!(
                    "image {:?}, not the one deploy/README.md builds ({image})",
                    s(c, "/image")
                ));
            }
            let Some(daemon) = list(c, "/command")
                .first()
                .and_then(Value::as_str)
                .and_then(Daemon::from_program)
            else {
                err("runs no shardcast daemon (command[0])".into());
                continue;
            };
            match check_container(objects, &w, c, daemon) {
                Ok((checked, errs)) => {
                    for e in errs {
                        err(e);
                    }
                    out.insert(id, checked);
                }
                Err(errs) => {
                    for e in errs {
                        err(e);
                    }
                }
            }
        }
        check_pod_identity(objects, &w, &mut errors);
    }
    check_services(objects, &out, &mut errors);
    (errors, out)
}

/// The pod's ServiceAccount exists, mounts no token, and nothing grants it a role: neither
/// daemon calls the Kubernetes API.
fn check_pod_identity(objects: &[Value], w: &Workload<'_>, errors: &mut Vec<String>) {
    let Some(sa) = s(w.pod, "/serviceAccountName") else {
        errors.push(format!(
            "{}: no serviceAccountName (it would run as `default`)",
            w.id
        ));
        return;
    };
    let account = objects
        .iter()
        .find(|o| s(o, "/kind") == Some("ServiceAccount") && s(o, "/metadata/name") == Some(sa));
    if account.is_none() {
        errors.push(format!(
            "{}: ServiceAccount {sa} is not in the manifests",
            w.id
        ));
    }
    let automount = w
        .pod
        .pointer("/automountServiceAccountToken")
        .or_else(|| account.and_then(|a| a.pointer("/automountServiceAccountToken")));
    if automount != Some(&Value::Bool(false)) {
        errors.push(format!(
            "{}: mounts a ServiceAccount token, but the daemon never calls the Kubernetes API",
            w.id
        ));
    }
    for b in objects
        .iter()
        .filter(|o| matches!(s(o, "/kind"), Some("RoleBinding" | "ClusterRoleBinding")))
    {
        if list(b, "/subjects")
            .iter()
            .any(|x| s(x, "/name") == Some(sa))
        {
            errors.push(format!(
                "{}: {} grants ServiceAccount {sa} a role it has no use for",
                w.id,
                s(b, "/metadata/name").unwrap_or("?")
            ));
        }
    }
}

fn check_container(
    objects: &[Value],
    w: &Workload<'_>,
    c: &Value,
    daemon: Daemon,
) -> Result<(Checked, Vec<String>), Vec<String>> {
    let mut errors = Vec::new();
    let env = environment(objects, c).map_err(|e| vec![e])?;
    let gpu_runtime = s(w.pod, "/runtimeClassName").is_some();
    let argv = daemons::argv(daemon, &env.args, &env.vars, |var| {
        if env.referenced.contains(var) {
            Some("a variable other values refer to")
        } else if var.starts_with("NVIDIA_") && gpu_runtime {
            Some("read by the NVIDIA container runtime of the pod's runtime class")
        } else if daemon.reads_env_directly(var) {
            Some("read by the daemon's code")
        } else {
            None
        }
    })?;
    let settings = daemon.load(&argv).map_err(|e| {
        vec![format!(
            "{} refuses its configuration: {e}",
            daemon.binary()
        )]
    })?;
    let insecure = daemons::flag(&settings, "insecure_plaintext");
    // The controller's loader leaves the identity to start-up: check it here for both.
    let missing: Vec<&str> = ["tls_ca", "tls_cert", "tls_key"]
        .into_iter()
        .filter(|k| daemons::text(&settings, k).is_none())
        .collect();
    if !insecure && !missing.is_empty() {
        errors.push(format!("mutual TLS needs {missing:?}"));
    }

    // Listeners and container ports: each reachable listener has its port, each port a listener.
    let declared = ports(c);
    let mut wanted: Vec<(u16, &str, &str)> = Vec::new();
    let mut http_port = None;
    for &(key, http) in daemon.listener_keys() {
        let Some(value) = daemons::text(&settings, key) else {
            continue;
        };
        match Listener::parse(value) {
            Ok(Listener::Tcp(addr)) if addr.ip().is_loopback() => {}
            Ok(Listener::Tcp(addr)) => {
                wanted.push((addr.port(), "TCP", key));
                if daemon == Daemon::Transferd
                    && key == "listen"
                    && daemons::flag(&settings, "quic")
                    && !insecure
                {
                    wanted.push((addr.port(), "UDP", "quic"));
                }
                if http {
                    http_port = Some(addr.port());
                }
            }
            Ok(Listener::Unix(_)) => {}
            Err(e) => errors.push(e),
        }
    }
    for (port, proto, key) in &wanted {
        if !declared.iter().any(|(_, p, pr)| p == port && pr == proto) {
            errors.push(format!(
                "listener {key} binds {port}/{proto}, which no containerPort declares"
            ));
        }
    }
    for (name, port, proto) in &declared {
        if !wanted.iter().any(|(p, pr, _)| p == port && pr == proto) {
            errors.push(format!(
                "containerPort {name:?} {port}/{proto} is no listener of the daemon's settings"
            ));
        }
    }

    // Probes: on the HTTP listener, the anonymous health routes, in its scheme.
    for probe in ["startupProbe", "livenessProbe", "readinessProbe"] {
        let Some(p) = c.get(probe) else {
            if probe != "startupProbe" {
                errors.push(format!("no {probe}"));
            }
            continue;
        };
        let Some(get) = p.get("httpGet") else {
            errors.push(format!("{probe}: not an httpGet"));
            continue;
        };
        let port = resolve_port(get.get("port"), &declared);
        if port.is_none() || port != http_port {
            errors.push(format!(
                "{probe}: port {:?} is not the HTTP listener's ({http_port:?})",
                get.get("port")
            ));
        }
        let path = s(get, "/path").unwrap_or("/");
        if !["/healthz", "/readyz"].contains(&path) {
            errors.push(format!("{probe}: {path} is not an anonymous health route"));
        }
        let scheme = s(get, "/scheme").unwrap_or("HTTP");
        let want = if insecure { "HTTP" } else { "HTTPS" };
        if scheme != want {
            errors.push(format!(
                "{probe}: scheme {scheme}, but the listener speaks {want}"
            ));
        }
    }

    // Advertised addresses carry the listeners' ports (the pod's address is the one dialled).
    for &(adv, listener) in daemon.advertise_keys() {
        if let (Some(a), Some(l)) = (
            daemons::text(&settings, adv),
            daemons::text(&settings, listener),
        ) && daemons::port_of(a) != daemons::port_of(l)
        {
            errors.push(format!("{adv} {a} does not carry {listener}'s port ({l})"));
        }
    }

    // Paths: each beneath a mount (the root file system is read-only), writable where
    // the daemon writes; every mount used by a setting.
    let mounts: Vec<(&str, bool, &str)> = list(c, "/volumeMounts")
        .iter()
        .filter_map(|m| {
            Some((
                s(m, "/mountPath")?,
                m.get("readOnly") == Some(&Value::Bool(true)),
                s(m, "/name")?,
            ))
        })
        .collect();
    let volume = |name: &str| {
        list(w.pod, "/volumes")
            .iter()
            .find(|v| s(v, "/name") == Some(name))
    };
    let mut used = BTreeSet::new();
    for pk in daemon.path_keys() {
        let Some(p) = daemons::text(&settings, pk.key) else {
            continue;
        };
        let Some(&(mount, read_only, vol)) = mounts
            .iter()
            .filter(|(m, _, _)| beneath(p, m))
            .max_by_key(|(m, _, _)| m.len())
        else {
            errors.push(format!("{} = {p} is beneath no volume mount", pk.key));
            continue;
        };
        used.insert(mount);
        if pk.writable && read_only {
            errors.push(format!("{} = {p} is on a read-only mount", pk.key));
        }
        let v = volume(vol);
        let kind_of = |k: &str| v.is_some_and(|v| v.get(k).is_some());
        match pk.key {
            // A pod's own /dev/shm is private to it and dies with it; engine pods map the
            // files at the path the hand-off names, so the path is the host's.
            "memory_dir"
                if !kind_of("hostPath") || v.and_then(|v| s(v, "/hostPath/path")) != Some(mount) =>
            {
                errors.push(format!(
                    "memory_dir {p}: its volume must be a hostPath mounted at its own path (the host's tmpfs), got {v:?}"
                ))
            }
            "data_dir" if !kind_of("hostPath") => errors.push(format!(
                "data_dir {p}: the disk tier must outlive the pod (a hostPath), got {v:?}"
            )),
            "state_dir"
                if daemons::text(&settings, "state").is_none() && !kind_of("persistentVolumeClaim") =>
            {
                errors.push(format!(
                    "state_dir {p}: the embedded store must outlive the pod (a PersistentVolumeClaim), got {v:?}"
                ))
            }
            _ => {}
        }
    }
    for (mount, _, _) in &mounts {
        if !used.contains(mount) {
            errors.push(format!(
                "volume mount {mount} holds no path of the daemon's settings"
            ));
        }
    }

    // Resources: requests set; a memory limit above the memory tier's cap (tmpfs pages are
    // charged to the writer's cgroup).
    if c.pointer("/resources/requests/cpu").is_none()
        || c.pointer("/resources/requests/memory").is_none()
    {
        errors.push("no cpu and memory requests".into());
    }
    for r in ["requests", "limits"] {
        if c.pointer(&format!("/resources/{r}/nvidia.com~1gpu"))
            .is_some()
        {
            errors.push(format!(
                "resources.{r} takes whole GPUs from the engines; use the runtime class and NVIDIA_VISIBLE_DEVICES"
            ));
        }
    }
    if daemon == Daemon::Transferd
        && let Some(limit) = s(c, "/resources/limits/memory")
    {
        let limit = quantity(limit);
        let cap = match settings.get("memory_capacity") {
            Some(toml::Value::Integer(n)) => u64::try_from(*n).ok(),
            Some(toml::Value::String(t)) => shardcast_protocol::units::parse_size(t).ok(),
            _ => None,
        };
        match (limit, cap) {
            (Some(l), Some(c)) if c < l => {}
            _ => errors.push(format!(
                "memory limit {limit:?} needs memory_capacity set below it (got {cap:?}): the memory tier's pages count against the limit"
            )),
        }
    }

    // The pod: what transferd needs of the host; the host id from the node's name.
    let pod_flag = |k: &str| w.pod.get(k) == Some(&Value::Bool(true));
    if daemon == Daemon::Transferd {
        if !pod_flag("hostNetwork") {
            errors.push("transferd needs hostNetwork (peers dial the node's address)".into());
        }
        if !pod_flag("hostIPC") {
            errors.push("transferd needs hostIPC (CUDA IPC hand-offs to engine pods)".into());
        }
        if s(w.object, "/kind") == Some("DaemonSet")
            && daemons::text(&settings, "host_id") != Some(SAMPLE_NODE)
        {
            errors.push(format!(
                "host_id is {:?}, not the node's name (downward API spec.nodeName)",
                daemons::text(&settings, "host_id")
            ));
        }
    }
    if pod_flag("hostNetwork")
        && daemons::text(&settings, "controller").is_some_and(|c| c.contains(".svc"))
        && s(w.pod, "/dnsPolicy") != Some("ClusterFirstWithHostNet")
    {
        errors.push(
            "a hostNetwork pod resolves Service names only with dnsPolicy ClusterFirstWithHostNet"
                .into(),
        );
    }
    let replicas = w.object.pointer("/spec/replicas").and_then(Value::as_u64);
    if daemon == Daemon::Controller {
        let strategy = s(w.object, "/spec/strategy/type");
        match daemons::text(&settings, "state") {
            None if replicas != Some(1) || strategy != Some("Recreate") => errors.push(format!(
                "on the embedded store there is one writer: replicas 1 and strategy Recreate, got {replicas:?} and {strategy:?}"
            )),
            Some(_) if replicas.unwrap_or(1) < 2 => {
                errors.push("on etcd, run more than one replica".into())
            }
            _ => {}
        }
    }
    Ok((
        Checked {
            daemon,
            settings,
            replicas,
            volumes: w.pod.get("volumes").cloned().unwrap_or(Value::Null),
            http_port,
            insecure,
        },
        errors,
    ))
}

/// What a Service port reaches: the daemon container behind it (if it passed its checks)
/// and the container port's number.
type Target<'a> = (Option<&'a Checked>, Option<u16>);

/// Services select daemon pods and target their ports; ServiceMonitors select those
/// Services and scrape the daemons' HTTP listeners.
fn check_services(
    objects: &[Value],
    checked: &BTreeMap<String, Checked>,
    errors: &mut Vec<String>,
) {
    let ws = workloads(objects);
    // service name -> port name -> what it targets
    let mut targets: BTreeMap<&str, BTreeMap<&str, Target<'_>>> = BTreeMap::new();
    for svc in objects.iter().filter(|o| s(o, "/kind") == Some("Service")) {
        let name = s(svc, "/metadata/name").unwrap_or("?");
        let selected: Vec<&Workload<'_>> = ws
            .iter()
            .filter(|w| selects(svc.pointer("/spec/selector"), w.labels))
            .collect();
        if selected.is_empty() {
            errors.push(format!(
                "Service/{name}: its selector matches no workload's pods"
            ));
        }
        for p in list(svc, "/spec/ports") {
            let pname = s(p, "/name").unwrap_or("");
            let proto = s(p, "/protocol").unwrap_or("TCP");
            let target = p.get("targetPort").or_else(|| p.get("port"));
            let mut found = None;
            for w in &selected {
                for c in list(w.pod, "/containers") {
                    let declared = ports(c);
                    if let Some(n) = resolve_port(target, &declared)
                        && declared.iter().any(|(_, pn, pr)| *pn == n && pr == proto)
                    {
                        let id = format!("{}/{}", w.id, s(c, "/name").unwrap_or("?"));
                        found = Some((checked.get(&id), Some(n)));
                    }
                }
            }
            if found.is_none() {
                errors.push(format!(
                    "Service/{name} port {pname}: target {target:?}/{proto} is no containerPort of the pods it selects"
                ));
            }
            targets
                .entry(name)
                .or_default()
                .insert(pname, found.unwrap_or((None, None)));
        }
    }
    for sm in objects
        .iter()
        .filter(|o| s(o, "/kind") == Some("ServiceMonitor"))
    {
        let name = s(sm, "/metadata/name").unwrap_or("?");
        let svcs: Vec<&str> = objects
            .iter()
            .filter(|o| s(o, "/kind") == Some("Service"))
            .filter(|o| {
                o.pointer("/metadata/labels")
                    .and_then(Value::as_object)
                    .is_some_and(|l| selects(sm.pointer("/spec/selector/matchLabels"), l))
            })
            .filter_map(|o| s(o, "/metadata/name"))
            .collect();
        if svcs.is_empty() {
            errors.push(format!("ServiceMonitor/{name}: selects no Service"));
        }
        for e in list(sm, "/spec/endpoints") {
            let port = s(e, "/port").unwrap_or("");
            for svc in &svcs {
                match targets.get(svc).and_then(|t| t.get(port)) {
                    Some((Some(c), n)) if *n == c.http_port => {
                        let want = if c.insecure { "http" } else { "https" };
                        if s(e, "/scheme") != Some(want) {
                            errors.push(format!(
                                "ServiceMonitor/{name}: scheme {:?}, the listener speaks {want}",
                                s(e, "/scheme")
                            ));
                        }
                    }
                    // A container that failed its checks is reported already.
                    Some((None, Some(_))) => {}
                    other => errors.push(format!(
                        "ServiceMonitor/{name}: port {port:?} of Service/{svc} is not a daemon's HTTP listener (it targets {:?})",
                        other.and_then(|(_, n)| *n)
                    )),
                }
            }
            if s(e, "/path") != Some("/metrics") {
                errors.push(format!(
                    "ServiceMonitor/{name}: path {:?} is not /metrics",
                    s(e, "/path")
                ));
            }
        }
    }
}

/// Every file beneath `dir`.
fn files(dir: &Path, out: &mut BTreeSet<PathBuf>) {
    for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let p = e.path();
        if p.is_dir() {
            files(&p, out);
        } else {
            out.insert(p);
        }
    }
}

fn overlays() -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(deploy("kubernetes/overlays"))
        .expect("deploy/kubernetes/overlays")
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.join("kustomization.yaml").is_file())
        .collect();
    v.sort();
    v
}

fn assert_checked(what: &str, objects: &[Value], image: &str) -> BTreeMap<String, Checked> {
    let (errors, checked) = check(objects, image);
    assert!(errors.is_empty(), "{what}:\n  {}", errors.join("\n  "));
    let daemons: BTreeSet<Daemon> = checked.values().map(|c| c.daemon).collect();
    assert_eq!(
        daemons,
        BTreeSet::from([Daemon::Transferd, Daemon::Controller]),
        "{what}: both daemons are deployed"
    );
    checked
}

/// The controller's container in a checked overlay.
fn controller(checked: &BTreeMap<String, Checked>) -> &Checked {
    checked
        .values()
        .find(|c| c.daemon == Daemon::Controller)
        .expect("a controller")
}

#[test]
fn kubernetes_overlays_give_the_daemons_only_what_they_accept() {
    let image = documented_image();
    assert_eq!(
        image.rsplit_once(':').map(|(_, tag)| tag.to_string()),
        Some(workspace_version()),
        "the documented image tag is the workspace's version"
    );
    let overlays = overlays();
    let names: Vec<&str> = overlays
        .iter()
        .filter_map(|p| p.file_name()?.to_str())
        .collect();
    assert_eq!(
        names,
        ["embedded", "etcd"],
        "one overlay per controller mode"
    );
    let mut used = BTreeSet::new();
    let mut ours = BTreeMap::new();
    for o in &overlays {
        let name = o.file_name().and_then(|n| n.to_str()).unwrap_or("?");
        let objects = render(o, &mut used).unwrap_or_else(|e| panic!("overlay {name}: {e}"));
        let checked = assert_checked(&format!("overlay {name}"), &objects, &image);
        let ctl = controller(&checked);
        let state = daemons::text(&ctl.settings, "state");
        match name {
            "embedded" => assert_eq!((state, ctl.replicas), (None, Some(1)), "{name}"),
            _ => assert!(
                state.is_some_and(|s| s.starts_with("etcd://")) && ctl.replicas == Some(3),
                "{name}: three replicas on etcd, got {state:?} and {:?}",
                ctl.replicas
            ),
        }
        ours.insert(name.to_string(), checked);
    }
    // No file of deploy/kubernetes that no kustomization reads (a patch never applied).
    let mut all = BTreeSet::new();
    files(&canonical(&deploy("kubernetes")), &mut all);
    let unused: Vec<_> = all
        .iter()
        .filter(|p| !used.contains(*p) && p.extension().is_some_and(|x| x == "yaml" || x == "env"))
        .collect();
    assert!(
        unused.is_empty(),
        "files no kustomization reads: {unused:?}"
    );

    // The real renderer, where it is installed: it must accept every overlay, and its
    // output must pass the same checks and give each daemon the same settings.
    let kubectl = Command::new("kubectl")
        .arg("version")
        .arg("--client")
        .output();
    if kubectl.is_err() {
        // The marker scripts/skip-report lists.
        eprintln!(
            "SKIPPED: kubectl is not on PATH: `kubectl kustomize` of the overlays (the built-in renderer's checks ran)"
        );
        return;
    }
    for o in &overlays {
        let name = o.file_name().and_then(|n| n.to_str()).unwrap_or("?");
        let out = Command::new("kubectl")
            .arg("kustomize")
            .arg(o)
            .output()
            .expect("running kubectl kustomize");
        assert!(
            out.status.success(),
            "kubectl kustomize {}: {}",
            o.display(),
            String::from_utf8_lossy(&out.stderr)
        );
        let objects = parse_docs(&String::from_utf8_lossy(&out.stdout), "kubectl kustomize")
            .unwrap_or_else(|e| panic!("{e}"));
        let theirs = assert_checked(&format!("kubectl kustomize {name}"), &objects, &image);
        assert_eq!(
            ours[name], theirs,
            "overlay {name}: the built-in renderer and kubectl disagree"
        );
        println!("kubectl kustomize {name}: rendered, checked, same as the built-in renderer");
    }
}

#[test]
fn the_renderers_strategic_merge_follows_kustomize() {
    let mut base = json!({"spec": {"replicas": 1, "template": {"spec": {
        "containers": [{"name": "a", "env": [{"name": "X", "value": "1"}], "args": ["--p"]}],
        "volumes": [{"name": "state", "emptyDir": {}}, {"name": "pki", "secret": {"secretName": "s"}}],
    }}}});
    let patch = json!({"spec": {"replicas": 3, "template": {"spec": {
        "containers": [{"name": "a", "env": [{"name": "Y", "value": "2"}], "args": ["--q"]}],
        "volumes": [{"name": "state", "emptyDir": null, "persistentVolumeClaim": {"claimName": "c"}}],
    }}}});
    merge(&mut base, &patch, "");
    assert_eq!(
        base,
        json!({"spec": {"replicas": 3, "template": {"spec": {
            "containers": [{"name": "a", "env": [{"name": "X", "value": "1"}, {"name": "Y", "value": "2"}], "args": ["--q"]}],
            "volumes": [{"name": "state", "persistentVolumeClaim": {"claimName": "c"}}, {"name": "pki", "secret": {"secretName": "s"}}],
        }}}})
    );
    let mut seen = BTreeSet::new();
    let defined = BTreeMap::from([("IP".to_string(), "10.1.2.3".to_string())]);
    assert_eq!(
        expand("$(IP):7400", &defined, &mut seen).as_deref(),
        Ok("10.1.2.3:7400")
    );
    assert!(expand("$(NOPE):1", &defined, &mut seen).is_err());
    assert_eq!(quantity("72Gi"), Some(72 << 30));
    assert_eq!(quantity("512M"), Some(512_000_000));
}

#[test]
fn a_flag_or_variable_the_daemon_lacks_is_refused() {
    // The same path the manifests take, with settings that are wrong in known ways.
    let env = BTreeMap::from([("SHARDCAST_NO_SUCH_SETTING".to_string(), "1".to_string())]);
    let errs = daemons::argv(Daemon::Transferd, &[], &env, |_| None).unwrap_err();
    assert!(errs[0].contains("SHARDCAST_NO_SUCH_SETTING"), "{errs:?}");
    let errs = daemons::argv(
        Daemon::Controller,
        &["--no-such-flag=1".into()],
        &BTreeMap::new(),
        |_| None,
    )
    .unwrap_err();
    assert!(errs[0].contains("--no-such-flag"), "{errs:?}");
    // A variable clap knows becomes its flag, and the loader checks its value.
    let env = BTreeMap::from([("SHARDCAST_WINDOW".to_string(), "eight".to_string())]);
    let argv = daemons::argv(Daemon::Transferd, &[], &env, |_| None).unwrap();
    assert!(argv.contains(&"--window=eight".to_string()), "{argv:?}");
    assert!(Daemon::Transferd.load(&argv).is_err());
    // A listener off loopback without TLS is refused by the daemon's loader.
    let env = BTreeMap::from([
        ("SHARDCAST_LISTEN".to_string(), "0.0.0.0:7400".to_string()),
        (
            "SHARDCAST_INSECURE_PLAINTEXT".to_string(),
            "true".to_string(),
        ),
    ]);
    let argv = daemons::argv(Daemon::Transferd, &[], &env, |_| None).unwrap();
    assert!(Daemon::Transferd.load(&argv).is_err(), "{argv:?}");
    // Reading the sources finds the variables the daemons read themselves.
    assert!(Daemon::Transferd.reads_env_directly("SHARDCAST_LOG"));
    assert!(Daemon::Controller.reads_env_directly("SHARDCAST_ETCD_PASSWORD"));
    assert!(!Daemon::Controller.reads_env_directly("SHARDCAST_NO_SUCH_SETTING"));
}
