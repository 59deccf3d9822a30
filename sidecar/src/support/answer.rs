//! Engines' answers to weir's own requests — metrics scrapes, the limits read when a replica
//! joins, isolation probes — read whole, but never past a bound: an engine is not trusted, and
//! an answer of gigabytes (hostile or broken) must not grow the sidecar's memory by that much
//! ten times a second.

/// The most weir reads of one answer: a vLLM exposition is about 50 KB, llama.cpp's `/props`
/// a few KB with its chat template, a probe's completion less.
pub const MAX_ANSWER_BYTES: usize = 8 << 20;

/// The whole body of `resp`, or `None` when it says or turns out to be longer than `max`
/// bytes, or breaks off.
pub async fn read_bounded(mut resp: reqwest::Response, max: usize) -> Option<Vec<u8>> {
    if resp.content_length().is_some_and(|n| n > max as u64) {
        return None;
    }
    let mut body = Vec::new();
    while let Some(chunk) = resp.chunk().await.ok()? {
        if body.len() + chunk.len() > max {
            return None;
        }
        body.extend_from_slice(&chunk);
    }
    Some(body)
}
