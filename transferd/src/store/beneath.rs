//! A tier root opened once, and every path beneath it resolved without following symlinks.
//!
//! The memory tier usually lives in `/dev/shm`, where every local user can create entries.
//! A local user who plants `models/<digest>` (or any other store path) as a symlink must not
//! make the daemon read, write or delete anything outside the store. So the store never
//! hands a path string to the file system: [`TierDir`] holds a file descriptor of the tier
//! root, checked at start-up (owned by the daemon's effective uid, not writable by group or
//! others, tightened to the store's modes), and opens everything beneath it with
//! `openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS)`. Kernels without
//! `openat2` (before 5.6, or a seccomp filter answering `ENOSYS`) get the equivalent walk:
//! one `openat(O_DIRECTORY | O_NOFOLLOW)` per component. Names are checked to be plain
//! components first (no `/` at the start, no `.` or `..`), so the walk cannot leave the root.
//!
//! A symlink met on the way is refused with [`StoreError::Symlink`], counted in
//! [`StoreStats::symlinks_refused`] and logged. Removal ([`TierDir::remove_tree`]) unlinks
//! a symlink it meets instead of descending through it.
//!
//! Modes: directories `0700` and files `0600`, or `0750`/`0640` with the group set to the
//! configured `store_group` so that inference processes in that group can map the memory
//! tier. Modes are set with `fchmod` after creation, so the daemon's umask does not matter.

use std::ffi::OsStr;
use std::fs::File;
use std::io::{self, Read, Write};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::DirBuilderExt;
use std::path::{Component, Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use rustix::fs::{self as rfs, AtFlags, FileType, Mode, OFlags, ResolveFlags};
use rustix::io::Errno;

use super::{StoreError, StoreStats};

/// Deepest directory nesting [`TierDir::remove_tree`] descends (shard paths are far
/// shallower; this only bounds the recursion on a tree someone else built).
const MAX_DEPTH: usize = 64;
/// Suffix of the store's temporary files (atomic replacement of manifests and bitmaps).
pub(super) const TMP_SUFFIX: &str = ".tmp";

/// Modes and group for what the store creates.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Perms {
    /// Group of every directory and file, when inference processes need to read them.
    pub(super) gid: Option<u32>,
}

impl Perms {
    /// `0700`, or `0750` with a group.
    pub(super) fn dir_mode(self) -> u32 {
        if self.gid.is_some() { 0o750 } else { 0o700 }
    }

    /// `0600`, or `0640` with a group.
    pub(super) fn file_mode(self) -> u32 {
        if self.gid.is_some() { 0o640 } else { 0o600 }
    }
}

/// One tier root, opened once; see the module docs.
#[derive(Debug)]
pub(super) struct TierDir {
    root: PathBuf,
    fd: OwnedFd,
    perms: Perms,
    stats: Arc<StoreStats>,
    /// Cleared the first time the kernel answers `openat2` with `ENOSYS`.
    openat2: AtomicBool,
}

/// How to open a file beneath the root.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Access {
    /// Read only; the file must exist.
    Read,
    /// Read and write, creating the file (with the store's mode and group) if missing.
    ReadWriteCreate,
}

/// What a walk component failed on.
enum WalkError {
    /// A component is a symlink.
    Symlink,
    /// Any other error.
    Errno(Errno),
}

impl From<Errno> for WalkError {
    fn from(e: Errno) -> Self {
        Self::Errno(e)
    }
}

fn errno_io(e: Errno) -> io::Error {
    io::Error::from_raw_os_error(e.raw_os_error())
}

/// The components of a relative store path, each checked to be a plain name.
fn components(rel: &Path) -> Result<Vec<&OsStr>, StoreError> {
    let mut out = Vec::new();
    for c in rel.components() {
        match c {
            Component::Normal(n) if !n.as_bytes().contains(&0) => out.push(n),
            _ => {
                return Err(StoreError::InvalidPath {
                    path: rel.display().to_string(),
                });
            }
        }
    }
    if out.is_empty() {
        return Err(StoreError::InvalidPath {
            path: rel.display().to_string(),
        });
    }
    Ok(out)
}

fn dir_flags() -> OFlags {
    OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC
}

/// Opens directory `name` in `dir`, refusing a symlink (`O_NOFOLLOW` on a symlink with
/// `O_DIRECTORY` answers `ENOTDIR` on Linux, so that case is told apart with `fstatat`).
fn open_child_dir(dir: BorrowedFd<'_>, name: &OsStr) -> Result<OwnedFd, WalkError> {
    match rfs::openat(dir, name, dir_flags(), Mode::empty()) {
        Ok(fd) => Ok(fd),
        Err(Errno::LOOP) => Err(WalkError::Symlink),
        Err(Errno::NOTDIR) if is_symlink(dir, name) => Err(WalkError::Symlink),
        Err(e) => Err(WalkError::Errno(e)),
    }
}

fn is_symlink(dir: BorrowedFd<'_>, name: &OsStr) -> bool {
    rfs::statat(dir, name, AtFlags::SYMLINK_NOFOLLOW)
        .is_ok_and(|st| FileType::from_raw_mode(st.st_mode) == FileType::Symlink)
}

impl TierDir {
    /// Checks an existing tier root without changing anything (a missing one passes): not a
    /// symlink, owned by the daemon's effective uid, not writable by group or others. The
    /// store checks both roots this way before it creates or tightens either; [`TierDir::open`]
    /// checks again on the opened directory.
    pub(super) fn precheck(root: &Path, stats: &StoreStats) -> Result<(), StoreError> {
        use std::os::unix::fs::MetadataExt;
        let md = match std::fs::symlink_metadata(root) {
            Ok(md) => md,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
            Err(e) => return Err(super::io_err(root)(e)),
        };
        if md.file_type().is_symlink() {
            stats.symlinks_refused.fetch_add(1, Ordering::Relaxed);
            return Err(StoreError::Symlink {
                path: root.to_path_buf(),
            });
        }
        if !md.is_dir() {
            return Err(super::io_err(root)(errno_io(Errno::NOTDIR)));
        }
        let euid = rustix::process::geteuid().as_raw();
        if md.uid() != euid {
            return Err(StoreError::RootOwner {
                path: root.to_path_buf(),
                owner: md.uid(),
                euid,
            });
        }
        if md.mode() & 0o022 != 0 {
            return Err(StoreError::RootWritable {
                path: root.to_path_buf(),
                mode: md.mode() & 0o777,
            });
        }
        Ok(())
    }

    /// Opens (creating if missing) the tier root and checks it: a directory, not a symlink,
    /// owned by the daemon's effective uid, not writable by group or others. A root readable
    /// by others is tightened to the store's mode (and given the store's group) and logged.
    pub(super) fn open(
        root: &Path,
        perms: Perms,
        stats: Arc<StoreStats>,
    ) -> Result<Self, StoreError> {
        if let Some(parent) = root.parent().filter(|p| !p.as_os_str().is_empty()) {
            // Parents are not the store's to choose modes for.
            std::fs::create_dir_all(parent).map_err(super::io_err(parent))?;
        }
        match std::fs::DirBuilder::new()
            .mode(perms.dir_mode())
            .create(root)
        {
            Ok(()) => tracing::info!(root = %root.display(), "created tier root"),
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(super::io_err(root)(e)),
        }
        let fd = match rfs::open(root, dir_flags(), Mode::empty()) {
            Ok(fd) => fd,
            Err(e @ (Errno::LOOP | Errno::NOTDIR)) => {
                let link =
                    std::fs::symlink_metadata(root).is_ok_and(|m| m.file_type().is_symlink());
                return Err(if link {
                    stats.symlinks_refused.fetch_add(1, Ordering::Relaxed);
                    StoreError::Symlink {
                        path: root.to_path_buf(),
                    }
                } else {
                    super::io_err(root)(errno_io(e))
                });
            }
            Err(e) => return Err(super::io_err(root)(errno_io(e))),
        };
        let st = rfs::fstat(&fd).map_err(|e| super::io_err(root)(errno_io(e)))?;
        let euid = rustix::process::geteuid().as_raw();
        if st.st_uid != euid {
            return Err(StoreError::RootOwner {
                path: root.to_path_buf(),
                owner: st.st_uid,
                euid,
            });
        }
        let mode = st.st_mode & 0o777;
        if mode & 0o022 != 0 {
            return Err(StoreError::RootWritable {
                path: root.to_path_buf(),
                mode,
            });
        }
        let dir = Self {
            root: root.to_path_buf(),
            fd,
            perms,
            stats,
            openat2: AtomicBool::new(true),
        };
        if let Some(gid) = perms.gid {
            if st.st_gid != gid {
                rfs::fchown(&dir.fd, None, Some(rfs::Gid::from_raw(gid))).map_err(|e| {
                    StoreError::Group {
                        path: root.to_path_buf(),
                        gid,
                        source: errno_io(e),
                    }
                })?;
                tracing::info!(root = %root.display(), gid, "tier root given the store group");
            }
        }
        let want = perms.dir_mode();
        if mode != want {
            dir.chmod(dir.fd.as_fd(), root, want)?;
            if mode & !want != 0 {
                tracing::warn!(
                    root = %root.display(),
                    from = format!("{mode:o}"),
                    to = format!("{want:o}"),
                    "tier root was readable by others; tightened"
                );
            }
        }
        Ok(dir)
    }

    /// The root's path (for messages and for paths handed to other processes).
    pub(super) fn root(&self) -> &Path {
        &self.root
    }

    /// Makes `openat2` look unavailable, to test the walk that replaces it.
    #[cfg(test)]
    pub(super) fn force_walk(&self) {
        self.openat2.store(false, Ordering::Relaxed);
    }

    fn chmod(&self, fd: BorrowedFd<'_>, path: &Path, mode: u32) -> Result<(), StoreError> {
        rfs::fchmod(fd, Mode::from_raw_mode(mode)).map_err(|e| super::io_err(path)(errno_io(e)))
    }

    /// Gives a file or directory the store's mode and group, if it lacks them.
    fn own(&self, fd: BorrowedFd<'_>, rel: &Path, mode: u32) -> Result<(), StoreError> {
        let path = self.root.join(rel);
        let st = rfs::fstat(fd).map_err(|e| super::io_err(&path)(errno_io(e)))?;
        if let Some(gid) = self.perms.gid.filter(|&g| st.st_gid != g) {
            rfs::fchown(fd, None, Some(rfs::Gid::from_raw(gid))).map_err(|e| {
                StoreError::Group {
                    path: path.clone(),
                    gid,
                    source: errno_io(e),
                }
            })?;
        }
        if st.st_mode & 0o777 != mode {
            self.chmod(fd, &path, mode)?;
        }
        Ok(())
    }

    /// The error for `errno` met opening `rel`: symlinks (and escapes, which need one) are
    /// counted and logged.
    fn fail(&self, rel: &Path, e: WalkError) -> StoreError {
        let path = self.root.join(rel);
        match e {
            WalkError::Symlink | WalkError::Errno(Errno::LOOP | Errno::XDEV) => {
                self.stats.symlinks_refused.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(path = %path.display(), "refusing a symlink inside the store");
                StoreError::Symlink { path }
            }
            WalkError::Errno(e) => StoreError::Io {
                path,
                source: errno_io(e),
            },
        }
    }

    /// Opens `rel` beneath the root with `flags`, following no symlink anywhere.
    fn open_at(&self, rel: &Path, flags: OFlags, mode: u32) -> Result<OwnedFd, StoreError> {
        let comps = components(rel)?;
        let flags = flags | OFlags::NOFOLLOW | OFlags::CLOEXEC;
        let mode = if flags.contains(OFlags::CREATE) {
            Mode::from_raw_mode(mode)
        } else {
            Mode::empty()
        };
        if self.openat2.load(Ordering::Relaxed) {
            let resolve =
                ResolveFlags::BENEATH | ResolveFlags::NO_SYMLINKS | ResolveFlags::NO_MAGICLINKS;
            match rfs::openat2(&self.fd, rel, flags, mode, resolve) {
                Err(Errno::NOSYS) => {
                    tracing::warn!(
                        "openat2 is unavailable; resolving store paths one component at a time"
                    );
                    self.openat2.store(false, Ordering::Relaxed);
                }
                r => return r.map_err(|e| self.fail(rel, WalkError::Errno(e))),
            }
        }
        self.walk(&comps, flags, mode)
            .map_err(|e| self.fail(rel, e))
    }

    /// `openat2` without the system call: one `O_NOFOLLOW` open per component.
    fn walk(&self, comps: &[&OsStr], flags: OFlags, mode: Mode) -> Result<OwnedFd, WalkError> {
        let Some((last, dirs)) = comps.split_last() else {
            return Err(WalkError::Errno(Errno::INVAL));
        };
        let mut cur: Option<OwnedFd> = None;
        for c in dirs {
            let at = cur.as_ref().map_or(self.fd.as_fd(), |f| f.as_fd());
            cur = Some(open_child_dir(at, c)?);
        }
        let at = cur.as_ref().map_or(self.fd.as_fd(), |f| f.as_fd());
        if flags.contains(OFlags::DIRECTORY) {
            return open_child_dir(at, last);
        }
        match rfs::openat(at, *last, flags, mode) {
            Ok(fd) => Ok(fd),
            Err(Errno::LOOP) => Err(WalkError::Symlink),
            Err(e) => Err(WalkError::Errno(e)),
        }
    }

    /// Opens the directory `rel` (`.` components are not allowed; pass `None` for the root).
    fn open_dir(&self, rel: Option<&Path>) -> Result<OwnedFd, StoreError> {
        match rel.filter(|p| !p.as_os_str().is_empty()) {
            Some(rel) => self.open_at(rel, dir_flags(), 0),
            None => self
                .fd
                .try_clone()
                .map_err(|e| super::io_err(&self.root)(e)),
        }
    }

    /// Creates directory `rel` and any missing parents beneath the root, with the store's
    /// mode and group. A symlink anywhere on the way is refused.
    pub(super) fn create_dir_all(&self, rel: &Path) -> Result<(), StoreError> {
        let comps = components(rel)?;
        let mut cur: Option<OwnedFd> = None;
        let mut done = PathBuf::new();
        for c in comps {
            done.push(c);
            let at = cur.as_ref().map_or(self.fd.as_fd(), |f| f.as_fd());
            let created = match rfs::mkdirat(at, c, Mode::from_raw_mode(self.perms.dir_mode())) {
                Ok(()) => true,
                Err(Errno::EXIST) => false,
                Err(e) => return Err(self.fail(&done, WalkError::Errno(e))),
            };
            let next = open_child_dir(at, c).map_err(|e| self.fail(&done, e))?;
            if created {
                self.own(next.as_fd(), &done, self.perms.dir_mode())?;
            }
            cur = Some(next);
        }
        Ok(())
    }

    /// Gives an existing directory `rel` the store's mode and group (the top-level
    /// directories at start-up, which an older version created with default modes).
    pub(super) fn tighten_dir(&self, rel: &Path) -> Result<(), StoreError> {
        let fd = self.open_dir(Some(rel))?;
        self.own(fd.as_fd(), rel, self.perms.dir_mode())
    }

    /// Opens the file `rel` beneath the root. Files opened for writing get the store's
    /// mode and group.
    pub(super) fn open_file(&self, rel: &Path, access: Access) -> Result<File, StoreError> {
        let flags = match access {
            Access::Read => OFlags::RDONLY,
            Access::ReadWriteCreate => OFlags::RDWR | OFlags::CREATE,
        };
        let fd = self.open_at(rel, flags, self.perms.file_mode())?;
        if access != Access::Read {
            self.own(fd.as_fd(), rel, self.perms.file_mode())?;
        }
        Ok(File::from(fd))
    }

    /// Reads the whole file `rel`, refusing one longer than `max` bytes.
    pub(super) fn read_file(&self, rel: &Path, max: u64) -> Result<Vec<u8>, StoreError> {
        let f = self.open_file(rel, Access::Read)?;
        let mut out = Vec::new();
        let path = self.root.join(rel);
        f.take(max.saturating_add(1))
            .read_to_end(&mut out)
            .map_err(super::io_err(&path))?;
        if out.len() as u64 > max {
            return Err(StoreError::Corrupt {
                path,
                reason: format!("longer than {max} bytes"),
            });
        }
        Ok(out)
    }

    /// Replaces the file `rel` atomically: a temporary `<name>.tmp` in the same directory
    /// (a stale one is removed first), written, synced, then renamed over `rel`. A symlink
    /// at `rel` is refused rather than replaced.
    pub(super) fn write_atomic(&self, rel: &Path, data: &[u8]) -> Result<(), StoreError> {
        let comps = components(rel)?;
        let Some((name, _)) = comps.split_last() else {
            return Err(StoreError::InvalidPath {
                path: rel.display().to_string(),
            });
        };
        let dir = self.open_dir(rel.parent())?;
        if is_symlink(dir.as_fd(), name) {
            return Err(self.fail(rel, WalkError::Symlink));
        }
        let mut tmp_name = name.to_os_string();
        tmp_name.push(TMP_SUFFIX);
        let tmp_rel = rel.with_file_name(&tmp_name);
        let tmp_path = self.root.join(&tmp_rel);
        // A stale temporary (or something planted under its name): unlinking never follows.
        match rfs::unlinkat(&dir, &tmp_name, AtFlags::empty()) {
            Ok(()) | Err(Errno::NOENT) => {}
            Err(e) => return Err(super::io_err(&tmp_path)(errno_io(e))),
        }
        let flags =
            OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::CLOEXEC;
        let fd = rfs::openat(
            &dir,
            &tmp_name,
            flags,
            Mode::from_raw_mode(self.perms.file_mode()),
        )
        .map_err(|e| self.fail(&tmp_rel, WalkError::Errno(e)))?;
        self.own(fd.as_fd(), &tmp_rel, self.perms.file_mode())?;
        let mut f = File::from(fd);
        f.write_all(data).map_err(super::io_err(&tmp_path))?;
        f.sync_all().map_err(super::io_err(&tmp_path))?;
        rfs::renameat(&dir, &tmp_name, &dir, *name)
            .map_err(|e| super::io_err(&self.root.join(rel))(errno_io(e)))
    }

    /// Moves the regular file `from` to `to`, both beneath the root (`to`'s directory must
    /// exist), replacing a regular file at `to`. Nothing is followed: a symlink at `from`,
    /// at `to` or on the way to either is refused (counted, logged), and anything at `from`
    /// but a regular file is an error. Both names stay on the tier's file system unless a
    /// directory between is a mount point, which the kernel refuses (`EXDEV`).
    pub(super) fn rename_file(&self, from: &Path, to: &Path) -> Result<(), StoreError> {
        let (from_comps, to_comps) = (components(from)?, components(to)?);
        let (Some((from_name, _)), Some((to_name, _))) =
            (from_comps.split_last(), to_comps.split_last())
        else {
            return Err(StoreError::InvalidPath {
                path: from.display().to_string(),
            });
        };
        let from_dir = self.open_dir(from.parent())?;
        let to_dir = self.open_dir(to.parent())?;
        let st = rfs::statat(&from_dir, *from_name, AtFlags::SYMLINK_NOFOLLOW)
            .map_err(|e| super::io_err(&self.root.join(from))(errno_io(e)))?;
        match FileType::from_raw_mode(st.st_mode) {
            FileType::RegularFile => {}
            FileType::Symlink => return Err(self.fail(from, WalkError::Symlink)),
            _ => {
                return Err(super::io_err(&self.root.join(from))(io::Error::new(
                    io::ErrorKind::InvalidInput,
                    "not a regular file",
                )));
            }
        }
        if is_symlink(to_dir.as_fd(), to_name) {
            return Err(self.fail(to, WalkError::Symlink));
        }
        rfs::renameat(&from_dir, *from_name, &to_dir, *to_name)
            .map_err(|e| super::io_err(&self.root.join(to))(errno_io(e)))
    }

    /// The type of `rel` without following a symlink in its last component; `None` if it
    /// does not exist.
    pub(super) fn kind(&self, rel: &Path) -> Result<Option<FileType>, StoreError> {
        let comps = components(rel)?;
        let Some((name, _)) = comps.split_last() else {
            return Ok(None);
        };
        let dir = match self.open_dir(rel.parent()) {
            Ok(d) => d,
            Err(StoreError::Io { source, .. }) if source.kind() == io::ErrorKind::NotFound => {
                return Ok(None);
            }
            Err(e) => return Err(e),
        };
        match rfs::statat(&dir, *name, AtFlags::SYMLINK_NOFOLLOW) {
            Ok(st) => Ok(Some(FileType::from_raw_mode(st.st_mode))),
            Err(Errno::NOENT) => Ok(None),
            Err(e) => Err(super::io_err(&self.root.join(rel))(errno_io(e))),
        }
    }

    /// Whether `rel` is a regular file; a symlink there is refused (counted, logged).
    pub(super) fn is_file(&self, rel: &Path) -> Result<bool, StoreError> {
        match self.kind(rel)? {
            Some(FileType::RegularFile) => Ok(true),
            Some(FileType::Symlink) => Err(self.fail(rel, WalkError::Symlink)),
            _ => Ok(false),
        }
    }

    /// The entries of directory `rel` (names and types; symlinks reported as such, never
    /// followed).
    pub(super) fn list(
        &self,
        rel: &Path,
    ) -> Result<Vec<(std::ffi::OsString, FileType)>, StoreError> {
        let dir = self.open_dir(Some(rel))?;
        list_fd(dir.as_fd()).map_err(|e| super::io_err(&self.root.join(rel))(errno_io(e)))
    }

    /// Removes `rel` and everything beneath it; a missing entry is fine. Never descends
    /// through a symlink: one met anywhere (including at `rel`) is unlinked itself, and
    /// counted and logged when it is `rel` or one of its parents. Returns the bytes freed
    /// (the blocks of the regular files unlinked).
    pub(super) fn remove_tree(&self, rel: &Path) -> Result<u64, StoreError> {
        let comps = components(rel)?;
        let Some((name, _)) = comps.split_last() else {
            return Ok(0);
        };
        let path = self.root.join(rel);
        let parent = match self.open_dir(rel.parent()) {
            Ok(d) => d,
            Err(StoreError::Io { source, .. }) if source.kind() == io::ErrorKind::NotFound => {
                return Ok(0);
            }
            Err(e) => return Err(e),
        };
        let st = match rfs::statat(&parent, *name, AtFlags::SYMLINK_NOFOLLOW) {
            Ok(st) => st,
            Err(Errno::NOENT) => return Ok(0),
            Err(e) => return Err(super::io_err(&path)(errno_io(e))),
        };
        let mut freed = 0;
        match FileType::from_raw_mode(st.st_mode) {
            FileType::Directory => {
                let dir = open_child_dir(parent.as_fd(), name).map_err(|e| self.fail(rel, e))?;
                freed = remove_contents(dir.as_fd(), 0)
                    .map_err(|e| super::io_err(&path)(errno_io(e)))?;
                rfs::unlinkat(&parent, *name, AtFlags::REMOVEDIR)
            }
            FileType::Symlink => {
                self.stats.symlinks_refused.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(path = %path.display(), "removing a symlink planted in the store (its target is left alone)");
                rfs::unlinkat(&parent, *name, AtFlags::empty())
            }
            _ => {
                freed = allocated(&st);
                rfs::unlinkat(&parent, *name, AtFlags::empty())
            }
        }
        .or_else(|e| if e == Errno::NOENT { Ok(()) } else { Err(e) })
        .map_err(|e| super::io_err(&path)(errno_io(e)))?;
        Ok(freed)
    }

    /// Removes the store's temporary files (`*.tmp`) directly inside directory `rel`.
    /// Returns how many were removed.
    pub(super) fn remove_temps(&self, rel: &Path) -> Result<u64, StoreError> {
        let dir = match self.open_dir(Some(rel)) {
            Ok(d) => d,
            Err(StoreError::Io { source, .. }) if source.kind() == io::ErrorKind::NotFound => {
                return Ok(0);
            }
            Err(e) => return Err(e),
        };
        let entries =
            list_fd(dir.as_fd()).map_err(|e| super::io_err(&self.root.join(rel))(errno_io(e)))?;
        let mut n = 0;
        for (name, ty) in entries {
            if ty == FileType::Directory || !name.as_bytes().ends_with(TMP_SUFFIX.as_bytes()) {
                continue;
            }
            match rfs::unlinkat(&dir, &name, AtFlags::empty()) {
                Ok(()) => {
                    n += 1;
                    tracing::info!(path = %self.root.join(rel).join(&name).display(), "removed a stale temporary file");
                }
                Err(Errno::NOENT) => {}
                Err(e) => return Err(super::io_err(&self.root.join(rel).join(&name))(errno_io(e))),
            }
        }
        Ok(n)
    }

    /// Bytes available to the daemon on the tier's file system (`fstatvfs`).
    pub(super) fn available(&self) -> Result<u64, StoreError> {
        let st = rfs::fstatvfs(&self.fd).map_err(|e| super::io_err(&self.root)(errno_io(e)))?;
        Ok(st.f_bavail.saturating_mul(st.f_frsize))
    }
}

/// Entries of an open directory, with their types (`fstatat` where `d_type` is unknown).
fn list_fd(dir: BorrowedFd<'_>) -> Result<Vec<(std::ffi::OsString, FileType)>, Errno> {
    let mut out = Vec::new();
    for entry in rfs::Dir::read_from(dir)? {
        let entry = entry?;
        let name = OsStr::from_bytes(entry.file_name().to_bytes());
        if name == "." || name == ".." {
            continue;
        }
        let ty = match entry.file_type() {
            FileType::Unknown => {
                FileType::from_raw_mode(rfs::statat(dir, name, AtFlags::SYMLINK_NOFOLLOW)?.st_mode)
            }
            t => t,
        };
        out.push((name.to_os_string(), ty));
    }
    Ok(out)
}

/// Empties an open directory, descending into subdirectories (never through symlinks:
/// those are unlinked like files).
fn remove_contents(dir: BorrowedFd<'_>, depth: usize) -> Result<u64, Errno> {
    if depth > MAX_DEPTH {
        return Err(Errno::NAMETOOLONG);
    }
    let mut freed = 0;
    for (name, ty) in list_fd(dir)? {
        let r = if ty == FileType::Directory {
            let sub = rfs::openat(dir, &name, dir_flags(), Mode::empty())?;
            freed += remove_contents(sub.as_fd(), depth + 1)?;
            rfs::unlinkat(dir, &name, AtFlags::REMOVEDIR)
        } else {
            if ty == FileType::RegularFile
                && let Ok(st) = rfs::statat(dir, &name, AtFlags::SYMLINK_NOFOLLOW)
            {
                freed += allocated(&st);
            }
            rfs::unlinkat(dir, &name, AtFlags::empty())
        };
        match r {
            Ok(()) | Err(Errno::NOENT) => {}
            Err(e) => return Err(e),
        }
    }
    Ok(freed)
}

/// The bytes a file's blocks occupy (what unlinking its last link frees; a sparse file
/// counts what it holds, not its length).
fn allocated(st: &rfs::Stat) -> u64 {
    u64::try_from(st.st_blocks).unwrap_or(0).saturating_mul(512)
}
