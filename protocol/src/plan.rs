//! Plan claims: what the controller authorises one chain session to do. The controller
//! encodes [`PlanClaims`], signs the bytes (see `shardcast_identity::plan`), and the token
//! travels in the session's `Open`; every hop verifies the signature and then asks
//! [`PlanClaims::authorises`] whether this `Open` is within the plan. Pure: the caller
//! passes the time in.
//!
//! Token layout (all lengths big-endian):
//! `claims_len: u32 | claims | sig_len: u16 | signature | cert_len: u16 | signer certificate (DER)`.
//! Claims layout: `PLAN_MAGIC (4) | plan id: str | model: [u8; 32] | not_after: u64 (Unix
//! seconds) | issued_at_ms: u64 (the controller's clock, Unix milliseconds) | n: u16 |
//! n × (host id: str | data address: str) | name: str` (`name` empty when the plan does not
//! bind its model's name; an address empty for a host no one dials in the plan).
//! `issued_at_ms` orders the statements that bind a name on a host: one older than the
//! binding a host holds is refused, so replaying an old token cannot roll a name back.
//! The addresses are signed so that every address a hop dials for a session — the next
//! hops, the holders above it, a `shardcast://` fallback — is one the controller named:
//! a host with a valid certificate cannot point another at an address of its choosing.
//!
//! [`PlanClaims::authorises`] checks the expiry, the model, that this host, the sender and
//! every downstream hop are named, and that every address the `Open` would make this host
//! dial is the one signed for that host. [`TokenParts`] parses a token with every length
//! bounded ([`MAX_TOKEN_LEN`]); the signature itself is checked by
//! `shardcast_identity`'s `TlsContext::verify_plan`.

use bytes::{Buf, BufMut, Bytes};

use crate::codec::{
    self, Codec, DecodeError, get_array, get_bytes, get_str, get_u16, get_u64, need,
};
use crate::frame::{Hop, MAX_ADDR_LEN, SessionHeader};
use crate::manifest::ModelDigest;
use crate::name::{HostId, MAX_HOST_ID_LEN, MAX_MODEL_NAME_LEN, ModelName};

/// Magic at the start of encoded claims.
/// (`SCP3`: each host with its data address. `SCP2` had host ids only and `SCPL` no
/// `issued_at_ms`; both are refused.)
pub const PLAN_MAGIC: &[u8; 4] = b"SCP3";
/// Most hosts one token may name: a chain of up to [`crate::frame::MAX_HOPS`] hops, its
/// head and the holders it may fall back to. Tokens are signed per chain.
pub const MAX_PLAN_HOSTS: usize = crate::frame::MAX_HOPS + 64;
/// Longest plan id.
pub const MAX_PLAN_ID_LEN: usize = 128;
/// Longest signature (ECDSA P-384 DER is 104 bytes, RSA-4096 512).
pub const MAX_SIGNATURE_LEN: usize = 1024;
/// Longest signer certificate.
pub const MAX_CERT_LEN: usize = 16 << 10;
/// Longest token: claims at their maximum plus a signature and a certificate.
pub const MAX_TOKEN_LEN: usize = 4
    + 4
    + 2
    + MAX_PLAN_ID_LEN
    + 32
    + 8
    + 8
    + 2
    + MAX_PLAN_HOSTS * (2 + MAX_HOST_ID_LEN + 2 + MAX_ADDR_LEN)
    + 2
    + MAX_MODEL_NAME_LEN
    + 2
    + MAX_SIGNATURE_LEN
    + 2
    + MAX_CERT_LEN;

/// What a plan authorises.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlanClaims {
    /// The controller's plan id (for logs).
    pub plan: String,
    /// The model version the sessions carry.
    pub model: ModelDigest,
    /// Unix seconds after which no new session of the plan is accepted.
    pub not_after: u64,
    /// When the controller signed it (its clock, Unix milliseconds): a host binds
    /// [`Self::name`] only when no newer statement about the name has reached it.
    pub issued_at_ms: u64,
    /// Every host that may send or receive in the plan's sessions (sources and receivers),
    /// each with the data address the plan's hops may dial it at (empty: none may).
    pub hosts: Vec<Hop>,
    /// The registry name whose current version `model` is, when the controller signed the
    /// plan: the hosts resolve `name` to `model` from then on. `None` for a plan of another
    /// version (a pinned digest, a rollback target that is not current), which binds no
    /// name.
    pub name: Option<ModelName>,
}

impl PlanClaims {
    /// Whether the plan names `host`.
    pub fn names(&self, host: &HostId) -> bool {
        self.hosts.iter().any(|h| h.host == *host)
    }

    /// Whether the plan names `hop`'s host at `hop`'s address.
    pub fn signs(&self, hop: &Hop) -> bool {
        !hop.addr.is_empty() && self.hosts.iter().any(|h| h == hop)
    }

    /// Whether an `Open` (`header`), received by `me` from `sender`, is within these claims
    /// at `now` (Unix seconds): the model, this host, the sender, and every address the
    /// header would have this host dial — each downstream hop and each upstream holder at
    /// the address the plan gives it, a `shardcast://` fallback at a plan host's address.
    /// The error says which part is not.
    pub fn authorises(
        &self,
        header: &SessionHeader,
        me: &HostId,
        sender: &HostId,
        now: u64,
    ) -> Result<(), Unauthorised> {
        let plan = self.plan.clone();
        if now > self.not_after {
            return Err(Unauthorised::Expired {
                plan,
                ago_s: now - self.not_after,
            });
        }
        if header.model != self.model {
            return Err(Unauthorised::OtherModel {
                plan,
                model: self.model,
                asked: header.model,
            });
        }
        for (who, h) in [(Party::ThisHost, me), (Party::Sender, sender)] {
            if !self.names(h) {
                return Err(Unauthorised::HostNotNamed {
                    plan,
                    who,
                    host: h.clone(),
                });
            }
        }
        for (which, hops) in [
            (Party::Downstream, &header.downstream),
            (Party::Upstream, &header.upstream),
        ] {
            for hop in hops.iter() {
                if !self.names(&hop.host) {
                    return Err(Unauthorised::HopNotNamed {
                        plan,
                        which,
                        host: hop.host.clone(),
                    });
                }
                if !self.signs(hop) {
                    return Err(Unauthorised::AddressNotSigned {
                        plan,
                        which,
                        host: hop.host.clone(),
                        addr: hop.addr.clone(),
                    });
                }
            }
        }
        if let Some(addr) = header.origin.strip_prefix("shardcast://") {
            if !self
                .hosts
                .iter()
                .any(|h| !h.addr.is_empty() && h.addr == addr)
            {
                return Err(Unauthorised::FallbackNotAPlanHost {
                    plan,
                    addr: addr.to_string(),
                });
            }
        }
        Ok(())
    }
}

/// Who an [`Unauthorised`] is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Party {
    /// The host that received the `Open`.
    ThisHost,
    /// The host that sent it.
    Sender,
    /// A hop below, which this host would dial.
    Downstream,
    /// A holder above, which this host may pull from.
    Upstream,
}

impl std::fmt::Display for Party {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::ThisHost => "this host",
            Self::Sender => "the sender",
            Self::Downstream => "downstream hop",
            Self::Upstream => "upstream hop",
        })
    }
}

/// Why an `Open` is not within its plan's claims ([`PlanClaims::authorises`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Unauthorised {
    /// The plan expired.
    #[error("plan {plan} expired {ago_s} s ago")]
    Expired {
        /// The plan id.
        plan: String,
        /// Seconds since it expired.
        ago_s: u64,
    },
    /// The plan is for another model.
    #[error("plan {plan} is for model {model}, not {asked}")]
    OtherModel {
        /// The plan id.
        plan: String,
        /// The plan's model.
        model: ModelDigest,
        /// The model the `Open` asks for.
        asked: ModelDigest,
    },
    /// The plan does not name this host or the sender.
    #[error("plan {plan} does not name {who} ({host})")]
    HostNotNamed {
        /// The plan id.
        plan: String,
        /// [`Party::ThisHost`] or [`Party::Sender`].
        who: Party,
        /// The host.
        host: HostId,
    },
    /// The plan does not name a hop the header lists.
    #[error("plan {plan} does not name {which} {host}")]
    HopNotNamed {
        /// The plan id.
        plan: String,
        /// [`Party::Downstream`] or [`Party::Upstream`].
        which: Party,
        /// The hop's host.
        host: HostId,
    },
    /// The plan does not give a hop the address the header lists.
    #[error("plan {plan} does not give {which} {host} the address {addr}")]
    AddressNotSigned {
        /// The plan id.
        plan: String,
        /// [`Party::Downstream`] or [`Party::Upstream`].
        which: Party,
        /// The hop's host.
        host: HostId,
        /// The address the header gives it.
        addr: String,
    },
    /// A `shardcast://` fallback is no plan host's address.
    #[error("fallback holder {addr} is not the address of a host of plan {plan}")]
    FallbackNotAPlanHost {
        /// The plan id.
        plan: String,
        /// The fallback's address.
        addr: String,
    },
}

impl Codec for PlanClaims {
    fn decode<B: Buf>(b: &mut B) -> Result<Self, DecodeError> {
        let magic: [u8; 4] = get_array(b)?;
        if &magic != PLAN_MAGIC {
            return Err(DecodeError::BadMagic {
                expected: PLAN_MAGIC,
            });
        }
        let plan = get_str(b, "plan id", MAX_PLAN_ID_LEN)?;
        let model = ModelDigest(get_array(b)?);
        let not_after = get_u64(b)?;
        let issued_at_ms = get_u64(b)?;
        let n = get_u16(b)? as usize;
        if n > MAX_PLAN_HOSTS {
            return Err(DecodeError::TooLong {
                field: "plan hosts",
                len: n as u64,
                max: MAX_PLAN_HOSTS as u64,
            });
        }
        let mut hosts = Vec::with_capacity(n.min(64));
        for _ in 0..n {
            let s = get_str(b, "host id", MAX_HOST_ID_LEN)?;
            let host = HostId::new(s).map_err(|e| DecodeError::Invalid {
                field: "host id",
                reason: e.to_string(),
            })?;
            let addr = get_str(b, "host address", MAX_ADDR_LEN)?;
            hosts.push(Hop { host, addr });
        }
        let name = get_str(b, "model name", MAX_MODEL_NAME_LEN)?;
        let name = match name.is_empty() {
            true => None,
            false => Some(ModelName::new(name).map_err(|e| DecodeError::Invalid {
                field: "model name",
                reason: e.to_string(),
            })?),
        };
        Ok(Self {
            plan,
            model,
            not_after,
            issued_at_ms,
            hosts,
            name,
        })
    }

    fn encode<B: BufMut>(&self, b: &mut B) {
        b.put_slice(PLAN_MAGIC);
        codec::put_str(b, &self.plan);
        b.put_slice(&self.model.0);
        b.put_u64(self.not_after);
        b.put_u64(self.issued_at_ms);
        let n = self.hosts.len().min(MAX_PLAN_HOSTS);
        b.put_u16(n as u16);
        for h in &self.hosts[..n] {
            codec::put_str(b, h.host.as_str());
            codec::put_str(b, &h.addr);
        }
        codec::put_str(b, self.name.as_ref().map_or("", |n| n.as_str()));
    }

    fn encoded_len(&self) -> usize {
        4 + codec::str_len(&self.plan)
            + 32
            + 8
            + 8
            + 2
            + self.hosts[..self.hosts.len().min(MAX_PLAN_HOSTS)]
                .iter()
                .map(|h| codec::str_len(h.host.as_str()) + codec::str_len(&h.addr))
                .sum::<usize>()
            + codec::str_len(self.name.as_ref().map_or("", |n| n.as_str()))
    }
}

/// A token split into its parts (signature not yet verified).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenParts {
    /// The encoded claims (what was signed).
    pub claims: Bytes,
    /// The signature over `claims`.
    pub signature: Bytes,
    /// The signer's certificate (DER).
    pub signer: Bytes,
}

impl TokenParts {
    /// Splits a token; lengths are checked before anything is copied.
    pub fn parse(token: &[u8]) -> Result<Self, DecodeError> {
        if token.len() > MAX_TOKEN_LEN {
            return Err(DecodeError::TooLong {
                field: "plan token",
                len: token.len() as u64,
                max: MAX_TOKEN_LEN as u64,
            });
        }
        let mut b = Bytes::copy_from_slice(token);
        need(&b, 4)?;
        let n = b.get_u32() as usize;
        need(&b, n)?;
        let claims = b.split_to(n);
        let signature = get_bytes(&mut b, "plan signature", MAX_SIGNATURE_LEN)?;
        let signer = get_bytes(&mut b, "plan signer certificate", MAX_CERT_LEN)?;
        if b.has_remaining() {
            return Err(DecodeError::TrailingBytes(b.remaining()));
        }
        Ok(Self {
            claims,
            signature,
            signer,
        })
    }

    /// Joins the parts into a token.
    pub fn encode(&self) -> Vec<u8> {
        let mut out =
            Vec::with_capacity(8 + self.claims.len() + self.signature.len() + self.signer.len());
        out.put_u32(self.claims.len() as u32);
        out.put_slice(&self.claims);
        out.put_u16(self.signature.len().min(u16::MAX as usize) as u16);
        out.put_slice(&self.signature);
        out.put_u16(self.signer.len().min(u16::MAX as usize) as u16);
        out.put_slice(&self.signer);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codec::decode_exact;

    fn hop(host: &str, addr: &str) -> Hop {
        Hop {
            host: HostId::new(host).unwrap(),
            addr: addr.into(),
        }
    }

    fn claims() -> PlanClaims {
        PlanClaims {
            plan: "p1".into(),
            model: ModelDigest([7; 32]),
            not_after: 1000,
            issued_at_ms: 400_000,
            hosts: vec![
                hop("a", "10.0.0.1:7400"),
                hop("b", "10.0.0.2:7400"),
                hop("c", "10.0.0.3:7400"),
                hop("quiet", ""),
            ],
            name: Some(ModelName::new("org/model").unwrap()),
        }
    }

    fn open(downstream: Vec<Hop>, upstream: Vec<Hop>, origin: &str) -> SessionHeader {
        SessionHeader {
            session: crate::frame::SessionId([1; 16]),
            model: ModelDigest([7; 32]),
            shard: 0,
            start: 0,
            end: 1,
            tier: crate::DataTier::Memory,
            origin: origin.into(),
            downstream,
            token: Bytes::new(),
            upstream,
            transport: crate::frame::HopTransport::Tcp,
        }
    }

    #[test]
    fn round_trip() {
        let c = claims();
        let mut buf = Vec::new();
        c.encode(&mut buf);
        assert_eq!(buf.len(), c.encoded_len());
        assert_eq!(decode_exact::<PlanClaims>(Bytes::from(buf)).unwrap(), c);
        let unnamed = PlanClaims {
            name: None,
            ..c.clone()
        };
        let mut buf = Vec::new();
        unnamed.encode(&mut buf);
        assert_eq!(buf.len(), unnamed.encoded_len());
        assert_eq!(
            decode_exact::<PlanClaims>(Bytes::from(buf.clone())).unwrap(),
            unnamed
        );
        // The layout before addresses were signed is refused, not misread.
        let mut old = buf.clone();
        old[..4].copy_from_slice(b"SCP2");
        assert!(decode_exact::<PlanClaims>(Bytes::from(old)).is_err());
    }

    #[test]
    fn who_and_when() {
        let c = claims();
        let (a, b, x) = (
            HostId::new("a").unwrap(),
            HostId::new("b").unwrap(),
            HostId::new("x").unwrap(),
        );
        let plain = open(vec![], vec![], "");
        assert!(c.authorises(&plain, &b, &a, 999).is_ok());
        let err = |h: &SessionHeader, me: &HostId, from: &HostId, now| {
            c.authorises(h, me, from, now).unwrap_err().to_string()
        };
        assert!(matches!(
            c.authorises(&plain, &b, &a, 1001),
            Err(Unauthorised::Expired { ago_s: 1, .. })
        ));
        assert!(matches!(
            c.authorises(&plain, &b, &x, 1),
            Err(Unauthorised::HostNotNamed {
                who: Party::Sender,
                ..
            })
        ));
        assert!(err(&plain, &b, &a, 1001).contains("expired"));
        let other = SessionHeader {
            model: ModelDigest([8; 32]),
            ..plain.clone()
        };
        assert!(err(&other, &b, &a, 1).contains("for model"));
        assert!(err(&plain, &x, &a, 1).contains("this host"));
        assert!(err(&plain, &b, &x, 1).contains("sender"));
    }

    #[test]
    fn every_address_dialled_is_signed() {
        let c = claims();
        let (a, b) = (HostId::new("a").unwrap(), HostId::new("b").unwrap());
        let ok = open(
            vec![hop("c", "10.0.0.3:7400")],
            vec![hop("a", "10.0.0.1:7400")],
            "shardcast://10.0.0.3:7400",
        );
        assert!(c.authorises(&ok, &b, &a, 1).is_ok());
        let cases = [
            // A host outside the plan, downstream or upstream.
            (
                open(vec![hop("x", "10.0.0.9:7400")], vec![], ""),
                "does not name downstream hop x",
            ),
            (
                open(vec![], vec![hop("x", "10.0.0.9:7400")], ""),
                "does not name upstream hop x",
            ),
            // A plan host at an address the plan does not give it.
            (
                open(vec![hop("c", "192.0.2.7:7400")], vec![], ""),
                "does not give downstream hop c the address 192.0.2.7:7400",
            ),
            (
                open(vec![], vec![hop("a", "192.0.2.7:7400")], ""),
                "does not give upstream hop a the address 192.0.2.7:7400",
            ),
            // A plan host no one may dial, at any address.
            (
                open(vec![hop("quiet", "")], vec![], ""),
                "does not give downstream hop quiet",
            ),
            (
                open(vec![], vec![hop("quiet", "10.0.0.4:7400")], ""),
                "does not give upstream hop quiet",
            ),
            // A fallback holder that is no plan host's address.
            (
                open(vec![], vec![], "shardcast://192.0.2.7:7400"),
                "fallback holder 192.0.2.7:7400 is not the address of a host of plan p1",
            ),
            (
                open(vec![], vec![], "shardcast://"),
                "fallback holder  is not",
            ),
        ];
        for (h, why) in cases {
            let e = c.authorises(&h, &b, &a, 1).unwrap_err().to_string();
            assert!(e.contains(why), "{e} (wanted {why})");
        }
        // Origins that are not holders are the origin policy's business, not the plan's.
        assert!(
            c.authorises(&open(vec![], vec![], "s3://bucket/m"), &b, &a, 1)
                .is_ok()
        );
    }

    #[test]
    fn token_parts_round_trip_and_bounds() {
        let p = TokenParts {
            claims: Bytes::from_static(b"claims"),
            signature: Bytes::from_static(b"sig"),
            signer: Bytes::from_static(b"cert"),
        };
        assert_eq!(TokenParts::parse(&p.encode()).unwrap(), p);
        let mut t = p.encode();
        t.push(0);
        assert!(TokenParts::parse(&t).is_err());
        assert!(TokenParts::parse(&[0xff, 0xff, 0xff, 0xff]).is_err());
        assert!(TokenParts::parse(&[]).is_err());
    }
}
