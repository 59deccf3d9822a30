//! A pool's upstream credential: the token weir presents to its engines (or to a hosted API)
//! as `Authorization: Bearer …`, on every request it sends there — tenants' requests, and its
//! own health checks, limit reads and isolation probes.
//!
//! The config names where the token is, never the token: `credential: {file: PATH}` (a mounted
//! Kubernetes secret) or `credential: {env: VAR}`. A token written inline (`credential: "sk-…"`,
//! `{token: …}`) is refused when the config is loaded, so a config file, a ConfigMap or a log of
//! either never holds one. The token is read at start-up and at every reload, surrounding
//! whitespace (a file's final newline) dropped; the header value is marked sensitive, so it is
//! left out of reqwest's and hyper's debug output.

use std::path::PathBuf;

use anyhow::{Context, bail};
use reqwest::header::HeaderValue;
use serde::Deserialize;

/// Where a pool's token is read from: a file or an environment variable, exactly one.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CredentialConfig {
    pub file: Option<PathBuf>,
    pub env: Option<String>,
}

/// The shapes the config may hold, so an inline token gets a message of its own rather than
/// serde's "unknown field".
#[derive(Deserialize)]
#[serde(untagged)]
enum Written {
    Sources(Sources),
    Other(serde::de::IgnoredAny),
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Sources {
    #[serde(default)]
    file: Option<PathBuf>,
    #[serde(default)]
    env: Option<String>,
}

impl<'de> Deserialize<'de> for CredentialConfig {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        match Written::deserialize(d)? {
            Written::Sources(Sources { file, env }) => Ok(CredentialConfig { file, env }),
            Written::Other(_) => Err(serde::de::Error::custom(
                "a credential is read from `file: PATH` or `env: VAR`, never written inline",
            )),
        }
    }
}

impl CredentialConfig {
    /// Reads the token; `field` names the setting in errors (`pools[0].credential`).
    pub fn load(&self, field: &str) -> anyhow::Result<HeaderValue> {
        let token = match (&self.file, &self.env) {
            (Some(_), Some(_)) => bail!("{field}: set file or env, not both"),
            (None, None) => bail!("{field}: set file or env"),
            (Some(path), None) => std::fs::read_to_string(path)
                .with_context(|| format!("{field}.file: reading {}", path.display()))?,
            (None, Some(var)) => {
                std::env::var(var).with_context(|| format!("{field}.env: ${var} is not set"))?
            }
        };
        let token = token.trim();
        if token.is_empty() {
            bail!("{field}: the credential is empty");
        }
        // Not the token in the message: only that it cannot be a header.
        let mut value = HeaderValue::from_str(&format!("Bearer {token}")).map_err(|_| {
            anyhow::anyhow!("{field}: the credential holds characters a header cannot carry")
        })?;
        value.set_sensitive(true);
        Ok(value)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(json: &str) -> Result<CredentialConfig, serde_json::Error> {
        serde_json::from_str(json)
    }

    #[test]
    fn a_credential_comes_from_a_file_or_the_environment_never_inline() {
        for inline in [
            r#""sk-inline-token""#,
            r#"{"token": "sk-inline-token"}"#,
            r#"{"file": "/x", "value": "sk"}"#,
        ] {
            let error = parse(inline).unwrap_err().to_string();
            assert!(error.contains("never written inline"), "{inline}: {error}");
            assert!(
                !error.contains("sk-inline-token"),
                "the token is not echoed"
            );
        }
        let yaml: Result<CredentialConfig, _> = serde_yaml_ng::from_str("sk-inline");
        assert!(yaml.is_err());

        let path = std::env::temp_dir().join(format!("weir-credential-{}", std::process::id()));
        std::fs::write(&path, "engine-token\n").unwrap();
        let from_file = CredentialConfig {
            file: Some(path.clone()),
            env: None,
        };
        let header = from_file.load("pools[0].credential").unwrap();
        assert_eq!(header.to_str().unwrap(), "Bearer engine-token");
        assert!(header.is_sensitive());

        let both = CredentialConfig {
            file: Some(path.clone()),
            env: Some("PATH".into()),
        };
        assert!(both.load("c").is_err());
        let unset = CredentialConfig {
            file: None,
            env: Some("WEIR_TEST_SURELY_UNSET_CREDENTIAL".into()),
        };
        let error = unset.load("pools[1].credential").unwrap_err().to_string();
        assert!(error.contains("pools[1].credential.env"), "{error}");
        std::fs::write(&path, "  \n").unwrap();
        assert!(from_file.load("c").is_err(), "empty");
        std::fs::write(&path, "line\nbreak").unwrap();
        let error = from_file.load("c").unwrap_err().to_string();
        assert!(!error.contains("break"), "{error}");
        let _ = std::fs::remove_file(&path);
    }
}
