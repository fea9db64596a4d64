//! Origin fetch (in progress).
