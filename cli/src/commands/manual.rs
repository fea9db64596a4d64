//! `shardcast completions <shell>` and `shardcast man [--out DIR]`: generated from the
//! command line's own definition ([`Cli`]), so they list exactly the subcommands and flags
//! this build has (clap_complete, clap_mangen). No controller is contacted.

use std::io::Write;
use std::path::{Path, PathBuf};

use clap::CommandFactory;

use crate::args::Cli;
use crate::error::CliError;

/// The binary's name in completions and man pages.
const BIN: &str = "shardcast";

fn io_error(what: &str, e: std::io::Error) -> CliError {
    CliError {
        exit: 1,
        message: format!("{what}: {e}"),
    }
}

/// Writes the completion script for `shell` to `out`.
pub(crate) fn completions(
    shell: clap_complete::Shell,
    out: &mut dyn Write,
) -> Result<(), CliError> {
    let mut cmd = Cli::command();
    clap_complete::generate(shell, &mut cmd, BIN, out);
    out.flush().map_err(|e| io_error("writing completions", e))
}

/// Writes the top page, `shardcast(1)` (its subcommands listed), to `out`.
pub(crate) fn page(out: &mut dyn Write) -> Result<(), CliError> {
    let mut cmd = Cli::command().disable_help_subcommand(true);
    cmd.build();
    clap_mangen::Man::new(cmd)
        .render(out)
        .map_err(|e| io_error("writing the man page", e))
}

/// Writes one page per command and subcommand into `dir` (created if missing); the pages
/// written, sorted.
pub(crate) fn pages(dir: &Path) -> Result<Vec<PathBuf>, CliError> {
    std::fs::create_dir_all(dir)
        .map_err(|e| io_error(&format!("creating {}", dir.display()), e))?;
    clap_mangen::generate_to(Cli::command(), dir)
        .map_err(|e| io_error(&format!("writing man pages into {}", dir.display()), e))?;
    let mut written = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(|e| io_error("listing the pages", e))? {
        let path = entry.map_err(|e| io_error("listing the pages", e))?.path();
        let name = path
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or_default();
        if name.starts_with(BIN) && name.ends_with(".1") {
            written.push(path);
        }
    }
    written.sort();
    Ok(written)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every subcommand's name, at every depth (`certs`, `certs init`, …), as the user types it.
    fn subcommands(cmd: &clap::Command, prefix: &str, out: &mut Vec<String>) {
        for sub in cmd.get_subcommands() {
            let path = format!("{prefix}{}", sub.get_name());
            out.push(path.clone());
            subcommands(sub, &format!("{path} "), out);
        }
    }

    #[test]
    fn bash_completions_offer_every_subcommand() {
        let mut script = Vec::new();
        completions(clap_complete::Shell::Bash, &mut script).unwrap();
        let script = String::from_utf8(script).unwrap();
        let mut names = Vec::new();
        subcommands(&Cli::command(), "", &mut names);
        assert!(names.len() >= 20, "{names:?}");
        for name in &names {
            let leaf = name.rsplit(' ').next().unwrap();
            // clap_complete offers each subcommand's name in its parent's word list.
            assert!(
                script.contains(&format!(" {leaf} ")) || script.contains(&format!(" {leaf}\"")),
                "bash completions lack {name}"
            );
        }
        assert!(script.contains("complete -F _shardcast"), "{script}");
        // Flags too.
        assert!(script.contains("--controller") && script.contains("--tls-cert"));
    }

    #[test]
    fn every_shell_gets_a_script() {
        use clap::ValueEnum;
        for shell in clap_complete::Shell::value_variants() {
            let mut script = Vec::new();
            completions(*shell, &mut script).unwrap();
            let script = String::from_utf8(script).unwrap();
            assert!(
                script.contains("prewarm") && script.contains("scale-out"),
                "{shell}"
            );
        }
    }

    #[test]
    fn man_pages_are_written_for_every_subcommand() {
        let dir = tempfile::tempdir().unwrap();
        let written = pages(dir.path()).unwrap();
        let mut names = Vec::new();
        subcommands(&Cli::command(), "", &mut names);
        let mut expected: Vec<PathBuf> = names
            .iter()
            .map(|n| dir.path().join(format!("{BIN}-{}.1", n.replace(' ', "-"))))
            .collect();
        expected.push(dir.path().join(format!("{BIN}.1")));
        expected.sort();
        assert_eq!(written, expected);
        for p in &written {
            let page = std::fs::read_to_string(p).unwrap();
            assert!(
                page.starts_with(".ie") || page.contains(".TH"),
                "{}",
                p.display()
            );
            assert!(page.contains(".SH NAME"), "{}", p.display());
        }
        let prewarm = std::fs::read_to_string(dir.path().join("shardcast-prewarm.1")).unwrap();
        assert!(prewarm.contains("replicas"), "{prewarm}");
        // The top page lists the subcommands.
        let mut top = Vec::new();
        page(&mut top).unwrap();
        let top = String::from_utf8(top).unwrap();
        assert!(
            top.contains("shardcast\\-prewarm(1)") || top.contains("prewarm"),
            "{top}"
        );
    }
}
