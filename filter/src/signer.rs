//! Signing what the filter vouches for. The secret is read once, at configuration, from the
//! environment variable the config names (never from the config itself), and every forwarded
//! request carries `x-weir-signature` over all of its `x-weir-*` headers.

use weir_core::config::SigningConfig;
use weir_core::signature;

use crate::host;

pub struct Signer {
    secret: Vec<u8>,
    ttl_ms: u64,
}

impl Signer {
    /// Reads the secret; a missing, short or placeholder one is a configuration error, so
    /// Envoy does not start a filter whose requests every sidecar would refuse — or anyone who
    /// read the placeholder could forge.
    pub fn from_config(config: &SigningConfig) -> Result<Signer, String> {
        let name = &config.secret_env;
        let secret = host::env(name).ok_or_else(|| {
            format!(
                "signing.secret_env: ${name} is not set in the VM (list it in \
                 vm_config.environment_variables.host_env_keys)"
            )
        })?;
        Signer::new(secret.trim().as_bytes().to_vec(), config.ttl_ms)
            .map_err(|e| format!("signing.secret_env: ${name} {e}"))
    }

    fn new(secret: Vec<u8>, ttl_ms: u64) -> Result<Signer, String> {
        signature::check_secret(&secret)?;
        Ok(Signer { secret, ttl_ms })
    }

    /// The `x-weir-signature` value for `headers`, valid for the configured lifetime.
    pub fn sign(&self, headers: &[(&str, &str)], now_ms: u64) -> Option<String> {
        signature::sign(&self.secret, headers, now_ms.saturating_add(self.ttl_ms)).ok()
    }
}

#[cfg(test)]
mod tests {
    use super::Signer;
    use weir_core::signature::verify;

    #[test]
    fn short_secrets_are_refused_and_signatures_expire_after_the_ttl() {
        assert!(Signer::new(b"short".to_vec(), 1000).is_err());
        let secret = b"0123456789abcdef0123456789abcdef".to_vec();
        let signer = Signer::new(secret.clone(), 1000).unwrap();
        let mut headers = vec![("x-weir-tenant", "a/b/c/d".to_owned())];
        headers.push((
            "x-weir-signature",
            signer.sign(&[("x-weir-tenant", "a/b/c/d")], 5_000).unwrap(),
        ));
        let view: Vec<(&str, &str)> = headers.iter().map(|(k, v)| (*k, v.as_str())).collect();
        assert_eq!(verify(&[&secret], &view, 6_000), Ok(()));
        assert!(verify(&[&secret], &view, 6_001).is_err());
    }
}
