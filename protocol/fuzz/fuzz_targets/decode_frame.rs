//! Feeds arbitrary bytes to `Frame::decode` and to `FrameHeader::parse` + `Frame::decode_body`;
//! both must agree, never panic, and any accepted frame must re-encode to exactly the bytes it
//! was decoded from and decode again to the same frame.
//!
//! The checks live in `protocol/tests/support/fuzz_checks.rs`, shared with the stable-Rust
//! smoke test in `protocol/tests/robustness.rs`.

#![no_main]

#[path = "../../tests/support/fuzz_checks.rs"]
#[allow(dead_code)] // check_manifest_bytes is used by the other target
mod fuzz_checks;

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    fuzz_checks::check_frame_bytes(data);
});
