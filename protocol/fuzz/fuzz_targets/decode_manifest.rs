//! Feeds arbitrary bytes to `Manifest::decode` (and `ChunkSet::decode`); any accepted
//! manifest must re-encode to exactly its input bytes, decode again to the same manifest,
//! have `encoded_len` equal to its encoding's length and a digest equal to the BLAKE3 of it.
//!
//! The checks live in `protocol/tests/support/fuzz_checks.rs`, shared with the stable-Rust
//! smoke test in `protocol/tests/robustness.rs`.

#![no_main]

#[path = "../../tests/support/fuzz_checks.rs"]
#[allow(dead_code)] // check_frame_bytes is used by the other target
mod fuzz_checks;

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    fuzz_checks::check_manifest_bytes(data);
});
