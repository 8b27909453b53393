//! `fleet-sidecar check-config` (like `nginx -t`): loads and validates the config file,
//! reads what it can without side effects — merod's config.toml for the PeerId and the
//! admin URL, each MRTD source — and prints the effective configuration with every default
//! filled in. The token is shown only as set/unset.
//!
//! Exit 0 when the config is usable, 78 (EX_CONFIG) when it is not. What cannot be read
//! yet on an image being built (merod's config.toml, the MRTD of a TD not running) is
//! reported, not fatal: the daemon waits for merod and polls without an MRTD.

use std::path::Path;
use std::time::Duration;

use crate::config::{Config, LogFormat, LogTarget};
use crate::identity::{read_peer_id, resolve_admin_url};
use crate::mrtd::{read_source, MrtdSource};
use crate::state::volatile::check_state_dir;

/// Runs the check on the config file at `path`: the report goes to stdout, a config error
/// to stderr. Returns whether the config is usable.
pub(crate) fn run(path: &Path) -> bool {
    match Config::load(path) {
        Ok(cfg) => {
            print!("{}", render(path, &cfg));
            true
        }
        Err(e) => {
            eprintln!("fleet-sidecar: {e}");
            false
        }
    }
}

/// A TOML string literal (quoted and escaped).
fn quoted(s: impl AsRef<str>) -> String {
    toml::Value::String(s.as_ref().to_owned()).to_string()
}

fn duration(d: Duration) -> String {
    quoted(humantime_serde::re::humantime::format_duration(d).to_string())
}

fn path(p: &Path) -> String {
    quoted(p.display().to_string())
}

/// The effective configuration as TOML (checks and unset keys as comments), then the
/// results of the side-effect-free reads.
fn render(file: &Path, cfg: &Config) -> String {
    let mut out = String::new();
    top_level_keys(&mut out, file, cfg);
    tables(&mut out, cfg);
    reads(&mut out, cfg);
    out
}

/// Appends `s` and a newline to `out`.
fn push_line(out: &mut String, s: String) {
    out.push_str(&s);
    out.push('\n');
}

/// The header and the top-level keys.
fn top_level_keys(out: &mut String, file: &Path, cfg: &Config) {
    let mut line = |s: String| push_line(out, s);
    line(format!(
        "# {}: valid. Effective configuration, every default filled in.",
        file.display()
    ));
    for w in &cfg.warnings {
        line(format!("# warning: {w}"));
    }
    line(format!("mdma_url = {}", quoted(cfg.mdma_url.as_str())));
    line(format!(
        "# fleet_token: {} (the value is never shown)",
        if cfg.fleet_token.is_some() {
            "set"
        } else {
            "unset"
        }
    ));
    if let Some(p) = &cfg.fleet_token_file {
        line(format!(
            "fleet_token_file = {}  # read again on a refused poll and on SIGHUP",
            path(p)
        ));
    }
    match &cfg.mdma_ca_file {
        Some(p) => line(format!("mdma_ca_file = {}", path(p))),
        None => line("# mdma_ca_file: unset (system roots only)".to_owned()),
    }
    line(format!("poll_interval = {}", duration(cfg.poll_interval)));
    line(format!("state_file = {}", path(&cfg.state_file)));
    line(format!("log_file = {}", path(&cfg.log_file)));
    let format = match cfg.log_format {
        LogFormat::Text => "text",
        LogFormat::Json => "json",
    };
    line(format!("log_format = {}", quoted(format)));
    let target = match cfg.log_target {
        LogTarget::Auto => "auto",
        LogTarget::Journald => "journald",
        LogTarget::Stderr => "stderr",
    };
    line(format!("log_target = {}", quoted(target)));
    line(format!("log_to_file = {}", cfg.log_to_file));
    match cfg.status_listen {
        Some(a) => line(format!("status_listen = {}", quoted(a.to_string()))),
        None => line("# status_listen: unset (no status listener)".to_owned()),
    }
    line(format!(
        "ready_max_poll_age = {}",
        duration(cfg.ready_max_poll_age)
    ));
    line(format!("max_backoff = {}", duration(cfg.max_backoff)));
    let p = &cfg.leave_policy;
    line(format!("leave_after_polls = {}", p.leave_after_polls));
    line(format!("leave_grace = {}", duration(p.leave_grace)));
    line(format!("mass_drop_min = {}", p.mass_drop_min));
    line(format!("mass_drop_hold = {}", duration(p.mass_drop_hold)));
    line(format!(
        "max_leaves_per_minute = {}",
        p.max_leaves_per_minute
    ));
    line(format!("max_leaves_per_hour = {}", p.max_leaves_per_hour));
    line(format!(
        "max_concurrent_joins = {}",
        cfg.max_concurrent_joins
    ));
    line(format!("join_timeout = {}", duration(cfg.join_timeout)));
    line(format!("leave_timeout = {}", duration(cfg.leave_timeout)));
    line(format!("leave_orphans = {}", cfg.leave_orphans));
}

/// The tables, `[merod]` to `[device_login]`.
fn tables(out: &mut String, cfg: &Config) {
    let mut line = |s: String| push_line(out, s);
    line(String::new());
    line("[merod]".to_owned());
    line(format!("home = {}", path(&cfg.merod.home)));
    line(format!("node = {}", quoted(&cfg.merod.node)));
    // The daemon's own resolution order, and where the URL came from.
    let resolved = resolve_admin_url(&cfg.merod);
    let (admin_url, from) = (resolved.url.to_string(), resolved.source);
    line(format!("admin_url = {}  # from {from}", quoted(admin_url)));
    for url in &resolved.fallbacks {
        line(format!("# then, if it does not answer: {url}"));
    }
    line(String::new());
    line("[tdx]".to_owned());
    line(format!("mrtd_path = {}", path(&cfg.tdx.mrtd_path)));
    line(format!(
        "legacy_mrtd_path = {}",
        path(&cfg.tdx.legacy_mrtd_path)
    ));
    line(format!("device = {}", path(&cfg.tdx.device)));
    line(format!(
        "tsm_report_dir = {}",
        path(&cfg.tdx.tsm_report_dir)
    ));
    let sources: Vec<String> = cfg.tdx.sources.iter().map(|s| quoted(s.as_str())).collect();
    line(format!("sources = [{}]", sources.join(", ")));
    if let Some(reg) = &cfg.registration {
        line(String::new());
        line("[registration]".to_owned());
        line(format!("token_file = {}", path(&reg.token_file)));
        line(format!(
            "metadata_url = {}",
            quoted(reg.metadata_url.as_str())
        ));
        match &reg.enrolment_token_file {
            Some(p) => line(format!("enrolment_token_file = {}", path(p))),
            None => {
                line("# enrolment_token_file: unset (the metadata's enrolment-token)".to_owned())
            }
        }
        match &reg.relay_url {
            Some(r) => line(format!("relay_url = {}", quoted(r))),
            None => line("# relay_url: unset (the metadata's relay-url)".to_owned()),
        }
        line(format!("retry_interval = {}", duration(reg.retry_interval)));
    }
    line(String::new());
    line("[tls]".to_owned());
    line(format!("report = {}", cfg.tls.report));
    line(format!("dir = {}", path(&cfg.tls.dir)));
    line(format!("install = {}", cfg.tls.install));
    line(format!(
        "restart_units = [{}]",
        cfg.tls
            .restart_units
            .iter()
            .map(String::as_str)
            .map(quoted)
            .collect::<Vec<_>>()
            .join(", ")
    ));
    line(format!("csr = {}", cfg.tls.csr));
    line(String::new());
    line("[logs_token]".to_owned());
    line(format!("report = {}", cfg.logs_token.report));
    line(format!("file = {}", path(&cfg.logs_token.file)));
    let lt = &cfg.logs_token;
    line(format!("install = {}", lt.install));
    for (key, endpoint, attribute) in [
        ("logs_endpoint", &lt.logs_endpoint, "logs-endpoint"),
        ("metrics_endpoint", &lt.metrics_endpoint, "metrics-endpoint"),
    ] {
        line(match endpoint {
            Some(e) => format!("{key} = {}", quoted(e)),
            None => format!("# {key}: unset (the metadata's {attribute})"),
        });
    }
    line(format!("vector = {}", lt.vector));
    line(format!("vector_script = {}", path(&lt.vector_script)));
    line(format!("vector_config = {}", path(&lt.vector_config)));
    line(format!("vector_unit = {}", quoted(&lt.vector_unit)));
    line(format!("vmagent = {}", lt.vmagent));
    line(format!("vmagent_script = {}", path(&lt.vmagent_script)));
    line(format!("vmagent_config = {}", path(&lt.vmagent_config)));
    line(String::new());
    line("[inventory]".to_owned());
    line(format!("enabled = {}", cfg.inventory.enabled));
    line(String::new());
    line("[recovery]".to_owned());
    line(format!("enabled = {}", cfg.recovery.enabled));
    line(String::new());
    let dl = &cfg.device_login;
    line("[device_login]".to_owned());
    line(format!("enabled = {}", dl.enabled));
    line(format!("marker = {}", path(&dl.marker)));
    line(format!("key_file = {}", path(&dl.key_file)));
    line(format!(
        "restart_units = [{}]",
        dl.restart_units
            .iter()
            .map(String::as_str)
            .map(quoted)
            .collect::<Vec<_>>()
            .join(", ")
    ));
}

/// The results of the side-effect-free reads, as comments.
fn reads(out: &mut String, cfg: &Config) {
    let mut line = |s: String| push_line(out, s);
    let merod_config = cfg.merod.config_toml();
    let lt = &cfg.logs_token;
    let dl = &cfg.device_login;
    line(String::new());
    line("# What could be read (nothing was written, created or called):".to_owned());
    line(match check_state_dir(&cfg.state_file) {
        Ok(Some(fs)) => format!(
            "# ERROR state_file {}: its directory is on a RAM filesystem, {fs}: a reboot loses what this node admitted and a namespace withdrawn while it was down is never left; put it on persistent storage (e.g. /mnt/data/fleet/fleet-confirmed.json)",
            cfg.state_file.display()
        ),
        Ok(None) => format!(
            "# ok    state_file {}: not on a RAM filesystem",
            cfg.state_file.display()
        ),
        Err(e) => format!("# fail  state_file: {e}"),
    });
    match read_peer_id(&merod_config) {
        Ok(id) => line(format!(
            "# ok    PeerId {id} (from {})",
            merod_config.display()
        )),
        Err(e) => line(format!(
            "# fail  PeerId: {e} (the daemon waits for it and exits if it stays unreadable)"
        )),
    }
    if let Some(reg) = &cfg.registration {
        line(format!(
            "# {}",
            crate::registration::token_file_presence(&reg.token_file)
        ));
    }
    if let Some(cert) = cfg.tls.cert_file() {
        line(match std::fs::File::open(&cert) {
            Ok(_) => format!("# ok    [tls] {} is readable", cert.display()),
            Err(e) if cfg.tls.dir.is_dir() => format!(
                "# note  [tls] {}: {e} (polls report tls_cert_not_after = \"\": MDMA sends a certificate)",
                cert.display()
            ),
            Err(_) => format!(
                "# fail  [tls] dir {}: not a directory (polls report tls_cert_not_after = \"\")",
                cfg.tls.dir.display()
            ),
        });
    }
    if cfg.tls.install {
        let key = cfg.tls.key_file();
        line(match std::fs::File::open(&key) {
            Ok(_) => format!(
                "# ok    [tls] {} is readable (a delivered certificate must certify it)",
                key.display()
            ),
            Err(e) => format!(
                "# note  [tls] {}: {e} (a delivered certificate is refused: nothing to match it with)",
                key.display()
            ),
        });
    }
    if let Some(file) = cfg.logs_token.reported_file() {
        line(match std::fs::File::open(file) {
            Ok(_) => format!("# ok    [logs_token] {} is readable", file.display()),
            Err(e) => format!(
                "# note  [logs_token] {}: {e} (polls report logs_token_fp = \"\" until MDMA delivers one)",
                file.display()
            ),
        });
    }
    if lt.install {
        for (on, name, script, config) in [
            (lt.vector, "vector", &lt.vector_script, &lt.vector_config),
            (
                lt.vmagent,
                "vmagent",
                &lt.vmagent_script,
                &lt.vmagent_config,
            ),
        ] {
            if !on {
                continue;
            }
            let runnable = crate::config::is_executable(script);
            line(if runnable && config.is_file() {
                format!(
                    "# ok    [logs_token] {name}: {} is executable, {} exists",
                    script.display(),
                    config.display()
                )
            } else {
                format!("# note  [logs_token] {name}: {} not executable or {} missing ({name} is not configured when a token is delivered)", script.display(), config.display())
            });
        }
    }
    if dl.enabled {
        let marker = dl.marker.display();
        line(match dl.marker.try_exists() {
            Ok(true) => format!(
                "# ok    [device_login] {marker} exists: merod's node key is kept in {}",
                dl.key_file.display()
            ),
            Ok(false) => {
                format!("# note  [device_login] {marker} does not exist: device-key login is off")
            }
            Err(e) => format!("# fail  [device_login] {marker}: {e}"),
        });
    }
    for &source in &cfg.tdx.sources {
        line(match source {
            // A quote is made by creating an entry under configfs-tsm: a side effect.
            MrtdSource::Quote => {
                let dir = &cfg.tdx.tsm_report_dir;
                format!(
                    "# skip  MRTD quote: not tried (it creates a configfs-tsm entry); {} {}",
                    dir.display(),
                    if dir.is_dir() {
                        "is present"
                    } else {
                        "is absent"
                    }
                )
            }
            source => match read_source(&cfg.tdx, source) {
                Ok(m) => format!("# ok    MRTD {source}: {m}"),
                Err(e) => format!("# fail  MRTD {source}: {e}"),
            },
        });
    }
}
