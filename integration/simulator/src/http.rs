//! A small, defensive HTTP/1.1 request parser and response writer on top of std::io.
//!
//! Supports keep-alive, `Content-Length` and `Transfer-Encoding: chunked` request bodies,
//! `Expect: 100-continue`, and chunked (SSE) responses. Every malformed input is an error value,
//! never a panic.

use std::io::{self, BufRead, Read, Write};
use std::thread;
use std::time::Duration;

/// Longest accepted request line / header line / chunk-size line.
pub const MAX_LINE: u64 = 16 * 1024;
/// Most header (or trailer) fields accepted.
pub const MAX_HEADERS: usize = 128;
/// Largest accepted request body.
pub const MAX_BODY: usize = 16 * 1024 * 1024;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    pub method: String,
    pub path: String,
    pub query: String,
    pub http10: bool,
    /// Header names are lower-cased; order preserved.
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Request {
    /// First value of a header (name must be lower-case).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }

    /// First value of a query parameter, percent-decoded.
    pub fn query_param(&self, name: &str) -> Option<String> {
        self.query.split('&').find_map(|pair| {
            let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
            if percent_decode(k) == name {
                Some(percent_decode(v))
            } else {
                None
            }
        })
    }

    /// Whether the connection stays open after this request.
    pub fn keep_alive(&self) -> bool {
        let conn = self.header("connection").unwrap_or("").to_ascii_lowercase();
        let has = |t: &str| conn.split(',').any(|x| x.trim() == t);
        if self.http10 {
            has("keep-alive")
        } else {
            !has("close")
        }
    }
}

pub fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'+' => {
                out.push(b' ');
                i += 1;
            }
            b'%' if i + 2 < bytes.len() => {
                let hex = std::str::from_utf8(&bytes[i + 1..i + 3])
                    .ok()
                    .and_then(|h| u8::from_str_radix(h, 16).ok());
                match hex {
                    Some(b) => {
                        out.push(b);
                        i += 3;
                    }
                    None => {
                        out.push(b'%');
                        i += 1;
                    }
                }
            }
            b => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[derive(Debug, PartialEq, Eq)]
pub enum ParseError {
    /// The peer closed the connection cleanly before sending a request.
    Closed,
    /// Malformed request: answer 400 and close.
    Bad(&'static str),
    /// Line, header block or body over the limits: answer 413/431 and close.
    TooLarge(&'static str),
    /// Socket error or timeout: just close.
    Io(io::ErrorKind),
}

/// Reads one line ending in LF (CRLF or bare LF), without the terminator. Returns the number of
/// raw bytes consumed (0 on EOF).
fn read_line<R: BufRead>(r: &mut R, out: &mut Vec<u8>) -> Result<usize, ParseError> {
    out.clear();
    let n = r
        .by_ref()
        .take(MAX_LINE)
        .read_until(b'\n', out)
        .map_err(|e| ParseError::Io(e.kind()))?;
    if n == 0 {
        return Ok(0);
    }
    if out.last() != Some(&b'\n') {
        return Err(if n as u64 >= MAX_LINE {
            ParseError::TooLarge("line too long")
        } else {
            ParseError::Bad("unexpected end of stream")
        });
    }
    out.pop();
    if out.last() == Some(&b'\r') {
        out.pop();
    }
    Ok(n)
}

fn is_tchar(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
}

/// Reads one request (head and body) from `r`. `w` is used only for `100 Continue`.
pub fn read_request<R: BufRead, W: Write>(r: &mut R, w: &mut W) -> Result<Request, ParseError> {
    let mut line = Vec::new();
    let mut empty_lines = 0;
    loop {
        if read_line(r, &mut line)? == 0 {
            return Err(ParseError::Closed);
        }
        if !line.is_empty() {
            break;
        }
        empty_lines += 1;
        if empty_lines > 4 {
            return Err(ParseError::Bad("expected a request line"));
        }
    }
    let text =
        std::str::from_utf8(&line).map_err(|_| ParseError::Bad("request line is not UTF-8"))?;
    let mut parts = text.split(' ');
    let (method, target, version) = match (parts.next(), parts.next(), parts.next(), parts.next()) {
        (Some(m), Some(t), Some(v), None) => (m, t, v),
        _ => return Err(ParseError::Bad("malformed request line")),
    };
    if method.is_empty() || !method.bytes().all(is_tchar) {
        return Err(ParseError::Bad("malformed method"));
    }
    let http10 = match version {
        "HTTP/1.1" => false,
        "HTTP/1.0" => true,
        _ => return Err(ParseError::Bad("unsupported HTTP version")),
    };
    // origin-form, or absolute-form (strip scheme and authority).
    let target = if let Some(rest) = target
        .strip_prefix("http://")
        .or_else(|| target.strip_prefix("https://"))
    {
        match rest.find('/') {
            Some(i) => &rest[i..],
            None => "/",
        }
    } else {
        target
    };
    if !target.starts_with('/') || target.bytes().any(|b| b <= b' ' || b == 0x7f) {
        return Err(ParseError::Bad("malformed request target"));
    }
    let (path, query) = target.split_once('?').unwrap_or((target, ""));
    let (method, path, query) = (method.to_string(), path.to_string(), query.to_string());

    let mut headers: Vec<(String, String)> = Vec::new();
    loop {
        if read_line(r, &mut line)? == 0 {
            return Err(ParseError::Bad("unexpected end of headers"));
        }
        if line.is_empty() {
            break;
        }
        if headers.len() >= MAX_HEADERS {
            return Err(ParseError::TooLarge("too many headers"));
        }
        if line[0] == b' ' || line[0] == b'\t' {
            return Err(ParseError::Bad("obsolete header line folding"));
        }
        let colon = line
            .iter()
            .position(|&b| b == b':')
            .ok_or(ParseError::Bad("header line without colon"))?;
        let name = &line[..colon];
        if name.is_empty() || !name.iter().all(|&b| is_tchar(b)) {
            return Err(ParseError::Bad("malformed header name"));
        }
        let value = String::from_utf8_lossy(&line[colon + 1..])
            .trim()
            .to_string();
        let name = String::from_utf8_lossy(name).to_ascii_lowercase();
        headers.push((name, value));
    }

    let mut req = Request {
        method,
        path,
        query,
        http10,
        headers,
        body: Vec::new(),
    };

    let te = req
        .header("transfer-encoding")
        .map(|s| s.to_ascii_lowercase());
    let cls: Vec<&str> = req
        .headers
        .iter()
        .filter(|(n, _)| n == "content-length")
        .map(|(_, v)| v.as_str())
        .collect();
    let expect_continue = !http10
        && req
            .header("expect")
            .is_some_and(|v| v.eq_ignore_ascii_case("100-continue"));

    if let Some(te) = te {
        if !cls.is_empty() {
            return Err(ParseError::Bad(
                "both transfer-encoding and content-length present",
            ));
        }
        if te.rsplit(',').next().map(str::trim) != Some("chunked") {
            return Err(ParseError::Bad("unsupported transfer-encoding"));
        }
        if expect_continue {
            send_continue(w)?;
        }
        req.body = read_chunked(r)?;
    } else if let Some(first) = cls.first() {
        if cls.iter().any(|v| v != first) {
            return Err(ParseError::Bad("conflicting content-length headers"));
        }
        if first.is_empty() || first.len() > 19 || !first.bytes().all(|b| b.is_ascii_digit()) {
            return Err(ParseError::Bad("invalid content-length"));
        }
        let len: usize = first
            .parse()
            .map_err(|_| ParseError::Bad("invalid content-length"))?;
        if len > MAX_BODY {
            return Err(ParseError::TooLarge("request body too large"));
        }
        if len > 0 {
            if expect_continue {
                send_continue(w)?;
            }
            let mut body = vec![0u8; len];
            r.read_exact(&mut body).map_err(eof_is_bad)?;
            req.body = body;
        }
    }
    Ok(req)
}

fn send_continue<W: Write>(w: &mut W) -> Result<(), ParseError> {
    w.write_all(b"HTTP/1.1 100 Continue\r\n\r\n")
        .and_then(|_| w.flush())
        .map_err(|e| ParseError::Io(e.kind()))
}

fn eof_is_bad(e: io::Error) -> ParseError {
    if e.kind() == io::ErrorKind::UnexpectedEof {
        ParseError::Bad("unexpected end of body")
    } else {
        ParseError::Io(e.kind())
    }
}

/// Decodes a chunked body (chunk extensions ignored, trailers read and discarded).
pub fn read_chunked<R: BufRead>(r: &mut R) -> Result<Vec<u8>, ParseError> {
    let mut body = Vec::new();
    let mut line = Vec::new();
    loop {
        if read_line(r, &mut line)? == 0 {
            return Err(ParseError::Bad("unexpected end of chunked body"));
        }
        let size_text = line.split(|&b| b == b';').next().unwrap_or(&[]);
        let size_text = std::str::from_utf8(size_text)
            .map_err(|_| ParseError::Bad("invalid chunk size"))?
            .trim();
        if size_text.is_empty()
            || size_text.len() > 15
            || !size_text.bytes().all(|b| b.is_ascii_hexdigit())
        {
            return Err(ParseError::Bad("invalid chunk size"));
        }
        let size = usize::from_str_radix(size_text, 16)
            .map_err(|_| ParseError::Bad("invalid chunk size"))?;
        if size == 0 {
            let mut trailers = 0;
            loop {
                if read_line(r, &mut line)? == 0 {
                    return Err(ParseError::Bad("unexpected end of chunked trailers"));
                }
                if line.is_empty() {
                    return Ok(body);
                }
                trailers += 1;
                if trailers > MAX_HEADERS {
                    return Err(ParseError::TooLarge("too many trailers"));
                }
            }
        }
        if body.len().saturating_add(size) > MAX_BODY {
            return Err(ParseError::TooLarge("request body too large"));
        }
        let start = body.len();
        body.resize(start + size, 0);
        r.read_exact(&mut body[start..]).map_err(eof_is_bad)?;
        if read_line(r, &mut line)? == 0 || !line.is_empty() {
            return Err(ParseError::Bad("missing CRLF after chunk data"));
        }
    }
}

pub enum Body {
    Full(Vec<u8>),
    /// Sent with `transfer-encoding: chunked`, one chunk per event, `delay_ms` between events.
    Stream {
        events: Vec<Vec<u8>>,
        delay_ms: u64,
    },
}

pub struct Response {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Body,
}

impl Response {
    pub fn new(status: u16) -> Self {
        Response {
            status,
            headers: Vec::new(),
            body: Body::Full(Vec::new()),
        }
    }

    pub fn json(status: u16, value: &serde_json::Value) -> Self {
        let mut r = Response::new(status);
        r.header("content-type", "application/json");
        r.body = Body::Full(value.to_string().into_bytes());
        r
    }

    pub fn header(&mut self, name: &str, value: impl Into<String>) {
        self.headers.push((name.to_string(), value.into()));
    }
}

pub fn reason(status: u16) -> &'static str {
    match status {
        100 => "Continue",
        200 => "OK",
        400 => "Bad Request",
        401 => "Unauthorized",
        403 => "Forbidden",
        404 => "Not Found",
        405 => "Method Not Allowed",
        408 => "Request Timeout",
        409 => "Conflict",
        413 => "Payload Too Large",
        422 => "Unprocessable Entity",
        429 => "Too Many Requests",
        431 => "Request Header Fields Too Large",
        500 => "Internal Server Error",
        502 => "Bad Gateway",
        503 => "Service Unavailable",
        504 => "Gateway Timeout",
        529 => "Site Overloaded",
        _ => "Unknown",
    }
}

/// Writes a response. `keep_alive` false adds `connection: close`. HTTP/1.0 peers get streams
/// as one body with a content-length.
pub fn write_response<W: Write>(
    w: &mut W,
    resp: Response,
    keep_alive: bool,
    http10: bool,
) -> io::Result<()> {
    write_response_then(w, resp, keep_alive, http10, || {})
}

/// `write_response`, calling `before_last` just before the write that completes the
/// response: a request counted in flight stops being counted before its client can have seen
/// the end of its answer (and sent the next request), so the count never shows an overlap the
/// client could not have caused.
pub fn write_response_then<W: Write>(
    w: &mut W,
    resp: Response,
    keep_alive: bool,
    http10: bool,
    before_last: impl FnOnce(),
) -> io::Result<()> {
    let mut head = format!("HTTP/1.1 {} {}\r\n", resp.status, reason(resp.status));
    for (n, v) in &resp.headers {
        head.push_str(n);
        head.push_str(": ");
        head.push_str(v);
        head.push_str("\r\n");
    }
    if !keep_alive {
        head.push_str("connection: close\r\n");
    } else if http10 {
        head.push_str("connection: keep-alive\r\n");
    }
    let body = match resp.body {
        Body::Stream { events, .. } if http10 => Body::Full(events.concat()),
        b => b,
    };
    match body {
        Body::Full(bytes) => {
            head.push_str(&format!("content-length: {}\r\n\r\n", bytes.len()));
            let mut out = head.into_bytes();
            out.extend_from_slice(&bytes);
            before_last();
            w.write_all(&out)?;
            w.flush()
        }
        Body::Stream { events, delay_ms } => {
            head.push_str("transfer-encoding: chunked\r\n\r\n");
            w.write_all(head.as_bytes())?;
            w.flush()?;
            for (i, ev) in events.iter().enumerate() {
                if i > 0 && delay_ms > 0 {
                    thread::sleep(Duration::from_millis(delay_ms));
                }
                if ev.is_empty() {
                    continue;
                }
                let mut chunk = format!("{:x}\r\n", ev.len()).into_bytes();
                chunk.extend_from_slice(ev);
                chunk.extend_from_slice(b"\r\n");
                w.write_all(&chunk)?;
                w.flush()?;
            }
            before_last();
            w.write_all(b"0\r\n\r\n")?;
            w.flush()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Cursor;

    fn parse(raw: &[u8]) -> Result<Request, ParseError> {
        let mut sink = Vec::new();
        read_request(&mut Cursor::new(raw.to_vec()), &mut sink)
    }

    #[test]
    fn content_length_body() {
        let req = parse(
            b"POST /v1/chat/completions?x=1 HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\n\r\nhello",
        )
        .unwrap();
        assert_eq!(req.method, "POST");
        assert_eq!(req.path, "/v1/chat/completions");
        assert_eq!(req.query, "x=1");
        assert_eq!(req.header("host"), Some("a"));
        assert_eq!(req.body, b"hello");
        assert!(req.keep_alive());
    }

    #[test]
    fn chunked_body_with_extensions_and_trailers() {
        let raw = b"POST /v1/messages HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n5;ext=1\r\nhello\r\nB\r\n, world!!!!\r\n0\r\nX-Trailer: y\r\n\r\n";
        let req = parse(raw).unwrap();
        assert_eq!(req.body, b"hello, world!!!!");
    }

    #[test]
    fn chunked_body_direct() {
        let mut c = Cursor::new(b"3\r\nabc\r\n0\r\n\r\nNEXT".to_vec());
        assert_eq!(read_chunked(&mut c).unwrap(), b"abc");
        let mut rest = String::new();
        c.read_to_string(&mut rest).unwrap();
        assert_eq!(rest, "NEXT");
    }

    #[test]
    fn bad_chunked_bodies() {
        for raw in [
            &b"zz\r\nabc\r\n0\r\n\r\n"[..],
            b"3\r\nabcdef\r\n0\r\n\r\n",
            b"3\r\nab",
            b"",
            b"-1\r\n",
            b"+3\r\nabc\r\n0\r\n\r\n",
        ] {
            assert!(
                matches!(
                    read_chunked(&mut Cursor::new(raw.to_vec())),
                    Err(ParseError::Bad(_))
                ),
                "{:?}",
                String::from_utf8_lossy(raw)
            );
        }
    }

    #[test]
    fn malformed_requests() {
        assert_eq!(parse(b""), Err(ParseError::Closed));
        for raw in [
            &b"GARBAGE\r\n\r\n"[..],
            b"GET / HTTP/2.0\r\n\r\n",
            b"GET / HTTP/1.1\r\nno colon here\r\n\r\n",
            b"POST / HTTP/1.1\r\nContent-Length: abc\r\n\r\n",
            b"POST / HTTP/1.1\r\nContent-Length: 10\r\n\r\nshort",
            b"POST / HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\nab",
            b"POST / HTTP/1.1\r\nTransfer-Encoding: gzip\r\n\r\n",
            b"GET nope HTTP/1.1\r\n\r\n",
            b"GET / HTTP/1.1\r\nHost: a\r\n",
        ] {
            assert!(
                matches!(parse(raw), Err(ParseError::Bad(_))),
                "{:?}",
                String::from_utf8_lossy(raw)
            );
        }
        let huge = format!("GET /{} HTTP/1.1\r\n\r\n", "a".repeat(20_000));
        assert!(matches!(
            parse(huge.as_bytes()),
            Err(ParseError::TooLarge(_))
        ));
    }

    #[test]
    fn keep_alive_rules_and_pipelining() {
        let raw = b"GET /a HTTP/1.1\r\nConnection: close\r\n\r\nGET /b HTTP/1.0\r\n\r\n";
        let mut c = Cursor::new(raw.to_vec());
        let mut sink = Vec::new();
        let a = read_request(&mut c, &mut sink).unwrap();
        assert!(!a.keep_alive());
        let b = read_request(&mut c, &mut sink).unwrap();
        assert_eq!(b.path, "/b");
        assert!(!b.keep_alive());
        assert_eq!(
            read_request(&mut c, &mut sink).unwrap_err(),
            ParseError::Closed
        );
    }

    #[test]
    fn expect_continue_is_answered() {
        let raw = b"POST / HTTP/1.1\r\nExpect: 100-continue\r\nContent-Length: 2\r\n\r\nhi";
        let mut sink = Vec::new();
        let req = read_request(&mut Cursor::new(raw.to_vec()), &mut sink).unwrap();
        assert_eq!(req.body, b"hi");
        assert_eq!(sink, b"HTTP/1.1 100 Continue\r\n\r\n");
    }

    #[test]
    fn query_params() {
        let req = parse(b"GET /x?alt=sse&key=AI%3Aza+b HTTP/1.1\r\n\r\n").unwrap();
        assert_eq!(req.query_param("key").as_deref(), Some("AI:za b"));
        assert_eq!(req.query_param("alt").as_deref(), Some("sse"));
        assert_eq!(req.query_param("nope"), None);
        assert_eq!(percent_decode("%"), "%");
        assert_eq!(percent_decode("a%2"), "a%2");
        assert_eq!(percent_decode("%zz"), "%zz");
    }

    #[test]
    fn writes_chunked_stream() {
        let mut out = Vec::new();
        let mut resp = Response::new(200);
        resp.header("content-type", "text/event-stream");
        resp.body = Body::Stream {
            events: vec![b"data: a\n\n".to_vec(), b"data: [DONE]\n\n".to_vec()],
            delay_ms: 0,
        };
        write_response(&mut out, resp, true, false).unwrap();
        let text = String::from_utf8(out).unwrap();
        assert!(text.starts_with("HTTP/1.1 200 OK\r\n"));
        assert!(text.contains("transfer-encoding: chunked\r\n\r\n9\r\ndata: a\n\n\r\ne\r\ndata: [DONE]\n\n\r\n0\r\n\r\n"));
    }
}
