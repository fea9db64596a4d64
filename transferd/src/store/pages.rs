//! Which pages a tier's file system gives the store's files.
//!
//! A chunk written into a new shard file on tmpfs costs a page allocation per 4 KiB as
//! well as the copy: `store_write` measured fresh 4 KiB pages at 2.2 GiB/s against
//! 11.0 GiB/s on a tmpfs mounted with `huge=within_size` (docs/BENCHMARKS.md, issue #16),
//! and the receiving hop pays it for every byte. The store cannot choose the mount, so it
//! finds out what the memory tier has, logs it at start-up (with a hint when huge pages
//! would help) and exports it as a metric.

use std::path::{Path, PathBuf};

/// The file system a tier root is on, from `/proc/self/mountinfo` (serialised in the
/// bench's reports as the machine's `memory_tier`).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct TierFs {
    /// Where that file system is mounted.
    pub mount_point: PathBuf,
    /// Its type: `tmpfs`, `ext4`, …
    pub fs_type: String,
    /// For tmpfs: its `huge=` policy (`never` when the mount names none), overridden by
    /// the kernel-wide `shmem_enabled` setting when that is `deny` or `force`.
    pub huge: Option<String>,
}

impl TierFs {
    /// Finds the file system `root` is on; `None` where `/proc` cannot tell.
    pub fn of(root: &Path) -> Option<Self> {
        let root = std::fs::canonicalize(root).ok()?;
        let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
        let mut fs = parse_mountinfo(&mountinfo, &root)?;
        if fs.huge.is_some() {
            let kernel =
                std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/shmem_enabled");
            if let Some(forced) = kernel.ok().as_deref().and_then(forced_shmem_policy) {
                fs.huge = Some(forced.to_owned());
            }
        }
        Some(fs)
    }

    /// Whether new pages of files here can be huge (2 MiB) pages.
    pub fn huge_pages(&self) -> bool {
        matches!(
            self.huge.as_deref(),
            Some("always" | "within_size" | "advise" | "force")
        )
    }
}

/// The entry of `mountinfo` whose mount point holds `path` (the deepest, and of stacked
/// mounts on one point the last, which is the one visible).
fn parse_mountinfo(mountinfo: &str, path: &Path) -> Option<TierFs> {
    let mut best: Option<TierFs> = None;
    for line in mountinfo.lines() {
        // id parent major:minor root mount-point options [optional…] - type source super
        let (pre, post) = match line.split_once(" - ") {
            Some(parts) => parts,
            None => continue,
        };
        let Some(mount_point) = pre.split(' ').nth(4).map(unescape) else {
            continue;
        };
        let mut post = post.split(' ');
        let (Some(fs_type), Some(_source), Some(options)) = (post.next(), post.next(), post.next())
        else {
            continue;
        };
        let mount_point = PathBuf::from(mount_point);
        if !path.starts_with(&mount_point) {
            continue;
        }
        if best
            .as_ref()
            .is_some_and(|b| b.mount_point.components().count() > mount_point.components().count())
        {
            continue;
        }
        let huge = (fs_type == "tmpfs").then(|| {
            options
                .split(',')
                .find_map(|o| o.strip_prefix("huge="))
                .unwrap_or("never")
                .to_owned()
        });
        best = Some(TierFs {
            mount_point,
            fs_type: fs_type.to_owned(),
            huge,
        });
    }
    best
}

/// `shmem_enabled`'s kernel-wide override, when it has one: the selected value is in
/// brackets (`always within_size advise [never] deny force`).
fn forced_shmem_policy(text: &str) -> Option<&str> {
    let selected = text
        .split_whitespace()
        .find(|w| w.starts_with('['))?
        .trim_matches(['[', ']']);
    matches!(selected, "deny" | "force").then_some(selected)
}

/// Mount points escape space, tab, newline and backslash as octal (`\040`).
fn unescape(field: &str) -> String {
    let bytes = field.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let octal = bytes
            .get(i + 1..i + 4)
            .filter(|d| bytes[i] == b'\\' && d.iter().all(|c| (b'0'..=b'7').contains(c)))
            .and_then(|d| u8::from_str_radix(std::str::from_utf8(d).ok()?, 8).ok());
        match octal {
            Some(b) => {
                out.push(b);
                i += 4;
            }
            None => {
                out.push(bytes[i]);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    const MOUNTINFO: &str = "\
22 1 0:21 / / rw,relatime shared:1 - ext4 /dev/vda rw
25 22 0:23 / /dev/shm rw,nosuid,nodev shared:3 - tmpfs tmpfs rw,size=12g
26 22 0:24 / /mnt/huge\\040tier rw,relatime shared:4 - tmpfs tmpfs rw,size=8g,huge=within_size
27 22 0:25 / /mnt/stack rw - tmpfs tmpfs rw,huge=always
28 22 0:26 / /mnt/stack rw - tmpfs tmpfs rw
29 22 0:27 / /srv/models rw,relatime - xfs /dev/vdb rw
";

    fn at(path: &str) -> TierFs {
        parse_mountinfo(MOUNTINFO, Path::new(path)).expect("a mount holds every path")
    }

    #[test]
    fn the_deepest_mount_holding_the_path_is_the_tiers() {
        let shm = at("/dev/shm/shardcast/mem");
        assert_eq!(shm.mount_point, Path::new("/dev/shm"));
        assert_eq!(shm.fs_type, "tmpfs");
        assert_eq!(shm.huge.as_deref(), Some("never"));
        assert!(!shm.huge_pages());

        let huge = at("/mnt/huge tier/mem");
        assert_eq!(huge.mount_point, Path::new("/mnt/huge tier"));
        assert_eq!(huge.huge.as_deref(), Some("within_size"));
        assert!(huge.huge_pages());

        let disk = at("/srv/models/disk");
        assert_eq!(disk.fs_type, "xfs");
        assert_eq!(disk.huge, None);
        assert!(!disk.huge_pages());

        // Not a prefix by components: `/dev/shmx` is on the root file system.
        assert_eq!(at("/dev/shmx").fs_type, "ext4");
    }

    #[test]
    fn of_mounts_stacked_on_one_point_the_last_is_visible() {
        assert_eq!(at("/mnt/stack/mem").huge.as_deref(), Some("never"));
    }

    #[test]
    fn the_kernel_wide_setting_overrides_only_when_it_forces_or_denies() {
        assert_eq!(
            forced_shmem_policy("always within_size advise [never] deny force\n"),
            None
        );
        assert_eq!(
            forced_shmem_policy("always within_size advise never [deny] force\n"),
            Some("deny")
        );
        assert_eq!(
            forced_shmem_policy("always within_size advise never deny [force]"),
            Some("force")
        );
        assert_eq!(forced_shmem_policy(""), None);
    }

    #[test]
    fn malformed_lines_are_skipped_not_fatal() {
        let text = "garbage\n1 2 3\n - \n22 1 0:21 / / rw - ext4 /dev/vda rw\n";
        assert_eq!(
            parse_mountinfo(text, Path::new("/x")).map(|f| f.fs_type),
            Some("ext4".to_owned())
        );
        assert_eq!(unescape("a\\040b\\\\c\\9"), "a b\\\\c\\9");
    }

    #[test]
    fn this_hosts_mounts_are_read() {
        let root = TierFs::of(Path::new("/")).expect("/proc/self/mountinfo names the root");
        assert_eq!(root.mount_point, Path::new("/"));
        assert!(!root.fs_type.is_empty());
        let dir = tempfile::tempdir().unwrap();
        let tmp = TierFs::of(dir.path()).expect("a temporary directory is on some mount");
        assert!(
            dir.path()
                .canonicalize()
                .unwrap()
                .starts_with(&tmp.mount_point)
        );
    }
}
