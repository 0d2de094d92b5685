//! The server on loopback, driven by envoy-types' own tonic client as Envoy drives it.

mod delta;
mod sotw;
mod support;
mod transport;
