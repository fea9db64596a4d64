//! What the TLS record writer's copy costs (issue #28): transferd's `RecordWriter` copies
//! each 16 KiB of plaintext into its output buffer and seals it there (ring has only
//! in-place sealing); aws-lc-rs can seal from the plaintext straight into the output
//! (`seal_out_of_place_scatter`). This seals `--size` bytes of a buffer much larger than
//! the caches (as a source's memory-tier shard is) both ways, AES-128-GCM, into one reused
//! 128 KiB output buffer, and reports the CPU seconds per GB of each, alternating rounds.
//!
//! `seal-cost --size 4GiB --rounds 5`

use std::time::Instant;

const RECORD: usize = 1 << 14;
const TAG: usize = 16;
const OUT: usize = 128 << 10;

fn cpu() -> f64 {
    // SAFETY: getrusage fills the zeroed struct it is given.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: RUSAGE_THREAD with a valid pointer.
    unsafe { libc::getrusage(libc::RUSAGE_THREAD, &mut ru) };
    let t = |tv: libc::timeval| tv.tv_sec as f64 + tv.tv_usec as f64 / 1e6;
    t(ru.ru_utime) + t(ru.ru_stime)
}

fn nonce(seq: u64) -> [u8; 12] {
    let mut n = [7u8; 12];
    for (b, s) in n[4..].iter_mut().zip(seq.to_be_bytes()) {
        *b ^= s;
    }
    n
}

#[derive(clap::Parser)]
struct Args {
    /// Bytes to seal in each pass.
    #[arg(long, default_value = "4GiB", value_parser = quic_impls::parse_size)]
    size: u64,
    /// Rounds of the three ways, alternating.
    #[arg(long, default_value_t = 5)]
    rounds: usize,
}

/// The ways a record is sealed.
#[derive(Clone, Copy)]
enum Way {
    /// Copy the plaintext into the output, then seal it there with ring (transferd before).
    RingCopy,
    /// The same with aws-lc-rs.
    LcCopy,
    /// aws-lc-rs from the plaintext straight into the output.
    LcOutOfPlace,
}

impl Way {
    const ALL: [Way; 3] = [Way::RingCopy, Way::LcCopy, Way::LcOutOfPlace];

    fn label(self) -> &'static str {
        match self {
            Way::RingCopy => "ring: copy, then seal in place",
            Way::LcCopy => "aws-lc: copy, then seal in place",
            Way::LcOutOfPlace => "aws-lc: seal out of place",
        }
    }
}

fn main() {
    let args = <Args as clap::Parser>::parse();
    let rounds = args.rounds;
    let size = usize::try_from(args.size).expect("--size fits in memory");
    // The plaintext: written once, so its pages exist, then read cold by each pass.
    let src: Vec<u8> = (0..size).map(|i| (i * 31 % 251) as u8).collect();
    let key = [9u8; 16];
    let ring_key = ring::aead::LessSafeKey::new(
        ring::aead::UnboundKey::new(&ring::aead::AES_128_GCM, &key).expect("key"),
    );
    let lc_key = aws_lc_rs::aead::LessSafeKey::new(
        aws_lc_rs::aead::UnboundKey::new(&aws_lc_rs::aead::AES_128_GCM, &key).expect("key"),
    );
    let mut out = vec![0u8; OUT + RECORD + 64];
    let gb = size as f64 / 1e9;
    let mut check = 0u64;
    for round in 1..=rounds {
        for way in Way::ALL {
            let (c0, t0) = (cpu(), Instant::now());
            let mut at = 0;
            for (seq, rec) in src.chunks(RECORD).enumerate() {
                if at + rec.len() + 1 + TAG > out.len() {
                    at = 0;
                }
                let header = [0x17, 3, 3, 0, 0];
                let n = rec.len();
                match way {
                    Way::LcOutOfPlace => {
                        let (body, rest) = out[at..].split_at_mut(n);
                        lc_key
                            .seal_out_of_place_scatter(
                                aws_lc_rs::aead::Nonce::assume_unique_for_key(nonce(seq as u64)),
                                aws_lc_rs::aead::Aad::from(header),
                                rec,
                                body,
                                &[0x17],
                                &mut rest[..1 + TAG],
                            )
                            .expect("seal");
                    }
                    Way::RingCopy | Way::LcCopy => {
                        out[at..at + n].copy_from_slice(rec);
                        out[at + n] = 0x17;
                        let buf = &mut out[at..at + n + 1];
                        let tag: [u8; TAG] = if matches!(way, Way::RingCopy) {
                            let t = ring_key
                                .seal_in_place_separate_tag(
                                    ring::aead::Nonce::assume_unique_for_key(nonce(seq as u64)),
                                    ring::aead::Aad::from(header),
                                    buf,
                                )
                                .expect("seal");
                            t.as_ref().try_into().expect("tag")
                        } else {
                            let t = lc_key
                                .seal_in_place_separate_tag(
                                    aws_lc_rs::aead::Nonce::assume_unique_for_key(nonce(
                                        seq as u64,
                                    )),
                                    aws_lc_rs::aead::Aad::from(header),
                                    buf,
                                )
                                .expect("seal");
                            t.as_ref().try_into().expect("tag")
                        };
                        out[at + n + 1..at + n + 1 + TAG].copy_from_slice(&tag);
                    }
                }
                check = check.wrapping_add(u64::from(out[at + n]));
                at += n + 1 + TAG;
            }
            let (secs, c) = (t0.elapsed().as_secs_f64(), cpu() - c0);
            println!(
                "round {round} {:<34} {:.3} GB/s, {:.3} CPU-s/GB",
                way.label(),
                gb / secs,
                c / gb
            );
        }
    }
    eprintln!("(checksum {check})");
}
