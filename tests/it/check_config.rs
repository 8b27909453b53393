//! `fleet-sidecar check-config`, `completions` and the man page: what an image build step
//! and a hand install run.

use std::path::Path;
use std::process::Output;

use fleet_sidecar::testing::sandbox::{MRTD_HEX, PEER_ID};

use crate::common::run_once;

/// Grepped for in every output (`.ci/run` greps the whole run for this marker too).
const TOKEN: &str = "NEVER-LOGGED-TOKEN-check-config";

fn run(args: &[&str]) -> Output {
    run_once(args, &[])
}

fn text(out: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// A merod home with a config.toml (PeerId, listen address) and a sysfs MRTD attribute;
/// `extra` goes at the top of the sidecar's config.
fn node(dir: &Path, extra: &str) -> std::path::PathBuf {
    let node = dir.join("calimero/default");
    std::fs::create_dir_all(&node).unwrap();
    std::fs::write(
        node.join("config.toml"),
        format!("[identity]\npeer_id = \"{PEER_ID}\"\nkeypair = \"SECRET-KEYPAIR\"\n[server]\nlisten = [\"/ip4/127.0.0.1/tcp/2999\"]\n"),
    )
    .unwrap();
    std::fs::write(dir.join("mrtd"), hex::decode(MRTD_HEX).unwrap()).unwrap();
    let d = dir.display();
    let cfg = dir.join("fleet-sidecar.toml");
    std::fs::write(
        &cfg,
        format!(
            "{extra}\nmdma_url = \"https://mdma.fleet.internal\"\n[merod]\nhome = \"{d}/calimero\"\n[tdx]\nmrtd_path = \"{d}/mrtd\"\nlegacy_mrtd_path = \"{d}/no\"\ndevice = \"{d}/no\"\ntsm_report_dir = \"{d}/no\"\n"
        ),
    )
    .unwrap();
    cfg
}

#[test]
fn check_config_prints_the_effective_config_and_what_it_could_read() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = node(dir.path(), &format!("fleet_token = \"{TOKEN}\""));
    let out = run(&["--config", cfg.to_str().unwrap(), "check-config"]);
    let (stdout, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(0), "{stdout}{stderr}");
    for line in [
        "mdma_url = \"https://mdma.fleet.internal/\"",
        "# fleet_token: set (the value is never shown)",
        // Defaults filled in.
        "poll_interval = \"1s\"",
        "state_file = \"/var/lib/calimero/fleet-confirmed.json\"",
        "leave_after_polls = 3",
        "leave_grace = \"1day\"",
        "mass_drop_hold = \"1day\"",
        "max_leaves_per_hour = 4",
        "node = \"default\"",
        "sources = [\"sysfs\", \"sysfs-legacy\", \"tdreport\", \"quote\"]",
        "[tls]",
        "dir = \"/mnt/data/tls\"",
        "install = true",
        "restart_units = [\"traefik.service\"]",
        "csr = true",
        "[logs_token]",
        "file = \"/etc/vector/provided_token\"",
        "[inventory]",
        "enabled = true",
        "[device_login]",
        "marker = \"/etc/calimero/device-key-login\"",
        "key_file = \"/mnt/data/fleet/login-node-key\"",
        "restart_units = [\"mero-auth.service\"]",
    ] {
        assert!(
            stdout.lines().any(|l| l == line),
            "no {line:?} in\n{stdout}"
        );
    }
    assert!(
        stdout.contains("admin_url = \"http://127.0.0.1:2999/\"  # from [server].listen of"),
        "{stdout}"
    );
    assert!(
        stdout.contains("# note  [tls] /mnt/data/tls/key.pem: "),
        "{stdout}"
    );
    assert!(
        stdout.contains("# note  [device_login] /etc/calimero/device-key-login does not exist: device-key login is off"),
        "{stdout}"
    );
    assert!(
        stdout.contains(&format!("# ok    PeerId {PEER_ID}")),
        "{stdout}"
    );
    assert!(
        stdout.contains(&format!("# ok    MRTD sysfs: {MRTD_HEX}")),
        "{stdout}"
    );
    assert!(stdout.contains("# fail  MRTD tdreport:"), "{stdout}");
    assert!(
        stdout.contains("# skip  MRTD quote: not tried"),
        "no quote is made: {stdout}"
    );
    for secret in [TOKEN, "SECRET-KEYPAIR"] {
        assert!(!stdout.contains(secret) && !stderr.contains(secret));
    }
    // No side effect: nothing created next to the config, the state file untouched.
    let mut names: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort();
    assert_eq!(names, ["calimero", "fleet-sidecar.toml", "mrtd"]);
    // The uncommented lines are valid TOML (the same keys the config file takes).
    let body: String = stdout
        .lines()
        .map(|l| l.split("  # ").next().unwrap())
        .collect::<Vec<_>>()
        .join("\n");
    fleet_sidecar::Config::from_toml(&body, Path::new("printed"))
        .expect("the printed configuration loads");
}

#[test]
fn check_config_without_merod_or_mrtd_still_passes_and_says_so() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = node(dir.path(), "");
    std::fs::remove_dir_all(dir.path().join("calimero")).unwrap();
    std::fs::remove_file(dir.path().join("mrtd")).unwrap();
    let out = run(&["--config", cfg.to_str().unwrap(), "check-config"]);
    let (stdout, _) = text(&out);
    assert_eq!(out.status.code(), Some(0), "{stdout}");
    assert!(stdout.contains("# fleet_token: unset"), "{stdout}");
    assert!(stdout.contains("admin_url = \"http://127.0.0.1:2528/\"  # from the default"));
    assert!(
        stdout.contains("# fail  PeerId: cannot read merod config"),
        "{stdout}"
    );
    assert!(stdout.contains("# fail  MRTD sysfs:"), "{stdout}");
}

#[test]
fn check_config_exits_78_on_an_unusable_config() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = node(dir.path(), "pol_interval = \"1s\"");
    let out = run(&["--config", cfg.to_str().unwrap(), "check-config"]);
    let (stdout, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(78));
    assert!(stderr.contains("pol_interval"), "{stderr}");
    assert!(stdout.is_empty());
    let out = run(&[
        "--config",
        "/nonexistent/fleet-sidecar.toml",
        "check-config",
    ]);
    assert_eq!(out.status.code(), Some(78));
}

/// A relative path would be taken from wherever the daemon was started: refused, naming
/// the key, for every file and directory key.
#[test]
fn check_config_refuses_a_relative_path_naming_its_key() {
    for (extra, key) in [
        ("state_file = \"fleet/state.json\"", "state_file"),
        ("log_file = \"fleet.log\"", "log_file"),
        ("fleet_token_file = \"token\"", "fleet_token_file"),
        ("mdma_ca_file = \"./ca.pem\"", "mdma_ca_file"),
        ("[tls]\ndir = \"tls\"", "tls.dir"),
        ("[logs_token]\nfile = \"provided_token\"", "logs_token.file"),
        (
            "[logs_token]\nvector_script = \"configure_vector.sh\"",
            "logs_token.vector_script",
        ),
        (
            "[logs_token]\nvmagent_config = \"scrape.yml\"",
            "logs_token.vmagent_config",
        ),
        ("[device_login]\nkey_file = \"k\"", "device_login.key_file"),
        (
            "[registration]\ntoken_file = \"t\"",
            "registration.token_file",
        ),
    ] {
        let dir = tempfile::tempdir().unwrap();
        // The table keys go last, after the node's own tables.
        let cfg = node(dir.path(), "");
        let mut written = std::fs::read_to_string(&cfg).unwrap();
        if extra.starts_with('[') {
            written.push_str(extra);
        } else {
            written.insert_str(0, &format!("{extra}\n"));
        }
        std::fs::write(&cfg, written).unwrap();
        let out = run(&["--config", cfg.to_str().unwrap(), "check-config"]);
        let (stdout, stderr) = text(&out);
        assert_eq!(out.status.code(), Some(78), "{key}: {stdout}{stderr}");
        assert!(
            stderr.contains(&format!("{key} = ")) && stderr.contains("must be an absolute path"),
            "{key}: {stderr}"
        );
    }
    // merod.home and a [tdx] path, in the tables node() writes.
    for (from, to, key) in [
        ("home = \"", "home = \"rel", "merod.home"),
        ("mrtd_path = \"", "mrtd_path = \"rel", "tdx.mrtd_path"),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let cfg = node(dir.path(), "");
        let written = std::fs::read_to_string(&cfg).unwrap().replacen(from, to, 1);
        std::fs::write(&cfg, written).unwrap();
        let out = run(&["--config", cfg.to_str().unwrap(), "check-config"]);
        let (_, stderr) = text(&out);
        assert_eq!(out.status.code(), Some(78), "{key}: {stderr}");
        assert!(stderr.contains(&format!("{key} = ")), "{key}: {stderr}");
    }
}

/// The image-build gate on the config the package ships: refused (exit 78, naming
/// mdma_url) as shipped and with its placeholder uncommented, by `check-config` and by the
/// daemon alike; accepted once a real URL is put there.
#[test]
fn the_shipped_config_fails_check_config_and_run_until_mdma_url_is_filled_in() {
    let dir = tempfile::tempdir().unwrap();
    let shipped = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("packaging/fleet-sidecar.toml"),
    )
    .unwrap();
    let example = shipped
        .lines()
        .find(|l| l.starts_with("#mdma_url = "))
        .expect("the shipped config shows mdma_url, commented out")
        .to_owned();
    let cfg = dir.path().join("fleet-sidecar.toml");
    for (config, why) in [
        (shipped.clone(), "mdma_url is not set"),
        (shipped.replace(&example, &example[1..]), "placeholder"),
    ] {
        std::fs::write(&cfg, &config).unwrap();
        for cmd in ["check-config", "run"] {
            let out = run(&["--config", cfg.to_str().unwrap(), cmd]);
            let (stdout, stderr) = text(&out);
            assert_eq!(out.status.code(), Some(78), "{cmd}: {stdout}{stderr}");
            assert!(
                stderr.contains("mdma_url") && stderr.contains(why),
                "{cmd}: {stderr}"
            );
        }
    }
    // Filled in: valid (what it cannot read on this machine, merod and the MRTD, is reported
    // but does not fail it).
    std::fs::write(
        &cfg,
        shipped.replace(&example, "mdma_url = \"https://mdma.fleet.internal\""),
    )
    .unwrap();
    let out = run(&["--config", cfg.to_str().unwrap(), "check-config"]);
    let (stdout, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(0), "{stdout}{stderr}");
}

#[test]
fn completions_for_each_shell_and_a_man_page() {
    for (shell, marker) in [
        ("bash", "complete -F"),
        ("zsh", "#compdef fleet-sidecar"),
        ("fish", "complete -c fleet-sidecar"),
    ] {
        let out = run(&["completions", shell]);
        let (stdout, _) = text(&out);
        assert!(out.status.success(), "{shell}");
        assert!(stdout.contains(marker), "{shell}: {stdout}");
        assert!(stdout.contains("check-config"), "{shell}: {stdout}");
    }
    assert!(!run(&["completions", "tcsh"]).status.success());
    let out = run(&["man"]);
    let (page, _) = text(&out);
    assert!(out.status.success());
    assert!(
        page.starts_with(".ie \\n(.g .ds Aq") || page.contains(".TH fleet-sidecar 1"),
        "{page}"
    );
    assert!(page.contains("check\\-config"), "{page}");
    // Hidden from --help: it is a packaging step.
    let (help, _) = text(&run(&["--help"]));
    assert!(
        help.contains("completions") && !help.contains("\n  man "),
        "{help}"
    );
}

#[test]
fn check_config_calls_a_state_file_on_a_ram_filesystem_an_error_naming_it() {
    if !Path::new("/dev/shm").is_dir() {
        println!("SKIPPED: no /dev/shm");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let shm = tempfile::tempdir_in("/dev/shm").unwrap();
    let state = shm.path().join("fleet/fleet-confirmed.json");
    let cfg = node(dir.path(), &format!("state_file = \"{}\"", state.display()));
    let out = run(&["--config", cfg.to_str().unwrap(), "check-config"]);
    let (stdout, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(0), "still usable: {stdout}{stderr}");
    let error = stdout
        .lines()
        .find(|l| l.starts_with("# ERROR state_file"))
        .unwrap_or_else(|| panic!("no error line in\n{stdout}"));
    assert!(
        error.contains("RAM filesystem, tmpfs at /dev/shm"),
        "{error}"
    );
    assert!(!shm.path().join("fleet").exists(), "nothing created");

    // On disk (the test's temp dir here): no error.
    let disk = tempfile::tempdir_in(env!("CARGO_MANIFEST_DIR")).unwrap();
    let state = disk.path().join("fleet-confirmed.json");
    let cfg = node(dir.path(), &format!("state_file = \"{}\"", state.display()));
    let (stdout, _) = text(&run(&["--config", cfg.to_str().unwrap(), "check-config"]));
    assert!(!stdout.contains("# ERROR"), "{stdout}");
    assert!(
        stdout.contains("# ok    state_file") && stdout.contains("not on a RAM filesystem"),
        "{stdout}"
    );
}
