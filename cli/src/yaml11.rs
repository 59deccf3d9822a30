//! Bare words that YAML 1.1 reads as booleans. Kubernetes reads a manifest as YAML 1.1, so a
//! `WasmPlugin`'s `mode: off` reaches the filter as `"mode": false`, which it refuses; weir reads
//! YAML 1.2, where the same `off` is the string "off". What Kubernetes will make of a manifest
//! depends on how each word was written, which a parsed value no longer says: this walks the
//! document itself.

use std::fmt;

use serde::de::{self, DeserializeSeed, MapAccess, SeqAccess, Visitor};

/// YAML 1.1's boolean words that YAML 1.2 reads as strings (`true` and `false` are booleans in
/// both).
fn is_yaml11_boolean(word: &str) -> bool {
    matches!(
        word,
        "y" | "Y"
            | "yes"
            | "Yes"
            | "YES"
            | "n"
            | "N"
            | "no"
            | "No"
            | "NO"
            | "on"
            | "On"
            | "ON"
            | "off"
            | "Off"
            | "OFF"
    )
}

/// A bare YAML-1.1 boolean word in a document: where (a dotted path from the document's root)
/// and the word.
#[derive(Debug, PartialEq, Eq)]
pub struct BareWord {
    pub path: String,
    pub word: String,
}

impl BareWord {
    /// What Kubernetes makes of it.
    pub fn message(&self) -> String {
        let word = &self.word;
        let read_as = ["y", "yes", "on"].contains(&word.to_ascii_lowercase().as_str());
        format!("quote it: \"{word}\" — Kubernetes reads a bare {word} as {read_as}")
    }
}

/// The bare YAML-1.1 boolean words of one document of `source`, keys and values alike; none when
/// it does not parse (the parse error is reported where the document is read).
pub fn bare_words<'de>(
    source: &'de str,
    document: serde_yaml_ng::Deserializer<'de>,
) -> Vec<BareWord> {
    let mut found = Vec::new();
    let walk = Walk {
        source,
        path: String::new(),
        found: &mut found,
    };
    match walk.deserialize(document) {
        Ok(_) => found,
        Err(_) => Vec::new(),
    }
}

/// One node of the walk, at `path`.
struct Walk<'de, 'f> {
    source: &'de str,
    path: String,
    found: &'f mut Vec<BareWord>,
}

impl<'de> DeserializeSeed<'de> for Walk<'de, '_> {
    /// The node's text when it is a string (a key's, for the path below it).
    type Value = Option<String>;

    fn deserialize<D: de::Deserializer<'de>>(self, d: D) -> Result<Option<String>, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Walk<'de, '_> {
    type Value = Option<String>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any YAML")
    }

    /// A scalar taken straight from the source: the parser hands a bare word over as the slice of
    /// the source it is, a quoted one as the slice inside its quotes.
    fn visit_borrowed_str<E: de::Error>(self, text: &'de str) -> Result<Option<String>, E> {
        let at = (text.as_ptr() as usize).wrapping_sub(self.source.as_ptr() as usize);
        let quoted = at
            .checked_sub(1)
            .and_then(|before| self.source.as_bytes().get(before))
            .is_some_and(|b| matches!(b, b'"' | b'\''));
        if is_yaml11_boolean(text) && !quoted && at < self.source.len() {
            self.found.push(BareWord {
                path: self.path,
                word: text.to_owned(),
            });
        }
        Ok(Some(text.to_owned()))
    }

    /// A scalar that is not a slice of the source (escaped, or a block): never bare.
    fn visit_str<E: de::Error>(self, text: &str) -> Result<Option<String>, E> {
        Ok(Some(text.to_owned()))
    }

    fn visit_bool<E: de::Error>(self, _: bool) -> Result<Option<String>, E> {
        Ok(None)
    }

    fn visit_i64<E: de::Error>(self, _: i64) -> Result<Option<String>, E> {
        Ok(None)
    }

    fn visit_u64<E: de::Error>(self, _: u64) -> Result<Option<String>, E> {
        Ok(None)
    }

    fn visit_f64<E: de::Error>(self, _: f64) -> Result<Option<String>, E> {
        Ok(None)
    }

    fn visit_unit<E: de::Error>(self) -> Result<Option<String>, E> {
        Ok(None)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut items: A) -> Result<Option<String>, A::Error> {
        let mut i = 0;
        loop {
            let item = Walk {
                source: self.source,
                path: format!("{}[{i}]", self.path),
                found: &mut *self.found,
            };
            if items.next_element_seed(item)?.is_none() {
                return Ok(None);
            }
            i += 1;
        }
    }

    fn visit_map<A: MapAccess<'de>>(self, mut fields: A) -> Result<Option<String>, A::Error> {
        loop {
            let before = self.found.len();
            let key = Walk {
                source: self.source,
                path: String::new(),
                found: &mut *self.found,
            };
            let Some(name) = fields.next_key_seed(key)? else {
                return Ok(None);
            };
            let name = name.unwrap_or_else(|| "?".into());
            let path = if self.path.is_empty() {
                name
            } else {
                format!("{}.{name}", self.path)
            };
            // A bare key: its path is the key's own.
            if let Some(key) = self.found.get_mut(before) {
                key.path.clone_from(&path);
            }
            let value = Walk {
                source: self.source,
                path,
                found: &mut *self.found,
            };
            fields.next_value_seed(value)?;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn words(text: &str) -> Vec<(String, String)> {
        serde_yaml_ng::Deserializer::from_str(text)
            .flat_map(|doc| bare_words(text, doc))
            .map(|b| (b.path, b.word))
            .collect()
    }

    #[test]
    fn only_bare_words_are_found_keys_and_values_alike() {
        let text = "a: {mode: off}\nb: [\"off\", 'no', yes, offline, true, \"o\\x66f\"]\nON: 1\nc: |\n  off\n---\nd: N\n";
        let expected = [("a.mode", "off"), ("b[2]", "yes"), ("ON", "ON"), ("d", "N")];
        let expected: Vec<_> = expected
            .iter()
            .map(|(p, w)| (p.to_string(), w.to_string()))
            .collect();
        assert_eq!(words(text), expected);
    }

    #[test]
    fn the_message_says_what_kubernetes_reads() {
        let off = BareWord {
            path: "mode".into(),
            word: "off".into(),
        };
        assert_eq!(
            off.message(),
            "quote it: \"off\" — Kubernetes reads a bare off as false"
        );
        let yes = BareWord {
            path: "x".into(),
            word: "Yes".into(),
        };
        assert!(yes.message().ends_with("a bare Yes as true"));
    }
}
