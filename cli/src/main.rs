//! `weir`: operator commands. Keys are minted here and only their SHA-256 goes into the
//! gateway config, so the plaintext key exists once, in this command's output.

use anyhow::Context;
use clap::{Parser, Subcommand};
use serde_json::json;
use weir_core::keys::{KEY_PREFIX, hash_key};

#[derive(Parser)]
#[command(name = "weir", version, about = "weir operator commands")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// API keys.
    Keys {
        #[command(subcommand)]
        action: KeysAction,
    },
}

#[derive(Subcommand)]
enum KeysAction {
    /// Mint a key: prints it once, with the entry to add under a project's `keys`.
    New {
        /// The key's id within its project.
        #[arg(long, default_value = "default")]
        id: String,
    },
    /// Print the SHA-256 the config stores for an existing key (read from stdin).
    Hash,
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
            action: KeysAction::New { id },
        } => {
            let key = mint()?;
            let entry = json!({"id": id, "sha256": hash_key(&key)});
            println!("key:    {key}");
            println!("config: {entry}");
            eprintln!("Store the key now: weir keeps only its hash.");
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
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn minted_keys_are_prefixed_random_and_hash_cleanly() {
        let (a, b) = (mint().unwrap(), mint().unwrap());
        assert_ne!(a, b);
        assert!(a.starts_with(KEY_PREFIX) && a.len() == KEY_PREFIX.len() + 48);
        assert_eq!(hash_key(&a).len(), 64);
    }
}
