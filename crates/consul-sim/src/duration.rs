//! Go's `time.ParseDuration`, and Consul's rules for turning `?wait=` into a timeout.
//!
//! `humantime` is not a substitute: it accepts bare numbers and spaces and rejects some of Go's
//! forms (`1.5h`, `5.s`, `µs`). Consul answers 400 `Invalid wait time` exactly when Go's
//! parser fails, so this is a line-by-line port of `time.ParseDuration` (Go 1.22).

use std::fmt;
use std::time::Duration;

/// Consul's default blocking wait when `wait` is absent, zero or negative.
pub const DEFAULT_WAIT: Duration = Duration::from_secs(5 * 60);
/// Consul's maximum blocking wait; larger values are capped.
pub const MAX_WAIT: Duration = Duration::from_secs(10 * 60);

/// Why a duration string was rejected (mirrors Go's error texts).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DurationError {
    input: String,
    reason: &'static str,
}

impl fmt::Display for DurationError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "time: {} {:?}", self.reason, self.input)
    }
}

impl std::error::Error for DurationError {}

const NANOSECOND: u64 = 1;
const MICROSECOND: u64 = 1_000 * NANOSECOND;
const MILLISECOND: u64 = 1_000 * MICROSECOND;
const SECOND: u64 = 1_000 * MILLISECOND;
const MINUTE: u64 = 60 * SECOND;
const HOUR: u64 = 60 * MINUTE;
const LIMIT: u64 = 1 << 63;

fn unit_nanos(unit: &str) -> Option<u64> {
    Some(match unit {
        "ns" => NANOSECOND,
        // U+00B5 micro sign and U+03BC Greek small letter mu, as Go accepts both.
        "us" | "\u{b5}s" | "\u{3bc}s" => MICROSECOND,
        "ms" => MILLISECOND,
        "s" => SECOND,
        "m" => MINUTE,
        "h" => HOUR,
        _ => return None,
    })
}

/// Parses a Go duration (`300ms`, `-1.5h`, `1m30s`, `0`) into signed nanoseconds.
///
/// A unit is required on every number except for the literal `0`, so a bare `10` fails.
pub fn parse_go_duration(input: &str) -> Result<i64, DurationError> {
    let err = |reason| DurationError { input: input.to_owned(), reason };
    let mut s = input.as_bytes();
    let mut neg = false;
    if let Some(&c) = s.first()
        && (c == b'-' || c == b'+')
    {
        neg = c == b'-';
        s = &s[1..];
    }
    if s == b"0" {
        return Ok(0);
    }
    if s.is_empty() {
        return Err(err("invalid duration"));
    }
    let mut total: u64 = 0;
    while !s.is_empty() {
        if !(s[0] == b'.' || s[0].is_ascii_digit()) {
            return Err(err("invalid duration"));
        }
        // The integer part.
        let before = s.len();
        let (mut value, rest) = leading_int(s).ok_or_else(|| err("invalid duration"))?;
        s = rest;
        let pre = before != s.len();
        // The fraction.
        let mut fraction: u64 = 0;
        let mut scale: f64 = 1.0;
        let mut post = false;
        if s.first() == Some(&b'.') {
            s = &s[1..];
            let before = s.len();
            let (f, sc, rest) = leading_fraction(s);
            fraction = f;
            scale = sc;
            s = rest;
            post = before != s.len();
        }
        if !pre && !post {
            // No digits at all, e.g. ".s".
            return Err(err("invalid duration"));
        }
        // The unit runs up to the next digit or dot.
        let unit_len = s.iter().position(|&c| c == b'.' || c.is_ascii_digit()).unwrap_or(s.len());
        if unit_len == 0 {
            return Err(err("missing unit in duration"));
        }
        let unit = std::str::from_utf8(&s[..unit_len]).map_err(|_| err("unknown unit in duration"))?;
        s = &s[unit_len..];
        let unit = unit_nanos(unit).ok_or_else(|| err("unknown unit in duration"))?;
        if value > LIMIT / unit {
            return Err(err("invalid duration"));
        }
        value *= unit;
        if fraction > 0 {
            // float64 is needed so that e.g. 1.5h is computed without overflow, as in Go.
            value += (fraction as f64 * (unit as f64 / scale)) as u64;
            if value > LIMIT {
                return Err(err("invalid duration"));
            }
        }
        total += value;
        if total > LIMIT {
            return Err(err("invalid duration"));
        }
    }
    if neg {
        // total <= 2^63, so the negation fits (it is i64::MIN at most).
        return Ok((total as i128).wrapping_neg() as i64);
    }
    if total > LIMIT - 1 {
        return Err(err("invalid duration"));
    }
    Ok(total as i64)
}

/// Consumes leading digits; `None` on overflow past 2^63.
fn leading_int(s: &[u8]) -> Option<(u64, &[u8])> {
    let mut x: u64 = 0;
    let mut i = 0;
    while i < s.len() && s[i].is_ascii_digit() {
        if x > LIMIT / 10 {
            return None;
        }
        x = x * 10 + u64::from(s[i] - b'0');
        if x > LIMIT {
            return None;
        }
        i += 1;
    }
    Some((x, &s[i..]))
}

/// Consumes leading fraction digits, ignoring the precision that does not fit (as Go does).
fn leading_fraction(s: &[u8]) -> (u64, f64, &[u8]) {
    let mut x: u64 = 0;
    let mut scale = 1.0;
    let mut overflow = false;
    let mut i = 0;
    while i < s.len() && s[i].is_ascii_digit() {
        if !overflow {
            if x > (LIMIT - 1) / 10 {
                overflow = true;
            } else {
                let y = x * 10 + u64::from(s[i] - b'0');
                if y > LIMIT {
                    overflow = true;
                } else {
                    x = y;
                    scale *= 10.0;
                }
            }
        }
        i += 1;
    }
    (x, scale, &s[i..])
}

/// Consul's effective blocking wait for a parsed `?wait=` (in nanoseconds, `None` if absent):
/// absent, zero or negative means the 5 minute default, anything above 10 minutes is capped.
pub fn effective_wait(requested_nanos: Option<i64>) -> Duration {
    match requested_nanos {
        Some(n) if n > 0 => Duration::from_nanos(n as u64).min(MAX_WAIT),
        _ => DEFAULT_WAIT,
    }
}

/// The random extra Consul adds to a blocking wait: uniformly up to `wait / 16`, so that
/// many clients started together do not all time out at the same instant.
pub(crate) fn jitter(wait: Duration) -> Duration {
    let max = wait.as_nanos() / 16;
    if max == 0 {
        return Duration::ZERO;
    }
    let extra = rand::random_range(0..=max as u64);
    Duration::from_nanos(extra)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ok(s: &str) -> i64 {
        parse_go_duration(s).unwrap_or_else(|e| panic!("{s}: {e}"))
    }

    #[test]
    fn accepts_go_forms() {
        assert_eq!(ok("0"), 0);
        assert_eq!(ok("+0"), 0);
        assert_eq!(ok("-0"), 0);
        assert_eq!(ok("10s"), 10 * SECOND as i64);
        assert_eq!(ok("5m"), 5 * MINUTE as i64);
        assert_eq!(ok("300000ms"), 300 * SECOND as i64);
        assert_eq!(ok("1m30s"), 90 * SECOND as i64);
        assert_eq!(ok("1.5h"), 90 * MINUTE as i64);
        assert_eq!(ok(".5s"), 500 * MILLISECOND as i64);
        assert_eq!(ok("5.s"), 5 * SECOND as i64);
        assert_eq!(ok("1h2m3s4ms5us6ns"), 3_723_004_005_006);
        assert_eq!(ok("3µs"), 3_000);
        assert_eq!(ok("3μs"), 3_000);
        assert_eq!(ok("-1.5s"), -1_500_000_000);
        assert_eq!(ok("0s"), 0);
        assert_eq!(ok("9223372036854775807ns"), i64::MAX);
        assert_eq!(ok("-9223372036854775808ns"), i64::MIN);
        assert_eq!(ok("0.100000000000000000000h"), 6 * MINUTE as i64);
    }

    #[test]
    fn rejects_what_go_rejects() {
        for bad in [
            "",
            "10",
            "-10",
            "+",
            "-",
            ".",
            ".s",
            "s",
            "1x",
            "1 s",
            " 1s",
            "1s ",
            "1S",
            "1sec",
            "10ms1",
            "9223372036854775808ns",
            "1e3s",
            "++1s",
            "1.2.3s",
            "3000000h",
        ] {
            assert!(parse_go_duration(bad).is_err(), "{bad:?} should be rejected");
        }
    }

    #[test]
    fn effective_wait_defaults_and_caps() {
        assert_eq!(effective_wait(None), DEFAULT_WAIT);
        assert_eq!(effective_wait(Some(0)), DEFAULT_WAIT);
        assert_eq!(effective_wait(Some(-5)), DEFAULT_WAIT);
        assert_eq!(effective_wait(Some(ok("300ms"))), Duration::from_millis(300));
        assert_eq!(effective_wait(Some(ok("10m"))), MAX_WAIT);
        assert_eq!(effective_wait(Some(ok("20m"))), MAX_WAIT);
        assert_eq!(effective_wait(Some(i64::MAX)), MAX_WAIT);
    }

    #[test]
    fn jitter_is_bounded_by_a_sixteenth() {
        let wait = Duration::from_millis(1600);
        for _ in 0..1000 {
            assert!(jitter(wait) <= Duration::from_millis(100));
        }
        assert_eq!(jitter(Duration::from_nanos(15)), Duration::ZERO);
    }
}
