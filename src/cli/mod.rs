//! The `fleet-sidecar` command line: parse it, load the config, build the real clients, run,
//! and map the outcome to an exit code. [`main`] is the binary's entry point; the
//! subcommands that are not the daemon itself are in the submodules: `check_config`
//! (`check-config`), `generate` (shell completions, the man page), `status` (`status`).
//!
//! **Not part of the library's promise**: with the `daemon` feature only, the binary's own;
//! it changes in any version without a note.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use clap::{CommandFactory, Parser, Subcommand};
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

use crate::config::{Config, DEFAULT_ADMIN_URL, DEFAULT_CONFIG_PATH};
use crate::daemon::{self, CycleOutcome, Deps};
use crate::identity::{resolve_admin_url, AdminUrlSource};
use crate::logging;
use crate::mdma::MdmaClient;
use crate::merod::{ListenCandidates, MerodClient, Node};
use crate::mrtd::{read_mrtd_bounded, read_saved, SavedEvidence, TdxConfig, MRTD_READ_TIMEOUT};
use crate::notify;
use crate::telemetry::{self, unix_now, Telemetry};

mod check_config;
mod generate;
mod status;

/// Exit code: the daemon or the cycle failed.
const EXIT_FAILURE: u8 = 1;
/// Exit code of `once` when the poll failed (nothing was joined or left).
const EXIT_POLL_FAILED: u8 = 3;
/// Exit code for a bad command line (as clap uses).
const EXIT_USAGE: u8 = 2;
/// Exit code for an unusable config file (sysexits EX_CONFIG).
const EXIT_CONFIG: u8 = 78;

/// Keeps this Calimero TEE node's namespace membership in sync with MDMA.
#[derive(Parser, Debug)]
#[command(name = "fleet-sidecar", version, about, long_about = None)]
struct Cli {
    /// The config file (TOML) [default: /etc/calimero/fleet-sidecar.toml].
    #[arg(long, global = true, value_name = "PATH")]
    config: Option<PathBuf>,
    /// Poll and log the plan only: merod is not called, nothing is confirmed, the state
    /// file is not written (with `run` or `once`).
    #[arg(long, global = true)]
    dry_run: bool,
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Run the daemon (the default): reconcile every poll_interval until SIGTERM/SIGINT.
    Run,
    /// Run one full cycle and exit: 0 on a successful poll, 3 when the poll failed.
    Once,
    /// Print what this node holds (from the state file) and, when `status_listen` is set,
    /// the running daemon's live status; exit 1 if the state file is unreadable.
    Status {
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Print this TD's MRTD and its source (or each source's failure; exit 1 if none
    /// worked), or parse a saved TDREPORT or quote offline.
    Mrtd {
        /// Parse this saved 1024-byte TDREPORT instead of reading the TD.
        #[arg(long, value_name = "FILE", conflicts_with = "quote")]
        tdreport: Option<PathBuf>,
        /// Parse this saved TD quote (v4 or v5) instead of reading the TD.
        #[arg(long, value_name = "FILE")]
        quote: Option<PathBuf>,
    },
    /// Load and validate the config, read merod's config.toml and each MRTD source
    /// without side effects, and print the effective configuration (the token only as
    /// set/unset); exit 0, or 78 when the config is unusable.
    CheckConfig,
    /// Print the completion script for SHELL (bash, zsh, fish, elvish, powershell).
    Completions {
        /// The shell to complete for.
        shell: clap_complete::Shell,
    },
    /// Print the man page (roff); the package build ships it.
    #[command(hide = true)]
    Man,
}

/// Runs the `fleet-sidecar` command line (the process arguments) and returns its exit
/// status: 0 success, 1 failure, 2 usage, 3 a failed poll with `once`, 78 a bad config.
pub fn main() -> ExitCode {
    fix_mmap_threshold();
    let cli = Cli::parse();
    let command = cli.command.unwrap_or(Command::Run);
    if cli.dry_run && !matches!(command, Command::Run | Command::Once) {
        eprintln!("fleet-sidecar: --dry-run goes with run or once");
        return ExitCode::from(EXIT_USAGE);
    }
    match command {
        Command::Mrtd { tdreport, quote } => mrtd_command(cli.config.as_deref(), tdreport, quote),
        Command::CheckConfig => {
            let path = cli
                .config
                .unwrap_or_else(|| PathBuf::from(DEFAULT_CONFIG_PATH));
            if check_config::run(&path) {
                ExitCode::SUCCESS
            } else {
                ExitCode::from(EXIT_CONFIG)
            }
        }
        Command::Completions { shell } => {
            generate::completions(Cli::command(), shell);
            ExitCode::SUCCESS
        }
        Command::Man => match generate::man(Cli::command()) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("fleet-sidecar: cannot write the man page: {e}");
                ExitCode::from(EXIT_FAILURE)
            }
        },
        command => {
            let path = cli
                .config
                .unwrap_or_else(|| PathBuf::from(DEFAULT_CONFIG_PATH));
            let mut cfg = match Config::load(&path) {
                Ok(c) => c,
                Err(e) => {
                    eprintln!("fleet-sidecar: {e}");
                    return ExitCode::from(EXIT_CONFIG);
                }
            };
            cfg.dry_run = cli.dry_run;
            // One thread: the loop, its joins/leaves and the HTTP connections share it, so
            // an idle poll wakes one thread (a timer, then the answer) instead of handing
            // work between worker threads (measured: ~14 wake-ups a poll with 2 workers,
            // ~3 with one). Nothing on it blocks for long: every outside call is async and
            // bounded, the MRTD read runs on the blocking pool; a hanging join cannot delay
            // a poll (tests/it/heartbeat.rs pins it for this binary).
            let runtime = match tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            {
                Ok(r) => r,
                Err(e) => {
                    eprintln!("fleet-sidecar: cannot start the async runtime: {e}");
                    return ExitCode::from(EXIT_FAILURE);
                }
            };
            match command {
                Command::Status { json } => runtime.block_on(status_command(&cfg, json)),
                command => runtime.block_on(serve(cfg, matches!(command, Command::Once))),
            }
        }
    }
}

/// Fixes glibc's mmap threshold at its initial 128 KiB, so every block of at least that
/// size (a poll answer's body, a list of 10,000 ids, a rendered state) gets a mapping of
/// its own and goes back to the kernel when freed. Left dynamic (glibc's default), the
/// threshold rises to the size of the first such block freed, and later ones come from the
/// heap, where the holes they leave between longer-lived blocks are never given back: the
/// daemon's RSS at 10,000 namespaces then grows in steps (`scripts/bench-revisions.sh`:
/// 18.3 MiB peak with it dynamic, 16.3 MiB fixed; bench/RESULTS.md). A no-op outside
/// glibc; a refusal (which glibc does not give for this value) leaves the default.
fn fix_mmap_threshold() {
    #[cfg(target_env = "gnu")]
    {
        const MMAP_THRESHOLD: nix::libc::c_int = 128 * 1024;
        // SAFETY: mallopt only sets a parameter of the allocator; called first thing in
        // the process, before any thread of ours exists.
        let _ = unsafe { nix::libc::mallopt(nix::libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD) };
    }
}

async fn serve(cfg: Config, once: bool) -> ExitCode {
    let file = cfg.log_to_file.then_some(cfg.log_file.as_path());
    let logs = match logging::init(file, cfg.log_format, cfg.log_target) {
        Ok((logs, None)) => Arc::new(logs),
        Ok((logs, Some(problem))) => {
            eprintln!("fleet-sidecar: {problem}");
            Arc::new(logs)
        }
        Err(problem) => {
            eprintln!("fleet-sidecar: {problem}");
            Arc::new(logging::Logs::default())
        }
    };
    let code = serve_logged(cfg, once, Arc::clone(&logs)).await;
    // Lines still queued are written before the exit, unless their sink does not read.
    logs.flush(LOG_FLUSH_AT_EXIT);
    code
}

/// The longest the exit waits for queued log lines to be written.
const LOG_FLUSH_AT_EXIT: std::time::Duration = std::time::Duration::from_secs(2);

async fn serve_logged(cfg: Config, once: bool, logs: Arc<logging::Logs>) -> ExitCode {
    for w in &cfg.warnings {
        warn!("{w}");
    }
    let (admin_url, fallbacks) = admin_url(&cfg);
    let telemetry = Arc::new(Telemetry::new());
    let mut mdma = MdmaClient::builder(cfg.mdma_url.clone());
    if let Some(token) = cfg.fleet_token.clone() {
        mdma = mdma.token(token);
    }
    if let Some(ca) = &cfg.mdma_ca_file {
        mdma = mdma.ca_file(ca);
    }
    let resends = telemetry.poll_resends.clone();
    let mdma = match mdma
        .on_resend(move || {
            resends.inc();
        })
        .build()
    {
        Ok(c) => c,
        Err(e) => {
            error!("{e}");
            return ExitCode::from(EXIT_CONFIG);
        }
    };
    let clients: Result<Vec<MerodClient>, _> = std::iter::once(&admin_url)
        .chain(&fallbacks)
        .map(MerodClient::new)
        .collect();
    let mut clients = match clients {
        Ok(c) => c.into_iter(),
        Err(e) => {
            error!("{e}");
            return ExitCode::from(EXIT_FAILURE);
        }
    };
    let Some(first) = clients.next() else {
        return ExitCode::from(EXIT_FAILURE);
    };
    // Registration's merod calls (identity, attest) follow the loop's choice among the
    // `[server].listen` addresses: the one whose probe answered.
    let candidates = Arc::new(ListenCandidates::new(first, clients.collect()));
    let merod: Arc<dyn Node> = if fallbacks.is_empty() {
        Arc::new(candidates.current().clone())
    } else {
        Arc::clone(&candidates) as Arc<dyn Node>
    };
    let also: Vec<String> = fallbacks.iter().map(ToString::to_string).collect();
    info!(
        version = env!("CARGO_PKG_VERSION"),
        mdma = %cfg.mdma_url,
        merod = %admin_url,
        merod_fallbacks = %also.join(" "),
        state = %cfg.state_file.display(),
        "fleet-sidecar starting"
    );
    let deps = match Deps::real(&cfg, mdma, merod, candidates, telemetry) {
        Ok(d) => d,
        Err(e) => {
            error!("{e}");
            return ExitCode::from(EXIT_FAILURE);
        }
    };
    if notify::install(&deps.telemetry) {
        info!("systemd notification on (READY, STATUS, WATCHDOG, STOPPING)");
    }
    let shutdown = CancellationToken::new();
    if let Some(addr) = cfg.status_listen {
        match telemetry::serve(
            addr,
            Arc::clone(&deps.telemetry),
            cfg.ready_max_poll_age,
            shutdown.clone(),
        )
        .await
        {
            Ok(bound) => {
                info!("status listener on http://{bound} (/healthz /readyz /metrics /status)")
            }
            Err(e) => {
                error!("cannot listen on status_listen {addr}: {e}");
                return ExitCode::from(EXIT_CONFIG);
            }
        }
    }
    if let Err(e) = spawn_signal_handler(shutdown.clone(), logs, deps.clone()) {
        error!("cannot install signal handlers: {e}");
        return ExitCode::from(EXIT_FAILURE);
    }
    if once {
        match daemon::once(cfg, deps, shutdown).await {
            Ok(Some(CycleOutcome::Planned { joins, leaves })) => {
                info!(joins, leaves, "cycle done");
                ExitCode::SUCCESS
            }
            Ok(Some(CycleOutcome::PollFailed(e))) => {
                error!("poll failed: {e}");
                ExitCode::from(EXIT_POLL_FAILED)
            }
            // `once` waits for merod before its cycle, so this is not expected; nothing ran.
            Ok(Some(CycleOutcome::WaitingForMerod)) => {
                error!("merod did not answer: nothing planned");
                ExitCode::from(EXIT_FAILURE)
            }
            Ok(None) => ExitCode::SUCCESS,
            Err(e) => {
                error!("{e}");
                ExitCode::from(EXIT_FAILURE)
            }
        }
    } else {
        match daemon::run(cfg, deps, shutdown).await {
            Ok(()) => {
                info!("stopped");
                ExitCode::SUCCESS
            }
            Err(e) => {
                error!("{e}");
                ExitCode::from(EXIT_FAILURE)
            }
        }
    }
}

/// merod's admin URL and the later `[server].listen` URLs to try after it, saying why when
/// it falls back to the default (a wrong `[merod].home` shows here first; the PeerId read
/// then fails loudly).
fn admin_url(cfg: &Config) -> (url::Url, Vec<url::Url>) {
    let resolved = resolve_admin_url(&cfg.merod);
    match &resolved.source {
        AdminUrlSource::Configured | AdminUrlSource::MerodListen(_) => {}
        AdminUrlSource::DefaultNoMerodConfig(path) => warn!(
            "merod config {} not found (is [merod] home/node right?): using {DEFAULT_ADMIN_URL}",
            path.display()
        ),
        AdminUrlSource::DefaultNoListen(path) => info!(
            "merod config {} has no [server].listen: using {DEFAULT_ADMIN_URL}",
            path.display()
        ),
        AdminUrlSource::DefaultUnreadable(e) => warn!("{e}; using {DEFAULT_ADMIN_URL}"),
    }
    (resolved.url, resolved.fallbacks)
}

/// `fleet-sidecar status`: the state file and, if the listener is on, the live status.
async fn status_command(cfg: &Config, json: bool) -> ExitCode {
    let report = status::report(cfg).await;
    if json {
        match serde_json::to_string_pretty(&report) {
            Ok(text) => println!("{text}"),
            Err(e) => {
                eprintln!("fleet-sidecar: cannot render the report: {e}");
                return ExitCode::from(EXIT_FAILURE);
            }
        }
    } else {
        print!("{}", status::render_text(&report, unix_now()));
    }
    if report.state_error.is_some() {
        ExitCode::from(EXIT_FAILURE)
    } else {
        ExitCode::SUCCESS
    }
}

/// SIGTERM and SIGINT cancel `shutdown`; SIGHUP reopens the log file (logrotate) and reads
/// the token file again (`fleet_token_file`, or `[registration].token_file`).
fn spawn_signal_handler(
    shutdown: CancellationToken,
    logs: Arc<logging::Logs>,
    deps: Deps,
) -> std::io::Result<()> {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    let mut hup = signal(SignalKind::hangup())?;
    tokio::spawn(async move {
        loop {
            tokio::select! {
                _ = term.recv() => { info!("SIGTERM: stopping between steps"); shutdown.cancel(); }
                _ = int.recv() => { info!("SIGINT: stopping between steps"); shutdown.cancel(); }
                // The log writer reopens the file after the lines already logged, and
                // says how it went; the token file is read again.
                _ = hup.recv() => {
                    match logs.reopen() {
                        Some(true) => {}
                        Some(false) => warn!(
                            path = %logs.file_path().map(|p| p.display().to_string()).unwrap_or_default(),
                            "SIGHUP: the log file's writer is behind; not reopened (send SIGHUP again)"
                        ),
                        None => info!("SIGHUP: no log file to reopen"),
                    }
                    deps.reload_token();
                }
            }
        }
    });
    Ok(())
}

/// `fleet-sidecar mrtd`: read (or parse offline) and print the MRTD with its source. With
/// no `--config`, the default config file is used if it exists, else the default sources.
fn mrtd_command(
    config: Option<&std::path::Path>,
    tdreport: Option<PathBuf>,
    quote: Option<PathBuf>,
) -> ExitCode {
    let offline = tdreport
        .map(|p| (p, SavedEvidence::TdReport, "tdreport"))
        .or_else(|| quote.map(|p| (p, SavedEvidence::Quote, "quote")));
    if let Some((path, kind, name)) = offline {
        return match read_saved(&path, kind) {
            Ok(m) => {
                println!("{m}\t{name} file {}", path.display());
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("fleet-sidecar: {e}");
                ExitCode::from(EXIT_FAILURE)
            }
        };
    }
    let default = std::path::Path::new(DEFAULT_CONFIG_PATH);
    let path = match config {
        Some(p) => Some(p),
        None => default.exists().then_some(default),
    };
    let tdx = match path.map(Config::load) {
        None => TdxConfig::default(),
        Some(Ok(c)) => c.tdx,
        Some(Err(e)) => {
            eprintln!("fleet-sidecar: {e}");
            return ExitCode::from(EXIT_CONFIG);
        }
    };
    match read_mrtd_bounded(&tdx, MRTD_READ_TIMEOUT) {
        Ok(r) => {
            println!("{}\t{}", r.mrtd, r.source);
            ExitCode::SUCCESS
        }
        Err(e) => {
            for (source, err) in &e.failures {
                eprintln!("{source}: {err}");
            }
            eprintln!("fleet-sidecar: no MRTD source worked");
            ExitCode::from(EXIT_FAILURE)
        }
    }
}
