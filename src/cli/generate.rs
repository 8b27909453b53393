//! Shell completions and the man page, generated from the clap definition:
//! `fleet-sidecar completions SHELL` for users who install by hand, and the hidden
//! `fleet-sidecar man` that `scripts/build-deb.sh` runs to put both in the package.

use std::io::Write;

use clap_complete::Shell;

/// Writes the completion script for `shell` to stdout.
pub(crate) fn completions(mut cmd: clap::Command, shell: Shell) {
    let name = cmd.get_name().to_owned();
    clap_complete::generate(shell, &mut cmd, name, &mut std::io::stdout());
}

/// Writes the man page (roff, section 1) to stdout. Errors: writing to stdout failed.
pub(crate) fn man(cmd: clap::Command) -> std::io::Result<()> {
    let mut page = Vec::new();
    clap_mangen::Man::new(cmd).render(&mut page)?;
    std::io::stdout().write_all(&page)
}
