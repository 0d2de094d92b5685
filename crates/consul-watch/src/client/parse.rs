//! Parsing Consul's answers: `/v1/health/service/<name>` into endpoints, and the change
//! feed's `/v1/catalog/services` and `/v1/health/state/any` into what it diffs.
//!
//! Consul's response shape varies by version (see docs/consul-protocol.md): `Meta`, `Tags` and
//! `TaggedAddresses` may be `null` or objects, newer agents add fields. Every field we do
//! not use is ignored, every field we use tolerates `null`, and anything else malformed is
//! an error rather than a panic.

use std::borrow::Cow;
use std::collections::{BTreeMap, BTreeSet};

use serde::Deserialize;
use serde_json::Value;

use consul_resolver_core::keys::AddressType;
use consul_resolver_core::model::{Endpoint, Health};

#[derive(Deserialize)]
#[serde(rename_all = "PascalCase")]
struct Entry {
    #[serde(deserialize_with = "object")]
    node: Node,
    #[serde(deserialize_with = "object")]
    service: Service,
    #[serde(default)]
    checks: Option<Vec<Check>>,
}

#[derive(Deserialize)]
#[serde(rename_all = "PascalCase")]
struct Node {
    #[serde(default)]
    node: Option<String>,
    #[serde(default)]
    address: Option<String>,
    /// `lan`, `wan`, `lan_ipv4`, ...: plain strings on nodes.
    #[serde(default)]
    tagged_addresses: Option<BTreeMap<String, Option<String>>>,
}

/// A service's tagged address: an object with its own port.
#[derive(Deserialize)]
#[serde(rename_all = "PascalCase")]
struct ServiceAddress {
    #[serde(default)]
    address: Option<String>,
    #[serde(default)]
    port: Option<u16>,
}

#[derive(Deserialize)]
#[serde(rename_all = "PascalCase")]
struct Service {
    #[serde(rename = "ID", default)]
    id: Option<String>,
    /// The instance's service name: the destination's on `/v1/health/service`, the
    /// proxy's own (`web-sidecar-proxy`) on `/v1/health/connect`.
    #[serde(rename = "Service", default)]
    name: Option<String>,
    #[serde(default)]
    address: Option<String>,
    #[serde(default)]
    port: Option<u16>,
    #[serde(default)]
    tags: Option<Vec<String>>,
    #[serde(default)]
    meta: Option<BTreeMap<String, Value>>,
    #[serde(default)]
    tagged_addresses: Option<BTreeMap<String, Option<ServiceAddress>>>,
    /// Consul 1.17+; absent or `null` before, and for instances registered without one.
    #[serde(default)]
    locality: Option<Locality>,
    #[serde(default)]
    weights: Option<Weights>,
}

/// `Service.Weights`: each instance's share by its health (Consul 1.2.3+; DNS SRV answers
/// and our xDS endpoints use them).
#[derive(Deserialize)]
#[serde(rename_all = "PascalCase")]
struct Weights {
    #[serde(default)]
    passing: Option<u32>,
    #[serde(default)]
    warning: Option<u32>,
}

/// The weight of an instance at `health`, when not Consul's default (1). A critical
/// instance has none: it is not meant to serve.
fn weight(weights: Option<&Weights>, health: Health) -> Option<u32> {
    let w = weights?;
    let weight = match health {
        Health::Passing => w.passing,
        Health::Warning => w.warning,
        Health::Critical => None,
    };
    weight.filter(|&w| w != 1)
}

#[derive(Deserialize)]
#[serde(rename_all = "PascalCase")]
struct Locality {
    #[serde(default)]
    zone: Option<String>,
}

#[derive(Deserialize)]
#[serde(rename_all = "PascalCase")]
struct Check {
    #[serde(default)]
    status: Option<String>,
}

/// Consul's check statuses; maintenance mode is a `critical` check. An unknown status is
/// treated as critical: routing to an instance we cannot judge is the worse mistake.
fn status(s: Option<&str>) -> Health {
    match s {
        Some("passing") => Health::Passing,
        Some("warning") => Health::Warning,
        _ => Health::Critical,
    }
}

/// Parses a health body into endpoints with the address `address` asks for, sorted.
#[cfg(test)]
pub(crate) fn health_service(body: &[u8], address: &AddressType) -> Result<Vec<Endpoint>, String> {
    health_instances(body, address).map(|(endpoints, _)| endpoints)
}

/// Parses a health body into endpoints with the address `address` asks for, sorted, and
/// the service names the instances carry (lower case, as Consul compares them).
pub(crate) fn health_instances(
    body: &[u8],
    address: &AddressType,
) -> Result<(Vec<Endpoint>, BTreeSet<String>), String> {
    let entries: Vec<Object<Entry>> =
        serde_json::from_slice(body).map_err(|e| format!("malformed /v1/health/service body: {e}"))?;
    let mut names = BTreeSet::new();
    let mut out: Vec<Endpoint> = entries
        .into_iter()
        .map(|Object(mut e)| {
            if let Some(name) = e.service.name.take() {
                names.insert(name.to_ascii_lowercase());
            }
            endpoint(e, address)
        })
        .collect();
    out.sort();
    Ok((out, names))
}

/// `T` read from a JSON object only. Serde's derived structs also read an array as their
/// fields in order (`[{},[]]` as an entry with no address), which no agent writes: such a
/// body is malformed.
struct Object<T>(T);

impl<'de, T: Deserialize<'de>> Deserialize<'de> for Object<T> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Fields<T>(std::marker::PhantomData<T>);

        impl<'de, T: Deserialize<'de>> serde::de::Visitor<'de> for Fields<T> {
            type Value = T;

            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a JSON object")
            }

            fn visit_map<A: serde::de::MapAccess<'de>>(self, map: A) -> Result<T, A::Error> {
                T::deserialize(serde::de::value::MapAccessDeserializer::new(map))
            }
        }

        d.deserialize_map(Fields(std::marker::PhantomData)).map(Object)
    }
}

/// A field read with [`Object`].
fn object<'de, D: serde::Deserializer<'de>, T: Deserialize<'de>>(d: D) -> Result<T, D::Error> {
    Object::deserialize(d).map(|Object(t)| t)
}

/// The (address, port) to publish: see [`AddressType`]. Empty values count as absent.
fn address_of(e: &mut Entry, kind: &AddressType) -> (String, u16) {
    let port = e.service.port.unwrap_or(0);
    let non_empty = |a: Option<String>| a.filter(|a| !a.is_empty());
    let node = non_empty(e.node.address.take()).unwrap_or_default();
    let default = || (non_empty(e.service.address.clone()).unwrap_or_else(|| node.clone()), port);
    match kind {
        AddressType::Service => default(),
        AddressType::Node => (node.clone(), port),
        AddressType::Tagged(name) => {
            let service = e.service.tagged_addresses.as_mut().and_then(|t| t.remove(name)).flatten();
            if let Some(ServiceAddress { address: Some(a), port: p }) = service
                && !a.is_empty()
            {
                return (a, p.filter(|p| *p != 0).unwrap_or(port));
            }
            let on_node = e.node.tagged_addresses.as_mut().and_then(|t| t.remove(name)).flatten();
            match non_empty(on_node) {
                Some(a) => (a, port),
                None => default(),
            }
        }
    }
}

/// `/v1/catalog/services`: service name to its tags (`null` tags on old agents are none).
pub(crate) fn catalog_services(body: &[u8]) -> Result<BTreeMap<String, Vec<String>>, String> {
    let raw: BTreeMap<String, Option<Vec<String>>> =
        serde_json::from_slice(body).map_err(|e| format!("malformed /v1/catalog/services body: {e}"))?;
    Ok(raw
        .into_iter()
        .map(|(name, tags)| {
            let mut tags = tags.unwrap_or_default();
            tags.sort();
            (name, tags)
        })
        .collect())
}

/// A node, reduced to what locating a catalog move uses (see `crate::locate`): its name,
/// and the raft index that last wrote it.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "PascalCase")]
pub(crate) struct NodeRow {
    pub node: String,
    /// `0` when absent, which lies in no move.
    #[serde(default)]
    pub modify_index: u64,
}

/// `/v1/catalog/nodes`: every node the token may see.
pub(crate) fn catalog_nodes(body: &[u8]) -> Result<Vec<NodeRow>, String> {
    serde_json::from_slice(body).map_err(|e| format!("malformed /v1/catalog/nodes body: {e}"))
}

/// `/v1/catalog/node-services/<node>` (Consul 1.7+): the node, `None` when it is unknown
/// (`{"Node": null, "Services": null}`), and its service instances.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct NodeServices {
    pub node: Option<NodeRow>,
    pub services: Vec<NodeService>,
}

/// One service instance of a node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct NodeService {
    /// The instance's service name, lower case as Consul compares them.
    pub name: String,
    /// A Connect proxy's destination (`Proxy.DestinationServiceName`), lower case.
    pub destination: Option<String>,
    pub modify_index: u64,
}

#[derive(Deserialize)]
#[serde(rename_all = "PascalCase")]
struct RawNodeServices {
    #[serde(default)]
    node: Option<NodeRow>,
    #[serde(default)]
    services: Option<Vec<RawNodeService>>,
}

#[derive(Deserialize)]
#[serde(rename_all = "PascalCase")]
struct RawNodeService {
    service: String,
    #[serde(default)]
    proxy: Option<RawProxy>,
    #[serde(default)]
    modify_index: u64,
}

#[derive(Deserialize)]
#[serde(rename_all = "PascalCase")]
struct RawProxy {
    #[serde(default)]
    destination_service_name: Option<String>,
}

/// Reads a `/v1/catalog/node-services/<node>` body (`Services: null` on an unknown node).
pub(crate) fn node_services(body: &[u8]) -> Result<NodeServices, String> {
    let raw: RawNodeServices =
        serde_json::from_slice(body).map_err(|e| format!("malformed /v1/catalog/node-services body: {e}"))?;
    let services = raw
        .services
        .unwrap_or_default()
        .into_iter()
        .map(|s| NodeService {
            name: s.service.to_ascii_lowercase(),
            destination: s
                .proxy
                .and_then(|p| p.destination_service_name)
                .filter(|d| !d.is_empty())
                .map(|d| d.to_ascii_lowercase()),
            modify_index: s.modify_index,
        })
        .collect();
    Ok(NodeServices { node: raw.node, services })
}

/// One check of `/v1/health/state/any`, reduced to what the change feed uses, borrowed
/// from the answer where it can be: at 75,000 checks, three strings per check allocated
/// and freed on every answer were most of its parsing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct CheckRow<'a> {
    pub node: Cow<'a, str>,
    pub check_id: Cow<'a, str>,
    /// Empty for a node check (which counts against every instance on its node).
    pub service: Cow<'a, str>,
    pub modify_index: u64,
}

#[derive(Deserialize)]
#[serde(rename_all = "PascalCase")]
struct StateCheck<'a> {
    #[serde(borrow, default, deserialize_with = "in_place")]
    node: Cow<'a, str>,
    #[serde(borrow, rename = "CheckID", default, deserialize_with = "in_place")]
    check_id: Cow<'a, str>,
    #[serde(borrow, default, deserialize_with = "in_place")]
    service_name: Cow<'a, str>,
    #[serde(default)]
    modify_index: Option<u64>,
}

/// A string read in place when it has no escapes (serde's own `Cow` always copies, and
/// `Option<Cow>` too), `null` as empty (the older agents' shape), anything else an error.
fn in_place<'de: 'a, 'a, D: serde::Deserializer<'de>>(d: D) -> Result<Cow<'a, str>, D::Error> {
    struct InPlace;
    impl<'de> serde::de::Visitor<'de> for InPlace {
        type Value = Cow<'de, str>;
        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("a string or null")
        }
        fn visit_borrowed_str<E>(self, v: &'de str) -> Result<Self::Value, E> {
            Ok(Cow::Borrowed(v))
        }
        fn visit_str<E>(self, v: &str) -> Result<Self::Value, E> {
            Ok(Cow::Owned(v.to_owned()))
        }
        fn visit_string<E>(self, v: String) -> Result<Self::Value, E> {
            Ok(Cow::Owned(v))
        }
        fn visit_unit<E>(self) -> Result<Self::Value, E> {
            Ok(Cow::Borrowed(""))
        }
    }
    d.deserialize_any(InPlace)
}

/// One check of `/v1/health/state/any` as it came: its bytes, and a hash of them that
/// stands for the check in the change feed's view. The feed reads only the checks whose
/// bytes it has not seen before (docs/consul.md, "Services without a blocking query of their
/// own"): every write to a check moves its `ModifyIndex`, so a check that did not change
/// comes back byte for byte, and at 75,000 checks reading and looking up every one of them
/// in every answer was half of what the feed cost.
#[derive(Debug, Clone, Copy)]
pub(crate) struct CheckBytes<'a> {
    /// 128 bits of xxh3: a collision (a changed check taken for an unchanged one) is far
    /// less likely than a memory error.
    pub hash: u128,
    bytes: &'a [u8],
}

impl<'a> CheckBytes<'a> {
    fn of(bytes: &'a [u8]) -> Self {
        CheckBytes { hash: xxhash_rust::xxh3::xxh3_128(bytes), bytes }
    }

    /// Reads the check: an error when it is not a check.
    pub(crate) fn read(&self) -> Result<CheckRow<'a>, String> {
        let c: StateCheck<'a> = serde_json::from_slice(self.bytes)
            .map_err(|e| format!("malformed check in a /v1/health/state body: {e}"))?;
        Ok(CheckRow {
            node: c.node,
            check_id: c.check_id,
            service: c.service_name,
            modify_index: c.modify_index.unwrap_or(0),
        })
    }
}

/// How much of a checks answer is asked of its stream at a time.
const READ_AT_ONCE: usize = 64 * 1024;
/// How much a quick split holds looking for the end of one check before it splits exactly
/// instead: an answer not written as agents write it (indented, say) has no `},{` to find,
/// and would otherwise be held whole.
const QUICK_PIECE_MAX: usize = 1 << 20;

/// The separator a quick split cuts at, its searcher built once: building one per check
/// (what `memmem::find` does) was 4% of the operator's CPU at 150,000 checks.
static BETWEEN_CHECKS: std::sync::LazyLock<memchr::memmem::Finder<'static>> =
    std::sync::LazyLock::new(|| memchr::memmem::Finder::new(b"},{"));

/// `/v1/health/state/any` split into its checks as it is read from `body`: every check of
/// the scope, handed out one at a time ([`StateSplit::next`]), not yet read. What is held is
/// the check being split and at most one read's worth after it, never the answer (21 MB at
/// 75,000 checks).
///
/// Two ways to split, the first tried first:
/// - Quick: at each `},{`, without looking at strings, which is how agents write the
///   answer (compact, `[`, checks joined by commas, `]`). A bracket-matching scan of the
///   21 MB answer was a tenth of the operator's CPU per change at 75,000 checks; this is a
///   `memmem` of it. Sound only with a reader that says when a piece is no check
///   ([`CheckBytes::read`] and the bytes of checks read before): a cut that falls inside a
///   check (a `},{` in a string or a nested value) leaves a piece that ends inside a
///   string or with an object still open, which is neither a check read before (those were
///   whole values) nor readable. Every piece before it started where a check starts and is
///   one whole value, so it also ended where that check ends. So when the reader refuses a
///   piece, [`StateSplit::split_exactly`] splits again from that piece's start, exactly.
/// - Exact: brackets matched, strings and their escapes skipped, from where the last
///   accepted piece ended. Each element is only split here, and read (and so validated) by
///   [`CheckBytes::read`] when its bytes are new to the reader.
///
/// The answer must be one JSON array to its end: a malformed or truncated one is an
/// error, never fewer checks.
pub(crate) struct StateSplit<R> {
    body: R,
    buf: Vec<u8>,
    /// Where the next thing to split starts in `buf`.
    at: usize,
    /// Where the piece last handed out starts in `buf`, for [`StateSplit::split_exactly`].
    last: usize,
    phase: Phase,
    quick: bool,
    /// The body has no more.
    ended: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Before the array's `[`.
    Open,
    /// Just after it: `]` or the first element.
    First,
    /// At an element.
    Element,
    /// Just after an element: `,` or `]`.
    After,
    /// After the array: only whitespace may follow.
    Closed,
    Done,
}

impl<R: std::io::Read> StateSplit<R> {
    pub(crate) fn new(body: R) -> Self {
        StateSplit { body, buf: Vec::new(), at: 0, last: 0, phase: Phase::Open, quick: true, ended: false }
    }

    /// A split that is exact from the start.
    #[cfg(test)]
    fn exact(body: R) -> Self {
        StateSplit { quick: false, ..StateSplit::new(body) }
    }

    /// The next check, not yet read; `None` after the last. Asking for the next accepts the
    /// one before it as a whole check.
    pub(crate) fn next(&mut self) -> Result<Option<CheckBytes<'_>>, String> {
        let malformed = |what: &str| format!("malformed /v1/health/state body: {what}");
        loop {
            match (self.phase, self.peek()?) {
                (Phase::Open, Some(b'[')) => {
                    self.at += 1;
                    self.phase = Phase::First;
                }
                (Phase::Open, _) => return Err(malformed("not an array")),
                (Phase::First, Some(b']')) | (Phase::After, Some(b']')) => {
                    self.at += 1;
                    self.phase = Phase::Closed;
                }
                (Phase::After, Some(b',')) => {
                    self.at += 1;
                    self.phase = Phase::Element;
                }
                (Phase::After, Some(_)) => return Err(malformed("expected `,` or `]` between checks")),
                (Phase::First | Phase::Element | Phase::After, None) => return Err(malformed("truncated")),
                (Phase::First | Phase::Element, Some(_)) => {
                    self.phase = Phase::Element;
                    let found = if self.quick { self.quick_piece()? } else { self.exact_piece()? };
                    if let Some((start, end)) = found {
                        self.last = start;
                        return Ok(Some(CheckBytes::of(&self.buf[start..end])));
                    }
                }
                (Phase::Closed, None) => {
                    self.phase = Phase::Done;
                    return Ok(None);
                }
                (Phase::Closed, Some(_)) => return Err(malformed("trailing characters after the array")),
                (Phase::Done, _) => return Ok(None),
            }
        }
    }

    /// The piece last handed out is no check: splits again from its start, exactly. `false`
    /// when the split was exact already, and the piece is a malformed check.
    pub(crate) fn split_exactly(&mut self) -> bool {
        if !self.quick {
            return false;
        }
        self.quick = false;
        self.at = self.last;
        self.phase = Phase::Element;
        true
    }

    /// The next piece of a quick split, as `(start, end)` in `buf`; `None` when the split
    /// turned exact (see `QUICK_PIECE_MAX`, and an answer that does not end as agents
    /// end it).
    fn quick_piece(&mut self) -> Result<Option<(usize, usize)>, String> {
        // How much past `at` holds no `},{` (but for its last two bytes, which more may end).
        let mut searched = 0;
        loop {
            if let Some(i) = BETWEEN_CHECKS.find(&self.buf[self.at + searched..]) {
                let (start, end) = (self.at, self.at + searched + i + 1);
                self.at = end + 1;
                return Ok(Some((start, end)));
            }
            let held = self.buf.len() - self.at;
            searched = held.saturating_sub(2);
            if held > QUICK_PIECE_MAX {
                break;
            }
            if !self.fill()? {
                // The last check and the array's `]`.
                let inner = self.buf[self.at..].trim_ascii_end().strip_suffix(b"]");
                let piece = inner.map(<[u8]>::trim_ascii_end).unwrap_or_default();
                if piece.is_empty() {
                    break;
                }
                let start = self.at;
                self.at = self.buf.len();
                self.phase = Phase::Closed;
                return Ok(Some((start, start + piece.len())));
            }
        }
        self.quick = false;
        Ok(None)
    }

    /// The next element of an exact split, as `(start, end)` in `buf`.
    fn exact_piece(&mut self) -> Result<Option<(usize, usize)>, String> {
        // Resumed as more of the element arrives (reading more keeps it at `at`).
        let mut scan = Scan::default();
        loop {
            if let Some(len) = scan.element_end(&self.buf[self.at..]) {
                let start = self.at;
                self.at += len;
                self.phase = Phase::After;
                return Ok(Some((start, start + len)));
            }
            if !self.fill()? {
                return Err("malformed /v1/health/state body: truncated".into());
            }
        }
    }

    /// The next byte that is not whitespace, reading more as needed; `None` at the end.
    fn peek(&mut self) -> Result<Option<u8>, String> {
        loop {
            while let Some(&b) = self.buf.get(self.at) {
                if !is_space(b) {
                    return Ok(Some(b));
                }
                self.at += 1;
            }
            if !self.fill()? {
                return Ok(None);
            }
        }
    }

    /// Reads more of the body after what `buf` holds, first dropping what was handed out
    /// (asking for more accepts it); `false` at the end of the body.
    fn fill(&mut self) -> Result<bool, String> {
        if self.ended {
            return Ok(false);
        }
        self.buf.drain(..self.at);
        self.at = 0;
        let held = self.buf.len();
        self.buf.resize(held + READ_AT_ONCE, 0);
        let read = loop {
            match self.body.read(&mut self.buf[held..]) {
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                read => break read,
            }
        };
        let n = read.map_err(|e| format!("cannot read the /v1/health/state body: {e}"));
        self.buf.truncate(held + *n.as_ref().unwrap_or(&0));
        self.ended = n? == 0;
        Ok(!self.ended)
    }
}

/// Bracket matching of one array element, resumable as more of it arrives.
#[derive(Debug, Default, Clone, Copy)]
struct Scan {
    /// How far into the element it is matched.
    at: usize,
    depth: usize,
    in_string: bool,
}

impl Scan {
    /// The length of the array element at the start of `element` (brackets matched, strings
    /// and their escapes skipped; whether it is well formed is for the JSON reader to say),
    /// or `None` when it does not end within `element`. Called again with more of the same
    /// element, it goes on from where it stopped.
    fn element_end(&mut self, element: &[u8]) -> Option<usize> {
        while self.at < element.len() {
            if self.in_string {
                let Some(i) = memchr::memchr2(b'"', b'\\', &element[self.at..]) else {
                    self.at = element.len();
                    return None;
                };
                let found = self.at + i;
                if element[found] == b'\\' {
                    if found + 1 == element.len() {
                        // The escaped byte is not here yet: this backslash is looked at again.
                        self.at = found;
                        return None;
                    }
                    self.at = found + 2;
                    continue;
                }
                self.in_string = false;
                self.at = found + 1;
                if self.depth == 0 {
                    return Some(self.at);
                }
                continue;
            }
            match element[self.at] {
                b'"' => self.in_string = true,
                b'{' | b'[' => self.depth += 1,
                b'}' | b']' | b',' if self.depth == 0 => return Some(self.at),
                b'}' | b']' => {
                    self.depth -= 1;
                    if self.depth == 0 {
                        return Some(self.at + 1);
                    }
                }
                _ => {}
            }
            self.at += 1;
        }
        None
    }
}

/// Every check of a `/v1/health/state` body, read (split exactly).
#[cfg(test)]
fn read_all(body: &[u8]) -> Result<Vec<CheckRow<'static>>, String> {
    let mut split = StateSplit::exact(body);
    let mut rows = Vec::new();
    while let Some(check) = split.next()? {
        let row = check.read()?;
        let owned = |s: Cow<'_, str>| Cow::Owned(s.into_owned());
        rows.push(CheckRow {
            node: owned(row.node),
            check_id: owned(row.check_id),
            service: owned(row.service),
            ..row
        });
    }
    Ok(rows)
}

/// JSON's whitespace.
fn is_space(b: u8) -> bool {
    matches!(b, b' ' | b'\t' | b'\n' | b'\r')
}

fn endpoint(mut e: Entry, kind: &AddressType) -> Endpoint {
    let (address, port) = address_of(&mut e, kind);
    let mut tags = e.service.tags.unwrap_or_default();
    tags.sort();
    let meta = e
        .service
        .meta
        .unwrap_or_default()
        .into_iter()
        .map(|(k, v)| {
            let v = match v {
                Value::String(s) => s,
                Value::Null => String::new(),
                other => other.to_string(),
            };
            (k, v)
        })
        .collect();
    // No checks at all means passing, as Consul's own `passing` filter treats it.
    let health =
        e.checks.unwrap_or_default().iter().map(|c| status(c.status.as_deref())).max().unwrap_or(Health::Passing);
    let zone = e.service.locality.and_then(|l| l.zone).filter(|z| !z.is_empty());
    let weight = weight(e.service.weights.as_ref(), health);
    Endpoint {
        address,
        port,
        node: e.node.node.unwrap_or_default(),
        service_id: e.service.id.unwrap_or_default(),
        tags,
        meta,
        health,
        zone,
        weight,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A modern agent's answer (1.15+ shape, trimmed of nothing we rely on).
    const MODERN: &str = r#"[
      {"Node":{"ID":"a1","Node":"node-b","Address":"10.0.0.2","Datacenter":"dc1",
               "TaggedAddresses":{"lan":"10.0.0.2","wan":"203.0.113.2"},"Meta":{"consul-network-segment":""},
               "CreateIndex":5,"ModifyIndex":5},
       "Service":{"ID":"web-2","Service":"web","Tags":["v2","primary"],"Address":"",
                  "TaggedAddresses":{"lan_ipv4":{"Address":"10.0.0.12","Port":9080}},
                  "Meta":{"version":"2","weight":3,"canary":true},"Port":8080,
                  "Weights":{"Passing":1,"Warning":1},"EnableTagOverride":false,
                  "Proxy":{"Mode":"","MeshGateway":{},"Expose":{}},"Connect":{},
                  "PeerName":"","Namespace":"default","Partition":"default","Locality":null,
                  "CreateIndex":7,"ModifyIndex":7},
       "Checks":[
         {"Node":"node-b","CheckID":"serfHealth","Name":"Serf Health Status","Status":"passing","Output":"",
          "ServiceID":"","ServiceName":"","ServiceTags":[],"Type":"","Interval":"","Timeout":"",
          "ExposedPort":0,"Definition":{},"CreateIndex":5,"ModifyIndex":5},
         {"Node":"node-b","CheckID":"service:web-2","Name":"http","Status":"warning","Output":"slow",
          "ServiceID":"web-2","ServiceName":"web","ServiceTags":["v2"],"CreateIndex":7,"ModifyIndex":9}]},
      {"Node":{"ID":"a0","Node":"node-a","Address":"10.0.0.1","Datacenter":"dc1","TaggedAddresses":{},"Meta":{}},
       "Service":{"ID":"web-1","Service":"web","Tags":[],"Address":"192.168.1.1","Port":80,"Meta":{},
                  "TaggedAddresses":{}},
       "Checks":[]}
    ]"#;

    /// An old agent's answer: nulls everywhere an empty value could be.
    const LEGACY: &str = r#"[
      {"Node":{"ID":"","Node":"old","Address":"10.1.0.1","TaggedAddresses":null,"Meta":null,
               "CreateIndex":3,"ModifyIndex":3},
       "Service":{"ID":"api-1","Service":"api","Tags":null,"Address":"","Port":9000,"Meta":null,
                  "EnableTagOverride":false,"CreateIndex":4,"ModifyIndex":4},
       "Checks":[{"Node":"old","CheckID":"_node_maintenance","Name":"Node Maintenance Mode",
                  "Status":"critical","Output":"","ServiceID":"","ServiceName":""},
                 {"Node":"old","CheckID":"service:api-1","Status":"passing","ServiceID":"api-1"}]}
    ]"#;

    #[test]
    fn modern_shape() {
        let eps = health_service(MODERN.as_bytes(), &AddressType::Service).unwrap();
        assert_eq!(eps.len(), 2);
        // Sorted by address first.
        let (a, b) = (&eps[0], &eps[1]);
        assert_eq!(
            (a.address.as_str(), a.port, a.node.as_str(), a.service_id.as_str()),
            ("10.0.0.2", 8080, "node-b", "web-2")
        );
        assert_eq!(a.tags, ["primary", "v2"]);
        assert_eq!(a.meta.get("version").map(String::as_str), Some("2"));
        assert_eq!(a.meta.get("weight").map(String::as_str), Some("3"));
        assert_eq!(a.meta.get("canary").map(String::as_str), Some("true"));
        assert_eq!(a.health, Health::Warning);
        assert_eq!((b.address.as_str(), b.port), ("192.168.1.1", 80), "Service.Address wins when set");
        assert_eq!(b.health, Health::Passing, "no checks means passing");
        assert!(b.tags.is_empty() && b.meta.is_empty());
    }

    #[test]
    fn weight_at_the_instances_health_when_not_the_default() {
        let body = r#"[
          {"Node":{"Node":"n","Address":"10.0.0.1"},"Service":{"ID":"a","Port":1,"Weights":{"Passing":3,"Warning":1}},"Checks":[]},
          {"Node":{"Node":"n","Address":"10.0.0.2"},"Service":{"ID":"b","Port":1,"Weights":{"Passing":3,"Warning":0}},
           "Checks":[{"Status":"warning"}]},
          {"Node":{"Node":"n","Address":"10.0.0.3"},"Service":{"ID":"c","Port":1,"Weights":{"Passing":1,"Warning":1}},"Checks":[]},
          {"Node":{"Node":"n","Address":"10.0.0.4"},"Service":{"ID":"d","Port":1},"Checks":[]},
          {"Node":{"Node":"n","Address":"10.0.0.5"},"Service":{"ID":"e","Port":1,"Weights":{"Passing":5,"Warning":2}},
           "Checks":[{"Status":"critical"}]}]"#;
        let weights: Vec<_> =
            health_service(body.as_bytes(), &AddressType::Service).unwrap().into_iter().map(|e| e.weight).collect();
        assert_eq!(weights, [Some(3), Some(0), None, None, None]);
    }

    #[test]
    fn locality_zone_when_set() {
        let body = r#"[{"Node":{"Node":"n","Address":"10.0.0.1"},
            "Service":{"ID":"a","Port":1,"Locality":{"Region":"eu-west-1","Zone":"eu-west-1a"}},"Checks":[]},
          {"Node":{"Node":"n","Address":"10.0.0.2"},"Service":{"ID":"b","Port":1,"Locality":null},"Checks":[]},
          {"Node":{"Node":"n","Address":"10.0.0.3"},"Service":{"ID":"c","Port":1,"Locality":{"Zone":""}},"Checks":[]}]"#;
        let zones: Vec<_> =
            health_service(body.as_bytes(), &AddressType::Service).unwrap().into_iter().map(|e| e.zone).collect();
        assert_eq!(zones, [Some("eu-west-1a".to_owned()), None, None]);
    }

    #[test]
    fn an_entry_or_its_parts_written_as_arrays_are_malformed() {
        // Serde's derived structs also read an array as their fields in order; no agent
        // writes one, and `[{},[]]` would otherwise be an instance with no address.
        for body in [r#"[[{},[]]]"#, r#"[{"Node":[],"Service":{}}]"#, r#"[{"Node":{},"Service":[null,null,"a",80]}]"#] {
            let parsed = health_service(body.as_bytes(), &AddressType::Service);
            assert!(parsed.as_ref().is_err_and(|e| e.contains("malformed")), "{body}: {:?}", parsed.map(|e| e.len()));
        }
        let object = r#"[{"Node":{},"Service":{"Address":"a","Port":80}}]"#;
        assert_eq!(health_service(object.as_bytes(), &AddressType::Service).unwrap().len(), 1);
    }

    #[test]
    fn legacy_nulls_and_maintenance() {
        let eps = health_service(LEGACY.as_bytes(), &AddressType::Service).unwrap();
        assert_eq!(eps.len(), 1);
        let e = &eps[0];
        assert_eq!(e.address, "10.1.0.1");
        assert!(e.tags.is_empty() && e.meta.is_empty());
        assert_eq!(e.health, Health::Critical, "node maintenance is a critical node check");
    }

    #[test]
    fn empty_and_null_lists() {
        assert!(health_service(b"[]", &AddressType::Service).unwrap().is_empty());
        let null_checks = r#"[{"Node":{"Node":"n","Address":"1.2.3.4"},"Service":{"ID":"s","Port":1},"Checks":null}]"#;
        assert_eq!(health_service(null_checks.as_bytes(), &AddressType::Service).unwrap()[0].health, Health::Passing);
    }

    #[test]
    fn malformed_bodies_are_errors() {
        for body in [
            &b""[..],
            b"{}",
            b"null",
            b"[{\"Node\":1}]",
            b"[{\"Node\":{},\"Service\":{\"Port\":70000}}]",
            b"[{\"Node\":{},\"Service\":{\"Port\":-1}}]",
            b"[{\"Node\":{}}]",
            b"<html>",
        ] {
            assert!(health_service(body, &AddressType::Service).is_err(), "{:?}", String::from_utf8_lossy(body));
        }
    }

    #[test]
    fn address_types() {
        let at = |kind: AddressType| {
            health_service(MODERN.as_bytes(), &kind)
                .unwrap()
                .into_iter()
                .map(|e| (e.service_id, e.address, e.port))
                .collect::<BTreeSet<_>>()
        };
        let set = |v: &[(&str, &str, u16)]| v.iter().map(|(i, a, p)| (i.to_string(), a.to_string(), *p)).collect();
        assert_eq!(at(AddressType::Service), set(&[("web-2", "10.0.0.2", 8080), ("web-1", "192.168.1.1", 80)]));
        assert_eq!(at(AddressType::Node), set(&[("web-2", "10.0.0.2", 8080), ("web-1", "10.0.0.1", 80)]));
        // web-2 has a service lan_ipv4 (with its port); web-1 has none: its default.
        assert_eq!(
            at(AddressType::Tagged("lan_ipv4".into())),
            set(&[("web-2", "10.0.0.12", 9080), ("web-1", "192.168.1.1", 80)])
        );
        // wan: web-2's node has one (the service's port stays).
        assert_eq!(
            at(AddressType::Tagged("wan".into())),
            set(&[("web-2", "203.0.113.2", 8080), ("web-1", "192.168.1.1", 80)])
        );
        // Legacy nulls everywhere.
        let legacy = health_service(LEGACY.as_bytes(), &AddressType::Tagged("wan".into())).unwrap();
        assert_eq!((legacy[0].address.as_str(), legacy[0].port), ("10.1.0.1", 9000));
    }

    /// Nodes and a node's instances as Consul 1.8.7 sends them (a dev agent's node, an
    /// instance registered through its agent API), an unknown node, and a proxy.
    #[test]
    fn catalog_nodes_and_node_services() {
        let nodes = catalog_nodes(
            br#"[{"ID":"d82647e4-b1ba-ec78-adb8-a2e247ec6a5f","Node":"vm","Address":"127.0.0.1","Datacenter":"dc1",
                  "TaggedAddresses":{"lan":"127.0.0.1","wan":"127.0.0.1"},"Meta":{"consul-network-segment":""},
                  "CreateIndex":10,"ModifyIndex":12}]"#,
        )
        .unwrap();
        assert_eq!(nodes, [NodeRow { node: "vm".into(), modify_index: 12 }]);
        assert!(catalog_nodes(b"{}").is_err());
        let on_vm = node_services(
            br#"{"Node":{"ID":"d826","Node":"vm","Address":"127.0.0.1","CreateIndex":10,"ModifyIndex":12},
                 "Services":[{"ID":"web-1","Service":"Web","Tags":["a"],"Address":"","Meta":null,"Port":8081,
                              "Weights":{"Passing":1,"Warning":1},"EnableTagOverride":false,
                              "Proxy":{"MeshGateway":{},"Expose":{}},"Connect":{},"CreateIndex":13,"ModifyIndex":15},
                             {"ID":"edge-1","Service":"edge","Kind":"connect-proxy","Port":21000,
                              "Proxy":{"DestinationServiceName":"Web"},"ModifyIndex":16}]}"#,
        )
        .unwrap();
        assert_eq!(on_vm.node, Some(NodeRow { node: "vm".into(), modify_index: 12 }));
        let web = NodeService { name: "web".into(), destination: None, modify_index: 15 };
        let edge = NodeService { name: "edge".into(), destination: Some("web".into()), modify_index: 16 };
        assert_eq!(on_vm.services, [web, edge], "names in lower case, as Consul compares them");
        let unknown = node_services(br#"{"Node":null,"Services":null}"#).unwrap();
        assert_eq!(unknown, NodeServices::default());
        assert!(node_services(b"7").is_err());
    }

    #[test]
    fn catalog_services_and_health_state() {
        let services = catalog_services(br#"{"consul":[],"web":["v2","a"],"old":null}"#).unwrap();
        assert_eq!(services["web"], ["a", "v2"]);
        assert!(services["old"].is_empty() && services["consul"].is_empty());
        assert!(catalog_services(b"[]").is_err());

        let rows = read_all(
            br#"[{"Node":"n1","CheckID":"serfHealth","Name":"Serf","Status":"passing","ServiceID":"","ServiceName":"",
                   "ServiceTags":[],"Type":"","CreateIndex":5,"ModifyIndex":5},
                  {"Node":"n1","CheckID":"service:web-1","Status":"critical","ServiceID":"web-1","ServiceName":"web",
                   "ServiceTags":null,"CreateIndex":7,"ModifyIndex":9,"Namespace":"default"}]"#,
        )
        .unwrap();
        assert_eq!(
            rows[1],
            CheckRow { node: "n1".into(), check_id: "service:web-1".into(), service: "web".into(), modify_index: 9 }
        );
        assert_eq!(rows[0].service, "", "a node check names no service");
        let mut split = StateSplit::new(&br#"[{"Node":"n1","CheckID":"service:web-1","ModifyIndex":9}]"#[..]);
        let check = split.next().unwrap().unwrap().read().unwrap();
        assert!(matches!(check.check_id, Cow::Borrowed(_)), "read in place, not copied");
        let escaped = read_all(br#"[{"Node":"n1","CheckID":"c","ModifyIndex":1}]"#).unwrap();
        assert_eq!(escaped[0].node, "n1", "an escaped string is unescaped into a copy");
        let nulls = read_all(br#"[{"Node":"n","CheckID":"c","ServiceName":null,"ModifyIndex":1}]"#).unwrap();
        assert_eq!(nulls[0].service, "", "null, as older agents send it, is empty");
        assert!(read_all(br#"[{"Node":7,"CheckID":"c","ModifyIndex":1}]"#).is_err());
        for bad in [&b"{}"[..], b"null", b"[{\"ModifyIndex\":-1}]", b"<html>"] {
            assert!(read_all(bad).is_err(), "{:?}", String::from_utf8_lossy(bad));
        }
    }

    #[test]
    fn unknown_status_is_critical() {
        let body = r#"[{"Node":{"Node":"n","Address":"a"},"Service":{"ID":"s","Port":1},
                        "Checks":[{"Status":"passing"},{"Status":"maintenance"}]}]"#;
        assert_eq!(health_service(body.as_bytes(), &AddressType::Service).unwrap()[0].health, Health::Critical);
    }
}

/// Property tests: whatever a Consul (or something pretending to be one) sends, the parsers
/// return a value or an error, never panic, hold memory linear in the body, and read back
/// exactly what an agent of either shape (modern, or legacy `null`s) rendered.
#[cfg(test)]
mod proptests {
    use super::*;
    use heap_peak::peak_heap;
    use proptest::prelude::*;
    use serde_json::json;

    /// Heap a parse may hold at once: a small multiple of the body (serde's values, the
    /// endpoints) plus a constant. A parser that amplified its input (a quadratic copy, an
    /// allocation sized by a number in the body) would exceed it.
    fn heap_bound(body: &[u8]) -> usize {
        64 * body.len() + 64 * 1024
    }

    /// Any JSON value, a few levels deep, with keys that are mostly the ones the parsers
    /// read, so that wrong types reach every field.
    fn any_json() -> impl Strategy<Value = Value> {
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::from),
            any::<i64>().prop_map(Value::from),
            any::<u64>().prop_map(Value::from),
            any::<f64>().prop_filter("JSON numbers are finite", |f| f.is_finite()).prop_map(Value::from),
            ".{0,8}".prop_map(Value::from),
            // What a splitter could take for structure: quotes, escapes, brackets.
            r#"[\\"{}\[\],: a]{0,8}"#.prop_map(Value::from),
        ];
        leaf.prop_recursive(4, 48, 6, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..6).prop_map(Value::from),
                prop::collection::btree_map(key(), inner, 0..6).prop_map(|m| Value::Object(m.into_iter().collect())),
            ]
        })
    }

    fn key() -> impl Strategy<Value = String> {
        const READ: &[&str] = &[
            "Node",
            "Service",
            "Checks",
            "Address",
            "Port",
            "ID",
            "Tags",
            "Meta",
            "TaggedAddresses",
            "Status",
            "CheckID",
            "ServiceName",
            "ModifyIndex",
            "lan",
            "wan",
        ];
        prop_oneof![3 => prop::sample::select(READ).prop_map(str::to_owned), 1 => "[A-Za-z_]{0,8}"]
    }

    /// One instance as an agent holds it, and what the parser must make of it.
    #[derive(Debug, Clone)]
    struct Instance {
        node: String,
        node_address: String,
        /// Empty: the node's address is published.
        service_address: String,
        id: String,
        port: u16,
        tags: Vec<String>,
        meta: BTreeMap<String, String>,
        /// Check statuses, node checks included; anything unknown counts as critical.
        checks: Vec<String>,
    }

    fn text() -> impl Strategy<Value = String> {
        // Any Unicode, quotes and escapes included: the JSON encoding must round-trip them.
        ".{0,10}"
    }

    fn instance() -> impl Strategy<Value = Instance> {
        let status = prop_oneof![
            Just("passing".to_owned()),
            Just("warning".to_owned()),
            Just("critical".to_owned()),
            Just("maintenance".to_owned()),
            text(),
        ];
        (
            (text(), text(), prop_oneof![Just(String::new()), text()], text(), any::<u16>()),
            prop::collection::vec(text(), 0..4),
            prop::collection::btree_map(text(), text(), 0..4),
            prop::collection::vec(status, 0..4),
        )
            .prop_map(|((node, node_address, service_address, id, port), tags, meta, checks)| Instance {
                node,
                node_address,
                service_address,
                id,
                port,
                tags,
                meta,
                checks,
            })
    }

    /// The health entry an agent answers: modern (`{}`/`[]`, extra fields) or legacy
    /// (`null` for empty tags, meta and tagged addresses).
    fn render(i: &Instance, legacy: bool) -> Value {
        let or_null = |v: Value, empty: bool| if legacy && empty { Value::Null } else { v };
        let mut entry = json!({
            "Node": {"Node": i.node, "Address": i.node_address, "Datacenter": "dc1",
                     "TaggedAddresses": or_null(json!({}), true), "Meta": or_null(json!({}), true)},
            "Service": {"ID": i.id, "Service": "web", "Tags": or_null(json!(i.tags), i.tags.is_empty()),
                        "Address": i.service_address, "Port": i.port,
                        "Meta": or_null(json!(i.meta), i.meta.is_empty()),
                        "TaggedAddresses": or_null(json!({}), true)},
            "Checks": i.checks.iter().map(|s| json!({"CheckID": "c", "Status": s})).collect::<Vec<_>>(),
        });
        if !legacy {
            entry["Service"]["Weights"] = json!({"Passing": 1, "Warning": 1});
            entry["Service"]["Proxy"] = json!({"Mode": "", "Expose": {}});
        }
        entry
    }

    fn expected(i: &Instance, kind: &AddressType) -> Endpoint {
        let address = match kind {
            AddressType::Node => i.node_address.clone(),
            _ if i.service_address.is_empty() => i.node_address.clone(),
            _ => i.service_address.clone(),
        };
        let mut tags = i.tags.clone();
        tags.sort();
        Endpoint {
            address,
            port: i.port,
            node: i.node.clone(),
            service_id: i.id.clone(),
            tags,
            meta: i.meta.clone(),
            health: i.checks.iter().map(|s| status(Some(s))).max().unwrap_or(Health::Passing),
            zone: None,
            weight: None,
        }
    }

    /// A body that gives at most `step` bytes a read, as a socket or an inflater may.
    struct Trickle<'a> {
        body: &'a [u8],
        step: usize,
    }

    impl std::io::Read for Trickle<'_> {
        fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
            let n = self.step.min(buf.len()).min(self.body.len());
            buf[..n].copy_from_slice(&self.body[..n]);
            self.body = &self.body[n..];
            Ok(n)
        }
    }

    #[derive(Debug, Clone, Copy)]
    enum Split {
        Exact,
        /// Quick, every piece taken as a check.
        QuickTakingAll,
        /// Quick, every piece that does not read as a check refused (as the feed's view does).
        Refusing,
    }

    /// The pieces (bytes and hash) of a checks answer arriving `step` bytes a read.
    fn pieces(body: &[u8], step: usize, how: Split) -> Result<Vec<(Vec<u8>, u128)>, String> {
        let trickle = Trickle { body, step };
        let mut split = match how {
            Split::Exact => StateSplit::exact(trickle),
            Split::QuickTakingAll | Split::Refusing => StateSplit::new(trickle),
        };
        let mut out = Vec::new();
        while let Some(check) = split.next()? {
            if matches!(how, Split::Refusing) && check.read().is_err() {
                let e = check.read().unwrap_err();
                if !split.split_exactly() {
                    return Err(e);
                }
                continue;
            }
            out.push((check.bytes.to_vec(), check.hash));
        }
        Ok(out)
    }

    /// A checks answer whose node names and outputs may hold brackets, quotes, escapes and
    /// the quick split's separator, and whose checks may hold a nested value.
    fn state_body(checks: &[(String, String, u64, Option<Value>)], pretty: bool) -> Vec<u8> {
        let body: Vec<Value> = checks
            .iter()
            .map(|(node, output, index, definition)| {
                let mut c =
                    json!({"Node": node, "CheckID": "c", "Output": output, "ServiceName": "", "ModifyIndex": index});
                if let Some(d) = definition {
                    c["Definition"] = d.clone();
                }
                c
            })
            .collect();
        if pretty { serde_json::to_vec_pretty(&body) } else { serde_json::to_vec(&body) }.unwrap()
    }

    fn config() -> ProptestConfig {
        ProptestConfig { cases: 256, ..ProptestConfig::default() }
    }

    proptest! {
        #![proptest_config(config())]

        #[test]
        fn health_bodies_of_either_shape_read_back_exactly(
            instances in prop::collection::vec(instance(), 0..6),
            legacy in any::<bool>(),
            node_addresses in any::<bool>(),
        ) {
            let body = serde_json::to_vec(&instances.iter().map(|i| render(i, legacy)).collect::<Vec<_>>()).unwrap();
            let kind = if node_addresses { AddressType::Node } else { AddressType::Service };
            let mut want: Vec<Endpoint> = instances.iter().map(|i| expected(i, &kind)).collect();
            want.sort();
            prop_assert_eq!(health_service(&body, &kind).unwrap(), want);
            // Every strict prefix of a body is an error, never a partial list: a truncated
            // answer must not publish fewer endpoints.
            for cut in [0, body.len() / 3, body.len() / 2, body.len() - 1] {
                prop_assert!(health_service(&body[..cut], &kind).is_err(), "prefix of {} bytes", cut);
            }
        }

        #[test]
        fn any_bytes_are_an_answer_or_an_error_within_a_memory_bound(
            body in prop_oneof![
                prop::collection::vec(any::<u8>(), 0..512),
                any_json().prop_map(|v| serde_json::to_vec(&v).unwrap()),
                prop::collection::vec(any_json(), 0..4).prop_map(|v| serde_json::to_vec(&v).unwrap()),
            ],
            tagged in "[a-z_]{1,8}",
        ) {
            for kind in [AddressType::Service, AddressType::Node, AddressType::Tagged(tagged.clone())] {
                let (parsed, peak) = peak_heap(|| health_service(&body, &kind));
                prop_assert!(peak <= heap_bound(&body), "{} bytes held for a {}-byte body", peak, body.len());
                if let Ok(endpoints) = parsed {
                    // Each endpoint comes from an entry of at least `{"Node":{},"Service":{}}`.
                    prop_assert!(endpoints.len() * 24 <= body.len());
                }
            }
            let (_, peak) = peak_heap(|| catalog_services(&body));
            prop_assert!(peak <= heap_bound(&body));
            // (The split reads its body a buffer at a time.)
            let (_, peak) = peak_heap(|| read_all(&body));
            prop_assert!(peak <= heap_bound(&body) + READ_AT_ONCE);
        }

        #[test]
        fn entries_with_wrong_types_anywhere_never_panic(
            entries in prop::collection::vec(
                (
                    prop_oneof![3 => instance().prop_map(|i| render(&i, false)), 1 => any_json()],
                    key(),
                    any_json(),
                ),
                0..4,
            ),
        ) {
            // A rendered entry with one field (at the top or one level down) replaced.
            let body: Vec<Value> = entries
                .into_iter()
                .map(|(mut entry, field, value)| {
                    if let Some(obj) = entry.as_object_mut() {
                        match obj.values_mut().find(|v| v.is_object()) {
                            Some(Value::Object(inner)) if field.len() % 2 == 0 => { inner.insert(field, value); }
                            _ => { obj.insert(field, value); }
                        }
                    }
                    entry
                })
                .collect();
            let body = serde_json::to_vec(&body).unwrap();
            let (_, peak) = peak_heap(|| health_service(&body, &AddressType::Tagged("wan".into())));
            prop_assert!(peak <= heap_bound(&body));
        }

        #[test]
        fn catalog_services_read_back_with_sorted_tags(
            services in prop::collection::btree_map(text(), prop::collection::vec(text(), 0..4), 0..8),
            legacy in any::<bool>(),
        ) {
            let body: serde_json::Map<String, Value> = services
                .iter()
                .map(|(name, tags)| (name.clone(), if legacy && tags.is_empty() { Value::Null } else { json!(tags) }))
                .collect();
            let parsed = catalog_services(&serde_json::to_vec(&body).unwrap()).unwrap();
            let want: BTreeMap<String, Vec<String>> = services
                .into_iter()
                .map(|(name, mut tags)| {
                    tags.sort();
                    (name, tags)
                })
                .collect();
            prop_assert_eq!(parsed, want);
        }

        #[test]
        fn checks_answers_split_into_their_elements_exactly(
            values in prop::collection::vec(any_json(), 0..6),
            pretty in any::<bool>(),
            step in 1..64usize,
        ) {
            let body = if pretty { serde_json::to_vec_pretty(&values) } else { serde_json::to_vec(&values) }.unwrap();
            let split = pieces(&body, usize::MAX, Split::Exact).unwrap();
            prop_assert_eq!(split.len(), values.len());
            for (piece, value) in split.iter().zip(&values) {
                // Each element is its value's bytes, whatever strings, escapes and brackets
                // it holds (compared read back when indented, floats read the same way).
                let alone = serde_json::to_vec(value).unwrap();
                if pretty {
                    let read = |b: &[u8]| serde_json::from_slice::<Value>(b).unwrap();
                    prop_assert_eq!(read(&piece.0), read(&alone));
                } else {
                    prop_assert_eq!(&piece.0, &alone);
                    prop_assert_eq!(piece.1, xxhash_rust::xxh3::xxh3_128(&alone));
                }
            }
            // The same pieces however the body arrives: a few bytes a read (an escape, a
            // bracket or a separator cut between reads) or all at once.
            prop_assert_eq!(pieces(&body, step, Split::Exact).unwrap(), split);
            // A truncated answer is an error from the split alone, never fewer checks.
            for cut in [0, body.len() / 3, body.len() / 2, body.len() - 1] {
                prop_assert!(pieces(&body[..cut], step, Split::Exact).is_err(), "prefix of {} bytes", cut);
            }
        }

        #[test]
        fn a_quick_split_whose_pieces_all_read_is_the_exact_split(
            checks in prop::collection::vec(
                (r#"[},{"\\ a]{0,8}"#, r#"[},{"\\ a]{0,8}"#, any::<u64>(), prop::option::of(any_json())),
                0..6,
            ),
            pretty in any::<bool>(),
            step in 1..64usize,
        ) {
            let body = state_body(&checks, pretty);
            let exact = pieces(&body, step, Split::Exact).unwrap();
            let quick = pieces(&body, step, Split::QuickTakingAll).unwrap();
            if quick.iter().all(|(bytes, _)| CheckBytes::of(bytes).read().is_ok()) {
                prop_assert_eq!(&quick, &exact);
            } else {
                // A cut inside a check: only where a check holds the separator (or the
                // answer is indented, and the quick split finds no separator at all).
                let holds = exact.iter().any(|(c, _)| memchr::memmem::find(c, b"},{").is_some());
                prop_assert!(holds || pretty, "a piece did not read, but no check holds the separator");
            }
            // A reader that refuses what is no check gets the exact split's checks.
            prop_assert_eq!(pieces(&body, step, Split::Refusing).unwrap(), exact);
        }

        #[test]
        fn health_state_reads_back_every_check(
            checks in prop::collection::vec((text(), text(), prop::option::of(text()), any::<u64>()), 0..8),
        ) {
            let body: Vec<Value> = checks
                .iter()
                .map(|(node, id, service, index)| json!({
                    "Node": node, "CheckID": id, "Name": "n", "Status": "passing",
                    "ServiceID": "", "ServiceName": service, "ServiceTags": [], "CreateIndex": 1, "ModifyIndex": index,
                }))
                .collect();
            let bytes = serde_json::to_vec(&body).unwrap();
            let rows = read_all(&bytes).unwrap();
            let want: Vec<CheckRow> = checks
                .into_iter()
                .map(|(node, check_id, service, modify_index)| CheckRow {
                    node: node.into(),
                    check_id: check_id.into(),
                    service: service.unwrap_or_default().into(),
                    modify_index,
                })
                .collect();
            prop_assert_eq!(rows, want);
        }
    }
}
