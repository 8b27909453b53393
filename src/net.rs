//! What every HTTP client of the crate shares (MDMA's, merod's, the metadata server's): which
//! URLs are loopback (never sent through a proxy) and the one capped read of an answer's body.

use url::Url;

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
    mut resp: reqwest::Response,
    limit: usize,
) -> Result<Vec<u8>, BodyError> {
    let too_large = BodyError::TooLarge { limit };
    let announced = resp.content_length();
    if announced.is_some_and(|n| n > limit as u64) {
        return Err(too_large);
    }
    let mut bytes = Vec::with_capacity(announced.map_or(0, |n| usize::try_from(n).unwrap_or(0)));
    while let Some(chunk) = resp.chunk().await.map_err(BodyError::Transport)? {
        if bytes.len() + chunk.len() > limit {
            return Err(too_large);
        }
        bytes.extend_from_slice(&chunk);
    }
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

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
