//! The Consul queries Mappings imply, shared by the resolvers that ask the same.

use serde_json::json;
use tokio::time::Instant;

use crate::assembler::snapshot::Part;
use crate::assembler::{self, Config};
use crate::keys::WatchKey;
use crate::model::{ConsulEvent, Event, KubeEvent};

use super::fixtures::{
    WINDOW, consul_keys, ep, fixed, listed, mapping, mappings_key, pipeline, publish, resolver, resolvers_key,
};

#[tokio::test(start_paused = true)]
async fn mappings_drive_consul_watches_and_sharing() {
    let mut p = pipeline(Config::default());
    let now = Instant::now();
    p.set_fixed(fixed(), now);
    p.apply(
        listed(
            &resolvers_key(),
            vec![
                resolver("shop", "consul", json!({"address": "127.0.0.1:8500", "datacenter": "dc1"})),
                // Same settings in another namespace: same queries, shared watches.
                resolver("blog", "consul", json!({"address": "http://127.0.0.1:8500", "datacenter": "dc1"})),
            ],
        ),
        now,
    );
    p.apply(
        listed(
            &mappings_key(),
            vec![
                mapping("shop", "a", json!({"service": "billing:8080", "resolver": "consul"})),
                mapping("shop", "b", json!({"service": "http://billing", "resolver": "consul"})),
                mapping("blog", "c", json!({"service": "billing.blog:80", "resolver": "consul"})),
                mapping("blog", "d", json!({"service": "posts", "resolver": "consul"})),
            ],
        ),
        now,
    );
    let services: Vec<_> = consul_keys(&p).iter().map(|k| k.service.clone()).collect();
    assert_eq!(services, ["billing", "posts"], "three Mappings, two resolvers, one billing watch");
    assert!(consul_keys(&p).iter().all(|k| k.scope.datacenter.as_deref() == Some("dc1")));

    // The two resolvers' equal entries of billing are one part, whose JSON is made and
    // kept once, and stay one after a new answer.
    let billing = |s: &assembler::Snapshot, ns: &str| {
        s.resolver(ns, "consul")
            .and_then(|r| r.services.iter().find(|e| e.name == "billing"))
            .cloned()
            .expect("billing")
    };
    for (index, address) in [(3, "10.0.0.1"), (4, "10.0.0.2")] {
        let answers = consul_keys(&p)
            .into_iter()
            .map(|k| Event::Consul(k, ConsulEvent::Answer { index, endpoints: vec![ep(address, 80)].into() }));
        p.apply(answers, now);
        tokio::time::advance(WINDOW * 2).await;
        let s = publish(&mut p).expect("published");
        assert_eq!(billing(&s, "blog").endpoints[0].address, address);
        assert!(Part::ptr_eq(&billing(&s, "shop"), &billing(&s, "blog")), "one part for equal entries");
    }

    // Mapping d goes: posts stops. Mapping a goes: billing stays (b and c still use it).
    let diff = p.apply(
        [
            Event::Kube(mappings_key(), KubeEvent::Deleted(mapping("blog", "d", json!({})).id)),
            Event::Kube(mappings_key(), KubeEvent::Deleted(mapping("shop", "a", json!({})).id)),
        ],
        now,
    );
    assert!(diff.added.is_empty());
    assert_eq!(diff.removed.len(), 1);
    assert!(matches!(&diff.removed[0], WatchKey::Consul(k) if k.service == "posts"));

    // Changing the resolver's spec restarts only the watches whose key changed.
    let diff = p.apply(
        [Event::Kube(
            resolvers_key(),
            KubeEvent::Applied(resolver("blog", "consul", json!({"address": "127.0.0.1:8500", "datacenter": "dc2"}))),
        )],
        now,
    );
    assert_eq!(diff.added.len(), 1, "{diff:?}");
    assert!(matches!(&diff.added[0], WatchKey::Consul(k) if k.scope.datacenter.as_deref() == Some("dc2")));
    assert!(diff.removed.is_empty(), "dc1 billing is still used by shop/b");
    // Their entries differ now (blog's new query has not answered): each its own.
    tokio::time::advance(WINDOW * 2).await;
    let s = publish(&mut p).expect("published");
    let (shop, blog) = (billing(&s, "shop"), billing(&s, "blog"));
    assert!(shop.synced && !blog.synced, "{shop:?} {blog:?}");
    assert!(!Part::ptr_eq(&shop, &blog));
}

/// Resolvers with the same settings share one answer: their entries, their last known good
/// and the world's store hold one list of endpoints, not a copy each (at 75,000 endpoints
/// and five resolvers the copies were about 100 MiB).
#[tokio::test(start_paused = true)]
async fn resolvers_share_one_list_of_endpoints() {
    let mut p = pipeline(Config::default());
    let now = Instant::now();
    p.set_fixed(fixed(), now);
    let address = json!({"address": "127.0.0.1:8500"});
    p.apply(
        listed(
            &resolvers_key(),
            vec![resolver("shop", "consul", address.clone()), resolver("blog", "consul", address)],
        ),
        now,
    );
    let routes = vec![
        mapping("shop", "a", json!({"service": "billing:80", "resolver": "consul"})),
        mapping("blog", "b", json!({"service": "billing:80", "resolver": "consul"})),
    ];
    p.apply(listed(&mappings_key(), routes), now);
    let key = consul_keys(&p).remove(0);
    p.apply(
        [Event::Consul(key.clone(), ConsulEvent::Answer { index: 3, endpoints: vec![ep("10.0.0.1", 80)].into() })],
        now,
    );
    let content = p.assembler().content(p.world());
    let (blog, shop) = (&content.resolvers[0].services[0].endpoints, &content.resolvers[1].services[0].endpoints);
    assert_eq!(**shop, [ep("10.0.0.1", 80)]);
    assert!(std::sync::Arc::ptr_eq(blog, shop), "one list for both resolvers");
    assert!(std::sync::Arc::ptr_eq(shop, &p.world().consul()[&key].endpoints), "the world's own");
}
