//! Communicator unique ids: 128 opaque bytes (like `ncclUniqueId`), handed by rank 0's daemon to
//! the framework, which passes them to every rank.
//!
//! Layout: magic `b"cmUI"`, format version (u32 LE), 16-byte random token, then (format 2) the
//! root daemon's advertised peer address as a u16 LE length and UTF-8 `host:port`, zero padded.
//! An empty address means the issuing daemon has no peer service: the id is single-node only.
//! Format 1 ids (no address) still decode.

use rand::RngCore;
use thiserror::Error;

pub const UNIQUE_ID_BYTES: usize = 128;
const MAGIC: [u8; 4] = *b"cmUI";
const FORMAT: u32 = 2;
/// Longest root address an id can carry.
pub const MAX_ROOT_ADDR: usize = UNIQUE_ID_BYTES - 26;

#[derive(Clone, PartialEq, Eq, Hash)]
pub struct UniqueId {
    pub token: [u8; 16],
    /// The root daemon's peer address (`host:port`); empty for single-node ids.
    pub root: String,
}

impl std::fmt::Debug for UniqueId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Print a short prefix only: the token is the communicator's credential.
        write!(
            f,
            "UniqueId({:02x}{:02x}{:02x}{:02x}..)",
            self.token[0], self.token[1], self.token[2], self.token[3]
        )
    }
}

#[derive(Debug, Error, PartialEq, Eq)]
pub enum UniqueIdError {
    #[error("unique id must be {UNIQUE_ID_BYTES} bytes, got {0}")]
    Length(usize),
    #[error("not a commd unique id (bad magic)")]
    Magic,
    #[error("unique id format {0} is not supported (this build supports 1..={FORMAT})")]
    Format(u32),
    #[error("unique id carries a malformed root address")]
    Root,
}

impl UniqueId {
    /// A fresh id whose root is `root` (the issuing daemon's advertised peer address, or "").
    /// An address longer than [`MAX_ROOT_ADDR`] is dropped (the id is then single-node).
    pub fn random_with_root(root: &str) -> Self {
        let mut token = [0u8; 16];
        rand::rng().fill_bytes(&mut token);
        let root = if root.len() <= MAX_ROOT_ADDR {
            root.to_string()
        } else {
            String::new()
        };
        Self { token, root }
    }

    pub fn random() -> Self {
        Self::random_with_root("")
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut b = vec![0u8; UNIQUE_ID_BYTES];
        b[0..4].copy_from_slice(&MAGIC);
        b[4..8].copy_from_slice(&FORMAT.to_le_bytes());
        b[8..24].copy_from_slice(&self.token);
        let a = self.root.as_bytes();
        let len = u16::try_from(a.len()).expect(
            "the root address is at most MAX_ROOT_ADDR bytes (random_with_root drops longer)",
        );
        b[24..26].copy_from_slice(&len.to_le_bytes());
        b[26..26 + a.len()].copy_from_slice(a);
        b
    }

    pub fn decode(b: &[u8]) -> Result<Self, UniqueIdError> {
        if b.len() != UNIQUE_ID_BYTES {
            return Err(UniqueIdError::Length(b.len()));
        }
        if b[0..4] != MAGIC {
            return Err(UniqueIdError::Magic);
        }
        let f = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
        if f == 0 || f > FORMAT {
            return Err(UniqueIdError::Format(f));
        }
        let mut token = [0u8; 16];
        token.copy_from_slice(&b[8..24]);
        let root = if f >= 2 {
            let n = u16::from_le_bytes([b[24], b[25]]) as usize;
            if n > MAX_ROOT_ADDR {
                return Err(UniqueIdError::Root);
            }
            String::from_utf8(b[26..26 + n].to_vec()).map_err(|_| UniqueIdError::Root)?
        } else {
            String::new()
        };
        Ok(Self { token, root })
    }

    /// Short printable id for logs and errors (first 8 hex digits of the token).
    pub fn short(&self) -> String {
        self.token[..4].iter().map(|b| format!("{b:02x}")).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_rejects() {
        let u = UniqueId::random();
        assert_eq!(UniqueId::decode(&u.encode()), Ok(u.clone()));
        assert_ne!(UniqueId::random(), u);
        let r = UniqueId::random_with_root("10.1.2.3:7461");
        assert_eq!(
            UniqueId::decode(&r.encode()).map(|x| x.root),
            Ok("10.1.2.3:7461".into())
        );
        let mut bad = r.encode();
        bad[24] = 200;
        assert_eq!(UniqueId::decode(&bad), Err(UniqueIdError::Root));
        // A format-1 id (no address) still decodes, single-node.
        let mut v1 = u.encode();
        v1[4] = 1;
        assert_eq!(UniqueId::decode(&v1).map(|x| x.root), Ok(String::new()));
        assert_eq!(UniqueId::decode(&[0; 5]), Err(UniqueIdError::Length(5)));
        assert_eq!(UniqueId::decode(&[0; 128]), Err(UniqueIdError::Magic));
        let mut b = u.encode();
        b[4] = 9;
        assert_eq!(UniqueId::decode(&b), Err(UniqueIdError::Format(9)));
    }
}
