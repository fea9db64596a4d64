//! deploy/container/Dockerfile, checked without building it (no registry is reachable
//! from the tests to pull the base images; deploy/README.md records a build with base images
//! made locally): every file it copies from the build context exists and every workspace
//! member is among them; the builder stage builds, with `--release --locked`, binaries the
//! workspace declares, and strips their debug info; the runtime stage takes exactly those,
//! from where cargo writes them, compiles nothing and runs as a non-root user; the Rust
//! image is new enough for the workspace; and the build command in its comment tags the
//! image deploy/README.md documents (which the manifests run: `kube`).

use std::collections::BTreeSet;
use std::path::Path;

use super::{deploy, documented_image, read, repo};

/// One instruction: its keyword (upper case) and its words.
#[derive(Debug)]
struct Instruction {
    keyword: String,
    words: Vec<String>,
}

/// The Dockerfile's instructions (continuation lines joined, comments dropped).
fn instructions(text: &str) -> Vec<Instruction> {
    let mut out = Vec::new();
    let mut current = String::new();
    for line in text.lines() {
        let t = line.trim();
        if current.is_empty() && (t.is_empty() || t.starts_with('#')) {
            continue;
        }
        if let Some(head) = t.strip_suffix('\\') {
            current.push_str(head);
            current.push(' ');
            continue;
        }
        current.push_str(t);
        let mut words = current.split_whitespace().map(str::to_string);
        if let Some(k) = words.next() {
            out.push(Instruction {
                keyword: k.to_uppercase(),
                words: words.collect(),
            });
        }
        current.clear();
    }
    out
}

/// A build stage: its name, base image and instructions.
struct Stage {
    name: Option<String>,
    from: String,
    body: Vec<Instruction>,
}

fn stages(all: Vec<Instruction>) -> Vec<Stage> {
    let mut out: Vec<Stage> = Vec::new();
    for i in all {
        if i.keyword == "FROM" {
            let name = match i.words.as_slice() {
                [_, as_, n] if as_.eq_ignore_ascii_case("as") => Some(n.clone()),
                _ => None,
            };
            out.push(Stage {
                name,
                from: i.words.first().cloned().unwrap_or_default(),
                body: Vec::new(),
            });
        } else if let Some(s) = out.last_mut() {
            s.body.push(i);
        }
    }
    out
}

/// (member directory, the binaries it declares: `[[bin]]` names, or the package's name
/// for a `src/main.rs`).
fn workspace_binaries() -> Vec<(String, Vec<String>)> {
    let root: toml::Table = toml::from_str(&read(&repo().join("Cargo.toml"))).unwrap();
    let members = root["workspace"]["members"].as_array().unwrap();
    members
        .iter()
        .filter_map(toml::Value::as_str)
        .map(|m| {
            let manifest: toml::Table =
                toml::from_str(&read(&repo().join(m).join("Cargo.toml"))).unwrap();
            let mut bins: Vec<String> = manifest
                .get("bin")
                .and_then(toml::Value::as_array)
                .into_iter()
                .flatten()
                .filter_map(|b| b.get("name")?.as_str().map(str::to_string))
                .collect();
            if bins.is_empty() && repo().join(m).join("src/main.rs").is_file() {
                bins.push(manifest["package"]["name"].as_str().unwrap().to_string());
            }
            (m.to_string(), bins)
        })
        .collect()
}

/// `a.b` as numbers, for comparing Rust versions.
fn version(v: &str) -> Vec<u32> {
    v.split('.').filter_map(|p| p.parse().ok()).collect()
}

/// The value of `--flag X` or `--flag=X` options in `words`.
fn options(words: &[String], flag: &str) -> Vec<String> {
    let mut out = Vec::new();
    for (i, w) in words.iter().enumerate() {
        if w == flag {
            out.extend(words.get(i + 1).cloned());
        } else if let Some(v) = w.strip_prefix(&format!("{flag}=")) {
            out.push(v.to_string());
        }
    }
    out
}

#[test]
fn container_build_file_refers_to_what_exists() {
    let path = deploy("container/Dockerfile");
    let text = read(&path);
    let all = instructions(&text);
    let args: Vec<(String, String)> = all
        .iter()
        .filter(|i| i.keyword == "ARG")
        .filter_map(|i| {
            let (k, v) = i.words.first()?.split_once('=')?;
            Some((k.to_string(), v.to_string()))
        })
        .collect();
    let stages = stages(all);
    assert!(stages.len() >= 2, "a builder stage and a runtime stage");

    // The Rust image is at least the workspace's rust-version.
    let root: toml::Table = toml::from_str(&read(&repo().join("Cargo.toml"))).unwrap();
    let needed = root["workspace"]["package"]["rust-version"]
        .as_str()
        .unwrap();
    let rust = args
        .iter()
        .find(|(k, _)| k == "RUST_VERSION")
        .map(|(_, v)| v.clone())
        .expect("ARG RUST_VERSION=…");
    assert!(
        version(&rust) >= version(needed),
        "rust {rust} is older than the workspace's rust-version {needed}"
    );

    // Sources from the build context exist; every member is among them (cargo reads each
    // member's manifest), and so is the protoc wrapper .cargo/config.toml names.
    let members = workspace_binaries();
    let mut copied = Vec::new();
    for st in &stages {
        for i in st.body.iter().filter(|i| i.keyword == "COPY") {
            if i.words.iter().any(|w| w.starts_with("--from")) {
                continue;
            }
            let paths: Vec<&String> = i.words.iter().filter(|w| !w.starts_with("--")).collect();
            let (_, sources) = paths.split_last().expect("COPY src… dst");
            for s in sources {
                assert!(
                    !s.contains(['*', '?', '[']),
                    "COPY {s}: a pattern this check cannot follow"
                );
                assert!(
                    repo().join(s).exists(),
                    "COPY {s}: no such path in the repository"
                );
                copied.push(s.trim_end_matches('/').to_string());
            }
        }
    }
    let is_copied = |p: &str| copied.iter().any(|c| Path::new(p).starts_with(c));
    for (m, _) in &members {
        assert!(
            is_copied(m),
            "workspace member {m} is not copied into the builder"
        );
    }
    for f in [
        "Cargo.toml",
        "Cargo.lock",
        ".cargo/config.toml",
        "scripts/protoc",
    ] {
        assert!(is_copied(f), "{f} is not copied into the builder");
    }

    // The builder builds declared binaries, locked, in release; the runtime copies exactly
    // those from cargo's output directory.
    let declared: BTreeSet<String> = members.iter().flat_map(|(_, b)| b.clone()).collect();
    let last = stages.last().unwrap();
    let mut shipped = BTreeSet::new();
    for i in last.body.iter().filter(|i| i.keyword == "COPY") {
        let Some(from) = options(&i.words, "--from").pop() else {
            continue;
        };
        let builder = stages
            .iter()
            .find(|s| s.name.as_deref() == Some(&from))
            .unwrap_or_else(|| panic!("COPY --from={from}: no such stage"));
        let workdir = builder
            .body
            .iter()
            .filter(|i| i.keyword == "WORKDIR")
            .filter_map(|i| i.words.first())
            .next_back()
            .expect("the builder's WORKDIR");
        let mut built = BTreeSet::new();
        for run in builder.body.iter().filter(|i| i.keyword == "RUN") {
            let Some(at) = run
                .words
                .windows(2)
                .position(|w| w[0] == "cargo" && w[1] == "build")
            else {
                continue;
            };
            let cmd = &run.words[at..];
            let cmd = &cmd[..cmd.iter().position(|w| w == "&&").unwrap_or(cmd.len())];
            assert!(
                cmd.iter().any(|w| w == "--release"),
                "cargo build without --release"
            );
            assert!(
                cmd.iter().any(|w| w == "--locked"),
                "cargo build without --locked"
            );
            built.extend(options(cmd, "--bin"));
        }
        for b in &built {
            assert!(
                declared.contains(b),
                "cargo build --bin {b}: no workspace member declares it"
            );
        }
        let paths: Vec<&String> = i.words.iter().filter(|w| !w.starts_with("--")).collect();
        let (_, sources) = paths.split_last().expect("COPY src… dst");
        for s in sources {
            let bin = s
                .strip_prefix(&format!("{workdir}/target/release/"))
                .unwrap_or_else(|| {
                    panic!("COPY --from={from} {s}: not cargo's release output in {workdir}")
                });
            assert!(
                built.contains(bin),
                "COPY --from={from} {s}: {bin} is not built there"
            );
            // Without their line tables (the release profile keeps them: 80 % of the size).
            let relative = format!("target/release/{bin}");
            assert!(
                builder.body.iter().any(|r| r.keyword == "RUN"
                    && r.words.first().is_some_and(|w| w == "strip")
                    && r.words
                        .iter()
                        .any(|w| w == "--strip-debug" || w == "--strip-all")
                    && r.words.iter().any(|w| *w == **s || *w == relative)),
                "{s} is shipped with its debug info: no `strip --strip-debug` of it in {from}"
            );
            shipped.insert(bin.to_string());
        }
        assert_eq!(
            shipped, built,
            "what the builder builds is what the image holds"
        );
    }
    for needed in ["transferd", "shardcast-controller", "shardcast"] {
        assert!(shipped.contains(needed), "the image lacks {needed}");
    }

    // The runtime stage compiles nothing and runs as a non-root user.
    assert!(
        !last.from.contains("rust"),
        "the runtime stage starts from {}, a compiler image",
        last.from
    );
    assert!(
        !last
            .body
            .iter()
            .any(|i| i.keyword == "RUN" && i.words.iter().any(|w| w == "cargo")),
        "the runtime stage runs cargo"
    );
    let user = last
        .body
        .iter()
        .filter(|i| i.keyword == "USER")
        .filter_map(|i| i.words.first())
        .next_back()
        .expect("a USER in the runtime stage");
    let uid = user.split(':').next().unwrap_or(user);
    assert!(uid != "0" && uid != "root", "the image runs as {user}");

    // The build command in the file tags what the docs document, and the context leaves
    // build output out.
    let image = documented_image();
    assert!(
        text.lines()
            .any(|l| l.contains("docker build") && l.contains(&format!("-t {image} "))),
        "the Dockerfile's build command does not tag {image}, as deploy/README.md does"
    );
    let ignore = read(&deploy("container/Dockerfile.dockerignore"));
    assert!(
        ignore.lines().any(|l| l.trim() == "target"),
        "target/ is sent as build context"
    );
}
