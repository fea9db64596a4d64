//! Chunks forwarded in verified pieces (protocol version 7; `shardcast_protocol::pieces`).
//!
//! A hop that forwards a chunk only once all of it is here adds one chunk's link time per
//! hop. A sender that knows a chunk's pieces' CVs (it verified the chunk piece by piece,
//! `Shard::piece_cvs`, or it is receiving the chunk in pieces itself) sends a `ChunkHead`
//! with them and then the chunk as `Piece` frames; the receiver checks the CVs against the
//! manifest, then each piece against its CV as it lands, and hands every verified piece to
//! its own forwarder at once ([`PieceRelay`]), so the chunk moves down the chain a piece
//! behind, not a chunk behind. A chunk is stored, counted and answered (`Ack`/`Nack`) once,
//! after its last piece, exactly as a whole chunk is: the send window, the receiving
//! pipeline and recovery see chunks only.
//!
//! - [`Assemblies`]: the receiving end of one upstream connection's chunks in pieces. A
//!   head whose CVs do not merge into the manifest's hash, or a piece that does not match
//!   its CV, makes the chunk refused: its remaining pieces are read and dropped, and the
//!   last one is answered with `Nack` (the sender then re-sends the chunk whole). A piece of
//!   a chunk not announced, out of order, or more chunks in pieces at once than
//!   [`MAX_ASSEMBLIES`] break the protocol and end the connection.
//! - [`PieceRelay`]: one per session, the verified pieces of chunks not yet whole here,
//!   which the forwarder sends on ahead of the chunk.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use shardcast_protocol::pieces::piece_cv;
use shardcast_protocol::{Manifest, PieceCheck, PieceCv, VerifiedPieces, VerifyError};
use tokio::sync::watch;

use super::ChainError;

/// Most chunks one upstream connection may have in pieces at once. Rationale: a sender
/// pieces out at most [`MAX_PIECING`] chunks that are still arriving there, plus the one
/// whose remaining pieces it sends once whole; 8 leaves room and bounds what a peer can
/// make a receiver hold (8 chunks, the pieces charged to the frame budget as they are).
pub(super) const MAX_ASSEMBLIES: usize = 8;

/// Most chunks a forwarder sends in pieces while they are still arriving here.
pub(super) const MAX_PIECING: usize = 2;

/// One chunk arriving in pieces on one connection.
struct Assembly {
    /// `None`: refused (bad CVs or a bad piece); its remaining pieces are dropped.
    check: Option<PieceCheck>,
    pieces: Vec<Bytes>,
    /// Pieces received so far (including refused ones).
    seen: u32,
    /// Pieces the chunk has (from the head).
    total: u32,
}

/// What a `Piece` came to.
#[derive(Debug)]
pub(super) struct PieceStep {
    /// The piece verified: the forwarder may send it on.
    pub(super) verified: bool,
    /// The chunk was refused at this piece (it did not match its CV).
    pub(super) failed: Option<VerifyError>,
    /// It was the chunk's last piece: the whole chunk, verified (`Some`) or refused
    /// (`None`, answered with `Nack`).
    pub(super) last: Option<Option<VerifiedPieces>>,
}

/// The chunks arriving in pieces on one upstream connection. See the module docs. Ends
/// the relay of whatever is still incomplete when dropped (the connection ended).
pub(super) struct Assemblies {
    manifest: Arc<Manifest>,
    relay: Arc<PieceRelay>,
    map: HashMap<u32, Assembly>,
}

impl Assemblies {
    pub(super) fn new(manifest: Arc<Manifest>, relay: Arc<PieceRelay>) -> Self {
        Self {
            manifest,
            relay,
            map: HashMap::new(),
        }
    }

    /// Whether chunk `index` is arriving in pieces (a whole `Chunk` for it then breaks the
    /// protocol).
    pub(super) fn contains(&self, index: u32) -> bool {
        self.map.contains_key(&index)
    }

    /// A `ChunkHead`: `Ok(None)` when its CVs check out (its pieces are relayed as they
    /// verify), `Ok(Some(e))` when they do not (the chunk is refused; `Nack` after its last
    /// piece, or at once with `answer_now` when it announced no pieces).
    pub(super) fn head(
        &mut self,
        shard: u32,
        index: u32,
        cvs: &[PieceCv],
    ) -> Result<Option<(VerifyError, bool)>, ChainError> {
        if self.map.contains_key(&index) {
            return Err(ChainError::protocol(format!(
                "a second ChunkHead for chunk {index} before its last piece"
            )));
        }
        if self.map.len() >= MAX_ASSEMBLIES {
            return Err(ChainError::protocol(format!(
                "more than {MAX_ASSEMBLIES} chunks in pieces at once"
            )));
        }
        let total = cvs.len() as u32;
        match self.manifest.piece_check(shard, index, cvs) {
            Ok(check) => {
                self.relay.begin(index, check.cvs().clone());
                self.map.insert(
                    index,
                    Assembly {
                        check: Some(check),
                        pieces: Vec::with_capacity(cvs.len()),
                        seen: 0,
                        total,
                    },
                );
                Ok(None)
            }
            Err(e) => {
                if total > 0 {
                    self.map.insert(
                        index,
                        Assembly {
                            check: None,
                            pieces: Vec::new(),
                            seen: 0,
                            total,
                        },
                    );
                }
                Ok(Some((e, total == 0)))
            }
        }
    }

    /// A `Piece`, with its CV when the frame reader worked it out as the bytes arrived
    /// (else it is hashed here).
    pub(super) fn piece(
        &mut self,
        index: u32,
        piece: u32,
        data: Bytes,
        cv: Option<PieceCv>,
    ) -> Result<PieceStep, ChainError> {
        let Some(a) = self.map.get_mut(&index) else {
            return Err(ChainError::protocol(format!(
                "piece {piece} of chunk {index}, which no ChunkHead announced"
            )));
        };
        if piece != a.seen {
            return Err(ChainError::protocol(format!(
                "piece {piece} of chunk {index} out of order (expected {})",
                a.seen
            )));
        }
        a.seen += 1;
        let mut step = PieceStep {
            verified: false,
            failed: None,
            last: None,
        };
        if let Some(check) = &a.check {
            let verdict = check.verify_hashed(piece, data.len(), || {
                cv.unwrap_or_else(|| piece_cv(piece, &data))
            });
            match verdict {
                Ok(()) => {
                    self.relay.add(index, piece, data.clone());
                    a.pieces.push(data);
                    step.verified = true;
                }
                Err(e) => {
                    a.check = None;
                    a.pieces.clear();
                    self.relay.end(index);
                    step.failed = Some(e);
                }
            }
        }
        if a.seen == a.total
            && let Some(a) = self.map.remove(&index)
        {
            step.last = Some(match a.check {
                // The relay's entry stays until the chunk is stored: the forwarder may
                // still be sending its pieces.
                Some(check) => match check.assemble(a.pieces) {
                    Ok(chunk) => Some(chunk),
                    Err(e) => {
                        self.relay.end(index);
                        step.failed = Some(e);
                        None
                    }
                },
                None => None,
            });
        }
        Ok(step)
    }
}

impl Drop for Assemblies {
    fn drop(&mut self) {
        for index in self.map.keys() {
            self.relay.end(*index);
        }
    }
}

/// Verified pieces of a chunk not yet whole here.
#[derive(Debug, Clone)]
pub(super) struct Relayed {
    /// The chunk.
    pub(super) index: u32,
    /// Its pieces' CVs (checked against the manifest).
    pub(super) cvs: Arc<[PieceCv]>,
    /// Its first pieces, each verified, in order.
    pub(super) pieces: Vec<Bytes>,
}

/// A session's chunks arriving in pieces, for its forwarder. See the module docs.
#[derive(Debug)]
pub(super) struct PieceRelay {
    chunks: Mutex<BTreeMap<u32, Relayed>>,
    /// Bumped whenever a piece is added: the forwarder waits on it.
    changed: watch::Sender<u64>,
}

impl Default for PieceRelay {
    fn default() -> Self {
        Self {
            chunks: Mutex::default(),
            changed: watch::Sender::new(0),
        }
    }
}

impl PieceRelay {
    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<u32, Relayed>> {
        self.chunks.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Chunk `index` starts arriving in pieces with these CVs.
    fn begin(&self, index: u32, cvs: Arc<[PieceCv]>) {
        let mut chunks = self.lock();
        // Connections of one session are few; a bound all the same (the lowest goes).
        while chunks.len() >= MAX_ASSEMBLIES * 2 {
            chunks.pop_first();
        }
        chunks.insert(
            index,
            Relayed {
                index,
                cvs,
                pieces: Vec::new(),
            },
        );
    }

    /// Piece `piece` of chunk `index` verified (kept only in order).
    fn add(&self, index: u32, piece: u32, data: Bytes) {
        let mut chunks = self.lock();
        if let Some(r) = chunks.get_mut(&index)
            && r.pieces.len() == piece as usize
        {
            r.pieces.push(data);
            drop(chunks);
            self.changed.send_modify(|n| *n += 1);
        }
    }

    /// Chunk `index` is stored (the forwarder reads it from the store now), or refused.
    pub(super) fn end(&self, index: u32) {
        self.lock().remove(&index);
    }

    /// The lowest chunk in pieces that `wanted` accepts and that has more verified pieces
    /// than `sent(index)`.
    pub(super) fn next(
        &self,
        wanted: impl Fn(u32) -> bool,
        sent: impl Fn(u32) -> usize,
    ) -> Option<Relayed> {
        self.lock()
            .values()
            .find(|r| wanted(r.index) && r.pieces.len() > sent(r.index))
            .cloned()
    }

    /// Wakes on every piece added.
    pub(super) fn subscribe(&self) -> watch::Receiver<u64> {
        self.changed.subscribe()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use shardcast_protocol::pieces::{PIECE_SIZE, piece_span};
    use shardcast_protocol::{Hashed, ShardHasher, ShardPath};

    /// A manifest of one shard of three chunks of 1 MiB + 5 bytes (5 pieces each).
    fn fixture() -> (Arc<Manifest>, Vec<Vec<u8>>) {
        let chunk = (1 << 20) + 5;
        let data: Vec<Vec<u8>> = (0..3u8)
            .map(|c| {
                (0..chunk)
                    .map(|i| (i as u32).wrapping_mul(2_654_435_761).to_le_bytes()[2] ^ c)
                    .collect()
            })
            .collect();
        let mut h = ShardHasher::new(chunk as u32);
        for d in &data {
            h.update(d);
        }
        let entry = h.finish(ShardPath::new("w.bin").unwrap());
        let m = Manifest::new("org/m".parse().unwrap(), chunk as u32, vec![entry]).unwrap();
        (Arc::new(m), data)
    }

    fn pieces_of(data: &[u8]) -> Vec<Bytes> {
        (0..shardcast_protocol::pieces::piece_count(data.len()) as u32)
            .map(|p| Bytes::copy_from_slice(&data[piece_span(data.len(), p).unwrap()]))
            .collect()
    }

    #[test]
    fn a_chunk_in_sound_pieces_is_relayed_piece_by_piece_and_verified_whole() {
        let (m, data) = fixture();
        let relay = Arc::new(PieceRelay::default());
        let mut a = Assemblies::new(m.clone(), relay.clone());
        let cvs = Hashed::of(&data[1]).cvs;
        assert_eq!(cvs.len(), 5);
        assert!(a.head(0, 1, &cvs).unwrap().is_none());
        let pieces = pieces_of(&data[1]);
        for (p, piece) in pieces.iter().enumerate() {
            let step = a.piece(1, p as u32, piece.clone(), None).unwrap();
            assert!(step.verified && step.failed.is_none());
            let r = relay.next(|_| true, |_| 0).unwrap();
            assert_eq!((r.index, r.pieces.len()), (1, p + 1));
            if p + 1 < pieces.len() {
                assert!(step.last.is_none());
            } else {
                let chunk = step.last.unwrap().unwrap();
                assert_eq!((chunk.index(), chunk.len()), (1, data[1].len()));
                assert_eq!(chunk.offset(), m.chunk_span(0, 1).unwrap().0);
                let joined: Vec<u8> = chunk.pieces().flat_map(|(_, b)| b.to_vec()).collect();
                assert_eq!(joined, data[1]);
                assert_eq!(
                    chunk.pieces().nth(2).unwrap().0,
                    chunk.offset() + 2 * PIECE_SIZE as u64
                );
            }
        }
        // Stored: the forwarder reads it from the store from here on.
        relay.end(1);
        assert!(relay.next(|_| true, |_| 0).is_none());
    }

    #[test]
    fn the_relay_offers_what_was_not_sent_yet() {
        let (m, data) = fixture();
        let relay = Arc::new(PieceRelay::default());
        let mut a = Assemblies::new(m, relay.clone());
        a.head(0, 1, &Hashed::of(&data[1]).cvs).unwrap();
        for (p, piece) in pieces_of(&data[1]).into_iter().enumerate() {
            a.piece(1, p as u32, piece, None).unwrap();
            assert_eq!(relay.next(|_| true, |_| 0).unwrap().pieces.len(), p + 1);
            assert!(relay.next(|_| true, |_| p + 1).is_none());
            assert!(relay.next(|i| i != 1, |_| 0).is_none());
        }
    }

    #[test]
    fn a_bad_piece_refuses_the_chunk_and_its_last_piece_is_answered() {
        let (m, data) = fixture();
        let relay = Arc::new(PieceRelay::default());
        let mut a = Assemblies::new(m, relay.clone());
        a.head(0, 0, &Hashed::of(&data[0]).cvs).unwrap();
        let mut pieces = pieces_of(&data[0]);
        let mut bad = pieces[2].to_vec();
        bad[100] ^= 1;
        pieces[2] = bad.into();
        assert!(a.piece(0, 0, pieces[0].clone(), None).unwrap().verified);
        assert!(a.piece(0, 1, pieces[1].clone(), None).unwrap().verified);
        let step = a.piece(0, 2, pieces[2].clone(), None).unwrap();
        assert!(!step.verified);
        assert!(matches!(
            step.failed,
            Some(VerifyError::Piece { piece: 2, .. })
        ));
        // Nothing of it is relayed any more.
        assert!(relay.next(|_| true, |_| 0).is_none());
        // The rest is read and dropped; the last one answers (Nack).
        let step = a.piece(0, 3, pieces[3].clone(), None).unwrap();
        assert!(!step.verified && step.failed.is_none() && step.last.is_none());
        let step = a.piece(0, 4, pieces[4].clone(), None).unwrap();
        assert!(matches!(step.last, Some(None)));
        // A CV the reader worked out that does not match is as bad as bytes that do not.
        a.head(0, 0, &Hashed::of(&data[0]).cvs).unwrap();
        let step = a.piece(0, 0, pieces[0].clone(), Some([7; 32])).unwrap();
        assert!(step.failed.is_some());
    }

    #[test]
    fn cvs_that_do_not_merge_into_the_manifests_hash_refuse_the_chunk() {
        let (m, data) = fixture();
        let relay = Arc::new(PieceRelay::default());
        let mut a = Assemblies::new(m, relay.clone());
        // Chunk 1's CVs announced as chunk 0's.
        let (e, now) = a.head(0, 0, &Hashed::of(&data[1]).cvs).unwrap().unwrap();
        assert!(matches!(e, VerifyError::Hash { index: 0, .. }));
        assert!(!now);
        assert!(relay.next(|_| true, |_| 0).is_none());
        // Its pieces (even sound bytes) are dropped, and the last is answered.
        for (p, piece) in pieces_of(&data[0]).into_iter().enumerate() {
            let step = a.piece(0, p as u32, piece, None).unwrap();
            assert!(!step.verified);
            assert_eq!(step.last.is_some(), p == 4);
        }
        // The wrong number of CVs, or none at all (answered at once).
        assert!(
            a.head(0, 2, &Hashed::of(&data[2]).cvs[..4])
                .unwrap()
                .is_some()
        );
        let (_, now) = a.head(0, 1, &[]).unwrap().unwrap();
        assert!(now);
        assert!(!a.contains(1));
    }

    #[test]
    fn pieces_out_of_protocol_end_the_connection() {
        let (m, data) = fixture();
        let relay = Arc::new(PieceRelay::default());
        let mut a = Assemblies::new(m, relay.clone());
        let pieces = pieces_of(&data[0]);
        // Not announced.
        assert!(a.piece(0, 0, pieces[0].clone(), None).is_err());
        a.head(0, 0, &Hashed::of(&data[0]).cvs).unwrap();
        // Announced twice.
        assert!(a.head(0, 0, &Hashed::of(&data[0]).cvs).is_err());
        // Out of order.
        assert!(a.piece(0, 1, pieces[1].clone(), None).is_err());
        // Too many at once.
        let mut many = Assemblies::new(a.manifest.clone(), relay.clone());
        for i in 0..MAX_ASSEMBLIES as u32 {
            // Refused heads count too (their pieces are still to come).
            many.head(0, 100 + i, &[[0; 32]; 2]).unwrap();
        }
        assert!(many.head(0, 1, &Hashed::of(&data[1]).cvs).is_err());
        // The connection's end ends the relay of its incomplete chunks.
        assert!(relay.next(|_| true, |_| 0).is_none());
        a.piece(0, 0, pieces[0].clone(), None).unwrap();
        assert!(relay.next(|_| true, |_| 0).is_some());
        drop(a);
        assert!(relay.next(|_| true, |_| 0).is_none());
    }
}
