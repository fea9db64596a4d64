//! The controller's source keeps its shape: no file over [`MAX_LINES`] lines (test files
//! aside), and no circle among the imports of its top-level modules (`core/…` counts as
//! `core`, `ha/switch.rs` as `ha`), so each module can be read with only the ones below it
//! in mind.
//!
//! An import is any path that starts at `crate::` or climbs out of its module with
//! `super::` — in a `use` or inline (`crate::tiers::TierConfig { … }`) — outside comments,
//! string literals and `#[cfg(test)]` items; tests may reach anywhere. The source is read
//! with a small lexer (comments, strings, chars) and a walk over its tokens, not a Rust
//! parser: what it reads is this crate's own code, and a change it misreads fails here
//! naming the file.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// A source file longer than this is split (issue 30: a file a reader can hold).
const MAX_LINES: usize = 800;

/// Every `.rs` file under `dir`, sorted.
fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let mut entries: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("reading {}: {e}", dir.display()))
        .map(|e| e.expect("a directory entry").path())
        .collect();
    entries.sort();
    for p in entries {
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// A test module's file: `tests.rs`, or anything beneath a `tests/` folder.
fn is_test_file(rel: &Path) -> bool {
    rel.components()
        .any(|c| c.as_os_str() == "tests" || c.as_os_str() == "tests.rs")
}

/// The source with comments, string and char literals blanked (lifetimes kept).
fn strip(src: &str) -> String {
    let s: Vec<char> = src.chars().collect();
    let mut out = String::with_capacity(src.len());
    let ident = |c: char| c.is_alphanumeric() || c == '_';
    let mut i = 0;
    while i < s.len() {
        let c = s[i];
        let next = s.get(i + 1).copied();
        let prev_ident = i > 0 && ident(s[i - 1]);
        if c == '/' && next == Some('/') {
            while i < s.len() && s[i] != '\n' {
                i += 1;
            }
        } else if c == '/' && next == Some('*') {
            let mut depth = 0;
            while i < s.len() {
                if s[i] == '/' && s.get(i + 1) == Some(&'*') {
                    depth += 1;
                    i += 2;
                } else if s[i] == '*' && s.get(i + 1) == Some(&'/') {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    i += 1;
                }
            }
            out.push(' ');
        } else if !prev_ident && (c == 'r' || (c == 'b' && next == Some('r'))) && {
            // A raw string: r"…", r#"…"#, br"…".
            let mut j = i + if c == 'b' { 2 } else { 1 };
            while s.get(j) == Some(&'#') {
                j += 1;
            }
            s.get(j) == Some(&'"')
        } {
            let mut j = i + if c == 'b' { 2 } else { 1 };
            let mut hashes = 0;
            while s[j] == '#' {
                hashes += 1;
                j += 1;
            }
            j += 1;
            loop {
                if j >= s.len() {
                    break;
                }
                if s[j] == '"' && (1..=hashes).all(|k| s.get(j + k) == Some(&'#')) {
                    j += 1 + hashes;
                    break;
                }
                j += 1;
            }
            i = j;
            out.push_str("\"\"");
        } else if c == '"' {
            i += 1;
            while i < s.len() && s[i] != '"' {
                i += if s[i] == '\\' { 2 } else { 1 };
            }
            i += 1;
            out.push_str("\"\"");
        } else if c == '\'' && (next == Some('\\') || s.get(i + 2) == Some(&'\'')) {
            // A char literal ('x', '\n', '\''); a lifetime ('a) has no closing quote there.
            i += if next == Some('\\') { 3 } else { 2 };
            while i < s.len() && s[i] != '\'' {
                i += 1;
            }
            i += 1;
            out.push_str("' '");
        } else {
            out.push(c);
            i += 1;
        }
    }
    out
}

/// Identifiers and the punctuation the walk needs (`::` as one token).
fn tokens(src: &str) -> Vec<String> {
    let s: Vec<char> = src.chars().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < s.len() {
        let c = s[i];
        if c.is_alphanumeric() || c == '_' {
            let start = i;
            while i < s.len() && (s[i].is_alphanumeric() || s[i] == '_') {
                i += 1;
            }
            out.push(s[start..i].iter().collect());
        } else if c == ':' && s.get(i + 1) == Some(&':') {
            out.push("::".into());
            i += 2;
        } else if c.is_whitespace() {
            i += 1;
        } else {
            out.push(c.to_string());
            i += 1;
        }
    }
    out
}

/// Where the item starting at `i` (after its attributes) ends: past its `;` or its
/// outermost `{…}`.
fn item_end(t: &[String], mut i: usize) -> usize {
    let mut depth = 0usize;
    while i < t.len() {
        match t[i].as_str() {
            "{" => depth += 1,
            "}" => {
                depth = depth.saturating_sub(1);
                if depth == 0 {
                    return i + 1;
                }
            }
            ";" if depth == 0 => return i + 1,
            _ => {}
        }
        i += 1;
    }
    i
}

/// The first segment of each path a `{…}` group starting at `t[i] == "{"` imports, and
/// the index past the group.
fn group_heads(t: &[String], mut i: usize) -> (Vec<String>, usize) {
    let mut heads = Vec::new();
    let mut depth = 0;
    let mut expect_head = true;
    while i < t.len() {
        match t[i].as_str() {
            "{" => {
                depth += 1;
                expect_head = depth == 1;
            }
            "}" => {
                depth -= 1;
                if depth == 0 {
                    return (heads, i + 1);
                }
            }
            "," if depth == 1 => expect_head = true,
            tok if expect_head && depth == 1 => {
                heads.push(tok.to_string());
                expect_head = false;
            }
            _ => {}
        }
        i += 1;
    }
    (heads, i)
}

/// The top-level modules the non-test code of one file, whose module path is `module`,
/// imports.
fn imports(src: &str, module: &[String]) -> BTreeSet<String> {
    let t = tokens(&strip(src));
    let mut found = BTreeSet::new();
    // Inline `mod name { … }` blocks: (their name, the brace depth inside them).
    let mut inline: Vec<usize> = Vec::new();
    let mut path: Vec<String> = module.to_vec();
    let mut depth = 0usize;
    let mut i = 0;
    while i < t.len() {
        let tok = t[i].as_str();
        if tok == "#"
            && t.get(i + 1..i + 7)
                .is_some_and(|w| w.join("") == "[cfg(test)]")
        {
            // Skip the attribute, any further ones, then the item.
            let mut j = i + 7;
            while t.get(j).map(String::as_str) == Some("#") {
                j = item_end_attr(&t, j);
            }
            i = item_end(&t, j);
            continue;
        }
        match tok {
            "mod" if t.get(i + 2).map(String::as_str) == Some("{") => {
                path.push(t[i + 1].clone());
                depth += 1;
                inline.push(depth);
                i += 3;
                continue;
            }
            "{" => depth += 1,
            "}" => {
                if inline.last() == Some(&depth) {
                    inline.pop();
                    path.pop();
                }
                depth = depth.saturating_sub(1);
            }
            "crate" | "super" if t.get(i + 1).map(String::as_str) == Some("::") => {
                let after_sep = i > 0 && t[i - 1] == "::";
                if !after_sep {
                    let mut base: Option<Vec<String>> = Some(path.clone());
                    let mut j = i;
                    if tok == "crate" {
                        base = Some(Vec::new());
                        j += 2;
                    } else {
                        while t.get(j).map(String::as_str) == Some("super")
                            && t.get(j + 1).map(String::as_str) == Some("::")
                        {
                            base = base.and_then(|mut b| b.pop().map(|_| b));
                            j += 2;
                        }
                    }
                    let heads = match t.get(j).map(String::as_str) {
                        Some("{") => group_heads(&t, j).0,
                        Some(h) => vec![h.to_string()],
                        None => Vec::new(),
                    };
                    match base {
                        Some(b) if b.is_empty() => found.extend(heads),
                        Some(b) => {
                            found.insert(b[0].clone());
                        }
                        None => panic!("`super::` above the crate root in module {module:?}"),
                    }
                }
            }
            _ => {}
        }
        i += 1;
    }
    found
}

/// Past the attribute `#[…]` starting at `t[i] == "#"`.
fn item_end_attr(t: &[String], i: usize) -> usize {
    let mut depth = 0;
    let mut j = i + 1;
    while j < t.len() {
        match t[j].as_str() {
            "[" => depth += 1,
            "]" => {
                depth -= 1;
                if depth == 0 {
                    return j + 1;
                }
            }
            _ => {}
        }
        j += 1;
    }
    j
}

/// A file's module path under `src/`: `core/runner.rs` is `[core, runner]`,
/// `ha/mod.rs` is `[ha]`.
fn module_path(rel: &Path) -> Vec<String> {
    let mut parts: Vec<String> = rel
        .iter()
        .map(|c| c.to_string_lossy().into_owned())
        .collect();
    let last = parts.pop().expect("a file name");
    if last != "mod.rs" {
        parts.push(last.trim_end_matches(".rs").to_string());
    }
    parts
}

/// One import circle in `edges` (as `a -> b -> … -> a`), if there is one.
fn find_cycle(edges: &BTreeMap<String, BTreeSet<String>>) -> Option<Vec<String>> {
    fn visit(
        v: &str,
        edges: &BTreeMap<String, BTreeSet<String>>,
        done: &mut BTreeSet<String>,
        stack: &mut Vec<String>,
    ) -> Option<Vec<String>> {
        if let Some(at) = stack.iter().position(|s| s == v) {
            let mut cycle = stack[at..].to_vec();
            cycle.push(v.to_string());
            return Some(cycle);
        }
        if done.contains(v) {
            return None;
        }
        stack.push(v.to_string());
        for w in edges.get(v).into_iter().flatten() {
            if let Some(c) = visit(w, edges, done, stack) {
                return Some(c);
            }
        }
        stack.pop();
        done.insert(v.to_string());
        None
    }
    let mut done = BTreeSet::new();
    edges
        .keys()
        .find_map(|v| visit(v, edges, &mut done, &mut Vec::new()))
}

/// The controller's `src/`: (path under it, text) of every `.rs` file.
fn sources() -> Vec<(PathBuf, String)> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    files
        .into_iter()
        .map(|p| {
            let text = std::fs::read_to_string(&p)
                .unwrap_or_else(|e| panic!("reading {}: {e}", p.display()));
            (p.strip_prefix(&src).expect("under src").to_path_buf(), text)
        })
        .collect()
}

/// The top-level modules `lib.rs` declares.
fn top_modules(lib: &str) -> BTreeSet<String> {
    let t = tokens(&strip(lib));
    t.windows(3)
        .filter(|w| w[0] == "mod" && w[2] == ";")
        .map(|w| w[1].clone())
        .collect()
}

/// Edges `from -> to` between top-level modules, each with the files it comes from.
fn module_graph() -> BTreeMap<(String, String), Vec<PathBuf>> {
    let files = sources();
    let lib = &files
        .iter()
        .find(|(p, _)| p == Path::new("lib.rs"))
        .expect("src/lib.rs")
        .1;
    let tops = top_modules(lib);
    assert!(
        tops.contains("core") && tops.contains("server"),
        "lib.rs declares {tops:?}"
    );
    let mut graph: BTreeMap<(String, String), Vec<PathBuf>> = BTreeMap::new();
    for (rel, text) in &files {
        // The binary is a crate of its own; lib.rs is the root, not a module.
        if is_test_file(rel) || rel.starts_with("bin") || rel == Path::new("lib.rs") {
            continue;
        }
        let module = module_path(rel);
        let from = &module[0];
        assert!(
            tops.contains(from),
            "{} is in no module of lib.rs",
            rel.display()
        );
        for to in imports(text, &module) {
            if tops.contains(&to) && &to != from {
                graph
                    .entry((from.clone(), to))
                    .or_default()
                    .push(rel.clone());
            }
        }
    }
    graph
}

#[test]
fn no_controller_source_file_is_over_800_lines() {
    let long: Vec<String> = sources()
        .iter()
        .filter(|(rel, _)| !is_test_file(rel))
        .filter(|(_, text)| text.lines().count() > MAX_LINES)
        .map(|(rel, text)| format!("src/{} ({} lines)", rel.display(), text.lines().count()))
        .collect();
    assert!(
        long.is_empty(),
        "over {MAX_LINES} lines: {} — split it (tests into a tests.rs beside it, or a part \
         into a submodule)",
        long.join(", ")
    );
}

#[test]
fn the_controllers_modules_import_in_no_circle() {
    let graph = module_graph();
    // The graph is not empty and reads what is plainly there (a check of the reader).
    assert!(
        graph.contains_key(&("server".into(), "core".into())),
        "{graph:?}"
    );
    assert!(
        graph.contains_key(&("ha".into(), "etcd".into())),
        "{graph:?}"
    );
    let mut edges: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (from, to) in graph.keys() {
        edges.entry(from.clone()).or_default().insert(to.clone());
    }
    if let Some(cycle) = find_cycle(&edges) {
        let steps: Vec<String> = cycle
            .windows(2)
            .map(|w| {
                let files = &graph[&(w[0].clone(), w[1].clone())];
                let files: Vec<String> = files
                    .iter()
                    .map(|f| format!("src/{}", f.display()))
                    .collect();
                format!("{} -> {} ({})", w[0], w[1], files.join(", "))
            })
            .collect();
        panic!(
            "the controller's modules import in a circle: {}",
            steps.join("; ")
        );
    }
}

#[test]
fn the_reader_sees_imports_in_uses_paths_and_groups_but_not_in_tests_or_text() {
    let src = r##"
        use crate::{plan::{PlanState, ReceiverState}, state};
        use super::events::Event;
        pub(crate) fn f() -> crate::wire::X { crate::lock(&x); }
        // crate::commented::Out
        const S: &str = "crate::quoted::Out";
        const R: &str = r#"crate::raw::Out"#;
        const C: char = '"'; fn g<'a>(x: &'a str) -> super::super::usage::U { x.into() }
        mod inner { use super::super::super::tiers::T; use super::local::L; }
        #[cfg(test)]
        mod tests { use crate::ha::Test; }
        #[cfg(test)]
        use crate::etcd::Test;
    "##;
    // As `core/runner.rs`: `super` is `core`, `super::super` the crate root.
    let got = imports(src, &["core".into(), "runner".into()]);
    let want: BTreeSet<String> = ["plan", "state", "core", "wire", "lock", "usage", "tiers"]
        .map(String::from)
        .into();
    assert_eq!(got, want);
    // A cycle is found and named; a ladder is not one.
    let mut edges: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (a, b) in [("a", "b"), ("b", "c"), ("a", "c")] {
        edges.entry(a.into()).or_default().insert(b.into());
    }
    assert_eq!(find_cycle(&edges), None);
    edges.entry("c".into()).or_default().insert("a".into());
    assert_eq!(
        find_cycle(&edges),
        Some(["a", "b", "c", "a"].map(String::from).to_vec())
    );
}
