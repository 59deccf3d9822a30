//! The sidecar's ports over HTTP/2, frame by frame (a raw connection, so the test controls
//! what arrives in one read): one connection carries many tenants' streams, as a gateway's
//! does, so nothing one of them does to its own streams may close it.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a panic is a failed check

use std::time::{Duration, Instant};

use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use weir_e2e::{Sidecar, Sim, vouched};

const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
const DATA: u8 = 0;
const HEADERS: u8 = 1;
const RST_STREAM: u8 = 3;
const SETTINGS: u8 = 4;
const PING: u8 = 6;
const GOAWAY: u8 = 7;
const WINDOW_UPDATE: u8 = 8;
const END_STREAM: u8 = 0x1;
const END_HEADERS: u8 = 0x4;
const ACK: u8 = 0x1;

fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let len = u32::try_from(payload.len()).unwrap().to_be_bytes();
    let mut f = vec![len[1], len[2], len[3], kind, flags];
    f.extend_from_slice(&stream.to_be_bytes());
    f.extend_from_slice(payload);
    f
}

/// An HPACK integer of a 7-bit prefix.
fn hpack_int(mut n: usize, out: &mut Vec<u8>) {
    if n < 127 {
        out.push(n as u8);
        return;
    }
    out.push(127);
    n -= 127;
    while n >= 128 {
        out.push((n % 128) as u8 | 0x80);
        n /= 128;
    }
    out.push(n as u8);
}

/// A header block of literal fields, never indexed nor Huffman-coded.
fn header_block(fields: &[(&str, &str)]) -> Vec<u8> {
    let mut block = Vec::new();
    for (name, value) in fields {
        block.push(0);
        hpack_int(name.len(), &mut block);
        block.extend_from_slice(name.as_bytes());
        hpack_int(value.len(), &mut block);
        block.extend_from_slice(value.as_bytes());
    }
    block
}

/// A chat request's header block, signed for `tenant` when `signed` (as the filter signs).
fn chat_headers(tenant: &str, request_id: &str, signed: bool) -> Vec<u8> {
    let mut fields: Vec<(String, String)> = [
        (":method", "POST"),
        (":scheme", "http"),
        (":path", "/v1/chat/completions"),
        (":authority", "127.0.0.1"),
        ("content-type", "application/json"),
    ]
    .map(|(k, v)| (k.to_owned(), v.to_owned()))
    .to_vec();
    if signed {
        fields.extend(vouched(&format!("acme/w/p/{tenant}"), request_id, &[]));
    }
    let view: Vec<(&str, &str)> = fields
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    header_block(&view)
}

/// What the server sent on a connection, as far as these tests look.
#[derive(Default, Debug)]
struct Seen {
    data: std::collections::HashMap<u32, usize>,
    ended: Vec<u32>,
    resets: Vec<u32>,
    goaway: Option<(u32, Vec<u8>)>,
    closed: bool,
}

/// A raw HTTP/2 connection: the preface and settings sent (the largest windows, so the
/// server is never held by flow control), frames read as they come.
struct Connection {
    tcp: TcpStream,
    buf: Vec<u8>,
    seen: Seen,
}

impl Connection {
    async fn open(port: u16) -> Connection {
        let mut tcp = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
        let mut hello = PREFACE.to_vec();
        // SETTINGS_INITIAL_WINDOW_SIZE (4) at its largest, and the connection's window too.
        let mut settings = 4u16.to_be_bytes().to_vec();
        settings.extend_from_slice(&(u32::MAX >> 1).to_be_bytes());
        hello.extend(frame(SETTINGS, 0, 0, &settings));
        hello.extend(frame(
            WINDOW_UPDATE,
            0,
            0,
            &((u32::MAX >> 1) - 65_535).to_be_bytes(),
        ));
        tcp.write_all(&hello).await.unwrap();
        Connection {
            tcp,
            buf: Vec::new(),
            seen: Seen::default(),
        }
    }

    async fn send(&mut self, bytes: &[u8]) {
        self.tcp.write_all(bytes).await.unwrap();
    }

    /// Reads frames until `done` holds of what was seen, the connection closes, or `limit`
    /// passes.
    async fn read_until(&mut self, limit: Duration, done: impl Fn(&Seen) -> bool) {
        let deadline = Instant::now() + limit;
        while !done(&self.seen) && !self.seen.closed {
            let mut chunk = [0u8; 16_384];
            let left = deadline.saturating_duration_since(Instant::now());
            let Ok(read) = tokio::time::timeout(left, self.tcp.read(&mut chunk)).await else {
                return;
            };
            match read {
                Ok(0) | Err(_) => self.seen.closed = true,
                Ok(n) => self.buf.extend_from_slice(&chunk[..n]),
            }
            self.parse().await;
        }
    }

    async fn parse(&mut self) {
        while self.buf.len() >= 9 {
            let len = u32::from_be_bytes([0, self.buf[0], self.buf[1], self.buf[2]]) as usize;
            if self.buf.len() < 9 + len {
                return;
            }
            let (kind, flags) = (self.buf[3], self.buf[4]);
            let stream = u32::from_be_bytes(self.buf[5..9].try_into().unwrap()) & 0x7fff_ffff;
            let payload: Vec<u8> = self.buf.drain(..9 + len).skip(9).collect();
            match kind {
                DATA => *self.seen.data.entry(stream).or_default() += len,
                RST_STREAM => self.seen.resets.push(stream),
                GOAWAY => {
                    let last = u32::from_be_bytes(payload[..4].try_into().unwrap());
                    self.seen.goaway = Some((last, payload[4..].to_vec()));
                }
                SETTINGS if flags & ACK == 0 => self.send(&frame(SETTINGS, ACK, 0, &[])).await,
                PING if flags & ACK == 0 => self.send(&frame(PING, ACK, 0, &payload)).await,
                _ => {}
            }
            if matches!(kind, DATA | HEADERS) && flags & END_STREAM != 0 {
                self.seen.ended.push(stream);
            }
        }
    }
}

#[tokio::test]
async fn one_peers_burst_of_reset_streams_does_not_cut_the_other_streams_on_its_connection() {
    // Answers at an 8B model's pace: the victims are still streaming when the burst comes.
    let sim = Sim::start(&[
        "--preset",
        "llama-3.1-8b",
        "--served-model-name",
        "tiny",
        "--output-len",
        "fixed:200",
    ]);
    let sidecar = Sidecar::start(json!({"pools": [{"model": "tiny", "replicas": [sim.url]}]}));
    sidecar.wait_for_probes(1);
    let mut conn = Connection::open(sidecar.port).await;
    let body = json!({"model": "tiny", "stream": true, "max_tokens": 200,
        "messages": [{"role": "user", "content": "go on"}]})
    .to_string();
    let run = format!("{}", std::process::id());
    let victims = [1u32, 3, 5];
    for (i, &stream) in victims.iter().enumerate() {
        let mut request = frame(
            HEADERS,
            END_HEADERS,
            stream,
            &chat_headers("victim", &format!("victim-{run}-{i}"), true),
        );
        request.extend(frame(DATA, END_STREAM, stream, body.as_bytes()));
        conn.send(&request).await;
    }
    conn.read_until(Duration::from_secs(10), |seen| {
        victims.iter().all(|v| seen.data.contains_key(v))
    })
    .await;
    assert!(
        victims.iter().all(|v| conn.seen.data.contains_key(v)),
        "the victims stream: {:?}",
        conn.seen
    );

    // Another tenant's requests, each cancelled as soon as sent (as Envoy resets the streams
    // of callers that left), all arriving in one read: more than h2's default of 20.
    let mut burst = Vec::new();
    for stream in (7u32..).step_by(2).take(40) {
        burst.extend(frame(
            HEADERS,
            END_HEADERS,
            stream,
            &chat_headers("leaver", "", false),
        ));
        burst.extend(frame(RST_STREAM, 0, stream, &8u32.to_be_bytes()));
    }
    conn.send(&burst).await;

    conn.read_until(Duration::from_secs(30), |seen| {
        seen.goaway.is_some() || victims.iter().all(|v| seen.ended.contains(v))
    })
    .await;
    assert_eq!(
        conn.seen.goaway, None,
        "the connection was closed on everyone"
    );
    assert!(
        victims.iter().all(|v| conn.seen.ended.contains(v)),
        "every victim's stream ran to its end: {:?}",
        conn.seen
    );
    let rows = weir_e2e::wait_for(Duration::from_secs(5), || {
        let rows = sidecar.ledger_rows(Some("acme/w/p/victim"));
        (rows.len() == victims.len()).then_some(rows)
    })
    .unwrap_or_default();
    let outcomes: Vec<&str> = rows.iter().map(|r| r.outcome.as_str()).collect();
    assert_eq!(outcomes, ["ok"; 3], "{rows:?}");
}

#[tokio::test]
async fn the_admin_port_speaks_http1_only_and_the_serving_port_http2_too() {
    let sim = Sim::start_tiny_fast(&[]);
    let sidecar = Sidecar::start(json!({"pools": [{"model": "tiny", "replicas": [sim.url]}]}));
    let admin_port: u16 = sidecar.admin.rsplit(':').next().unwrap().parse().unwrap();
    // Over HTTP/2 a reader that never takes its answers could have a `/metrics` page
    // buffered for each of 200 streams of one connection; over HTTP/1.1 there is one.
    let first_bytes = |port: u16| async move {
        let mut tcp = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
        let mut hello = PREFACE.to_vec();
        hello.extend(frame(SETTINGS, 0, 0, &[]));
        tcp.write_all(&hello).await.unwrap();
        let mut reply = vec![0u8; 64];
        let n = tokio::time::timeout(Duration::from_secs(5), tcp.read(&mut reply))
            .await
            .unwrap()
            .unwrap();
        reply.truncate(n);
        reply
    };
    let admin = first_bytes(admin_port).await;
    assert!(
        admin.is_empty() || admin.starts_with(b"HTTP/1.1 "),
        "the admin port answered HTTP/2's preface with {:?}",
        String::from_utf8_lossy(&admin)
    );
    let serving = first_bytes(sidecar.port).await;
    assert!(
        serving.len() >= 9 && serving[3] == SETTINGS,
        "the serving port answers HTTP/2's preface with its settings: {serving:?}"
    );
}
