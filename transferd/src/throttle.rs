//! Rate limiting (in progress).
