//! Layered configuration, shared by `transferd` and `shardcast-controller`: built-in
//! defaults < a TOML file < environment variables < command-line flags, merged key by key
//! while remembering where each value came from ([`Origin`]), then read into the daemon's
//! settings struct with serde.
//!
//! * Defaults are the settings struct's own `Default`, serialized ([`Layers::defaults`]).
//! * The file is a flat TOML table whose keys are the struct's fields ([`Layers::file`]).
//! * Environment variables and flags arrive as text ([`Layers::command_line`] reads them
//!   from clap, which knows each argument's variable name and whether a value came from the
//!   command line or the environment). Text is read as a value of the field's type: `"16"`
//!   for an integer, `"true"`, `"1"`, `"yes"` or `"on"` for a boolean; durations and sizes
//!   go through [`crate::units`]' serde modules, which take both a number and text with a
//!   unit (`"10s"`, `"4GiB"`).
//!
//! [`Layers::extract`] refuses an unknown key and a value its field cannot take, naming the
//! key and its origin (`window (from environment variable SHARDCAST_WINDOW): ...`), so a
//! daemon stops before it opens a port. [`Layers::render`] writes the effective settings as
//! TOML with each value's origin beside it (`--print-config`).
//!
//! No I/O here: the caller reads the file and passes its text.

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};

use serde::Serialize;
use serde::de::{self, DeserializeOwned, DeserializeSeed, IntoDeserializer, MapAccess, Visitor};
pub use toml::Value;

/// Where a setting's value came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Origin {
    /// The built-in default.
    Default,
    /// The TOML file at this path.
    File(PathBuf),
    /// This environment variable.
    Env(String),
    /// This command-line flag (`--window`).
    Flag(String),
}

impl Origin {
    /// The layer's rank: defaults 0, the file 1, the environment and flags 2 (one layer, as
    /// clap merges them: a flag wins over its variable).
    pub fn rank(&self) -> u8 {
        match self {
            Self::Default => 0,
            Self::File(_) => 1,
            Self::Env(_) | Self::Flag(_) => 2,
        }
    }
}

impl fmt::Display for Origin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Default => f.write_str("default"),
            Self::File(p) => write!(f, "file {}", p.display()),
            Self::Env(v) => write!(f, "environment variable {v}"),
            Self::Flag(flag) => write!(f, "flag {flag}"),
        }
    }
}

/// A configuration that cannot be read: the message names the key and its origin.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError(String);

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for ConfigError {}

impl de::Error for ConfigError {
    fn custom<T: fmt::Display>(msg: T) -> Self {
        Self(msg.to_string())
    }
}

fn toml_error(e: toml::de::Error) -> ConfigError {
    ConfigError(e.message().trim().to_string())
}

/// The merged layers: each key's value from the highest layer that sets it, and its origin.
#[derive(Debug, Clone, Default)]
pub struct Layers {
    values: BTreeMap<String, (Value, Origin)>,
}

impl Layers {
    /// No layers yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// The defaults: every field `defaults` serializes (an `Option` left `None` is no value).
    pub fn defaults<T: Serialize>(&mut self, defaults: &T) -> Result<(), ConfigError> {
        let table = toml::Table::try_from(defaults)
            .map_err(|e| ConfigError(format!("serializing the defaults: {e}")))?;
        for (k, v) in table {
            self.set(&k, v, Origin::Default);
        }
        Ok(())
    }

    /// The TOML file at `path`, whose text is `text`, over what is set so far.
    pub fn file(&mut self, path: &Path, text: &str) -> Result<(), ConfigError> {
        let table: toml::Table = toml::from_str(text).map_err(|e| {
            ConfigError(format!(
                "parsing config file {}: {}",
                path.display(),
                e.to_string().trim_end()
            ))
        })?;
        for (k, v) in table {
            self.set(&k, v, Origin::File(path.to_path_buf()));
        }
        Ok(())
    }

    /// Sets `key` over what is set so far.
    pub fn set(&mut self, key: &str, value: Value, origin: Origin) {
        self.values.insert(key.to_string(), (value, origin));
    }

    /// Where `key`'s value came from (`None`: no layer sets it).
    pub fn origin(&self, key: &str) -> Option<&Origin> {
        self.values.get(key).map(|(_, o)| o)
    }

    /// `key`'s merged value, as its layer gave it (text from the environment and flags).
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.values.get(key).map(|(v, _)| v)
    }

    /// Reads the merged values into `T`, a struct whose fields are the keys. An unknown key
    /// or a value its field cannot take is refused with the key and its origin.
    pub fn extract<T: DeserializeOwned>(&self) -> Result<T, ConfigError> {
        T::deserialize(Root(self))
    }

    /// `effective` (what [`Layers::extract`] gave, after any normalisation) as TOML, one key
    /// a line, each followed by its origin; `T`'s fields that no layer sets are listed as
    /// comments.
    pub fn render<T: Serialize + DeserializeOwned>(
        &self,
        effective: &T,
    ) -> Result<String, ConfigError> {
        let table = toml::Table::try_from(effective)
            .map_err(|e| ConfigError(format!("serializing the settings: {e}")))?;
        let mut out = String::new();
        for field in field_names::<T>() {
            match table.get(*field) {
                Some(v) => {
                    let origin = self
                        .origin(field)
                        .map_or_else(|| Origin::Default.to_string(), ToString::to_string);
                    out.push_str(&format!("{field} = {v}  # {origin}\n"));
                }
                None => out.push_str(&format!("# {field}: not set\n")),
            }
        }
        Ok(out)
    }

    /// The origin of every key `message` names that a file, a variable or a flag set, for a
    /// validation error raised after [`Layers::extract`] (`egress_rate: invalid rate`):
    /// `" [egress_rate from environment variable SHARDCAST_EGRESS_RATE]"`, or nothing.
    pub fn explain(&self, message: &str) -> String {
        let named = |key: &str| {
            message.match_indices(key).any(|(i, _)| {
                let before = message[..i].chars().next_back();
                let after = message[i + key.len()..].chars().next();
                let word = |c: Option<char>| c.is_some_and(|c| c.is_alphanumeric() || c == '_');
                !word(before) && !word(after)
            })
        };
        let notes: Vec<String> = self
            .values
            .iter()
            .filter(|(k, (_, o))| *o != Origin::Default && named(k))
            .map(|(k, (_, o))| format!("{k} from {o}"))
            .collect();
        if notes.is_empty() {
            String::new()
        } else {
            format!(" [{}]", notes.join("; "))
        }
    }
}

/// `--print-config`, the flag both daemons take (each flattens it into its command line,
/// after its own `--config`): print the effective settings, each value with its origin
/// ([`Layers::render`]), and exit without opening a port. Not a setting:
/// [`Layers::from_command_line`] leaves it out.
#[cfg(feature = "clap")]
#[derive(Debug, Default, Clone, clap::Args)]
pub struct PrintConfig {
    /// Print the effective configuration, each value with where it came from (default, the
    /// file, an environment variable or a flag), and exit without opening any port.
    #[arg(long)]
    pub print_config: bool,
}

#[cfg(feature = "clap")]
impl PrintConfig {
    /// The argument's id in clap's matches.
    const ID: &str = "print_config";

    /// Whether the command line (`matches`) asks for `--print-config`.
    pub fn requested(matches: &clap::ArgMatches) -> bool {
        matches.get_flag(Self::ID)
    }
}

#[cfg(feature = "clap")]
impl Layers {
    /// The layers a daemon's command line asks for: `defaults` < the TOML file its
    /// `config` argument names (read by `read`: this crate does no I/O) < environment
    /// variables < flags. The `config` and `print_config` ([`PrintConfig`]) arguments are not
    /// settings.
    pub fn from_command_line<T: Serialize>(
        defaults: &T,
        command: &clap::Command,
        matches: &clap::ArgMatches,
        read: impl FnOnce(&Path) -> std::io::Result<String>,
    ) -> Result<Self, ConfigError> {
        let mut layers = Self::new();
        layers.defaults(defaults)?;
        if let Some(path) = matches.get_one::<std::path::PathBuf>("config") {
            let text = read(path)
                .map_err(|e| ConfigError(format!("reading config file {}: {e}", path.display())))?;
            layers.file(path, &text)?;
        }
        layers.command_line(command, matches, &["config", PrintConfig::ID]);
        Ok(layers)
    }

    /// The environment variables and flags clap read (each argument's `env = ...` and
    /// `--long`), over what is set so far. Arguments named in `skip` (the config file's own
    /// path, `--print-config`) and values clap filled from its own defaults are left out;
    /// an argument that collects values (`ArgAction::Append`) gives an array.
    pub fn command_line(
        &mut self,
        command: &clap::Command,
        matches: &clap::ArgMatches,
        skip: &[&str],
    ) {
        use clap::parser::ValueSource;
        for arg in command.get_arguments() {
            let id = arg.get_id().as_str();
            if skip.contains(&id) {
                continue;
            }
            let origin = match matches.value_source(id) {
                Some(ValueSource::CommandLine) => {
                    Origin::Flag(format!("--{}", arg.get_long().unwrap_or(id)))
                }
                Some(ValueSource::EnvVariable) => Origin::Env(
                    arg.get_env()
                        .map(|e| e.to_string_lossy().into_owned())
                        .unwrap_or_default(),
                ),
                _ => continue,
            };
            let Some(raw) = matches.get_raw(id) else {
                continue;
            };
            let values: Vec<String> = raw.map(|v| v.to_string_lossy().into_owned()).collect();
            let value = if matches!(arg.get_action(), clap::ArgAction::Append) {
                Value::Array(values.into_iter().map(Value::String).collect())
            } else {
                match values.into_iter().next_back() {
                    Some(v) => Value::String(v),
                    None => continue,
                }
            };
            self.set(id, value, origin);
        }
    }
}

/// The field names of the struct `T` (empty for anything else).
fn field_names<T: DeserializeOwned>() -> &'static [&'static str] {
    struct Probe<'a>(&'a mut &'static [&'static str]);
    impl<'de> de::Deserializer<'de> for Probe<'_> {
        type Error = ConfigError;
        fn deserialize_any<V: Visitor<'de>>(self, _: V) -> Result<V::Value, ConfigError> {
            Err(ConfigError("not a struct".into()))
        }
        fn deserialize_struct<V: Visitor<'de>>(
            self,
            _: &'static str,
            fields: &'static [&'static str],
            _: V,
        ) -> Result<V::Value, ConfigError> {
            *self.0 = fields;
            Err(ConfigError("probed".into()))
        }
        serde::forward_to_deserialize_any! {
            bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string bytes
            byte_buf option unit unit_struct newtype_struct seq tuple tuple_struct map enum
            identifier ignored_any
        }
    }
    let mut fields: &'static [&'static str] = &[];
    let _ = T::deserialize(Probe(&mut fields));
    fields
}

/// The closest known field to an unknown key, if one is close.
fn suggestion(key: &str, fields: &[&str]) -> String {
    fields
        .iter()
        .map(|f| (strsim::levenshtein(key, f), f))
        .filter(|(d, f)| *d <= (key.len() / 5).max(2) || (key.len() >= 4 && f.starts_with(key)))
        .min()
        .map(|(_, f)| format!("; did you mean `{f}`?"))
        .unwrap_or_default()
}

/// The merged table as a deserializer of the settings struct.
struct Root<'a>(&'a Layers);

impl<'de> de::Deserializer<'de> for Root<'_> {
    type Error = ConfigError;

    fn deserialize_any<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, ConfigError> {
        visitor.visit_map(Entries {
            iter: self.0.values.iter(),
            current: None,
        })
    }

    fn deserialize_struct<V: Visitor<'de>>(
        self,
        _name: &'static str,
        fields: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, ConfigError> {
        for (key, (_, origin)) in &self.0.values {
            if !fields.contains(&key.as_str()) {
                return Err(ConfigError(format!(
                    "unknown field `{key}` (from {origin}){}",
                    suggestion(key, fields)
                )));
            }
        }
        self.deserialize_any(visitor)
    }

    serde::forward_to_deserialize_any! {
        bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string bytes byte_buf
        option unit unit_struct newtype_struct seq tuple tuple_struct map enum identifier
        ignored_any
    }
}

type Entry<'a> = (&'a String, &'a (Value, Origin));

struct Entries<'a> {
    iter: std::collections::btree_map::Iter<'a, String, (Value, Origin)>,
    current: Option<Entry<'a>>,
}

impl<'de> MapAccess<'de> for Entries<'_> {
    type Error = ConfigError;

    fn next_key_seed<K: DeserializeSeed<'de>>(
        &mut self,
        seed: K,
    ) -> Result<Option<K::Value>, ConfigError> {
        match self.iter.next() {
            None => Ok(None),
            Some(entry) => {
                self.current = Some(entry);
                seed.deserialize(entry.0.as_str().into_deserializer())
                    .map(Some)
            }
        }
    }

    fn next_value_seed<V: DeserializeSeed<'de>>(
        &mut self,
        seed: V,
    ) -> Result<V::Value, ConfigError> {
        let (key, (value, origin)) = self
            .current
            .take()
            .ok_or_else(|| ConfigError("a value asked for before its key".into()))?;
        let shown = match value {
            Value::String(s) => format!(" = {s:?}"),
            Value::Integer(_) | Value::Float(_) | Value::Boolean(_) => format!(" = {value}"),
            _ => String::new(),
        };
        seed.deserialize(Lenient(value))
            .map_err(|e| ConfigError(format!("{key}{shown} (from {origin}): {e}")))
    }
}

/// One value, read leniently: text where the field wants a number or a boolean is parsed
/// (environment variables and flags are text).
struct Lenient<'a>(&'a Value);

fn parse_bool(s: &str) -> Result<bool, ConfigError> {
    match s.trim().to_ascii_lowercase().as_str() {
        "true" | "1" | "yes" | "on" => Ok(true),
        "false" | "0" | "no" | "off" => Ok(false),
        _ => Err(ConfigError(format!("expected true or false, got {s:?}"))),
    }
}

macro_rules! lenient_int {
    ($($method:ident)*) => {$(
        fn $method<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, ConfigError> {
            match self.0 {
                Value::String(s) => {
                    let t = s.trim();
                    if let Ok(n) = t.parse::<i64>() {
                        visitor.visit_i64(n)
                    } else if let Ok(n) = t.parse::<u64>() {
                        visitor.visit_u64(n)
                    } else {
                        Err(ConfigError(format!("expected a whole number, got {s:?}")))
                    }
                }
                v => v.clone().$method(visitor).map_err(toml_error),
            }
        }
    )*};
}

macro_rules! forward {
    ($($method:ident)*) => {$(
        fn $method<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, ConfigError> {
            self.0.clone().$method(visitor).map_err(toml_error)
        }
    )*};
}

impl<'de> de::Deserializer<'de> for Lenient<'_> {
    type Error = ConfigError;

    lenient_int! { deserialize_i8 deserialize_i16 deserialize_i32 deserialize_i64
    deserialize_u8 deserialize_u16 deserialize_u32 deserialize_u64 }

    forward! { deserialize_any deserialize_char deserialize_str deserialize_string
    deserialize_bytes deserialize_byte_buf deserialize_unit deserialize_seq deserialize_map
    deserialize_identifier deserialize_ignored_any deserialize_i128 deserialize_u128 }

    fn deserialize_bool<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, ConfigError> {
        match self.0 {
            Value::String(s) => visitor.visit_bool(parse_bool(s)?),
            v => v.clone().deserialize_bool(visitor).map_err(toml_error),
        }
    }

    fn deserialize_f32<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, ConfigError> {
        self.deserialize_f64(visitor)
    }

    fn deserialize_f64<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, ConfigError> {
        match self.0 {
            Value::String(s) => match s.trim().parse::<f64>() {
                Ok(f) if f.is_finite() => visitor.visit_f64(f),
                _ => Err(ConfigError(format!("expected a number, got {s:?}"))),
            },
            v => v.clone().deserialize_f64(visitor).map_err(toml_error),
        }
    }

    fn deserialize_option<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, ConfigError> {
        visitor.visit_some(self)
    }

    fn deserialize_newtype_struct<V: Visitor<'de>>(
        self,
        _name: &'static str,
        visitor: V,
    ) -> Result<V::Value, ConfigError> {
        visitor.visit_newtype_struct(self)
    }

    fn deserialize_unit_struct<V: Visitor<'de>>(
        self,
        name: &'static str,
        visitor: V,
    ) -> Result<V::Value, ConfigError> {
        self.0
            .clone()
            .deserialize_unit_struct(name, visitor)
            .map_err(toml_error)
    }

    fn deserialize_tuple<V: Visitor<'de>>(
        self,
        len: usize,
        visitor: V,
    ) -> Result<V::Value, ConfigError> {
        self.0
            .clone()
            .deserialize_tuple(len, visitor)
            .map_err(toml_error)
    }

    fn deserialize_tuple_struct<V: Visitor<'de>>(
        self,
        name: &'static str,
        len: usize,
        visitor: V,
    ) -> Result<V::Value, ConfigError> {
        self.0
            .clone()
            .deserialize_tuple_struct(name, len, visitor)
            .map_err(toml_error)
    }

    fn deserialize_struct<V: Visitor<'de>>(
        self,
        name: &'static str,
        fields: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, ConfigError> {
        self.0
            .clone()
            .deserialize_struct(name, fields, visitor)
            .map_err(toml_error)
    }

    fn deserialize_enum<V: Visitor<'de>>(
        self,
        name: &'static str,
        variants: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, ConfigError> {
        self.0
            .clone()
            .deserialize_enum(name, variants, visitor)
            .map_err(toml_error)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::units;
    use serde::Deserialize;

    #[derive(Debug, Serialize, Deserialize, PartialEq)]
    #[serde(deny_unknown_fields)]
    struct Settings {
        window: usize,
        quic: bool,
        share: f64,
        #[serde(with = "units::millis")]
        grace_ms: u64,
        #[serde(with = "units::seconds")]
        idle_s: u64,
        #[serde(with = "units::size")]
        frame_memory: u64,
        #[serde(
            default,
            with = "units::opt_size",
            skip_serializing_if = "Option::is_none"
        )]
        capacity: Option<u64>,
        #[serde(skip_serializing_if = "Option::is_none")]
        zone: Option<String>,
        allow: Vec<String>,
    }

    impl Default for Settings {
        fn default() -> Self {
            Self {
                window: 16,
                quic: true,
                share: 0.8,
                grace_ms: 2000,
                idle_s: 30,
                frame_memory: 512 << 20,
                capacity: None,
                zone: None,
                allow: Vec::new(),
            }
        }
    }

    fn layers(file: &str) -> Result<Layers, ConfigError> {
        let mut l = Layers::new();
        l.defaults(&Settings::default())?;
        l.file(Path::new("/etc/t.toml"), file)?;
        Ok(l)
    }

    fn env(l: &mut Layers, key: &str, var: &str, text: &str) {
        l.set(key, Value::String(text.into()), Origin::Env(var.into()));
    }

    #[test]
    fn each_layer_overrides_the_one_below_and_keeps_its_origin() {
        let mut l = layers("window = 8\nzone = \"a\"\ngrace_ms = \"3s\"\n").unwrap();
        env(&mut l, "window", "SHARDCAST_WINDOW", "4");
        l.set(
            "zone",
            Value::String("b".into()),
            Origin::Flag("--zone".into()),
        );
        env(&mut l, "idle_s", "SHARDCAST_IDLE_S", "2m");
        env(&mut l, "capacity", "SHARDCAST_CAPACITY", "4GiB");
        env(&mut l, "quic", "SHARDCAST_QUIC", "off");
        env(&mut l, "share", "SHARDCAST_SHARE", "0.5");
        let s: Settings = l.extract().unwrap();
        assert_eq!(
            s,
            Settings {
                window: 4,
                quic: false,
                share: 0.5,
                grace_ms: 3000,
                idle_s: 120,
                capacity: Some(4 << 30),
                zone: Some("b".into()),
                ..Settings::default()
            }
        );
        assert_eq!(
            l.origin("window"),
            Some(&Origin::Env("SHARDCAST_WINDOW".into()))
        );
        assert_eq!(
            l.origin("grace_ms"),
            Some(&Origin::File("/etc/t.toml".into()))
        );
        assert_eq!(l.origin("frame_memory"), Some(&Origin::Default));

        let text = l.render(&s).unwrap();
        assert!(
            text.contains("window = 4  # environment variable SHARDCAST_WINDOW\n"),
            "{text}"
        );
        assert!(
            text.contains("grace_ms = 3000  # file /etc/t.toml\n"),
            "{text}"
        );
        assert!(text.contains("zone = \"b\"  # flag --zone\n"), "{text}");
        assert!(
            text.contains("frame_memory = \"512MiB\"  # default\n"),
            "{text}"
        );
        assert!(text.contains("capacity = \"4GiB\""), "{text}");
        // What --print-config writes reads back as a config file, to the same settings.
        let mut again = Layers::new();
        again.defaults(&Settings::default()).unwrap();
        again.file(Path::new("/tmp/printed.toml"), &text).unwrap();
        assert_eq!(again.extract::<Settings>().unwrap(), s);
        // A field no layer sets is listed as such.
        let s2: Settings = layers("").unwrap().extract().unwrap();
        assert!(
            layers("")
                .unwrap()
                .render(&s2)
                .unwrap()
                .contains("# zone: not set\n")
        );
    }

    #[test]
    fn unknown_and_ill_typed_keys_are_refused_by_name_and_origin() {
        let err = layers("windw = 8\n")
            .unwrap()
            .extract::<Settings>()
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("unknown field `windw` (from file /etc/t.toml); did you mean `window`?"),
            "{err}"
        );
        let err = layers("[gpu]\nx = 1\n")
            .unwrap()
            .extract::<Settings>()
            .unwrap_err()
            .to_string();
        assert!(err.contains("unknown field `gpu`"), "{err}");

        let err = layers("window = \"many\"\n")
            .unwrap()
            .extract::<Settings>()
            .unwrap_err()
            .to_string();
        assert!(
            err.starts_with("window = \"many\" (from file /etc/t.toml): "),
            "{err}"
        );
        let err = layers("zone = 3\n")
            .unwrap()
            .extract::<Settings>()
            .unwrap_err()
            .to_string();
        assert!(
            err.starts_with("zone = 3 (from file /etc/t.toml): "),
            "{err}"
        );

        for (key, var, text, says) in [
            (
                "window",
                "SHARDCAST_WINDOW",
                "abc",
                "expected a whole number",
            ),
            ("window", "SHARDCAST_WINDOW", "-1", "invalid value"),
            ("quic", "SHARDCAST_QUIC", "maybe", "expected true or false"),
            ("share", "SHARDCAST_SHARE", "lots", "expected a number"),
            ("grace_ms", "SHARDCAST_GRACE_MS", "soon", "invalid duration"),
            (
                "idle_s",
                "SHARDCAST_IDLE_S",
                "1500ms",
                "not a whole number of seconds",
            ),
            (
                "frame_memory",
                "SHARDCAST_FRAME_MEMORY",
                "big",
                "invalid size",
            ),
        ] {
            let mut l = layers("").unwrap();
            env(&mut l, key, var, text);
            let err = l.extract::<Settings>().unwrap_err().to_string();
            let head = format!("{key} = {text:?} (from environment variable {var}): ");
            assert!(err.starts_with(&head), "{err}");
            assert!(err.contains(says), "{err}");
        }
        let mut l = layers("").unwrap();
        l.set(
            "color",
            Value::String("red".into()),
            Origin::Flag("--color".into()),
        );
        let err = l.extract::<Settings>().unwrap_err().to_string();
        assert!(
            err.contains("unknown field `color` (from flag --color)"),
            "{err}"
        );

        let err = layers("window = \n").unwrap_err().to_string();
        assert!(
            err.starts_with("parsing config file /etc/t.toml: "),
            "{err}"
        );
    }

    #[test]
    fn explain_names_the_origins_of_the_keys_a_message_names() {
        let mut l = layers("window = 8\n").unwrap();
        env(&mut l, "zone", "SHARDCAST_ZONE", "x");
        assert_eq!(
            l.explain("window must be between 1 and 4096"),
            " [window from file /etc/t.toml]"
        );
        assert_eq!(
            l.explain("zone and window disagree"),
            " [window from file /etc/t.toml; zone from environment variable SHARDCAST_ZONE]"
        );
        // Defaults and mere substrings are not explained.
        assert_eq!(l.explain("quic is off; windows"), "");
    }

    #[test]
    fn a_close_or_prefixed_field_is_suggested() {
        let fields = ["window", "stall_timeout_ms", "zone"];
        // Up to two edits (more for long keys: a fifth of the key's length).
        assert_eq!(suggestion("windw", &fields), "; did you mean `window`?");
        assert_eq!(suggestion("wnidow", &fields), "; did you mean `window`?");
        assert_eq!(
            suggestion("stall_timeout_s", &fields),
            "; did you mean `stall_timeout_ms`?"
        );
        // A key of four or more characters that begins a field.
        assert_eq!(
            suggestion("stall", &fields),
            "; did you mean `stall_timeout_ms`?"
        );
        // The nearest wins; nothing near, no suggestion.
        assert_eq!(suggestion("zona", &fields), "; did you mean `zone`?");
        assert_eq!(suggestion("bandwidth", &fields), "");
    }
}
