//! Why a Consul request failed. Every message names the address it was sent to and never
//! a request header (the ACL token travels in one).

use std::time::Duration;

/// Why a query failed; the text is what the operator reports.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum QueryError {
    #[error("Consul at {address} rejected the request: ACL token rejected ({body})")]
    Forbidden { address: String, body: String },
    #[error("Consul at {address} is rate limiting (429 Too Many Requests)")]
    RateLimited { address: String, retry_after: Option<Duration> },
    #[error("Consul at {address} answered {status}: {body}")]
    Status { address: String, status: u16, body: String },
    #[error("cannot reach Consul at {address}: {cause}")]
    Network { address: String, cause: String },
    #[error("cannot reach Consul at {address}: {cause}")]
    Tls { address: String, cause: String },
    #[error("Consul at {address} sent an unreadable answer: {cause}")]
    Body { address: String, cause: String },
    #[error(
        "Consul at {address} answered {status} redirecting elsewhere; redirects are not followed (the token would go with them)"
    )]
    Redirect { address: String, status: u16 },
    #[error("Consul at {address} sent an answer larger than {limit} bytes (--consul-max-response-bytes)")]
    TooLarge { address: String, limit: usize },
}

impl QueryError {
    /// The request did not reach the server, or got no answer from it (refused, reset,
    /// timed out, no address): the server may be down. Not a TLS setup that fails, nor any
    /// answer, which are the request's own.
    pub(crate) fn unreachable(&self) -> bool {
        matches!(self, QueryError::Network { .. })
    }

    /// What went wrong, without the address (the caller names its own).
    pub(crate) fn cause(&self) -> String {
        match self {
            QueryError::Network { cause, .. } | QueryError::Tls { cause, .. } | QueryError::Body { cause, .. } => {
                cause.clone()
            }
            other => other.to_string(),
        }
    }

    /// Consul refused the query itself (a 4xx other than 429: a rejected token, a `filter` it
    /// cannot parse): the same query will be refused again, whatever the backoff.
    pub(crate) fn refused(&self) -> bool {
        match self {
            QueryError::Forbidden { .. } => true,
            QueryError::Status { status, .. } => (400..500).contains(status),
            _ => false,
        }
    }

    /// A delay the server asked for (Retry-After), if any.
    pub(crate) fn retry_after(&self) -> Option<Duration> {
        match self {
            QueryError::RateLimited { retry_after, .. } => *retry_after,
            _ => None,
        }
    }
}

/// An error with its sources, which is where h2 and rustls put the useful part ("connection
/// refused").
pub(crate) fn cause_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        let t = c.to_string();
        if !s.contains(&t) {
            s.push_str(": ");
            s.push_str(&t);
        }
        cur = c.source();
    }
    s
}
