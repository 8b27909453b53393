//! Subcommands of the binary that are not the daemon itself: `check-config`, and the
//! shell completions and man page generated from the clap definition.

pub mod check_config;
pub mod generate;
