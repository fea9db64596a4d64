//! transferd
