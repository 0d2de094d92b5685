//! The snapshot ConfigMap, in the format of [`format`] (plain JSON, gzip, or a gzip stream
//! split over parts named by their content, and an index naming them).
//!
//! A publication creates the parts the cluster lacks, then writes the index naming them; a
//! reader fetches only the parts it has not read before (docs/snapshot.md). The switch to
//! a new split snapshot is atomic: its parts exist before the index names them, and the
//! parts the previous index names are left alone. A reader gets the old snapshot whole or
//! the new one whole, and a writer stopped at any point (even SIGKILL) leaves the old one
//! readable. After the index, our parts that neither the new index nor the previous one
//! names are deleted (the previous one's are kept for readers still reading it); our parts
//! are found by their label, once per process or leadership term, so those of a writer
//! stopped before its index are deleted too.
//!
//! Writes happen only while this replica leads, each bounded by the leadership deadline
//! and none sent after it, and each is conditional on what this replica last saw of that
//! ConfigMap ([`Writer`]): a name it has not seen is created (which fails if it exists), a
//! known one is replaced with the resourceVersion it last wrote or read (an update, its
//! body in protobuf, `kube_client::protobuf`: the same update in JSON costs the API server
//! about 1.5 times the CPU, a server-side apply about 2.6 times, docs/benchmarks.md), and a
//! stale part is deleted with the resourceVersion and uid it was just read with. A write
//! delayed past a change of leader (sent just before the deadline, applied by an API server
//! that was frozen) then fails with a conflict instead of overwriting the new leader's
//! snapshot. What was written is compared with the cluster every resync period, so a
//! deleted or edited snapshot ConfigMap is written again ([`ConfigMapPublisher::repair`]).

mod format;

pub use format::*;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};

use futures::FutureExt;
use futures::future::BoxFuture;
use k8s_openapi::api::core::v1::ConfigMap;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::Api;
use kube::api::{DeleteParams, ListParams, PostParams, Preconditions};
use tokio::time::Instant;

use super::{PublishError, Publisher};
use crate::kube_client::{FIELD_MANAGER, protobuf, status_code};
use crate::leadership::Leadership;
use consul_resolver_api::names::NamespacedName;
use consul_resolver_core::assembler::Snapshot;
use consul_resolver_core::keys::KubeKey;

/// Parts created at once ([`Writer::create_parts`]): a change's few new parts in one round
/// trip, while a first publication's dozens (each up to [`DATA_BUDGET`]) are not all held
/// in requests at the same time.
const PARTS_AT_ONCE: usize = 4;

/// Writes each snapshot to the `--snapshot-configmap`.
pub(crate) struct ConfigMapPublisher {
    api: Api<ConfigMap>,
    target: NamespacedName,
    budget: usize,
    leadership: Leadership,
    state: Arc<Mutex<State>>,
}

#[derive(Default)]
struct State {
    /// Bumped by [`Publisher::forget`]: a write that started before does not record itself.
    epoch: u64,
    /// The hash and ConfigMaps of the last snapshot written completely; `None` at start,
    /// after taking over and after a failed write (which may or may not have switched the
    /// index): the next write is then never skipped as equal to what the cluster holds.
    written: Option<(String, Arc<Encoded>)>,
    /// Our parts in the cluster, as far as this replica knows; `None` when not known (as
    /// for `written`): the next write lists them first.
    parts: Option<Parts>,
    /// Each of our ConfigMaps as we last wrote or read it; a name absent is one not seen
    /// (or seen absent), written by creating it.
    versions: BTreeMap<String, Seen>,
}

/// The part ConfigMaps in the cluster.
#[derive(Debug, Clone, Default)]
struct Parts {
    /// Every part of ours there is (labelled as ours, named as ours are).
    existing: BTreeSet<String>,
    /// Those this replica created, or read and found holding the bytes their name says:
    /// a listed name alone is a claim, and the index never names a part on a claim.
    verified: BTreeSet<String>,
    /// The parts the index in the cluster names: readers may be reading them.
    named: BTreeSet<String>,
}

/// What this replica last saw of one ConfigMap: every write of it is conditional on this.
#[derive(Debug, Clone)]
struct Seen {
    /// Its metadata as seen, without managedFields: the resourceVersion (and for a
    /// deletion the uid) a write is conditional on, and what others set there, which a
    /// replacement keeps ([`over_seen`]).
    meta: Arc<ObjectMeta>,
}

impl Seen {
    /// `None` for an object without a resourceVersion (nothing to be conditional on).
    fn of(meta: &ObjectMeta) -> Option<Seen> {
        meta.resource_version.as_ref()?;
        Some(Seen { meta: Arc::new(ObjectMeta { managed_fields: None, ..meta.clone() }) })
    }
}

/// Our labels and annotations: a replacement sets those `ours` carries and drops the
/// others of these that it does not.
const OUR_LABELS: [&str; 3] = [LABEL_MANAGED_BY, LABEL_SNAPSHOT, LABEL_PART_OF];
const OUR_ANNOTATIONS: [&str; 2] = [ANNOTATION_ID, ANNOTATION_HASH];

/// `ours` as a replacement of the object seen with `seen`, conditional on its version
/// (the resourceVersion `seen` holds).
/// The data are ours alone; of the metadata, what others set (their labels and
/// annotations, owner references, finalizers) is kept as seen.
fn over_seen(seen: &ObjectMeta, ours: &ConfigMap) -> ConfigMap {
    let merged = |theirs: &Option<BTreeMap<String, String>>, ours: &Option<BTreeMap<String, String>>, keys: &[&str]| {
        let mut m: BTreeMap<String, String> = theirs
            .iter()
            .flatten()
            .filter(|(k, _)| !keys.contains(&k.as_str()))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        m.extend(ours.iter().flatten().map(|(k, v)| (k.clone(), v.clone())));
        (!m.is_empty()).then_some(m)
    };
    let metadata = ObjectMeta {
        labels: merged(&seen.labels, &ours.metadata.labels, &OUR_LABELS),
        annotations: merged(&seen.annotations, &ours.metadata.annotations, &OUR_ANNOTATIONS),
        managed_fields: None,
        ..seen.clone()
    };
    ConfigMap { metadata, ..ours.clone() }
}

impl ConfigMapPublisher {
    pub(crate) fn new(client: kube::Client, target: NamespacedName, leadership: Leadership) -> Self {
        Self::with_budget(client, target, leadership, DATA_BUDGET)
    }

    pub(crate) fn with_budget(
        client: kube::Client,
        target: NamespacedName,
        leadership: Leadership,
        budget: usize,
    ) -> Self {
        let api = Api::namespaced(client, &target.namespace);
        ConfigMapPublisher { api, target, budget, leadership, state: Arc::default() }
    }

    /// The highest snapshot id in the ConfigMaps now, whoever wrote them (`None` if there
    /// is none yet): `NAME`'s, and every part's. A leader stopped between its parts and its
    /// index has written parts of a snapshot no index names yet: a successor numbering
    /// after the index alone would give its own, other snapshot that same id.
    pub(crate) async fn published_id(&self) -> Result<Option<u64>, PublishError> {
        let name = &self.target.name;
        let main = self.api.get_opt(name).await.map_err(PublishError::kube(format!("get ConfigMap {name}")))?;
        let parts = list_parts(&self.api, &self.target).await?;
        let ids = parts.iter().filter_map(|p| snapshot_id(&p.metadata));
        Ok(main.as_ref().and_then(|m| snapshot_id(&m.metadata)).into_iter().chain(ids).max())
    }

    /// How many part ConfigMaps the last snapshot written took (0: it fit in one), if
    /// this replica has written one since it last took over.
    pub(crate) fn parts_written(&self) -> Option<usize> {
        self.state.lock().expect("configmap state lock").written.as_ref().map(|(_, e)| e.parts.len())
    }

    /// Compares what was last written with the cluster and writes again whatever was
    /// deleted or edited since. Returns the names written again.
    pub(crate) async fn repair(&self) -> Result<Vec<String>, PublishError> {
        let Some(until) = self.leadership.until() else { return Ok(Vec::new()) };
        let (epoch, written, mut versions) = {
            let st = self.state.lock().expect("configmap state lock");
            (st.epoch, st.written.clone(), st.versions.clone())
        };
        let Some((_, encoded)) = written else { return Ok(Vec::new()) };
        let repaired = tokio::time::timeout_at(until, async {
            let mut writer = Writer { api: &self.api, leadership: &self.leadership, until, seen: &mut versions };
            let mut damaged = Vec::new();
            // Parts first: the index must never name a part that is not there.
            for part in &encoded.parts {
                let expected = encoded.part_configmap(part);
                match writer.read(&part.name).await? {
                    Some(live) if same_part(&live, &expected) => continue,
                    // Immutable: replaced, not edited.
                    Some(_) => {
                        writer.delete(&part.name).await?;
                    }
                    None => {}
                }
                writer.create_part(&expected).await?;
                damaged.push(part.name.clone());
            }
            let live = writer.read(&self.target.name).await?;
            if !live.is_some_and(|live| same_content(&live, &encoded.main)) {
                writer.write(&encoded.main).await?;
                damaged.push(self.target.name.clone());
            }
            Ok::<_, PublishError>(damaged)
        })
        .await
        .map_err(|_| PublishError::LeadershipLapsed("the snapshot ConfigMap"))
        .and_then(|r| r);
        // Kept whatever happened: what a failed write left is what the next one is
        // conditional on.
        let mut st = self.state.lock().expect("configmap state lock");
        if st.epoch == epoch {
            st.versions = versions;
        }
        repaired
    }
}

/// Our parts of `target`'s snapshots in the cluster, by their label: names, versions and
/// annotations only (not their bytes).
async fn list_parts(
    api: &Api<ConfigMap>,
    target: &NamespacedName,
) -> Result<Vec<kube::core::PartialObjectMeta<ConfigMap>>, PublishError> {
    let params = ListParams::default().labels(&format!("{LABEL_PART_OF}={}", target.name));
    let list = api
        .list_metadata(&params)
        .await
        .map_err(PublishError::kube(format!("list the parts of ConfigMap {}", target.name)))?;
    // A label is only a claim: a part must also be named as ours are.
    let prefix = format!("{}-", target.name);
    Ok(list.items.into_iter().filter(|p| p.metadata.name.as_deref().is_some_and(|n| n.starts_with(&prefix))).collect())
}

/// A `--watch` key with the operator's snapshot ConfigMaps left out, when it watches
/// ConfigMaps: `!consulresolver.io/snapshot` is added to its label selector, so the API
/// server never sends them. Otherwise each publication would come back through the watch
/// into the next snapshot, which would grow without end. Other keys are returned as they are.
pub(crate) fn without_snapshots(key: KubeKey) -> KubeKey {
    if !key.is("", "ConfigMap") {
        return key;
    }
    let exclude = format!("!{LABEL_SNAPSHOT}");
    let selector = match &key.label_selector {
        Some(s) if s.split(',').any(|term| term.trim() == exclude) => return key,
        Some(s) if !s.trim().is_empty() => format!("{s},{exclude}"),
        _ => exclude,
    };
    key.with_labels(selector)
}

/// Whether part `live` holds what we wrote as `expected`: its bytes, under our labels. (Its
/// annotation names the snapshot that first needed it, not the latest.)
fn same_part(live: &ConfigMap, expected: &ConfigMap) -> bool {
    let labels = expected.metadata.labels.iter().flatten();
    live.binary_data == expected.binary_data
        && labels.into_iter().all(|(k, v)| live.metadata.labels.as_ref().and_then(|l| l.get(k)) == Some(v))
}

/// Whether `live` holds what we wrote as `expected` (data, labels and annotations ours).
fn same_content(live: &ConfigMap, expected: &ConfigMap) -> bool {
    let ours = |m: &Option<BTreeMap<String, String>>, keys: &Option<BTreeMap<String, String>>| {
        keys.iter().flatten().all(|(k, v)| m.as_ref().and_then(|m| m.get(k)) == Some(v))
    };
    live.data == expected.data
        && live.binary_data == expected.binary_data
        && ours(&live.metadata.labels, &expected.metadata.labels)
        && ours(&live.metadata.annotations, &expected.metadata.annotations)
}

/// The snapshot id a ConfigMap of ours carries.
fn snapshot_id(meta: &ObjectMeta) -> Option<u64> {
    meta.annotations.as_ref()?.get(ANNOTATION_ID)?.parse().ok()
}

/// Whether the API server refused a request with 409: the object exists (a create), or is
/// no longer the version the request was conditional on.
fn is_conflict(e: &PublishError) -> bool {
    matches!(e, PublishError::Kube { source, .. } if status_code(source) == Some(409))
}

/// Whether the API server refused a replacement with 404: the object was deleted since it
/// was seen.
fn is_gone(e: &PublishError) -> bool {
    matches!(e, PublishError::Kube { source, .. } if status_code(source) == Some(404))
}

/// The requests of one publication or repair. Every write is conditional on what this
/// replica last saw of that ConfigMap (`seen`, updated by every answer), and none is sent
/// once the deadline has passed or leadership is gone.
struct Writer<'a> {
    api: &'a Api<ConfigMap>,
    leadership: &'a Leadership,
    /// The leadership deadline the publication started with; the whole is bounded by it.
    until: Instant,
    seen: &'a mut BTreeMap<String, Seen>,
}

impl Writer<'_> {
    /// Whether a write may still be sent. The whole publication is bounded by
    /// `timeout_at(until)`, but a task resumed after a pause (a stopped process, a starved
    /// CPU) is polled with the answer to its last request before that timer fires: without
    /// this check it would send its next write after its deadline, when another replica may
    /// lead.
    fn may_write(&self) -> Result<(), PublishError> {
        if Instant::now() < self.until && self.leadership.is_leading() {
            Ok(())
        } else {
            Err(PublishError::LeadershipLapsed("the snapshot ConfigMap"))
        }
    }

    /// Remembers the API server's answer about `name` (`None`: it does not exist).
    fn saw(&mut self, name: &str, cm: Option<&ConfigMap>) {
        match cm.and_then(|cm| Seen::of(&cm.metadata)) {
            Some(seen) => self.seen.insert(name.to_owned(), seen),
            None => self.seen.remove(name),
        };
    }

    /// Reads `name`, and remembers it.
    async fn read(&mut self, name: &str) -> Result<Option<ConfigMap>, PublishError> {
        let cm = self.api.get_opt(name).await.map_err(PublishError::kube(format!("get ConfigMap {name}")))?;
        self.saw(name, cm.as_ref());
        Ok(cm)
    }

    /// Writes `cm` (only ever `NAME`; parts are created, never written over): created whole
    /// when its name was not seen, replaced conditional on the version seen otherwise. A 409
    /// (someone else created it, or wrote it since) is read and written over once, and a 404
    /// (deleted since it was seen) is created again: we lead, and the leadership deadline
    /// bounds the whole. Any other error leaves what was seen as it was: a write that timed
    /// out may have landed, and the next one, conditional on the version before it, then
    /// conflicts and reads first instead of writing blind.
    async fn write(&mut self, cm: &ConfigMap) -> Result<(), PublishError> {
        let name = cm.metadata.name.clone().unwrap_or_default();
        let mut retried = false;
        loop {
            let step = match self.seen.get(&name).cloned() {
                None => self.create(cm).await,
                Some(seen) => self.replace(cm, &seen).await,
            };
            let Err(e) = step else { return Ok(()) };
            if retried {
                return Err(if is_conflict(&e) { PublishError::Conflict(name) } else { e });
            }
            retried = true;
            if is_conflict(&e) {
                tracing::info!(configmap = %name, "the snapshot ConfigMap was written by someone else; reading it and writing ours");
                self.read(&name).await?;
            } else if is_gone(&e) {
                self.seen.remove(&name);
            } else {
                return Err(e);
            }
        }
    }

    /// Creates `parts` of `encoded`, [`PARTS_AT_ONCE`] at a time: they are distinct objects,
    /// each written in a round trip of its own, and one after the other they were most of a
    /// publication's time at the scale profile (docs/benchmarks.md). Each creation sees and
    /// records only its own name. Each part is tried (none is sent once leadership is gone:
    /// [`Writer::may_write`]), and the first error is returned at the end, with what each
    /// creation saw recorded. Dropped at the publication's deadline, the names they held are
    /// forgotten; a failed publication lists and reads the parts again anyway.
    async fn create_parts(&mut self, encoded: &Encoded, parts: &[&Part]) -> Result<(), PublishError> {
        let mut own = self.lend(parts.iter().map(|p| p.name.as_str()));
        let (api, leadership, until) = (self.api, self.leadership, self.until);
        // Futures made in a loop, not by a closure: a closure over these borrows makes the
        // publication's boxed future not `Send` ("FnOnce is not general enough").
        let mut creations = Vec::with_capacity(parts.len());
        for (part, seen) in parts.iter().zip(own.iter_mut()) {
            creations.push(async move {
                Writer { api, leadership, until, seen }.create_part(&encoded.part_configmap(part)).await
            });
        }
        let results = at_once(creations).await;
        self.take_back(own);
        results.into_iter().collect()
    }

    /// Deletes the stale parts `names` ([`Writer::delete`]), [`PARTS_AT_ONCE`] at a time,
    /// as [`Writer::create_parts`] creates: one after the other, a change's few deletions
    /// held the publisher, and the next publication behind it, for a round trip each.
    async fn delete_parts(&mut self, names: &[String]) -> Result<(), PublishError> {
        let mut own = self.lend(names.iter().map(String::as_str));
        let (api, leadership, until) = (self.api, self.leadership, self.until);
        let mut deletions = Vec::with_capacity(names.len());
        for (name, seen) in names.iter().zip(own.iter_mut()) {
            deletions.push(async move { Writer { api, leadership, until, seen }.delete(name).await.map(|_| ()) });
        }
        let results = at_once(deletions).await;
        self.take_back(own);
        results.into_iter().collect()
    }

    /// What was seen of each of `names`, each in a map of its own, for requests sent at once
    /// that each see and record only their own name.
    fn lend<'n>(&mut self, names: impl Iterator<Item = &'n str>) -> Vec<BTreeMap<String, Seen>> {
        names.map(|name| self.seen.remove_entry(name).into_iter().collect()).collect()
    }

    /// Records what the requests [`Writer::lend`] served saw.
    fn take_back(&mut self, own: Vec<BTreeMap<String, Seen>>) {
        for seen in own {
            self.seen.extend(seen);
        }
    }

    /// Creates part `cm` whole (parts are immutable). One that exists already is used as it is
    /// when it holds these bytes under our labels (a part's name is its content's hash: an
    /// earlier publication or leader wrote it). Anything else of that name is read first,
    /// then replaced (deleted as read, created again) once: we lead, and the name is ours.
    async fn create_part(&mut self, cm: &ConfigMap) -> Result<(), PublishError> {
        let name = cm.metadata.name.clone().unwrap_or_default();
        let params = PostParams { field_manager: Some(FIELD_MANAGER.to_owned()), ..PostParams::default() };
        for attempt in 0..2 {
            self.may_write()?;
            match protobuf::create(self.api, &params, cm).await {
                Ok(created) => {
                    self.saw(&name, Some(&created));
                    return Ok(());
                }
                Err(e) if status_code(&e) == Some(409) && attempt == 0 => match self.read(&name).await? {
                    Some(live) if same_part(&live, cm) => return Ok(()),
                    Some(_) => {
                        tracing::info!(configmap = %name, "a snapshot part's name holds something else; replacing it");
                        self.delete(&name).await?;
                    }
                    None => {}
                },
                Err(e) if status_code(&e) == Some(409) => return Err(PublishError::Conflict(name)),
                Err(e) => return Err(PublishError::Kube { what: format!("create ConfigMap {name}"), source: e }),
            }
        }
        Err(PublishError::Conflict(name))
    }

    /// Creates `cm` whole; a 409 if its name exists.
    async fn create(&mut self, cm: &ConfigMap) -> Result<(), PublishError> {
        self.may_write()?;
        let name = cm.metadata.name.clone().unwrap_or_default();
        let params = PostParams { field_manager: Some(FIELD_MANAGER.to_owned()), ..PostParams::default() };
        let created = protobuf::create(self.api, &params, cm)
            .await
            .map_err(PublishError::kube(format!("create ConfigMap {name}")))?;
        self.saw(&name, Some(&created));
        Ok(())
    }

    /// Replaces the object seen as `seen` with `cm` ([`over_seen`]), conditional on that
    /// version: a 409 if it is no longer that version, a 404 if it is gone.
    async fn replace(&mut self, cm: &ConfigMap, seen: &Seen) -> Result<(), PublishError> {
        self.may_write()?;
        let name = cm.metadata.name.clone().unwrap_or_default();
        let cm = over_seen(&seen.meta, cm);
        let params = PostParams { field_manager: Some(FIELD_MANAGER.to_owned()), ..PostParams::default() };
        let written = protobuf::replace(self.api, &name, &params, &cm)
            .await
            .map_err(PublishError::kube(format!("replace ConfigMap {name}")))?;
        self.saw(&name, Some(&written));
        Ok(())
    }

    /// Deletes `name` only while it is still the object last seen, at that version: a 409
    /// otherwise (someone wrote it since; it is theirs now). Returns whether it was deleted
    /// by us; a name not seen is not deleted.
    async fn delete(&mut self, name: &str) -> Result<bool, PublishError> {
        let Some(seen) = self.seen.get(name).cloned() else { return Ok(false) };
        self.may_write()?;
        let preconditions =
            Preconditions { resource_version: seen.meta.resource_version.clone(), uid: seen.meta.uid.clone() };
        let params = DeleteParams { preconditions: Some(preconditions), ..DeleteParams::default() };
        match self.api.delete(name, &params).await {
            Ok(_) => {
                self.seen.remove(name);
                Ok(true)
            }
            Err(e) if status_code(&e) == Some(404) => {
                self.seen.remove(name);
                Ok(false)
            }
            Err(e) => Err(PublishError::Kube { what: format!("delete part ConfigMap {name}"), source: e }),
        }
    }
}

/// Runs `requests`, [`PARTS_AT_ONCE`] at a time; their results, in the order they ended.
/// Each is run to its end (none is sent once leadership is gone: [`Writer::may_write`]),
/// and the caller returns the first error.
async fn at_once<F: Future<Output = Result<(), PublishError>>>(requests: Vec<F>) -> Vec<Result<(), PublishError>> {
    use futures::StreamExt as _;
    futures::stream::iter(requests).buffer_unordered(PARTS_AT_ONCE).collect().await
}

/// Our parts in the cluster, and those the index there names now. Read once per process or
/// leadership term (and after a failed write); known from our own writes after that.
async fn live_parts(writer: &mut Writer<'_>, target: &NamespacedName) -> Result<Parts, PublishError> {
    let main = writer.read(&target.name).await?;
    let index = main.as_ref().and_then(|m| index_of(m).ok().flatten());
    let named = index.iter().flat_map(|i| &i.parts).map(|p| p.name.clone()).collect();
    let mut existing = BTreeSet::new();
    for part in list_parts(writer.api, target).await? {
        let Some(name) = part.metadata.name.clone() else { continue };
        if let Some(seen) = Seen::of(&part.metadata) {
            writer.seen.insert(name.clone(), seen);
        }
        existing.insert(name);
    }
    Ok(Parts { existing, verified: BTreeSet::new(), named })
}

/// The ConfigMap publisher's name in metrics, logs and Events.
pub(crate) const NAME: &str = "configmap";

impl Publisher for ConfigMapPublisher {
    fn name(&self) -> &'static str {
        NAME
    }

    fn forget(&self) {
        let mut st = self.state.lock().expect("configmap state lock");
        st.epoch += 1;
        st.written = None;
        st.parts = None;
        st.versions.clear();
    }

    fn publish(&self, snapshot: Arc<Snapshot>) -> BoxFuture<'static, Result<(), PublishError>> {
        let (epoch, mut versions, known) = {
            let st = self.state.lock().expect("configmap state lock");
            if st.written.as_ref().is_some_and(|(hash, _)| *hash == snapshot.hash) {
                return futures::future::ready(Ok(())).boxed();
            }
            (st.epoch, st.versions.clone(), st.parts.clone())
        };
        let (api, target, budget, leadership, state) =
            (self.api.clone(), self.target.clone(), self.budget, self.leadership.clone(), self.state.clone());
        async move {
            let until = leadership.until().ok_or(PublishError::NotLeading("the snapshot ConfigMap"))?;
            let written = tokio::time::timeout_at(until, async {
                let mut writer = Writer { api: &api, leadership: &leadership, until, seen: &mut versions };
                let known = match known {
                    Some(known) => known,
                    None => live_parts(&mut writer, &target).await?,
                };
                let encoded = Arc::new(encode(&target, &snapshot, budget).map_err(PublishError::Encode)?);
                // The parts not known to be there as they should be, then the index naming
                // them.
                let Parts { mut existing, mut verified, named: previous } = known;
                let missing: Vec<&Part> = encoded.parts.iter().filter(|p| !verified.contains(&p.name)).collect();
                writer.create_parts(&encoded, &missing).await?;
                for part in &missing {
                    existing.insert(part.name.clone());
                    verified.insert(part.name.clone());
                }
                let created = missing.len();
                writer.write(&encoded.main).await?;
                // Switched. Our parts named by neither this index nor the one before it are
                // read by nobody now.
                let named: BTreeSet<String> = encoded.parts.iter().map(|p| p.name.clone()).collect();
                let stale: Vec<String> =
                    existing.iter().filter(|n| !named.contains(*n) && !previous.contains(*n)).cloned().collect();
                writer.delete_parts(&stale).await?;
                for name in &stale {
                    existing.remove(name);
                    verified.remove(name);
                }
                Ok::<_, PublishError>((encoded, Parts { existing, verified, named }, created, stale.len()))
            })
            .await
            .map_err(|_| PublishError::LeadershipLapsed("the snapshot ConfigMap"))
            .and_then(|r| r);
            let mut st = state.lock().expect("configmap state lock");
            if st.epoch == epoch {
                st.versions = versions;
                if written.is_err() {
                    // The index may or may not have switched: known again after a write.
                    st.written = None;
                    st.parts = None;
                }
            }
            let (encoded, parts, created, deleted) = written?;
            tracing::debug!(
                configmap = %target,
                id = snapshot.id,
                bytes = snapshot.len(),
                parts = encoded.parts.len(),
                parts_created = created,
                stale_parts_deleted = deleted,
                "snapshot ConfigMap written"
            );
            if st.epoch == epoch {
                st.written = Some((snapshot.hash.clone(), encoded));
                st.parts = Some(parts);
            }
            Ok(())
        }
        .boxed()
    }
}

#[cfg(test)]
pub(crate) mod tests {
    pub(crate) use super::format::tests::target;
    use super::format::tests::{encoded, snapshot, snapshot_with};
    use super::*;

    #[test]
    fn a_watch_of_configmaps_leaves_the_snapshot_out() {
        let cm = KubeKey::new("", "", "ConfigMap").in_namespace("ops");
        assert_eq!(without_snapshots(cm.clone()).label_selector.as_deref(), Some("!consulresolver.io/snapshot"));
        let selected = without_snapshots(cm.clone().with_labels("app=web"));
        assert_eq!(selected.label_selector.as_deref(), Some("app=web,!consulresolver.io/snapshot"));
        assert_eq!(without_snapshots(selected.clone()), selected, "once");
        let svc = KubeKey::new("", "", "Service");
        assert_eq!(without_snapshots(svc.clone()), svc, "other kinds unchanged");
        let e = encoded(&snapshot(8_000, 200), DATA_BUDGET);
        assert!(!e.parts.is_empty());
        for cm in e.part_configmaps().iter().chain([&e.main]) {
            assert_eq!(cm.metadata.labels.as_ref().unwrap()[LABEL_SNAPSHOT], "true", "parts carry it too");
        }
    }
    /// A 409 `Status`, with the API server's reason.
    fn conflict(reason: &str) -> (u16, serde_json::Value) {
        let status = serde_json::json!({"kind": "Status", "apiVersion": "v1", "status": "Failure",
            "reason": reason, "code": 409, "message": "the object has been modified"});
        (409, status)
    }

    /// ConfigMaps held by a loopback API server that answers as a real one does: each write
    /// gets a new resourceVersion (and a created object a uid); a create of an existing name,
    /// a replacement naming another resourceVersion than the stored one, and a delete whose
    /// preconditions do not match are 409s; a replacement of a missing object is a 404.
    #[derive(Default)]
    pub(crate) struct Stored {
        objects: BTreeMap<String, serde_json::Value>,
        version: u64,
        /// DELETEs answer 500.
        fail_deletes: bool,
        /// Creates and replacements answer 403, as RBAC refusing them.
        pub(crate) refuse_writes: bool,
        /// Writes sent with no condition: replacements without a resourceVersion, deletes
        /// without preconditions. A writer that sends one may overwrite what it never saw.
        blind: Vec<String>,
        /// The names created, in order.
        created: Vec<String>,
        /// A replacement of this name is carried out, and answered 500: as a timeout leaves
        /// it, written without the writer knowing.
        lost_answer: Option<String>,
        /// Right after a GET of this name, another writer changes it (once).
        written_after_read: Option<String>,
        /// Right after a GET finds this name missing, another writer creates it (once).
        created_after_read: Option<String>,
        /// When this name is written, leadership is taken away (the sender is told `None`).
        lose_leadership_at: Option<(String, tokio::sync::watch::Sender<Option<Instant>>)>,
    }

    impl Stored {
        /// Stores `cm` as written now, with a new resourceVersion (and a uid when new).
        fn put(&mut self, name: &str, mut cm: serde_json::Value) -> serde_json::Value {
            self.version += 1;
            let uid = self.objects.get(name).map(|o| o["metadata"]["uid"].clone());
            cm["metadata"]["name"] = serde_json::json!(name);
            cm["metadata"]["resourceVersion"] = serde_json::json!(self.version.to_string());
            cm["metadata"]["uid"] = uid.unwrap_or_else(|| serde_json::json!(format!("uid-{}", self.version)));
            self.objects.insert(name.to_owned(), cm.clone());
            cm
        }

        /// Another writer's ConfigMap `name`, labelled as a part of ours when `ours`.
        fn someone_elses(&mut self, name: &str, ours: bool, id: u64) {
            let labels = if ours { serde_json::json!({LABEL_PART_OF: "snap"}) } else { serde_json::json!({}) };
            let cm = serde_json::json!({"apiVersion": "v1", "kind": "ConfigMap",
                "metadata": {"namespace": "ops", "labels": labels, "annotations": {ANNOTATION_ID: id.to_string()}},
                "binaryData": {KEY_PART: "b3RoZXI="}});
            self.put(name, cm);
        }

        fn version_of(&self, name: &str) -> Option<serde_json::Value> {
            self.objects.get(name).map(|o| o["metadata"]["resourceVersion"].clone())
        }

        fn create(&mut self, body: &[u8]) -> (u16, serde_json::Value) {
            let cm: serde_json::Value = serde_json::from_slice(body).unwrap();
            let name = cm["metadata"]["name"].as_str().unwrap().to_owned();
            if self.objects.contains_key(&name) {
                return conflict("AlreadyExists");
            }
            self.wrote(&name);
            self.created.push(name.clone());
            (201, self.put(&name, cm))
        }

        /// A list of the ConfigMaps labelled as parts of `snap`, as metadata only (what
        /// `list_metadata` asks for).
        fn list(&self) -> (u16, serde_json::Value) {
            let items: Vec<serde_json::Value> = self
                .objects
                .values()
                .filter(|o| o["metadata"]["labels"][LABEL_PART_OF] == "snap")
                .map(|o| {
                    serde_json::json!({"apiVersion": "meta.k8s.io/v1", "kind": "PartialObjectMetadata",
                    "metadata": o["metadata"]})
                })
                .collect();
            let list = serde_json::json!({"apiVersion": "meta.k8s.io/v1", "kind": "PartialObjectMetadataList",
                "metadata": {"resourceVersion": self.version.to_string()}, "items": items});
            (200, list)
        }

        fn replace(&mut self, name: &str, body: &[u8]) -> (u16, serde_json::Value) {
            let cm: serde_json::Value = serde_json::from_slice(body).unwrap();
            let Some(current) = self.version_of(name) else { return crate::test_fixtures::not_found(name) };
            match cm["metadata"].get("resourceVersion") {
                None => self.blind.push(format!("PUT {name}")),
                Some(sent) if *sent != current => return conflict("Conflict"),
                Some(_) => {}
            }
            if self.objects.get(name).is_some_and(|o| o["immutable"] == true) {
                return (
                    422,
                    serde_json::json!({"kind": "Status", "apiVersion": "v1", "status": "Failure",
                    "reason": "Invalid", "code": 422, "message": "field is immutable when `immutable` is set"}),
                );
            }
            self.wrote(name);
            let written = self.put(name, cm);
            if self.lost_answer.as_deref() == Some(name) {
                return (
                    500,
                    serde_json::json!({"kind": "Status", "apiVersion": "v1", "status": "Failure",
                    "reason": "InternalError", "code": 500, "message": "the answer was lost"}),
                );
            }
            (200, written)
        }

        fn delete(&mut self, name: &str, body: &[u8]) -> (u16, serde_json::Value) {
            let options: serde_json::Value = serde_json::from_slice(body).unwrap_or_default();
            let pre = &options["preconditions"];
            if pre.get("resourceVersion").is_none() && pre.get("uid").is_none() {
                self.blind.push(format!("DELETE {name}"));
            }
            if self.fail_deletes {
                return (
                    500,
                    serde_json::json!({"kind": "Status", "apiVersion": "v1", "status": "Failure",
                    "reason": "InternalError", "code": 500, "message": "etcd is away"}),
                );
            }
            let Some(current) = self.objects.get(name) else { return crate::test_fixtures::not_found(name) };
            for key in ["resourceVersion", "uid"] {
                if pre.get(key).is_some_and(|v| *v != current["metadata"][key]) {
                    return conflict("Conflict");
                }
            }
            (200, self.objects.remove(name).unwrap())
        }

        fn get(&mut self, name: &str) -> (u16, serde_json::Value) {
            if name == "configmaps" {
                return self.list();
            }
            if self.created_after_read.as_deref() == Some(name) && !self.objects.contains_key(name) {
                self.created_after_read = None;
                let theirs = serde_json::json!({"apiVersion": "v1", "kind": "ConfigMap",
                    "metadata": {"namespace": "ops", "labels": {"team": "payments"}}, "data": {"theirs": "x"}});
                self.put(name, theirs);
                return crate::test_fixtures::not_found(name);
            }
            let Some(cm) = self.objects.get(name).cloned() else { return crate::test_fixtures::not_found(name) };
            if self.written_after_read.as_deref() == Some(name) {
                self.written_after_read = None;
                let mut edited = cm.clone();
                edited["metadata"]["annotations"]["edited-by"] = serde_json::json!("someone else");
                self.put(name, edited);
            }
            (200, cm)
        }

        /// A create or a replacement of `name` is being carried out.
        fn wrote(&mut self, name: &str) {
            if self.lose_leadership_at.as_ref().is_some_and(|(at, _)| at == name) {
                self.lose_leadership_at.take().unwrap().1.send_replace(None);
            }
        }
    }

    pub(crate) async fn stored_api(stored: Arc<Mutex<Stored>>) -> crate::test_fixtures::FakeApi {
        crate::test_fixtures::serve(Arc::new(move |method: &str, path: &str, body: &[u8]| {
            answer(&stored, method, path, body)
        }))
        .await
    }

    /// What the API server holding `stored` answers.
    fn answer(stored: &Mutex<Stored>, method: &str, path: &str, body: &[u8]) -> (u16, serde_json::Value) {
        let name = path.rsplit('/').next().unwrap_or_default().to_owned();
        let mut st = stored.lock().unwrap();
        if st.refuse_writes && matches!(method, "POST" | "PUT") {
            let status = serde_json::json!({"kind": "Status", "apiVersion": "v1", "status": "Failure",
                "reason": "Forbidden", "code": 403, "message": "configmaps is forbidden"});
            return (403, status);
        }
        match method {
            "POST" => st.create(body),
            "PUT" => st.replace(&name, body),
            "DELETE" => st.delete(&name, body),
            "GET" => st.get(&name),
            _ => (405, serde_json::json!({})),
        }
    }

    /// A loopback API server holding `stored` that holds each request `gated` picks until
    /// `PARTS_AT_ONCE` of them are in flight (or two seconds pass), which one after the other
    /// never happens; and the most it saw in flight at once.
    async fn gated_api(
        stored: &Arc<Mutex<Stored>>,
        gated: fn(&str, &[u8]) -> bool,
    ) -> (crate::test_fixtures::FakeApi, Arc<(Mutex<(usize, usize)>, std::sync::Condvar)>) {
        // (in flight now, most in flight at once)
        let gate = Arc::new((Mutex::new((0usize, 0usize)), std::sync::Condvar::new()));
        let (stored, gate2) = (stored.clone(), gate.clone());
        let api = crate::test_fixtures::serve(Arc::new(move |method: &str, path: &str, body: &[u8]| {
            if gated(method, body) {
                let (lock, ready) = &*gate2;
                let deadline = std::time::Instant::now() + std::time::Duration::from_secs(2);
                let mut g = lock.lock().unwrap();
                g.0 += 1;
                g.1 = g.1.max(g.0);
                ready.notify_all();
                while g.1 < PARTS_AT_ONCE {
                    let Some(left) = deadline.checked_duration_since(std::time::Instant::now()) else { break };
                    g = ready.wait_timeout(g, left).unwrap().0;
                }
                g.0 -= 1;
            }
            answer(&stored, method, path, body)
        }))
        .await;
        (api, gate)
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 8)]
    async fn parts_are_created_several_at_once() {
        let s = Arc::new(snapshot(200, 64));
        let names = part_names(&s);
        assert!(names.len() > PARTS_AT_ONCE, "the budget splits this snapshot into {} parts", names.len());
        let stored = Arc::new(Mutex::new(Stored::default()));
        let is_part = |method: &str, body: &[u8]| {
            method == "POST" && body.windows(LABEL_PART_OF.len()).any(|w| w == LABEL_PART_OF.as_bytes())
        };
        let (api, gate) = gated_api(&stored, is_part).await;
        let publisher = small_budget(&api, Leadership::always());
        publisher.publish(s.clone()).await.unwrap();
        assert_eq!(gate.0.lock().unwrap().1, PARTS_AT_ONCE, "parts in flight at once");
        assert_eq!(stored_parts(&stored), names.iter().cloned().collect::<BTreeSet<_>>(), "every part written");
        let created = stored.lock().unwrap().created.clone();
        assert_eq!(created.len(), names.len() + 1, "{created:?}");
        assert_eq!(created.last().map(String::as_str), Some("snap"), "parts first: {created:?}");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 8)]
    async fn stale_parts_are_deleted_several_at_once() {
        let stored = Arc::new(Mutex::new(Stored::default()));
        let stale: Vec<String> = (1..=PARTS_AT_ONCE + 2).map(|i| format!("snap-{i}")).collect();
        for name in &stale {
            stored.lock().unwrap().someone_elses(name, true, 1);
        }
        let (api, gate) = gated_api(&stored, |method, _| method == "DELETE").await;
        let publisher = small_budget(&api, Leadership::always());
        let s = Arc::new(snapshot(40, 64));
        publisher.publish(s.clone()).await.unwrap();
        assert_eq!(gate.0.lock().unwrap().1, PARTS_AT_ONCE, "deletions in flight at once");
        assert_eq!(stored_parts(&stored), part_names(&s).into_iter().collect::<BTreeSet<_>>(), "every stale part gone");
        let requests = api.take();
        let index = requests.iter().rposition(|r| r == "POST configmaps").expect("the index is created");
        assert_eq!(stored.lock().unwrap().created.last().map(String::as_str), Some("snap"), "the index last");
        assert!(requests[..index].iter().all(|r| !r.starts_with("DELETE")), "nothing deleted before the switch");
    }

    /// A loopback API server holding `stored`, and a publisher (always leading) writing to it
    /// with a budget of 1000 bytes.
    async fn publisher_of(stored: &Arc<Mutex<Stored>>) -> (crate::test_fixtures::FakeApi, ConfigMapPublisher) {
        let api = stored_api(stored.clone()).await;
        let publisher = small_budget(&api, Leadership::always());
        (api, publisher)
    }

    /// A loopback API server holding `stored`, and a publisher (always leading) writing to it
    /// with the product's data budget.
    async fn whole_budget_publisher_of(
        stored: &Arc<Mutex<Stored>>,
    ) -> (crate::test_fixtures::FakeApi, ConfigMapPublisher) {
        let api = stored_api(stored.clone()).await;
        let publisher = ConfigMapPublisher::new(api.client.clone(), target(), Leadership::always());
        (api, publisher)
    }

    fn small_budget(api: &crate::test_fixtures::FakeApi, leadership: Leadership) -> ConfigMapPublisher {
        ConfigMapPublisher::with_budget(api.client.clone(), target(), leadership, 1000)
    }

    /// The part names of `s` split with a budget of 1000 bytes.
    fn part_names(s: &Snapshot) -> Vec<String> {
        encoded(s, 1000).parts.into_iter().map(|p| p.name).collect()
    }

    /// The part ConfigMaps `stored` holds.
    fn stored_parts(stored: &Arc<Mutex<Stored>>) -> BTreeSet<String> {
        let st = stored.lock().unwrap();
        st.objects.keys().filter(|k| k.as_str() != "snap").cloned().collect()
    }

    #[tokio::test]
    async fn parts_are_created_before_the_index_then_stale_parts_go_and_equal_content_is_skipped() {
        let s = Arc::new(snapshot(40, 64));
        let names = part_names(&s);
        assert!(names.len() >= 2, "the budget below splits this snapshot ({} parts)", names.len());
        // Stale parts of ours: of an earlier version (slotted and unslotted names) and of a
        // writer stopped before its index; and someone else's, not labelled as ours.
        let stored = Arc::new(Mutex::new(Stored::default()));
        {
            let mut st = stored.lock().unwrap();
            for stale in ["snap-0123456789abcdef", "snap-1", "snap-a-1"] {
                st.someone_elses(stale, true, 1);
            }
            st.someone_elses("snap-fedcba9876543210", false, 1);
        }
        let (api, publisher) = publisher_of(&stored).await;

        publisher.publish(s.clone()).await.unwrap();
        // The index is read (none yet) and our parts listed; the parts created whole, then
        // the index, then the stale parts deleted.
        let mut expected = vec!["GET snap".to_owned(), "GET configmaps".to_owned()];
        expected.extend(names.iter().map(|_| "POST configmaps".to_owned()));
        expected.push("POST configmaps".into());
        let mut requests = api.take();
        // The deletions, sent at once, end in any order.
        requests[expected.len()..].sort();
        expected.extend(["DELETE snap-0123456789abcdef", "DELETE snap-1", "DELETE snap-a-1"].map(String::from));
        assert_eq!(requests, expected);
        let mut left: BTreeSet<String> = names.iter().cloned().collect();
        left.insert("snap-fedcba9876543210".into());
        assert_eq!(stored_parts(&stored), left, "ours written, someone else's kept");
        assert_eq!(stored.lock().unwrap().created.last().map(String::as_str), Some("snap"), "the index last");
        assert!(stored.lock().unwrap().blind.is_empty(), "{:?}", stored.lock().unwrap().blind);

        let same_content = Arc::new(s.content.clone().into_snapshot(s.id + 1));
        publisher.publish(same_content).await.unwrap();
        assert!(api.take().is_empty(), "equal hash: nothing written");
    }

    #[tokio::test]
    async fn a_configmap_that_is_not_ours_is_never_deleted() {
        let stored = Arc::new(Mutex::new(Stored::default()));
        {
            let mut st = stored.lock().unwrap();
            st.someone_elses("snap-1", false, 1);
            // Labelled as a part of snap, but not named as ours are.
            st.someone_elses("other-1", true, 1);
        }
        let (api, publisher) = publisher_of(&stored).await;
        publisher.publish(Arc::new(snapshot(2, 8))).await.unwrap();
        assert_eq!(api.take(), ["GET snap", "GET configmaps", "POST configmaps"]);
        assert_eq!(stored_parts(&stored), BTreeSet::from(["other-1".to_owned(), "snap-1".to_owned()]));
    }

    #[test]
    fn a_tiny_budget_splits_into_many_parts_found_by_name() {
        let s = snapshot(50, 64);
        let json = s.to_json();
        let e = encoded(&s, 1000);
        assert!(e.parts.len() > 2);
        let mut parts = e.part_configmaps();
        assert_eq!(decode(&e.main, &parts).unwrap(), json);
        parts.reverse();
        assert_eq!(decode(&e.main, &parts).unwrap(), json, "parts are found by name, not position");
    }

    /// A part name that exists already is used as it is when it holds our bytes under our
    /// labels (as a previous leader leaves it). Anything else of that name is read, then
    /// replaced conditional on that read: never written over blind. Written over by yet
    /// someone else in between, it is left to them and the index is not switched.
    #[tokio::test]
    async fn an_existing_part_is_used_when_it_holds_our_bytes_and_replaced_as_read_otherwise() {
        let stored = Arc::new(Mutex::new(Stored::default()));
        let (api, publisher) = publisher_of(&stored).await;
        let (s1, s2) = (snapshot(40, 64), snapshot(41, 64));
        publisher.publish(Arc::new(s1.clone())).await.unwrap();
        let index1 = stored.lock().unwrap().objects["snap"].clone();
        let new = part_names(&s2).into_iter().find(|n| !part_names(&s1).contains(n)).unwrap();
        {
            let mut st = stored.lock().unwrap();
            st.someone_elses(&new, true, 99);
            st.written_after_read = Some(new.clone());
        }
        api.take();
        let err = publisher.publish(Arc::new(s2.clone())).await.unwrap_err();
        assert_eq!(err.reason(), "conflict", "{err}");
        let calls = api.take();
        // Refused, read, deleted as read (other parts' creations run beside it).
        let at = calls.iter().position(|c| *c == format!("GET {new}")).unwrap();
        assert!(calls[..at].contains(&"POST configmaps".to_owned()), "{calls:?}");
        assert!(calls[at..].contains(&format!("DELETE {new}")), "{calls:?}");
        assert!(calls.iter().all(|c| c != "PUT snap"), "the index is not switched: {calls:?}");
        assert_eq!(read_with(&stored.lock().unwrap(), &index1).unwrap(), s1.to_json());
        assert!(stored.lock().unwrap().objects[&new]["metadata"]["annotations"]["edited-by"] == "someone else");

        // Someone else's, read and not written since: replaced.
        let e = encoded(&s2, 1000);
        publisher.publish(Arc::new(s2.clone())).await.unwrap();
        {
            let st = stored.lock().unwrap();
            let ours = e.part_configmap(e.parts.iter().find(|p| p.name == new).unwrap());
            let live: ConfigMap = serde_json::from_value(st.objects[&new].clone()).unwrap();
            assert!(same_part(&live, &ours), "replaced by our part");
            assert_eq!(read_with(&st, &st.objects["snap"]).unwrap(), s2.to_json());
        }

        // A part the next snapshot needs, left by another leader: our bytes, our labels.
        // Used as it is.
        let s3 = snapshot(42, 64);
        let e3 = encoded(&s3, 1000);
        let left = e3.parts.iter().find(|p| !part_names(&s2).contains(&p.name)).unwrap();
        stored.lock().unwrap().put(&left.name, serde_json::to_value(e3.part_configmap(left)).unwrap());
        api.take();
        publisher.publish(Arc::new(s3.clone())).await.unwrap();
        let calls = api.take();
        assert!(calls.contains(&format!("GET {}", left.name)), "refused, then read: {calls:?}");
        assert!(!calls.contains(&format!("DELETE {}", left.name)), "used as it is: {calls:?}");
        let st = stored.lock().unwrap();
        assert!(st.blind.is_empty(), "written without a condition: {:?}", st.blind);
        assert_eq!(read_with(&st, &st.objects["snap"]).unwrap(), s3.to_json());
    }

    /// A write whose answer is lost (a timeout) may have landed: the next publication reads
    /// the index again, so its write stays conditional on what is there, never blind.
    #[tokio::test]
    async fn after_a_lost_answer_the_next_write_is_still_conditional() {
        let stored = Arc::new(Mutex::new(Stored::default()));
        let (api, publisher) = publisher_of(&stored).await;
        publisher.publish(Arc::new(snapshot(40, 64))).await.unwrap();
        stored.lock().unwrap().lost_answer = Some("snap".into());
        let err = publisher.publish(Arc::new(snapshot(41, 64))).await.unwrap_err();
        assert_eq!(err.reason(), "server_error", "{err}");
        // Someone else writes it meanwhile.
        {
            let mut st = stored.lock().unwrap();
            st.lost_answer = None;
            let mut cm = st.objects["snap"].clone();
            cm["metadata"]["annotations"]["edited-by"] = serde_json::json!("someone else");
            st.put("snap", cm);
        }
        api.take();
        let s3 = snapshot(42, 64);
        publisher.publish(Arc::new(s3.clone())).await.unwrap();
        let calls = api.take();
        assert_eq!(calls[..2], ["GET snap", "GET configmaps"], "read again first: {calls:?}");
        let st = stored.lock().unwrap();
        assert!(st.blind.is_empty(), "written without a condition: {:?}", st.blind);
        assert_eq!(read_with(&st, &st.objects["snap"]).unwrap(), s3.to_json());
    }

    /// A stale part is deleted only as it was last seen: one written by someone else since
    /// is left to them, and the publication fails.
    #[tokio::test]
    async fn a_stale_part_written_since_it_was_seen_is_not_deleted() {
        let stored = Arc::new(Mutex::new(Stored::default()));
        let (api, publisher) = publisher_of(&stored).await;
        let (s1, s2, s3) = (snapshot(40, 64), snapshot(41, 64), snapshot(42, 64));
        publisher.publish(Arc::new(s1.clone())).await.unwrap();
        publisher.publish(Arc::new(s2.clone())).await.unwrap();
        // The third makes s1's parts stale: one of them is written by someone else first.
        let (p1, p2, p3) = (part_names(&s1), part_names(&s2), part_names(&s3));
        let stale = p1.iter().find(|n| !p2.contains(n) && !p3.contains(n)).unwrap().clone();
        {
            let mut st = stored.lock().unwrap();
            let mut cm = st.objects[&stale].clone();
            cm["metadata"]["annotations"]["edited-by"] = serde_json::json!("someone else");
            st.put(&stale, cm);
        }
        api.take();
        let err = publisher.publish(Arc::new(s3)).await.unwrap_err();
        assert_eq!(err.reason(), "conflict", "{err}");
        let st = stored.lock().unwrap();
        assert!(st.objects.contains_key(&stale), "deleted after someone else wrote it");
        assert!(st.blind.is_empty(), "written without a condition: {:?}", st.blind);
    }

    /// Once leadership is gone no write is sent, even between two writes of one
    /// publication whose deadline has not passed.
    #[tokio::test]
    async fn no_write_is_sent_once_leadership_is_gone() {
        let stored = Arc::new(Mutex::new(Stored::default()));
        let api = stored_api(stored.clone()).await;
        let (lead, leadership) = Leadership::manual();
        lead.send_replace(Some(Instant::now() + std::time::Duration::from_secs(3600)));
        let s = snapshot(200, 64);
        assert!(part_names(&s).len() > PARTS_AT_ONCE);
        stored.lock().unwrap().lose_leadership_at = Some((part_names(&s)[0].clone(), lead));
        let publisher = small_budget(&api, leadership);
        let err = publisher.publish(Arc::new(s)).await.unwrap_err();
        assert_eq!(err.reason(), "leadership_lapsed", "{err}");
        // The creations already on their way when the first answer said so, and nothing
        // after: no further part, no index.
        let calls = api.take();
        let posts = calls.len() - 2;
        assert_eq!(calls[..2], ["GET snap", "GET configmaps"]);
        assert!((1..=PARTS_AT_ONCE).contains(&posts), "{calls:?}");
        assert!(calls[2..].iter().all(|c| c == "POST configmaps"), "nothing written after: {calls:?}");
    }

    /// A new leader numbers its snapshots above every id in the ConfigMaps: the index's,
    /// and those of parts a previous leader wrote before it stopped, that no index names.
    #[tokio::test]
    async fn the_published_id_counts_parts_no_index_names_yet() {
        let stored = Arc::new(Mutex::new(Stored::default()));
        let (_api, publisher) = publisher_of(&stored).await;
        assert_eq!(publisher.published_id().await.unwrap(), None);
        publisher.publish(Arc::new(snapshot(40, 64))).await.unwrap();
        assert_eq!(publisher.published_id().await.unwrap(), Some(42));
        {
            let mut st = stored.lock().unwrap();
            st.someone_elses("snap-0123456789abcdef", true, 57);
            // Not ours: not labelled, or not named as ours are.
            st.someone_elses("snap-fedcba9876543210", false, 90);
            st.someone_elses("other-0123456789abcdef", true, 90);
        }
        assert_eq!(publisher.published_id().await.unwrap(), Some(57));
    }

    #[tokio::test]
    async fn a_deleted_or_edited_configmap_is_written_again_by_repair() {
        let stored = Arc::new(Mutex::new(Stored::default()));
        let (api, publisher) = whole_budget_publisher_of(&stored).await;
        publisher.publish(Arc::new(snapshot(2, 8))).await.unwrap();
        api.take();
        assert!(publisher.repair().await.unwrap().is_empty(), "intact: nothing to repair");
        assert_eq!(api.take(), ["GET snap"], "one read, no write");

        stored.lock().unwrap().objects.remove("snap");
        assert_eq!(publisher.repair().await.unwrap(), ["snap"]);
        assert_eq!(api.take(), ["GET snap", "POST configmaps"], "gone: created again");

        let edited = {
            let mut st = stored.lock().unwrap();
            let cm = st.objects.get_mut("snap").unwrap();
            cm["data"][KEY_JSON] = serde_json::json!("{}");
            cm["metadata"]["resourceVersion"] = serde_json::json!("edited");
            cm.clone()
        };
        assert_eq!(publisher.repair().await.unwrap(), ["snap"], "an edit is repaired too");
        let back = stored.lock().unwrap().objects["snap"].clone();
        assert_ne!(back["data"], edited["data"]);
        assert_eq!(back["data"][KEY_JSON].as_str().unwrap().as_bytes(), snapshot(2, 8).to_json());
    }

    #[tokio::test]
    async fn a_deleted_or_replaced_part_is_created_again_by_repair() {
        let stored = Arc::new(Mutex::new(Stored::default()));
        let (api, publisher) = publisher_of(&stored).await;
        let s = snapshot(40, 64);
        publisher.publish(Arc::new(s.clone())).await.unwrap();
        let names = part_names(&s);
        {
            let mut st = stored.lock().unwrap();
            st.objects.remove(&names[0]);
            st.objects.remove(&names[1]);
            st.someone_elses(&names[1], true, 7);
        }
        api.take();
        assert_eq!(publisher.repair().await.unwrap(), names[..2]);
        let calls = api.take();
        let expected = [format!("GET {}", names[0]), "POST configmaps".into(), format!("GET {}", names[1])];
        assert_eq!(calls[..3], expected, "{calls:?}");
        assert!(calls.contains(&format!("DELETE {}", names[1])), "replaced: deleted, then created: {calls:?}");
        let st = stored.lock().unwrap();
        assert_eq!(read_with(&st, &st.objects["snap"]).unwrap(), s.to_json());
        assert!(st.blind.is_empty(), "{:?}", st.blind);
    }

    #[tokio::test]
    async fn writes_are_conditional_and_a_conflict_is_read_and_written_over() {
        let stored = Arc::new(Mutex::new(Stored::default()));
        let (api, publisher) = whole_budget_publisher_of(&stored).await;
        publisher.publish(Arc::new(snapshot(2, 8))).await.unwrap();
        // Someone else writes it in between.
        stored.lock().unwrap().objects.get_mut("snap").unwrap()["metadata"]["resourceVersion"] =
            serde_json::json!("other");
        api.take();
        publisher.publish(Arc::new(snapshot(3, 8))).await.unwrap();
        assert_eq!(api.take(), ["PUT snap", "GET snap", "PUT snap"], "not split before or now: no parts");
        let back = stored.lock().unwrap().objects["snap"].clone();
        assert_eq!(back["data"][KEY_JSON].as_str().unwrap().as_bytes(), snapshot(3, 8).to_json());
        let bodies = api.bodies.lock().unwrap().clone();
        assert_eq!(bodies, ["application/vnd.kubernetes.protobuf"; 3], "the create and both replacements");
    }

    /// `NAME` is replaced whole but for what others set in its metadata: their labels,
    /// annotations and owner references stay; a data key of theirs, and a key of ours the
    /// new encoding does not use, go.
    #[tokio::test]
    async fn a_replacement_keeps_what_others_set_in_the_metadata_and_nothing_else() {
        let stored = Arc::new(Mutex::new(Stored::default()));
        let (api, publisher) = whole_budget_publisher_of(&stored).await;
        publisher.publish(Arc::new(snapshot(2, 8))).await.unwrap();
        {
            let mut st = stored.lock().unwrap();
            let mut cm = st.objects["snap"].clone();
            cm["metadata"]["labels"]["team"] = serde_json::json!("payments");
            cm["metadata"]["labels"].as_object_mut().unwrap().remove(LABEL_SNAPSHOT);
            cm["metadata"]["annotations"]["note"] = serde_json::json!("kept");
            cm["metadata"]["ownerReferences"] =
                serde_json::json!([{"apiVersion": "v1", "kind": "Namespace", "name": "ops", "uid": "u-1"}]);
            cm["data"]["extra"] = serde_json::json!("theirs");
            st.put("snap", cm);
        }
        api.take();
        // Large enough to be gzipped: `snapshot.json` is ours, and goes.
        let big = snapshot(20_000, 0);
        publisher.publish(Arc::new(big.clone())).await.unwrap();
        assert_eq!(api.take(), ["PUT snap", "GET snap", "PUT snap"], "refused, read, replaced");
        let st = stored.lock().unwrap();
        let live = &st.objects["snap"];
        assert_eq!(live["metadata"]["labels"]["team"], "payments");
        assert_eq!(live["metadata"]["labels"][LABEL_SNAPSHOT], "true", "ours set again");
        assert_eq!(live["metadata"]["annotations"]["note"], "kept");
        assert_eq!(live["metadata"]["annotations"][ANNOTATION_HASH], big.hash.as_str());
        assert_eq!(live["metadata"]["ownerReferences"][0]["uid"], "u-1");
        assert!(live.get("data").is_none_or(|d| d.is_null()), "their key and our old one gone: {}", live["data"]);
        assert_eq!(read_with(&st, live).unwrap(), big.to_json());
        assert!(st.blind.is_empty(), "{:?}", st.blind);
    }

    /// A `NAME` not seen is created, which fails when another writer holds the name: it is
    /// read then, and replaced conditional on that read, never written over unseen.
    #[tokio::test]
    async fn a_name_not_seen_is_created_so_another_writers_object_is_read_before_it_is_written() {
        let stored = Arc::new(Mutex::new(Stored::default()));
        let (api, publisher) = whole_budget_publisher_of(&stored).await;
        publisher.publish(Arc::new(snapshot(2, 8))).await.unwrap();
        // Gone when repair reads it, and created by someone else right after.
        {
            let mut st = stored.lock().unwrap();
            st.objects.remove("snap");
            st.created_after_read = Some("snap".into());
        }
        api.take();
        assert_eq!(publisher.repair().await.unwrap(), ["snap"]);
        assert_eq!(api.take(), ["GET snap", "POST configmaps", "GET snap", "PUT snap"]);
        let st = stored.lock().unwrap();
        let live = &st.objects["snap"];
        assert_eq!(read_with(&st, live).unwrap(), snapshot(2, 8).to_json());
        assert_eq!(live["metadata"]["labels"]["team"], "payments", "read, then replaced as read");
        assert!(live["data"].get("theirs").is_none(), "{}", live["data"]);
        assert!(st.blind.is_empty(), "{:?}", st.blind);
    }

    /// A `NAME` deleted since it was seen is created again, by the write that finds it gone.
    #[tokio::test]
    async fn a_configmap_deleted_since_it_was_seen_is_created_again() {
        let stored = Arc::new(Mutex::new(Stored::default()));
        let (api, publisher) = whole_budget_publisher_of(&stored).await;
        publisher.publish(Arc::new(snapshot(2, 8))).await.unwrap();
        stored.lock().unwrap().objects.remove("snap");
        api.take();
        publisher.publish(Arc::new(snapshot(3, 8))).await.unwrap();
        assert_eq!(api.take(), ["PUT snap", "POST configmaps"]);
        let st = stored.lock().unwrap();
        assert_eq!(read_with(&st, &st.objects["snap"]).unwrap(), snapshot(3, 8).to_json());
        assert!(st.blind.is_empty(), "{:?}", st.blind);
    }

    /// The objects `stored` holds, decoded as a reader would from `main` (an index read
    /// earlier, say).
    fn read_with(stored: &Stored, main: &serde_json::Value) -> Result<Vec<u8>, String> {
        let main: ConfigMap = serde_json::from_value(main.clone()).unwrap();
        let parts: Vec<ConfigMap> =
            stored.objects.values().map(|o| serde_json::from_value(o.clone()).unwrap()).collect();
        decode(&main, &parts)
    }

    /// A new index reuses the parts the cluster holds; a reader of the previous index still
    /// reads its snapshot whole, until the next publication after that.
    #[tokio::test]
    async fn a_new_index_reuses_unchanged_parts_and_the_previous_one_stays_readable() {
        let stored = Arc::new(Mutex::new(Stored::default()));
        let (api, publisher) = whole_budget_publisher_of(&stored).await;
        let s1 = snapshot(30_000, 32);
        let s2 = snapshot_with(30_000, 32, &[10_000]).content.into_snapshot(43);
        let s3 = snapshot_with(30_000, 32, &[10_000, 20_000]).content.into_snapshot(44);

        publisher.publish(Arc::new(s1.clone())).await.unwrap();
        let index1 = stored.lock().unwrap().objects["snap"].clone();
        let n = index_of(&serde_json::from_value(index1.clone()).unwrap()).unwrap().unwrap().parts.len();
        api.take();
        publisher.publish(Arc::new(s2.clone())).await.unwrap();
        let calls = api.take();
        let created = calls.iter().filter(|c| *c == "POST configmaps").count();
        assert_eq!(created, 3, "the header, the changed segment and the trailer, of {n}: {calls:?}");
        assert_eq!(calls.last().map(String::as_str), Some("PUT snap"), "nothing deleted yet: {calls:?}");
        // A reader holding the first index still reads the first snapshot, whole.
        assert_eq!(read_with(&stored.lock().unwrap(), &index1).unwrap(), s1.to_json());
        let index2 = stored.lock().unwrap().objects["snap"].clone();
        assert_eq!(read_with(&stored.lock().unwrap(), &index2).unwrap(), s2.to_json());

        // The third: the first's own parts go, the second's stay for its readers.
        publisher.publish(Arc::new(s3.clone())).await.unwrap();
        let calls = api.take();
        assert_eq!(calls.iter().filter(|c| c.starts_with("DELETE")).count(), 3, "{calls:?}");
        assert_eq!(read_with(&stored.lock().unwrap(), &index2).unwrap(), s2.to_json());
        assert!(read_with(&stored.lock().unwrap(), &index1).unwrap_err().contains("is missing"));

        // A new process (or leader) reads the index and lists the parts first. A part listed
        // is only a claim: each one it needs is read once (its create refused) and used as
        // it is, nothing written again.
        let next = ConfigMapPublisher::new(api.client.clone(), target(), Leadership::always());
        next.publish(Arc::new(s2.clone())).await.unwrap();
        let calls = api.take();
        assert_eq!(calls[..2], ["GET snap", "GET configmaps"]);
        assert_eq!(calls.iter().filter(|c| c.starts_with("GET snap-")).count(), n, "{calls:?}");
        assert!(calls.iter().all(|c| !c.starts_with("DELETE")), "{calls:?}");
        assert_eq!(calls.last().map(String::as_str), Some("PUT snap"));

        // Snapshots that fit in one ConfigMap: the parts go, the last index's one
        // publication later.
        next.publish(Arc::new(snapshot(2, 8))).await.unwrap();
        assert!(!stored_parts(&stored).is_empty(), "the previous index's parts are kept for its readers");
        next.publish(Arc::new(snapshot(3, 8))).await.unwrap();
        assert_eq!(stored_parts(&stored), BTreeSet::new(), "no part left once none is needed");
        assert!(stored.lock().unwrap().blind.is_empty(), "{:?}", stored.lock().unwrap().blind);
    }

    /// A write that fails after switching the index (here: deleting stale parts) leaves the
    /// cluster holding a snapshot this publisher did not record: the next one is written
    /// even when it equals the one written before, and the index is read again first.
    #[tokio::test]
    async fn after_a_failed_write_nothing_is_skipped_as_already_written() {
        let stored = Arc::new(Mutex::new(Stored::default()));
        let (api, publisher) = publisher_of(&stored).await;
        let (s1, s2, small) = (snapshot(40, 64), snapshot(41, 64), snapshot(2, 8));
        publisher.publish(Arc::new(s1)).await.unwrap();
        publisher.publish(Arc::new(s2.clone())).await.unwrap();
        stored.lock().unwrap().fail_deletes = true;
        publisher.publish(Arc::new(small.clone())).await.unwrap_err();
        let main = stored.lock().unwrap().objects["snap"].clone();
        assert_eq!(read_with(&stored.lock().unwrap(), &main).unwrap(), small.to_json(), "the index had switched");
        stored.lock().unwrap().fail_deletes = false;
        api.take();

        publisher.publish(Arc::new(s2.clone())).await.unwrap();
        assert_eq!(api.take()[0], "GET snap", "the index is read again");
        let main = stored.lock().unwrap().objects["snap"].clone();
        assert_eq!(read_with(&stored.lock().unwrap(), &main).unwrap(), s2.to_json(), "written, not skipped");
    }

    #[tokio::test(start_paused = true)]
    async fn nothing_is_written_without_leadership_and_writing_stops_at_its_deadline() {
        let stored = Arc::new(Mutex::new(Stored::default()));
        let api = stored_api(stored.clone()).await;
        let (lead, leadership) = Leadership::manual();
        let publisher = ConfigMapPublisher::new(api.client.clone(), target(), leadership);
        let err = publisher.publish(Arc::new(snapshot(2, 8))).await.unwrap_err();
        assert!(matches!(err, PublishError::NotLeading(_)), "{err}");
        assert_eq!(err.reason(), "not_leading");
        assert!(api.take().is_empty());
        // Leading until a deadline already passed: nothing is sent either.
        lead.send_replace(Some(tokio::time::Instant::now()));
        let err = publisher.publish(Arc::new(snapshot(2, 8))).await.unwrap_err();
        assert!(matches!(err, PublishError::NotLeading(_)), "a lapsed deadline is no leadership: {err}");
        assert!(publisher.repair().await.unwrap().is_empty());
        assert!(api.take().is_empty());
    }
}
