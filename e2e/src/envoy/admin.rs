//! A blocking GET on Envoy's admin interface, callable from sync tests and from async ones
//! alike (no runtime of its own). HTTP/1.1 with `Connection: close`: Envoy refuses HTTP/1.0
//! by default, and answers most admin pages chunked.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use anyhow::{Context, bail};

/// `(status, body)` of `GET path`.
pub(super) fn get(addr: SocketAddr, path: &str) -> anyhow::Result<(u16, String)> {
    let mut stream = TcpStream::connect_timeout(&addr, Duration::from_secs(2))
        .with_context(|| format!("connecting to Envoy's admin on {addr}"))?;
    stream.set_read_timeout(Some(Duration::from_secs(10)))?;
    write!(stream, "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n")?;
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw).with_context(|| format!("reading GET {path} from Envoy's admin"))?;
    parse(&raw).with_context(|| format!("GET {path} from Envoy's admin"))
}

fn parse(raw: &[u8]) -> anyhow::Result<(u16, String)> {
    let end = raw.windows(4).position(|w| w == b"\r\n\r\n").context("no end of headers")?;
    let head = String::from_utf8_lossy(&raw[..end]);
    let body = &raw[end + 4..];
    let status = head.split(' ').nth(1).and_then(|s| s.parse().ok()).context("no status line")?;
    let chunked = head.lines().any(|l| {
        l.split_once(':').is_some_and(|(name, value)| {
            name.eq_ignore_ascii_case("transfer-encoding") && value.trim().eq_ignore_ascii_case("chunked")
        })
    });
    let body = if chunked { dechunk(body)? } else { body.to_vec() };
    Ok((status, String::from_utf8_lossy(&body).into_owned()))
}

fn dechunk(mut rest: &[u8]) -> anyhow::Result<Vec<u8>> {
    let mut body = Vec::new();
    loop {
        let eol = rest.windows(2).position(|w| w == b"\r\n").context("chunk size")?;
        let size = String::from_utf8_lossy(&rest[..eol]);
        let size = usize::from_str_radix(size.split(';').next().unwrap_or("").trim(), 16).context("chunk size")?;
        if size == 0 {
            return Ok(body);
        }
        let data = &rest[eol + 2..];
        if data.len() < size {
            bail!("chunk of {size} bytes cut short");
        }
        body.extend_from_slice(&data[..size]);
        rest = data[size..].strip_prefix(b"\r\n").context("chunk end")?;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunked_and_plain_answers_are_read() {
        let chunked = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n4\r\nLIVE\r\n1\r\n\n\r\n0\r\n\r\n";
        assert_eq!(parse(chunked).unwrap(), (200, "LIVE\n".to_owned()));
        let plain = b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 16\r\n\r\nPRE_INITIALIZING";
        assert_eq!(parse(plain).unwrap(), (503, "PRE_INITIALIZING".to_owned()));
    }
}
