//! origin_server (in progress).
