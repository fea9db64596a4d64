//! The controller API's enums by name: each is a number on the gRPC wire and its
//! lowercase name in the HTTP/JSON API, the CLI and messages (`memory`, `running`,
//! `partition-live`); `Unspecified` is the empty string (a request's tier: memory).
//!
//! Each enum has `label` / `from_label` / `LABELS`; the `json` submodules are the
//! `serde(with)` modules `build.rs` puts on every enum field of the controller's messages,
//! so JSON carries the names (an unknown name is an error listing the known ones). Both
//! APIs' `Transport` and `Tier` convert to and from the domain's [`crate::HopTransport`] and
//! [`crate::Tier`] (`From`, and `domain`, `None` for `Unspecified`).

use crate::controller::{GpuState, PlanKind, PlanState, ReceiverState, Tier, Transport};

macro_rules! labels {
    ($ty:ident { $($v:ident => $s:literal),+ $(,)? }) => {
        impl $ty {
            /// Every name but the empty one, for messages.
            pub const LABELS: &'static [&'static str] = &[$($s),+];

            /// Its name (`""` for `Unspecified`).
            pub fn label(self) -> &'static str {
                match self {
                    Self::Unspecified => "",
                    $(Self::$v => $s),+
                }
            }

            /// The variant named `s` (`""` is `Unspecified`).
            pub fn from_label(s: &str) -> Option<Self> {
                match s {
                    "" => Some(Self::Unspecified),
                    $($s => Some(Self::$v),)+
                    _ => None,
                }
            }
        }
    };
}

labels!(Tier { Memory => "memory", Disk => "disk", Gpu => "gpu" });
labels!(Transport { Tcp => "tcp", Quic => "quic" });
labels!(PlanState {
    Running => "running",
    Done => "done",
    Partial => "partial",
    Failed => "failed",
});
labels!(PlanKind { Chains => "chains", Burst => "burst" });
labels!(ReceiverState {
    Pending => "pending",
    Receiving => "receiving",
    Joined => "joined",
    Loading => "loading",
    Done => "done",
    Local => "local",
    Lost => "lost",
    Failed => "failed",
});
labels!(GpuState {
    Loading => "loading",
    PartitionLive => "partition-live",
    Resident => "resident",
    Failed => "failed",
    Unavailable => "unavailable",
});

/// An API enum whose `Unspecified` means "the caller's default" and whose other variants
/// are a domain enum's, by the same names: `From` the domain enum, and `domain` back
/// (`None` for `Unspecified`).
macro_rules! domain {
    ($($pb:ty => $dom:ty { $($v:ident),+ });+ $(;)?) => {$(
        impl From<$dom> for $pb {
            fn from(t: $dom) -> Self {
                match t {
                    $(<$dom>::$v => Self::$v),+
                }
            }
        }

        impl $pb {
            /// The domain's value, or `None` for `Unspecified` (the default applies).
            pub fn domain(self) -> Option<$dom> {
                match self {
                    Self::Unspecified => None,
                    $(Self::$v => Some(<$dom>::$v)),+
                }
            }
        }
    )+};
}

domain! {
    crate::agent::Transport => crate::HopTransport { Tcp, Quic };
    crate::controller::Transport => crate::HopTransport { Tcp, Quic };
    crate::controller::Tier => crate::tier::Tier { Memory, Disk, Gpu };
}

// The agent's `Tier` has no `Unspecified` (every request names its store tier), so it
// converts both ways in full.
impl From<crate::tier::Tier> for crate::agent::Tier {
    fn from(t: crate::tier::Tier) -> Self {
        match t {
            crate::tier::Tier::Memory => Self::Memory,
            crate::tier::Tier::Disk => Self::Disk,
            crate::tier::Tier::Gpu => Self::Gpu,
        }
    }
}

impl From<crate::tier::DataTier> for crate::agent::Tier {
    fn from(t: crate::tier::DataTier) -> Self {
        crate::tier::Tier::from(t).into()
    }
}

impl From<crate::agent::Tier> for crate::tier::Tier {
    fn from(t: crate::agent::Tier) -> Self {
        match t {
            crate::agent::Tier::Memory => Self::Memory,
            crate::agent::Tier::Disk => Self::Disk,
            crate::agent::Tier::Gpu => Self::Gpu,
        }
    }
}

/// `serde(with)` modules for the enum fields of the API's messages (see `build.rs`): the
/// name in JSON; a number this build does not know is written as the number, and a name
/// it does not know is an error that lists the known ones.
pub mod json {
    macro_rules! module {
        ($m:ident, $ty:ident, $what:literal) => {
            #[doc = concat!("`", stringify!($ty), "` fields by name.")]
            pub mod $m {
                use serde::de::Error as _;
                use serde::{Deserialize, Deserializer, Serializer};

                use crate::controller::$ty;

                /// The field's name.
                pub fn serialize<S: Serializer>(v: &i32, s: S) -> Result<S::Ok, S::Error> {
                    match $ty::try_from(*v) {
                        Ok(e) => s.serialize_str(e.label()),
                        Err(_) => s.serialize_i32(*v),
                    }
                }

                /// A name (or the number).
                pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<i32, D::Error> {
                    #[derive(Deserialize)]
                    #[serde(untagged)]
                    enum Raw {
                        Name(String),
                        Number(i32),
                    }
                    match Raw::deserialize(d)? {
                        Raw::Number(n) => $ty::try_from(n).map(|e| e as i32).map_err(|_| {
                            D::Error::custom(format!("{} {n} is not one this build knows", $what))
                        }),
                        Raw::Name(s) => $ty::from_label(&s).map(|e| e as i32).ok_or_else(|| {
                            D::Error::custom(format!(
                                "unknown {} {s:?}: expected one of {}",
                                $what,
                                $ty::LABELS.join(", ")
                            ))
                        }),
                    }
                }

                /// The field's schema in the OpenAPI document: a string, one of the
                /// names (`""`: the caller's default).
                #[cfg(feature = "openapi")]
                pub struct Name;

                #[cfg(feature = "openapi")]
                impl utoipa::PartialSchema for Name {
                    fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
                        use utoipa::openapi::schema::{ObjectBuilder, Type};
                        let mut names = vec![""];
                        names.extend_from_slice($ty::LABELS);
                        ObjectBuilder::new()
                            .schema_type(Type::String)
                            .enum_values(Some(names))
                            .description(Some(concat!(
                                "A ",
                                $what,
                                " by name; \"\" (or absent) is the default."
                            )))
                            .into()
                    }
                }

                #[cfg(feature = "openapi")]
                impl utoipa::ToSchema for Name {
                    fn name() -> std::borrow::Cow<'static, str> {
                        std::borrow::Cow::Borrowed(stringify!($ty))
                    }
                }
            }
        };
    }

    module!(tier, Tier, "tier");
    module!(transport, Transport, "transport");
    module!(plan_state, PlanState, "plan state");
    module!(plan_kind, PlanKind, "plan kind");
    module!(receiver_state, ReceiverState, "receiver state");
    module!(gpu_state, GpuState, "GPU state");
}

#[cfg(test)]
mod tests {
    use crate::controller::{HostProgress, PlanState, PrewarmRequest, ReceiverState, Tier};

    #[test]
    fn json_uses_names_and_refuses_unknown_ones() {
        let req: PrewarmRequest =
            serde_json::from_str(r#"{"model": "m", "replicas": 2, "tier": "gpu"}"#).unwrap();
        assert_eq!(req.tier(), Tier::Gpu);
        let req: PrewarmRequest = serde_json::from_str(r#"{"model": "m", "tier": ""}"#).unwrap();
        assert_eq!(req.tier(), Tier::Unspecified);
        let req: PrewarmRequest = serde_json::from_str(r#"{"model": "m"}"#).unwrap();
        assert_eq!(req.tier(), Tier::Unspecified);
        let e = serde_json::from_str::<PrewarmRequest>(r#"{"tier": "ssd"}"#).unwrap_err();
        assert!(
            e.to_string()
                .contains("unknown tier \"ssd\": expected one of memory, disk, gpu"),
            "{e}"
        );
        let h = HostProgress {
            state: ReceiverState::Receiving as i32,
            gpu_state: crate::controller::GpuState::PartitionLive as i32,
            ..Default::default()
        };
        let v = serde_json::to_value(&h).unwrap();
        assert_eq!(v["state"], "receiving");
        assert_eq!(v["gpu_state"], "partition-live");
        let back: HostProgress = serde_json::from_value(v).unwrap();
        assert_eq!(back, h);
        for s in PlanState::LABELS {
            assert_eq!(PlanState::from_label(s).unwrap().label(), *s);
        }
        let req: PrewarmRequest =
            serde_json::from_str(r#"{"model": "m", "transport": "quic"}"#).unwrap();
        assert_eq!(req.transport().domain(), Some(crate::HopTransport::Quic));
        let req: PrewarmRequest = serde_json::from_str(r#"{"model": "m"}"#).unwrap();
        assert_eq!(
            req.transport().domain(),
            None,
            "unspecified: the controller's default"
        );
        let e = serde_json::from_str::<PrewarmRequest>(r#"{"transport": "udp"}"#).unwrap_err();
        assert!(
            e.to_string()
                .contains("unknown transport \"udp\": expected one of tcp, quic"),
            "{e}"
        );
    }
}
