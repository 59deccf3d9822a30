//! JSON read with one meaning only, and without building a tree of the whole body.
//!
//! Parsers disagree on an object with a repeated key: `serde_json::Value`, Python and
//! nlohmann keep the last value, gjson and simdjson lookups the first, serde's derived structs
//! refuse it. A body admitted on one reading and served on another escapes its limits
//! (`{"max_tokens": 2000, "max_tokens": 5}`), so the front door refuses repeated keys
//! ([`check_unique_keys`]).
//!
//! A tree of a request body (`serde_json::Value`) costs up to tens of times the body
//! (`[{"a":0},{"a":0},...]`: a map node per 8 bytes), and a VM's linear memory never shrinks:
//! one 4 MiB body left each Envoy worker ~150 MB larger. So nothing here builds one: the check
//! walks the body keeping only the keys of the objects it is inside, and [`TopLevel`] holds
//! the top-level fields as raw JSON text.

use std::collections::{BTreeMap, HashSet};
use std::fmt;
use std::hash::{BuildHasher, RandomState};

use serde::de::{self, DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};
use serde_json::value::RawValue;

/// Longest key quoted back in an error.
const QUOTED_KEY_CHARS: usize = 64;

/// Checks a JSON document, refusing any object that repeats a key (at any depth). serde_json's
/// nesting limit applies.
pub fn check_unique_keys(bytes: &[u8]) -> Result<(), serde_json::Error> {
    let mut de = serde_json::Deserializer::from_slice(bytes);
    let hasher = RandomState::new();
    UniqueKeys { hasher: &hasher }.deserialize(&mut de)?;
    de.end()
}

/// A JSON value whose objects never repeat a key; keeps nothing but hashes of the keys of the
/// objects being read.
#[derive(Clone, Copy)]
struct UniqueKeys<'h> {
    hasher: &'h RandomState,
}

impl<'de> DeserializeSeed<'de> for UniqueKeys<'_> {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<(), D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for UniqueKeys<'_> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_bool<E>(self, _: bool) -> Result<(), E> {
        Ok(())
    }

    fn visit_i64<E>(self, _: i64) -> Result<(), E> {
        Ok(())
    }

    fn visit_u64<E>(self, _: u64) -> Result<(), E> {
        Ok(())
    }

    fn visit_f64<E>(self, _: f64) -> Result<(), E> {
        Ok(())
    }

    fn visit_str<E>(self, _: &str) -> Result<(), E> {
        Ok(())
    }

    fn visit_unit<E>(self) -> Result<(), E> {
        Ok(())
    }

    fn visit_none<E>(self) -> Result<(), E> {
        Ok(())
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        while seq.next_element_seed(self)?.is_some() {}
        Ok(())
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        let mut seen = HashSet::new();
        while let Some(key) = map.next_key::<String>()? {
            if !seen.insert(self.hasher.hash_one(&key)) {
                return Err(de::Error::custom(duplicate_key(&key)));
            }
            map.next_value_seed(self)?;
        }
        Ok(())
    }
}

fn duplicate_key(key: &str) -> String {
    let quoted: String = key.chars().take(QUOTED_KEY_CHARS).collect();
    let ellipsis = if quoted.len() < key.len() { "…" } else { "" };
    format!("duplicate key `{quoted}{ellipsis}`")
}

/// The top-level fields of a JSON object, each value kept as its JSON text: fields can be
/// removed, set and the object written back without reading the values into a tree.
#[derive(Debug, Default)]
pub struct TopLevel(BTreeMap<String, Box<RawValue>>);

impl TopLevel {
    /// Reads a JSON object's fields (a repeated key keeps its last value: check first).
    pub fn parse(bytes: &[u8]) -> Result<Self, serde_json::Error> {
        serde_json::from_slice(bytes).map(TopLevel)
    }

    pub fn get(&self, key: &str) -> Option<&RawValue> {
        self.0.get(key).map(AsRef::as_ref)
    }

    /// Removes a field; whether it was there.
    pub fn remove(&mut self, key: &str) -> bool {
        self.0.remove(key).is_some()
    }

    /// Sets a field to an already written JSON value.
    pub fn set_raw(&mut self, key: &str, value: Box<RawValue>) {
        self.0.insert(key.to_owned(), value);
    }

    /// Sets a field to a value's JSON text.
    pub fn set(
        &mut self,
        key: &str,
        value: impl serde::Serialize,
    ) -> Result<(), serde_json::Error> {
        let raw = serde_json::value::to_raw_value(&value)?;
        self.set_raw(key, raw);
        Ok(())
    }

    /// The object as JSON text.
    pub fn to_raw(&self) -> Result<Box<RawValue>, serde_json::Error> {
        serde_json::value::to_raw_value(&self.0)
    }

    pub fn to_vec(&self) -> Result<Vec<u8>, serde_json::Error> {
        serde_json::to_vec(&self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::Value;

    #[test]
    fn repeated_keys_are_refused_at_any_depth() {
        for doc in [
            r#"{"max_tokens":2000,"max_tokens":5}"#,
            r#"{"a":{"b":1,"b":1}}"#,
            r#"[{"role":"user","content":"x","content":"y"}]"#,
            r#"{"model":"m","mod\u0065l":"n"}"#,
        ] {
            let err = check_unique_keys(doc.as_bytes())
                .err()
                .map(|e| e.to_string());
            assert!(
                err.as_deref().is_some_and(|e| e.contains("duplicate key")),
                "{doc}: {err:?}"
            );
        }
    }

    #[test]
    fn everything_else_is_checked_as_serde_json_reads_it() {
        for doc in [
            r#"{"model":"m","n":1,"t":0.5,"neg":-3,"big":18446744073709551615,"x":null,"s":[true,[],{}]}"#,
            r#"  [1, "two", {"3": [4]}, {"3": [4]}]  "#,
            r#""\ud83d\ude00""#,
        ] {
            assert!(check_unique_keys(doc.as_bytes()).is_ok(), "{doc}");
        }
        for bad in ["{", "{} {}", "\u{feff}{}", &"[".repeat(200), r#""\ud800""#] {
            assert!(check_unique_keys(bad.as_bytes()).is_err(), "{bad}");
        }
    }

    #[test]
    fn top_level_fields_are_edited_as_text() {
        let mut top =
            TopLevel::parse(br#"{"model":"m","cache_salt":"s","x":[1, {"y": 2.50}]}"#).unwrap();
        assert!(top.remove("cache_salt") && !top.remove("cache_salt"));
        top.set("max_tokens", 7).unwrap();
        assert_eq!(top.get("x").map(RawValue::get), Some(r#"[1, {"y": 2.50}]"#));
        let out: Value = serde_json::from_slice(&top.to_vec().unwrap()).unwrap();
        assert_eq!(
            out,
            serde_json::json!({"model": "m", "max_tokens": 7, "x": [1, {"y": 2.50}]})
        );
        assert!(TopLevel::parse(b"[1]").is_err());
    }
}
