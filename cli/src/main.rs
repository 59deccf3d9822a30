//! `weir`: operator commands. Keys are minted here and only their SHA-256 goes into the
//! gateway config, so the plaintext key exists once, in this command's output. Usage is exported
//! from the sidecar's ledger.

mod config_check;
mod placeholders;
mod usage_export;
mod usage_runs;
mod yaml11;

use anyhow::Context;
use clap::{Parser, Subcommand};
use weir_core::keys::{KEY_PREFIX, hash_key};

#[derive(Parser)]
#[command(name = "weir", version, about = "weir operator commands")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Mint an API key and print its config entry, or hash an existing key.
    Keys {
        #[command(subcommand)]
        action: KeysAction,
    },
    /// Check configs or manifests as the filter and sidecar will read them.
    Config {
        #[command(subcommand)]
        action: ConfigAction,
    },
    /// Export the usage ledger as CSV or JSON (one row per attempt that used an engine).
    ///
    /// Reads the sidecar's ledger, SQLite or PostgreSQL, read-only.
    Usage {
        /// The SQLite ledger the sidecar writes (its `ledger` setting); `weir-ledger.sqlite` in
        /// the current directory unless given. Opened read-only: never created or written.
        #[arg(long, default_value = "weir-ledger.sqlite")]
        ledger: std::path::PathBuf,
        /// Read the ledger from PostgreSQL (the sidecar's `ledger_store`) instead, its URL in
        /// this environment variable.
        #[arg(long, conflicts_with = "postgres_url_file")]
        postgres_url_env: Option<String>,
        /// Read the ledger from PostgreSQL, its URL in this file.
        #[arg(long)]
        postgres_url_file: Option<std::path::PathBuf>,
        /// Only this tenant, by its full path `org/workspace/project/key`, or every tenant under
        /// a level of it (`acme`, `acme/ml`, `acme/ml/chat`); all tenants when omitted.
        #[arg(long)]
        tenant: Option<String>,
        /// How far back: `90s`, `30m`, `24h`, `7d`, or `all`. Only the last 24 hours unless
        /// given: a billing export of everything needs `--since all`.
        #[arg(long, default_value = "24h")]
        since: String,
        /// CSV with a header row, or a JSON array.
        #[arg(long, value_enum, default_value = "csv")]
        format: Format,
        /// Sum the records per run (tenant, agent and run id, as the filter holds run budgets):
        /// calls, tool calls, tokens, cost, runtime and the last call's outcome, instead of one
        /// row per attempt; records of no run are left out.
        #[arg(long, value_enum)]
        by: Option<By>,
    },
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum Format {
    Csv,
    Json,
}

/// What `weir usage --by` sums records per.
#[derive(Clone, Copy, clap::ValueEnum)]
enum By {
    Run,
}

/// The start of the window in Unix ms, from a relative duration.
fn since_ms(since: &str, now_ms: u64) -> anyhow::Result<u64> {
    if since == "all" {
        return Ok(0);
    }
    let (n, unit) = since.split_at(since.len().saturating_sub(1));
    let n: u64 = n
        .parse()
        .with_context(|| format!("--since {since}: expected a number and s, m, h or d"))?;
    let unit_ms = match unit {
        "s" => 1_000,
        "m" => 60_000,
        "h" => 3_600_000,
        "d" => 86_400_000,
        _ => anyhow::bail!("--since {since}: the unit must be s, m, h or d"),
    };
    Ok(now_ms.saturating_sub(n.saturating_mul(unit_ms)))
}

/// Where `weir usage` reads: the SQLite file, or PostgreSQL at a URL (which may hold a
/// password, so never on the command line).
enum Source<'a> {
    Sqlite(&'a std::path::Path),
    Postgres(String),
}

fn export_usage(
    source: Source<'_>,
    tenant: Option<&str>,
    since: &str,
    (format, by): (Format, Option<By>),
) -> anyhow::Result<()> {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)?
        .as_millis() as u64;
    let since = since_ms(since, now)?;
    let rows = match source {
        Source::Sqlite(ledger) => {
            let conn = weir_sidecar::ledger::open_read_only(ledger)?;
            weir_sidecar::ledger::query(&conn, tenant, since)?
        }
        Source::Postgres(url) => {
            let mut client = weir_sidecar::ledger::postgres::connect_read_only(&url)
                .context("connecting to the PostgreSQL ledger")?;
            weir_sidecar::ledger::postgres::query(&mut client, tenant, since)?
        }
    };
    write_out(&usage_text(&rows, format, by)?)
}

/// The export of `rows`: one row per attempt, or per run.
fn usage_text(
    rows: &[weir_sidecar::ledger::UsageRecord],
    format: Format,
    by: Option<By>,
) -> anyhow::Result<String> {
    Ok(match (by, format) {
        (None, Format::Json) => usage_export::json(rows)?,
        (None, Format::Csv) => usage_export::table(rows),
        (Some(By::Run), Format::Json) => usage_runs::json(&usage_runs::by_run(rows))?,
        (Some(By::Run), Format::Csv) => usage_runs::table(&usage_runs::by_run(rows)),
    })
}

/// Writes to stdout; a reader that closed the pipe early (`weir usage | head`) has what it
/// wanted, so that ends the command quietly rather than in a panic.
fn write_out(text: &str) -> anyhow::Result<()> {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    match out.write_all(text.as_bytes()).and_then(|()| out.flush()) {
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
        written => Ok(written?),
    }
}

#[derive(Subcommand)]
enum ConfigAction {
    /// Check configs, or the manifests carrying them, as the filter and sidecar will read them.
    ///
    /// With their own parsers: errors name the field (unknown fields and tiers, wrong types,
    /// duplicate key hashes, limits that can never admit anything). A file may be a filter or
    /// sidecar config, or manifests carrying them (WasmPlugin, EnvoyFilter,
    /// EnvoyExtensionPolicy, ConfigMap, `kubectl kustomize` output); a manifest's config is
    /// read as Kubernetes reads it, where a bare `off` is false.
    ///
    /// Warns of placeholders left from the examples, in every manifest: a Secret's REPLACE-ME,
    /// a key hash or image digest of zeros, an example.com registry.
    ///
    /// Exits 1 on any error, and when no file holds a weir config (one without, among others
    /// that have one, is only a note).
    Check {
        /// The files to check, `-` for standard input: e.g.
        /// `kubectl kustomize deploy/k8s | weir config check --strict -`.
        #[arg(value_name = "FILE", required = true)]
        files: Vec<std::path::PathBuf>,
        #[arg(long, value_enum, default_value = "auto")]
        kind: config_check::Kind,
        /// Exit 1 on warnings too: for CI, so a placeholder never reaches a cluster.
        #[arg(long)]
        strict: bool,
    },
}

#[derive(Subcommand)]
enum KeysAction {
    /// Mint a key: prints it once, then apart from it the YAML entry (its sha256 only) to add
    /// under its project's `keys`.
    New {
        /// The key's id within its project.
        #[arg(long, default_value = "default")]
        id: String,
        /// The project the key goes in, `org/workspace/project`: the entry then says where it
        /// goes and the key's tenant path. Without it, the entry is printed to paste under any
        /// project's `keys`.
        #[arg(long)]
        tenant: Option<String>,
    },
    /// Print the SHA-256 the config stores for an existing key (read from stdin).
    Hash,
}

/// Where a new key's entry goes, as the comment above it: checked before any key is minted,
/// so none is ever printed for an entry that cannot be used.
fn placement(id: &str, tenant: Option<&str>) -> anyhow::Result<String> {
    if !weir_core::trusted::is_level_id(id) {
        anyhow::bail!("--id {id}: letters, digits, '-', '_', '.'");
    }
    let Some(tenant) = tenant else {
        return Ok("# add under a project's keys:".into());
    };
    let ids: Vec<&str> = tenant.split('/').collect();
    let [org, workspace, project] = ids.as_slice() else {
        anyhow::bail!("--tenant {tenant}: org/workspace/project");
    };
    if !ids.iter().all(|i| weir_core::trusted::is_level_id(i)) {
        anyhow::bail!("--tenant {tenant}: ids of letters, digits, '-', '_', '.'");
    }
    Ok(format!(
        "# add under orgs[id={org}].workspaces[id={workspace}].projects[id={project}].keys\n\
         # (its tenant path: {tenant}/{id}):"
    ))
}

/// A new key, and its YAML entry under where it goes.
fn new_key(id: &str, tenant: Option<&str>) -> anyhow::Result<(String, String)> {
    let place = placement(id, tenant)?;
    let key = mint()?;
    let entry = format!("{place}\n- id: {id}\n  sha256: {}", hash_key(&key));
    Ok((key, entry))
}

/// 192 random bits, hex-encoded, behind the recognisable prefix.
fn mint() -> anyhow::Result<String> {
    let mut bytes = [0u8; 24];
    getrandom::fill(&mut bytes).map_err(|e| anyhow::anyhow!("no system randomness: {e}"))?;
    let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
    Ok(format!("{KEY_PREFIX}{hex}"))
}

fn main() -> anyhow::Result<()> {
    match Cli::parse().command {
        Command::Keys {
            action: KeysAction::New { id, tenant },
        } => {
            let (key, entry) = new_key(&id, tenant.as_deref())?;
            // Apart and labelled, so that the key is not pasted into a config with its entry.
            println!(
                "API key: give this to the caller; it is not stored anywhere, and cannot be \
                 shown again:\n\n    {key}\n\nConfig entry: only the key's sha256, never the key:\n\n{entry}"
            );
        }
        Command::Config {
            action:
                ConfigAction::Check {
                    files,
                    kind,
                    strict,
                },
        } => {
            let inputs = files.iter().map(|file| {
                if file.as_os_str() == "-" {
                    (
                        "stdin".to_owned(),
                        std::io::read_to_string(std::io::stdin()),
                    )
                } else {
                    (file.display().to_string(), std::fs::read_to_string(file))
                }
            });
            let lines = config_check::check_all(inputs.collect(), kind);
            let failing = if strict {
                config_check::Verdict::Warn
            } else {
                config_check::Verdict::Error
            };
            for line in &lines {
                match line.verdict {
                    config_check::Verdict::Ok | config_check::Verdict::Note => println!("{line}"),
                    _ => eprintln!("{line}"),
                }
            }
            if lines.iter().any(|l| l.verdict >= failing) {
                std::process::exit(1);
            }
        }
        Command::Keys {
            action: KeysAction::Hash,
        } => {
            let mut key = String::new();
            std::io::stdin()
                .read_line(&mut key)
                .context("reading the key from stdin")?;
            println!("{}", hash_key(key.trim()));
        }
        Command::Usage {
            ledger,
            postgres_url_env,
            postgres_url_file,
            tenant,
            since,
            format,
            by,
        } => {
            let source = if postgres_url_env.is_some() || postgres_url_file.is_some() {
                Source::Postgres(weir_sidecar::ledger::read_url(
                    postgres_url_env.as_deref(),
                    postgres_url_file.as_deref(),
                )?)
            } else {
                Source::Sqlite(&ledger)
            };
            export_usage(source, tenant.as_deref(), &since, (format, by))?
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_new_key_s_entry_says_where_it_goes() {
        let (key, entry) = new_key("ci", Some("acme/prod/assistant")).unwrap();
        assert!(entry.contains("orgs[id=acme].workspaces[id=prod].projects[id=assistant].keys"));
        assert!(entry.ends_with(&format!("- id: ci\n  sha256: {}", hash_key(&key))));
        let yaml = format!(
            "orgs:\n- id: acme\n  workspaces:\n  - id: prod\n    projects:\n    - id: assistant\n      keys:\n{}",
            entry
                .lines()
                .filter(|l| !l.starts_with('#'))
                .map(|l| format!("      {l}\n"))
                .collect::<String>()
        );
        assert!(
            weir_core::config::Config::parse(yaml.as_bytes()).is_ok(),
            "{yaml}"
        );
        // Refused before a key is minted: `weir keys new` printed the key, then failed.
        assert!(placement("ci", Some("acme/prod")).is_err());
        assert!(new_key("ci", Some("acme/ml")).is_err());
        assert!(placement("a b", None).is_err());
    }

    #[test]
    fn since_understands_relative_windows() {
        assert_eq!(since_ms("all", 1_000_000).unwrap(), 0);
        assert_eq!(since_ms("90s", 1_000_000).unwrap(), 910_000);
        assert_eq!(since_ms("2h", 10_000_000).unwrap(), 2_800_000);
        assert!(since_ms("3w", 0).is_err());
        assert!(since_ms("h", 0).is_err());
    }

    #[test]
    fn usage_exports_only_the_asked_tenant() {
        use weir_sidecar::ledger::{UsageRecord, append, open};
        let path = std::env::temp_dir().join(format!("weir-cli-usage-{}", std::process::id()));
        let conn = open(&path).unwrap();
        for (id, tenant) in [("r1", "a/w/p/k"), ("r2", "b/w/p/k")] {
            let record = UsageRecord {
                request_id: id.into(),
                idempotency_key: id.into(),
                attempt: 1,
                tenant: tenant.into(),
                model: "m".into(),
                api: "chat_completions".into(),
                replica: "r".into(),
                prompt_tokens: 1,
                completion_tokens: 2,
                source: "engine".into(),
                outcome: "ok".into(),
                queued_ms: 0,
                finished_at_ms: u64::MAX / 2,
                ..UsageRecord::default()
            };
            append(&conn, &record).unwrap();
        }
        let rows = weir_sidecar::ledger::query(&conn, Some("a/w/p/k"), 0).unwrap();
        assert_eq!(rows.len(), 1);
        assert!(
            export_usage(
                Source::Sqlite(&path),
                Some("a/w/p/k"),
                "all",
                (Format::Json, None)
            )
            .is_ok()
        );
        let _ = std::fs::remove_file(&path);
    }

    #[test]
    fn usage_of_an_org_or_workspace_is_that_of_every_tenant_under_it() {
        // Before, `--tenant acme` matched no row: only a full key path did.
        use weir_sidecar::ledger::{UsageRecord, append, open, query};
        let path = std::env::temp_dir().join(format!("weir-cli-prefix-{}", std::process::id()));
        let conn = open(&path).unwrap();
        let tenants = [
            "acme/ml/chat/ci",
            "acme/ops/bot/k",
            "acme2/ml/chat/ci",
            "ACME/ml/chat/ci",
        ];
        for (i, tenant) in tenants.into_iter().chain(["a_me/ml/chat/ci"]).enumerate() {
            let record = UsageRecord {
                request_id: format!("r{i}"),
                idempotency_key: format!("k{i}"),
                attempt: 1,
                tenant: tenant.into(),
                finished_at_ms: 1_000,
                ..UsageRecord::default()
            };
            append(&conn, &record).unwrap();
        }
        let of = |prefix: &str| -> Vec<String> {
            let rows = query(&conn, Some(prefix), 0).unwrap();
            rows.into_iter().map(|r| r.tenant).collect()
        };
        assert_eq!(of("acme"), ["acme/ml/chat/ci", "acme/ops/bot/k"]);
        assert_eq!(of("acme/ml"), ["acme/ml/chat/ci"]);
        assert_eq!(of("acme/ml/chat/ci"), ["acme/ml/chat/ci"]);
        assert!(
            of("acme/m").is_empty(),
            "a prefix of an id is not its level"
        );
        assert_eq!(of("a_me"), ["a_me/ml/chat/ci"], "no wildcards");
        let _ = std::fs::remove_file(&path);
    }

    #[test]
    fn minted_keys_are_prefixed_random_and_hash_cleanly() {
        let (a, b) = (mint().unwrap(), mint().unwrap());
        assert_ne!(a, b);
        assert!(a.starts_with(KEY_PREFIX) && a.len() == KEY_PREFIX.len() + 48);
        assert_eq!(hash_key(&a).len(), 64);
    }
}
