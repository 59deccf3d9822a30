//! How weir talks to one pool's engines: its HTTP client (plain HTTP, or HTTPS over rustls with
//! the platform's trusted roots and, optionally, the pool's own CA) and its credential
//! ([`crate::config::credential`]), sent on every request weir makes there — tenants' requests, health
//! checks, limit reads, isolation probes.
//!
//! Redirects are not followed: an engine has no reason to send one, and following it would
//! carry the request (and the credential) somewhere the config never named.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use reqwest::header::{AUTHORIZATION, HeaderValue};

use crate::config::PoolConfig;

/// Longest a connection to an engine may take to open.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

/// Longest an idle connection to an engine is kept for reuse. Engines' servers close theirs
/// after 5 s (uvicorn's default, under vLLM and SGLang; llama.cpp says `Keep-Alive: timeout=5`):
/// a connection taken from the pool as its engine closes it fails the request sent on it.
const IDLE_TIMEOUT: Duration = Duration::from_secs(4);

pub struct Upstream {
    http: reqwest::Client,
    /// `Bearer …`, marked sensitive.
    credential: Option<HeaderValue>,
}

impl std::fmt::Debug for Upstream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Upstream")
            .field(
                "credential",
                &self.credential.as_ref().map(|_| "<redacted>"),
            )
            .finish_non_exhaustive()
    }
}

/// The client every pool without a CA file of its own shares.
pub fn client(ca_pem: Option<&[u8]>) -> anyhow::Result<reqwest::Client> {
    // Engines speak HTTP/1.1 (vLLM, llama.cpp); saying so keeps TLS from offering HTTP/2 in a
    // build whose features another crate of the workspace widened.
    let mut builder = reqwest::Client::builder()
        .http1_only()
        .connect_timeout(CONNECT_TIMEOUT)
        .pool_idle_timeout(IDLE_TIMEOUT)
        .redirect(reqwest::redirect::Policy::none());
    if let Some(pem) = ca_pem {
        let certs = reqwest::Certificate::from_pem_bundle(pem)
            .context("not a PEM bundle of certificates")?;
        if certs.is_empty() {
            anyhow::bail!("no certificate in it");
        }
        builder = builder.tls_certs_merge(certs);
    }
    builder.build().context("building the HTTP client")
}

impl Upstream {
    /// No credential, a client of its own: for tests.
    pub fn plain() -> Arc<Upstream> {
        Arc::new(Upstream {
            http: client(None).unwrap_or_default(),
            credential: None,
        })
    }

    /// A pool's upstream, as configured; `shared` is the client of pools with no CA file.
    /// `field` names the pool in errors (`pools[2]`).
    pub fn of(
        pool: &PoolConfig,
        shared: &reqwest::Client,
        field: &str,
    ) -> anyhow::Result<Arc<Upstream>> {
        let http = match pool.tls.as_ref().and_then(|t| t.ca_file.as_ref()) {
            None => shared.clone(),
            Some(path) => {
                let pem = std::fs::read(path)
                    .with_context(|| format!("{field}.tls.ca_file: reading {}", path.display()))?;
                client(Some(&pem)).with_context(|| format!("{field}.tls.ca_file"))?
            }
        };
        let credential = pool
            .credential
            .as_ref()
            .map(|c| c.load(&format!("{field}.credential")))
            .transpose()?;
        Ok(Arc::new(Upstream { http, credential }))
    }

    /// Whether requests carry a credential.
    pub fn has_credential(&self) -> bool {
        self.credential.is_some()
    }

    fn authorized(&self, request: reqwest::RequestBuilder) -> reqwest::RequestBuilder {
        match &self.credential {
            Some(value) => request.header(AUTHORIZATION, value.clone()),
            None => request,
        }
    }

    pub fn get(&self, url: &str) -> reqwest::RequestBuilder {
        self.authorized(self.http.get(url))
    }

    pub fn post(&self, url: &str) -> reqwest::RequestBuilder {
        self.authorized(self.http.post(url))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_carry_the_credential_and_debug_output_never_shows_it() {
        let mut value = HeaderValue::from_static("Bearer secret-token");
        value.set_sensitive(true);
        let upstream = Upstream {
            http: reqwest::Client::new(),
            credential: Some(value),
        };
        let request = upstream.get("http://127.0.0.1:1/metrics").build().unwrap();
        assert_eq!(
            request.headers()[AUTHORIZATION].to_str().unwrap(),
            "Bearer secret-token"
        );
        let post = upstream.post("http://127.0.0.1:1/v1/x").build().unwrap();
        assert!(post.headers().contains_key(AUTHORIZATION));
        assert!(!format!("{upstream:?}").contains("secret-token"));
        assert!(!format!("{request:?}").contains("secret-token"));
        let plain = Upstream::plain();
        let request = plain.get("http://127.0.0.1:1/metrics").build().unwrap();
        assert!(!request.headers().contains_key(AUTHORIZATION));
    }

    #[test]
    fn a_ca_file_that_holds_no_certificate_is_refused() {
        assert!(client(Some(b"not a certificate")).is_err());
        assert!(client(Some(b"")).is_err());
        assert!(client(None).is_ok());
    }
}
