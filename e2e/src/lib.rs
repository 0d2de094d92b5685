//! End-to-end support: the Consul API simulator, the Consul test client, and the harness
//! that runs the operator against a real local control plane.

pub mod agent;
pub mod apiserver;
pub mod bench;
pub mod consul;
pub mod fixtures;
pub mod harness;
pub mod netns;
pub mod watches;
