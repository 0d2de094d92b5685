//! Tokens and client certificates read from Secrets, and the watches of those Secrets.

use serde_json::json;
use tokio::time::Instant;

use crate::assembler::snapshot::UnusableReason;
use crate::assembler::{self, Config};
use crate::keys::WatchKey;
use crate::model::{ConsulEvent, Event, KubeEvent, WatchFailure};
use crate::pipeline::Step;

use super::fixtures::{
    BOOTSTRAP, fixed, listed, mapping, mappings_key, object, pipeline, publish, resolver, resolvers_key,
};

#[tokio::test(start_paused = true)]
async fn tokens_come_from_secrets_and_never_reach_the_snapshot() {
    let token = "0f7e6d5c-4b3a-2918-7654-32100fedcba9";
    let mut p = pipeline(Config::default());
    let now = Instant::now();
    p.set_fixed(fixed(), now);
    let diff = p.apply(
        listed(
            &resolvers_key(),
            vec![resolver(
                "shop",
                "consul",
                json!({"address": "127.0.0.1:8500", "tokenSecretRef": {"name": "consul-acl", "key": "token"}}),
            )],
        ),
        now,
    );
    // The Secret is watched by name as soon as the resolver names it.
    assert_eq!(
        diff.added.iter().map(ToString::to_string).collect::<Vec<_>>(),
        ["Secret/v1 in shop fields metadata.name=consul-acl"]
    );
    let diff = p.apply(
        listed(&mappings_key(), vec![mapping("shop", "m", json!({"service": "billing", "resolver": "consul"}))]),
        now,
    );
    assert!(diff.added.is_empty(), "no Consul watch without the token: {diff:?}");
    let secret_key = crate::assembler::resolvers::secret_key("shop", "consul-acl");
    use base64::Engine;
    let encoded = base64::engine::general_purpose::STANDARD.encode(format!("{token}\n"));
    let diff = p.apply(
        listed(
            &secret_key,
            vec![object(json!({"metadata": {"namespace": "shop", "name": "consul-acl"}, "data": {"token": encoded}}))],
        ),
        now,
    );
    let WatchKey::Consul(k) = &diff.added[0] else { panic!("{diff:?}") };
    assert_eq!(k.scope.server.token.as_ref().unwrap().expose(), token, "trimmed token from the Secret");
    p.apply([Event::Consul(k.clone(), ConsulEvent::Answer { index: 1, endpoints: vec![].into() })], now);
    let snap = publish(&mut p).unwrap();
    let bytes = String::from_utf8(snap.to_json().to_vec()).unwrap();
    assert!(!bytes.contains(token) && !bytes.contains(&encoded[..20]), "token leaked into the snapshot");
    // A rotated token restarts the watch with the new token.
    let encoded2 = base64::engine::general_purpose::STANDARD.encode("rotated");
    let diff = p.apply(
        [Event::Kube(
            secret_key,
            KubeEvent::Applied(object(
                json!({"metadata": {"namespace": "shop", "name": "consul-acl"}, "data": {"token": encoded2}}),
            )),
        )],
        now,
    );
    assert_eq!((diff.added.len(), diff.removed.len()), (1, 1));
}

#[tokio::test(start_paused = true)]
async fn client_certificates_come_from_secrets_and_go_in_pairs() {
    let mut p = pipeline(Config::default());
    let now = Instant::now();
    p.set_fixed(fixed(), now);
    let tls = |key_ref: serde_json::Value| {
        json!({"address": "https://127.0.0.1:8501", "tls": {
            "clientCertSecretRef": {"name": "consul-client", "key": "tls.crt"}, "clientKeySecretRef": key_ref}})
    };
    let both = resolver("shop", "paired", tls(json!({"name": "consul-client", "key": "tls.key"})));
    let half = resolver("shop", "half", tls(serde_json::Value::Null));
    p.apply(listed(&resolvers_key(), vec![both, half]), now);
    let mappings = vec![
        mapping("shop", "a", json!({"service": "billing", "resolver": "paired"})),
        mapping("shop", "b", json!({"service": "billing", "resolver": "half"})),
    ];
    p.apply(listed(&mappings_key(), mappings), now);
    use base64::Engine;
    let b64 = |s: &str| base64::engine::general_purpose::STANDARD.encode(s);
    let secret = json!({"metadata": {"namespace": "shop", "name": "consul-client"}, "type": "kubernetes.io/tls",
        "data": {"tls.crt": b64("CERT PEM"), "tls.key": b64("KEY PEM")}});
    let diff =
        p.apply(listed(&crate::assembler::resolvers::secret_key("shop", "consul-client"), vec![object(secret)]), now);
    let [WatchKey::Consul(k)] = diff.added.as_slice() else { panic!("one Consul watch: {diff:?}") };
    let id = k.scope.server.tls.as_ref().and_then(|t| t.client_identity.as_ref()).expect("a client identity");
    assert_eq!((&*id.cert_pem, id.key_pem.expose()), ("CERT PEM", "KEY PEM"));
    assert!(!format!("{k:?}").contains("KEY PEM"), "the key never prints");
    p.apply([Event::Consul(k.clone(), ConsulEvent::Answer { index: 1, endpoints: vec![].into() })], now);
    let snap = publish(&mut p).unwrap();
    let half = snap.content.resolvers.iter().find(|r| r.name == "half").unwrap();
    let unusable = half.unusable.as_ref().expect("half an identity is refused");
    assert!(unusable.message.contains("spec.tls.clientKeySecretRef"), "{unusable:?}");
}

#[tokio::test(start_paused = true)]
async fn a_rejected_secret_watch_does_not_hold_back_the_first_publication() {
    let mut p = pipeline(Config::default());
    let now = Instant::now();
    p.set_fixed(fixed(), now);
    let spec = json!({"address": "127.0.0.1:8500", "tokenSecretRef": {"name": "acl", "key": "token"}});
    p.apply(listed(&resolvers_key(), vec![resolver("locked", "consul", spec)]), now);
    p.apply(listed(&mappings_key(), vec![]), now);
    assert_eq!(p.poll(now), Step::WaitUntil(now + BOOTSTRAP), "the Secret is waited for");
    let secret = assembler::resolvers::secret_key("locked", "acl");
    p.apply([Event::Kube(secret, KubeEvent::Failed(WatchFailure::rejected("secrets is forbidden")))], now);
    let snap = publish(&mut p).expect("rejected is settled: published at once");
    let unusable = snap.content.resolvers[0].unusable.as_ref().unwrap();
    assert_eq!(unusable.reason, UnusableReason::SecretUnavailable);
    assert_eq!(unusable.message, "spec.tokenSecretRef: Secret locked/acl cannot be read: secrets is forbidden");
}
