//! The tool policy on the answer: calls withheld from streams and whole bodies, the rest
//! passed byte for byte, every token billed either way.

use std::rc::Rc;

use proxy_wasm::types::Action;
use serde_json::{Value, json};
use weir_core::config::{Config, ToolRule};
use weir_core::endpoint::Endpoint;
use weir_core::keys::hash_key;
use weir_core::meter::{MAX_HELD_BYTES, StreamMeter};
use weir_core::tools::{approval_id, arguments_sha256};

use super::{KEY, Mock, configured, headers_arrive_with, pairs};

mod attacks;
use crate::Gateway;
use crate::exchange::{Exchange, Side};
use crate::host::Metrics;
use crate::telemetry;

/// A gateway whose key blocks `shell_*`, needs approval for `deploy` and removes blocked tools
/// offered.
fn gateway() -> Rc<Gateway> {
    gateway_with(json!({ "tools": tool_policy() }))
}

/// A gateway whose one key's org has `policy`.
fn gateway_with(policy: Value) -> Rc<Gateway> {
    let config = json!({
        "orgs": [{"id": "acme", "policy": policy, "workspaces": [{"id": "w", "projects": [
            {"id": "p", "keys": [{"id": "k", "sha256": hash_key(KEY)}]}]}]}],
        "routes": {"default": {"mode": "enforce"}},
    });
    let config = Config::parse(config.to_string().as_bytes()).unwrap();
    Rc::new(Gateway::new(config, None, Metrics::default()))
}

const OFFERED: [&str; 3] = ["search", "deploy", "shell_rm"];

/// A request to `endpoint` offering [`OFFERED`] (streamed with its usage asked for, so the
/// meter hides nothing), admitted.
fn admitted(gw: &Rc<Gateway>, host: &Mock, endpoint: Endpoint, stream: bool) -> Exchange {
    admitted_with(gw, host, endpoint, stream, &[])
}

/// [`admitted`], its request carrying `extra` headers.
fn admitted_with(
    gw: &Rc<Gateway>,
    host: &Mock,
    endpoint: Endpoint,
    stream: bool,
    extra: &[(&str, &str)],
) -> Exchange {
    let (path, body) = match endpoint {
        Endpoint::Responses => {
            let tools: Vec<Value> = (OFFERED.iter())
                .map(|n| json!({"type": "function", "name": n, "parameters": {}}))
                .collect();
            let body = json!({"model": "tiny", "input": "call them", "tools": tools,
                              "stream": stream});
            ("/v1/responses", body)
        }
        Endpoint::Messages => {
            let tools: Vec<Value> = (OFFERED.iter())
                .map(|n| json!({"name": n, "input_schema": {}}))
                .collect();
            let body = json!({"model": "tiny", "max_tokens": 50, "tools": tools,
                "messages": [{"role": "user", "content": "call them"}], "stream": stream});
            ("/v1/messages", body)
        }
        _ => {
            let tools: Vec<Value> = (OFFERED.iter())
                .map(|n| json!({"type": "function", "function": {"name": n}}))
                .collect();
            let mut body = json!({"model": "tiny", "tools": tools, "stream": stream,
                "messages": [{"role": "user", "content": "call them"}]});
            if stream {
                body["stream_options"] = json!({"include_usage": true});
            }
            ("/v1/chat/completions", body)
        }
    };
    let mut x = Exchange::new(Rc::clone(gw));
    assert_eq!(
        headers_arrive_with(&mut x, host, path, Some(KEY), extra),
        Action::Continue
    );
    let body = body.to_string().into_bytes();
    let size = body.len();
    *host.request_body.borrow_mut() = body;
    assert_eq!(x.on_body(host, size, true), Action::Continue);
    assert!(host.reply.borrow().is_none(), "{:?}", host.replied());
    let sent: Value = serde_json::from_slice(&host.request_body.borrow()).unwrap();
    if super::tenant(gw).tools.rule("shell_rm") == ToolRule::Blocked {
        assert!(!sent.to_string().contains("shell_rm"), "removed: {sent}");
    }
    x
}

fn event(data: Value) -> String {
    format!("data: {data}\n\n")
}

/// A chat stream: text, then each call (id, name, arguments) with its name in one delta and
/// its arguments over two, the finish, the usage and `[DONE]`.
fn chat_stream(calls: &[(&str, &str, &str)]) -> String {
    let chunk = |delta: Value, finish: Value| {
        event(
            json!({"id": "c", "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}),
        )
    };
    let mut s = chunk(
        json!({"role": "assistant", "content": "Let me see."}),
        Value::Null,
    );
    for (i, (id, name, arguments)) in calls.iter().enumerate() {
        let call = |f: Value| json!({"tool_calls": [{"index": i, "id": id, "function": f}]});
        s += &chunk(call(json!({"name": name})), Value::Null);
        let (a, b) = arguments.split_at(arguments.len() / 2);
        s += &chunk(call(json!({"arguments": a})), Value::Null);
        s += &chunk(call(json!({"arguments": b})), Value::Null);
    }
    s += &chunk(json!({}), json!("tool_calls"));
    s += &event(json!({"id": "c", "choices": [],
        "usage": {"prompt_tokens": 30, "completion_tokens": 17, "total_tokens": 47}}));
    s + "data: [DONE]\n\n"
}

/// The stream through the exchange in two chunks cut at `cut`: what the client got.
fn streamed(x: &mut Exchange, host: &Mock, stream: &str, cut: usize) -> String {
    answer_headers(
        x,
        host,
        &[(":status", "200"), ("content-type", "text/event-stream")],
    );
    let mut got = Vec::new();
    let (a, b) = stream.as_bytes().split_at(cut);
    for (chunk, end) in [(a, false), (b, true)] {
        *host.response_body.borrow_mut() = chunk.to_vec();
        assert_eq!(x.on_response_body(host, chunk.len(), end), Action::Continue);
        got.extend(host.response_body.borrow().iter());
    }
    String::from_utf8(got).unwrap()
}

/// A configured host and a request to `endpoint` admitted on it (see [`admitted`]).
fn fresh(endpoint: Endpoint, stream: bool) -> (Mock, Exchange) {
    let gw = gateway();
    let host = Mock::new(None);
    configured(&gw, &host);
    let x = admitted(&gw, &host, endpoint, stream);
    (host, x)
}

/// The answer's headers arrive: `headers`; the exchange lets them go on.
fn answer_headers(x: &mut Exchange, host: &Mock, headers: &[(&str, &str)]) {
    *host.response_headers.borrow_mut() = pairs(headers);
    assert_eq!(x.on_response_headers(host, false), Action::Continue);
}

/// One stream through a fresh exchange: what the client got, and the tokens settled.
fn through(endpoint: Endpoint, stream: &str, cut: usize) -> (String, i64, Mock) {
    let (host, mut x) = fresh(endpoint, true);
    let got = streamed(&mut x, &host, stream, cut);
    x.on_log(&host);
    let out = host.metric(telemetry::TOKENS_OUT);
    (got, out, host)
}

/// The error object of the stream's error event.
fn error_of(endpoint: Endpoint, got: &str) -> Value {
    let data = (got.split("\n\n"))
        .filter_map(|e| e.lines().find_map(|l| l.strip_prefix("data: ")))
        .filter_map(|d| serde_json::from_str::<Value>(d).ok())
        .find(|d| d.get("error").is_some() || d["type"] == "error")
        .unwrap_or_else(|| panic!("no error event in {got}"));
    match endpoint {
        Endpoint::Responses => data,
        _ => data["error"].clone(),
    }
}

/// The attempt id the exchange vouched for (the approval id's seed).
fn attempt(host: &Mock) -> String {
    host.header(Side::Request, "x-weir-request-id").unwrap()
}

#[test]
fn allowed_calls_pass_byte_identical_at_every_cut() {
    let stream = chat_stream(&[("call_1", "search", r#"{"q":"rain"}"#)]);
    for cut in 1..stream.len() {
        let (got, out, _) = through(Endpoint::ChatCompletions, &stream, cut);
        assert_eq!(got, stream, "cut {cut}");
        assert_eq!(out, 17);
    }
}

#[test]
fn a_blocked_call_is_withheld_at_every_cut_and_usage_equals_the_unfiltered_meter() {
    let stream = chat_stream(&[
        ("call_1", "search", r#"{"q":"rain"}"#),
        ("call_2", "shell_rm", r#"{"path":"/"}"#),
    ]);
    let mut unfiltered = StreamMeter::new(Endpoint::ChatCompletions, false);
    unfiltered.feed(stream.as_bytes(), true);
    let billed = unfiltered.usage().unwrap().completion_tokens as i64;
    let mut first = None;
    for cut in 1..stream.len() {
        let (got, out, _) = through(Endpoint::ChatCompletions, &stream, cut);
        assert_eq!(out, billed, "every token billed");
        assert!(
            !got.contains(r#""name":"shell_rm""#),
            "the call never reaches the client: {got}"
        );
        assert!(
            got.contains("\"search\""),
            "the allowed call before it does"
        );
        assert!(got.ends_with("data: [DONE]\n\n"));
        let error = error_of(Endpoint::ChatCompletions, &got);
        assert_eq!(error["code"], "tool_blocked");
        assert_eq!(error["tool"], "shell_rm");
        assert_eq!(error["policy"], "blocked");
        assert_eq!(
            *first.get_or_insert(got.clone()),
            got,
            "decided the same at cut {cut}"
        );
    }
}

#[test]
fn a_hallucinated_name_is_blocked_as_not_offered() {
    let stream = chat_stream(&[("call_1", "lookup", r#"{"q":"x"}"#)]);
    let (got, _, _) = through(Endpoint::ChatCompletions, &stream, 10);
    let error = error_of(Endpoint::ChatCompletions, &got);
    assert_eq!(error["policy"], "not_offered", "{got}");
    assert!(!got.contains(r#""name":"lookup""#));
}

/// A chat stream calling one tool whose name comes in two deltas (the simulator's
/// `split-tool-name` fault), then its arguments.
fn split_name_stream(head: &str, tail: &str) -> String {
    let call = |f: Value| {
        event(
            json!({"id": "c", "choices": [{"index": 0, "delta": {"tool_calls": [
            {"index": 0, "id": "call_1", "function": f}]}, "finish_reason": null}]}),
        )
    };
    let done = chat_stream(&[]);
    let (text, rest) = done.split_at(done.find("\n\n").unwrap() + 2);
    [
        text.to_owned(),
        call(json!({"name": head})),
        call(json!({"name": tail})),
        call(json!({"arguments": "{}"})),
        rest.to_owned(),
    ]
    .concat()
}

#[test]
fn a_name_split_over_deltas_is_judged_whole_at_every_cut() {
    // `sea` + `rch` is allowed; `shell_` + `rm` is blocked though neither piece is.
    for (head, tail, blocked) in [("sea", "rch", false), ("shell_", "rm", true)] {
        let stream = split_name_stream(head, tail);
        for cut in 1..stream.len() {
            let (got, _, _) = through(Endpoint::ChatCompletions, &stream, cut);
            if blocked {
                assert_eq!(
                    error_of(Endpoint::ChatCompletions, &got)["tool"],
                    "shell_rm"
                );
                assert!(!got.contains(r#""name":"shell_""#), "{got}");
            } else {
                assert_eq!(got, stream, "cut {cut}");
            }
        }
    }
}

#[test]
fn held_bytes_are_bounded() {
    // A name that never becomes final: a piece at a time, past the bound.
    let piece = event(
        json!({"id": "c", "choices": [{"index": 0, "delta": {"tool_calls": [
        {"index": 0, "function": {"name": "x".repeat(1000)}}]}, "finish_reason": null}]}),
    );
    let stream = piece.repeat(MAX_HELD_BYTES / piece.len() + 2) + "data: [DONE]\n\n";
    let (got, _, _) = through(Endpoint::ChatCompletions, &stream, piece.len());
    assert!(
        got.len() < 1024,
        "nothing held was released: {}",
        &got[..300]
    );
    assert_eq!(
        error_of(Endpoint::ChatCompletions, &got)["code"],
        "tool_call_too_large"
    );
}

/// A Responses stream calling `name` with `arguments`.
fn responses_stream(name: &str, arguments: &str) -> String {
    let e = |data: Value| {
        format!(
            "event: {}\ndata: {data}\n\n",
            data["type"].as_str().unwrap()
        )
    };
    let item = |status: &str, args: &str| {
        json!({"type": "function_call", "id": "fc_1", "call_id": "call_9", "name": name,
               "arguments": args, "status": status})
    };
    [
        e(json!({"type": "response.created", "response": {"id": "r", "output": []}})),
        e(
            json!({"type": "response.output_item.added", "output_index": 0,
                 "item": item("in_progress", "")}),
        ),
        e(
            json!({"type": "response.function_call_arguments.delta", "output_index": 0,
                 "delta": arguments}),
        ),
        e(
            json!({"type": "response.output_item.done", "output_index": 0,
                 "item": item("completed", arguments)}),
        ),
        e(json!({"type": "response.completed", "response": {"id": "r",
                 "usage": {"input_tokens": 30, "output_tokens": 9}}})),
    ]
    .concat()
}

/// A Messages stream calling `name` with `arguments`.
fn messages_stream(name: &str, arguments: &str) -> String {
    let e = |data: Value| {
        format!(
            "event: {}\ndata: {data}\n\n",
            data["type"].as_str().unwrap()
        )
    };
    [
        e(
            json!({"type": "message_start", "message": {"id": "m", "content": [],
                 "usage": {"input_tokens": 30, "output_tokens": 1}}}),
        ),
        e(
            json!({"type": "content_block_start", "index": 0, "content_block":
                 {"type": "tool_use", "id": "toolu_9", "name": name, "input": {}}}),
        ),
        e(json!({"type": "content_block_delta", "index": 0,
                 "delta": {"type": "input_json_delta", "partial_json": arguments}})),
        e(json!({"type": "content_block_stop", "index": 0})),
        e(
            json!({"type": "message_delta", "delta": {"stop_reason": "tool_use"},
                 "usage": {"output_tokens": 9}}),
        ),
        e(json!({"type": "message_stop"})),
    ]
    .concat()
}

#[test]
fn an_approval_call_is_withheld_with_its_id_tool_and_digest_in_each_api() {
    let arguments = r#"{"env":"prod"}"#;
    let cases = [
        (
            Endpoint::ChatCompletions,
            chat_stream(&[("call_9", "deploy", arguments)]),
            "call_9",
        ),
        (
            Endpoint::Responses,
            responses_stream("deploy", arguments),
            "call_9",
        ),
        (
            Endpoint::Messages,
            messages_stream("deploy", arguments),
            "toolu_9",
        ),
    ];
    for (endpoint, stream, call_id) in cases {
        for cut in [1, stream.len() / 3, stream.len() - 1] {
            let (got, out, host) = through(endpoint, &stream, cut);
            assert!(
                !got.contains("prod"),
                "{endpoint:?}: the call is withheld: {got}"
            );
            let error = error_of(endpoint, &got);
            assert_eq!(error["code"], "approval_required", "{endpoint:?}: {got}");
            assert_eq!(error["tool"], "deploy");
            assert_eq!(
                error["approval_id"],
                approval_id(&attempt(&host), 0, call_id),
                "{endpoint:?}"
            );
            assert_eq!(error["arguments_sha256"], arguments_sha256(arguments));
            assert!(out > 0, "billed");
        }
    }
}

#[test]
fn an_approved_call_the_sidecar_delivers_passes() {
    let stream = chat_stream(&[("call_9", "deploy", r#"{"env":"prod"}"#)]);
    let gw = gateway();
    let host = Mock::new(None);
    configured(&gw, &host);
    let resend = [("weir-approval-id", "apr_x")];
    let mut x = admitted_with(&gw, &host, Endpoint::ChatCompletions, true, &resend);
    let delivered = ("weir-approval", "delivered");
    assert_eq!(streamed_marked(&mut x, &host, &stream, delivered), stream);
}

/// A whole chat answer calling `name`.
fn chat_body(name: &str) -> String {
    json!({"id": "c", "object": "chat.completion", "choices": [{"index": 0, "message": {
        "role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function",
        "function": {"name": name, "arguments": "{\"q\":1}"}}]}, "finish_reason": "tool_calls"}],
        "usage": {"prompt_tokens": 30, "completion_tokens": 11, "total_tokens": 41}})
    .to_string()
}

#[test]
fn a_whole_answer_is_held_and_replaced_by_the_error_when_it_makes_a_withheld_call() {
    for (name, code) in [
        ("search", None),
        ("shell_rm", Some("tool_blocked")),
        ("deploy", Some("approval_required")),
    ] {
        let (host, mut x) = fresh(Endpoint::ChatCompletions, false);
        let json = ("content-type", "application/json");
        answer_headers(
            &mut x,
            &host,
            &[(":status", "200"), json, ("content-length", "999")],
        );
        let header = |name| host.header(Side::Response, name);
        assert_eq!(header("content-length"), None, "the body may change length");
        let body = chat_body(name);
        let (a, _) = body.split_at(10);
        *host.response_body.borrow_mut() = a.as_bytes().to_vec();
        assert_eq!(x.on_response_body(&host, a.len(), false), Action::Pause);
        // Envoy buffers: the last callback sees the whole body.
        *host.response_body.borrow_mut() = body.clone().into_bytes();
        let action = x.on_response_body(&host, body.len(), true);
        assert_eq!(host.metric(telemetry::TOKENS_OUT), 11, "{name}: billed");
        assert_eq!(action, Action::Continue);
        assert!(
            host.reply.borrow().is_none(),
            "no local reply: the answer is rewritten"
        );
        let sent: Value = serde_json::from_slice(&host.response_body.borrow()).unwrap();
        match code {
            Some(code) => {
                assert_eq!(sent["error"]["code"], code, "{sent}");
                assert_eq!(sent["error"]["tool"], name, "{sent}");
                assert!(!sent.to_string().contains("tool_calls"), "{sent}");
            }
            None => assert_eq!(sent, serde_json::from_str::<Value>(&body).unwrap()),
        }
    }
}

#[test]
fn a_blocked_tool_offered_is_refused_unless_the_policy_removes_it() {
    let gw = gateway_with(json!({"tools": {"blocked": ["shell_*"]}}));
    let host = Mock::new(None);
    configured(&gw, &host);
    let mut x = Exchange::new(Rc::clone(&gw));
    headers_arrive_with(&mut x, &host, "/v1/chat/completions", Some(KEY), &[]);
    let body = json!({"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
        "tools": [{"type": "function", "function": {"name": "search"}},
                  {"type": "function", "function": {"name": "shell_rm"}}]});
    let body = body.to_string().into_bytes();
    let size = body.len();
    *host.request_body.borrow_mut() = body;
    assert_eq!(x.on_body(&host, size, true), Action::Pause);
    let (status, reply) = host.replied().unwrap();
    assert_eq!(status, 403);
    assert_eq!(reply["error"]["code"], "tool_blocked");
    assert_eq!(reply["error"]["param"], "tools[1]");
    assert_eq!(reply["error"]["tool"], "shell_rm");
    let headers = host.reply.borrow().clone().unwrap().1;
    assert!(headers.contains(&("x-should-retry".into(), "false".into())));
}

/// The tool policy of [`gateway`].
fn tool_policy() -> Value {
    json!({"blocked": ["shell_*"], "classes": {"deploy": "approval"},
           "on_blocked_offered": "remove"})
}

/// The run table the run tests' gateways hold: 64 runs a key.
fn run_table() -> weir_core::run::RunTable {
    weir_core::run::RunTable::new(64, 60_000)
}

/// A request in run `r1` of a key with `tools` (a policy, or null for none) whose runs may
/// make `tool_calls` calls (its request carrying `extra` headers), admitted.
fn in_a_run(tools: Value, tool_calls: u64, extra: &[(&str, &str)]) -> (Mock, Exchange) {
    let mut policy = json!({"runs": {"budgets": {"tool_calls": tool_calls}}});
    if !tools.is_null() {
        policy["tools"] = tools;
    }
    let gw = gateway_with(policy);
    let host = Mock::new(None);
    configured(&gw, &host);
    let tenant = super::tenant(&gw);
    weir_core::run::create(&host.store, [tenant.as_ref()], run_table());
    let x = admitted_in_run(&gw, &host, extra, 7);
    (host, x)
}

/// Another call of run `r1` (its call lease `call_id`), admitted on `gw`'s host.
fn admitted_in_run(
    gw: &Rc<Gateway>,
    host: &Mock,
    extra: &[(&str, &str)],
    call_id: u64,
) -> Exchange {
    use weir_core::reservation::SlotLease;
    use weir_core::run::{self, Counts, RunDemand, RunKey};

    let tenant = super::tenant(gw);
    let key = RunKey::new(tenant.path(), None, "r1").unwrap();
    let demand = RunDemand {
        counts: Counts {
            model_calls: 1,
            ..Counts::default()
        },
        call: SlotLease {
            id: call_id,
            ttl_ms: 30_000,
        },
    };
    let hold = run::reserve(&host.store, &tenant, &run_table(), &key, demand, 1_000_000).unwrap();
    let mut x = admitted_with(gw, host, Endpoint::ChatCompletions, true, extra);
    x.run = Some(hold);
    x
}

/// `stream` through `x` whole, as a 200 event stream whose headers also carry `marker`: what
/// the client got.
fn streamed_marked(x: &mut Exchange, host: &Mock, stream: &str, marker: (&str, &str)) -> String {
    let headers = [
        (":status", "200"),
        ("content-type", "text/event-stream"),
        marker,
    ];
    answer_headers(x, host, &headers);
    *host.response_body.borrow_mut() = stream.as_bytes().to_vec();
    x.on_response_body(host, stream.len(), true);
    String::from_utf8(host.response_body.borrow().clone()).unwrap()
}

#[test]
fn a_call_past_the_run_s_tool_budget_is_withheld_naming_the_budget() {
    // With a tool policy, and without one (the answers are read for the budget alone).
    for tools in [tool_policy(), Value::Null] {
        let (host, mut x) = in_a_run(tools, 1, &[]);
        let stream = chat_stream(&[
            ("call_1", "search", r#"{"q":"a"}"#),
            ("call_2", "search", r#"{"q":"b"}"#),
        ]);
        let got = streamed(&mut x, &host, &stream, 40);
        assert!(got.contains("call_1") && !got.contains("call_2"), "{got}");
        let error = error_of(Endpoint::ChatCompletions, &got);
        assert_eq!(error["code"], "run_budget_exceeded", "{got}");
        assert_eq!(error["budget"], "tool_calls");
        assert_eq!(error["limit"], 1);
        assert_eq!(error["used"], 1);
        assert_eq!(error["run_id"], "r1");
    }
}
