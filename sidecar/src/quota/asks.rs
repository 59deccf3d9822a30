//! What a renewal may ask for: the strict checks an ask passes before it reaches the store.
//! The caller is a signed filter, but a filter bug or a version skew must not write junk keys
//! or amounts the script's arithmetic cannot hold exactly.

use weir_core::error::ApiError;
use weir_core::fleet::{
    CounterAsk, Holder, LeaseRequest, MAX_AMOUNT, MAX_COUNTERS, MAX_HOLD_MS, MAX_HOLDER_ID_LEN,
    MIN_HOLD_MS,
};
use weir_core::trusted;

/// A renewal's body: [`MAX_COUNTERS`] asks of the longest key fit well within it.
pub const MAX_BODY_BYTES: usize = 1024 * 1024;

/// Counter namespaces: enforced limits (`e`) and shadow-mode ones (`s`).
const NAMESPACES: [&str; 2] = ["weir:e:", "weir:s:"];

/// A counter name as the filter forms it: `weir:e:<tenant path>:<limit>` (or `weir:s:` in
/// shadow mode), where the limit is one or more ids joined by `:`.
pub fn is_counter_key(key: &str) -> bool {
    let Some(rest) = NAMESPACES.iter().find_map(|ns| key.strip_prefix(ns)) else {
        return false;
    };
    let Some((path, limit)) = rest.split_once(':') else {
        return false;
    };
    trusted::is_tenant_path(path) && limit.split(':').all(trusted::is_level_id)
}

/// The tenant path of a checked counter key, for per-tenant metrics.
pub fn tenant_of(key: &str) -> &str {
    key.split(':').nth(2).unwrap_or_default()
}

/// Every ask checked, or the 400 naming the first bad one.
pub fn check(request: &LeaseRequest) -> Result<(), ApiError> {
    if request.counters.len() > MAX_COUNTERS {
        return Err(invalid(
            format!("a renewal carries at most {MAX_COUNTERS} counters"),
            "counters",
        ));
    }
    if let Some(holder) = &request.holder {
        check_holder(holder).map_err(|problem| invalid(problem, "holder"))?;
    }
    let mut seen = std::collections::HashSet::new();
    for (i, ask) in request.counters.iter().enumerate() {
        check_ask(ask).map_err(|problem| invalid(problem, &format!("counters[{i}]")))?;
        // One ask per counter: a second would be applied on the first's answer in one call.
        if !seen.insert((ask.key.as_str(), ask.window)) {
            return Err(invalid(
                "a counter is asked for twice",
                &format!("counters[{i}]"),
            ));
        }
    }
    Ok(())
}

/// A holder id is a store hash field: short hex, nothing else.
fn check_holder(holder: &Holder) -> Result<(), String> {
    let id = &holder.id;
    if id.is_empty() || id.len() > MAX_HOLDER_ID_LEN || !id.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err(format!(
            "the id must be 1 to {MAX_HOLDER_ID_LEN} hex digits"
        ));
    }
    if !(MIN_HOLD_MS..=MAX_HOLD_MS).contains(&holder.hold_ms) {
        return Err(format!("hold_ms must be {MIN_HOLD_MS} to {MAX_HOLD_MS}"));
    }
    Ok(())
}

fn check_ask(ask: &CounterAsk) -> Result<(), String> {
    if !is_counter_key(&ask.key) {
        return Err("the key is not a weir counter name (weir:e:<tenant path>:<limit>)".into());
    }
    for (field, value) in [
        ("limit", ask.limit),
        ("want", ask.want),
        ("returned", ask.returned),
        ("held", ask.held.unwrap_or(0)),
    ] {
        if value > MAX_AMOUNT {
            return Err(format!("{field} is above {MAX_AMOUNT}"));
        }
    }
    Ok(())
}

fn invalid(message: impl Into<String>, param: &str) -> ApiError {
    ApiError::bad_request(message.into())
        .with_code("invalid_lease_request")
        .with_param(param)
}

#[cfg(test)]
mod tests {
    use super::*;
    use weir_core::fleet::Window;

    fn ask(key: &str, limit: u64) -> LeaseRequest {
        LeaseRequest {
            counters: vec![CounterAsk {
                key: key.into(),
                window: Window::Minute,
                limit,
                want: 1,
                returned: 0,
                returned_window_start_ms: None,
                held: None,
                held_window_start_ms: None,
            }],
            holder: None,
        }
    }

    #[test]
    fn keys_are_weir_counter_names() {
        for good in [
            "weir:e:acme:itpm",
            "weir:e:acme/lab/e2e/plain:rpm",
            "weir:s:acme/w:spend:usd",
        ] {
            assert!(is_counter_key(good), "{good}");
        }
        for bad in [
            "",
            "weir:e:acme",
            "weir:x:acme:itpm",
            "other:e:acme:itpm",
            "weir:e::itpm",
            "weir:e:acme:",
            "weir:e:a/b/c/d/e:itpm",
            "weir:e:acme:it pm",
            "weir:e:../x:itpm",
            "weir:e:acme:itpm\n",
        ] {
            assert!(!is_counter_key(bad), "{bad:?}");
        }
        assert_eq!(tenant_of("weir:e:acme/lab:spend:usd"), "acme/lab");
    }

    #[test]
    fn amounts_are_capped_and_the_bad_ask_is_named() {
        assert!(check(&ask("weir:e:acme:itpm", MAX_AMOUNT)).is_ok());
        let e = check(&ask("weir:e:acme:itpm", MAX_AMOUNT + 1)).err();
        let e = e.map(|e| (e.status, e.param));
        assert_eq!(e, Some((400, Some("counters[0]".into()))));
        assert!(check(&ask("tenant-chosen-key", 1)).is_err());
        let many = LeaseRequest {
            counters: vec![ask("weir:e:a:b", 1).counters[0].clone(); MAX_COUNTERS + 1],
            holder: None,
        };
        assert!(check(&many).is_err());
        let twice = LeaseRequest {
            counters: vec![ask("weir:e:a:b", 1).counters[0].clone(); 2],
            holder: None,
        };
        let e = check(&twice).err().map(|e| e.param);
        assert_eq!(
            e,
            Some(Some("counters[1]".into())),
            "a counter asked for twice"
        );
    }

    #[test]
    fn a_holder_is_short_hex_with_a_bounded_hold() {
        let with = |id: &str, hold_ms: u64| LeaseRequest {
            holder: Some(Holder {
                id: id.into(),
                hold_ms,
            }),
            ..ask("weir:e:acme:itpm", 1)
        };
        assert!(check(&with("0123456789abcdef", 6_000)).is_ok());
        for (id, hold_ms) in [
            ("", 6_000),
            ("not-hex", 6_000),
            ("a:b", 6_000),
            (&"f".repeat(MAX_HOLDER_ID_LEN + 1), 6_000),
            ("abc", 0),
            ("abc", MIN_HOLD_MS - 1),
            ("abc", MAX_HOLD_MS + 1),
        ] {
            let e = check(&with(id, hold_ms)).err().map(|e| e.param);
            assert_eq!(e, Some(Some("holder".into())), "{id:?} {hold_ms}");
        }
    }
}
