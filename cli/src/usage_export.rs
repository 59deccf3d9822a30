//! `weir usage`'s exports: CSV (RFC 4180), for billing pipelines and spreadsheets, and JSON.
//! Fields a tenant chooses (its `Idempotency-Key`: any visible ASCII, commas and quotes
//! included) are quoted like every other field, so no record can add or shift the columns a
//! billing pipeline reads its token counts from. Both give the finish time twice: as the
//! ledger holds it (epoch milliseconds) and in RFC 3339 (UTC), for people.

use serde::Serialize;
use time::OffsetDateTime;
use time::format_description::well_known::Rfc3339;
use weir_sidecar::ledger::UsageRecord;

const HEADER: &str = "tenant,idempotency_key,attempt,request_id,model,api,route,mode,replica,prompt_tokens,completion_tokens,cached_prompt_tokens,source,outcome,queued_ms,finished_at_ms,finished_at,currency,price_input,price_cached_input,price_output,cost_micros,run_id,agent_id,tool_calls,started_at_ms";

/// A record as the JSON export writes it.
#[derive(Serialize)]
struct Exported<'r> {
    #[serde(flatten)]
    record: &'r UsageRecord,
    finished_at: String,
}

/// The records as a JSON array.
pub fn json(rows: &[UsageRecord]) -> serde_json::Result<String> {
    let rows: Vec<Exported> = rows
        .iter()
        .map(|record| Exported {
            record,
            finished_at: rfc3339(record.finished_at_ms),
        })
        .collect();
    Ok(serde_json::to_string_pretty(&rows)? + "\n")
}

/// Epoch milliseconds in RFC 3339, UTC, to the millisecond (empty past year 9999).
pub fn rfc3339(ms: u64) -> String {
    OffsetDateTime::from_unix_timestamp_nanos(i128::from(ms) * 1_000_000)
        .ok()
        .and_then(|t| t.format(&Rfc3339).ok())
        .unwrap_or_default()
}

/// The header line and one line per record.
pub fn table(rows: &[UsageRecord]) -> String {
    csv(
        HEADER,
        rows.iter().map(|r| {
            [
                r.tenant.clone(),
                r.idempotency_key.clone(),
                r.attempt.to_string(),
                r.request_id.clone(),
                r.model.clone(),
                r.api.clone(),
                r.route.clone().unwrap_or_default(),
                r.mode.clone().unwrap_or_default(),
                r.replica.clone(),
                r.prompt_tokens.to_string(),
                r.completion_tokens.to_string(),
                r.cached_prompt_tokens.to_string(),
                r.source.clone(),
                r.outcome.clone(),
                r.queued_ms.to_string(),
                r.finished_at_ms.to_string(),
                rfc3339(r.finished_at_ms),
                r.currency.clone().unwrap_or_default(),
                optional(r.price_input),
                optional(r.price_cached_input),
                optional(r.price_output),
                optional(r.cost_micros),
                r.run_id.clone().unwrap_or_default(),
                r.agent_id.clone().unwrap_or_default(),
                r.tool_calls.to_string(),
                optional(r.started_at_ms),
            ]
        }),
    )
}

/// `header` and a line of each row's fields, each quoted as [`field`] says.
pub fn csv<const N: usize>(header: &str, rows: impl Iterator<Item = [String; N]>) -> String {
    let mut out = format!("{header}\n");
    for fields in rows {
        let line: Vec<String> = fields.iter().map(|f| field(f)).collect();
        out.push_str(&line.join(","));
        out.push('\n');
    }
    out
}

/// A figure, or an empty field for a record without one.
pub fn optional(value: Option<impl ToString>) -> String {
    value.map(|v| v.to_string()).unwrap_or_default()
}

/// A field as RFC 4180 writes it: quoted, its quotes doubled, when it holds a comma, a quote or
/// a line break.
fn field(value: &str) -> String {
    // A field a client chose (a run id, a model name) that a spreadsheet would read as a
    // formula is written as text (OWASP's CSV injection advice).
    let value = if value.starts_with(['=', '+', '-', '@', '\t', '\r']) {
        format!("'{value}")
    } else {
        value.to_owned()
    };
    if value.contains([',', '"', '\r', '\n']) {
        format!("\"{}\"", value.replace('"', "\"\""))
    } else {
        value
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The fields of a CSV line as a conforming reader splits them.
    fn read(line: &str) -> Vec<String> {
        let (mut fields, mut field, mut quoted, mut chars) =
            (Vec::new(), String::new(), false, line.chars().peekable());
        while let Some(c) = chars.next() {
            match (c, quoted) {
                ('"', true) if chars.peek() == Some(&'"') => {
                    field.push('"');
                    chars.next();
                }
                ('"', _) => quoted = !quoted,
                (',', false) => fields.push(std::mem::take(&mut field)),
                _ => field.push(c),
            }
        }
        fields.push(field);
        fields
    }

    #[test]
    fn a_tenant_s_idempotency_key_cannot_move_the_columns_billing_reads() {
        // Any visible ASCII is a valid Idempotency-Key: this one would put its own token counts
        // where a pipeline reads prompt_tokens and completion_tokens.
        let key = r#"k",0,"x,1,r,m,a,rep,0,0,engine,ok"#;
        let record = UsageRecord {
            request_id: "weir-1".into(),
            idempotency_key: key.into(),
            attempt: 1,
            tenant: "a/w/p/k".into(),
            model: "m".into(),
            api: "chat_completions".into(),
            replica: "http://r".into(),
            prompt_tokens: 1200,
            completion_tokens: 300,
            source: "engine".into(),
            outcome: "ok".into(),
            queued_ms: 4,
            finished_at_ms: 1_796_601_600_123,
            route: Some("llm-api".into()),
            mode: Some("shadow".into()),
            cached_prompt_tokens: 200,
            currency: Some("USD".into()),
            price_input: Some(0.15),
            price_cached_input: Some(0.075),
            price_output: Some(0.6),
            cost_micros: Some(345),
            run_id: Some("run,1".into()),
            agent_id: None,
            tool_calls: 2,
            started_at_ms: Some(1_796_601_599_000),
        };
        let text = table(&[record]);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 2, "{text}");
        let (header, row) = (read(lines[0]), read(lines[1]));
        assert_eq!(row.len(), header.len(), "{}", lines[1]);
        let column = |name: &str| &row[header.iter().position(|h| h == name).unwrap()];
        assert_eq!(column("idempotency_key"), key);
        assert_eq!(column("prompt_tokens"), "1200");
        assert_eq!(column("completion_tokens"), "300");
        assert_eq!(
            (
                column("currency").as_str(),
                column("price_cached_input").as_str()
            ),
            ("USD", "0.075")
        );
        assert_eq!(column("cost_micros"), "345", "the cost with the price used");
        assert_eq!(
            (column("route").as_str(), column("mode").as_str()),
            ("llm-api", "shadow")
        );
        assert_eq!(column("finished_at"), "2026-12-07T00:00:00.123Z");
        assert_eq!(
            (column("run_id").as_str(), column("tool_calls").as_str()),
            ("run,1", "2"),
            "a run id is the caller's: quoted like the key"
        );
        assert_eq!(
            field("plain-id_1.2"),
            "plain-id_1.2",
            "unquoted when it can be"
        );
    }
}
