//! `fleet-sidecar`: the daemon's binary; the command line lives in the library
//! ([`fleet_sidecar::cli`]).

fn main() -> std::process::ExitCode {
    fleet_sidecar::cli::main()
}
