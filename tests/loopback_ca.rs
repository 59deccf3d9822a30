//! A throwaway certificate authority for TLS servers on loopback (the quota store over
//! `rediss://`, HTTPS engines).

/// A CA and a certificate it signed for 127.0.0.1 and localhost, all PEM.
pub struct LoopbackCa {
    pub ca_pem: String,
    pub leaf_pem: String,
    pub key_pem: String,
}

impl LoopbackCa {
    pub fn new() -> LoopbackCa {
        let mut ca_params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        ca_params
            .distinguished_name
            .push(rcgen::DnType::CommonName, "weir test CA");
        let ca =
            rcgen::CertifiedIssuer::self_signed(ca_params, rcgen::KeyPair::generate().unwrap())
                .unwrap();
        let key = rcgen::KeyPair::generate().unwrap();
        let leaf =
            rcgen::CertificateParams::new(vec!["127.0.0.1".to_owned(), "localhost".to_owned()])
                .unwrap()
                .signed_by(&key, &ca)
                .unwrap();
        LoopbackCa {
            ca_pem: ca.as_ref().pem(),
            leaf_pem: leaf.pem(),
            key_pem: key.serialize_pem(),
        }
    }
}

impl Default for LoopbackCa {
    fn default() -> Self {
        LoopbackCa::new()
    }
}
