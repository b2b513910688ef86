//! Communicator unique ids: 128 opaque bytes (like `ncclUniqueId`), handed by rank 0's daemon to
//! the framework, which passes them to every rank.
//!
//! Layout: magic `b"cmUI"`, format version (u32 LE), 16-byte random token, then reserved zeros
//! (later versions carry the root daemon's address for multi-node rendezvous).

use rand::RngCore;
use thiserror::Error;

pub const UNIQUE_ID_BYTES: usize = 128;
const MAGIC: [u8; 4] = *b"cmUI";
const FORMAT: u32 = 1;

#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct UniqueId {
    pub token: [u8; 16],
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
    #[error("unique id format {0} is not supported (this build supports {FORMAT})")]
    Format(u32),
}

impl UniqueId {
    pub fn random() -> Self {
        let mut token = [0u8; 16];
        rand::rng().fill_bytes(&mut token);
        Self { token }
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut b = vec![0u8; UNIQUE_ID_BYTES];
        b[0..4].copy_from_slice(&MAGIC);
        b[4..8].copy_from_slice(&FORMAT.to_le_bytes());
        b[8..24].copy_from_slice(&self.token);
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
        if f != FORMAT {
            return Err(UniqueIdError::Format(f));
        }
        let mut token = [0u8; 16];
        token.copy_from_slice(&b[8..24]);
        Ok(Self { token })
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
        assert_eq!(UniqueId::decode(&u.encode()), Ok(u));
        assert_ne!(UniqueId::random(), u);
        assert_eq!(UniqueId::decode(&[0; 5]), Err(UniqueIdError::Length(5)));
        assert_eq!(UniqueId::decode(&[0; 128]), Err(UniqueIdError::Magic));
        let mut b = u.encode();
        b[4] = 9;
        assert_eq!(UniqueId::decode(&b), Err(UniqueIdError::Format(9)));
    }
}
