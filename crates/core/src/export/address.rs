//! Which Consul addresses can be an EndpointSlice endpoint, in what form
//! (docs/export.md, "Addresses").
//!
//! A slice holds IP addresses of one family, one per endpoint, in canonical form: kube-proxy
//! compares and programs them as text, and reads only the first address of an endpoint.
//! Nothing is resolved: a hostname (FQDN slices are deprecated, and kube-proxy ignores
//! them) is left out and reported, as are addresses no consumer can route to from another
//! host: loopback (agentless Consul registers services on nodes at 127.0.0.1),
//! link-local, unspecified and multicast addresses.

use std::net::IpAddr;

use consul_resolver_api::export::IpFamily;

/// Why an instance's address cannot be an endpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Refused {
    Hostname,
    Loopback,
    LinkLocal,
    Unspecified,
    Multicast,
    OtherFamily(IpFamily),
}

impl Refused {
    /// For the export's status: what is wrong, and where to look.
    pub fn message(self) -> String {
        match self {
            Refused::Hostname => "not an IP address: hostnames are not resolved (FQDN EndpointSlices are deprecated and kube-proxy ignores them)".into(),
            Refused::Loopback => "loopback address: it names the consumer itself, not the instance (agentless Consul nodes register at 127.0.0.1)".into(),
            Refused::LinkLocal => "link-local address: not routable from another host".into(),
            Refused::Unspecified => "unspecified address (0.0.0.0 or ::)".into(),
            Refused::Multicast => "multicast address".into(),
            Refused::OtherFamily(f) => format!("not an {} address (spec.ipFamily)", f.as_str()),
        }
    }
}

/// The canonical form of `address` as an endpoint of a slice of `family`, or why it
/// cannot be one. An IPv4-mapped IPv6 address is its IPv4 address.
pub fn admit(address: &str, family: IpFamily) -> Result<String, Refused> {
    let ip: IpAddr = match address.trim().parse() {
        Ok(ip) => ip,
        // `[::1]` as some registrations write it.
        Err(_) => match address.trim().strip_prefix('[').and_then(|a| a.strip_suffix(']')).map(str::parse) {
            Some(Ok(ip)) => ip,
            _ => return Err(Refused::Hostname),
        },
    };
    let ip = match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
        v4 => v4,
    };
    if ip.is_loopback() {
        return Err(Refused::Loopback);
    }
    if ip.is_unspecified() {
        return Err(Refused::Unspecified);
    }
    if ip.is_multicast() {
        return Err(Refused::Multicast);
    }
    let link_local = match ip {
        IpAddr::V4(v4) => v4.is_link_local(),
        IpAddr::V6(v6) => (v6.segments()[0] & 0xffc0) == 0xfe80,
    };
    if link_local {
        return Err(Refused::LinkLocal);
    }
    let of = if ip.is_ipv4() { IpFamily::IPv4 } else { IpFamily::IPv6 };
    if of != family {
        return Err(Refused::OtherFamily(family));
    }
    Ok(ip.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_are_canonical_and_unroutable_ones_are_refused() {
        use IpFamily::{IPv4, IPv6};
        assert_eq!(admit("10.1.2.3", IPv4), Ok("10.1.2.3".into()));
        assert_eq!(admit(" 10.1.2.3 ", IPv4), Ok("10.1.2.3".into()));
        assert_eq!(admit("2001:DB8:0:0::1", IPv6), Ok("2001:db8::1".into()));
        assert_eq!(admit("[2001:db8::1]", IPv6), Ok("2001:db8::1".into()));
        assert_eq!(admit("::ffff:10.1.2.3", IPv4), Ok("10.1.2.3".into()));
        assert_eq!(admit("web.service.consul", IPv4), Err(Refused::Hostname));
        assert_eq!(admit("", IPv4), Err(Refused::Hostname));
        assert_eq!(admit("127.0.0.1", IPv4), Err(Refused::Loopback));
        assert_eq!(admit("127.9.9.9", IPv4), Err(Refused::Loopback));
        assert_eq!(admit("::1", IPv6), Err(Refused::Loopback));
        assert_eq!(admit("169.254.1.1", IPv4), Err(Refused::LinkLocal));
        assert_eq!(admit("fe80::1", IPv6), Err(Refused::LinkLocal));
        assert_eq!(admit("0.0.0.0", IPv4), Err(Refused::Unspecified));
        assert_eq!(admit("224.0.0.1", IPv4), Err(Refused::Multicast));
        assert_eq!(admit("2001:db8::1", IPv4), Err(Refused::OtherFamily(IPv4)));
        assert_eq!(admit("10.1.2.3", IPv6), Err(Refused::OtherFamily(IPv6)));
    }
}
