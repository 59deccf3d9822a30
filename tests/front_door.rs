//! The front door holds whatever the framing, the spelling of the path or the size of the body:
//! real Envoy (shipped template) with the built filter, in front of the simulator, on loopback.
//! HTTP/2 requests are sent with prior knowledge (h2c), HTTP/1.1 chunked ones over raw TCP, so
//! trailers and odd paths reach Envoy exactly as an attacker would send them.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a panic is a failed check

use std::io::{Read, Write};
use std::sync::OnceLock;

use bytes::Bytes;
use serde_json::{Value, json};
use weir_core::keys::hash_key;
use weir_e2e::{Envoy, Sim};

struct Stack {
    sim: Sim,
    envoy: Envoy,
}

/// Each test owns a key; `free` is the free tier of the shipped example (1,024 output tokens per
/// request). The body limit is the shipped default.
fn weir_config() -> Value {
    let key = |id: &str, limits: Value| json!({"id": id, "sha256": hash_key(&format!("key-{id}")), "limits": limits});
    json!({
        "orgs": [{"id": "initech", "policy": {"tier": "free"}, "workspaces": [{"id": "default", "projects": [{"id": "trial", "keys": [
            key("free", json!({"max_output_tokens": 1024})),
        ]}]}]}],
        "models": {"tiny": {"max_context_tokens": 4096}},
        "routes": {"by_name": {"shadowed": {"mode": "shadow"}}},
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
        let envoy = Envoy::start(&weir_config(), sim.port, sim.port);
        Stack { sim, envoy }
    })
}

fn addr() -> String {
    stack().envoy.url.trim_start_matches("http://").to_owned()
}

fn chat(content: &str, extra: Value) -> Value {
    let mut body = json!({"model": "tiny", "messages": [{"role": "user", "content": content}]});
    body.as_object_mut()
        .unwrap()
        .extend(extra.as_object().unwrap().clone());
    body
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
    if let Some(body) = body {
        stream
            .send_data(Bytes::copy_from_slice(body), false)
            .unwrap();
    }
    let mut trailers = http::HeaderMap::new();
    trailers.insert("x-checksum", "feedface".parse().unwrap());
    stream.send_trailers(trailers).unwrap();
    let response = response.await.unwrap();
    let status = response.status().as_u16();
    let headers = response
        .headers()
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_str().unwrap_or_default().to_owned()))
        .collect();
    let mut recv = response.into_body();
    let mut out = Vec::new();
    while let Some(chunk) = recv.data().await {
        let chunk = chunk.unwrap();
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
    conn.write_all(wire).unwrap();
    let mut response = Vec::new();
    let mut buf = [0u8; 65536];
    let mut read_more = |response: &mut Vec<u8>| {
        let n = conn.read(&mut buf).unwrap();
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
    stack()
        .sim
        .received()
        .await
        .into_iter()
        .filter(|r| r["headers"]["x-request-id"] == id)
        .collect()
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
        let body = chat("a short one", json!({"max_tokens": 5})).to_string();
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
        assert_eq!(headers["x-weir-reserved-output"], "5", "{framing:?}");
        assert!(
            headers["x-weir-input-tokens"]
                .as_str()
                .and_then(|t| t.parse::<u64>().ok())
                .is_some_and(|t| t > 0),
            "{framing:?}: {headers}"
        );
        assert_eq!(seen[0]["body"]["messages"][0]["content"], "a short one");
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

/// Every request this binary sent that reached the engine carried a completed admission.
async fn nothing_reached_the_engine_unmetered() {
    for r in stack().sim.received().await {
        let h = &r["headers"];
        assert!(
            h["x-weir-tenant"].is_string() && h["x-weir-reserved-output"].is_string(),
            "reached the engine unmetered: {} {h}",
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
        "/v1/responses",
        "/v1/embeddings",
        "/v1/messages",
        "/invocations",
        "/v1/audio/transcriptions",
        "/tokenize",
        "/pooling",
        "/score",
        "/rerank",
        "/v1/rerank",
        "/V1/Responses/",
        "//v1//embeddings",
        "/v1/x/../messages",
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
        "/shadow/v1/embeddings",
        "free",
        "shadow-embeddings",
        body.as_bytes(),
    )
    .await;
    assert_eq!(
        shadow.header("x-weir-shadow"),
        Some("would-reject; reason=not_metered")
    );
    nothing_reached_the_engine_unmetered().await;
}
