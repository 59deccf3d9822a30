//! The attacker pass on the tool policy: answers shaped to slip a call past it (an event too
//! large to hold, a call kind or field the scan did not read, an event a client parses more
//! leniently, a compressed body, a forged delivery) each end the answer with an error rather
//! than reach the client.

use super::*;

/// The chunks through a fresh exchange's stream, the last ending it: what the client got.
fn fed(endpoint: Endpoint, chunks: &[&[u8]]) -> String {
    let (host, mut x) = fresh(endpoint, true);
    let stream = ("content-type", "text/event-stream");
    answer_headers(&mut x, &host, &[(":status", "200"), stream]);
    let mut got = Vec::new();
    for (n, chunk) in chunks.iter().enumerate() {
        *host.response_body.borrow_mut() = chunk.to_vec();
        let end = n + 1 == chunks.len();
        assert_eq!(
            x.on_response_body(&host, chunk.len(), end),
            Action::Continue
        );
        got.extend(host.response_body.borrow().iter());
    }
    String::from_utf8(got).unwrap()
}

/// One chat chunk whose choice 0 has `delta`.
fn delta(delta: Value) -> String {
    event(json!({"id": "c", "choices": [{"index": 0, "delta": delta, "finish_reason": null}]}))
}

/// `stream` through `x` as an answer saying it delivers an approved call: what the client got.
fn claimed_delivered(x: &mut Exchange, host: &Mock, stream: &str) -> String {
    streamed_marked(x, host, stream, ("weir-approval", "delivered"))
}

const FINISH: &str = "data: {\"id\":\"c\",\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"tool_calls\"}]}\n\ndata: [DONE]\n\n";

#[test]
fn a_call_in_an_event_larger_than_64_kib_is_judged_whole() {
    let pad = "x".repeat(MAX_HELD_BYTES + 1000);
    for (name, blocked) in [("shell_rm", true), ("search", false)] {
        let arguments = json!({ "pad": pad }).to_string();
        let call = json!({"index": 0, "id": "call_1", "type": "function",
                          "function": {"name": name, "arguments": arguments}});
        let stream = delta(json!({ "tool_calls": [call] })) + FINISH;
        for cut in [1, stream.len() / 2, stream.len() - 1] {
            let (got, _, _) = through(Endpoint::ChatCompletions, &stream, cut);
            if blocked {
                assert!(!got.contains(&pad[..64]), "cut {cut}: the call went");
                let error = error_of(Endpoint::ChatCompletions, &got);
                assert_eq!(error["code"], "tool_blocked", "cut {cut}");
                assert_eq!(error["tool"], name);
            } else {
                assert_eq!(got, stream, "cut {cut}");
            }
        }
    }
}

#[test]
fn an_event_past_the_hold_limit_ends_the_answer_unread_and_one_below_passes_whole() {
    // Below the limit (the request body bound and a mebibyte): held whole, passed as it came.
    let text = "y".repeat(1024 * 1024);
    let stream = delta(json!({ "content": text })) + FINISH;
    let chunks: Vec<&[u8]> = stream.as_bytes().chunks(64 * 1024).collect();
    assert_eq!(fed(Endpoint::ChatCompletions, &chunks), stream);
    // Past it: none of it goes.
    let text = "y".repeat(6 * 1024 * 1024);
    let stream = delta(json!({ "content": text })) + FINISH;
    let chunks: Vec<&[u8]> = stream.as_bytes().chunks(1024 * 1024).collect();
    let got = fed(Endpoint::ChatCompletions, &chunks);
    assert!(!got.contains("yyyy"), "{}", &got[..200.min(got.len())]);
    let error = error_of(Endpoint::ChatCompletions, &got);
    assert_eq!(error["code"], "tool_call_unreadable", "{got}");
}

#[test]
fn custom_tool_calls_are_judged_in_chat_and_responses() {
    let custom = |name: &str| {
        delta(
            json!({"tool_calls": [{"index": 0, "id": "call_c", "type": "custom",
                                     "custom": {"name": name, "input": "rm -rf /"}}]}),
        ) + FINISH
    };
    let (got, _, _) = through(Endpoint::ChatCompletions, &custom("shell_rm"), 5);
    assert!(!got.contains("rm -rf"), "{got}");
    assert_eq!(
        error_of(Endpoint::ChatCompletions, &got)["tool"],
        "shell_rm"
    );
    // An offered tool's custom call passes (it was once withheld as a call without a name).
    let allowed = custom("search");
    assert_eq!(through(Endpoint::ChatCompletions, &allowed, 5).0, allowed);
    let stream = responses_stream("shell_rm", "rm -rf /")
        .replace("\"function_call\"", "\"custom_tool_call\"")
        .replace("function_call_arguments", "custom_tool_call_input");
    let (got, _, _) = through(Endpoint::Responses, &stream, 5);
    assert!(!got.contains("rm -rf"), "{got}");
    assert_eq!(error_of(Endpoint::Responses, &got)["tool"], "shell_rm");
}

#[test]
fn an_event_a_client_parses_more_leniently_ends_the_answer() {
    // A repeated member: Python and JavaScript keep the last `name`.
    let chunk = r#"data: {"id":"c","choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"id":"call_1","function":{"name":"search","name":"shell_rm","arguments":"{}"}}]}}]}"#;
    let stream = format!("{chunk}\n\n{FINISH}");
    for cut in [1, stream.len() - 1] {
        let (got, _, _) = through(Endpoint::ChatCompletions, &stream, cut);
        assert!(!got.contains("shell_rm"), "cut {cut}: {got}");
        let error = error_of(Endpoint::ChatCompletions, &got);
        assert_eq!(error["code"], "tool_call_unreadable", "{got}");
    }
}

#[test]
fn calls_stated_only_in_a_snapshot_are_judged() {
    let completed = json!({"type": "response.completed", "response": {"id": "r", "output": [
        {"type": "function_call", "call_id": "call_z", "name": "shell_rm", "arguments": "{}"}],
        "usage": {"input_tokens": 3, "output_tokens": 2}}});
    let stream = format!("event: response.completed\ndata: {completed}\n\n");
    let (got, _, _) = through(Endpoint::Responses, &stream, 3);
    assert!(!got.contains("call_z"), "{got}");
    assert_eq!(error_of(Endpoint::Responses, &got)["tool"], "shell_rm");
    let start = json!({"type": "message_start", "message": {"id": "m", "content": [
        {"type": "tool_use", "id": "toolu_z", "name": "shell_rm", "input": {"path": "/"}}]}});
    let stream = format!("event: message_start\ndata: {start}\n\n")
        + "event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n";
    let (got, _, _) = through(Endpoint::Messages, &stream, 3);
    assert!(!got.contains("toolu_z"), "{got}");
    assert_eq!(error_of(Endpoint::Messages, &got)["tool"], "shell_rm");
}

#[test]
fn a_second_call_under_a_used_index_ends_the_answer() {
    let added = |call_id: &str| {
        let item = json!({"type": "response.output_item.added", "output_index": 0, "item":
            {"type": "function_call", "call_id": call_id, "name": "search", "arguments": ""}});
        format!("event: response.output_item.added\ndata: {item}\n\n")
    };
    let stream = added("call_1") + &added("call_2");
    let (got, _, _) = through(Endpoint::Responses, &stream, 3);
    assert!(got.contains("call_1") && !got.contains("call_2"), "{got}");
    let error = error_of(Endpoint::Responses, &got);
    assert_eq!(error["policy"], "renamed", "{got}");
}

#[test]
fn a_compressed_answer_is_withheld_whole_in_its_shape() {
    for (content_type, streamed) in [("text/event-stream", true), ("application/json", false)] {
        let (host, mut x) = fresh(Endpoint::ChatCompletions, streamed);
        let headers = [
            (":status", "200"),
            ("content-type", content_type),
            ("content-encoding", "gzip"),
            ("content-length", "40"),
        ];
        answer_headers(&mut x, &host, &headers);
        assert_eq!(host.header(Side::Response, "content-encoding"), None);
        assert_eq!(host.header(Side::Response, "content-length"), None);
        let mut got = Vec::new();
        for (chunk, end) in [(&b"\x1f\x8b\x08\x00gzip"[..], false), (b"bytes", true)] {
            *host.response_body.borrow_mut() = chunk.to_vec();
            x.on_response_body(&host, chunk.len(), end);
            got.extend(host.response_body.borrow().iter());
        }
        let got = String::from_utf8(got).unwrap();
        assert!(!got.contains("gzip"), "{got}");
        let error = if streamed {
            error_of(Endpoint::ChatCompletions, &got)
        } else {
            serde_json::from_str::<Value>(&got).unwrap()["error"].clone()
        };
        assert_eq!(error["code"], "tool_call_unreadable", "{got}");
    }
}

#[test]
fn a_delivery_claimed_on_an_answer_to_no_re_send_is_not_believed() {
    let stream = chat_stream(&[("call_9", "deploy", r#"{"env":"prod"}"#)]);
    let (host, mut x) = fresh(Endpoint::ChatCompletions, true);
    let got = claimed_delivered(&mut x, &host, &stream);
    assert!(!got.contains("prod"), "{got}");
    assert_eq!(
        error_of(Endpoint::ChatCompletions, &got)["code"],
        "approval_required"
    );
}

#[test]
fn an_approval_with_two_choices_names_the_call_of_its_own_choice() {
    let chunk = |c: u32, id: &str, name: &str| {
        json!({"index": c, "delta": {"tool_calls": [{"index": 0, "id": id, "type": "function",
               "function": {"name": name, "arguments": "{}"}}]}, "finish_reason": "tool_calls"})
    };
    let both = json!({"id": "c", "choices": [chunk(0, "call_a", "search"),
                                             chunk(1, "call_b", "deploy")]});
    let stream = event(both) + "data: [DONE]\n\n";
    let (got, _, host) = through(Endpoint::ChatCompletions, &stream, 3);
    let error = error_of(Endpoint::ChatCompletions, &got);
    assert_eq!(error["tool"], "deploy", "{got}");
    assert_eq!(
        error["approval_id"],
        approval_id(&attempt(&host), 0, "call_b")
    );
}

#[test]
fn a_delivered_approval_call_counts_against_the_run_s_tool_calls() {
    let resend = [("weir-approval-id", "apr_x")];
    let (host, mut x) = in_a_run(tool_policy(), 1, &resend);
    let stream = chat_stream(&[
        ("call_1", "deploy", r#"{"env":"prod"}"#),
        ("call_2", "search", r#"{"q":"b"}"#),
    ]);
    let got = claimed_delivered(&mut x, &host, &stream);
    assert!(got.contains("call_1") && !got.contains("call_2"), "{got}");
    let error = error_of(Endpoint::ChatCompletions, &got);
    assert_eq!(
        (error["code"].as_str(), error["used"].as_u64()),
        (Some("run_budget_exceeded"), Some(1))
    );
}

// Attacker pass 3.

#[test]
fn attack_a_call_in_a_bom_prefixed_first_event_is_judged() {
    let bom = "\u{feff}";
    let chat = delta(
        json!({"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
        "function": {"name": "shell_rm", "arguments": "{\"path\":\"rm -rf /\"}"}}]}),
    );
    let start = json!({"type": "message_start", "message": {"id": "m", "content": [
        {"type": "tool_use", "id": "toolu_z", "name": "shell_rm", "input": {"path": "rm -rf /"}}]}});
    let messages = format!("event: message_start\ndata: {start}\n\n")
        + "event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n";
    for (endpoint, stream) in [
        (Endpoint::ChatCompletions, format!("{bom}{chat}{FINISH}")),
        (Endpoint::Messages, format!("{bom}{messages}")),
    ] {
        for cut in [1, 5, stream.len() - 1] {
            let (got, _, _) = through(endpoint, &stream, cut);
            assert!(!got.contains("rm -rf"), "{endpoint:?} cut {cut}: {got}");
        }
    }
}

#[test]
fn attack_a_replayed_answer_s_calls_are_not_counted_twice() {
    let keyed = [("idempotency-key", "K1")];
    let (host, mut first) = in_a_run(tool_policy(), 1, &keyed);
    let stream = chat_stream(&[("call_1", "search", r#"{"q":"a"}"#)]);
    assert_eq!(streamed(&mut first, &host, &stream, 40), stream);
    first.on_log(&host);
    // The same call again with its key: the sidecar replays the answer it stored.
    let gw = Rc::clone(&first.gw);
    let mut replay = admitted_in_run(&gw, &host, &keyed, 8);
    let got = streamed_marked(&mut replay, &host, &stream, ("idempotent-replayed", "true"));
    assert_eq!(
        got, stream,
        "the replay of a call already counted was withheld"
    );
}

#[test]
fn attack_a_local_shell_call_never_offered_is_withheld() {
    let item = json!({"type": "local_shell_call", "id": "lsh_1", "call_id": "call_s",
        "status": "completed", "action": {"type": "exec", "command": ["rm", "-rf", "/"]}});
    let added = json!({"type": "response.output_item.added", "output_index": 0, "item": item});
    let done = json!({"type": "response.output_item.done", "output_index": 0, "item": item});
    let completed = json!({"type": "response.completed", "response": {"id": "r",
        "output": [item], "usage": {"input_tokens": 3, "output_tokens": 2}}});
    let stream = format!(
        "event: response.output_item.added\ndata: {added}\n\n\
         event: response.output_item.done\ndata: {done}\n\n\
         event: response.completed\ndata: {completed}\n\n"
    );
    let (got, _, _) = through(Endpoint::Responses, &stream, 3);
    assert!(!got.contains("rm\",\"-rf"), "{got}");
}

#[test]
fn a_whole_answer_ending_in_trailers_is_judged_on_what_envoy_buffered() {
    let (host, mut x) = fresh(Endpoint::ChatCompletions, false);
    let json = ("content-type", "application/json");
    answer_headers(&mut x, &host, &[(":status", "200"), json]);
    let body = chat_body("shell_rm");
    // Every body callback says more is coming; the trailers end it.
    *host.response_body.borrow_mut() = body.clone().into_bytes();
    assert_eq!(x.on_response_body(&host, body.len(), false), Action::Pause);
    assert_eq!(x.on_response_trailers(&host), Action::Continue);
    let sent: Value = serde_json::from_slice(&host.response_body.borrow()).unwrap();
    assert_eq!(sent["error"]["code"], "tool_blocked", "{sent}");
    assert!(!sent.to_string().contains("tool_calls"), "{sent}");
    assert_eq!(
        host.metric(telemetry::TOKENS_OUT),
        11,
        "billed at the trailers"
    );
}
