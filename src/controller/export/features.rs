//! What the API server knows of the fields an export may write, from its version, learned
//! once at start. A field a server does not know is refused under server-side apply (or
//! dropped), so it is sent only where the version says the server has it.

use consul_resolver_api::export::TrafficDistribution;
use k8s_openapi::apimachinery::pkg::version::Info;

/// The first minor version of Kubernetes 1.x with `Service.spec.trafficDistribution` on by
/// default (beta; alpha behind a gate that is off by default in 1.30, GA in 1.33).
const SERVICE_TRAFFIC_DISTRIBUTION_SINCE: u32 = 31;

/// The fields of the exported objects the API server knows, beyond those of every supported
/// version. The default knows none of them: what an unknown server is taken to be.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct ServerFeatures {
    /// `Service.spec.trafficDistribution`.
    pub(crate) service_traffic_distribution: bool,
}

impl ServerFeatures {
    /// From the API server's `/version`. A version that cannot be read is taken as knowing
    /// none of the fields (warned): a field sent to a server without it fails the write.
    pub(crate) fn of(info: &Info) -> ServerFeatures {
        let Some(version) = version(info) else {
            tracing::warn!(major = %info.major, minor = %info.minor,
                "cannot read the API server's version: the Service's spec.trafficDistribution is not written");
            return ServerFeatures::default();
        };
        ServerFeatures { service_traffic_distribution: version >= (1, SERVICE_TRAFFIC_DISTRIBUTION_SINCE) }
    }

    /// What the Service's `spec.trafficDistribution` is written as: the export's, where the
    /// server knows the field; nothing elsewhere (only the slices' hints say it there).
    pub(crate) fn service_traffic_distribution(
        self,
        asked: Option<TrafficDistribution>,
    ) -> Option<TrafficDistribution> {
        asked.filter(|_| self.service_traffic_distribution)
    }
}

/// `(major, minor)` from `/version`: the emulated version where the server says one (a
/// server emulating an older version has that version's features), else its own. Some
/// managed clusters add to the minor (`"31+"`), so only its leading digits count.
fn version(info: &Info) -> Option<(u32, u32)> {
    let (major, minor) = match (&info.emulation_major, &info.emulation_minor) {
        (Some(major), Some(minor)) => (major, minor),
        _ => (&info.major, &info.minor),
    };
    Some((leading_number(major)?, leading_number(minor)?))
}

fn leading_number(s: &str) -> Option<u32> {
    let end = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    s[..end].parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(major: &str, minor: &str) -> Info {
        Info { major: major.into(), minor: minor.into(), ..Info::default() }
    }

    #[test]
    fn the_minor_version_is_its_leading_digits() {
        assert_eq!(version(&info("1", "20")), Some((1, 20)));
        assert_eq!(version(&info("1", "31+")), Some((1, 31)));
        assert_eq!(version(&info("1", "")), None);
        assert_eq!(version(&info("1", "x")), None);
        assert_eq!(version(&info("", "31")), None);
        let emulating =
            Info { emulation_major: Some("1".into()), emulation_minor: Some("30".into()), ..info("1", "33") };
        assert_eq!(version(&emulating), Some((1, 30)), "a 1.33 server emulating 1.30");
    }

    #[test]
    fn the_services_traffic_distribution_is_known_from_1_31() {
        let known = |major: &str, minor: &str| ServerFeatures::of(&info(major, minor)).service_traffic_distribution;
        assert!(!known("1", "20"), "the test API server");
        assert!(!known("1", "30"), "alpha, its gate off by default");
        assert!(known("1", "31"));
        assert!(known("1", "31+"));
        assert!(known("1", "33"));
        assert!(known("2", "0"));
        assert!(!known("1", ""), "unreadable: taken as not known");
        assert!(!known("1", "x"));
    }

    #[test]
    fn the_service_carries_the_exports_distribution_only_where_the_server_knows_it() {
        let asked = Some(TrafficDistribution::PreferClose);
        let known = ServerFeatures { service_traffic_distribution: true };
        assert_eq!(known.service_traffic_distribution(asked), asked);
        assert_eq!(known.service_traffic_distribution(None), None);
        assert_eq!(ServerFeatures::default().service_traffic_distribution(asked), None);
    }
}
