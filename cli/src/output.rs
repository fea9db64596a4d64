//! Where a command's result goes: text (tables drawn by [`crate::table`]) on stdout, or
//! with `--json` the API's message as pretty JSON.

use serde::Serialize;

/// How a command prints its result: the global `--json` flag.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Output {
    /// Print the API's messages as JSON instead of tables and lines.
    pub(crate) json: bool,
}

impl Output {
    /// Prints `msg` as JSON with `--json`, else the text `text` renders from it (which ends
    /// with a newline).
    pub(crate) fn show<T: Serialize>(self, msg: &T, text: impl FnOnce(&T) -> String) {
        if self.json {
            print_json(msg);
        } else {
            print!("{}", text(msg));
        }
    }
}

/// Pretty JSON on stdout (what every `--json` prints).
pub(crate) fn print_json<T: Serialize>(v: &T) {
    match serde_json::to_string_pretty(v) {
        Ok(s) => println!("{s}"),
        Err(e) => eprintln!("cannot encode JSON: {e}"),
    }
}

/// "up" or "DOWN".
pub(crate) fn up_down(up: bool) -> String {
    if up { "up" } else { "DOWN" }.to_string()
}

/// A digest's first 12 characters, as tables show it.
pub(crate) fn short(digest: &str) -> String {
    digest.chars().take(12).collect()
}
