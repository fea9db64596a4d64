//! netns (in progress).
