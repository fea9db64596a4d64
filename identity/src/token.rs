//! Bearer tokens for HTTP clients that cannot present a certificate (curl in a FaaS hook,
//! a dashboard). The tokens file holds one line per token, `<role> <name> <blake3-hex>`:
//! only the BLAKE3 hash of each token is stored, so the file is not a secret (keep it
//! 0600 anyway), and a leaked file does not leak tokens. `#` starts a comment.
//! `shardcast certs token` creates a token and prints the line to add.
//!
//! [`generate`] makes 256 random bits with the `shc_` prefix.

use std::collections::HashMap;
use std::path::Path;

use crate::role::{Identity, IdentityError, Role};

/// Bytes of randomness in a generated token (256 bits).
const TOKEN_BYTES: usize = 32;
/// Prefix of generated tokens, so a leaked one is recognisable in logs and scanners.
pub const TOKEN_PREFIX: &str = "shc_";

/// Tokens by hash.
#[derive(Debug, Default, Clone)]
pub struct Tokens {
    by_hash: HashMap<[u8; 32], Identity>,
}

impl Tokens {
    /// Parses a tokens file.
    pub fn load(path: &Path) -> Result<Self, IdentityError> {
        let text = std::fs::read_to_string(path).map_err(|e| IdentityError::Io {
            path: path.display().to_string(),
            source: e,
        })?;
        Self::parse(&text).map_err(|reason| IdentityError::Pem {
            path: path.display().to_string(),
            reason,
        })
    }

    /// Parses the file's text.
    pub fn parse(text: &str) -> Result<Self, String> {
        let mut by_hash = HashMap::new();
        for (n, line) in text.lines().enumerate() {
            let line = line.split('#').next().unwrap_or("").trim();
            if line.is_empty() {
                continue;
            }
            let fields: Vec<&str> = line.split_whitespace().collect();
            let [role, name, hash] = fields[..] else {
                return Err(format!(
                    "line {}: expected `<role> <name> <blake3-hex>`",
                    n + 1
                ));
            };
            let role: Role = role.parse().map_err(|e| format!("line {}: {e}", n + 1))?;
            if matches!(role, Role::Host | Role::Controller) {
                return Err(format!(
                    "line {}: tokens are for HTTP clients (admin, platform, read); a {role} authenticates with its certificate",
                    n + 1
                ));
            }
            let id = Identity::new(role, name).map_err(|e| format!("line {}: {e}", n + 1))?;
            let mut h = [0u8; 32];
            hex::decode_to_slice(hash, &mut h).map_err(|e| format!("line {}: hash: {e}", n + 1))?;
            by_hash.insert(h, id);
        }
        Ok(Self { by_hash })
    }

    /// The identity a presented token stands for.
    pub fn lookup(&self, token: &str) -> Option<&Identity> {
        // The map is keyed by hash: timing reveals nothing about the token's bytes.
        self.by_hash.get(blake3::hash(token.as_bytes()).as_bytes())
    }

    /// How many tokens are configured.
    pub fn len(&self) -> usize {
        self.by_hash.len()
    }

    /// Whether none are.
    pub fn is_empty(&self) -> bool {
        self.by_hash.is_empty()
    }
}

/// A new random token for `id`, and the tokens-file line that admits it.
pub fn generate(id: &Identity) -> (String, String) {
    use rand::RngCore;
    let mut bytes = [0u8; TOKEN_BYTES];
    rand::rng().fill_bytes(&mut bytes);
    let token = format!("{TOKEN_PREFIX}{}", hex::encode(bytes));
    let line = format!(
        "{} {} {}",
        id.role,
        id.name,
        blake3::hash(token.as_bytes()).to_hex()
    );
    (token, line)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generate_and_look_up() {
        let id = Identity::new(Role::Platform, "knative").unwrap();
        let (token, line) = generate(&id);
        let tokens = Tokens::parse(&format!("# platform\n{line}\n")).unwrap();
        assert_eq!(tokens.lookup(&token), Some(&id));
        assert_eq!(tokens.lookup("shc_wrong"), None);
        assert!(Tokens::parse("platform knative nothex").is_err());
        assert!(Tokens::parse("root x 00").is_err());
        let host = format!("host h1 {}", "00".repeat(32));
        assert!(Tokens::parse(&host).unwrap_err().contains("certificate"));
    }
}
