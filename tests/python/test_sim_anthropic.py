"""The official Anthropic Python SDK as a real client of weir-sim's Messages API."""

import anthropic
import pytest

# Every warning is an error: the SDK must parse each event and body as its own types. (The
# simulator's pipe, closed by the garbage collector after the module's fixture, is not the SDK's.)
pytestmark = pytest.mark.filterwarnings(
    "error", "ignore::ResourceWarning", "ignore::pytest.PytestUnraisableExceptionWarning"
)

MESSAGES = [{"role": "user", "content": "Explain paged attention in one line."}]
TOOLS = [{
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
}]


@pytest.fixture
def claude(sim):
    return anthropic.Anthropic(base_url=sim, api_key="unused", max_retries=0)


def test_create_reports_usage_and_stop_reason(claude):
    message = claude.messages.create(model="tiny", max_tokens=9, messages=MESSAGES,
                                     system="Be terse.", extra_body={"ignore_eos": True})
    assert message.type == "message" and message.role == "assistant"
    assert [b.type for b in message.content] == ["text"]
    assert message.content[0].text
    assert message.stop_reason == "max_tokens"
    assert message.usage.output_tokens == 9
    assert message.usage.input_tokens > 10  # system and message, with chat framing
    assert message.usage.cache_read_input_tokens == 0


def test_stream_helper_builds_the_final_message(claude):
    with claude.messages.stream(model="tiny", max_tokens=12, messages=MESSAGES) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert final.content[0].text == text
    assert final.stop_reason in ("end_turn", "max_tokens")
    assert 0 < final.usage.output_tokens <= 12
    assert final.usage.input_tokens > 5


def test_raw_stream_events_in_order(claude):
    events = list(claude.messages.create(model="tiny", max_tokens=6, messages=MESSAGES,
                                         stream=True, extra_body={"ignore_eos": True}))
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert kinds.count("content_block_delta") == 6
    assert events[-2].usage.output_tokens == 6
    assert events[-2].delta.stop_reason == "max_tokens"


def test_tool_use_streamed_and_not(claude):
    with claude.messages.stream(model="tiny", max_tokens=400, messages=MESSAGES,
                                tools=TOOLS) as stream:
        final = stream.get_final_message()
    block = final.content[-1]
    assert block.type == "tool_use" and block.name == "get_weather"
    assert set(block.input) == {"city"} and block.id.startswith("toolu_")
    assert final.stop_reason == "tool_use"
    whole = claude.messages.create(model="tiny", max_tokens=400, messages=MESSAGES, tools=TOOLS)
    assert whole.content[-1].type == "tool_use" and whole.stop_reason == "tool_use"
    none = claude.messages.create(model="tiny", max_tokens=4, messages=MESSAGES, tools=TOOLS,
                                  tool_choice={"type": "none"})
    assert [b.type for b in none.content] == ["text"]


def test_errors_raise_the_sdk_s_typed_exceptions(claude):
    with pytest.raises(anthropic.BadRequestError) as missing:
        # The SDK requires max_tokens; `omit` sends the request without it.
        claude.messages.create(model="tiny", max_tokens=anthropic.omit, messages=MESSAGES,
                               timeout=30)
    assert missing.value.body["type"] == "error"
    assert missing.value.body["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in missing.value.message
    with pytest.raises(anthropic.NotFoundError) as unknown:
        claude.messages.create(model="nope", max_tokens=4, messages=MESSAGES)
    assert unknown.value.body["error"]["type"] == "not_found_error"


AGENT_TOOLS = TOOLS + [{"name": "get_time", "input_schema": {"type": "object"}}]
CALL_BOTH = [{"role": "user", "content": "call get_weather, get_time"}]


@pytest.mark.parametrize("fault", [None, "split-tool-name"])
def test_parallel_tool_use_blocks_then_a_tool_result_ends_the_loop(claude, fault):
    headers = {"x-sim-fault": fault} if fault else {}
    with claude.messages.stream(model="tiny", max_tokens=400, messages=CALL_BOTH,
                                tools=AGENT_TOOLS, extra_headers=headers) as stream:
        final = stream.get_final_message()
    blocks = [b for b in final.content if b.type == "tool_use"]
    assert [b.name for b in blocks] == ["get_weather", "get_time"]
    assert len({b.id for b in blocks}) == 2
    assert set(blocks[0].input) == {"city"} and set(blocks[1].input) == {"query"}
    assert final.stop_reason == "tool_use"
    whole = claude.messages.create(model="tiny", max_tokens=400, messages=CALL_BOTH,
                                   tools=AGENT_TOOLS)
    assert [b.name for b in whole.content if b.type == "tool_use"] == ["get_weather", "get_time"]
    results = [{"type": "tool_result", "tool_use_id": b.id, "content": "done"} for b in blocks]
    history = CALL_BOTH + [{"role": "assistant", "content": final.content},
                           {"role": "user", "content": results}]
    answer = claude.messages.create(model="tiny", max_tokens=8, messages=history,
                                    tools=AGENT_TOOLS)
    assert [b.type for b in answer.content] == ["text"]
    assert answer.stop_reason in ("end_turn", "max_tokens")
