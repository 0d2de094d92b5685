//! Reading ConsulResolvers out of the world into the settings their queries use.
//!
//! Everything a resolver's spec names is validated before it is watched: a Secret name the
//! API server would refuse in a field selector is an `InvalidSpec`, never a request.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use super::snapshot::{Unusable, UnusableReason};
use crate::keys::{
    AddressType, ClientIdentity, Consistency, ConsulKey, ConsulServer, HealthStatuses, KubeKey, QueryOptions,
    QueryScope, Remote, Secret, TlsSettings,
};
use crate::model::Decoded;
use crate::world::World;
use consul_resolver_api::names::{self, NamespacedName};
use consul_resolver_api::resolver::{ConsistencyMode, ConsulResolverSpec, ConsulTls, HealthStatus, SecretKeyRef};

pub(crate) use consul_resolver_api::resolver::{GROUP, KIND};

/// A resolver in scope (its ambassadorId matches), usable or not.
#[derive(Debug, Clone)]
pub struct Resolver {
    pub namespace: String,
    pub name: String,
    pub spec: Option<ConsulResolverSpec>,
    /// `metadata.generation`, for the status's `observedGeneration`.
    pub generation: Option<i64>,
    /// The settings for its queries, or why it cannot be queried as it stands.
    pub settings: Result<Settings, Unusable>,
    /// The Secrets its spec names (validly): watched whether or not the rest of the spec
    /// is usable, so fixing the spec does not wait for a Secret to be read.
    pub secrets: Vec<KubeKey>,
}

impl Resolver {
    /// Its namespace and name.
    pub fn id(&self) -> NamespacedName {
        NamespacedName::new(self.namespace.clone(), self.name.clone())
    }

    /// The services it always watches (`spec.services`), whatever Mappings name.
    pub fn listed_services(&self) -> impl Iterator<Item = &str> {
        self.spec.iter().flat_map(|s| s.services.iter().flatten()).map(|s| &**s)
    }

    /// Whether Mappings in `namespace` (whose labels are `labels`, when known) may use it:
    /// its own namespace always, others as `spec.allowedNamespaces` says (a spec that
    /// cannot be read shares nothing).
    pub fn serves(&self, namespace: &str, labels: Option<&BTreeMap<String, String>>) -> bool {
        self.namespace == namespace
            || self.spec.as_ref().is_some_and(|s| s.serves_namespace(&self.namespace, namespace, labels))
    }

    /// Whether whom it serves depends on namespaces' labels (then Namespaces are watched).
    pub fn selects_namespaces(&self) -> bool {
        self.spec.as_ref().is_some_and(ConsulResolverSpec::selects_namespaces)
    }
}

/// Everything about a resolver that goes into its Consul keys but the service: one scope,
/// shared by the keys of all its services.
#[derive(Debug, Clone)]
pub struct Settings {
    scope: Arc<QueryScope>,
}

impl Settings {
    pub fn key(&self, service: &str) -> ConsulKey {
        ConsulKey { scope: self.scope.clone(), service: service.to_owned() }
    }

    /// Whether `key` is one of this resolver's queries (for some service), without
    /// building a key per service to compare.
    pub fn queries(&self, key: &ConsulKey) -> bool {
        key.scope == self.scope
    }

    pub fn server(&self) -> &ConsulServer {
        &self.scope.server
    }
}

/// The watch of Namespaces (their labels), while some resolver selects namespaces by label.
pub fn namespaces_key() -> KubeKey {
    KubeKey::new("", "v1", "Namespace")
}

/// The labels of every Namespace the world holds, by name.
pub(crate) fn namespace_labels(world: &World) -> BTreeMap<String, BTreeMap<String, String>> {
    world
        .objects_of("", "Namespace")
        .filter_map(|(id, stored)| match &stored.decoded {
            Decoded::Labels(labels) => Some((id.name.clone(), labels.clone())),
            _ => None,
        })
        .collect()
}

/// The watch that brings a Secret named by a resolver: that one Secret, by name.
pub fn secret_key(namespace: &str, name: &str) -> KubeKey {
    KubeKey::new("", "v1", "Secret").in_namespace(namespace).with_fields(format!("metadata.name={name}"))
}

fn invalid(message: String) -> Unusable {
    Unusable { reason: UnusableReason::InvalidSpec, message }
}

/// Reads every ConsulResolver of the operator's Ambassador ID, sorted by namespace and name.
pub fn read(world: &World, ambassador_id: &str, env: &BTreeMap<String, String>) -> Vec<Resolver> {
    let mut out: Vec<Resolver> = world
        .objects_of(GROUP, KIND)
        .filter_map(|(id, stored)| {
            let Decoded::Resolver(r) = &stored.decoded else { return None };
            let namespace = id.namespace.clone().unwrap_or_default();
            let name = id.name.clone();
            let generation = r.generation;
            match &r.spec {
                Ok(spec) if !spec.serves_ambassador_id(ambassador_id) => None,
                Ok(spec) => {
                    let refs = secret_refs(spec);
                    let secrets =
                        refs.iter().filter_map(|(_, r)| valid_ref(r).ok()).map(|r| secret_key(&namespace, &r.name));
                    let secrets = secrets.collect();
                    let settings = settings(world, &namespace, spec, &refs, env);
                    Some(Resolver { namespace, name, spec: Some(spec.clone()), generation, settings, secrets })
                }
                // We cannot tell whose it is; report it, a user needs to know.
                Err(e) => Some(Resolver {
                    namespace,
                    name,
                    spec: None,
                    generation,
                    settings: Err(invalid(e.clone())),
                    secrets: Vec::new(),
                }),
            }
        })
        .collect();
    out.sort_by(|a, b| (&a.namespace, &a.name).cmp(&(&b.namespace, &b.name)));
    out
}

/// The Secret references of a spec, with the field each is in.
fn secret_refs(spec: &ConsulResolverSpec) -> Vec<(&'static str, &SecretKeyRef)> {
    let token = spec.token_secret_ref.as_ref().map(|r| ("spec.tokenSecretRef", r));
    let tls = spec.tls.as_ref();
    let ca = tls.and_then(|t| t.ca_secret_ref.as_ref()).map(|r| ("spec.tls.caSecretRef", r));
    let cert = tls.and_then(|t| t.client_cert_secret_ref.as_ref()).map(|r| ("spec.tls.clientCertSecretRef", r));
    let key = tls.and_then(|t| t.client_key_secret_ref.as_ref()).map(|r| ("spec.tls.clientKeySecretRef", r));
    token.into_iter().chain(ca).chain(cert).chain(key).collect()
}

/// A reference whose name can go into a field selector and whose key can be in a Secret.
fn valid_ref(r: &SecretKeyRef) -> Result<&SecretKeyRef, String> {
    names::dns1123_subdomain(&r.name)
        .map_err(|why| format!("name {:?} is not a valid Secret name: it {why}", r.name))?;
    names::data_key(&r.key).map_err(|why| format!("key {:?} is not a valid Secret key: it {why}", r.key))?;
    Ok(r)
}

fn settings(
    world: &World,
    namespace: &str,
    spec: &ConsulResolverSpec,
    refs: &[(&'static str, &SecretKeyRef)],
    env: &BTreeMap<String, String>,
) -> Result<Settings, Unusable> {
    // First everything the spec alone decides (InvalidSpec), then the Secrets.
    let expanded = expand_env(&spec.address, env).map_err(|e| invalid(format!("spec.address: {e}")))?;
    let address = normalise_address(&expanded).map_err(|e| invalid(format!("spec.address {:?}: {e}", spec.address)))?;
    let datacenter = non_empty("datacenter", &spec.datacenter)?;
    let consul_ns = non_empty("namespace", &spec.namespace)?;
    let partition = non_empty("partition", &spec.partition)?;
    let remote = remote(spec)?;
    for (field, r) in refs {
        valid_ref(r).map_err(|e| invalid(format!("{field}: {e}")))?;
    }
    let server_name = tls_server_name(spec, &address)?;
    let query = query_options(spec).map_err(invalid)?;
    let token = spec
        .token_secret_ref
        .as_ref()
        .map(|r| read_secret(world, namespace, r, "spec.tokenSecretRef"))
        .transpose()?
        .map(|t| Secret::new(t.trim()));
    let tls = spec.tls.as_ref().map(|t| tls_settings(world, namespace, t, server_name)).transpose()?;
    Ok(Settings {
        scope: Arc::new(QueryScope {
            server: ConsulServer { address, token, tls },
            datacenter,
            namespace: consul_ns,
            partition,
            remote,
            query,
        }),
    })
}

/// An optional string field of the spec, which when present must say something.
fn non_empty(field: &str, v: &Option<String>) -> Result<Option<String>, Unusable> {
    match v.as_deref() {
        Some("") => Err(invalid(format!("spec.{field} must not be empty (omit it instead)"))),
        other => Ok(other.map(str::to_owned)),
    }
}

/// A peer or sameness group name: Consul checks it as a DNS label (the rule of Kubernetes'
/// RFC 1123 labels).
fn consul_label(field: &str, v: &Option<String>) -> Result<Option<String>, Unusable> {
    let v = non_empty(field, v)?;
    if let Some(name) = &v
        && names::dns1123_label(name).is_err()
    {
        return Err(invalid(format!(
            "spec.{field} {name:?} is not a Consul {field} name (at most 63 lower case letters, digits and -, \
             not starting or ending with -)"
        )));
    }
    Ok(v)
}

/// Where the instances come from when not from the local cluster: a peer or a sameness
/// group, never both, since both would mean two different sources of instances.
fn remote(spec: &ConsulResolverSpec) -> Result<Option<Remote>, Unusable> {
    match (consul_label("peer", &spec.peer)?, consul_label("samenessGroup", &spec.sameness_group)?) {
        (Some(_), Some(_)) => {
            Err(invalid("spec.peer and spec.samenessGroup are both set: a sameness group names its peers".into()))
        }
        (Some(peer), None) => Ok(Some(Remote::Peer(peer))),
        (None, Some(group)) => Ok(Some(Remote::SamenessGroup(group))),
        (None, None) => Ok(None),
    }
}

/// The TLS server name the spec asks for, once its TLS block is known to fit the address.
fn tls_server_name(spec: &ConsulResolverSpec, address: &str) -> Result<Option<String>, Unusable> {
    match &spec.tls {
        Some(_) if !address.starts_with("https://") => {
            Err(invalid("spec.tls is set but spec.address is not https://".to_owned()))
        }
        Some(t) if t.client_cert_secret_ref.is_some() != t.client_key_secret_ref.is_some() => Err(half_identity()),
        Some(t) => non_empty("tls.serverName", &t.server_name),
        None => Ok(None),
    }
}

/// The TLS settings with the CA and client identity read from their Secrets.
fn tls_settings(
    world: &World,
    namespace: &str,
    t: &ConsulTls,
    server_name: Option<String>,
) -> Result<TlsSettings, Unusable> {
    let read = |r, field| read_secret(world, namespace, r, field);
    let ca_pem = t.ca_secret_ref.as_ref().map(|r| read(r, "spec.tls.caSecretRef")).transpose()?.map(Arc::<str>::from);
    let client_identity = match (&t.client_cert_secret_ref, &t.client_key_secret_ref) {
        (None, None) => None,
        (Some(cert), Some(key)) => Some(ClientIdentity {
            cert_pem: Arc::from(read(cert, "spec.tls.clientCertSecretRef")?),
            key_pem: Secret::new(read(key, "spec.tls.clientKeySecretRef")?),
        }),
        (Some(_), None) | (None, Some(_)) => return Err(half_identity()),
    };
    Ok(TlsSettings {
        ca_pem,
        server_name,
        insecure_skip_verify: t.insecure_skip_verify.unwrap_or(false),
        client_identity,
    })
}

fn half_identity() -> Unusable {
    invalid("spec.tls.clientCertSecretRef and spec.tls.clientKeySecretRef go together: set both or neither".to_owned())
}

/// The longest `spec.filter` (the CRD schema says so too): it travels in every request's URL.
const MAX_FILTER_CHARS: usize = 2048;

/// The spec's query options, validated beyond what the CRD schema can say.
fn query_options(spec: &ConsulResolverSpec) -> Result<QueryOptions, String> {
    let statuses = match (&spec.health_statuses, spec.only_passing) {
        (Some(_), Some(_)) => {
            return Err("spec.healthStatuses and spec.onlyPassing are both set: keep healthStatuses".into());
        }
        (Some(list), None) => {
            if list.is_empty() {
                return Err("spec.healthStatuses is empty: no instance could ever be published".into());
            }
            let has = |s| list.contains(&s);
            HealthStatuses {
                passing: has(HealthStatus::Passing),
                warning: has(HealthStatus::Warning),
                critical: has(HealthStatus::Critical),
            }
        }
        (None, Some(false)) => HealthStatuses::ANY,
        (None, Some(true) | None) => HealthStatuses::PASSING,
    };
    let (mut tags, mut excluded_tags) = (BTreeSet::new(), BTreeSet::new());
    for (i, t) in spec.tags.iter().flatten().enumerate() {
        match t.strip_prefix('!') {
            Some("") => return Err(format!("spec.tags[{i}] is \"!\": it negates no tag")),
            Some(negated) => excluded_tags.insert(negated.to_owned()),
            None if t.is_empty() => return Err(format!("spec.tags[{i}] is empty")),
            None => tags.insert(t.0.clone()),
        };
    }
    if let Some(both) = tags.iter().find(|t| excluded_tags.iter().any(|x| x.eq_ignore_ascii_case(t))) {
        return Err(format!("spec.tags both requires and excludes {both:?}: no instance could match"));
    }
    let consistency = match spec.consistency.unwrap_or_default() {
        ConsistencyMode::Default => Consistency::Default,
        ConsistencyMode::Stale => Consistency::Stale,
        ConsistencyMode::Consistent => Consistency::Consistent,
    };
    let cached = spec.cached.unwrap_or(false);
    if cached && consistency == Consistency::Consistent {
        return Err("spec.cached cannot be combined with consistency: consistent (the agent's cache is not)".into());
    }
    let address = match spec.address_type.as_deref() {
        None | Some("service") => AddressType::Service,
        Some("node") => AddressType::Node,
        Some(t)
            if !t.is_empty()
                && t.len() <= 63
                && t.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_') =>
        {
            AddressType::Tagged(t.to_owned())
        }
        Some(t) => {
            return Err(format!(
                "spec.addressType {t:?} is not service, node or a tagged address name (lower case letters, digits, _)"
            ));
        }
    };
    let filter = match spec.filter.as_deref() {
        None => None,
        Some("") => return Err("spec.filter must not be empty (omit it instead)".into()),
        Some(f) if f.chars().count() > MAX_FILTER_CHARS => {
            return Err(format!("spec.filter is longer than {MAX_FILTER_CHARS} characters"));
        }
        Some(f) if f.chars().any(char::is_control) => {
            return Err("spec.filter holds a control character (a line break?): write it on one line".into());
        }
        Some(f) => Some(Arc::from(f)),
    };
    Ok(QueryOptions {
        statuses,
        tags,
        excluded_tags,
        consistency,
        cached,
        connect: spec.connect.unwrap_or(false),
        address,
        filter,
    })
}

fn read_secret(world: &World, namespace: &str, r: &SecretKeyRef, field: &str) -> Result<String, Unusable> {
    let shown = format!("{field}: Secret {namespace}/{}", r.name);
    let unavailable = |what: String| Unusable { reason: UnusableReason::SecretUnavailable, message: what };
    let store = world.kube().get(&secret_key(namespace, &r.name));
    let Some(store) = store.filter(|s| s.listed) else {
        return Err(match store.and_then(|s| s.rejection()) {
            Some(why) => unavailable(format!("{shown} cannot be read: {why}")),
            None => {
                Unusable { reason: UnusableReason::WaitingForSecret, message: format!("{shown}: waiting to read it") }
            }
        });
    };
    let data = store
        .objects
        .iter()
        .find(|(id, _)| id.name == r.name)
        .and_then(|(_, s)| match &s.decoded {
            Decoded::Secret(data) => Some(data),
            _ => None,
        })
        .ok_or_else(|| unavailable(format!("{shown} not found")))?;
    let value = data.get(&r.key).ok_or_else(|| unavailable(format!("{shown} has no key {:?}", r.key)))?;
    let bytes = value.clone().ok_or_else(|| unavailable(format!("{shown} key {:?} is not valid base64", r.key)))?;
    String::from_utf8(bytes).map_err(|_| unavailable(format!("{shown} key {:?} is not UTF-8", r.key)))
}

/// Expands `${VAR}` from the operator's environment. An unset variable is an error: a
/// resolver pointed at `:8500` would be worse than one reported as broken.
pub fn expand_env(input: &str, env: &BTreeMap<String, String>) -> Result<String, String> {
    let mut out = String::with_capacity(input.len());
    let mut rest = input;
    while let Some(start) = rest.find("${") {
        out.push_str(&rest[..start]);
        let after = &rest[start + 2..];
        let end = after.find('}').ok_or_else(|| format!("unclosed ${{ in {input:?}"))?;
        let var = &after[..end];
        if var.is_empty() || !var.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
            return Err(format!("invalid variable name {var:?} in {input:?}"));
        }
        let value = env.get(var).ok_or_else(|| {
            format!("environment variable {var} is not set in the operator, or not one --address-env allows")
        })?;
        out.push_str(value);
        rest = &after[end + 1..];
    }
    out.push_str(rest);
    Ok(out)
}

/// `host:port`, `http://host:port` or `https://host:port` (port defaults to 8500 for
/// http and 8501 for https, Consul's defaults) to `scheme://host:port`.
pub fn normalise_address(address: &str) -> Result<String, String> {
    if address.is_empty() {
        return Err("is empty".to_owned());
    }
    if address.chars().any(char::is_whitespace) {
        return Err("contains whitespace".to_owned());
    }
    let (scheme, rest) = match address.split_once("://") {
        Some((s, rest)) => match s.to_ascii_lowercase().as_str() {
            "http" => ("http", rest),
            "https" => ("https", rest),
            _ => return Err(format!("scheme {s:?} is not http or https")),
        },
        None => ("http", address),
    };
    let rest = rest.strip_suffix('/').unwrap_or(rest);
    if rest.contains('/') || rest.contains('?') {
        return Err("must not have a path or query".to_owned());
    }
    let default_port = if scheme == "https" { 8501 } else { 8500 };
    let (host, port) = if let Some(v6) = rest.strip_prefix('[') {
        let (ip, tail) = v6.split_once(']').ok_or("has an unclosed '['")?;
        let port = match tail.strip_prefix(':') {
            Some(p) => p,
            None if tail.is_empty() => "",
            None => return Err("has garbage after the IPv6 address".to_owned()),
        };
        (format!("[{ip}]"), port)
    } else {
        match rest.rsplit_once(':') {
            Some((h, p)) => (h.to_owned(), p),
            None => (rest.to_owned(), ""),
        }
    };
    if host.is_empty() || host == "[]" {
        return Err("has no host".to_owned());
    }
    let port: u16 = if port.is_empty() {
        default_port
    } else {
        match port.parse::<u16>() {
            Ok(p) if p > 0 => p,
            _ => return Err(format!("port {port:?} is not a number in 1-65535")),
        }
    };
    Ok(format!("{scheme}://{}:{port}", host.to_ascii_lowercase()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_normalise() {
        assert_eq!(normalise_address("127.0.0.1:8500").unwrap(), "http://127.0.0.1:8500");
        assert_eq!(normalise_address("consul").unwrap(), "http://consul:8500");
        assert_eq!(normalise_address("HTTPS://Consul.Example/").unwrap(), "https://consul.example:8501");
        assert_eq!(normalise_address("http://[::1]:9500").unwrap(), "http://[::1]:9500");
        for bad in ["", "ftp://x", "x:0", "x:port", "http://x/v1", "a b:80", "http://:80"] {
            assert!(normalise_address(bad).is_err(), "{bad:?} should be rejected");
        }
    }

    #[test]
    fn env_expands_and_unset_is_an_error() {
        let env = BTreeMap::from([("HOST_IP".to_owned(), "10.1.2.3".to_owned())]);
        assert_eq!(expand_env("${HOST_IP}:8500", &env).unwrap(), "10.1.2.3:8500");
        assert_eq!(expand_env("plain:8500", &env).unwrap(), "plain:8500");
        let e = expand_env("${NOPE}:8500", &env).unwrap_err();
        assert!(e.contains("NOPE is not set"), "{e}");
        assert!(expand_env("${HOST_IP:8500", &env).is_err());
        assert!(expand_env("${}:1", &env).is_err());
    }

    fn options(spec: serde_json::Value) -> Result<QueryOptions, String> {
        let mut full = serde_json::json!({"address": "127.0.0.1:8500"});
        full.as_object_mut().unwrap().extend(spec.as_object().unwrap().clone());
        query_options(&serde_json::from_value(full).unwrap())
    }

    #[test]
    fn query_options_from_the_spec() {
        let default = options(serde_json::json!({})).unwrap();
        assert_eq!(default, QueryOptions::default());
        assert!(default.statuses.only_passing());

        assert_eq!(options(serde_json::json!({"onlyPassing": false})).unwrap().statuses, HealthStatuses::ANY);
        assert_eq!(options(serde_json::json!({"onlyPassing": true})).unwrap().statuses, HealthStatuses::PASSING);
        let pw = options(serde_json::json!({"healthStatuses": ["warning", "passing"]})).unwrap().statuses;
        assert_eq!(pw, HealthStatuses { passing: true, warning: true, critical: false });

        let o = options(serde_json::json!({
            "tags": ["v2", "!canary"], "consistency": "stale", "cached": true, "connect": true, "addressType": "lan_ipv4"
        }))
        .unwrap();
        assert_eq!(o.tags, BTreeSet::from(["v2".to_owned()]));
        assert_eq!(o.excluded_tags, BTreeSet::from(["canary".to_owned()]));
        assert_eq!((o.consistency, o.cached, o.connect), (Consistency::Stale, true, true));
        assert_eq!(o.address, AddressType::Tagged("lan_ipv4".into()));
        assert_eq!(options(serde_json::json!({"addressType": "node"})).unwrap().address, AddressType::Node);
        assert_eq!(options(serde_json::json!({"addressType": "service"})).unwrap().address, AddressType::Service);

        for (spec, says) in [
            (serde_json::json!({"healthStatuses": ["passing"], "onlyPassing": true}), "both set"),
            (serde_json::json!({"healthStatuses": []}), "healthStatuses is empty"),
            (serde_json::json!({"tags": ["!"]}), "spec.tags[0] is \"!\""),
            (serde_json::json!({"tags": ["a", "!A"]}), "both requires and excludes"),
            (serde_json::json!({"cached": true, "consistency": "consistent"}), "spec.cached cannot"),
            (serde_json::json!({"addressType": "Lan IPv4"}), "spec.addressType \"Lan IPv4\""),
            (serde_json::json!({"filter": ""}), "spec.filter must not be empty"),
            (serde_json::json!({"filter": "Service.Port ==\n80"}), "control character"),
            (serde_json::json!({"filter": "x".repeat(2049)}), "longer than 2048"),
        ] {
            let e = options(spec.clone()).unwrap_err();
            assert!(e.contains(says), "{spec}: {e}");
        }
        let f = options(serde_json::json!({"filter": "Service.Meta.version == \"2\""})).unwrap().filter;
        assert_eq!(f.as_deref(), Some("Service.Meta.version == \"2\""));
    }

    fn key_of(spec: serde_json::Value) -> Result<ConsulKey, Unusable> {
        let mut full = serde_json::json!({"address": "127.0.0.1:8500"});
        full.as_object_mut().unwrap().extend(spec.as_object().unwrap().clone());
        let spec: ConsulResolverSpec = serde_json::from_value(full).unwrap();
        let world = World::new(std::time::Duration::from_secs(30));
        settings(&world, "ns", &spec, &[], &BTreeMap::new()).map(|s| s.key("web"))
    }

    #[test]
    fn a_peer_or_a_sameness_group_is_part_of_the_key_never_both() {
        assert_eq!(key_of(serde_json::json!({})).unwrap().scope.remote, None);
        let peer = key_of(serde_json::json!({"peer": "dc2-default"})).unwrap();
        assert_eq!(peer.scope.remote, Some(Remote::Peer("dc2-default".into())));
        let group = key_of(serde_json::json!({"samenessGroup": "web-group"})).unwrap();
        assert_eq!(group.scope.remote, Some(Remote::SamenessGroup("web-group".into())));
        assert_ne!(peer, group);
        for (spec, says) in [
            (serde_json::json!({"peer": "a", "samenessGroup": "b"}), "both set"),
            (serde_json::json!({"peer": "Other_Cluster"}), "spec.peer \"Other_Cluster\" is not a Consul peer name"),
            (serde_json::json!({"samenessGroup": "-x"}), "spec.samenessGroup \"-x\""),
            (serde_json::json!({"peer": ""}), "spec.peer must not be empty"),
        ] {
            let e = key_of(spec.clone()).unwrap_err();
            assert_eq!(e.reason, UnusableReason::InvalidSpec, "{spec}");
            assert!(e.message.contains(says), "{spec}: {}", e.message);
        }
    }
}
