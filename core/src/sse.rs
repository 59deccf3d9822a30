//! Server-sent-event framing as a client's parser reads it (the HTML standard's event-stream
//! parsing): a line ends at CRLF, LF or a lone CR, and an event at an empty line. The meters and
//! the sidecar's resume splice frame streams with these alone, so the events they count, hide
//! and cut at are the events a client's SDK dispatches, whatever line endings an engine mixes.

use std::borrow::Cow;

/// The first line of `buf`: where its text ends and where its line ending does; `None` without
/// a line ending.
fn line_end(buf: &[u8]) -> Option<(usize, usize)> {
    let i = buf.iter().position(|&b| b == b'\n' || b == b'\r')?;
    let crlf = buf.get(i..i + 2) == Some(b"\r\n");
    Some((i, i + 1 + usize::from(crlf)))
}

/// End (exclusive) of the first event in `buf`: just past the empty line that ends it, in one
/// pass. A CR as the last byte is no line ending yet (an LF after it would make it a CRLF), so
/// where events end never depends on how the stream was chunked.
pub fn event_end(buf: &[u8]) -> Option<usize> {
    let mut at = 0;
    loop {
        let rest = buf.get(at..)?;
        let (text, end) = line_end(rest)?;
        if end == rest.len() && rest.last() == Some(&b'\r') {
            return None;
        }
        at += end;
        if text == 0 {
            return Some(at);
        }
    }
}

/// The lines of an event (or of the unended rest of a stream): each line's text and its line
/// ending (none for an unended last line).
pub fn lines(event: &[u8]) -> impl Iterator<Item = (&[u8], &[u8])> {
    let mut rest = event;
    std::iter::from_fn(move || {
        let (text, end) = line_end(rest).unwrap_or((rest.len(), rest.len()));
        let (line, after) = rest.split_at_checked(end)?;
        if line.is_empty() {
            return None;
        }
        rest = after;
        line.split_at_checked(text)
    })
}

/// The concatenated `data:` lines of an event, if any (borrowed when there is one).
pub fn event_data(event: &[u8]) -> Option<Cow<'_, [u8]>> {
    let mut data: Option<Cow<'_, [u8]>> = None;
    for (line, _) in lines(event) {
        if let Some(value) = line.strip_prefix(b"data:") {
            let value = value.strip_prefix(b" ").unwrap_or(value);
            match &mut data {
                None => data = Some(Cow::Borrowed(value)),
                // Lines join with `\n`, none before the first non-empty one (as before the
                // data was borrowed).
                Some(d) => {
                    let d = d.to_mut();
                    if !d.is_empty() {
                        d.push(b'\n');
                    }
                    d.extend_from_slice(value);
                }
            }
        }
    }
    data
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Where the first event of `buf` ends as the standard reads it, found another way: the
    /// shortest prefix that holds an empty line once its line endings are spelled as LFs (CRLF
    /// first, then lone CRs), taking in the LF of a CRLF it stops inside; unknown while it
    /// stops at a CR the buffer ends with.
    fn standard_event_end(buf: &[u8]) -> Option<usize> {
        let lf = |b: &[u8]| {
            String::from_utf8_lossy(b)
                .replace("\r\n", "\n")
                .replace('\r', "\n")
        };
        let n = (1..=buf.len()).find(|&n| {
            let text = lf(&buf[..n]);
            text.starts_with('\n') || text.contains("\n\n")
        })?;
        match (buf[n - 1], buf.get(n)) {
            (b'\r', Some(b'\n')) => Some(n + 1),
            (b'\r', None) => None,
            _ => Some(n),
        }
    }

    #[test]
    fn an_event_ends_at_its_first_empty_line_for_every_run_of_line_endings() {
        let alphabet = [b'\r', b'\n', b'a'];
        for len in 0..=9u32 {
            for n in 0..3usize.pow(len) {
                let buf: Vec<u8> = (0..len).map(|i| alphabet[n / 3usize.pow(i) % 3]).collect();
                assert_eq!(event_end(&buf), standard_event_end(&buf), "{buf:?}");
            }
        }
        for (stream, first) in [
            ("data: a\n\ndata: b\n\n", "data: a\n\n"),
            ("data: a\r\n\r\ndata: b", "data: a\r\n\r\n"),
            ("data: a\n\r\ndata: b", "data: a\n\r\n"),
            ("data: a\r\n\ndata: b", "data: a\r\n\n"),
            ("data: a\r\rdata: b", "data: a\r\r"),
        ] {
            assert_eq!(
                event_end(stream.as_bytes()),
                Some(first.len()),
                "{stream:?}"
            );
        }
    }

    #[test]
    fn an_events_data_lines_join_with_no_break_before_the_first_non_empty_one() {
        let data = |event: &str| event_data(event.as_bytes()).map(|d| d.into_owned());
        assert_eq!(data("data: {}\n\n").as_deref(), Some(&b"{}"[..]));
        assert_eq!(data("data:\ndata: {}\n\n").as_deref(), Some(&b"{}"[..]));
        assert_eq!(
            data("data: a\ndata:\ndata: b\n\n").as_deref(),
            Some(&b"a\n\nb"[..])
        );
        assert_eq!(
            data("data: a\rdata: b\r\n\r").as_deref(),
            Some(&b"a\nb"[..])
        );
        assert_eq!(data("event: ping\n\n"), None);
    }

    #[test]
    fn an_events_lines_keep_their_endings() {
        let lines: Vec<_> = lines(b"a\r\nb\rc\n\nd").collect();
        let want: [(&[u8], &[u8]); 5] = [
            (b"a", b"\r\n"),
            (b"b", b"\r"),
            (b"c", b"\n"),
            (b"", b"\n"),
            (b"d", b""),
        ];
        assert_eq!(lines, want);
    }
}
