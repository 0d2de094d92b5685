//! `?filter=`: the subset of Consul's go-bexpr expressions the simulator evaluates on health
//! rows.
//!
//! Supported: `and`, `or`, `not`, parentheses; `<Selector> == <Value>`, `!=`,
//! `<Selector> is empty`, `is not empty`, `<Selector> contains <Value>`, `not contains`,
//! `<Value> in <Selector>`, `not in`. Values are double-quoted (with `\"` and `\\`
//! escapes), backquoted, or bare words. Selectors: `Node.{ID,Node,Address,Datacenter}`,
//! `Node.Meta[.<key>]`, `Node.TaggedAddresses[.<key>]`,
//! `Service.{ID,Service,Address,Port,Kind,PeerName}`, `Service.Tags`,
//! `Service.Meta[.<key>]`, and `Checks.{CheckID,Name,Status,ServiceID}` (the values of all
//! the row's checks, a list). `matches` (regular expressions) is refused rather than
//! guessed at.
//!
//! An expression that does not parse, or names a selector outside that list, is refused the
//! way Consul refuses one: `Failed to create boolean expression evaluator: <why>`; the
//! `<why>` is the simulator's own wording (go-bexpr's differs).

use std::collections::BTreeMap;

use super::catalog::HealthEntry;

/// A parsed expression, ready to evaluate on rows.
#[derive(Debug, PartialEq)]
pub(crate) enum Filter {
    And(Box<Filter>, Box<Filter>),
    Or(Box<Filter>, Box<Filter>),
    Not(Box<Filter>),
    Match(Selector, Op, String),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Op {
    Equal,
    NotEqual,
    IsEmpty,
    IsNotEmpty,
    /// `<Selector> contains <Value>` and `<Value> in <Selector>` (the same test).
    Contains,
    NotContains,
}

/// A validated selector.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Selector {
    Node(&'static str),
    NodeMap(&'static str, Option<String>),
    Service(&'static str),
    ServiceTags,
    ServiceMap(&'static str, Option<String>),
    Checks(&'static str),
}

/// What a selector finds on a row.
enum Found {
    Text(String),
    List(Vec<String>),
    Map(BTreeMap<String, String>),
    /// A map key the row lacks: empty, equal to nothing.
    Missing,
}

/// The prefix Consul gives every refused expression.
const REFUSED: &str = "Failed to create boolean expression evaluator: ";

impl Filter {
    /// Parses an expression; the error is the whole message of Consul's 400.
    pub(crate) fn parse(expression: &str) -> Result<Filter, String> {
        let tokens = tokenize(expression).map_err(|e| format!("{REFUSED}{e}"))?;
        let mut parser = Parser { tokens, at: 0 };
        let filter = parser.or().map_err(|e| format!("{REFUSED}{e}"))?;
        match parser.tokens.get(parser.at) {
            None => Ok(filter),
            Some(t) => Err(format!("{REFUSED}unexpected {t:?} after a complete expression")),
        }
    }

    pub(crate) fn matches(&self, row: &HealthEntry) -> bool {
        match self {
            Filter::And(a, b) => a.matches(row) && b.matches(row),
            Filter::Or(a, b) => a.matches(row) || b.matches(row),
            Filter::Not(a) => !a.matches(row),
            Filter::Match(selector, op, value) => {
                let found = selector.find(row);
                match op {
                    Op::Equal => equals(&found, value),
                    Op::NotEqual => !equals(&found, value),
                    Op::IsEmpty => is_empty(&found),
                    Op::IsNotEmpty => !is_empty(&found),
                    Op::Contains => contains(&found, value),
                    Op::NotContains => !contains(&found, value),
                }
            }
        }
    }
}

fn equals(found: &Found, value: &str) -> bool {
    matches!(found, Found::Text(t) if t == value)
}

fn is_empty(found: &Found) -> bool {
    match found {
        Found::Text(t) => t.is_empty(),
        Found::List(l) => l.is_empty(),
        Found::Map(m) => m.is_empty(),
        Found::Missing => true,
    }
}

fn contains(found: &Found, value: &str) -> bool {
    match found {
        Found::Text(t) => t.contains(value),
        Found::List(l) => l.iter().any(|v| v == value),
        Found::Map(m) => m.contains_key(value),
        Found::Missing => false,
    }
}

impl Selector {
    fn parse(path: &str) -> Result<Selector, String> {
        let invalid = || format!("Selector {path:?} is not valid");
        let mut parts = path.splitn(3, '.');
        let (root, field, key) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""), parts.next());
        let field = known_field(root, field).ok_or_else(invalid)?;
        let key = key.map(str::to_owned);
        Ok(match (root, field) {
            ("Node", "Meta" | "TaggedAddresses") => Selector::NodeMap(field, key),
            ("Service", "Meta") => Selector::ServiceMap(field, key),
            _ if key.is_some() => return Err(invalid()),
            ("Node", _) => Selector::Node(field),
            ("Service", "Tags") => Selector::ServiceTags,
            ("Service", _) => Selector::Service(field),
            _ => Selector::Checks(field),
        })
    }

    fn find(&self, row: &HealthEntry) -> Found {
        let map = |m: &BTreeMap<String, String>, key: &Option<String>| match key {
            None => Found::Map(m.clone()),
            Some(k) => m.get(k).map_or(Found::Missing, |v| Found::Text(v.clone())),
        };
        let (n, s) = (&row.node, &row.service);
        match self {
            Selector::Node(f) => Found::Text(
                match *f {
                    "ID" => &n.id,
                    "Node" => &n.name,
                    "Address" => &n.address,
                    _ => &n.datacenter,
                }
                .clone(),
            ),
            Selector::NodeMap(f, key) => map(if *f == "Meta" { &n.meta } else { &n.tagged_addresses }, key),
            Selector::Service(f) => Found::Text(match *f {
                "ID" => s.id.clone(),
                "Service" => s.key.name.clone(),
                "Address" => s.address.clone(),
                "Port" => s.port.to_string(),
                "Kind" => s.kind.as_str().to_owned(),
                _ => row.peer.clone().unwrap_or_default(),
            }),
            Selector::ServiceTags => Found::List(s.tags.clone()),
            Selector::ServiceMap(_, key) => map(&s.meta, key),
            Selector::Checks(f) => Found::List(
                row.checks
                    .iter()
                    .map(|c| match *f {
                        "CheckID" => c.check_id.clone(),
                        "Name" => c.name.clone(),
                        "Status" => c.status.as_str().to_owned(),
                        _ => c.service_id.clone(),
                    })
                    .collect(),
            ),
        }
    }
}

/// The field of a selector root, as a `'static` name; `None` if the root has no such field.
fn known_field(root: &str, field: &str) -> Option<&'static str> {
    const NODE: &[&str] = &["ID", "Node", "Address", "Datacenter", "Meta", "TaggedAddresses"];
    const SERVICE: &[&str] = &["ID", "Service", "Address", "Port", "Kind", "PeerName", "Tags", "Meta"];
    const CHECKS: &[&str] = &["CheckID", "Name", "Status", "ServiceID"];
    let fields = match root {
        "Node" => NODE,
        "Service" => SERVICE,
        "Checks" => CHECKS,
        _ => return None,
    };
    fields.iter().copied().find(|f| *f == field)
}

#[derive(Clone, Debug, PartialEq)]
enum Token {
    Open,
    Close,
    Equal,
    NotEqual,
    /// A bare word: a keyword, a selector or an unquoted value.
    Word(String),
    /// A quoted value.
    Quoted(String),
}

fn tokenize(s: &str) -> Result<Vec<Token>, String> {
    let mut out = Vec::new();
    let mut chars = s.chars().peekable();
    while let Some(&c) = chars.peek() {
        match c {
            c if c.is_whitespace() => {
                chars.next();
            }
            '(' | ')' => {
                chars.next();
                out.push(if c == '(' { Token::Open } else { Token::Close });
            }
            '=' | '!' => {
                chars.next();
                if chars.next() != Some('=') {
                    return Err(format!("expected '=' after {c:?}"));
                }
                out.push(if c == '=' { Token::Equal } else { Token::NotEqual });
            }
            '"' | '`' => {
                chars.next();
                let mut value = String::new();
                loop {
                    match chars.next() {
                        None => return Err("unterminated string".to_owned()),
                        Some(q) if q == c => break,
                        Some('\\') if c == '"' => value.push(chars.next().ok_or("unterminated string")?),
                        Some(other) => value.push(other),
                    }
                }
                out.push(Token::Quoted(value));
            }
            _ => {
                let mut word = String::new();
                while let Some(&w) = chars.peek() {
                    if w.is_alphanumeric() || "_-.:/".contains(w) {
                        word.push(w);
                        chars.next();
                    } else {
                        break;
                    }
                }
                if word.is_empty() {
                    return Err(format!("unexpected character {c:?}"));
                }
                out.push(Token::Word(word));
            }
        }
    }
    if out.is_empty() {
        return Err("empty expression".to_owned());
    }
    Ok(out)
}

struct Parser {
    tokens: Vec<Token>,
    at: usize,
}

impl Parser {
    fn peek_word(&self, offset: usize) -> Option<&str> {
        match self.tokens.get(self.at + offset) {
            Some(Token::Word(w)) => Some(w),
            _ => None,
        }
    }

    fn next(&mut self) -> Option<Token> {
        let t = self.tokens.get(self.at).cloned();
        self.at += 1;
        t
    }

    fn keyword(&mut self, word: &str) -> bool {
        if self.peek_word(0) == Some(word) {
            self.at += 1;
            true
        } else {
            false
        }
    }

    fn or(&mut self) -> Result<Filter, String> {
        let mut left = self.and()?;
        while self.keyword("or") {
            left = Filter::Or(Box::new(left), Box::new(self.and()?));
        }
        Ok(left)
    }

    fn and(&mut self) -> Result<Filter, String> {
        let mut left = self.unary()?;
        while self.keyword("and") {
            left = Filter::And(Box::new(left), Box::new(self.unary()?));
        }
        Ok(left)
    }

    fn unary(&mut self) -> Result<Filter, String> {
        if self.keyword("not") {
            return Ok(Filter::Not(Box::new(self.unary()?)));
        }
        if self.tokens.get(self.at) == Some(&Token::Open) {
            self.at += 1;
            let inner = self.or()?;
            return match self.next() {
                Some(Token::Close) => Ok(inner),
                other => Err(format!("expected ')', found {other:?}")),
            };
        }
        self.comparison()
    }

    fn value(&mut self) -> Result<String, String> {
        match self.next() {
            Some(Token::Word(w) | Token::Quoted(w)) => Ok(w),
            other => Err(format!("expected a value, found {other:?}")),
        }
    }

    fn comparison(&mut self) -> Result<Filter, String> {
        // `<Value> [not] in <Selector>`: the value comes first.
        let in_at = if self.peek_word(1) == Some("in") {
            Some(false)
        } else if self.peek_word(1) == Some("not") && self.peek_word(2) == Some("in") {
            Some(true)
        } else {
            None
        };
        if let Some(negated) = in_at {
            let value = self.value()?;
            self.at += if negated { 2 } else { 1 };
            let selector = match self.next() {
                Some(Token::Word(w)) => Selector::parse(&w)?,
                other => return Err(format!("expected a selector after 'in', found {other:?}")),
            };
            return Ok(Filter::Match(selector, if negated { Op::NotContains } else { Op::Contains }, value));
        }
        let selector = match self.next() {
            Some(Token::Word(w)) => Selector::parse(&w)?,
            other => return Err(format!("expected a selector, found {other:?}")),
        };
        let op = match self.next() {
            Some(Token::Equal) => Op::Equal,
            Some(Token::NotEqual) => Op::NotEqual,
            Some(Token::Word(w)) if w == "is" => {
                let negated = self.keyword("not");
                if !self.keyword("empty") {
                    return Err("expected 'empty' after 'is'".to_owned());
                }
                let op = if negated { Op::IsNotEmpty } else { Op::IsEmpty };
                return Ok(Filter::Match(selector, op, String::new()));
            }
            Some(Token::Word(w)) if w == "contains" => Op::Contains,
            Some(Token::Word(w)) if w == "not" && self.keyword("contains") => Op::NotContains,
            Some(Token::Word(w)) if w == "matches" || (w == "not" && self.peek_word(0) == Some("matches")) => {
                return Err("'matches' is not implemented by consul-sim".to_owned());
            }
            other => return Err(format!("expected an operator, found {other:?}")),
        };
        Ok(Filter::Match(selector, op, self.value()?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::catalog::{Catalog, RegisterRequest, ServiceKey};

    fn rows() -> Vec<HealthEntry> {
        let mut c = Catalog::new("dc1", 1);
        let reg = |node: &str, id: &str, port: u16, tags: &[&str], version: &str, status: &str| {
            serde_json::from_value::<RegisterRequest>(serde_json::json!({
                "Node": node, "Address": "127.0.0.1",
                "Service": {"ID": id, "Service": "web", "Port": port, "Tags": tags, "Meta": {"version": version}},
                "Check": {"CheckID": format!("c-{id}"), "Name": "c", "Status": status, "ServiceID": id},
            }))
            .unwrap()
        };
        c.register(reg("n1", "a", 80, &["blue", "v1"], "1", "passing"), None, None).unwrap();
        c.register(reg("n2", "b", 81, &["green"], "2", "critical"), None, None).unwrap();
        c.health(&ServiceKey::new("web"), &[])
    }

    fn ids(expression: &str) -> Vec<String> {
        let f = Filter::parse(expression).unwrap_or_else(|e| panic!("{expression}: {e}"));
        rows().into_iter().filter(|r| f.matches(r)).map(|r| r.service.id.clone()).collect()
    }

    #[test]
    fn the_supported_forms_select_rows() {
        assert_eq!(ids(r#"Service.Meta.version == "2""#), ["b"]);
        assert_eq!(ids("Service.Port != 80"), ["b"]);
        assert_eq!(ids(r#""blue" in Service.Tags"#), ["a"]);
        assert_eq!(ids("v1 not in Service.Tags"), ["b"]);
        assert_eq!(ids("Service.Tags contains green or Node.Node == n1"), ["a", "b"]);
        assert_eq!(ids(r#"not (Checks.Status contains "critical") and Service.Meta is not empty"#), ["a"]);
        assert_eq!(ids("Service.Meta.absent is empty and Service.Meta.absent != x"), ["a", "b"]);
        assert_eq!(ids("Service.Meta contains version and Service.Tags not contains blue"), ["b"]);
        assert_eq!(ids("Node.Node == `n2`"), ["b"]);
    }

    #[test]
    fn bad_expressions_are_refused_as_consul_does() {
        for bad in [
            "",
            "Service.Port ==",
            "Service.Nope == 1",
            "(Service.Port == 80",
            "Service.ID matches \"a.*\"",
            "Service.Port = 80",
            "\"x",
        ] {
            let err = Filter::parse(bad).unwrap_err();
            assert!(err.starts_with(REFUSED), "{bad}: {err}");
        }
    }
}
