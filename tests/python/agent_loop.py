"""A scripted agent on the official SDKs, for tests/runs.rs: it loops over model calls of one
run (streamed, with a tool offered), runs the tool calls the model makes and sends their
results back, and stops at the first call weir refuses. Prints one JSON line per call:
{"call": i, "ok": true, "tool_calls": n, "prompt_tokens": p} or
{"call": i, "ok": false, "status": s, "error": {...}}.

usage: agent_loop.py SDK BASE_URL KEY RUN_ID CALLS [--pause S] [--max-tokens N] [--parallel N]
                     [--retry-each]
--retry-each sends every call twice, as a client that retries does: the same body and the
same x-request-id.
SDK is `openai` (Chat Completions) or `anthropic` (Messages).
"""

import argparse
import json
import sys
import threading
import time

import anthropic
import openai

TOOL = "lookup"
ASK = f"call {TOOL}"


def openai_call(client, messages, args, headers):
    stream = client.chat.completions.create(
        extra_headers=headers,
        model="tiny",
        messages=messages,
        tools=[{"type": "function", "function": {"name": TOOL, "parameters": {"type": "object"}}}],
        max_tokens=args.max_tokens,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": args.ignore_eos},
    )
    calls, text, usage = {}, [], None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.delta.content:
                text.append(choice.delta.content)
            for call in choice.delta.tool_calls or []:
                entry = calls.setdefault(call.index, {"id": "", "name": "", "arguments": ""})
                entry["id"] = call.id or entry["id"]
                if call.function:
                    entry["name"] += call.function.name or ""
                    entry["arguments"] += call.function.arguments or ""
    calls = [calls[i] for i in sorted(calls)]
    if calls:
        messages.append({"role": "assistant", "tool_calls": [
            {"id": c["id"], "type": "function",
             "function": {"name": c["name"], "arguments": c["arguments"] or "{}"}} for c in calls]})
        for c in calls:
            messages.append({"role": "tool", "tool_call_id": c["id"], "content": "42"})
    else:
        messages.append({"role": "assistant", "content": "".join(text)})
        messages.append({"role": "user", "content": ASK})
    return len(calls), usage.prompt_tokens if usage else None


def anthropic_call(client, messages, args, headers):
    calls, text, usage_in = [], [], None
    with client.messages.stream(
        extra_headers=headers,
        model="tiny",
        messages=messages,
        tools=[{"name": TOOL, "input_schema": {"type": "object"}}],
        max_tokens=args.max_tokens,
        extra_body={"ignore_eos": args.ignore_eos},
    ) as stream:
        for event in stream:
            if event.type == "message_start":
                # Anthropic counts cached prompt tokens apart from input_tokens.
                u = event.message.usage
                usage_in = (u.input_tokens + (u.cache_read_input_tokens or 0)
                            + (u.cache_creation_input_tokens or 0))
        final = stream.get_final_message()
    for block in final.content:
        if block.type == "tool_use":
            calls.append(block)
        elif block.type == "text":
            text.append(block.text)
    if calls:
        messages.append({"role": "assistant", "content": [
            {"type": "tool_use", "id": b.id, "name": b.name, "input": b.input} for b in calls]})
        messages.append({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": b.id, "content": "42"} for b in calls]})
    else:
        messages.append({"role": "assistant", "content": "".join(text) or "ok"})
        messages.append({"role": "user", "content": ASK})
    return len(calls), usage_in


def client_for(args):
    headers = {"x-weir-run-id": args.run_id}
    if args.sdk == "openai":
        return openai.OpenAI(base_url=f"{args.base_url}/v1", api_key=args.key, max_retries=0,
                             default_headers=headers), openai_call
    return anthropic.Anthropic(base_url=args.base_url, api_key=args.key, max_retries=0,
                               default_headers=headers), anthropic_call


def refusal(e):
    """The status and error object of an SDK's error (a refused call, or an error event)."""
    body = getattr(e, "body", None)
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        body = body["error"]
    return {"call": None, "ok": False, "status": getattr(e, "status_code", None), "error": body}


def one(client, call, messages, args, i, headers=None):
    try:
        tools, prompt = call(client, messages, args, headers or {})
        return {"call": i, "ok": True, "tool_calls": tools, "prompt_tokens": prompt}
    except (openai.APIError, anthropic.APIError) as e:
        return {**refusal(e), "call": i}


def main():
    parser = argparse.ArgumentParser()
    for name in ("sdk", "base_url", "key", "run_id"):
        parser.add_argument(name)
    parser.add_argument("calls", type=int)
    parser.add_argument("--pause", type=float, default=0.0)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--ignore-eos", action="store_true")
    parser.add_argument("--parallel", type=int, default=0)
    parser.add_argument("--retry-each", action="store_true")
    args = parser.parse_args()
    client, call = client_for(args)
    if args.parallel:
        # Branches of one run at once, each its own conversation.
        results = [None] * args.parallel
        def branch(i):
            results[i] = one(client, call, [{"role": "user", "content": "think"}], args, i)
        threads = [threading.Thread(target=branch, args=(i,)) for i in range(args.parallel)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for r in results:
            print(json.dumps(r), flush=True)
        return
    messages = [{"role": "user", "content": ASK}]
    for i in range(args.calls):
        sends = 2 if args.retry_each else 1
        headers = {"x-request-id": f"{args.run_id}-step-{i}"} if args.retry_each else {}
        before = [dict(m) for m in messages]
        for attempt in range(sends):
            # A retry sends what the first attempt sent; only the last answer is kept.
            convo = [dict(m) for m in before] if attempt < sends - 1 else messages
            result = one(client, call, convo, args, i, headers)
            print(json.dumps(result), flush=True)
            if not result["ok"]:
                return
        time.sleep(args.pause)


if __name__ == "__main__":
    sys.exit(main())
