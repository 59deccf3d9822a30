use super::*;
use crate::endpoint::Endpoint;
use crate::sse::event_end;

/// A chat stream: text, then `get_weather` with its name over two deltas (the simulator's
/// `split-tool-name` fault), its arguments over two, then a second call (index 1), the
/// finish reason, the usage chunk and `[DONE]`.
const CHAT_SPLIT_NAME: &str = concat!(
    "data: {\"id\":\"c1\",\"object\":\"chat.completion.chunk\",\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"Let me look.\"},\"finish_reason\":null}]}\n\n",
    "data: {\"id\":\"c1\",\"choices\":[{\"index\":0,\"delta\":{\"tool_calls\":[{\"index\":0,\"id\":\"call_a\",\"type\":\"function\",\"function\":{\"name\":\"get_w\"}}]},\"finish_reason\":null}]}\n\n",
    "data: {\"id\":\"c1\",\"choices\":[{\"index\":0,\"delta\":{\"tool_calls\":[{\"index\":0,\"function\":{\"name\":\"eather\"}}]},\"finish_reason\":null}]}\n\n",
    "data: {\"id\":\"c1\",\"choices\":[{\"index\":0,\"delta\":{\"tool_calls\":[{\"index\":0,\"function\":{\"arguments\":\"{\\\"city\\\":\"}}]},\"finish_reason\":null}]}\n\n",
    "data: {\"id\":\"c1\",\"choices\":[{\"index\":0,\"delta\":{\"tool_calls\":[{\"index\":0,\"function\":{\"arguments\":\"\\\"Oslo\\\"}\"}}]},\"finish_reason\":null}]}\n\n",
    "data: {\"id\":\"c1\",\"choices\":[{\"index\":0,\"delta\":{\"tool_calls\":[{\"index\":1,\"id\":\"call_b\",\"type\":\"function\",\"function\":{\"name\":\"search\",\"arguments\":\"\"}}]},\"finish_reason\":null}]}\n\n",
    "data: {\"id\":\"c1\",\"choices\":[{\"index\":0,\"delta\":{\"tool_calls\":[{\"index\":1,\"function\":{\"arguments\":\"{\\\"q\\\":\\\"rain\\\"}\"}}]},\"finish_reason\":null}]}\n\n",
    "data: {\"id\":\"c1\",\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"tool_calls\"}]}\n\n",
    "data: {\"id\":\"c1\",\"choices\":[],\"usage\":{\"prompt_tokens\":20,\"completion_tokens\":12}}\n\n",
    "data: [DONE]\n\n",
);

/// A Responses stream: a message item, then two `function_call` items.
const RESPONSES_CALLS: &str = concat!(
    "event: response.created\ndata: {\"type\":\"response.created\",\"response\":{\"id\":\"resp_1\",\"status\":\"in_progress\",\"output\":[]}}\n\n",
    "event: response.output_item.added\ndata: {\"type\":\"response.output_item.added\",\"output_index\":0,\"item\":{\"type\":\"message\",\"id\":\"msg_1\",\"role\":\"assistant\",\"content\":[]}}\n\n",
    "event: response.output_text.delta\ndata: {\"type\":\"response.output_text.delta\",\"output_index\":0,\"content_index\":0,\"delta\":\"Let me look.\"}\n\n",
    "event: response.output_item.done\ndata: {\"type\":\"response.output_item.done\",\"output_index\":0,\"item\":{\"type\":\"message\",\"id\":\"msg_1\",\"role\":\"assistant\",\"content\":[]}}\n\n",
    "event: response.output_item.added\ndata: {\"type\":\"response.output_item.added\",\"output_index\":1,\"item\":{\"type\":\"function_call\",\"id\":\"fc_1\",\"call_id\":\"call_a\",\"name\":\"get_weather\",\"arguments\":\"\",\"status\":\"in_progress\"}}\n\n",
    "event: response.function_call_arguments.delta\ndata: {\"type\":\"response.function_call_arguments.delta\",\"output_index\":1,\"item_id\":\"fc_1\",\"delta\":\"{\\\"city\\\":\"}\n\n",
    "event: response.function_call_arguments.delta\ndata: {\"type\":\"response.function_call_arguments.delta\",\"output_index\":1,\"item_id\":\"fc_1\",\"delta\":\"\\\"Oslo\\\"}\"}\n\n",
    "event: response.function_call_arguments.done\ndata: {\"type\":\"response.function_call_arguments.done\",\"output_index\":1,\"item_id\":\"fc_1\",\"arguments\":\"{\\\"city\\\":\\\"Oslo\\\"}\"}\n\n",
    "event: response.output_item.done\ndata: {\"type\":\"response.output_item.done\",\"output_index\":1,\"item\":{\"type\":\"function_call\",\"id\":\"fc_1\",\"call_id\":\"call_a\",\"name\":\"get_weather\",\"arguments\":\"{\\\"city\\\":\\\"Oslo\\\"}\",\"status\":\"completed\"}}\n\n",
    "event: response.output_item.added\ndata: {\"type\":\"response.output_item.added\",\"output_index\":2,\"item\":{\"type\":\"function_call\",\"id\":\"fc_2\",\"call_id\":\"call_b\",\"name\":\"search\",\"arguments\":\"\",\"status\":\"in_progress\"}}\n\n",
    "event: response.function_call_arguments.delta\ndata: {\"type\":\"response.function_call_arguments.delta\",\"output_index\":2,\"item_id\":\"fc_2\",\"delta\":\"{\\\"q\\\":\\\"rain\\\"}\"}\n\n",
    "event: response.output_item.done\ndata: {\"type\":\"response.output_item.done\",\"output_index\":2,\"item\":{\"type\":\"function_call\",\"id\":\"fc_2\",\"call_id\":\"call_b\",\"name\":\"search\",\"arguments\":\"{\\\"q\\\":\\\"rain\\\"}\",\"status\":\"completed\"}}\n\n",
    "event: response.completed\ndata: {\"type\":\"response.completed\",\"response\":{\"id\":\"resp_1\",\"status\":\"completed\",\"usage\":{\"input_tokens\":20,\"output_tokens\":12}}}\n\n",
);

/// A Messages stream: a text block, then two `tool_use` blocks.
const MESSAGES_CALLS: &str = concat!(
    "event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"id\":\"msg_1\",\"type\":\"message\",\"role\":\"assistant\",\"content\":[],\"usage\":{\"input_tokens\":20,\"output_tokens\":1}}}\n\n",
    "event: content_block_start\ndata: {\"type\":\"content_block_start\",\"index\":0,\"content_block\":{\"type\":\"text\",\"text\":\"\"}}\n\n",
    "event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":\"Let me look.\"}}\n\n",
    "event: content_block_stop\ndata: {\"type\":\"content_block_stop\",\"index\":0}\n\n",
    "event: content_block_start\ndata: {\"type\":\"content_block_start\",\"index\":1,\"content_block\":{\"type\":\"tool_use\",\"id\":\"toolu_a\",\"name\":\"get_weather\",\"input\":{}}}\n\n",
    "event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":1,\"delta\":{\"type\":\"input_json_delta\",\"partial_json\":\"{\\\"city\\\":\"}}\n\n",
    "event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":1,\"delta\":{\"type\":\"input_json_delta\",\"partial_json\":\"\\\"Oslo\\\"}\"}}\n\n",
    "event: content_block_stop\ndata: {\"type\":\"content_block_stop\",\"index\":1}\n\n",
    "event: content_block_start\ndata: {\"type\":\"content_block_start\",\"index\":2,\"content_block\":{\"type\":\"tool_use\",\"id\":\"toolu_b\",\"name\":\"search\",\"input\":{}}}\n\n",
    "event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":2,\"delta\":{\"type\":\"input_json_delta\",\"partial_json\":\"{\\\"q\\\":\\\"rain\\\"}\"}}\n\n",
    "event: content_block_stop\ndata: {\"type\":\"content_block_stop\",\"index\":2}\n\n",
    "event: message_delta\ndata: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":\"tool_use\",\"stop_sequence\":null},\"usage\":{\"output_tokens\":12}}\n\n",
    "event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n",
);

/// The events of `stream` sent as two chunks cut at `cut`, framed as the meter frames them
/// (whole events by [`event_end`], the unended rest at the end of the stream).
fn events_in_two_chunks(stream: &[u8], cut: usize) -> Vec<Vec<u8>> {
    let mut held = Vec::new();
    let mut events = Vec::new();
    for (chunk, end) in [(&stream[..cut], false), (&stream[cut..], true)] {
        held.extend_from_slice(chunk);
        let mut at = 0;
        while let Some(len) = event_end(&held[at..]) {
            events.push(held[at..at + len].to_vec());
            at += len;
        }
        held.drain(..at);
        if end && !held.is_empty() {
            events.push(std::mem::take(&mut held));
        }
    }
    events
}

/// Every step of a scan over `events`, and the calls it saw.
fn scan(endpoint: Endpoint, events: &[Vec<u8>]) -> (Vec<ScanStep>, Vec<ToolCall>, u64) {
    let mut scan = ToolScan::new(endpoint);
    let steps = events.iter().map(|e| scan.observe(e)).collect();
    assert!(scan.finish().is_empty());
    assert!(scan.saw_done());
    assert_eq!(scan.held_bytes(), 0);
    (steps, scan.calls().to_vec(), scan.calls_made())
}

fn decided(steps: &[ScanStep]) -> Vec<(u32, String, String)> {
    steps
        .iter()
        .flat_map(|s| match s {
            ScanStep::Decide { calls, .. } => calls.clone(),
            _ => Vec::new(),
        })
        .map(|c| (c.index, c.id, c.name))
        .collect()
}

fn expected(shape: Endpoint) -> Vec<(u32, String, String)> {
    let (a, b) = match shape {
        Endpoint::ChatCompletions => (0, 1),
        _ => (1, 2),
    };
    let (id_a, id_b) = match shape {
        Endpoint::Messages => ("toolu_a", "toolu_b"),
        _ => ("call_a", "call_b"),
    };
    vec![
        (a, id_a.to_owned(), "get_weather".to_owned()),
        (b, id_b.to_owned(), "search".to_owned()),
    ]
}

fn fixtures() -> [(Endpoint, &'static str); 3] {
    [
        (Endpoint::ChatCompletions, CHAT_SPLIT_NAME),
        (Endpoint::Responses, RESPONSES_CALLS),
        (Endpoint::Messages, MESSAGES_CALLS),
    ]
}

#[test]
fn calls_in_each_api_are_decided_once_with_their_full_names_and_completed_with_their_arguments() {
    for (shape, stream) in fixtures() {
        let events = events_in_two_chunks(stream.as_bytes(), 0);
        let (steps, calls, made) = scan(shape, &events);
        assert_eq!(decided(&steps), expected(shape), "{shape:?}");
        assert_eq!(made, 2);
        let whole: Vec<_> = calls
            .iter()
            .map(|c| {
                (
                    c.name.as_str(),
                    c.arguments.as_str(),
                    c.complete,
                    c.truncated,
                )
            })
            .collect();
        assert_eq!(
            whole,
            [
                ("get_weather", "{\"city\":\"Oslo\"}", true, false),
                ("search", "{\"q\":\"rain\"}", true, false)
            ],
            "{shape:?}"
        );
    }
}

#[test]
fn a_chat_name_split_over_two_deltas_is_held_until_its_first_arguments_then_decided_once() {
    let events = events_in_two_chunks(CHAT_SPLIT_NAME.as_bytes(), 0);
    let (steps, _, _) = scan(Endpoint::ChatCompletions, &events);
    let call = |index: u32, id: &str, name: &str, arguments: &str| CallSeen {
        choice: 0,
        index,
        id: id.to_owned(),
        name: name.to_owned(),
        arguments_so_far: arguments.to_owned(),
    };
    assert_eq!(
        steps,
        [
            ScanStep::Forward,
            ScanStep::Hold,
            ScanStep::Hold,
            ScanStep::Decide {
                calls: vec![call(0, "call_a", "get_weather", "{\"city\":")],
                hold: false
            },
            ScanStep::Forward,
            // Index 1 opens with its name and empty arguments: held until more.
            ScanStep::Hold,
            ScanStep::Decide {
                calls: vec![call(1, "call_b", "search", "{\"q\":\"rain\"}")],
                hold: false
            },
            ScanStep::Forward,
            ScanStep::Forward,
            ScanStep::Forward,
        ]
    );
}

#[test]
fn parallel_chat_calls_opened_in_turn_decide_the_first_at_the_second_index() {
    let stream = concat!(
        "data: {\"choices\":[{\"index\":0,\"delta\":{\"tool_calls\":[{\"index\":0,\"id\":\"call_a\",\"function\":{\"name\":\"read_file\"}}]}}]}\n\n",
        "data: {\"choices\":[{\"index\":0,\"delta\":{\"tool_calls\":[{\"index\":1,\"id\":\"call_b\",\"function\":{\"name\":\"shell_exec\"}}]}}]}\n\n",
        "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"x\"}}]}\n\n",
        "data: {\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"tool_calls\"}]}\n\n",
        "data: [DONE]\n\n",
    );
    let events = events_in_two_chunks(stream.as_bytes(), 0);
    let (steps, calls, made) = scan(Endpoint::ChatCompletions, &events);
    let names = |s: &ScanStep| match s {
        ScanStep::Decide { calls, hold } => Some((
            calls.iter().map(|c| c.name.clone()).collect::<Vec<_>>(),
            *hold,
        )),
        _ => None,
    };
    assert_eq!(steps[0], ScanStep::Hold);
    assert_eq!(names(&steps[1]), Some((vec!["read_file".to_owned()], true)));
    assert_eq!(steps[2], ScanStep::Hold);
    assert_eq!(
        names(&steps[3]),
        Some((vec!["shell_exec".to_owned()], false))
    );
    assert_eq!(steps[4], ScanStep::Forward);
    assert_eq!(made, 2);
    assert!(calls.iter().all(|c| c.complete && c.arguments.is_empty()));
}

#[test]
fn a_call_split_at_every_byte_offset_is_decided_the_same() {
    for (shape, stream) in fixtures() {
        let whole = scan(shape, &events_in_two_chunks(stream.as_bytes(), 0));
        for cut in 0..=stream.len() {
            let events = events_in_two_chunks(stream.as_bytes(), cut);
            assert_eq!(scan(shape, &events), whole, "{shape:?} cut at {cut}");
        }
    }
}

#[test]
fn a_name_piece_after_the_decision_is_reported_as_a_rename() {
    let stream = concat!(
        "data: {\"choices\":[{\"index\":0,\"delta\":{\"tool_calls\":[{\"index\":0,\"id\":\"c\",\"function\":{\"name\":\"search\",\"arguments\":\"{\"}}]}}]}\n\n",
        "data: {\"choices\":[{\"index\":0,\"delta\":{\"tool_calls\":[{\"index\":0,\"function\":{\"name\":\"_shell\"}}]}}]}\n\n",
    );
    let mut scan = ToolScan::new(Endpoint::ChatCompletions);
    let events = events_in_two_chunks(stream.as_bytes(), 0);
    assert!(matches!(scan.observe(&events[0]), ScanStep::Decide { .. }));
    assert_eq!(scan.observe(&events[1]), ScanStep::Renamed { index: 0 });
    assert_eq!(scan.calls()[0].name, "search");
}

#[test]
fn text_only_answers_are_all_forwarded() {
    let streams = [
        (
            Endpoint::ChatCompletions,
            "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"tool_calls\"}}]}\n\ndata: {\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"stop\"}]}\n\ndata: [DONE]\n\n",
        ),
        (
            Endpoint::Responses,
            "data: {\"type\":\"response.output_text.delta\",\"output_index\":0,\"delta\":\"function_call\"}\n\ndata: {\"type\":\"response.completed\",\"response\":{}}\n\n",
        ),
        (
            Endpoint::Messages,
            "event: ping\ndata: {\"type\":\"ping\"}\n\ndata: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":\"tool_use\"}}\n\ndata: {\"type\":\"message_stop\"}\n\n",
        ),
        (
            Endpoint::Completions,
            "data: {\"choices\":[{\"text\":\"hi\"}]}\n\ndata: [DONE]\n\n",
        ),
    ];
    for (shape, stream) in streams {
        let mut scan = ToolScan::new(shape);
        for event in events_in_two_chunks(stream.as_bytes(), 0) {
            assert_eq!(scan.observe(&event), ScanStep::Forward, "{shape:?}");
        }
        assert_eq!(scan.calls_made(), 0);
    }
}

#[test]
fn held_events_past_the_bound_are_too_large_from_then_on() {
    let mut scan = ToolScan::new(Endpoint::ChatCompletions);
    let open = "data: {\"choices\":[{\"index\":0,\"delta\":{\"tool_calls\":[{\"index\":0,\"function\":{\"name\":\"a\"}}]}}]}\n\n";
    let piece = format!(
        "data: {{\"choices\":[{{\"index\":0,\"delta\":{{\"tool_calls\":[{{\"index\":0,\"function\":{{\"name\":\"{}\"}}}}]}}}}]}}\n\n",
        "n".repeat(1000)
    );
    assert_eq!(scan.observe(open.as_bytes()), ScanStep::Hold);
    let mut steps = Vec::new();
    for _ in 0..(MAX_HELD_BYTES / 1000 + 2) {
        steps.push(scan.observe(piece.as_bytes()));
    }
    assert_eq!(steps.last(), Some(&ScanStep::TooLarge));
    assert!(
        steps
            .iter()
            .all(|s| *s == ScanStep::Hold || *s == ScanStep::TooLarge)
    );
    assert!(scan.held_bytes() > MAX_HELD_BYTES);
    assert_eq!(scan.observe(b"data: [DONE]\n\n"), ScanStep::TooLarge);
}

#[test]
fn too_many_calls_are_too_large() {
    let mut scan = ToolScan::new(Endpoint::Messages);
    let mut last = ScanStep::Forward;
    for i in 0..=MAX_CALLS {
        let event = format!(
            "data: {{\"type\":\"content_block_start\",\"index\":{i},\"content_block\":{{\"type\":\"tool_use\",\"id\":\"t{i}\",\"name\":\"x\",\"input\":{{}}}}}}\n\n"
        );
        last = scan.observe(event.as_bytes());
    }
    assert_eq!(last, ScanStep::TooLarge);
    assert_eq!(scan.calls_made(), MAX_CALLS as u64);
}

#[test]
fn arguments_past_their_bound_are_truncated() {
    let mut scan = ToolScan::new(Endpoint::Messages);
    scan.observe(b"data: {\"type\":\"content_block_start\",\"index\":0,\"content_block\":{\"type\":\"tool_use\",\"id\":\"t\",\"name\":\"x\",\"input\":{}}}\n\n");
    let piece = format!(
        "data: {{\"type\":\"content_block_delta\",\"index\":0,\"delta\":{{\"type\":\"input_json_delta\",\"partial_json\":\"{}\"}}}}\n\n",
        "a".repeat(4096)
    );
    for _ in 0..=(MAX_ARGUMENT_BYTES / 4096) {
        assert_eq!(scan.observe(piece.as_bytes()), ScanStep::Forward);
    }
    let call = &scan.calls()[0];
    assert!(call.truncated);
    assert!(call.arguments.len() <= MAX_ARGUMENT_BYTES);
}

#[test]
fn a_cut_stream_decides_its_held_call_at_the_finish() {
    let mut scan = ToolScan::new(Endpoint::ChatCompletions);
    let open = "data: {\"choices\":[{\"index\":0,\"delta\":{\"tool_calls\":[{\"index\":0,\"id\":\"c\",\"function\":{\"name\":\"dep\"}}]}}]}\n\n";
    assert_eq!(scan.observe(open.as_bytes()), ScanStep::Hold);
    let decided: Vec<_> = scan.finish().into_iter().map(|c| c.name).collect();
    assert_eq!(decided, ["dep"]);
    assert!(!scan.saw_done());
    assert_eq!(scan.completed().count(), 0);
}

#[test]
fn events_not_of_the_api_s_shape_are_unreadable_and_others_pass() {
    let chat: [&[u8]; 6] = [
        b"data: {\"choices\":[{\"delta\":{\"tool_calls\":[{\"index\":\"x\"}]}}]}\n\n",
        b"data: {\"choices\":\n\n",
        b"data: \xff\xfe\n\n",
        b"data: [1,2,3]\n\n",
        b"data: null\n\n",
        // A member repeated: a client's parser keeps the last name, serde refuses it.
        b"data: {\"choices\":[{\"index\":0,\"delta\":{\"tool_calls\":[{\"index\":0,\"id\":\"c\",\"function\":{\"name\":\"search\",\"name\":\"shell_rm\",\"arguments\":\"{}\"}}]}}]}\n\n",
    ];
    let responses: [&[u8]; 3] = [
        b"data: {\"type\":\"response.output_item.added\",\"output_index\":-1}\n\n",
        b"data: {\"output_index\":0,\"item\":{\"type\":\"function_call\",\"name\":\"x\"}}\n\n",
        // A call no client can place.
        b"data: {\"type\":\"response.output_item.added\",\"item\":{\"type\":\"function_call\",\"call_id\":\"c\",\"name\":\"x\"}}\n\n",
    ];
    let messages: [&[u8]; 2] = [
        b"data: {\"type\":\"content_block_start\",\"index\":0,\"content_block\":{\"type\":\"tool_use\",\"name\":7}}\n\n",
        b"data: {\"type\":\"content_block_start\",\"content_block\":{\"type\":\"tool_use\",\"id\":\"t\",\"name\":\"x\"}}\n\n",
    ];
    for (shape, events) in [
        (Endpoint::ChatCompletions, &chat[..]),
        (Endpoint::Responses, &responses[..]),
        (Endpoint::Messages, &messages[..]),
    ] {
        for event in events {
            let mut scan = ToolScan::new(shape);
            assert_eq!(
                scan.observe(event),
                ScanStep::Unreadable,
                "{shape:?} {event:?}"
            );
            assert_eq!(scan.calls_made(), 0);
        }
    }
    // No data, or an API whose answers make no calls: nothing to read.
    for shape in Endpoint::ALL {
        let mut scan = ToolScan::new(shape);
        for event in [&b": comment\n\n"[..], b"\r\r", b"event: ping\n\n"] {
            assert_eq!(
                scan.observe(event),
                ScanStep::Forward,
                "{shape:?} {event:?}"
            );
        }
    }
    for shape in [Endpoint::Completions, Endpoint::Embeddings] {
        let mut scan = ToolScan::new(shape);
        for event in chat.iter().chain(&responses).chain(&messages) {
            assert_eq!(
                scan.observe(event),
                ScanStep::Forward,
                "{shape:?} {event:?}"
            );
        }
    }
}

/// A decided call as (choice, index, id, name).
type Decided = (u32, u32, String, String);

/// The calls a stream of `events` (each a `data:` payload) decides, and the steps it took.
fn decisions(shape: Endpoint, events: &[&str]) -> (Vec<Decided>, Vec<ScanStep>) {
    let mut scan = ToolScan::new(shape);
    let steps: Vec<ScanStep> = events
        .iter()
        .map(|e| scan.observe(format!("data: {e}\n\n").as_bytes()))
        .collect();
    let seen = steps
        .iter()
        .flat_map(|s| match s {
            ScanStep::Decide { calls, .. } => calls.clone(),
            _ => Vec::new(),
        })
        .map(|c| (c.choice, c.index, c.id, c.name))
        .collect();
    (seen, steps)
}

fn call(choice: u32, index: u32, id: &str, name: &str) -> Decided {
    (choice, index, id.to_owned(), name.to_owned())
}

#[test]
fn custom_tool_calls_are_read_as_calls_in_chat_and_responses() {
    let (seen, _) = decisions(
        Endpoint::ChatCompletions,
        &[
            r#"{"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"id":"call_c","type":"custom","custom":{"name":"shell_rm"}}]}}]}"#,
            r#"{"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"custom":{"input":"rm -rf /"}}]}}]}"#,
            "[DONE]",
        ],
    );
    assert_eq!(seen, [call(0, 0, "call_c", "shell_rm")]);
    let (seen, _) = decisions(
        Endpoint::Responses,
        &[
            r#"{"type":"response.output_item.added","output_index":0,"item":{"type":"custom_tool_call","call_id":"call_c","name":"shell_rm","input":""}}"#,
            r#"{"type":"response.custom_tool_call_input.delta","output_index":0,"delta":"rm -rf /"}"#,
            r#"{"type":"response.completed","response":{"output":[]}}"#,
        ],
    );
    assert_eq!(seen, [call(0, 0, "call_c", "shell_rm")]);
    let body = br#"{"output":[{"type":"custom_tool_call","call_id":"call_c","name":"shell_rm","input":"rm"}]}"#;
    let calls = body_calls(Endpoint::Responses, body).unwrap();
    assert_eq!(
        (calls[0].name.as_str(), calls[0].arguments.as_str()),
        ("shell_rm", "rm")
    );
    let body = br#"{"choices":[{"index":0,"message":{"tool_calls":[{"id":"c","type":"custom","custom":{"name":"shell_rm","input":"rm"}}]}}]}"#;
    let calls = body_calls(Endpoint::ChatCompletions, body).unwrap();
    assert_eq!(
        (calls[0].name.as_str(), calls[0].arguments.as_str()),
        ("shell_rm", "rm")
    );
}

#[test]
fn the_legacy_function_call_is_read_as_a_call() {
    let (seen, _) = decisions(
        Endpoint::ChatCompletions,
        &[
            r#"{"choices":[{"index":0,"delta":{"function_call":{"name":"shell_rm","arguments":""}}}]}"#,
            r#"{"choices":[{"index":0,"delta":{"function_call":{"arguments":"{}"}}}]}"#,
            r#"{"choices":[{"index":0,"delta":{},"finish_reason":"function_call"}]}"#,
        ],
    );
    assert_eq!(seen, [call(0, LEGACY_INDEX, "", "shell_rm")]);
    let body = br#"{"choices":[{"index":0,"message":{"function_call":{"name":"shell_rm","arguments":"{}"}}}]}"#;
    let calls = body_calls(Endpoint::ChatCompletions, body).unwrap();
    assert_eq!(
        (calls[0].index, calls[0].name.as_str()),
        (LEGACY_INDEX, "shell_rm")
    );
}

#[test]
fn calls_stated_only_in_a_snapshot_of_the_answer_are_decided_there() {
    let (seen, steps) = decisions(
        Endpoint::Responses,
        &[
            r#"{"type":"response.created","response":{"output":[]}}"#,
            r#"{"type":"response.completed","response":{"output":[{"type":"message","content":[]},{"type":"function_call","call_id":"call_z","name":"shell_rm","arguments":"{}"}]}}"#,
        ],
    );
    assert_eq!(seen, [call(0, 1, "call_z", "shell_rm")]);
    assert!(matches!(steps[1], ScanStep::Decide { .. }), "{steps:?}");
    let (seen, _) = decisions(
        Endpoint::Messages,
        &[
            r#"{"type":"message_start","message":{"content":[{"type":"tool_use","id":"toolu_z","name":"shell_rm","input":{"path":"/"}}]}}"#,
            r#"{"type":"message_stop"}"#,
        ],
    );
    assert_eq!(seen, [call(0, 0, "toolu_z", "shell_rm")]);
    // A snapshot restating the calls the events opened decides nothing again.
    let events = events_in_two_chunks(RESPONSES_CALLS.as_bytes(), 0);
    let mut restated = events.clone();
    let completed = restated.pop().unwrap();
    let completed = String::from_utf8(completed).unwrap().replace(
        r#""status":"completed","#,
        r#""status":"completed","output":[{"type":"message","content":[]},{"type":"function_call","call_id":"call_a","name":"get_weather","arguments":"{}"},{"type":"function_call","call_id":"call_b","name":"search","arguments":"{}"}],"#,
    );
    restated.push(completed.into_bytes());
    let (steps, _, made) = scan(Endpoint::Responses, &restated);
    assert_eq!(decided(&steps), expected(Endpoint::Responses));
    assert_eq!(made, 2);
}

#[test]
fn a_call_stated_again_under_its_index_with_another_id_or_name_is_a_rename() {
    let added = |id: &str, name: &str| {
        format!(
            r#"{{"type":"response.output_item.added","output_index":0,"item":{{"type":"function_call","call_id":"{id}","name":"{name}","arguments":""}}}}"#
        )
    };
    for (id, name) in [("call_2", "search"), ("call_1", "shell_rm")] {
        let (seen, steps) = decisions(
            Endpoint::Responses,
            &[&added("call_1", "search"), &added(id, name)],
        );
        assert_eq!(seen, [call(0, 0, "call_1", "search")]);
        assert_eq!(steps[1], ScanStep::Renamed { index: 0 }, "{id} {name}");
    }
    // The same call stated again is the same call: nothing new to decide.
    let (seen, steps) = decisions(
        Endpoint::Responses,
        &[&added("call_1", "search"), &added("call_1", "search")],
    );
    assert_eq!(seen.len(), 1);
    assert_eq!(steps[1], ScanStep::Forward);
    let start = |id: &str| {
        format!(
            r#"{{"type":"content_block_start","index":1,"content_block":{{"type":"tool_use","id":"{id}","name":"search","input":{{}}}}}}"#
        )
    };
    let (_, steps) = decisions(Endpoint::Messages, &[&start("t1"), &start("t2")]);
    assert_eq!(steps[1], ScanStep::Renamed { index: 1 });
}

#[test]
fn parallel_choices_keep_their_calls_apart() {
    let (seen, _) = decisions(
        Endpoint::ChatCompletions,
        &[
            r#"{"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"id":"a","function":{"name":"search","arguments":"{}"}}]}},{"index":1,"delta":{"tool_calls":[{"index":0,"id":"b","function":{"name":"deploy","arguments":"{}"}}]}}]}"#,
        ],
    );
    assert_eq!(seen, [call(0, 0, "a", "search"), call(1, 0, "b", "deploy")]);
}

#[test]
fn random_bytes_and_mangled_streams_never_panic() {
    let mut rng = crate::draw::Rng::new(0x7001_5CA4);
    let alphabet: &[u8] = b"{}[]\":,0123 \n\rdata:index\\tool_callsfunctionnametype";
    for round in 0..3000 {
        let (shape, stream) = fixtures()[round % 3];
        let mut bytes = stream.as_bytes().to_vec();
        // Mangle a fixture in a few places, or draw random bytes.
        if round % 4 == 0 {
            let len = (rng.draw() % 512) as usize;
            bytes = (0..len)
                .map(|_| match rng.draw() % 3 {
                    0 => (rng.draw() % 256) as u8,
                    _ => alphabet[(rng.draw() % alphabet.len() as u64) as usize],
                })
                .collect();
        } else {
            for _ in 0..(1 + rng.draw() % 8) {
                let at = (rng.draw() as usize) % bytes.len();
                bytes[at] = alphabet[(rng.draw() % alphabet.len() as u64) as usize];
            }
        }
        let cut = (rng.draw() as usize) % (bytes.len() + 1);
        for shape in [shape, Endpoint::ALL[round % 5]] {
            let mut scan = ToolScan::new(shape);
            for event in events_in_two_chunks(&bytes, cut) {
                let _ = scan.observe(&event);
            }
            let _ = scan.finish();
            assert!(scan.calls().len() <= MAX_CALLS);
            let _ = body_calls(shape, &bytes);
        }
    }
}

#[test]
fn whole_bodies_give_their_calls_in_each_api() {
    let chat = br#"{"id":"c","choices":[{"index":0,"message":{"role":"assistant","content":null,"tool_calls":[{"id":"call_a","type":"function","function":{"name":"get_weather","arguments":"{\"city\":\"Oslo\"}"}},{"id":"call_b","type":"function","function":{"name":"search","arguments":"{\"q\":\"rain\"}"}}]},"finish_reason":"tool_calls"}],"usage":{"prompt_tokens":1,"completion_tokens":1}}"#;
    let responses = br#"{"id":"resp_1","output":[{"type":"message","id":"m","content":[]},{"type":"function_call","id":"fc_1","call_id":"call_a","name":"get_weather","arguments":"{\"city\":\"Oslo\"}"},{"type":"function_call","id":"fc_2","call_id":"call_b","name":"search","arguments":"{\"q\":\"rain\"}"}]}"#;
    let messages = br#"{"id":"msg_1","content":[{"type":"text","text":"Let me look."},{"type":"tool_use","id":"toolu_a","name":"get_weather","input":{"city":"Oslo"}},{"type":"tool_use","id":"toolu_b","name":"search","input":{"q":"rain"}}]}"#;
    for (shape, body) in [
        (Endpoint::ChatCompletions, &chat[..]),
        (Endpoint::Responses, &responses[..]),
        (Endpoint::Messages, &messages[..]),
    ] {
        let calls = body_calls(shape, body).unwrap();
        let seen: Vec<_> = calls
            .iter()
            .map(|c| (c.index, c.id.clone(), c.name.clone()))
            .collect();
        assert_eq!(seen, expected(shape), "{shape:?}");
        let arguments: Vec<_> = calls.iter().map(|c| c.arguments.as_str()).collect();
        assert_eq!(
            arguments,
            ["{\"city\":\"Oslo\"}", "{\"q\":\"rain\"}"],
            "{shape:?}"
        );
        assert!(calls.iter().all(|c| c.complete && c.decided));
    }
    assert_eq!(
        body_calls(
            Endpoint::ChatCompletions,
            b"{\"choices\":[{\"message\":{\"content\":\"hi\"}}]}"
        ),
        Some(Vec::new())
    );
    assert_eq!(body_calls(Endpoint::Messages, b"not json"), None);
    assert_eq!(body_calls(Endpoint::Embeddings, b"{}"), Some(Vec::new()));
}

#[test]
fn a_messages_block_opened_with_its_input_keeps_it_unless_deltas_follow() {
    let start = |i: u32, input: &str| {
        format!(
            "data: {{\"type\":\"content_block_start\",\"index\":{i},\"content_block\":{{\"type\":\"tool_use\",\"id\":\"t{i}\",\"name\":\"x\",\"input\":{input}}}}}\n\n"
        )
    };
    let mut scan = ToolScan::new(Endpoint::Messages);
    scan.observe(start(0, "{\"a\":1}").as_bytes());
    scan.observe(start(1, "{\"a\":1}").as_bytes());
    scan.observe(b"data: {\"type\":\"content_block_delta\",\"index\":1,\"delta\":{\"type\":\"input_json_delta\",\"partial_json\":\"{\\\"b\\\":2}\"}}\n\n");
    scan.observe(b"data: {\"type\":\"message_stop\"}\n\n");
    let arguments: Vec<_> = scan.completed().map(|c| c.arguments.as_str()).collect();
    assert_eq!(arguments, ["{\"a\":1}", "{\"b\":2}"]);
}

#[test]
fn approval_ids_are_fixed_by_attempt_index_and_call() {
    let id = super::approval_id("att-1", 0, "call_1");
    assert!(id.starts_with("apr_") && id.len() == 28, "{id}");
    assert!(
        id[4..]
            .bytes()
            .all(|b| b.is_ascii_lowercase() || (b'2'..=b'7').contains(&b))
    );
    assert_eq!(id, super::approval_id("att-1", 0, "call_1"));
    assert_ne!(id, super::approval_id("att-2", 0, "call_1"));
    assert_ne!(id, super::approval_id("att-1", 1, "call_1"));
    assert_ne!(id, super::approval_id("att-1", 0, "call_2"));
}

// Attacker pass 3: shapes a client reads a call in that the scan does not judge as such.

#[test]
fn attack_a_custom_typed_call_with_a_decoy_function_is_judged_by_what_the_client_runs() {
    let (seen, steps) = decisions(
        Endpoint::ChatCompletions,
        &[
            r#"{"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"id":"call_c","type":"custom","function":{"name":"search","arguments":"{}"},"custom":{"name":"shell_rm","input":"rm -rf /"}}]}}]}"#,
            "[DONE]",
        ],
    );
    let judged_custom = seen.iter().any(|c| c.3 == "shell_rm");
    let refused = steps.contains(&ScanStep::Unreadable);
    assert!(judged_custom || refused, "decided only {seen:?}");
    let body = br#"{"choices":[{"index":0,"message":{"tool_calls":[{"id":"c","type":"custom","function":{"name":"search","arguments":"{}"},"custom":{"name":"shell_rm","input":"rm -rf /"}}]}}]}"#;
    let calls = body_calls(Endpoint::ChatCompletions, body);
    assert!(
        calls.is_none_or(|calls| calls.iter().any(|c| c.name == "shell_rm")),
        "whole body judged as `search` only"
    );
}

#[test]
fn attack_client_run_builtin_calls_in_responses_are_read() {
    for kind in [
        "local_shell_call",
        "shell_call",
        "apply_patch_call",
        "computer_call",
    ] {
        let added = format!(
            r#"{{"type":"response.output_item.added","output_index":0,"item":{{"type":"{kind}","call_id":"call_s","action":{{"type":"exec","command":["rm","-rf","/"]}}}}}}"#
        );
        let (seen, steps) = decisions(
            Endpoint::Responses,
            &[
                &added,
                r#"{"type":"response.completed","response":{"output":[]}}"#,
            ],
        );
        let read = !seen.is_empty() || steps.contains(&ScanStep::Unreadable);
        assert!(read, "{kind}: passed unread and uncounted: {steps:?}");
        let body = format!(
            r#"{{"output":[{{"type":"{kind}","call_id":"call_s","action":{{"type":"exec","command":["rm"]}}}}]}}"#
        );
        let calls = body_calls(Endpoint::Responses, body.as_bytes());
        assert!(
            calls.is_none_or(|c| !c.is_empty()),
            "{kind}: whole body has no call"
        );
    }
}

#[test]
fn attack_a_tool_call_at_the_legacy_index_is_not_joined_to_the_legacy_call() {
    // Offered: `deploy` (approval) and `deploy_status` (allowed). The scan sees one call
    // `deploy_status`; the client sees tool call `deploy` and function_call `_status`.
    let (seen, steps) = decisions(
        Endpoint::ChatCompletions,
        &[
            r#"{"choices":[{"index":0,"delta":{"tool_calls":[{"index":4294967295,"id":"call_d","type":"function","function":{"name":"deploy"}}]}}]}"#,
            r#"{"choices":[{"index":0,"delta":{"function_call":{"name":"_status"}}}]}"#,
            r#"{"choices":[{"index":0,"delta":{"function_call":{"arguments":"{\"env\":\"prod\"}"}}}]}"#,
            r#"{"choices":[{"index":0,"delta":{},"finish_reason":"tool_calls"}]}"#,
            "[DONE]",
        ],
    );
    let judged_deploy = seen.iter().any(|c| c.3 == "deploy");
    let refused = steps
        .iter()
        .any(|s| matches!(s, ScanStep::Unreadable | ScanStep::Renamed { .. }));
    assert!(judged_deploy || refused, "decided only {seen:?}");
}

#[test]
fn attack_a_call_restated_at_another_snapshot_position_is_decided_once() {
    let (seen, _) = decisions(
        Endpoint::Responses,
        &[
            r#"{"type":"response.output_item.added","output_index":1,"item":{"type":"function_call","call_id":"call_a","name":"search","arguments":""}}"#,
            r#"{"type":"response.output_item.done","output_index":1,"item":{"type":"function_call","call_id":"call_a","name":"search","arguments":"{}"}}"#,
            r#"{"type":"response.completed","response":{"output":[{"type":"function_call","call_id":"call_a","name":"search","arguments":"{}"}]}}"#,
        ],
    );
    assert_eq!(
        seen.len(),
        1,
        "one call decided {} times: {seen:?}",
        seen.len()
    );
}
