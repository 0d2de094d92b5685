//! End-to-end support: the Consul API simulator, the Consul test client, the harness that
//! runs the operator against a real local control plane, and a real Envoy with backends to
//! route to and a prober that counts where each request went.

pub mod agent;
pub mod apiserver;
pub mod backends;
pub mod bench;
pub mod consul;
pub mod envoy;
pub mod fixtures;
pub mod harness;
pub mod netns;
pub mod probe;
pub mod procfs;
pub mod watches;
