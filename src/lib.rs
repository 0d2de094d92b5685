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
mod export;
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

pub use process::main;

/// The snapshot ConfigMap format (docs/snapshot.md), for readers of it.
pub mod snapshot_configmap {
    pub use crate::publishers::configmap::{
        ANNOTATION_HASH, ANNOTATION_ID, DATA_BUDGET, Index, KEY_GZIP, KEY_JSON, KEY_PART, LABEL_PART_OF,
        LABEL_SNAPSHOT, MAX_DECODED_BYTES, PartRef, decode, decode_limited, index_of,
    };
}

/// The README's Layout names what exists: every crate under `crates/` and every folder of
/// `src/`, and nothing that does not.
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

    #[test]
    fn the_readme_layout_names_every_crate_and_source_folder_and_nothing_else() {
        let layout = readme_layout();
        let named = |prefix: &str| -> BTreeSet<String> {
            layout
                .lines()
                .filter_map(|l| l.split_whitespace().next().filter(|_| l.starts_with(prefix)))
                .filter_map(|w| w.strip_prefix(prefix.trim_start()).and_then(|r| r.strip_suffix('/')))
                .filter(|n| !n.is_empty() && !n.contains('/'))
                .map(str::to_owned)
                .collect()
        };
        assert_eq!(named("crates/"), folders("crates"), "crates/ in the README's Layout");
        assert_eq!(named("  "), folders("src"), "the folders of src/ in the README's Layout");
    }
}
