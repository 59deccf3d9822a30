//! Placeholders a file still holds where the examples it was copied from had them: a Secret's
//! `REPLACE-ME` values, a key hash of zeros, an image digest of zeros, an `example.com`
//! registry. Each one loads (a zero hash matches no key, a zero digest no image), so they are
//! warnings, not errors: signs the file was not edited where it had to be, which
//! `weir config check --strict` fails in CI.

use base64::Engine;
use serde_json::Value;
use weir_core::config::Config;
use weir_core::signature::is_placeholder;

/// A placeholder: the field that holds it, and what to put there instead.
pub struct Placeholder {
    pub field: String,
    pub message: &'static str,
}

/// What the examples write for a SHA-256 (a key hash, an image digest) still to be filled in.
const ZEROS: &str = "0000000000000000000000000000000000000000000000000000000000000000";

/// Key hashes of zeros in a filter config.
pub fn in_keys(config: &Config) -> Vec<Placeholder> {
    let mut found = Vec::new();
    for (o, org) in config.orgs.iter().enumerate() {
        for (w, ws) in org.workspaces.iter().enumerate() {
            for (p, project) in ws.projects.iter().enumerate() {
                for (k, key) in project.keys.iter().enumerate() {
                    if key.sha256.iter().any(|h| h == ZEROS) {
                        found.push(Placeholder {
                            field: format!(
                                "orgs[{o}].workspaces[{w}].projects[{p}].keys[{k}].sha256"
                            ),
                            message: "64 zeros, a placeholder that no key hashes to: put the \
                                      sha256 `weir keys new` prints",
                        });
                    }
                }
            }
        }
    }
    found
}

/// Placeholders in a Kubernetes manifest: a Secret's values, and image digests of zeros
/// anywhere outside the weir configs it carries (those are checked as configs).
pub fn in_manifest(doc: &Value) -> Vec<Placeholder> {
    let mut found = Vec::new();
    if doc["kind"] == "Secret" {
        in_secret(doc, &mut found);
    }
    digests("", doc, &mut found);
    found
}

/// `stringData` values as written, `data` values base64-encoded.
fn in_secret(doc: &Value, found: &mut Vec<Placeholder>) {
    let message = "a placeholder: put your value, or have your secret store create this Secret";
    let plain = doc["stringData"].as_object().into_iter().flatten();
    for (name, value) in plain {
        if value.as_str().is_some_and(|v| is_placeholder(v.as_bytes())) {
            found.push(Placeholder {
                field: format!("stringData.{name}"),
                message,
            });
        }
    }
    let encoded = doc["data"].as_object().into_iter().flatten();
    for (name, value) in encoded {
        let decoded = value
            .as_str()
            .and_then(|v| base64::engine::general_purpose::STANDARD.decode(v).ok());
        if decoded.is_some_and(|v| is_placeholder(&v)) {
            found.push(Placeholder {
                field: format!("data.{name}"),
                message,
            });
        }
    }
}

/// A `sha256` field of zeros (a WasmPlugin's, an Envoy remote source's), a reference pinned
/// `@sha256:` to zeros (a container's `image`, an `oci://` URL), or an `image`, `url` or `uri`
/// on an `example.com` host, under `at`.
fn digests(at: &str, value: &Value, found: &mut Vec<Placeholder>) {
    match value {
        Value::Object(fields) if fields.contains_key("orgs") || fields.contains_key("pools") => {}
        Value::Object(fields) => {
            for (name, field) in fields {
                let path = if at.is_empty() {
                    name.clone()
                } else {
                    format!("{at}.{name}")
                };
                if ["image", "url", "uri"].contains(&name.as_str())
                    && field.as_str().is_some_and(on_an_example_host)
                {
                    found.push(Placeholder {
                        field: path.clone(),
                        message: "an example.com registry, a placeholder: put the registry you \
                                  pushed the image to",
                    });
                }
                if name == "sha256" && field == ZEROS {
                    found.push(Placeholder {
                        field: path,
                        message: "64 zeros, a placeholder digest that no image has: put the \
                                  digest of the image you pushed",
                    });
                } else {
                    digests(&path, field, found);
                }
            }
        }
        Value::Array(items) => {
            for (i, item) in items.iter().enumerate() {
                digests(&format!("{at}[{i}]"), item, found);
            }
        }
        Value::String(reference)
            if reference
                .strip_suffix(ZEROS)
                .is_some_and(|r| r.ends_with("@sha256:")) =>
        {
            found.push(Placeholder {
                field: at.to_owned(),
                message: "pinned to a digest of zeros, a placeholder that no image has: pin the \
                          digest of the image you pushed",
            });
        }
        _ => {}
    }
}

/// Whether an image reference or URL names a host under `example.com`, as the examples do.
fn on_an_example_host(reference: &str) -> bool {
    let rest = reference
        .split_once("://")
        .map_or(reference, |(_, rest)| rest);
    let authority = rest.split('/').next().unwrap_or(rest);
    let host = authority.rsplit('@').next().unwrap_or(authority);
    let host = host.split(':').next().unwrap_or(host).to_ascii_lowercase();
    host == "example.com" || host.ends_with(".example.com")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn example_hosts_are_told_from_real_ones() {
        for example in [
            "oci://registry.example.com/weir/filter:0.1.0",
            "registry.example.com/weir/sidecar@sha256:abc",
            "https://Example.com:443/filter.wasm",
            "registry.example.com:5000/weir/sidecar",
        ] {
            assert!(on_an_example_host(example), "{example}");
        }
        for real in [
            "ghcr.io/acme/weir:1.0",
            "weir-sidecar:dev",
            "oci://example.company.io/weir",
            "registry.notexample.com/weir",
            "ghcr.io/example.com/weir",
        ] {
            assert!(!on_an_example_host(real), "{real}");
        }
    }
}
