//! The front door holds whatever the framing, the spelling of the path or the size of the body:
//! real Envoy (shipped template) with the built filter, in front of the simulator, on loopback.
//! HTTP/2 requests are sent with prior knowledge (h2c), HTTP/1.1 chunked ones over raw TCP, so
//! trailers and odd paths reach Envoy exactly as an attacker would send them.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a panic is a failed check

use std::io::{Read, Write};
use std::sync::OnceLock;

use bytes::Bytes;
use serde_json::{Value, json};
use weir_e2e::{Envoy, Sim, api_key_limited, chat_body};

struct Stack {
    sim: Sim,
    envoy: Envoy,
}

/// Usage the compressing upstream reports inside its gzip bodies.
const HIDDEN_COMPLETION_TOKENS: u64 = 3;

/// An upstream that ignores `accept-encoding` and answers every request gzip-encoded: a chat
/// completion, or for a streamed request [`compressed_stream`]; returns its port.
fn compressing_upstream() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    std::thread::spawn(move || {
        for conn in listener.incoming().flatten() {
            std::thread::spawn(move || serve_compressed(conn));
        }
    });
    port
}

fn serve_compressed(mut conn: std::net::TcpStream) {
    let Ok(read_half) = conn.try_clone() else {
        return;
    };
    let Some((_, body)) = weir_e2e::read_http_request(&mut std::io::BufReader::new(read_half))
    else {
        return;
    };
    let body = body.as_slice();
    let streamed = serde_json::from_slice::<Value>(body).is_ok_and(|b| b["stream"] == true);
    if streamed {
        // Chunked, in small pieces: the filter sees the stream over several body callbacks.
        let mut wire = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\
                         content-encoding: gzip\r\ntransfer-encoding: chunked\r\n\r\n"
            .to_vec();
        for piece in compressed_stream().chunks(40) {
            wire.extend(format!("{:x}\r\n", piece.len()).bytes());
            wire.extend_from_slice(piece);
            wire.extend(b"\r\n");
        }
        wire.extend(b"0\r\n\r\n");
        let _ = conn.write_all(&wire);
        return;
    }
    let answer = json!({
        "id": "cmpl-1", "object": "chat.completion", "model": "tiny",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi there"}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 10, "completion_tokens": HIDDEN_COMPLETION_TOKENS, "total_tokens": 13},
    });
    let body = gzip(answer.to_string().as_bytes());
    let head = format!(
        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-encoding: gzip\r\n\
         content-length: {}\r\n\r\n",
        body.len()
    );
    let _ = conn.write_all(head.as_bytes());
    let _ = conn.write_all(&body);
}

/// The compressing upstream's streamed answer: an SSE stream of two content chunks, the usage
/// chunk and `[DONE]`, gzip-encoded as a whole (so no event can be read without inflating it).
fn compressed_stream() -> Vec<u8> {
    let chunk = |choices: Value, usage: Value| {
        json!({"id": "cmpl-2", "object": "chat.completion.chunk", "model": "tiny",
               "choices": choices, "usage": usage})
    };
    let delta = |content: &str| json!([{"index": 0, "delta": {"content": content}}]);
    let usage = json!({"prompt_tokens": 10, "completion_tokens": HIDDEN_COMPLETION_TOKENS,
                       "total_tokens": 13});
    let events = [
        chunk(delta("hi"), Value::Null),
        chunk(delta(" there"), Value::Null),
        chunk(json!([]), usage),
    ];
    let mut sse: String = events.iter().map(|e| format!("data: {e}\n\n")).collect();
    sse.push_str("data: [DONE]\n\n");
    gzip(sse.as_bytes())
}

/// A deflate bit stream: fields are written least significant bit first, Huffman codes most
/// significant bit first.
struct Bits {
    out: Vec<u8>,
    acc: u32,
    len: u32,
}

impl Bits {
    fn field(&mut self, value: u32, len: u32) {
        self.acc |= value << self.len;
        self.len += len;
        while self.len >= 8 {
            self.out.push(self.acc as u8);
            self.acc >>= 8;
            self.len -= 8;
        }
    }

    fn code(&mut self, code: u32, len: u32) {
        for i in (0..len).rev() {
            self.field((code >> i) & 1, 1);
        }
    }

    /// The bytes, the last one padded with zero bits.
    fn finish(mut self) -> Vec<u8> {
        if self.len > 0 {
            self.out.push(self.acc as u8);
        }
        self.out
    }
}

/// A valid gzip member holding `data` in one deflate block of fixed Huffman codes, literals
/// only: compressed for real (no byte of `data` appears as itself), without a deflate crate.
fn gzip(data: &[u8]) -> Vec<u8> {
    let mut bits = Bits {
        out: vec![0x1f, 0x8b, 8, 0, 0, 0, 0, 0, 0, 0xff],
        acc: 0,
        len: 0,
    };
    bits.field(0b011, 3); // BFINAL = 1, BTYPE = 01: fixed Huffman codes
    for &b in data {
        match b {
            0..=143 => bits.code(0b0011_0000 + u32::from(b), 8),
            _ => bits.code(0b1_1001_0000 + u32::from(b - 144), 9),
        }
    }
    bits.code(0, 7); // end of block
    let mut out = bits.finish();
    let crc = data.iter().fold(!0u32, |mut crc, &b| {
        crc ^= u32::from(b);
        for _ in 0..8 {
            crc = if crc & 1 == 1 {
                (crc >> 1) ^ 0xedb8_8320
            } else {
                crc >> 1
            };
        }
        crc
    });
    out.extend((!crc).to_le_bytes());
    out.extend((data.len() as u32).to_le_bytes());
    out
}

/// Each test owns a key; `free` is the free tier of the shipped example (1,024 output tokens per
/// request). The body limit is the shipped default.
fn weir_config() -> Value {
    let key = api_key_limited;
    json!({
        "orgs": [{"id": "initech", "policy": {"tier": "free"}, "workspaces": [{"id": "default", "projects": [{"id": "trial", "keys": [
            key("free", json!({"max_output_tokens": 1024})),
        ]}]}]}],
        "models": {"tiny": {"max_context_tokens": 4096}},
        "routes": {"default": {"mode": "enforce"}, "by_name": {"shadowed": {"mode": "shadow"}}},
    })
}

fn stack() -> &'static Stack {
    static STACK: OnceLock<Stack> = OnceLock::new();
    STACK.get_or_init(|| {
        let sim = Sim::start(&[
            "--preset",
            "tiny",
            "--time-scale",
            "5",
            "--output-len",
            "fixed:5",
            "--record-requests",
            "1000",
        ]);
        let compressing = compressing_upstream();
        let envoy = Envoy::start(&weir_config(), sim.port, compressing);
        Stack { sim, envoy }
    })
}

fn addr() -> String {
    stack().envoy.url.trim_start_matches("http://").to_owned()
}

fn chat(content: &str, extra: Value) -> Value {
    chat_body("tiny", content, extra)
}

/// A response as the tests look at it.
struct Answer {
    status: u16,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

impl Answer {
    fn error(&self) -> Value {
        let v: Value = serde_json::from_slice(&self.body)
            .unwrap_or_else(|_| panic!("not JSON: {}", String::from_utf8_lossy(&self.body)));
        v["error"].clone()
    }

    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

/// How a request body is framed on the wire.
#[derive(Clone, Copy, Debug)]
enum Framing {
    /// HTTP/2 (h2c): headers, one DATA frame, a trailers frame ending the stream.
    H2Trailers,
    /// HTTP/2: headers, then a trailers frame, no DATA at all.
    H2TrailersOnly,
    /// HTTP/1.1 `Transfer-Encoding: chunked` ending in trailer fields.
    ChunkedTrailers,
}

/// Sends one request with `framing`, as a client that talks the protocol itself.
async fn send(framing: Framing, path: &str, key: &str, id: &str, body: &[u8]) -> Answer {
    match framing {
        Framing::H2Trailers => h2_request(path, key, id, Some(body)).await,
        Framing::H2TrailersOnly => h2_request(path, key, id, None).await,
        Framing::ChunkedTrailers => {
            let (path, key, id, body) = (
                path.to_owned(),
                key.to_owned(),
                id.to_owned(),
                body.to_vec(),
            );
            tokio::task::spawn_blocking(move || chunked_request(&path, &key, &id, &body))
                .await
                .unwrap()
        }
    }
}

async fn h2_request(path: &str, key: &str, id: &str, body: Option<&[u8]>) -> Answer {
    let tcp = tokio::net::TcpStream::connect(addr()).await.unwrap();
    let (client, connection) = h2::client::handshake(tcp).await.unwrap();
    tokio::spawn(async move {
        let _ = connection.await;
    });
    let mut client = client.ready().await.unwrap();
    let request = http::Request::builder()
        .method("POST")
        .uri(format!("http://{}{path}", addr()))
        .header("authorization", format!("Bearer key-{key}"))
        .header("content-type", "application/json")
        .header("x-request-id", id)
        .body(())
        .unwrap();
    let (response, mut stream) = client.send_request(request, false).unwrap();
    // Envoy may answer (and reset the stream) before it read everything: sending may then fail.
    if let Some(body) = body {
        let _ = stream.send_data(Bytes::copy_from_slice(body), false);
    }
    let mut trailers = http::HeaderMap::new();
    trailers.insert("x-checksum", "feedface".parse().unwrap());
    let _ = stream.send_trailers(trailers);
    let response = response.await.unwrap();
    let status = response.status().as_u16();
    let headers = response
        .headers()
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_str().unwrap_or_default().to_owned()))
        .collect();
    let mut recv = response.into_body();
    let mut out = Vec::new();
    while let Some(Ok(chunk)) = recv.data().await {
        let _ = recv.flow_control().release_capacity(chunk.len());
        out.extend_from_slice(&chunk);
    }
    Answer {
        status,
        headers,
        body: out,
    }
}

fn chunked_request(path: &str, key: &str, id: &str, body: &[u8]) -> Answer {
    let head = format!(
        "POST {path} HTTP/1.1\r\nHost: weir\r\nAuthorization: Bearer key-{key}\r\n\
         Content-Type: application/json\r\nX-Request-Id: {id}\r\nTransfer-Encoding: chunked\r\n\
         Trailer: x-checksum\r\nConnection: close\r\n\r\n"
    );
    let mut wire = head.into_bytes();
    for piece in body.chunks(1000) {
        wire.extend(format!("{:x}\r\n", piece.len()).bytes());
        wire.extend_from_slice(piece);
        wire.extend(b"\r\n");
    }
    wire.extend(b"0\r\nx-checksum: feedface\r\n\r\n");
    raw_http1(&wire)
}

/// Writes raw bytes to Envoy and reads one HTTP/1.1 answer, by its framing (Envoy holds a
/// connection it answered early open for a while, so reading to EOF would wait for that).
fn raw_http1(wire: &[u8]) -> Answer {
    let mut conn = std::net::TcpStream::connect(addr()).unwrap();
    // Written alongside the read: Envoy may answer before it read everything.
    let mut writer = conn.try_clone().unwrap();
    let wire_copy = wire.to_vec();
    std::thread::spawn(move || writer.write_all(&wire_copy));
    let mut response = Vec::new();
    let mut buf = [0u8; 65536];
    let mut read_more = |response: &mut Vec<u8>| {
        let n = conn.read(&mut buf).unwrap_or(0);
        response.extend_from_slice(&buf[..n]);
        n > 0
    };
    let split = loop {
        if let Some(at) = response.windows(4).position(|w| w == b"\r\n\r\n") {
            break at;
        }
        assert!(
            read_more(&mut response),
            "no head in {:?}",
            String::from_utf8_lossy(&response)
        );
    };
    let head = String::from_utf8_lossy(&response[..split]).into_owned();
    let mut lines = head.lines();
    let status = lines
        .next()
        .unwrap()
        .split(' ')
        .nth(1)
        .unwrap()
        .parse()
        .unwrap();
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_owned()))
        .collect();
    let value = |name: &str| {
        headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.clone())
    };
    let is_head = wire.starts_with(b"HEAD ");
    let body = if is_head {
        Vec::new()
    } else if value("transfer-encoding").is_some_and(|v| v.contains("chunked")) {
        let mut out = Vec::new();
        let mut at = split + 4;
        loop {
            let eol = loop {
                if let Some(eol) = response[at..].windows(2).position(|w| w == b"\r\n") {
                    break eol;
                }
                assert!(read_more(&mut response), "truncated chunk");
            };
            let size = std::str::from_utf8(&response[at..at + eol]).unwrap().trim();
            let size = usize::from_str_radix(size, 16).unwrap();
            if size == 0 {
                break out;
            }
            while response.len() < at + eol + 4 + size {
                assert!(read_more(&mut response), "truncated chunk");
            }
            out.extend_from_slice(&response[at + eol + 2..at + eol + 2 + size]);
            at += eol + 4 + size;
        }
    } else if let Some(len) = value("content-length").and_then(|v| v.parse::<usize>().ok()) {
        while response.len() < split + 4 + len {
            assert!(read_more(&mut response), "truncated body");
        }
        response[split + 4..split + 4 + len].to_vec()
    } else {
        while read_more(&mut response) {}
        response[split + 4..].to_vec()
    };
    Answer {
        status,
        headers,
        body,
    }
}

/// What the engine received with this `x-request-id`.
async fn arrived(id: &str) -> Vec<Value> {
    stack().sim.received_with_id(id).await
}

const CHAT: &str = "/v1/chat/completions";
const FRAMINGS: [Framing; 2] = [Framing::ChunkedTrailers, Framing::H2Trailers];

#[tokio::test]
async fn requests_ending_in_trailers_are_admitted_like_any_other() {
    for framing in FRAMINGS {
        // Over the key's 1,024-token cap: refused, and never reaches the engine.
        let id = format!("trailers-over-cap-{framing:?}");
        let body = chat("write a novel", json!({"max_tokens": 2000})).to_string();
        let answer = send(framing, CHAT, "free", &id, body.as_bytes()).await;
        assert!(
            arrived(&id).await.is_empty(),
            "{framing:?} reached the engine"
        );
        assert_eq!(answer.status, 400, "{framing:?}");
        assert_eq!(answer.error()["param"], "max_tokens", "{framing:?}");

        // Within it: served, with the estimate and reservation the admission set.
        let id = format!("trailers-ok-{framing:?}");
        let body = chat(
            "a short one",
            json!({"max_tokens": 5, "cache_salt": "peek"}),
        )
        .to_string();
        let answer = send(framing, CHAT, "free", &id, body.as_bytes()).await;
        assert_eq!(
            answer.status,
            200,
            "{framing:?}: {:?}",
            String::from_utf8_lossy(&answer.body)
        );
        let seen = arrived(&id).await;
        assert_eq!(seen.len(), 1, "{framing:?}");
        let headers = &seen[0]["headers"];
        assert_eq!(headers["x-weir-tenant"], "initech/default/trial/free");
        let logged = stack().envoy.access_log_fields(&id);
        assert_eq!(
            logged["outcome"], "ok",
            "{framing:?}: admitted and metered: {logged:?}"
        );
        assert!(
            logged["estimate"].parse::<u64>().is_ok_and(|t| t > 0),
            "{framing:?}: {logged:?}"
        );
        assert_eq!(seen[0]["body"]["messages"][0]["content"], "a short one");
        assert!(
            seen[0]["body"].get("cache_salt").is_none(),
            "{framing:?}: the rewritten body went upstream"
        );
    }

    // Headers and trailers with no body at all: nothing to admit, so refused.
    let id = "trailers-no-body";
    let answer = send(Framing::H2TrailersOnly, CHAT, "free", id, b"").await;
    assert_eq!(answer.status, 400);
    assert!(
        answer.error()["message"]
            .as_str()
            .unwrap()
            .contains("body is required")
    );
    assert!(arrived(id).await.is_empty());
}

/// One HTTP/1.1 request with a `Content-Length` body, the path sent byte for byte as given.
async fn http1(method: &str, path: &str, key: &str, id: &str, body: &[u8]) -> Answer {
    let mut wire = format!(
        "{method} {path} HTTP/1.1\r\nHost: weir\r\nAuthorization: Bearer key-{key}\r\n\
         Content-Type: application/json\r\nX-Request-Id: {id}\r\nContent-Length: {}\r\n\
         Connection: close\r\n\r\n",
        body.len()
    )
    .into_bytes();
    wire.extend_from_slice(body);
    tokio::task::spawn_blocking(move || raw_http1(&wire))
        .await
        .unwrap()
}

/// Every request this binary sent that reached the engine (whole: the engine records a request
/// once it has its body) carried a completed admission: the access log says it was metered.
async fn nothing_reached_the_engine_unmetered() {
    for r in stack().sim.received().await {
        let h = &r["headers"];
        let id = h["x-request-id"].as_str().unwrap_or_default();
        let logged = stack().envoy.access_log_for(id);
        assert!(
            h["x-weir-tenant"].is_string()
                && !logged.is_empty()
                && logged.iter().all(|l| !l.contains("outcome=passthrough")),
            "reached the engine unmetered: {} {h} {logged:?}",
            r["path"]
        );
    }
}

#[tokio::test]
async fn every_spelling_of_a_metered_path_is_metered() {
    // Reads as a chat or a text completion, whichever the path names.
    let over_cap = chat(
        "write a novel",
        json!({"max_tokens": 2000, "prompt": "a novel"}),
    )
    .to_string();
    for (i, path) in [
        "/v1/chat/completions",
        "/v1/chat/completions/",
        "/v1/chat/completions?stream=false",
        "//v1//chat/completions",
        "/v1/chat%2Fcompletions",
        "/v1/chat%2fcompletions",
        "/v1/%63hat/completions",
        "/v1/chat/%2e/completions",
        "/v1/models/../chat/completions",
        "/v1/models/%2e%2e/chat/completions",
        "/v1/models%2F..%2Fchat%2Fcompletions",
        "/health/../v1/chat/completions",
        "/v1/./chat/completions",
        "/V1/Chat/Completions",
        "/v1%5Cchat%5Ccompletions",
        "/v1/completions/",
        "//v1/COMPLETIONS?x=1",
    ]
    .into_iter()
    .enumerate()
    {
        let id = format!("spelling-{i}");
        let answer = http1("POST", path, "free", &id, over_cap.as_bytes()).await;
        assert_eq!(
            answer.status,
            400,
            "{path}: {}",
            String::from_utf8_lossy(&answer.body)
        );
        assert_eq!(answer.error()["param"], "max_tokens", "{path}");
        assert!(arrived(&id).await.is_empty(), "{path} reached the engine");
    }
    nothing_reached_the_engine_unmetered().await;
}

#[tokio::test]
async fn apis_weir_does_not_meter_and_unknown_paths_are_refused() {
    let body =
        json!({"model": "tiny", "input": "hi", "messages": [{"role": "user", "content": "hi"}]})
            .to_string();
    for (i, path) in [
        "/v1/responses/resp_1",
        "/v1/responses/resp_1/input_items",
        "/v1/messages/count_tokens",
        "/invocations",
        "/v1/audio/transcriptions",
        "/tokenize",
        "/pooling",
        "/score",
        "/rerank",
        "/v1/rerank",
        "/V1/Responses/resp_1/",
        "//v1//messages//count_tokens",
        "/v1/x/../responses/resp_1",
    ]
    .into_iter()
    .enumerate()
    {
        let answer = http1(
            "POST",
            path,
            "free",
            &format!("unmetered-{i}"),
            body.as_bytes(),
        )
        .await;
        assert_eq!(answer.status, 404, "{path}");
        let err = answer.error();
        assert_eq!(err["code"], "not_metered", "{path}: {err}");
        assert!(
            err["message"].as_str().unwrap().contains("not metered"),
            "{path}"
        );
    }
    for path in [
        "/v1/unknown",
        "/",
        "/metrics",
        "/debug/requests",
        "/v1/chat/completions/v1/models",
    ] {
        let answer = http1("GET", path, "free", "unknown", b"").await;
        assert_eq!(answer.status, 404, "{path}");
        assert_eq!(answer.error()["code"], "unknown_path", "{path}");
    }

    // The allow-list is served unmetered, with the key still required.
    let models = http1("GET", "/v1/models", "free", "models", b"").await;
    assert_eq!(models.status, 200);
    assert_eq!(
        http1("HEAD", "/health", "free", "health", b"").await.status,
        200
    );
    assert_eq!(
        http1("GET", "/v1/models", "nobody", "models-anon", b"")
            .await
            .status,
        401
    );

    // Methods: metered APIs take POST, allowed paths GET and HEAD.
    let get = http1("GET", CHAT, "free", "get-chat", b"").await;
    assert_eq!(get.status, 405);
    assert_eq!(get.header("allow"), Some("POST"));
    assert_eq!(get.error()["code"], "method_not_allowed");
    let put = http1(
        "PUT",
        CHAT,
        "free",
        "put-chat",
        chat("hi", json!({})).to_string().as_bytes(),
    )
    .await;
    assert_eq!(put.status, 405);
    assert_eq!(
        http1("POST", "/v1/models", "free", "post-models", b"{}")
            .await
            .status,
        405
    );

    // A shadow route never refuses: it passes the request on and says what enforcement would do.
    let shadow = http1(
        "POST",
        "/shadow/v1/messages/count_tokens",
        "free",
        "shadow-count-tokens",
        body.as_bytes(),
    )
    .await;
    assert_eq!(
        shadow.header("x-weir-shadow"),
        Some("would-reject; reason=not_metered")
    );
    nothing_reached_the_engine_unmetered().await;
}

/// A chat body of about `bytes` bytes.
fn chat_of_size(bytes: usize) -> Vec<u8> {
    chat(&"lorem ipsum ".repeat(bytes / 12), json!({"max_tokens": 5}))
        .to_string()
        .into_bytes()
}

#[tokio::test]
async fn bodies_up_to_the_limit_are_read_and_larger_ones_get_the_openai_shaped_413() {
    // 2 MiB is under the shipped 4 MiB `max_body_bytes`: weir reads all of it, whatever the
    // framing, and judges it (far over the model's context).
    let two_mib = chat_of_size(2 << 20);
    let five_mib = chat_of_size(5 << 20);
    for (i, framing) in [
        None,
        Some(Framing::ChunkedTrailers),
        Some(Framing::H2Trailers),
    ]
    .into_iter()
    .enumerate()
    {
        let id = format!("two-mib-{i}");
        let answer = match framing {
            None => http1("POST", CHAT, "free", &id, &two_mib).await,
            Some(f) => send(f, CHAT, "free", &id, &two_mib).await,
        };
        assert_eq!(
            answer.status,
            400,
            "{framing:?}: {}",
            String::from_utf8_lossy(&answer.body)
        );
        assert_eq!(
            answer.error()["code"],
            "context_length_exceeded",
            "{framing:?}"
        );

        let id = format!("five-mib-{i}");
        let answer = match framing {
            None => http1("POST", CHAT, "free", &id, &five_mib).await,
            Some(f) => send(f, CHAT, "free", &id, &five_mib).await,
        };
        assert_eq!(answer.status, 413, "{framing:?}");
        assert_eq!(answer.header("content-type"), Some("application/json"));
        let err = answer.error();
        assert!(err["code"].is_null(), "{framing:?}: {err}");
        assert_eq!(err["type"], "invalid_request_error", "{framing:?}: {err}");
        assert!(
            err["message"]
                .as_str()
                .unwrap()
                .contains("exceeds the limit of 4194304 bytes"),
            "{framing:?}: {err}"
        );
        assert!(arrived(&id).await.is_empty());
    }
}

#[tokio::test]
async fn envoys_own_refusals_are_openai_shaped_too() {
    // A gateway configured to read more than the listener buffers: Envoy refuses first.
    let mut config = weir_config();
    config["max_body_bytes"] = json!(16 << 20);
    let envoy = Envoy::start(&config, stack().sim.port, stack().sim.port);
    let resp = reqwest::Client::new()
        .post(format!("{}{CHAT}", envoy.url))
        .bearer_auth("key-free")
        .header("content-type", "application/json")
        .body(chat_of_size(9 << 20))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 413);
    assert_eq!(resp.headers()["content-type"], "application/json");
    let err = resp.json::<Value>().await.unwrap()["error"].clone();
    assert!(err["code"].is_null(), "{err}");
    assert_eq!(err["type"], "invalid_request_error", "{err}");
    assert!(
        err["message"]
            .as_str()
            .unwrap()
            .contains("exceeds the limit"),
        "{err}"
    );
    assert!(err["param"].is_null(), "{err}");

    // Headers over Envoy's limit, on the shared stack.
    let big = "x".repeat(100 * 1024);
    let wire = format!(
        "GET /v1/models HTTP/1.1\r\nHost: weir\r\nX-Big: {big}\r\nConnection: close\r\n\r\n"
    );
    let answer = tokio::task::spawn_blocking(move || raw_http1(wire.as_bytes()))
        .await
        .unwrap();
    assert_eq!(answer.status, 431);
    let err = answer.error();
    assert!(err["code"].is_null(), "{err}");
    assert_eq!(err["type"], "invalid_request_error", "{err}");
    assert!(
        err["message"]
            .as_str()
            .unwrap()
            .contains("Request Header Fields Too Large"),
        "{err}"
    );
}

#[tokio::test]
async fn compressed_request_bodies_are_refused_clearly() {
    let body = gzip(chat("hi", json!({"max_tokens": 5})).to_string().as_bytes());
    for encoding in ["gzip", "br", "deflate, gzip"] {
        let id = format!("compressed-{encoding}");
        let wire = [
            format!(
                "POST {CHAT} HTTP/1.1\r\nHost: weir\r\nAuthorization: Bearer key-free\r\n\
                 Content-Type: application/json\r\nContent-Encoding: {encoding}\r\n\
                 X-Request-Id: {id}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                body.len()
            )
            .into_bytes(),
            body.clone(),
        ]
        .concat();
        let answer = tokio::task::spawn_blocking(move || raw_http1(&wire))
            .await
            .unwrap();
        assert_eq!(answer.status, 415, "{encoding}");
        assert_eq!(
            answer.error()["code"],
            "unsupported_content_encoding",
            "{encoding}"
        );
        assert!(arrived(&id).await.is_empty());
    }
}

#[tokio::test]
async fn metered_responses_are_readable_or_charged_their_reservation() {
    // The engine is asked for an uncompressed answer, whatever the client accepts.
    let id = "accepts-gzip";
    let resp = reqwest::Client::new()
        .post(format!("{}{CHAT}", stack().envoy.url))
        .bearer_auth("key-free")
        .header("accept-encoding", "gzip, br")
        .header("x-request-id", id)
        .json(&chat("hi", json!({"max_tokens": 5})))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let seen = arrived(id).await;
    assert_eq!(seen[0]["headers"]["accept-encoding"], "identity");

    // An upstream that compresses anyway: its usage cannot be read, so the reservation (7
    // output tokens), not zero, is what the request is charged.
    let unreadable = || async {
        let stats = stack().envoy.stats().await;
        stats.get("weir.meter.unreadable").copied().unwrap_or(0)
    };
    let before = unreadable().await;
    let id = "compressed-answer";
    let resp = reqwest::Client::new()
        .post(format!("{}/alt{CHAT}", stack().envoy.url))
        .bearer_auth("key-free")
        .header("x-request-id", id)
        .json(&chat("hi", json!({"max_tokens": 7})))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(
        resp.headers()["content-encoding"],
        "gzip",
        "passed on untouched"
    );
    let log = stack().envoy.access_log_for(id);
    assert!(
        log.iter().any(|l| l.contains("tokens_out=7 ")),
        "charged the reservation: {log:?}"
    );
    assert!(unreadable().await > before, "counted as unreadable");

    // The same for a stream: scanned as SSE, gzip bytes hold no event (nor usage) to count, so
    // it would be charged nothing; it is passed on byte for byte and charged its reservation.
    let before = unreadable().await;
    let id = "compressed-stream";
    let body = chat("hi", json!({"max_tokens": 7, "stream": true})).to_string();
    let wire = format!(
        "POST /alt{CHAT} HTTP/1.1\r\nHost: weir\r\nAuthorization: Bearer key-free\r\n\
         Content-Type: application/json\r\nAccept-Encoding: gzip\r\nX-Request-Id: {id}\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    let answer = tokio::task::spawn_blocking(move || raw_http1(wire.as_bytes()))
        .await
        .unwrap();
    assert_eq!(answer.status, 200);
    assert_eq!(answer.header("content-encoding"), Some("gzip"));
    assert_eq!(answer.header("content-type"), Some("text/event-stream"));
    assert!(
        answer.body == compressed_stream(),
        "the compressed stream reached the client untouched: {} bytes, {} sent",
        answer.body.len(),
        compressed_stream().len()
    );
    let log = stack().envoy.access_log_for(id);
    assert!(
        log.iter().any(|l| l.contains("tokens_out=7 ")),
        "a compressed stream is charged its reservation (7 output tokens), never 0: {log:?}"
    );
    assert!(unreadable().await > before, "counted as unreadable");
}

#[tokio::test]
async fn other_framings_and_protocol_tricks_fail_closed() {
    let body = chat("hi", json!({"max_tokens": 2000})).to_string();
    let len = body.len();
    let auth = "Host: weir\r\nAuthorization: Bearer key-free\r\nX-Request-Id: trick";
    for (what, head, with_body, status, code) in [
        (
            "websocket upgrade",
            format!(
                "POST {CHAT} HTTP/1.1\r\n{auth}\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\
                 Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\
                 Content-Length: {len}\r\n\r\n"
            ),
            true,
            403,
            Value::Null,
        ),
        (
            "h2c upgrade (ignored: an ordinary request)",
            format!(
                "POST {CHAT} HTTP/1.1\r\n{auth}\r\nConnection: Upgrade, HTTP2-Settings\r\n\
                 Upgrade: h2c\r\nHTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA\r\n\
                 Content-Length: {len}\r\n\r\n"
            ),
            true,
            400,
            Value::Null,
        ),
        (
            "CONNECT",
            format!("CONNECT weir:443 HTTP/1.1\r\n{auth}\r\n\r\n"),
            false,
            404,
            json!("unknown_path"),
        ),
        (
            "HTTP/1.0",
            format!("POST {CHAT} HTTP/1.0\r\n{auth}\r\nContent-Length: {len}\r\n\r\n"),
            true,
            426,
            Value::Null,
        ),
        (
            "transfer-encoding other than chunked",
            format!("POST {CHAT} HTTP/1.1\r\n{auth}\r\nTransfer-Encoding: gzip, chunked\r\n\r\n"),
            false,
            501,
            Value::Null,
        ),
    ] {
        let mut wire = head.into_bytes();
        if with_body {
            wire.extend(body.as_bytes());
        }
        let answer = tokio::task::spawn_blocking(move || raw_http1(&wire))
            .await
            .unwrap();
        assert_eq!(answer.status, status, "{what}");
        assert_eq!(answer.error()["code"], code, "{what}");
        let kind = if status >= 500 {
            "server_error"
        } else {
            "invalid_request_error"
        };
        assert_eq!(answer.error()["type"], kind, "{what}");
    }
    assert!(arrived("trick").await.is_empty());
}
