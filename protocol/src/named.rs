//! Enums with wire names: [`named_enum!`](crate::named_enum) declares one (its variants, the
//! name of each on the wire, in JSON, in stored records and in messages), and
//! [`UnknownName`] is what parsing a name that is none of them returns. Every domain enum
//! that crosses a boundary by name is declared with it, so a name is written once.

/// Declares an enum whose variants have wire names: the enum (`Debug`, `Clone`, `Copy`,
/// `PartialEq`, `Eq`, `Hash`, `PartialOrd`, `Ord`, and serde by name), `ALL`, `as_str`,
/// `Display` (the name) and `FromStr` (exactly the name, else [`UnknownName`]).
///
/// The crate that uses it depends on `serde` (the derives name `::serde`).
///
/// ```
/// shardcast_protocol::named_enum! {
///     /// A colour.
///     Colour {
///         /// Red.
///         Red = "red",
///         /// Light blue.
///         LightBlue = "light-blue",
///     }
/// }
/// assert_eq!(Colour::LightBlue.to_string(), "light-blue");
/// assert_eq!("red".parse::<Colour>(), Ok(Colour::Red));
/// assert!("blue".parse::<Colour>().is_err());
/// ```
///
/// [`UnknownName`]: crate::named::UnknownName
#[macro_export]
macro_rules! named_enum {
    ($(#[$m:meta])* $name:ident { $($(#[$vm:meta])* $v:ident = $s:literal),+ $(,)? }) => {
        $(#[$m])*
        #[derive(
            Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord,
            ::serde::Serialize, ::serde::Deserialize,
        )]
        pub enum $name {
            $($(#[$vm])* #[serde(rename = $s)] $v),+
        }

        impl $name {
            /// Every variant.
            pub const ALL: &'static [Self] = &[$(Self::$v),+];

            /// The name on the wire and in messages.
            pub fn as_str(self) -> &'static str {
                match self {
                    $(Self::$v => $s),+
                }
            }
        }

        impl ::std::fmt::Display for $name {
            fn fmt(&self, f: &mut ::std::fmt::Formatter<'_>) -> ::std::fmt::Result {
                f.write_str(self.as_str())
            }
        }

        impl ::std::str::FromStr for $name {
            type Err = $crate::named::UnknownName;

            fn from_str(s: &str) -> ::std::result::Result<Self, $crate::named::UnknownName> {
                match s {
                    $($s => Ok(Self::$v),)+
                    _ => Err($crate::named::UnknownName {
                        what: stringify!($name),
                        name: s.to_string(),
                        known: [$($s),+].join(", "),
                    }),
                }
            }
        }
    };
}

/// A name that is none of an enum's variants.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown {what} {name:?} (known: {known})")]
pub struct UnknownName {
    /// The enum's type name.
    pub what: &'static str,
    /// The name given.
    pub name: String,
    /// The names it knows, comma-separated.
    pub known: String,
}
