//! What ships: the systemd unit and logrotate snippet keep what operators rely on, and the
//! Debian package (`scripts/build-deb.sh`, cargo-deb) holds its files with their modes, the
//! conffile, the maintainer scripts' promises, and passes lintian. Checks the package `.ci/run`
//! built when `FLEET_SIDECAR_DEB` names it (so CI builds it once), else builds its own; skips
//! with a message when cargo-deb is not installed (`cargo install cargo-deb --locked`).

use std::path::{Path, PathBuf};
use std::process::Command;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn stdout_of(cmd: &mut Command) -> String {
    let out = cmd.output().expect("the command runs");
    assert!(
        out.status.success(),
        "{cmd:?} failed:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn available(program: &str, arg: &str) -> bool {
    Command::new(program)
        .arg(arg)
        .output()
        .is_ok_and(|o| o.status.success())
}

/// The package `.ci/run` built (`FLEET_SIDECAR_DEB`), else built into `dir` with the
/// README's command; `None` without cargo-deb.
fn build(dir: &Path) -> Option<PathBuf> {
    if let Some(deb) = std::env::var_os("FLEET_SIDECAR_DEB") {
        let deb = PathBuf::from(deb);
        assert!(
            deb.is_file(),
            "FLEET_SIDECAR_DEB: no package at {}",
            deb.display()
        );
        return Some(deb);
    }
    let cargo_deb = Command::new("cargo").args(["deb", "--version"]).output();
    if !cargo_deb.is_ok_and(|o| o.status.success()) {
        eprintln!("SKIP the Debian package test: cargo-deb is not installed (cargo install cargo-deb --locked)");
        return None;
    }
    let deb = dir.join("fleet-sidecar.deb");
    // What this test checks is the package's files, modes and scripts, none of which the
    // release profile's fat LTO changes; that LTO's long single-threaded link would only load
    // the machine while the timing-sensitive tests run beside this one. So the binary packed
    // here is built without it (cargo's documented profile overrides).
    stdout_of(
        Command::new(root().join("scripts/build-deb.sh"))
            .arg("--output")
            .arg(&deb)
            .env("CARGO_PROFILE_RELEASE_LTO", "false")
            .env("CARGO_PROFILE_RELEASE_CODEGEN_UNITS", "16")
            .current_dir(root()),
    );
    Some(deb)
}

#[test]
fn the_package_holds_every_file_with_its_mode_and_never_starts_or_purges_state() {
    let dir = tempfile::tempdir().unwrap();
    let Some(deb) = build(dir.path()) else {
        return;
    };
    // `dpkg-deb -c`: "<mode> <owner>/<group> <size> <date> <time> ./<path>".
    let listing = stdout_of(Command::new("dpkg-deb").arg("-c").arg(&deb));
    let entries: Vec<(String, String, String)> = listing
        .lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            Some((
                f.first()?.to_string(),
                f.get(1)?.to_string(),
                f.get(5)?.to_string(),
            ))
        })
        .collect();
    for (path, mode) in [
        ("./usr/bin/fleet-sidecar", "-rwxr-xr-x"),
        (
            "./usr/lib/systemd/system/fleet-sidecar.service",
            "-rw-r--r--",
        ),
        ("./etc/calimero/fleet-sidecar.toml", "-rw-------"),
        ("./etc/logrotate.d/fleet-sidecar", "-rw-r--r--"),
        ("./usr/lib/tmpfiles.d/fleet-sidecar.conf", "-rw-r--r--"),
        ("./usr/share/man/man1/fleet-sidecar.1.gz", "-rw-r--r--"),
        (
            "./usr/share/bash-completion/completions/fleet-sidecar",
            "-rw-r--r--",
        ),
        (
            "./usr/share/zsh/vendor-completions/_fleet-sidecar",
            "-rw-r--r--",
        ),
        (
            "./usr/share/fish/vendor_completions.d/fleet-sidecar.fish",
            "-rw-r--r--",
        ),
        ("./usr/share/doc/fleet-sidecar/copyright", "-rw-r--r--"),
        (
            "./usr/share/doc/fleet-sidecar/changelog.Debian.gz",
            "-rw-r--r--",
        ),
    ] {
        let found = entries.iter().find(|(_, _, p)| p == path);
        let (m, owner, _) = found.unwrap_or_else(|| panic!("no {path} in\n{listing}"));
        assert_eq!(m, mode, "{path}");
        assert!(owner == "root/root" || owner == "0/0", "{path}: {owner}");
    }
    assert!(
        !entries.iter().any(|(_, _, p)| p.starts_with("./var/lib")),
        "the package ships nothing under /var/lib:\n{listing}"
    );

    let info = |member: &str| stdout_of(Command::new("dpkg-deb").arg("-I").arg(&deb).arg(member));
    let control = info("control");
    assert!(control.contains("Package: fleet-sidecar"), "{control}");
    assert!(control.contains("Depends: libc6"), "{control}");
    let conffiles = info("conffiles");
    assert!(
        conffiles
            .lines()
            .any(|l| l == "/etc/calimero/fleet-sidecar.toml"),
        "{conffiles}"
    );
    let postinst = info("postinst");
    assert!(postinst.contains("deb-systemd-helper enable"), "{postinst}");
    assert!(postinst.contains("daemon-reload"), "{postinst}");
    let prerm = info("prerm");
    assert!(
        prerm.contains("deb-systemd-invoke stop fleet-sidecar.service"),
        "{prerm}"
    );
    let postrm = info("postrm");
    for script in [&postinst, &prerm, &postrm] {
        let commands: Vec<&str> = script
            .lines()
            .filter(|l| !l.trim_start().starts_with('#'))
            .collect();
        let commands = commands.join("\n");
        assert!(
            !commands.contains("systemctl start") && !commands.contains("invoke start"),
            "never starts:\n{script}"
        );
        assert!(
            !commands.contains("/var/lib/calimero") || !commands.contains("rm "),
            "never removes the state directory:\n{script}"
        );
    }
    assert!(!postrm.contains("rm -rf"), "{postrm}");

    // The packaged unit runs the packaged binary.
    let x = dir.path().join("x");
    stdout_of(Command::new("dpkg-deb").arg("-x").arg(&deb).arg(&x));
    let unit =
        std::fs::read_to_string(x.join("usr/lib/systemd/system/fleet-sidecar.service")).unwrap();
    assert!(
        unit.lines().any(|l| l
            == "ExecStart=/usr/bin/fleet-sidecar run --config /etc/calimero/fleet-sidecar.toml"),
        "{unit}"
    );
    assert!(!unit.contains("/usr/local/bin"), "{unit}");

    if !available("lintian", "--version") {
        eprintln!("SKIP lintian: not installed (apt-get install lintian)");
        return;
    }
    let out = Command::new("lintian")
        .arg(&deb)
        .output()
        .expect("lintian runs");
    let report = String::from_utf8_lossy(&out.stdout);
    let errors: Vec<&str> = report.lines().filter(|l| l.starts_with("E:")).collect();
    assert!(errors.is_empty(), "lintian errors:\n{report}");
}

fn read_shipped(path: &str) -> String {
    std::fs::read_to_string(std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(path))
        .expect("packaging file")
}

#[test]
fn the_unit_is_notify_with_a_watchdog_ordered_after_merod_and_hardened() {
    let unit = read_shipped("packaging/fleet-sidecar.service");
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
    // registered fleet token) and the TLS directory (a delivered certificate) are writable.
    for path in rw.trim_start_matches("ReadWritePaths=").split_whitespace() {
        let path = path.trim_start_matches('-');
        assert!(
            !path.starts_with("/mnt/data") || path == "/mnt/data/fleet" || path == "/mnt/data/tls",
            "{path} makes merod's data writable"
        );
    }
    assert!(
        rw.contains("-/mnt/data/tls"),
        "the [tls] dir is writable: a delivered certificate is installed there"
    );
    assert!(
        rw.contains("-/mnt/data/fleet"),
        "the token_file's directory is writable"
    );
}

#[test]
fn logrotate_signals_the_daemon_to_reopen_its_log() {
    let rotate = read_shipped("packaging/logrotate/fleet-sidecar");
    assert!(rotate.contains("/var/log/fleet-sidecar.log"));
    assert!(rotate.contains("systemctl kill -s HUP fleet-sidecar.service"));
}
