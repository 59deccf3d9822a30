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
    assert!(
        stdout.contains("(its tenant path: acme/ml/chat/ci)"),
        "{stdout}"
    );
}

#[test]
fn a_new_key_is_printed_apart_from_its_config_entry() {
    // Before, `key: wk-…` and the entry in one block: pasted whole into a WasmPlugin, the secret
    // key was there for anyone who can read it.
    let out = weir(&["keys", "new", "--tenant", "acme/ml/chat", "--id", "ci"]);
    assert!(out.status.success());
    let stdout = String::from_utf8_lossy(&out.stdout);
    let (key_part, entry) = stdout
        .split_once("Config entry: only the key's sha256, never the key:\n")
        .unwrap_or_else(|| panic!("no entry heading in {stdout}"));
    assert!(
        key_part.starts_with("API key: give this to the caller; it is not stored anywhere"),
        "{stdout}"
    );
    let key = key_part
        .split_whitespace()
        .find(|w| w.starts_with("wk-"))
        .unwrap_or_else(|| panic!("no key in {key_part}"));
    assert!(!entry.contains(key), "the key in its entry: {stdout}");
    let hash = weir_core::keys::hash_key(key);
    assert!(
        entry.ends_with(&format!("- id: ci\n  sha256: {hash}\n")),
        "{entry}"
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

#[test]
fn usage_by_run_sums_each_run_s_calls() {
    let dir = tempfile::tempdir().unwrap();
    let ledger = dir.path().join("ledger.sqlite");
    let conn = weir_sidecar::ledger::open(&ledger).unwrap();
    for (i, (tenant, run)) in [
        ("acme/ml/chat/agent", Some("run-1")),
        ("acme/ml/chat/agent", Some("run-1")),
        ("acme/ml/chat/agent", None),
        ("beta/ml/chat/agent", Some("run-1")),
    ]
    .into_iter()
    .enumerate()
    {
        let record = weir_sidecar::ledger::UsageRecord {
            idempotency_key: format!("k{i}"),
            attempt: 1,
            request_id: format!("r{i}"),
            tenant: tenant.into(),
            outcome: "ok".into(),
            prompt_tokens: 10,
            tool_calls: 1,
            started_at_ms: Some(1_000 * i as u64),
            finished_at_ms: 1_000 * i as u64 + 500,
            run_id: run.map(str::to_owned),
            ..Default::default()
        };
        weir_sidecar::ledger::append(&conn, &record).unwrap();
    }
    drop(conn);
    let path = ledger.to_str().unwrap();
    let out = weir(&["usage", "--ledger", path, "--since", "all", "--by", "run"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 3, "{text}");
    assert!(
        lines[0].starts_with("tenant,agent_id,run_id,calls,tool_calls,"),
        "{text}"
    );
    assert!(
        lines[1].starts_with("acme/ml/chat/agent,,run-1,2,2,20,"),
        "{text}"
    );
    assert!(lines[1].ends_with(",1500,ok"), "{text}");
    let out = weir(&[
        "usage", "--ledger", path, "--since", "all", "--by", "run", "--format", "json",
    ]);
    let runs: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(runs[1]["tenant"], "beta/ml/chat/agent");
    assert_eq!(runs[1]["calls"], 1);
}

/// `weir config check` run in `dir` on `file` (a path relative to it) with `flags`: whether it
/// passed, and what it printed on stderr.
fn config_check(dir: &std::path::Path, file: &str, text: &str, flags: &[&str]) -> (bool, String) {
    std::fs::write(dir.join(file), text).unwrap();
    let out = Command::new(workspace_root().join("target/debug/weir"))
        .current_dir(dir)
        .args(["config", "check", file])
        .args(flags)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!stderr.contains("panicked"), "{stderr}");
    (out.status.success(), stderr)
}

/// A filter config of one key whose hash is `hash`, its org on `tier`.
fn filter_config(tier: &str, hash: &str) -> String {
    format!(
        "orgs:\n- id: acme\n  policy: {{tier: {tier}}}\n  workspaces:\n  - id: ml\n    projects:\n    \
         - id: chat\n      keys:\n      - {{id: ci, sha256: '{hash}'}}\nroutes: {{default: {{mode: enforce}}}}\n"
    )
}

const A_HASH: &str = "5f1c6a1e0e4b5d9b0c43d5e1f3f8c2a7b6d4e9f0a1b2c3d4e5f60718293a4b5c";
const ZEROS: &str = "0000000000000000000000000000000000000000000000000000000000000000";

#[test]
fn a_typo_d_tier_is_refused_with_its_field() {
    // Before, `tier: enterprize` passed: the key was then neither shed as `free` nor labelled
    // `enterprise`, silently.
    let dir = tempfile::tempdir().unwrap();
    let (passed, _) = config_check(
        dir.path(),
        "weir.yaml",
        &filter_config("enterprise", A_HASH),
        &[],
    );
    assert!(passed);
    let typo = filter_config("enterprize", A_HASH);
    let (passed, stderr) = config_check(dir.path(), "weir.yaml", &typo, &[]);
    assert!(!passed, "{stderr}");
    assert_eq!(
        stderr,
        "error weir.yaml: orgs[0].policy.tier: 'enterprize' is not a known tier (free, standard, \
         enterprise); declare another under `tiers`\n"
    );
    // A tier of the platform's own, declared.
    let declared = format!("tiers: [enterprize]\n{typo}");
    let (passed, stderr) = config_check(dir.path(), "weir.yaml", &declared, &[]);
    assert!(passed, "{stderr}");
}

/// What `weir config check` says of `text` (in `file`) without `--strict` and with it: each
/// placeholder named by `place`, a warning, that fails only a strict check.
fn warned_of(file: &str, text: &str, place: &str) {
    let dir = tempfile::tempdir().unwrap();
    let (passed, stderr) = config_check(dir.path(), file, text, &[]);
    assert!(passed, "{file}: {stderr}");
    let warning = format!("warn  {file}: {place}: ");
    assert!(
        stderr
            .lines()
            .any(|l| l.starts_with(&warning) && l.contains("placeholder")),
        "{file}: expected {warning:?} in {stderr}"
    );
    assert!(!stderr.contains("error"), "{stderr}");
    let (passed, strict) = config_check(dir.path(), file, text, &["--strict"]);
    assert!(!passed, "--strict passed {file}");
    assert_eq!(strict, stderr, "the same report, only the exit differs");
}

/// A sidecar config in a ConfigMap, for the manifests around it to be checked with.
const SIDECAR_CONFIG_MAP: &str = "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: weir-sidecar}\n\
    data:\n  sidecar.yaml: |\n    pools:\n    - model: m\n      replicas: [http://127.0.0.1:8000]\n    \
    signing: {secret_file: /run/secrets/weir/signing-secret}\n";

#[test]
fn a_secret_still_holding_replace_me_is_warned_of_and_fails_a_strict_check() {
    // Before, the shipped Secret's placeholder values passed without a word.
    let string_data = format!(
        "apiVersion: v1\nkind: Secret\nmetadata: {{name: weir-sidecar}}\nstringData:\n  \
         signing-secret: REPLACE-ME-with-32-or-more-random-bytes-0123456789abcdef\n---\n{SIDECAR_CONFIG_MAP}"
    );
    warned_of(
        "kustomized.yaml",
        &string_data,
        "document 1 (Secret weir-sidecar): stringData.signing-secret",
    );
    // As `kubectl kustomize` renders a secretGenerator's: base64 under `data`.
    let data = format!(
        "apiVersion: v1\nkind: Secret\nmetadata: {{name: weir-sidecar}}\ndata:\n  \
         ledger-dsn: cG9zdGdyZXNxbDovL3dlaXI6UkVQTEFDRS1NRUBwb3N0Z3JlczoxMjM0L3dlaXI=\n---\n{SIDECAR_CONFIG_MAP}"
    );
    warned_of(
        "kustomized.yaml",
        &data,
        "document 1 (Secret weir-sidecar): data.ledger-dsn",
    );
}

#[test]
fn a_key_hash_of_zeros_is_warned_of_and_fails_a_strict_check() {
    warned_of(
        "weir.yaml",
        &filter_config("standard", ZEROS),
        "orgs[0].workspaces[0].projects[0].keys[0].sha256",
    );
}

/// A WasmPlugin pulling the filter from `registry`, pinned to `digest`.
fn plugin_from(registry: &str, digest: &str) -> String {
    format!(
        "apiVersion: extensions.istio.io/v1alpha1\nkind: WasmPlugin\nmetadata: {{name: weir}}\nspec:\n  \
         url: oci://{registry}/weir/filter:0.1.0\n  sha256: \"{digest}\"\n  pluginConfig:\n    \
         orgs: [{{id: acme, workspaces: [{{id: ml, projects: [{{id: chat, keys: [{{id: ci, sha256: {A_HASH}}}]}}]}}]}}]\n    \
         routes: {{default: {{mode: enforce}}}}\n"
    )
}

/// The sidecar's Deployment, its image from `registry` pinned to `digest`, and its ConfigMap.
fn deployment_from(registry: &str, digest: &str) -> String {
    format!(
        "apiVersion: apps/v1\nkind: Deployment\nmetadata: {{name: weir-sidecar}}\nspec:\n  template:\n    \
         spec:\n      containers:\n      - name: sidecar\n        \
         image: {registry}/weir/sidecar@sha256:{digest}\n---\n{SIDECAR_CONFIG_MAP}"
    )
}

const IMAGE: &str = "document 1 (Deployment weir-sidecar): spec.template.spec.containers[0].image";

#[test]
fn an_image_digest_of_zeros_is_warned_of_and_fails_a_strict_check() {
    let plugin = plugin_from("ghcr.io/acme", ZEROS);
    warned_of(
        "wasmplugin.yaml",
        &plugin,
        "document 1 (WasmPlugin weir): spec.sha256",
    );
    let deployment = deployment_from("ghcr.io/acme", ZEROS);
    warned_of("kustomized.yaml", &deployment, IMAGE);
}

#[test]
fn an_example_com_registry_is_warned_of_and_fails_a_strict_check() {
    // Before, the shipped manifests' `registry.example.com` passed a strict check once their
    // digests were filled in.
    let plugin = plugin_from("registry.example.com", A_HASH);
    warned_of(
        "wasmplugin.yaml",
        &plugin,
        "document 1 (WasmPlugin weir): spec.url",
    );
    let deployment = deployment_from("registry.example.com", A_HASH);
    warned_of("kustomized.yaml", &deployment, IMAGE);
}

#[test]
fn manifests_are_checked_file_by_file_or_from_stdin() {
    // Before, one FILE only, `-` was "No such file", and a file without a weir config (a
    // Deployment, a Secret) failed the check: `--strict` on the manifests failed CI whatever they
    // held.
    let dir = tempfile::tempdir().unwrap();
    let secret = "apiVersion: v1\nkind: Secret\nmetadata: {name: weir-sidecar}\nstringData:\n  \
                  signing-secret: 7c1e0b7f3a9d44c2b5e8a1f06d3c9e2b\n";
    std::fs::write(dir.path().join("secret.yaml"), secret).unwrap();
    std::fs::write(dir.path().join("sidecar.yaml"), SIDECAR_CONFIG_MAP).unwrap();
    let check = |args: &[&str], stdin: &str| {
        use std::io::Write;
        let mut child = Command::new(workspace_root().join("target/debug/weir"))
            .current_dir(dir.path())
            .args(["config", "check", "--strict"])
            .args(args)
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let mut input = child.stdin.take().unwrap();
        input.write_all(stdin.as_bytes()).unwrap();
        drop(input);
        let out = child.wait_with_output().unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        (out.status.success(), stdout, stderr)
    };
    let (passed, stdout, stderr) = check(&["secret.yaml", "sidecar.yaml"], "");
    assert!(passed, "{stdout}{stderr}");
    assert!(
        stdout.starts_with("note  secret.yaml: no weir config in it (placeholders checked)\n"),
        "{stdout}"
    );
    assert!(
        stdout.contains("ok    sidecar.yaml: document 1 (ConfigMap weir-sidecar sidecar.yaml)")
    );
    // The same Secret with its placeholder, piped in among the rest.
    let placeholder = secret.replace("7c1e0b7f3a9d44c2b5e8a1f06d3c9e2b", "REPLACE-ME");
    let (passed, _, stderr) = check(&["-", "sidecar.yaml"], &placeholder);
    assert!(!passed);
    assert!(
        stderr.contains("warn  stdin: document 1 (Secret weir-sidecar): stringData.signing-secret"),
        "{stderr}"
    );
    // No weir config in any of them: pointed at the wrong files.
    let (passed, _, stderr) = check(&["secret.yaml", "-"], "kind: Service\n");
    assert!(!passed);
    assert!(
        stderr.contains("error no weir config in any of these 2 inputs"),
        "{stderr}"
    );
}

#[test]
fn a_wrong_type_says_what_the_field_must_be_naming_the_file_and_the_field_once() {
    // Before: "error file: orgs[0].limits.requests_per_minute: orgs[0].limits.requests_per_minute:
    // invalid type: integer `-5`, expected u64 at line 3 column 33".
    let dir = tempfile::tempdir().unwrap();
    let negative = filter_config("standard", A_HASH).replace(
        "  policy:",
        "  limits: {requests_per_minute: -5}\n  policy:",
    );
    let (passed, stderr) = config_check(dir.path(), "weir.yaml", &negative, &[]);
    assert!(!passed);
    assert_eq!(
        stderr,
        "error weir.yaml: orgs[0].limits.requests_per_minute: must be a non-negative integer, \
         not -5\n"
    );
    let sidecar = "pools:\n- model: m\n  replicas: http://127.0.0.1:8000\n";
    let (passed, stderr) = config_check(dir.path(), "sidecar.yaml", sidecar, &[]);
    assert!(!passed);
    assert_eq!(
        stderr,
        "error sidecar.yaml: pools[0].replicas: must be a list, not \"http://127.0.0.1:8000\"\n"
    );
}

#[test]
fn a_file_that_is_not_yaml_says_where() {
    // Before, the message was "document 1", nothing more.
    let dir = tempfile::tempdir().unwrap();
    let (passed, stderr) = config_check(dir.path(), "weir.yaml", "orgs: [\n", &[]);
    assert!(!passed);
    assert!(
        stderr.starts_with("error weir.yaml: document 1: did not find expected node content")
            && stderr.contains("(line 2, column 1)"),
        "{stderr}"
    );
}

#[test]
fn each_document_of_a_stream_is_checked_on_its_own() {
    // Before, the first of several documents was parsed as the whole stream: "deserializing
    // from YAML containing more than one document is not supported".
    let dir = tempfile::tempdir().unwrap();
    let two = format!(
        "{}---\n{}",
        filter_config("standard", A_HASH),
        filter_config("free", A_HASH).replace("id: ci", "id: cd")
    );
    let (passed, stderr) = config_check(dir.path(), "two.yaml", &two, &[]);
    assert!(passed, "{stderr}");
}

#[test]
fn a_bare_off_in_a_manifest_fails_the_check_as_it_fails_the_filter() {
    // Kubernetes reads a manifest's YAML as YAML 1.1, where a bare `off` (or `on`, `yes`, `no`)
    // is a boolean: the WasmPlugin's pluginConfig reaches the filter as `"mode": false`, which
    // the filter refuses (and a module that does not load fails the whole listener). Before,
    // `weir config check` read the manifest as YAML 1.2, found the string "off", and passed it.
    let dir = tempfile::tempdir().unwrap();
    let plugin = |mode: &str| {
        format!(
            "apiVersion: extensions.istio.io/v1alpha1\nkind: WasmPlugin\nmetadata: {{name: weir}}\nspec:\n  \
             pluginConfig:\n    \
             orgs: [{{id: acme, workspaces: [{{id: ml, projects: [{{id: chat, keys: [{{id: ci, sha256: {A_HASH}}}]}}]}}]}}]\n    \
             routes:\n      by_name:\n        llm-api: {{mode: {mode}}}\n"
        )
    };
    let (passed, stderr) = config_check(dir.path(), "wasmplugin.yaml", &plugin("\"off\""), &[]);
    assert!(passed, "{stderr}");
    let (passed, stderr) = config_check(dir.path(), "wasmplugin.yaml", &plugin("off"), &[]);
    assert!(!passed, "a bare off passed: {stderr}");
    assert!(
        stderr.contains("routes.by_name.llm-api.mode") && stderr.contains("quote it"),
        "names the field and the cure: {stderr}"
    );
    // Block style too.
    let block = plugin("off").replace("llm-api: {mode: off}", "llm-api:\n          mode: off");
    let (passed, stderr) = config_check(dir.path(), "wasmplugin.yaml", &block, &[]);
    assert!(!passed, "a bare off passed: {stderr}");
}

#[test]
fn usage_from_a_closed_ledger_leaves_its_directory_as_it_found_it() {
    // The sidecar's ledger is in WAL mode; a clean close leaves the database file alone. A
    // read-only SQLite connection to it creates `-shm` and `-wal` files beside it (owned by
    // whoever ran `weir usage`, in a debug container often root, where the sidecar, uid
    // 65532, cannot write them next time it opens its ledger). weir usage writes nothing.
    let dir = tempfile::tempdir().unwrap();
    let ledger = dir.path().join("ledger.sqlite");
    let conn = weir_sidecar::ledger::open(&ledger).unwrap();
    let record = weir_sidecar::ledger::UsageRecord {
        idempotency_key: "k".into(),
        attempt: 1,
        request_id: "r".into(),
        tenant: "acme/ml/chat/ci".into(),
        model: "m".into(),
        source: "engine".into(),
        outcome: "ok".into(),
        finished_at_ms: 1_000,
        route: Some("llm-api".into()),
        mode: Some("enforce".into()),
        ..Default::default()
    };
    weir_sidecar::ledger::append(&conn, &record).unwrap();
    drop(conn);
    let listing = || {
        let mut names: Vec<String> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    };
    let before = listing();
    assert_eq!(before, ["ledger.sqlite"], "a clean close");
    let out = weir(&[
        "usage",
        "--ledger",
        ledger.to_str().unwrap(),
        "--since",
        "all",
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}");
    assert!(stdout.contains("acme/ml/chat/ci,k,1,r,m"), "{stdout}");
    assert!(stdout.contains(",llm-api,enforce,"), "{stdout}");
    assert_eq!(listing(), before, "weir usage wrote beside the ledger");
}
