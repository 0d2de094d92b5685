//! Optional TLS, and with it HTTP/2: Consul serves HTTP/2 only over HTTPS (ALPN `h2`), and
//! plain HTTP/1.1 otherwise, so the simulator does the same.
//!
//! The server offers ALPN `h2` and `http/1.1`; a client that negotiates `h2` gets HTTP/2 with
//! at most [`TlsConfig::h2_max_concurrent_streams`] streams at once (Go's default 250,
//! announced as `SETTINGS_MAX_CONCURRENT_STREAMS`), any other client HTTP/1.1. With a client
//! CA, a client certificate signed by it is required (mTLS). The crypto provider is rustls's
//! `ring`, as in the operator.
//!
//! With the `test-pki` feature, `TestPki` makes a CA, a server certificate and a client
//! certificate on the spot, for tests of clients.

use std::fmt;
use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;
use rustls::{RootCertStore, ServerConfig};
use tokio_rustls::TlsAcceptor;

/// Go's `http2` default for `SETTINGS_MAX_CONCURRENT_STREAMS`, which Consul keeps.
pub const DEFAULT_H2_MAX_CONCURRENT_STREAMS: u32 = 250;

/// What the simulator serves TLS with. [`Config::tls`](crate::Config::tls).
#[derive(Clone, PartialEq, Eq)]
pub struct TlsConfig {
    /// The server's certificate chain, leaf first, in PEM.
    pub cert_chain_pem: String,
    /// The server's private key (PKCS#8, PKCS#1 or SEC1) in PEM.
    pub key_pem: String,
    /// With a CA (PEM, one or more certificates), clients must present a certificate it
    /// signed (mTLS); without, no client certificate is asked for.
    pub client_ca_pem: Option<String>,
    /// `SETTINGS_MAX_CONCURRENT_STREAMS` of HTTP/2 connections.
    pub h2_max_concurrent_streams: u32,
    /// Whether ALPN offers `h2`; without, every client gets HTTP/1.1 (a server built with
    /// HTTP/2 turned off, or behind a proxy that does not speak it).
    pub offer_h2: bool,
}

impl TlsConfig {
    /// Server TLS without client certificates, 250 streams per HTTP/2 connection.
    pub fn new(cert_chain_pem: impl Into<String>, key_pem: impl Into<String>) -> Self {
        TlsConfig {
            cert_chain_pem: cert_chain_pem.into(),
            key_pem: key_pem.into(),
            client_ca_pem: None,
            h2_max_concurrent_streams: DEFAULT_H2_MAX_CONCURRENT_STREAMS,
            offer_h2: true,
        }
    }

    /// Requires client certificates signed by `ca_pem`.
    pub fn with_client_ca(mut self, ca_pem: impl Into<String>) -> Self {
        self.client_ca_pem = Some(ca_pem.into());
        self
    }

    pub fn with_h2_max_concurrent_streams(mut self, n: u32) -> Self {
        self.h2_max_concurrent_streams = n;
        self
    }

    /// HTTP/1.1 only: ALPN offers no `h2`.
    pub fn http1_only(mut self) -> Self {
        self.offer_h2 = false;
        self
    }

    /// The acceptor, or why the PEMs do not make a server configuration.
    pub(crate) fn acceptor(&self) -> Result<TlsAcceptor, String> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let chain = certificates(&self.cert_chain_pem, "certificate chain")?;
        let key = PrivateKeyDer::from_pem_slice(self.key_pem.as_bytes()).map_err(|e| format!("private key: {e}"))?;
        let builder = ServerConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .map_err(|e| e.to_string())?;
        let builder = match &self.client_ca_pem {
            None => builder.with_no_client_auth(),
            Some(ca) => {
                let mut roots = RootCertStore::empty();
                for cert in certificates(ca, "client CA")? {
                    roots.add(cert).map_err(|e| format!("client CA: {e}"))?;
                }
                let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider)
                    .build()
                    .map_err(|e| format!("client CA: {e}"))?;
                builder.with_client_cert_verifier(verifier)
            }
        };
        let mut config = builder.with_single_cert(chain, key).map_err(|e| format!("certificate chain and key: {e}"))?;
        config.alpn_protocols =
            if self.offer_h2 { vec![b"h2".to_vec(), b"http/1.1".to_vec()] } else { vec![b"http/1.1".to_vec()] };
        Ok(TlsAcceptor::from(Arc::new(config)))
    }
}

fn certificates(pem: &str, what: &str) -> Result<Vec<CertificateDer<'static>>, String> {
    let certs = CertificateDer::pem_slice_iter(pem.as_bytes())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("{what}: {e}"))?;
    if certs.is_empty() {
        return Err(format!("{what}: no certificate in the PEM"));
    }
    Ok(certs)
}

impl fmt::Debug for TlsConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The key stays out of logs, even in a test tool.
        f.debug_struct("TlsConfig")
            .field("cert_chain_pem", &format_args!("<{} bytes>", self.cert_chain_pem.len()))
            .field("key_pem", &"<redacted>")
            .field("client_ca_pem", &self.client_ca_pem.as_ref().map(|p| format!("<{} bytes>", p.len())))
            .field("h2_max_concurrent_streams", &self.h2_max_concurrent_streams)
            .field("offer_h2", &self.offer_h2)
            .finish()
    }
}

#[cfg(feature = "test-pki")]
pub use pki::TestPki;

#[cfg(feature = "test-pki")]
mod pki {
    use std::sync::Arc;

    use rcgen::{
        BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair, KeyUsagePurpose,
    };
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    use rustls::{ClientConfig, RootCertStore};

    use super::TlsConfig;

    /// A throw-away PKI for tests: a CA, a server certificate for `127.0.0.1`, `localhost`
    /// and `consul.test`, and a client certificate, both signed by the CA. All PEM.
    #[derive(Clone)]
    pub struct TestPki {
        pub ca_cert_pem: String,
        pub server_cert_pem: String,
        pub server_key_pem: String,
        pub client_cert_pem: String,
        pub client_key_pem: String,
    }

    impl std::fmt::Debug for TestPki {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.debug_struct("TestPki").finish_non_exhaustive()
        }
    }

    impl TestPki {
        /// New keys and certificates (ECDSA P-256), valid from now for years.
        pub fn generate() -> Result<Self, rcgen::Error> {
            let ca_key = KeyPair::generate()?;
            let mut ca = CertificateParams::new(Vec::<String>::new())?;
            ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
            ca.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
            ca.distinguished_name.push(DnType::CommonName, "consul-sim test CA");
            let ca_cert = ca.self_signed(&ca_key)?;
            let issuer = Issuer::from_params(&ca, &ca_key);

            let leaf = |names: Vec<String>, cn: &str, usage: ExtendedKeyUsagePurpose| {
                let key = KeyPair::generate()?;
                let mut params = CertificateParams::new(names)?;
                params.distinguished_name.push(DnType::CommonName, cn);
                params.extended_key_usages = vec![usage];
                let cert = params.signed_by(&key, &issuer)?;
                Ok::<_, rcgen::Error>((cert.pem(), key.serialize_pem()))
            };
            let server_names = ["127.0.0.1", "localhost", "consul.test"].map(str::to_owned).to_vec();
            let (server_cert_pem, server_key_pem) =
                leaf(server_names, "server.dc1.consul", ExtendedKeyUsagePurpose::ServerAuth)?;
            let (client_cert_pem, client_key_pem) = leaf(
                vec!["client.consul.test".to_owned()],
                "consul-sim test client",
                ExtendedKeyUsagePurpose::ClientAuth,
            )?;
            Ok(TestPki { ca_cert_pem: ca_cert.pem(), server_cert_pem, server_key_pem, client_cert_pem, client_key_pem })
        }

        /// Server TLS with the server certificate, no client certificates asked for.
        pub fn server_tls(&self) -> TlsConfig {
            TlsConfig::new(self.server_cert_pem.clone(), self.server_key_pem.clone())
        }

        /// Server TLS requiring a client certificate signed by this CA (mTLS).
        pub fn mtls(&self) -> TlsConfig {
            self.server_tls().with_client_ca(self.ca_cert_pem.clone())
        }

        /// A rustls client (ring provider) trusting this CA, offering ALPN `h2` then
        /// `http/1.1`, and presenting the client certificate when `client_cert`.
        pub fn client_config(&self, client_cert: bool) -> Result<ClientConfig, rustls::Error> {
            let mut roots = RootCertStore::empty();
            for cert in CertificateDer::pem_slice_iter(self.ca_cert_pem.as_bytes()) {
                roots.add(cert.map_err(|e| rustls::Error::General(e.to_string()))?)?;
            }
            let builder = ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
                .with_safe_default_protocol_versions()?
                .with_root_certificates(roots);
            let mut config = if client_cert {
                let chain = CertificateDer::pem_slice_iter(self.client_cert_pem.as_bytes())
                    .collect::<Result<Vec<_>, _>>()
                    .map_err(|e| rustls::Error::General(e.to_string()))?;
                let key = PrivateKeyDer::from_pem_slice(self.client_key_pem.as_bytes())
                    .map_err(|e| rustls::Error::General(e.to_string()))?;
                builder.with_client_auth_cert(chain, key)?
            } else {
                builder.with_no_client_auth()
            };
            config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
            Ok(config)
        }
    }
}
