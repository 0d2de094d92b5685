//! The TLS client configuration of one Consul server: which roots verify it, which name it
//! must prove, the client certificate we present (mutual TLS), and the protocols we offer.
//!
//! Built once per client (address spelling and TLS settings) and shared by the HTTP/1.1 path
//! (reqwest) and the HTTP/2 path (our own multiplexer), so both verify the same way.

use std::sync::Arc;

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::{ClientConfig, DigitallySignedStruct, RootCertStore, SignatureScheme};

use consul_resolver_core::keys::TlsSettings;

/// What we offer in ALPN.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Offer {
    /// `h2` first, then `http/1.1`: a server that speaks HTTP/2 multiplexes our queries.
    Http2OrHttp1,
    /// `http/1.1` only (the reqwest path, which does not multiplex).
    Http1,
}

/// The rustls configuration for `tls` (`None`: system roots, no client certificate).
/// Errors name the setting at fault, never a key's content.
pub(crate) fn client_config(tls: Option<&TlsSettings>, offer: Offer) -> Result<ClientConfig, String> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = ClientConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(|e| format!("TLS setup: {e}"))?;
    let ca_pem = tls.and_then(|t| t.ca_pem.as_deref());
    let builder = if tls.is_some_and(|t| t.insecure_skip_verify) {
        builder.dangerous().with_custom_certificate_verifier(Arc::new(AcceptAnyCertificate(provider)))
    } else if let Some(pem) = ca_pem {
        let mut roots = RootCertStore::empty();
        for cert in CertificateDer::pem_slice_iter(pem.as_bytes()) {
            let cert = cert.map_err(|e| format!("invalid CA bundle (tls.caSecretRef): {e}"))?;
            roots.add(cert).map_err(|e| format!("invalid CA certificate (tls.caSecretRef): {e}"))?;
        }
        if roots.is_empty() {
            return Err("the CA bundle (tls.caSecretRef) holds no certificate".into());
        }
        builder.with_root_certificates(roots)
    } else {
        // The system's roots, verified as the platform does (as reqwest does by default).
        let verifier = rustls_platform_verifier::Verifier::new(provider)
            .map_err(|e| format!("cannot load the system's CA certificates: {e}"))?;
        builder.dangerous().with_custom_certificate_verifier(Arc::new(verifier))
    };
    let mut config = match tls.and_then(|t| t.client_identity.as_ref()) {
        None => builder.with_no_client_auth(),
        Some(id) => {
            let certs = CertificateDer::pem_slice_iter(id.cert_pem.as_bytes())
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| format!("invalid client certificate (tls.clientCertSecretRef): {e}"))?;
            if certs.is_empty() {
                return Err("the client certificate (tls.clientCertSecretRef) holds no certificate".into());
            }
            // The parser's error could quote the input; say only what kind of failure it was.
            let key = PrivateKeyDer::from_pem_slice(id.key_pem.expose().as_bytes()).map_err(|_| {
                "the client key (tls.clientKeySecretRef) is not a PEM private key (PKCS#8, PKCS#1 or SEC1)".to_owned()
            })?;
            builder
                .with_client_auth_cert(certs, key)
                .map_err(|e| format!("the client certificate and key (tls.client*SecretRef) do not go together: {e}"))?
        }
    };
    config.alpn_protocols = match offer {
        Offer::Http2OrHttp1 => vec![b"h2".to_vec(), b"http/1.1".to_vec()],
        Offer::Http1 => vec![b"http/1.1".to_vec()],
    };
    Ok(config)
}

/// `insecureSkipVerify`: any certificate is accepted, but the handshake's signatures are
/// still checked (a peer must hold the key of the certificate it shows).
#[derive(Debug)]
struct AcceptAnyCertificate(Arc<CryptoProvider>);

impl ServerCertVerifier for AcceptAnyCertificate {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(message, cert, dss, &self.0.signature_verification_algorithms)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(message, cert, dss, &self.0.signature_verification_algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

/// A TLS failure in `e`'s chain of causes, said for a user: which setting to check.
pub(crate) fn explain(e: &(dyn std::error::Error + 'static)) -> Option<String> {
    let mut cur = Some(e);
    while let Some(err) = cur {
        let rustls_error = err
            .downcast_ref::<rustls::Error>()
            .or_else(|| err.downcast_ref::<std::io::Error>().and_then(|io| io.get_ref()?.downcast_ref()));
        if let Some(r) = rustls_error {
            return Some(advice(r));
        }
        cur = err.source();
    }
    None
}

fn advice(e: &rustls::Error) -> String {
    use rustls::{AlertDescription as Alert, CertificateError as Cert, Error as E};
    let hint = match e {
        E::InvalidCertificate(Cert::UnknownIssuer | Cert::BadSignature) => {
            "the server's certificate is not signed by the CA in tls.caSecretRef (or the system roots when it is unset)"
        }
        E::InvalidCertificate(Cert::NotValidForName | Cert::NotValidForNameContext { .. }) => {
            "the server's certificate does not name this host: set tls.serverName to a name it carries"
        }
        E::InvalidCertificate(Cert::Expired | Cert::ExpiredContext { .. } | Cert::NotValidYet) => {
            "the server's certificate is outside its validity period"
        }
        E::AlertReceived(Alert::CertificateRequired | Alert::BadCertificate | Alert::UnknownCA) => {
            "the server refused our client certificate: set tls.clientCertSecretRef and tls.clientKeySecretRef to one its CA signs"
        }
        _ => "the TLS handshake failed",
    };
    format!("TLS: {e}: {hint}")
}

#[cfg(test)]
mod tests {
    use super::*;
    use consul_resolver_core::keys::{ClientIdentity, Secret};

    #[test]
    fn settings_are_checked_and_errors_name_the_field() {
        let with = |t: TlsSettings| client_config(Some(&t), Offer::Http1).map(|_| ());
        let bad_ca = TlsSettings { ca_pem: Some("not a pem".into()), ..Default::default() };
        assert!(with(bad_ca).unwrap_err().contains("tls.caSecretRef"));
        let key = "-----BEGIN PRIVATE KEY-----\nc2VjcmV0LWtleS1ieXRlcw==\n-----END PRIVATE KEY-----\n";
        let half = TlsSettings {
            client_identity: Some(ClientIdentity { cert_pem: "nothing".into(), key_pem: Secret::new(key) }),
            insecure_skip_verify: true,
            ..Default::default()
        };
        let e = with(half).unwrap_err();
        assert!(e.contains("tls.clientCertSecretRef"), "{e}");
        assert!(!e.contains("c2VjcmV0"), "a key never shows: {e}");
        let offered = client_config(None, Offer::Http2OrHttp1).unwrap().alpn_protocols;
        assert_eq!(offered, [b"h2".to_vec(), b"http/1.1".to_vec()]);
    }

    #[test]
    fn tls_failures_say_what_to_check() {
        let io = std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            rustls::Error::InvalidCertificate(rustls::CertificateError::UnknownIssuer),
        );
        let said = explain(&io).unwrap();
        assert!(said.contains("tls.caSecretRef"), "{said}");
        assert_eq!(explain(&std::io::Error::other("connection refused")), None);
    }
}
