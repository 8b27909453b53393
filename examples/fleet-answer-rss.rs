//! Peak RSS of reading a fleet-sized should-join answer: 10,000 assignments, each with 8
//! admitter addresses of the longest common form (the answer `MAX_POLL_BODY` is sized for).
//! Prints the body size and the process's peak RSS (`VmHWM`) before the body is built, with
//! the body in memory, and after `parse_should_join` read it. Run in release:
//! `cargo run --release --example fleet-answer-rss`.

use fleet_sidecar::testing::mdma::fleet_answer;
use fleet_sidecar::{mdma::parse_should_join, mdma::MAX_POLL_BODY};

/// `VmHWM` of this process, KiB (0 where /proc is not there).
fn peak_rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmHWM:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        })
        .unwrap_or(0)
}

fn main() {
    let start = peak_rss_kib();
    let body = fleet_answer(10_000, 8);
    let with_body = peak_rss_kib();
    let answer = parse_should_join(body.as_bytes()).expect("a valid answer");
    let parsed = peak_rss_kib();
    assert_eq!(answer.assignments.len(), 10_000);
    println!(
        "body {} bytes (cap {MAX_POLL_BODY}), 10,000 assignments x 8 admitter_addrs: peak RSS {start} KiB at start, {with_body} KiB with the body in memory, {parsed} KiB after parsing it (parse: +{} KiB)",
        body.len(),
        parsed - with_body
    );
}
