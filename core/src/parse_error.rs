//! A config's parse errors in plain words, for the filter's and the sidecar's configs alike:
//! whoever edits a config reads "must be a non-negative integer, not -5", not serde's "invalid
//! type: integer `-5`, expected u64".

/// The message of a parse error at `field` (a path into the config; `.`, `?` or empty at its
/// root), from the parser's `error` text.
///
/// The parser's own copy of the path is dropped (the caller prints `field`), and so is its line
/// and column where there is a field: the path is the address, and a config handed over from a
/// manifest is re-serialized, so its line numbers are not the author's. At the root, where a
/// syntax error has no field, the line and column are all there is, and are kept.
pub fn plain(field: &str, error: &str) -> String {
    let message = match error.split_once(": ") {
        Some((path, rest)) if !path.is_empty() && field.starts_with(path) => rest,
        _ => error,
    };
    let (message, location) = split_location(message);
    let message = rephrase(&message);
    match location {
        Some((line, column)) if matches!(field, "" | "." | "?") => {
            format!("{message} (line {line}, column {column})")
        }
        _ => message,
    }
}

/// `… at line L column C[, while …]`, as serde_json and serde_yaml put a message: the message
/// without it, and L and C.
fn split_location(message: &str) -> (String, Option<(&str, &str)>) {
    let location = message.rsplit_once(" at line ").and_then(|(head, tail)| {
        let (line, tail) = tail.split_once(" column ")?;
        let digits = tail.bytes().take_while(u8::is_ascii_digit).count();
        let (column, rest) = tail.split_at(digits);
        let numbers =
            !line.is_empty() && line.bytes().all(|b| b.is_ascii_digit()) && !column.is_empty();
        numbers.then(|| (format!("{head}{rest}"), (line, column)))
    });
    match location {
        Some((rest, at)) => (rest, Some(at)),
        None => (message.to_owned(), None),
    }
}

/// Serde's "invalid type: X, expected Y" and "unknown variant `v`, expected …" as what the
/// value must be and what it was; any other message as it is.
fn rephrase(message: &str) -> String {
    let mismatch = message
        .strip_prefix("invalid type: ")
        .or_else(|| message.strip_prefix("invalid value: "))
        .and_then(|rest| rest.rsplit_once(", expected "));
    if let Some((found, expected)) = mismatch {
        return format!("{}, not {}", must_be(expected), found_value(found));
    }
    let variant = message
        .strip_prefix("unknown variant ")
        .and_then(|rest| rest.split_once(", expected "));
    if let Some((found, expected)) = variant {
        return format!("must be {expected}, not {found}");
    }
    message.to_owned()
}

/// What serde expected (a Rust type, or a phrase), as a rule.
fn must_be(expected: &str) -> String {
    let rule = match expected {
        "u8" => "an integer from 0 to 255",
        "u16" => "an integer from 0 to 65535",
        "u32" => "an integer from 0 to 4294967295",
        "u64" | "u128" | "usize" => "a non-negative integer",
        "i8" | "i16" | "i32" | "i64" | "i128" | "isize" => "an integer",
        "f32" | "f64" => "a number",
        "a boolean" => "true or false",
        "a string" | "a borrowed string" => "a string",
        "a sequence" => "a list",
        "a character" => "a single character",
        other if other.starts_with("struct ") => "a map of fields",
        other => other,
    };
    format!("must be {rule}")
}

/// The value serde found, as the config would spell it.
fn found_value(found: &str) -> String {
    let quoted = |prefix: &str| {
        found
            .strip_prefix(prefix)
            .and_then(|v| v.strip_prefix('`'))
            .and_then(|v| v.strip_suffix('`'))
    };
    if let Some(value) = ["integer ", "floating point ", "boolean "]
        .into_iter()
        .find_map(quoted)
    {
        return value.to_owned();
    }
    if let Some(text) = found.strip_prefix("string ") {
        return text.to_owned();
    }
    match found {
        "unit value" => "empty (null)".into(),
        "map" => "a map".into(),
        "sequence" => "a list".into(),
        other => other.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn serde_type_errors_read_as_rules() {
        for (field, error, expected) in [
            (
                "orgs[0].limits.requests_per_minute",
                "orgs[0].limits.requests_per_minute: invalid type: integer `-5`, expected u64 at \
                 line 3 column 33",
                "must be a non-negative integer, not -5",
            ),
            (
                "orgs[0].limits.requests_per_minute",
                "invalid value: integer `-5`, expected u64 at line 1 column 61",
                "must be a non-negative integer, not -5",
            ),
            (
                "routes.default.rollout_percent",
                "invalid value: integer `300`, expected u8",
                "must be an integer from 0 to 255, not 300",
            ),
            (
                "forward_api_key",
                "forward_api_key: invalid type: string \"yes please\", expected a boolean at line \
                 2 column 18",
                "must be true or false, not \"yes please\"",
            ),
            (
                "orgs",
                "orgs: invalid type: map, expected a sequence at line 1 column 7",
                "must be a list, not a map",
            ),
            (
                "orgs[0].id",
                "invalid type: integer `3`, expected a string",
                "must be a string, not 3",
            ),
            (
                "orgs[0].policy.weight",
                "invalid type: string \"heavy\", expected f64",
                "must be a number, not \"heavy\"",
            ),
            (
                "orgs[0].limits",
                "invalid type: integer `5`, expected struct Limits",
                "must be a map of fields, not 5",
            ),
            (
                "orgs[0].limits.requests_per_minute",
                "invalid type: unit value, expected u64",
                "must be a non-negative integer, not empty (null)",
            ),
            (
                "routes.default.mode",
                "routes.default.mode: unknown variant `enforced`, expected one of `ignore`, \
                 `off`, `shadow`, `enforce` at line 2 column 26",
                "must be one of `ignore`, `off`, `shadow`, `enforce`, not `enforced`",
            ),
            (
                "pools[0].queue",
                "pools[0]: unknown field `queue`, expected `model` at line 4 column 3",
                "unknown field `queue`, expected `model`",
            ),
            (
                ".",
                "did not find expected node content at line 2 column 1, while parsing a flow node",
                "did not find expected node content, while parsing a flow node (line 2, column 1)",
            ),
            (
                "",
                "EOF while parsing an object at line 1 column 1",
                "EOF while parsing an object (line 1, column 1)",
            ),
            ("x", "some other message", "some other message"),
        ] {
            assert_eq!(plain(field, error), expected, "{error}");
        }
    }
}
