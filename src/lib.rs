//! consul-resolver-operator: keeps an ingress controller's view of its upstreams complete
//! and current. The pipeline, and where each stage lives, is in docs/architecture.md:
//!
//! ```text
//! sources -> registry -> world -> limiter -> assembler -> publishers
//! ```
//!
//! The pure stages are the `consul-resolver-core` crate (no I/O, time passed in). This crate
//! is the edges around it: `sources` watch Kubernetes and Consul, `publishers` write whole
//! snapshots, `controller` writes each resolver's status, `runtime` drives the core with
//! them. Its public API is small on purpose: the process entry point, and what tests and
//! readers of the snapshot need.

mod cli;
mod controller;
mod crdgen;
mod kube_client;
mod leadership;
mod measure;
mod ops;
mod process;
mod publishers;
mod runtime;
mod sources;
#[cfg(test)]
mod test_fixtures;
mod vitals;

// Where the runtime's wiring and its metrics registry name the export controller.

pub use process::main;

/// The snapshot ConfigMap format (docs/snapshot.md), for readers of it.
pub mod snapshot_configmap {
    /// How the operator replaces a snapshot ConfigMap (its body in protobuf), for the
    /// benchmark of that write.
    pub use crate::kube_client::protobuf::replace as replace_protobuf;
    pub use crate::publishers::configmap::{
        ANNOTATION_HASH, ANNOTATION_ID, DATA_BUDGET, Index, KEY_GZIP, KEY_JSON, KEY_PART, LABEL_PART_OF,
        LABEL_SNAPSHOT, MAX_DECODED_BYTES, PartRef, decode, decode_limited, index_of,
    };
}

/// The README's Layout names what exists: every crate under `crates/`, every folder of
/// `src/` and of `src/controller/`, and nothing that does not.
#[cfg(test)]
mod layout {
    use std::collections::BTreeSet;
    use std::path::Path;

    fn readme_layout() -> String {
        let readme = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/README.md")).unwrap();
        let after = readme.split("## Layout").nth(1).expect("a Layout section");
        after.split("```").nth(1).expect("a block in the Layout section").to_owned()
    }

    /// The folders in `dir` (relative to the repository).
    fn folders(dir: &str) -> BTreeSet<String> {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join(dir);
        std::fs::read_dir(path)
            .unwrap()
            .filter_map(Result::ok)
            .filter(|e| e.path().is_dir())
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect()
    }

    /// The folders the Layout names under `src/`, as paths: a folder indented two more
    /// than the one above it is inside it (`controller/resolver`).
    fn named_under_src(layout: &str) -> BTreeSet<String> {
        let mut path: Vec<(usize, String)> = Vec::new();
        let mut named = BTreeSet::new();
        for line in layout.lines().skip_while(|l| !l.starts_with("src/")).skip(1) {
            let indent = line.len() - line.trim_start().len();
            if indent == 0 && !line.is_empty() {
                break;
            }
            let Some(folder) = line.split_whitespace().next().and_then(|w| w.strip_suffix('/')) else { continue };
            path.retain(|(at, _)| *at < indent);
            path.push((indent, folder.to_owned()));
            named.insert(path.iter().map(|(_, f)| f.as_str()).collect::<Vec<_>>().join("/"));
        }
        named
    }

    #[test]
    fn the_readme_layout_names_every_crate_and_source_folder_and_nothing_else() {
        let layout = readme_layout();
        let crates: BTreeSet<String> = layout
            .lines()
            .filter(|l| l.starts_with("crates/"))
            .filter_map(|l| l.split_whitespace().next()?.strip_prefix("crates/")?.strip_suffix('/'))
            .filter(|n| !n.is_empty() && !n.contains('/'))
            .map(str::to_owned)
            .collect();
        assert_eq!(crates, folders("crates"), "crates/ in the README's Layout");
        let mut source = folders("src");
        source.extend(folders("src/controller").into_iter().map(|f| format!("controller/{f}")));
        assert_eq!(named_under_src(&layout), source, "the folders of src/ and src/controller/ in the README's Layout");
    }
}
