//! Process set-up the daemons share (transferd and the controller).
//!
//! [`raise_nofile_limit`] raises the soft `RLIMIT_NOFILE` to the hard limit at start
//! (transferd's `daemon::run` and the controller's `server::run` call it).

/// Raises the soft `RLIMIT_NOFILE` to the hard limit (every connection, shard file and
/// mapping holds a descriptor; distributions default the soft limit to 1024). Returns the
/// (old, new) soft limits.
pub fn raise_nofile_limit() -> std::io::Result<(u64, u64)> {
    use rustix::process::{Resource, Rlimit, getrlimit, setrlimit};
    let cur = getrlimit(Resource::Nofile);
    let old = cur.current.unwrap_or(u64::MAX);
    let Some(hard) = cur.maximum else {
        // Unlimited hard limit: the kernel still caps descriptors at fs.nr_open; ask for
        // a large, always-valid value.
        let new = old.max(1 << 20);
        let r = setrlimit(
            Resource::Nofile,
            Rlimit {
                current: Some(new),
                maximum: None,
            },
        );
        return match r {
            Ok(()) => Ok((old, new)),
            Err(_) => Ok((old, old)),
        };
    };
    if old >= hard {
        return Ok((old, old));
    }
    setrlimit(
        Resource::Nofile,
        Rlimit {
            current: Some(hard),
            maximum: Some(hard),
        },
    )?;
    Ok((old, hard))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nofile_limit_is_raised_to_the_hard_limit() {
        let (old, new) = raise_nofile_limit().unwrap();
        assert!(new >= old);
        let cur = rustix::process::getrlimit(rustix::process::Resource::Nofile);
        assert_eq!(cur.current, Some(new));
    }
}
