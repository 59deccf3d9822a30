//! `cargo xtask up --engine URL …`: the stack in front of engines the user already runs. Each
//! engine's `/v1/models` says what it serves; the replicas of one model form a pool, and each
//! served model becomes a known model of the demo config (with its context length where the
//! engine reports one), so the demo keys can call it and the front door caps its context.

use std::collections::BTreeMap;
use std::time::Duration;

use anyhow::{Context, bail};
use serde_json::{Value, json};

/// A model an engine serves, and its context length if the engine says (llama.cpp's
/// `meta.n_ctx`, vLLM's `max_model_len`).
#[derive(Clone, Debug, PartialEq)]
pub struct ServedModel {
    pub id: String,
    pub context: Option<u64>,
}

/// One engine and what it serves.
#[derive(Clone, Debug)]
pub struct Engine {
    pub url: String,
    pub models: Vec<ServedModel>,
}

/// Asks each engine for its models.
pub fn discover(urls: &[String]) -> anyhow::Result<Vec<Engine>> {
    let runtime = tokio::runtime::Runtime::new()?;
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(5))
        .build()?;
    urls.iter()
        .map(|url| {
            let url = url.trim_end_matches('/').to_owned();
            let list: Value = runtime
                .block_on(async {
                    client
                        .get(format!("{url}/v1/models"))
                        .send()
                        .await?
                        .error_for_status()?
                        .json()
                        .await
                })
                .with_context(|| format!("asking {url}/v1/models what it serves"))?;
            let models = served_models(&list);
            if models.is_empty() {
                bail!("{url}/v1/models lists no model");
            }
            Ok(Engine { url, models })
        })
        .collect()
}

/// The models of an OpenAI `/v1/models` list.
fn served_models(list: &Value) -> Vec<ServedModel> {
    list["data"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|m| {
            Some(ServedModel {
                id: m["id"].as_str()?.to_owned(),
                context: m["max_model_len"]
                    .as_u64()
                    .or_else(|| m["meta"]["n_ctx"].as_u64()),
            })
        })
        .collect()
}

/// The sidecar's pools: each model with the engines that serve it.
pub fn pools(engines: &[Engine]) -> Value {
    let mut by_model: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
    for engine in engines {
        for model in &engine.models {
            by_model.entry(&model.id).or_default().push(&engine.url);
        }
    }
    by_model
        .into_iter()
        .map(|(model, replicas)| json!({"model": model, "replicas": replicas}))
        .collect()
}

/// Adds each served model to `config`'s known models; where replicas report different context
/// lengths, the smallest is the cap.
pub fn add_to_config(config: &mut Value, engines: &[Engine]) {
    let models = &mut config["models"];
    for model in engines.iter().flat_map(|e| &e.models) {
        let entry = &mut models[&model.id];
        if entry.is_null() {
            *entry = json!({});
        }
        if let Some(context) = model.context {
            let cap = entry["max_context_tokens"]
                .as_u64()
                .map_or(context, |c| c.min(context));
            entry["max_context_tokens"] = cap.into();
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn engine(url: &str, models: &[(&str, Option<u64>)]) -> Engine {
        Engine {
            url: url.into(),
            models: models
                .iter()
                .map(|(id, context)| ServedModel {
                    id: (*id).into(),
                    context: *context,
                })
                .collect(),
        }
    }

    #[test]
    fn reads_llama_cpp_and_vllm_model_lists() {
        let llama = json!({"object": "list", "models": [{"name": "tiny-llama"}],
            "data": [{"id": "tiny-llama", "object": "model", "meta": {"n_ctx": 2048, "n_vocab": 628}}]});
        let vllm =
            json!({"object": "list", "data": [{"id": "m", "max_model_len": 8192}, {"id": "lora"}]});
        assert_eq!(
            served_models(&llama),
            [ServedModel {
                id: "tiny-llama".into(),
                context: Some(2048)
            }]
        );
        assert_eq!(
            served_models(&vllm)
                .iter()
                .map(|m| (m.id.as_str(), m.context))
                .collect::<Vec<_>>(),
            [("m", Some(8192)), ("lora", None)]
        );
    }

    #[test]
    fn replicas_of_a_model_form_one_pool_and_the_tightest_context_caps_it() {
        let engines = [
            engine("http://a", &[("tiny", Some(2048))]),
            engine("http://b", &[("tiny", Some(1024))]),
            engine("http://c", &[("big", None)]),
        ];
        assert_eq!(
            pools(&engines),
            json!([
                {"model": "big", "replicas": ["http://c"]},
                {"model": "tiny", "replicas": ["http://a", "http://b"]},
            ])
        );
        let mut config = json!({"models": {"llama-3.1-8b": {"max_context_tokens": 131072}}});
        add_to_config(&mut config, &engines);
        assert_eq!(
            config["models"],
            json!({
                "llama-3.1-8b": {"max_context_tokens": 131072},
                "tiny": {"max_context_tokens": 1024},
                "big": {},
            })
        );
    }
}
