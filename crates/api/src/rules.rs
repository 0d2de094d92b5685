//! How the fields of a spec must relate to each other, as CEL rules of the CRD schema
//! (`x-kubernetes-validations`). API servers from Kubernetes 1.25 evaluate them, so a spec
//! that breaks one is refused at `kubectl apply` with the rule's message. The operator checks
//! the same things at run time and reports them as `InvalidSpec`: older API servers drop the
//! rules, and an object stored before a rule existed was never checked by it.
//!
//! Only `rule` and `message` are set: `fieldPath` and `reason` exist from Kubernetes 1.28, and
//! a 1.25-1.27 API server validating fields strictly refuses a CRD that carries them. So each
//! message names its fields itself, as the status does.
//!
//! Every list and string a rule reads has `maxItems`/`maxLength` in the schema: the API
//! server estimates a rule's cost from those bounds and refuses a CRD whose rules it cannot
//! bound.

/// One rule: `rule` holds for a valid object; `message` is what the API server answers when
/// it does not.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CelRule {
    pub rule: &'static str,
    pub message: &'static str,
}

/// Appends `rules` to the `x-kubernetes-validations` of `schema` (a schemars transform).
#[cfg(feature = "crd")]
pub(crate) fn add(schema: &mut schemars::Schema, rules: &[CelRule]) {
    for r in rules {
        kube::core::validate(schema, kube::core::Rule::new(r.rule).message(r.message))
            .expect("a rule of two strings serialises");
    }
}

#[cfg(all(test, feature = "crd"))]
mod tests;
