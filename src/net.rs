//! What every HTTP client of the crate shares (MDMA's, merod's, the metadata server's): which
//! URLs are loopback (never sent through a proxy), the one capped read of an answer's body,
//! and the one reading of a `Retry-After`.

use std::time::{Duration, SystemTime};

use url::Url;

/// The wait an answer's `Retry-After` header asks for, from `now` (the wall clock when it
/// came): delay-seconds (`"30"`), or an HTTP date less `now` (a date already past is zero).
/// `None` when absent, named twice, or unreadable (a negative or fractional number, a date
/// in no HTTP format): no wait is read into garbage. Not bounded here: whoever waits bounds
/// it (see `backoff::asked_wait`).
pub(crate) fn retry_after(
    headers: &reqwest::header::HeaderMap,
    now: SystemTime,
) -> Option<Duration> {
    let mut values = headers.get_all(reqwest::header::RETRY_AFTER).iter();
    let value = values.next()?;
    if values.next().is_some() {
        return None;
    }
    let text = value.to_str().ok()?.trim();
    if !text.is_empty() && text.bytes().all(|b| b.is_ascii_digit()) {
        // More digits than a u64 holds: as long as can be said (the waiter bounds it).
        return Some(Duration::from_secs(text.parse().unwrap_or(u64::MAX)));
    }
    let at = httpdate::parse_http_date(text).ok()?;
    Some(at.duration_since(now).unwrap_or(Duration::ZERO))
}

/// Whether `url`'s host is loopback: `localhost` (and `*.localhost`, a trailing dot allowed,
/// any case), 127.0.0.0/8, `::1`. Calls to such a host never use the environment's proxies.
pub(crate) fn is_loopback(url: &Url) -> bool {
    match url.host() {
        Some(url::Host::Domain(d)) => {
            let d = d.trim_end_matches('.').to_ascii_lowercase();
            d == "localhost" || d.ends_with(".localhost")
        }
        Some(url::Host::Ipv4(ip)) => ip.is_loopback(),
        Some(url::Host::Ipv6(ip)) => ip.is_loopback(),
        None => false,
    }
}

/// Why an answer's body could not be read by [`read_capped`].
#[derive(Debug)]
pub(crate) enum BodyError {
    /// Announced or found larger than the cap (bytes); refused without reading it whole.
    TooLarge {
        /// The cap, in bytes.
        limit: usize,
    },
    /// The connection failed while reading.
    Transport(reqwest::Error),
}

impl BodyError {
    /// The caller's own error for it: `too_large` with the reason (`larger than N bytes`),
    /// or `transport` with the connection's error.
    pub(crate) fn into_error<E>(
        self,
        too_large: impl FnOnce(String) -> E,
        transport: impl FnOnce(reqwest::Error) -> E,
    ) -> E {
        match self {
            BodyError::TooLarge { limit } => too_large(format!("larger than {limit} bytes")),
            BodyError::Transport(e) => transport(e),
        }
    }
}

/// Reads `resp`'s body whole, at most `limit` bytes: one announced (`Content-Length`) or
/// found larger is refused without reading further. Room for the announced length (≤ the
/// cap) is taken at once, so a large answer is not doubled and copied as its chunks arrive.
/// The caller bounds the time (the request's deadline).
///
/// Errors: [`BodyError::TooLarge`], [`BodyError::Transport`].
pub(crate) async fn read_capped(
    resp: reqwest::Response,
    limit: usize,
) -> Result<Vec<u8>, BodyError> {
    // Room for an announced length only within the cap: a larger one is refused by
    // `each_chunk` before any byte is read, and must not be allocated first.
    let room = resp
        .content_length()
        .and_then(|n| usize::try_from(n).ok())
        .filter(|&n| n <= limit)
        .unwrap_or(0);
    let mut bytes = Vec::with_capacity(room);
    each_chunk(resp, limit, |chunk| bytes.extend_from_slice(&chunk)).await?;
    Ok(bytes)
}

/// [`read_capped`], but the body stays in the chunks it arrived in (no copy into one
/// buffer), and each is handed to `seen` first (a digest computed while the body streams
/// in, with no second pass). For a large answer that is usually dropped unread (one whose
/// digest says it is the last one again): its bytes are neither copied nor put in pages
/// of their own.
///
/// Errors: as [`read_capped`].
pub(crate) async fn read_capped_chunks(
    resp: reqwest::Response,
    limit: usize,
    mut seen: impl FnMut(&[u8]),
) -> Result<Chunks, BodyError> {
    let mut chunks = Vec::new();
    each_chunk(resp, limit, |chunk| {
        seen(&chunk);
        chunks.push(chunk);
    })
    .await?;
    Ok(Chunks(chunks))
}

/// The one capped read of a body: each chunk to `take` as it arrives, refusing a body
/// announced or found larger than `limit` bytes.
async fn each_chunk(
    mut resp: reqwest::Response,
    limit: usize,
    mut take: impl FnMut(bytes::Bytes),
) -> Result<(), BodyError> {
    let too_large = BodyError::TooLarge { limit };
    if resp.content_length().is_some_and(|n| n > limit as u64) {
        return Err(too_large);
    }
    let mut read = 0usize;
    while let Some(chunk) = resp.chunk().await.map_err(BodyError::Transport)? {
        read += chunk.len();
        if read > limit {
            return Err(too_large);
        }
        take(chunk);
    }
    Ok(())
}

/// A body as it arrived, chunk by chunk ([`read_capped_chunks`]).
#[derive(Debug, Default)]
pub(crate) struct Chunks(Vec<bytes::Bytes>);

impl Chunks {
    /// The body in one piece: as it came when it came in one chunk, else copied into one
    /// buffer, each chunk freed once copied (the body is not held twice over).
    pub(crate) fn into_contiguous(self) -> bytes::Bytes {
        let mut chunks = self.0;
        if chunks.len() == 1 {
            return chunks.pop().unwrap_or_default();
        }
        let mut whole = Vec::with_capacity(chunks.iter().map(bytes::Bytes::len).sum());
        for chunk in chunks {
            whole.extend_from_slice(&chunk);
        }
        whole.into()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use reqwest::header::{HeaderMap, HeaderValue, RETRY_AFTER};

    #[test]
    fn retry_after_is_seconds_or_an_http_date_and_nothing_else() {
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_445_412_480);
        let read = |values: &[&str]| {
            let mut headers = HeaderMap::new();
            for v in values {
                headers.append(RETRY_AFTER, HeaderValue::from_str(v).unwrap());
            }
            retry_after(&headers, now)
        };
        assert_eq!(read(&["30"]), Some(Duration::from_secs(30)));
        assert_eq!(read(&[" 0 "]), Some(Duration::ZERO));
        assert_eq!(
            read(&["99999999999999999999999"]),
            Some(Duration::from_secs(u64::MAX))
        );
        // 2015-10-21 07:28:00 UTC is `now`; 07:28:30 is 30 s on; an earlier one is now.
        assert_eq!(
            read(&["Wed, 21 Oct 2015 07:28:30 GMT"]),
            Some(Duration::from_secs(30))
        );
        assert_eq!(
            read(&["Wed, 21 Oct 2015 07:00:00 GMT"]),
            Some(Duration::ZERO)
        );
        for garbage in ["-5", "1.5", "soon", "", "30s"] {
            assert_eq!(read(&[garbage]), None, "{garbage:?}");
        }
        assert_eq!(read(&[]), None);
        assert_eq!(read(&["30", "60"]), None, "named twice");
    }

    /// A server announcing a body of 1 TB: refused as too large, and nothing of that size
    /// is allocated first (that would abort the process).
    #[tokio::test]
    async fn an_announced_length_over_the_cap_is_refused_before_any_room_is_taken() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}/", listener.local_addr().unwrap());
        tokio::spawn(async move {
            let (mut conn, _) = listener.accept().await.unwrap();
            let mut buf = [0u8; 1024];
            let _ = conn.read(&mut buf).await;
            let head = "HTTP/1.1 200 OK\r\ncontent-length: 1000000000000\r\n\r\n{}";
            let _ = conn.write_all(head.as_bytes()).await;
            // Held open: the client must not wait for the rest.
            tokio::time::sleep(Duration::from_secs(30)).await;
        });
        let client = reqwest::Client::builder().no_proxy().build().unwrap();
        let resp = tokio::time::timeout(Duration::from_secs(10), client.get(&url).send())
            .await
            .unwrap()
            .unwrap();
        let read = tokio::time::timeout(Duration::from_secs(10), read_capped(resp, 1024))
            .await
            .unwrap();
        assert!(matches!(read, Err(BodyError::TooLarge { limit: 1024 })));
    }

    #[test]
    fn loopback_hosts_are_localhost_127_8_and_ipv6_one() {
        for url in [
            "http://localhost:1/",
            "http://LocalHost./",
            "http://node.localhost/",
            "http://127.0.0.1/",
            "http://127.9.8.7/",
            "http://[::1]:2528/",
        ] {
            assert!(is_loopback(&Url::parse(url).unwrap()), "{url}");
        }
        for url in [
            "http://localhost.example/",
            "http://10.0.0.1/",
            "http://[::2]/",
            "https://mdma.example/",
        ] {
            assert!(!is_loopback(&Url::parse(url).unwrap()), "{url}");
        }
    }
}
