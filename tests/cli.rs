//! The `weir` command as a platform team meets it on its first day: a mistake is refused before
//! anything is printed or written, and says which argument is wrong.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a panic is a failed check

use std::process::{Command, Output};

use weir_e2e::workspace_root;

fn weir(args: &[&str]) -> Output {
    Command::new(workspace_root().join("target/debug/weir"))
        .args(args)
        .output()
        .unwrap()
}

#[test]
fn a_new_key_for_a_malformed_tenant_is_refused_before_any_key_is_printed() {
    // Before, the key was printed and only then the tenant path refused: a key minted for an
    // entry that could not be used, already in the terminal's scrollback.
    for tenant in ["acme/ml", "acme/ml/chat/extra", "acme/m l/chat"] {
        let out = weir(&["keys", "new", "--tenant", tenant]);
        assert!(!out.status.success(), "{tenant}");
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(stdout.is_empty(), "{tenant}: printed {stdout:?}");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains("--tenant"), "{tenant}: {stderr}");
    }
    let out = weir(&["keys", "new", "--tenant", "acme/ml/chat", "--id", "ci"]);
    assert!(out.status.success());
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.starts_with("key: "), "{stdout}");
    assert!(
        stdout.contains("(its tenant path: acme/ml/chat/ci)"),
        "{stdout}"
    );
}

#[test]
fn usage_from_a_ledger_that_is_not_there_is_an_error_and_creates_nothing() {
    // Before, a mistyped `--ledger` created an empty database and printed only a header, exit 0.
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("weir-ledgr.sqlite");
    let out = weir(&[
        "usage",
        "--ledger",
        missing.to_str().unwrap(),
        "--since",
        "all",
    ]);
    assert!(!out.status.success());
    assert!(
        out.stdout.is_empty(),
        "{:?}",
        String::from_utf8_lossy(&out.stdout)
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("no ledger there"), "{stderr}");
    assert!(
        !missing.exists(),
        "weir usage created the file it was to read"
    );
}

#[test]
fn usage_piped_into_a_reader_that_stops_early_ends_quietly() {
    // `weir usage --format json | head` panicked on the broken pipe.
    let dir = tempfile::tempdir().unwrap();
    let ledger = dir.path().join("ledger.sqlite");
    let conn = weir_sidecar::ledger::open(&ledger).unwrap();
    for i in 0..2_000 {
        let record = weir_sidecar::ledger::UsageRecord {
            idempotency_key: format!("k{i}"),
            attempt: 1,
            request_id: format!("r{i}"),
            tenant: "acme/ml/chat/ci".into(),
            model: "m".into(),
            source: "engine".into(),
            outcome: "ok".into(),
            finished_at_ms: 1_000 + i,
            ..Default::default()
        };
        weir_sidecar::ledger::append(&conn, &record).unwrap();
    }
    drop(conn);
    let mut child = Command::new(workspace_root().join("target/debug/weir"))
        .args([
            "usage",
            "--ledger",
            ledger.to_str().unwrap(),
            "--since",
            "all",
        ])
        .args(["--format", "json"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // The reader takes nothing and goes away.
    drop(child.stdout.take());
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{:?}: {stderr}", out.status);
    assert!(!stderr.contains("panicked"), "{stderr}");
}
