//! Every table the CLI prints, drawn by [`comfy_table`] in one style: no borders, no rules,
//! no box-drawing characters — a header row, then one line per row, columns left-aligned
//! with two spaces between them and no trailing blanks. It reads the same on a terminal and
//! in a log or `grep`, and never wraps to the terminal's width (a long cell makes its
//! column wider instead).

use comfy_table::presets::NOTHING;
use comfy_table::{ContentArrangement, Table};

/// Spaces between two columns.
const GAP: u16 = 2;

/// A table of `headers` and `rows`, each line ending with a newline. A cell with a newline
/// takes several lines of its row.
pub(crate) fn table<R>(headers: &[&str], rows: R) -> String
where
    R: IntoIterator<Item = Vec<String>>,
{
    let mut t = Table::new();
    t.load_preset(NOTHING)
        .set_content_arrangement(ContentArrangement::Disabled)
        .set_header(headers.iter().copied())
        .add_rows(rows);
    let last = t.column_count().saturating_sub(1);
    for (i, column) in t.column_iter_mut().enumerate() {
        column.set_padding((0, if i == last { 0 } else { GAP }));
    }
    let mut out = t.trim_fmt();
    out.push('\n');
    out
}

/// [`table`], or the line `empty` alone when there are no rows (e.g. `no hosts`).
pub(crate) fn table_or<R>(headers: &[&str], rows: R, empty: &str) -> String
where
    R: IntoIterator<Item = Vec<String>>,
{
    let mut rows = rows.into_iter().peekable();
    if rows.peek().is_none() {
        return format!("{empty}\n");
    }
    table(headers, rows)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cells(row: &[&str]) -> Vec<String> {
        row.iter().map(|c| (*c).to_string()).collect()
    }

    #[test]
    fn columns_are_aligned_two_spaces_apart_without_trailing_blanks() {
        let t = table(
            &["A", "LONGER"],
            vec![cells(&["xyz", "1"]), cells(&["q", "22"])],
        );
        assert_eq!(t, "A    LONGER\nxyz  1\nq    22\n");
    }

    #[test]
    fn a_wide_last_column_widens_nothing_else_and_short_cells_are_not_padded() {
        let t = table(
            &["HOST", "STATE", "NOTE"],
            vec![
                cells(&["h1", "done", ""]),
                cells(&["host-22", "failed", "ENOSPC writing shard 3"]),
            ],
        );
        assert_eq!(
            t,
            "HOST     STATE   NOTE\n\
             h1       done\n\
             host-22  failed  ENOSPC writing shard 3\n"
        );
    }

    #[test]
    fn width_counts_characters_not_bytes() {
        let t = table(
            &["CHAIN", "BYTES"],
            vec![
                cells(&["a → b → c", "1 MiB"]),
                cells(&["abcdefghij", "2 MiB"]),
            ],
        );
        assert_eq!(
            t,
            "CHAIN       BYTES\na → b → c   1 MiB\nabcdefghij  2 MiB\n"
        );
    }

    #[test]
    fn no_box_drawing_or_rules() {
        let t = table(&["X", "Y"], vec![cells(&["1", "2"])]);
        assert!(
            !t.chars()
                .any(|c| matches!(c, '|' | '+' | '-' | '=' | '│' | '─' | '┌' | '╭')),
            "{t}"
        );
        assert_eq!(t.lines().count(), 2, "{t}");
    }

    #[test]
    fn a_header_alone_when_there_are_no_rows() {
        assert_eq!(table(&["A", "B"], Vec::<Vec<String>>::new()), "A  B\n");
    }

    #[test]
    fn the_empty_line_instead_of_an_empty_table() {
        assert_eq!(
            table_or(&["A", "B"], Vec::<Vec<String>>::new(), "no things"),
            "no things\n"
        );
        assert_eq!(
            table_or(&["A", "B"], vec![cells(&["1", "2"])], "no things"),
            "A  B\n1  2\n"
        );
    }
}
