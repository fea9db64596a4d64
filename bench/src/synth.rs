//! synth (in progress).
