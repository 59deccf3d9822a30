//! JSON read with one meaning only.
//!
//! Parsers disagree on an object with a repeated key: `serde_json::Value`, Python and
//! nlohmann keep the last value, gjson and simdjson lookups the first, serde's derived structs
//! refuse it. A body admitted on one reading and served on another escapes its limits
//! (`{"max_tokens": 2000, "max_tokens": 5}`), so the front door refuses repeated keys.

use std::fmt;

use serde::Deserialize;
use serde::de::{self, Deserializer, MapAccess, SeqAccess, Visitor};
use serde_json::{Map, Value};

/// Longest key quoted back in an error.
const QUOTED_KEY_CHARS: usize = 64;

/// Parses a JSON document, refusing any object that repeats a key (at any depth). serde_json's
/// nesting limit still applies.
pub fn parse_unique_keys(bytes: &[u8]) -> Result<Value, serde_json::Error> {
    let mut de = serde_json::Deserializer::from_slice(bytes);
    let UniqueKeys(value) = UniqueKeys::deserialize(&mut de)?;
    de.end()?;
    Ok(value)
}

/// A JSON value whose objects never repeat a key.
struct UniqueKeys(Value);

impl<'de> Deserialize<'de> for UniqueKeys {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer
            .deserialize_any(UniqueKeysVisitor)
            .map(UniqueKeys)
    }
}

struct UniqueKeysVisitor;

impl<'de> Visitor<'de> for UniqueKeysVisitor {
    type Value = Value;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_bool<E>(self, v: bool) -> Result<Value, E> {
        Ok(Value::Bool(v))
    }

    fn visit_i64<E>(self, v: i64) -> Result<Value, E> {
        Ok(Value::from(v))
    }

    fn visit_u64<E>(self, v: u64) -> Result<Value, E> {
        Ok(Value::from(v))
    }

    fn visit_f64<E>(self, v: f64) -> Result<Value, E> {
        Ok(Value::from(v))
    }

    fn visit_str<E>(self, v: &str) -> Result<Value, E> {
        Ok(Value::String(v.to_owned()))
    }

    fn visit_string<E>(self, v: String) -> Result<Value, E> {
        Ok(Value::String(v))
    }

    fn visit_unit<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }

    fn visit_none<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        let mut items = Vec::with_capacity(seq.size_hint().unwrap_or(0));
        while let Some(UniqueKeys(item)) = seq.next_element()? {
            items.push(item);
        }
        Ok(Value::Array(items))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
        let mut object = Map::new();
        while let Some(key) = map.next_key::<String>()? {
            let UniqueKeys(value) = map.next_value()?;
            if object.contains_key(&key) {
                return Err(de::Error::custom(duplicate_key(&key)));
            }
            object.insert(key, value);
        }
        Ok(Value::Object(object))
    }
}

fn duplicate_key(key: &str) -> String {
    let quoted: String = key.chars().take(QUOTED_KEY_CHARS).collect();
    let ellipsis = if quoted.len() < key.len() { "…" } else { "" };
    format!("duplicate key `{quoted}{ellipsis}`")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn repeated_keys_are_refused_at_any_depth() {
        for doc in [
            r#"{"max_tokens":2000,"max_tokens":5}"#,
            r#"{"a":{"b":1,"b":1}}"#,
            r#"[{"role":"user","content":"x","content":"y"}]"#,
            r#"{"model":"m","mod\u0065l":"n"}"#,
        ] {
            let err = parse_unique_keys(doc.as_bytes())
                .err()
                .map(|e| e.to_string());
            assert!(
                err.as_deref().is_some_and(|e| e.contains("duplicate key")),
                "{doc}: {err:?}"
            );
        }
    }

    #[test]
    fn everything_else_reads_as_serde_json_reads_it() {
        for doc in [
            r#"{"model":"m","n":1,"t":0.5,"neg":-3,"big":18446744073709551615,"x":null,"s":[true,[],{}]}"#,
            r#"  [1, "two", {"3": [4]}]  "#,
            r#""\ud83d\ude00""#,
        ] {
            let ours = parse_unique_keys(doc.as_bytes()).ok();
            let theirs: Option<Value> = serde_json::from_slice(doc.as_bytes()).ok();
            assert!(ours.is_some() && ours == theirs, "{doc}");
        }
        for bad in ["{", "{} {}", "\u{feff}{}", &"[".repeat(200)] {
            assert!(parse_unique_keys(bad.as_bytes()).is_err(), "{bad}");
        }
    }
}
