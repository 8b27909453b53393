//! The allocator's settings for the daemon process.

/// Makes every thread allocate from one glibc arena (`M_ARENA_MAX` = 1) instead of one
/// arena per thread that allocates (glibc's default, up to 8 per core). Each arena keeps
/// the memory freed in it for its own reuse, so with the runtime's threads each taking
/// turns at a cycle at 10,000 namespaces (the 1 MB poll answer, hyper's read buffers, the
/// new sets) every arena came to hold such a peak: 1.3 MB more peak RSS than one shared
/// arena (bench/RESULTS.md, third wave). A daemon making one request a second has no
/// contention to spread. Call before any thread starts. Returns whether glibc took the
/// setting (`false` on other C libraries, where it does nothing).
pub(super) fn one_arena() -> bool {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: mallopt only sets a parameter of glibc's allocator; it takes no pointer.
        unsafe { nix::libc::mallopt(nix::libc::M_ARENA_MAX, 1) == 1 }
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    {
        false
    }
}

#[cfg(test)]
mod tests {
    #[test]
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    fn glibc_takes_the_one_arena_setting() {
        assert!(super::one_arena());
    }
}
