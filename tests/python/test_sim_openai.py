"""The official OpenAI Python SDK as a real client of weir-sim."""

import base64
import json
import struct

import openai
import openai.types.responses
import pytest

# Every warning is an error: the SDK must parse each event and body as its own types. (The
# simulator's pipe, closed by the garbage collector after the module's fixture, is not the SDK's.)
pytestmark = pytest.mark.filterwarnings(
    "error", "ignore::ResourceWarning", "ignore::pytest.PytestUnraisableExceptionWarning"
)

MESSAGES = [
    {"role": "system", "content": "You are a terse assistant."},
    {"role": "user", "content": "Explain paged attention in one line."},
]


def test_streamed_chat_with_usage_matches_what_was_streamed(client):
    stream = client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        max_tokens=24,
        stream=True,
        stream_options={"include_usage": True},
    )
    pieces, usage, finish = [], None, None
    for chunk in stream:
        if chunk.usage is not None:
            assert chunk.choices == [], "usage rides on a chunk without choices"
            usage = chunk.usage
            continue
        choice = chunk.choices[0]
        if choice.delta.content:
            pieces.append(choice.delta.content)
        finish = choice.finish_reason or finish
    assert usage is not None, "include_usage must produce a usage chunk"
    assert usage.completion_tokens == len(pieces) > 0
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    # Two messages (3 framing tokens each) plus reply priming: well over 12 tokens.
    assert usage.prompt_tokens > 12
    assert finish in ("stop", "length")
    assert (finish == "length") == (len(pieces) == 24)


def test_stream_without_include_usage_has_no_usage_chunk(client):
    stream = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=8, stream=True
    )
    chunks = list(stream)
    assert chunks and all(c.usage is None and c.choices for c in chunks)


def test_non_streamed_chat_reports_usage(client):
    messages = [{"role": "user", "content": "A prompt no other test sends, long enough to fill "
                 "at least one sixteen-token block of the prefix cache."}]
    ask = lambda: client.chat.completions.create(  # noqa: E731
        model="tiny", messages=messages, max_tokens=12, extra_body={"ignore_eos": True}
    )
    resp = ask()
    choice = resp.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content
    assert choice.finish_reason == "length"
    assert resp.usage.completion_tokens == 12
    assert resp.usage.prompt_tokens_details.cached_tokens == 0
    assert ask().usage.prompt_tokens_details.cached_tokens >= 16, "the repeat hits the cache"


def test_text_completions_stream_and_not(client):
    resp = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=5,
                                     extra_body={"ignore_eos": True})
    assert resp.usage.completion_tokens == 5
    assert resp.usage.prompt_tokens == 4  # "Once upon a time" is four cl100k tokens
    stream = client.completions.create(
        model="tiny", prompt="Once upon a time", max_tokens=5, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert len(texts) == 5
    assert chunks[-1].usage.completion_tokens == 5


def test_same_seed_same_answer(client):
    ask = lambda: client.chat.completions.create(  # noqa: E731
        model="tiny", messages=MESSAGES, max_tokens=10, seed=42
    ).choices[0].message.content
    assert ask() == ask()


def test_sdk_raises_typed_errors(client):
    with pytest.raises(openai.NotFoundError) as unknown:
        client.chat.completions.create(model="nope", messages=MESSAGES)
    assert "does not exist" in unknown.value.message
    with pytest.raises(openai.BadRequestError) as n2:
        client.chat.completions.create(model="tiny", messages=MESSAGES, n=2)
    assert n2.value.body["param"] == "n"


# --- The Responses API, embeddings, tool calls and prompt batches --------------------------------

TOOLS = [{
    "type": "function",
    "function": {
        "name": "search",
        "description": "Search the knowledge base",
        "parameters": {"type": "object", "properties": {"terms": {"type": "string"}}},
    },
}]


def test_streamed_response_events_and_completed_usage(client):
    stream = client.responses.create(
        model="tiny", input="Explain paged attention.", instructions="Be terse.",
        max_output_tokens=16, stream=True,
    )
    events = list(stream)
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e.delta for e in events if isinstance(e, openai.types.responses.ResponseTextDeltaEvent)]
    done = next(e for e in events if e.type == "response.output_text.done")
    assert done.text == "".join(deltas)
    completed = events[-1].response
    assert completed.status in ("completed", "incomplete")
    assert completed.output_text == done.text
    usage = completed.usage
    assert usage.output_tokens == len(deltas)
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.input_tokens > 8  # instructions and input, with chat framing
    assert (completed.status == "incomplete") == (usage.output_tokens == 16)


def test_non_streamed_response(client):
    resp = client.responses.create(model="tiny", input="A prompt only this test sends.",
                                   max_output_tokens=7, extra_body={"ignore_eos": True})
    assert resp.object == "response"
    assert resp.status == "incomplete"
    assert resp.incomplete_details.reason == "max_output_tokens"
    assert resp.output[0].type == "message" and resp.output_text
    assert resp.usage.output_tokens == 7
    assert resp.usage.input_tokens_details.cached_tokens == 0


def test_embeddings_of_a_batch_and_as_base64(client):
    texts = [f"document number {i} about caches" for i in range(32)]
    resp = client.embeddings.create(model="tiny", input=texts)
    assert [d.index for d in resp.data] == list(range(32))
    assert all(len(d.embedding) == 64 for d in resp.data)
    first = resp.data[0].embedding
    assert abs(sum(x * x for x in first) - 1) < 1e-4, "unit vectors"
    assert resp.usage.prompt_tokens == resp.usage.total_tokens >= 32 * 5
    again = client.embeddings.create(model="tiny", input=texts[0], dimensions=64)
    assert again.data[0].embedding == pytest.approx(first), "deterministic"
    raw = client.embeddings.create(model="tiny", input=texts[:2], encoding_format="base64",
                                   dimensions=8)
    packed = base64.b64decode(raw.data[0].embedding)
    assert len(packed) == 8 * 4
    vector = struct.unpack("<8f", packed)
    assert abs(sum(x * x for x in vector) - 1) < 1e-4


def test_streamed_chat_tool_call_reassembles_to_json(client):
    stream = client.chat.completions.create(
        model="tiny", messages=MESSAGES, tools=TOOLS, max_tokens=400, stream=True,
        stream_options={"include_usage": True},
    )
    name, call_id, arguments, finish, usage = None, None, "", None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            for call in choice.delta.tool_calls or []:
                assert call.index == 0
                name = call.function.name or name
                call_id = call.id or call_id
                arguments += call.function.arguments or ""
            finish = choice.finish_reason or finish
    assert name == "search" and call_id
    assert finish == "tool_calls"
    assert set(json.loads(arguments)) == {"terms"}
    assert usage.completion_tokens > 0
    plain = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS,
                                           tool_choice="none", max_tokens=5)
    assert plain.choices[0].message.tool_calls in (None, [])
    whole = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS,
                                           max_tokens=400)
    call = whole.choices[0].message.tool_calls[0]
    assert call.function.name == "search" and json.loads(call.function.arguments)["terms"]


def test_prompt_batch_completions(client):
    resp = client.completions.create(model="tiny", prompt=["Once upon a time", "Hello"],
                                     max_tokens=3, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in resp.choices) == [0, 1]
    assert resp.usage.prompt_tokens == 4 + 1
    assert resp.usage.completion_tokens == 6
    stream = client.completions.create(model="tiny", prompt=[[1, 2, 3], [4, 5]], max_tokens=3,
                                       stream=True, stream_options={"include_usage": True},
                                       extra_body={"ignore_eos": True})
    texts, usage = {0: [], 1: []}, None
    for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            texts[choice.index].append(choice.text)
    assert [len(t) for t in texts.values()] == [3, 3]
    assert (usage.prompt_tokens, usage.completion_tokens) == (5, 6)


# --- Agent mode: parallel calls, a loop that ends, a name split over events --------------------

AGENT_TOOLS = TOOLS + [{
    "type": "function",
    "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}},
}]
CALL_BOTH = [{"role": "user", "content": "call search, get_time"}]


@pytest.mark.parametrize("fault", [None, "split-tool-name"])
def test_the_stream_helper_parses_parallel_chat_calls(client, fault):
    headers = {"x-sim-fault": fault} if fault else {}
    with client.chat.completions.stream(model="tiny", messages=CALL_BOTH, tools=AGENT_TOOLS,
                                        max_tokens=400, extra_headers=headers) as stream:
        final = stream.get_final_completion()
    calls = final.choices[0].message.tool_calls
    assert [c.function.name for c in calls] == ["search", "get_time"]
    assert len({c.id for c in calls}) == 2
    assert [set(json.loads(c.function.arguments)) for c in calls] == [{"terms"}, {"query"}]
    assert final.choices[0].finish_reason == "tool_calls"
    whole = client.chat.completions.create(model="tiny", messages=CALL_BOTH, tools=AGENT_TOOLS,
                                           max_tokens=400)
    assert [c.function.name for c in whole.choices[0].message.tool_calls] == ["search", "get_time"]


def test_a_tool_result_ends_the_chat_loop(client):
    first = client.chat.completions.create(model="tiny", messages=CALL_BOTH, tools=AGENT_TOOLS,
                                           max_tokens=400)
    message = first.choices[0].message
    results = [{"role": "tool", "tool_call_id": c.id, "content": "done"}
               for c in message.tool_calls]
    history = CALL_BOTH + [message.model_dump(exclude_none=True)] + results
    second = client.chat.completions.create(model="tiny", messages=history, tools=AGENT_TOOLS,
                                            max_tokens=8)
    assert second.choices[0].message.tool_calls in (None, [])
    assert second.choices[0].message.content
    assert second.choices[0].finish_reason in ("stop", "length")


def test_responses_parse_parallel_function_calls_streamed_and_not(client):
    tools = [{"type": "function", "name": t["function"]["name"],
              "parameters": t["function"]["parameters"]} for t in AGENT_TOOLS]
    with client.responses.stream(model="tiny", input="call search, get_time", tools=tools,
                                 max_output_tokens=400) as stream:
        final = stream.get_final_response()
    calls = [i for i in final.output if i.type == "function_call"]
    assert [c.name for c in calls] == ["search", "get_time"]
    assert len({c.call_id for c in calls}) == 2 and len({c.id for c in calls}) == 2
    assert [set(json.loads(c.arguments)) for c in calls] == [{"terms"}, {"query"}]
    whole = client.responses.create(model="tiny", input="call search, get_time", tools=tools,
                                    max_output_tokens=400)
    outputs = [{"type": "function_call_output", "call_id": c.call_id, "output": "done"}
               for c in whole.output if c.type == "function_call"]
    assert len(outputs) == 2
    history = [{"role": "user", "content": "call search, get_time"}]
    history += [c.model_dump(exclude_none=True) for c in whole.output] + outputs
    answer = client.responses.create(model="tiny", input=history, tools=tools, max_output_tokens=8)
    assert [i.type for i in answer.output] == ["message"] and answer.output_text
