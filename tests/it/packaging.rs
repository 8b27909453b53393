//! The shipped systemd unit and logrotate snippet keep what operators rely on.

fn read(path: &str) -> String {
    std::fs::read_to_string(std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(path))
        .expect("packaging file")
}

#[test]
fn the_unit_is_notify_with_a_watchdog_ordered_after_merod_and_hardened() {
    let unit = read("packaging/fleet-sidecar.service");
    let lines: Vec<&str> = unit.lines().map(str::trim).collect();
    for directive in [
        "Type=notify",
        "After=merod.service network-online.target",
        "Restart=always",
        "WatchdogSec=60s",
        "ProtectSystem=strict",
        "NoNewPrivileges=yes",
        "PrivateTmp=yes",
        "ExecStart=/usr/local/bin/fleet-sidecar run --config /etc/calimero/fleet-sidecar.toml",
    ] {
        assert!(lines.contains(&directive), "missing {directive}");
    }
    let rw = lines
        .iter()
        .find(|l| l.starts_with("ReadWritePaths="))
        .expect("ReadWritePaths=");
    assert!(rw.contains("/var/lib/calimero") && rw.contains("/var/log/fleet-sidecar.log"));
    // merod's data stays read-only: of /mnt/data only the sidecar's own directory (the
    // registered fleet token) is writable.
    for path in rw.trim_start_matches("ReadWritePaths=").split_whitespace() {
        let path = path.trim_start_matches('-');
        assert!(
            !path.starts_with("/mnt/data") || path == "/mnt/data/fleet",
            "{path} makes merod's data writable"
        );
    }
    assert!(
        rw.contains("-/mnt/data/fleet"),
        "the token_file's directory is writable"
    );
}

#[test]
fn logrotate_signals_the_daemon_to_reopen_its_log() {
    let rotate = read("packaging/logrotate/fleet-sidecar");
    assert!(rotate.contains("/var/log/fleet-sidecar.log"));
    assert!(rotate.contains("systemctl kill -s HUP fleet-sidecar.service"));
}
