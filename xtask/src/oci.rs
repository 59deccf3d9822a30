//! `cargo xtask oci`: the filter as an OCI image, in the *compat* variant of the Wasm image
//! spec — the one layout that Istio (`WasmPlugin`), Envoy Gateway (`EnvoyExtensionPolicy`) and
//! the spec itself all accept: an OCI image manifest whose config is a minimal image config and
//! whose only layer is a gzip-compressed tar holding one file, `plugin.wasm`, annotated
//! `module.wasm.image/variant: compat`.
//!
//! The image is written as an OCI image layout (`oci-layout`, `index.json`, `blobs/sha256/…`),
//! which skopeo, crane, oras and buildah read, and can be pushed to a registry over the OCI
//! distribution API ([`push`]: anonymous, plain HTTP). Two digests pin the module, and both are
//! printed: Istio and Envoy Gateway check an `oci://` image against its *manifest* digest;
//! plain Envoy's `vm_config.code.remote` checks the sha256 of the .wasm bytes.
//!
//! The output is deterministic: the tar entry has fixed metadata (mtime 0, uid/gid 0, mode
//! 0644, no user names), the gzip header has no name and mtime 0, the JSON documents are
//! serialised from structs (fixed key order) with no timestamps. The same .wasm gives the same
//! digests for a given `Cargo.lock` (the deflate encoder's version fixes the compressed bytes).

use std::collections::BTreeMap;
use std::io::Write;
use std::path::Path;

use anyhow::{Context, bail};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

pub const MANIFEST_MEDIA_TYPE: &str = "application/vnd.oci.image.manifest.v1+json";
pub const CONFIG_MEDIA_TYPE: &str = "application/vnd.oci.image.config.v1+json";
pub const LAYER_MEDIA_TYPE: &str = "application/vnd.oci.image.layer.v1.tar+gzip";
pub const INDEX_MEDIA_TYPE: &str = "application/vnd.oci.image.index.v1+json";
/// The manifest annotation naming the Wasm image variant.
pub const VARIANT_ANNOTATION: &str = "module.wasm.image/variant";
/// The one file of the layer, where every fetcher of the compat variant looks.
pub const WASM_FILE: &str = "plugin.wasm";
/// The tag the image has in the layout (`oci:DIR:latest`).
pub const LAYOUT_TAG: &str = "latest";

/// `sha256:<hex>`, the digest form of OCI descriptors.
pub fn digest(bytes: &[u8]) -> String {
    format!("sha256:{}", sha256_hex(bytes))
}

/// The lowercase hex SHA-256 of `bytes`, the form Envoy's `RemoteDataSource.sha256` takes.
pub fn sha256_hex(bytes: &[u8]) -> String {
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// A content descriptor: what a manifest or index says of a blob.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Descriptor {
    pub media_type: String,
    pub digest: String,
    pub size: u64,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub annotations: BTreeMap<String, String>,
}

impl Descriptor {
    fn of(media_type: &str, bytes: &[u8]) -> Descriptor {
        Descriptor {
            media_type: media_type.to_owned(),
            digest: digest(bytes),
            size: bytes.len() as u64,
            annotations: BTreeMap::new(),
        }
    }
}

/// An OCI image manifest.
#[derive(Serialize, Deserialize, Debug)]
#[serde(rename_all = "camelCase")]
pub struct Manifest {
    pub schema_version: u32,
    pub media_type: String,
    pub config: Descriptor,
    pub layers: Vec<Descriptor>,
    #[serde(default)]
    pub annotations: BTreeMap<String, String>,
}

/// The minimal valid OCI image config: a platform and the layer's uncompressed digest. The
/// platform is Go's name for WebAssembly under WASI preview 1 (`GOOS=wasip1 GOARCH=wasm`), the
/// vocabulary the image spec points to; no fetcher of Wasm images reads it.
#[derive(Serialize, Deserialize, Debug)]
pub struct ImageConfig {
    pub architecture: String,
    pub os: String,
    pub config: BTreeMap<String, String>,
    pub rootfs: RootFs,
}

#[derive(Serialize, Deserialize, Debug)]
pub struct RootFs {
    #[serde(rename = "type")]
    pub kind: String,
    pub diff_ids: Vec<String>,
}

/// An OCI image index (the layout's `index.json`).
#[derive(Serialize, Deserialize, Debug)]
#[serde(rename_all = "camelCase")]
pub struct Index {
    pub schema_version: u32,
    pub media_type: String,
    pub manifests: Vec<Descriptor>,
}

/// The compat-variant image of one module: its three documents, byte for byte.
pub struct Image {
    pub config: Vec<u8>,
    pub layer: Vec<u8>,
    pub manifest: Vec<u8>,
}

impl Image {
    /// Packages `wasm` as the compat variant.
    pub fn compat(wasm: &[u8]) -> anyhow::Result<Image> {
        let tar = layer_tar(wasm)?;
        let layer = gzip(&tar)?;
        let config = serde_json::to_vec(&ImageConfig {
            architecture: "wasm".into(),
            os: "wasip1".into(),
            config: BTreeMap::new(),
            rootfs: RootFs {
                kind: "layers".into(),
                diff_ids: vec![digest(&tar)],
            },
        })?;
        let manifest = serde_json::to_vec(&Manifest {
            schema_version: 2,
            media_type: MANIFEST_MEDIA_TYPE.into(),
            config: Descriptor::of(CONFIG_MEDIA_TYPE, &config),
            layers: vec![Descriptor::of(LAYER_MEDIA_TYPE, &layer)],
            annotations: BTreeMap::from([(VARIANT_ANNOTATION.into(), "compat".into())]),
        })?;
        Ok(Image {
            config,
            layer,
            manifest,
        })
    }

    /// The manifest digest: what Istio's `WasmPlugin.sha256` and Envoy Gateway's
    /// `code.image.sha256` pin an `oci://` image by (as hex, without `sha256:`).
    pub fn manifest_digest(&self) -> String {
        digest(&self.manifest)
    }

    /// The config and layer blobs, with their media types.
    fn blobs(&self) -> [(&'static str, &[u8]); 2] {
        [
            (CONFIG_MEDIA_TYPE, &self.config),
            (LAYER_MEDIA_TYPE, &self.layer),
        ]
    }

    /// Writes the image as an OCI image layout into `dir` (created if missing; blobs of other
    /// images already there are left alone), tagged [`LAYOUT_TAG`].
    pub fn write_layout(&self, dir: &Path) -> anyhow::Result<()> {
        let blobs = dir.join("blobs/sha256");
        std::fs::create_dir_all(&blobs).with_context(|| format!("creating {}", blobs.display()))?;
        for bytes in [&self.config[..], &self.layer, &self.manifest] {
            let path = blobs.join(sha256_hex(bytes));
            std::fs::write(&path, bytes).with_context(|| format!("writing {}", path.display()))?;
        }
        let mut manifest = Descriptor::of(MANIFEST_MEDIA_TYPE, &self.manifest);
        manifest.annotations.insert(
            "org.opencontainers.image.ref.name".into(),
            LAYOUT_TAG.into(),
        );
        let index = serde_json::to_vec(&Index {
            schema_version: 2,
            media_type: INDEX_MEDIA_TYPE.into(),
            manifests: vec![manifest],
        })?;
        std::fs::write(dir.join("index.json"), index)?;
        std::fs::write(dir.join("oci-layout"), br#"{"imageLayoutVersion":"1.0.0"}"#)?;
        Ok(())
    }
}

/// A tar holding only `plugin.wasm`, with metadata that does not depend on who built it when.
fn layer_tar(wasm: &[u8]) -> anyhow::Result<Vec<u8>> {
    let mut header = tar::Header::new_ustar();
    header.set_path(WASM_FILE)?;
    header.set_entry_type(tar::EntryType::Regular);
    header.set_size(wasm.len() as u64);
    header.set_mode(0o644);
    header.set_mtime(0);
    header.set_uid(0);
    header.set_gid(0);
    header.set_cksum();
    let mut tar = tar::Builder::new(Vec::new());
    tar.append(&header, wasm)?;
    Ok(tar.into_inner()?)
}

/// Gzip with a fixed header: no file name, mtime 0, OS "unknown" (flate2's default).
fn gzip(bytes: &[u8]) -> anyhow::Result<Vec<u8>> {
    let mut encoder = flate2::GzBuilder::new()
        .mtime(0)
        .write(Vec::new(), flate2::Compression::best());
    encoder.write_all(bytes)?;
    Ok(encoder.finish()?)
}

/// Where to push: `HOST[:PORT]/REPOSITORY[:TAG]` (the tag defaults to `latest`).
#[derive(Debug, PartialEq)]
pub struct Reference {
    pub registry: String,
    pub repository: String,
    pub tag: String,
}

impl std::str::FromStr for Reference {
    type Err = anyhow::Error;

    fn from_str(s: &str) -> anyhow::Result<Reference> {
        let s = s.strip_prefix("oci://").unwrap_or(s);
        let Some((registry, path)) = s.split_once('/') else {
            bail!("{s:?}: expected HOST:PORT/REPOSITORY:TAG");
        };
        if path.contains('@') {
            bail!("{s:?}: push to a tag; the manifest digest is printed once pushed");
        }
        let (repository, tag) = path.rsplit_once(':').unwrap_or((path, "latest"));
        let repository_ok = !repository.is_empty()
            && repository.split('/').all(|part| {
                !part.is_empty()
                    && part.bytes().all(|b| {
                        b.is_ascii_lowercase() || b.is_ascii_digit() || b"._-".contains(&b)
                    })
            });
        if registry.is_empty() || !repository_ok {
            bail!("{s:?}: expected HOST:PORT/REPOSITORY:TAG (a lowercase repository)");
        }
        let tag_ok = !tag.is_empty()
            && tag.len() <= 128
            && tag
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b));
        if !tag_ok {
            bail!("{s:?}: invalid tag {tag:?}");
        }
        Ok(Reference {
            registry: registry.to_owned(),
            repository: repository.to_owned(),
            tag: tag.to_owned(),
        })
    }
}

impl std::fmt::Display for Reference {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}:{}", self.registry, self.repository, self.tag)
    }
}

impl Reference {
    /// Whether the registry is on this machine (`localhost`, `127.0.0.0/8`, `[::1]`).
    pub fn is_loopback(&self) -> bool {
        let host = match self.registry.strip_prefix('[') {
            Some(v6) => v6.split(']').next().unwrap_or(v6),
            None => self
                .registry
                .rsplit_once(':')
                .map_or(&self.registry[..], |(host, _)| host),
        };
        host == "localhost"
            || host
                .parse::<std::net::IpAddr>()
                .is_ok_and(|ip| ip.is_loopback())
    }
}

/// Pushes `image` to `to` over the OCI distribution API: each blob unless the registry has it
/// already (HEAD), as one monolithic upload (POST, then PUT `?digest=`), then the manifest under
/// the tag. Plain HTTP, anonymous: a loopback registry always, another only with `plain_http`.
/// Registries that want TLS or credentials are skopeo's job (`skopeo copy oci:DIR:latest
/// docker://…`).
pub fn push(image: &Image, to: &Reference, plain_http: bool) -> anyhow::Result<()> {
    check_pushable(to, plain_http)?;
    let base = reqwest::Url::parse(&format!("http://{}/v2/{}/", to.registry, to.repository))
        .with_context(|| format!("registry address {:?}", to.registry))?;
    let client = reqwest::Client::builder()
        .timeout(std::time::Duration::from_secs(60))
        .build()?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async {
        for (media_type, bytes) in image.blobs() {
            push_blob(&client, &base, media_type, bytes).await?;
        }
        let response = client
            .put(base.join(&format!("manifests/{}", to.tag))?)
            .header(reqwest::header::CONTENT_TYPE, MANIFEST_MEDIA_TYPE)
            .body(image.manifest.clone())
            .send()
            .await
            .context("pushing the manifest")?;
        expect(
            response,
            reqwest::StatusCode::CREATED,
            "pushing the manifest",
        )
        .await?;
        Ok(())
    })
}

/// Whether [`push`] can reach `to`: plain HTTP is assumed only on loopback.
pub fn check_pushable(to: &Reference, plain_http: bool) -> anyhow::Result<()> {
    if !plain_http && !to.is_loopback() {
        bail!(
            "{} is not on loopback: `--plain-http` pushes to it over plain HTTP; for a registry \
             with TLS or credentials, push the layout with \
             `skopeo copy oci:<layout>:{LAYOUT_TAG} docker://{to}`",
            to.registry
        );
    }
    Ok(())
}

async fn push_blob(
    client: &reqwest::Client,
    base: &reqwest::Url,
    media_type: &str,
    bytes: &[u8],
) -> anyhow::Result<()> {
    let digest = digest(bytes);
    let what = format!("the {media_type} blob {digest}");
    let existing = client
        .head(base.join(&format!("blobs/{digest}"))?)
        .send()
        .await
        .with_context(|| format!("asking the registry for {what}"))?;
    if existing.status() == reqwest::StatusCode::OK {
        eprintln!("xtask: the registry has {what} already");
        return Ok(());
    }
    let started = client
        .post(base.join("blobs/uploads/")?)
        .send()
        .await
        .with_context(|| format!("starting the upload of {what}"))?;
    let started = expect(
        started,
        reqwest::StatusCode::ACCEPTED,
        &format!("starting the upload of {what}"),
    )
    .await?;
    let location = started
        .headers()
        .get(reqwest::header::LOCATION)
        .and_then(|v| v.to_str().ok())
        .with_context(|| format!("the registry gave no upload location for {what}"))?;
    // The location may be relative, and may carry a query (the upload's state) of its own.
    let mut upload = started.url().join(location)?;
    upload.query_pairs_mut().append_pair("digest", &digest);
    let done = client
        .put(upload)
        .header(reqwest::header::CONTENT_TYPE, "application/octet-stream")
        .body(bytes.to_vec())
        .send()
        .await
        .with_context(|| format!("uploading {what}"))?;
    expect(
        done,
        reqwest::StatusCode::CREATED,
        &format!("uploading {what}"),
    )
    .await?;
    Ok(())
}

/// `response` if it has the `wanted` status, else an error with what the registry said.
async fn expect(
    response: reqwest::Response,
    wanted: reqwest::StatusCode,
    what: &str,
) -> anyhow::Result<reqwest::Response> {
    let status = response.status();
    if status == wanted {
        return Ok(response);
    }
    let body = response.text().await.unwrap_or_default();
    if status == reqwest::StatusCode::UNAUTHORIZED || status == reqwest::StatusCode::FORBIDDEN {
        bail!(
            "{what}: the registry wants credentials ({status}); xtask pushes anonymously, so \
             push the layout with `skopeo copy oci:<layout>:{LAYOUT_TAG} docker://…`"
        );
    }
    bail!("{what}: {status} (expected {wanted}): {body}")
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code

    use std::io::Read;

    use super::*;

    /// Not a real module: the layout does not look inside it.
    const WASM: &[u8] = b"\0asm\x01\0\0\0 not really a module, but bytes all the same";

    fn manifest(image: &Image) -> Manifest {
        serde_json::from_slice(&image.manifest).unwrap()
    }

    fn gunzip(bytes: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        flate2::read::GzDecoder::new(bytes)
            .read_to_end(&mut out)
            .unwrap();
        out
    }

    #[test]
    fn manifest_is_the_compat_variant_with_one_gzip_layer() {
        let image = Image::compat(WASM).unwrap();
        let m = manifest(&image);
        assert_eq!(m.schema_version, 2);
        assert_eq!(m.media_type, MANIFEST_MEDIA_TYPE);
        assert_eq!(m.config.media_type, CONFIG_MEDIA_TYPE);
        assert_eq!(m.layers.len(), 1);
        assert_eq!(m.layers[0].media_type, LAYER_MEDIA_TYPE);
        assert_eq!(m.annotations[VARIANT_ANNOTATION], "compat");
        // Descriptors say the truth about the blobs.
        assert_eq!(m.config, Descriptor::of(CONFIG_MEDIA_TYPE, &image.config));
        assert_eq!(m.layers[0], Descriptor::of(LAYER_MEDIA_TYPE, &image.layer));
    }

    #[test]
    fn layer_is_gzip_of_a_tar_of_plugin_wasm_alone() {
        let image = Image::compat(WASM).unwrap();
        assert_eq!(&image.layer[..2], b"\x1f\x8b", "gzip magic");
        let tar = gunzip(&image.layer);
        let mut archive = tar::Archive::new(&tar[..]);
        let mut entries: Vec<(String, Vec<u8>, u32, u64)> = archive
            .entries()
            .unwrap()
            .map(|e| {
                let mut e = e.unwrap();
                let path = e.path().unwrap().display().to_string();
                let header = e.header().clone();
                let mut body = Vec::new();
                e.read_to_end(&mut body).unwrap();
                (path, body, header.mode().unwrap(), header.mtime().unwrap())
            })
            .collect();
        assert_eq!(entries.len(), 1, "one file in the layer");
        let (path, body, mode, mtime) = entries.remove(0);
        assert_eq!(path, WASM_FILE);
        assert_eq!(body, WASM);
        assert_eq!((mode, mtime), (0o644, 0));
    }

    #[test]
    fn config_is_a_valid_image_config_naming_the_uncompressed_layer() {
        let image = Image::compat(WASM).unwrap();
        let config: serde_json::Value = serde_json::from_slice(&image.config).unwrap();
        assert_eq!(config["architecture"], "wasm");
        assert_eq!(config["os"], "wasip1");
        assert_eq!(config["rootfs"]["type"], "layers");
        let diff_ids = config["rootfs"]["diff_ids"].as_array().unwrap();
        assert_eq!(diff_ids.len(), 1);
        assert_eq!(diff_ids[0], digest(&gunzip(&image.layer)));
    }

    #[test]
    fn the_same_module_gives_the_same_digests() {
        let (a, b) = (Image::compat(WASM).unwrap(), Image::compat(WASM).unwrap());
        assert_eq!(a.manifest, b.manifest);
        assert_eq!(a.layer, b.layer);
        assert_eq!(a.config, b.config);
        let other = Image::compat(b"\0asm\x01\0\0\0 another").unwrap();
        assert_ne!(a.manifest_digest(), other.manifest_digest());
    }

    #[test]
    fn layout_blobs_are_named_by_their_digests_and_the_index_tags_the_manifest() {
        let image = Image::compat(WASM).unwrap();
        let dir = tempfile::tempdir().unwrap();
        image.write_layout(dir.path()).unwrap();

        let layout: serde_json::Value =
            serde_json::from_slice(&std::fs::read(dir.path().join("oci-layout")).unwrap()).unwrap();
        assert_eq!(layout["imageLayoutVersion"], "1.0.0");

        let mut names = Vec::new();
        for entry in std::fs::read_dir(dir.path().join("blobs/sha256")).unwrap() {
            let path = entry.unwrap().path();
            let name = path.file_name().unwrap().to_str().unwrap().to_owned();
            assert_eq!(sha256_hex(&std::fs::read(&path).unwrap()), name);
            names.push(name);
        }
        names.sort();
        let mut wanted = vec![
            sha256_hex(&image.config),
            sha256_hex(&image.layer),
            sha256_hex(&image.manifest),
        ];
        wanted.sort();
        assert_eq!(names, wanted, "the config, the layer and the manifest");

        let index: Index =
            serde_json::from_slice(&std::fs::read(dir.path().join("index.json")).unwrap()).unwrap();
        assert_eq!(index.schema_version, 2);
        assert_eq!(index.media_type, INDEX_MEDIA_TYPE);
        assert_eq!(index.manifests.len(), 1);
        let entry = &index.manifests[0];
        assert_eq!(entry.media_type, MANIFEST_MEDIA_TYPE);
        assert_eq!(entry.digest, image.manifest_digest());
        assert_eq!(entry.size, image.manifest.len() as u64);
        assert_eq!(
            entry.annotations["org.opencontainers.image.ref.name"],
            LAYOUT_TAG
        );
    }

    #[test]
    fn references_parse_with_a_default_tag() {
        let r: Reference = "127.0.0.1:5000/weir/filter:0.1.0".parse().unwrap();
        assert_eq!(
            r,
            Reference {
                registry: "127.0.0.1:5000".into(),
                repository: "weir/filter".into(),
                tag: "0.1.0".into()
            }
        );
        assert!(r.is_loopback());
        let r: Reference = "oci://localhost:5000/weir".parse().unwrap();
        assert_eq!((r.tag.as_str(), r.is_loopback()), ("latest", true));
        assert!(
            "[::1]:5000/weir:x"
                .parse::<Reference>()
                .unwrap()
                .is_loopback()
        );
        assert!(
            !"registry.example:5000/weir:x"
                .parse::<Reference>()
                .unwrap()
                .is_loopback()
        );
        for bad in [
            "weir",
            "/weir:x",
            "127.0.0.1:5000/Weir:x",
            "127.0.0.1:5000/weir:",
            "127.0.0.1:5000/weir//x:y",
            "127.0.0.1:5000/weir@sha256:00",
        ] {
            assert!(bad.parse::<Reference>().is_err(), "{bad}");
        }
    }

    #[test]
    fn only_loopback_registries_get_plain_http_unasked() {
        let image = Image::compat(WASM).unwrap();
        let remote: Reference = "registry.example/weir:x".parse().unwrap();
        let err = push(&image, &remote, false).unwrap_err().to_string();
        assert!(
            err.contains("--plain-http") && err.contains("skopeo copy"),
            "{err}"
        );
    }
}
