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
