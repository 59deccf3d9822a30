//! The API key each scenario tenant sends as, against a deployment weir-bench does not run.
//!
//! Keys are secrets: they come from `--key TENANT=KEY` or, kept out of the process list, from a
//! keys file, and no error, log line, `Debug` output or result file ever shows one. A keys file
//! has one `tenant=key` a line; blank lines and lines starting with `#` are skipped, and space
//! around the tenant and the key is trimmed.

use std::collections::BTreeMap;
use std::fmt;
use std::path::Path;

use anyhow::Context;

use crate::scenario::TenantLoad;

/// Each tenant's key, by tenant name.
#[derive(Clone, Default)]
pub struct Keys(BTreeMap<String, String>);

impl fmt::Debug for Keys {
    /// The tenants only: a key never reaches a log.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_set().entries(self.0.keys()).finish()
    }
}

impl Keys {
    /// Adds one `tenant=key` pair from `what` (a flag or a file's line, for errors); a second key
    /// for a tenant is an error, so no key silently replaces another.
    fn add(&mut self, pair: &str, what: &str) -> anyhow::Result<()> {
        let Some((tenant, key)) = pair.split_once('=') else {
            anyhow::bail!(
                "{what}: expected TENANT=KEY (the value is not shown: it may hold a key)"
            );
        };
        let (tenant, key) = (tenant.trim(), key.trim());
        anyhow::ensure!(
            !tenant.is_empty() && !key.is_empty(),
            "{what}: expected TENANT=KEY with neither empty"
        );
        anyhow::ensure!(
            !self.0.contains_key(tenant),
            "{what}: a second key for tenant {tenant:?}"
        );
        self.0.insert(tenant.to_owned(), key.to_owned());
        Ok(())
    }

    /// The keys of `--key` flags (`TENANT=KEY` each).
    pub fn from_flags(flags: &[String]) -> anyhow::Result<Keys> {
        let mut keys = Keys::default();
        for (i, flag) in flags.iter().enumerate() {
            keys.add(flag, &format!("--key #{}", i + 1))?;
        }
        Ok(keys)
    }

    /// Adds the keys of a keys file's text, `file` naming it in errors.
    pub fn add_file_text(&mut self, text: &str, file: &str) -> anyhow::Result<()> {
        for (i, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            self.add(line, &format!("{file}:{}", i + 1))?;
        }
        Ok(())
    }

    /// Adds the keys of the keys file at `path`.
    pub fn add_file(&mut self, path: &Path) -> anyhow::Result<()> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("reading keys file {}", path.display()))?;
        self.add_file_text(&text, &path.display().to_string())
    }

    /// Checks that every one of `tenants` has a key, naming all that have none.
    pub fn check_covers(&self, tenants: &[TenantLoad]) -> anyhow::Result<()> {
        let missing: Vec<&str> = tenants
            .iter()
            .map(|t| t.name.as_str())
            .filter(|name| !self.0.contains_key(*name))
            .collect();
        anyhow::ensure!(
            missing.is_empty(),
            "no key for scenario tenant(s) {}: give each one with --key TENANT=KEY or in --keys-file",
            missing.join(", ")
        );
        Ok(())
    }

    /// The key of `tenant`; empty for a tenant without one, which [`Keys::check_covers`] rules
    /// out before any load is sent.
    pub fn of(&self, tenant: &str) -> &str {
        self.0.get(tenant).map_or("", String::as_str)
    }
}

impl FromIterator<(String, String)> for Keys {
    fn from_iter<I: IntoIterator<Item = (String, String)>>(pairs: I) -> Keys {
        Keys(pairs.into_iter().collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SECRET: &str = "wk-very-secret";

    fn tenants(names: &[&str]) -> Vec<TenantLoad> {
        names
            .iter()
            .map(|n| {
                serde_yaml_ng::from_str(&format!(
                    "{{name: {n}, arrival: {{kind: closed, concurrency: 1}}, prompt_tokens: 1, output_tokens: 1}}"
                ))
                .unwrap()
            })
            .collect()
    }

    #[test]
    fn a_keys_file_skips_comments_and_blanks_and_trims() {
        let mut keys = Keys::default();
        keys.add_file_text(
            "# tenants of the staging gateway\n\n alpha = wk-a \nbeta=wk-b=with-equals\n",
            "keys.txt",
        )
        .unwrap();
        assert_eq!(keys.of("alpha"), "wk-a");
        assert_eq!(
            keys.of("beta"),
            "wk-b=with-equals",
            "split at the first `=`"
        );
        assert_eq!(keys.of("gamma"), "");
    }

    #[test]
    fn malformed_pairs_are_refused_without_showing_them() {
        for bad in [SECRET.to_owned(), format!("={SECRET}"), "alpha=".to_owned()] {
            let err = Keys::from_flags(&[bad]).unwrap_err().to_string();
            assert!(err.starts_with("--key #1: expected TENANT=KEY"), "{err}");
            assert!(!err.contains(SECRET), "{err}");
        }
        let mut keys = Keys::default();
        let err = keys
            .add_file_text(&format!("alpha=wk-a\n{SECRET}\n"), "keys.txt")
            .unwrap_err()
            .to_string();
        assert!(err.starts_with("keys.txt:2: "), "{err}");
        assert!(!err.contains(SECRET), "{err}");
    }

    #[test]
    fn a_second_key_for_a_tenant_is_refused() {
        let mut keys = Keys::from_flags(&[format!("alpha={SECRET}")]).unwrap();
        let err = keys
            .add_file_text("alpha=wk-other\n", "keys.txt")
            .unwrap_err()
            .to_string();
        assert_eq!(err, "keys.txt:1: a second key for tenant \"alpha\"");
    }

    #[test]
    fn every_tenant_without_a_key_is_named() {
        let keys = Keys::from_flags(&["alpha=wk-a".into(), "extra=wk-x".into()]).unwrap();
        keys.check_covers(&tenants(&["alpha"])).unwrap();
        let err = keys
            .check_covers(&tenants(&["alpha", "beta", "gamma"]))
            .unwrap_err()
            .to_string();
        assert!(
            err.starts_with("no key for scenario tenant(s) beta, gamma:"),
            "{err}"
        );
    }

    #[test]
    fn debug_shows_tenants_not_keys() {
        let keys = Keys::from_flags(&[format!("alpha={SECRET}")]).unwrap();
        assert_eq!(format!("{keys:?}"), "{\"alpha\"}");
    }
}
