"""The official OpenAI Python SDK as a real client of weir-sim."""

import openai
import pytest

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
