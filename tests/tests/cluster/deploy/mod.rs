//! The `deploy/` folder checked against the daemons it deploys, without a cluster: the
//! Kubernetes manifests (`kube`), the systemd units (`systemd`), the container build file
//! (`container`) and the Grafana dashboard (`dashboard`; its series are checked against a
//! real scrape after a prewarm in `controller::metrics_after_a_prewarm_match_what_happened`).
//! Every flag, variable, port and path a deploy file gives a daemon goes through the
//! daemon's own clap command and configuration loader (`daemons`), so a renamed flag or a
//! moved default breaks these tests, not an installation.
//!
//! What cannot run here (a Kubernetes cluster, an image build) is listed in
//! deploy/README.md with the commands to run it.

mod container;
pub(crate) mod daemons;
pub(crate) mod dashboard;
mod kube;
mod systemd;

use std::path::{Path, PathBuf};

/// The repository's root.
pub(crate) fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the tests crate is one level below the repository root")
        .to_path_buf()
}

/// `deploy/<rel>`.
pub(crate) fn deploy(rel: &str) -> PathBuf {
    repo().join("deploy").join(rel)
}

/// A file's text, or a panic naming it.
pub(crate) fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()))
}

/// `KEY=VALUE` lines (an env file for systemd's `EnvironmentFile=` or kustomize's
/// `envs:`): blank lines and `#` comments skipped, the value unquoted if quoted.
pub(crate) fn env_file(text: &str) -> Result<Vec<(String, String)>, String> {
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let (k, v) = line
            .split_once('=')
            .ok_or_else(|| format!("line {}: {line:?} is not KEY=VALUE", i + 1))?;
        let v = v.trim();
        let v = v
            .strip_prefix('"')
            .and_then(|v| v.strip_suffix('"'))
            .unwrap_or(v);
        out.push((k.trim().to_string(), v.to_string()));
    }
    Ok(out)
}

/// The workspace's `[workspace.package] version`.
pub(crate) fn workspace_version() -> String {
    let root: toml::Table = toml::from_str(&read(&repo().join("Cargo.toml"))).expect("Cargo.toml");
    root["workspace"]["package"]["version"]
        .as_str()
        .expect("workspace.package.version")
        .to_string()
}

/// The image the documented build command tags: `-t NAME` of the `docker build` line in
/// deploy/README.md that builds deploy/container/Dockerfile.
pub(crate) fn documented_image() -> String {
    let readme = read(&deploy("README.md"));
    let tags: Vec<String> = readme
        .lines()
        .filter(|l| l.contains("build") && l.contains("deploy/container/Dockerfile"))
        .filter_map(|l| {
            let words: Vec<&str> = l.split_whitespace().collect();
            let i = words.iter().position(|w| *w == "-t" || *w == "--tag")?;
            words.get(i + 1).map(|w| w.to_string())
        })
        .collect();
    assert!(
        !tags.is_empty(),
        "deploy/README.md has no `docker build -f deploy/container/Dockerfile -t NAME .` line"
    );
    assert!(
        tags.iter().all(|t| *t == tags[0]),
        "deploy/README.md tags the image differently in its build lines: {tags:?}"
    );
    tags[0].clone()
}
