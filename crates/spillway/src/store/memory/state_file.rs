//! The in-memory store's state file: every key's count, and the tables set
//! at run time (overrides, tiers, block and allow lists), written so that
//! a restarted process starts where the last one stopped.
//!
//! # The file
//!
//! A 16-byte signature (`\x89spillway state\n`), the format's version as a
//! 32-bit little-endian integer ([`STATE_FORMAT`]), then frames. A frame is
//! its length and the CRC-32 of its bytes (each 32-bit little-endian), then
//! that many bytes: one [`Frame`] in postcard's encoding (postcard 1.x, a
//! documented and stable wire format). The first frame names the rules and
//! what their keys' states mean; then the keys, a frame per few thousand;
//! then the run-time tables; the last frame says how many came before it,
//! so that a file cut short is told from a whole one.
//!
//! Reading checks every frame's length and checksum, and the last frame,
//! before anything is applied: a file that is not a state file, is of
//! another version, or is damaged anywhere changes nothing and is an
//! error that says which.

use std::fs::{self, File, OpenOptions};
use std::io::{self, BufWriter, Write};
use std::net::IpAddr;
use std::num::NonZeroU32;
use std::path::Path;
use std::sync::Arc;

use compact_str::CompactString;
use serde::{Deserialize, Serialize};

use super::MemoryStore;
use crate::algorithm::concurrency::{Lease, LeaseState};
use crate::algorithm::fixed_window::FixedWindowState;
use crate::algorithm::sliding_log::{LogEntry, SlidingLogState};
use crate::algorithm::sliding_window::SlidingWindowState;
use crate::algorithm::token_bucket::TokenBucketState as Tat;
use crate::algorithm::{Algorithm, AnyAlgorithm, AnyState};
use crate::clock::{Clock, Micros};
use crate::store::{ListEntry, Listed, Override, OverrideEntry, Target, TierEntry};

/// The version of the state file's format this build writes and reads.
pub const STATE_FORMAT: u32 = 1;

/// What every state file starts with: a byte no text file starts with,
/// the name, and a line feed (a file passed through a text conversion no
/// longer matches).
const SIGNATURE: &[u8; 16] = b"\x89spillway state\n";

/// How many keys a frame holds at most.
const KEYS_PER_FRAME: usize = 4096;

/// Why a state file could not be written or read.
#[derive(Debug, thiserror::Error)]
pub enum StateFileError {
    /// The file could not be read, written, synced or renamed.
    #[error("{0}")]
    Io(#[from] io::Error),
    /// The file does not start with a state file's signature.
    #[error("not a Spillway state file (it does not start with the state file's signature)")]
    Foreign,
    /// The file is of a format version this build does not read.
    #[error("written in state file format {found}; this Spillway reads format {STATE_FORMAT}")]
    Version {
        /// The version the file says.
        found: u32,
    },
    /// The file is damaged: cut short, a checksum that does not match,
    /// or a frame that does not decode.
    #[error("damaged at byte {offset}: {reason}")]
    Damaged {
        /// Where in the file.
        offset: u64,
        /// What is wrong there.
        reason: String,
    },
}

/// What [`MemoryStore::save_state`] wrote.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Saved {
    /// The keys whose counts it holds (every rule's together).
    pub keys: u64,
    /// The run-time table entries it holds (overrides, tiers, list
    /// entries).
    pub entries: u64,
    /// Its size in bytes.
    pub bytes: u64,
}

/// What [`MemoryStore::restore_state`] read back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Restored {
    /// When the file was written (µs on the store's clock).
    pub written_at: Micros,
    /// The keys whose counts are back.
    pub keys: u64,
    /// The keys of the file that were not taken back: idle by now, or no
    /// room for them (a smaller `max_keys` or `max_memory`).
    pub keys_left: u64,
    /// The rules of the file whose keys were left out, each with how many:
    /// no rule of that name now, or one whose keys' states mean something
    /// else (another algorithm or window).
    pub rules_left: Vec<(String, u64)>,
    /// The run-time table entries back in force (overrides, tiers, list
    /// entries); those whose time passed since are left out.
    pub entries: u64,
    /// The reservations held open again, each given back at its time
    /// unless settled (those past their time are given back at once); a
    /// rule gone, changed or no longer giving back leaves its out.
    pub reservations: u64,
}

/// One frame of the file.
#[derive(Debug, Serialize, Deserialize)]
enum Frame {
    /// The first: when it was written, and the rules whose keys follow.
    Header {
        written_at: Micros,
        rules: Vec<SavedRule>,
    },
    /// Some keys of the header's rule at index `rule`.
    Keys {
        rule: u32,
        keys: Vec<(CompactString, SavedState)>,
    },
    /// Overrides: rule name, key or prefix, and the override.
    Overrides(Vec<SavedOverride>),
    /// API keys' tiers.
    Tiers(Vec<(String, SavedTier)>),
    /// Block and allow list entries.
    Lists(Vec<SavedListing>),
    /// The last: how many frames came before it.
    End { frames: u64 },
    /// The reservations held open, to give back if not settled in time.
    Holds(Vec<SavedHold>),
}

/// A reservation held open ([`Store::reserve`](crate::store::Store::reserve)).
#[derive(Debug, Serialize, Deserialize)]
struct SavedHold {
    rule: String,
    /// What the state it was charged to means.
    meaning: String,
    key: CompactString,
    /// When it is given back unless settled.
    until: Micros,
    cost: u64,
    at: Micros,
    reset_after: Micros,
}

#[derive(Debug, Serialize, Deserialize)]
struct SavedRule {
    name: String,
    /// [`AnyAlgorithm::state_meaning`](crate::algorithm::AnyAlgorithm::state_meaning).
    meaning: String,
}

/// A key's state, as the file holds it.
#[derive(Debug, Serialize, Deserialize)]
enum SavedState {
    FixedWindow {
        window: u64,
        count: u64,
    },
    SlidingWindow {
        window: u64,
        prev: u64,
        curr: u64,
    },
    Bucket {
        micros: Micros,
        frac: u64,
    },
    /// Each entry's time and cost, oldest first.
    SlidingLog(Vec<(Micros, u64)>),
    /// Each lease's name, end and slots; each release remembered (name,
    /// until), oldest first.
    Leases {
        leases: Vec<(Micros, Micros, u64)>,
        released: Vec<(Micros, Micros)>,
    },
}

#[derive(Debug, Serialize, Deserialize)]
struct SavedOverride {
    rule: String,
    prefix: bool,
    target: CompactString,
    limit: u32,
    burst: Option<NonZeroU32>,
    delay: Option<u32>,
    until: Option<Micros>,
    spec: String,
}

#[derive(Debug, Serialize, Deserialize)]
struct SavedTier {
    tier: String,
    until: Option<Micros>,
    spec: String,
}

#[derive(Debug, Serialize, Deserialize)]
enum SavedListed {
    Ip { addr: IpAddr, len: u8 },
    ApiKey(String),
    Key(String),
}

#[derive(Debug, Serialize, Deserialize)]
struct SavedListing {
    listed: SavedListed,
    allow: bool,
    rule: Option<String>,
    status: u16,
    until: Option<Micros>,
    spec: String,
}

impl SavedState {
    /// `state` as the file holds it; `None` for a fresh one (never held).
    fn of(state: &AnyState) -> Option<Self> {
        Some(match state {
            AnyState::Fresh => return None,
            AnyState::FixedWindow(s) => Self::FixedWindow {
                window: s.window,
                count: s.count,
            },
            AnyState::SlidingWindow(s) => Self::SlidingWindow {
                window: s.window,
                prev: s.prev,
                curr: s.curr,
            },
            AnyState::Bucket(t) => Self::Bucket {
                micros: t.micros,
                frac: t.frac,
            },
            AnyState::SlidingLog(s) => {
                Self::SlidingLog(s.entries.iter().map(|e| (e.at, e.cost)).collect())
            }
            AnyState::Leases(s) => Self::Leases {
                leases: s.leases().map(|l| (l.id, l.ends, l.slots)).collect(),
                released: s.released().collect(),
            },
        })
    }

    /// The state it holds: an error for one no store could have written
    /// (a log out of order, sums past 64 bits).
    fn into_state(self) -> Result<AnyState, &'static str> {
        Ok(match self {
            Self::FixedWindow { window, count } => {
                AnyState::FixedWindow(FixedWindowState { window, count })
            }
            Self::SlidingWindow { window, prev, curr } => {
                AnyState::SlidingWindow(SlidingWindowState { window, prev, curr })
            }
            Self::Bucket { micros, frac } => AnyState::Bucket(Tat { micros, frac }),
            Self::SlidingLog(entries) => {
                let ordered = entries.windows(2).all(|w| w[0].0 <= w[1].0);
                let total = entries.iter().try_fold(0u64, |t, e| t.checked_add(e.1));
                if !ordered || total.is_none() {
                    return Err("a sliding log out of order or past 64 bits");
                }
                let entries = entries.into_iter().map(|(at, cost)| LogEntry { at, cost });
                AnyState::SlidingLog(SlidingLogState::from_entries(entries))
            }
            Self::Leases { leases, released } => {
                if leases
                    .iter()
                    .try_fold(0u64, |t, l| t.checked_add(l.2))
                    .is_none()
                {
                    return Err("leases whose slots sum past 64 bits");
                }
                let leases = leases
                    .into_iter()
                    .map(|(id, ends, slots)| Lease { id, ends, slots });
                AnyState::Leases(LeaseState::from_leases(leases).with_released(released))
            }
        })
    }
}

/// The names of the rules whose keys a state file holds, as its header
/// lists them (the signature, version, every frame's checksum and the last
/// frame checked; the keys are not decoded): for a caller that makes its
/// store's rules from what it meets (a rule per limit a client sends) and
/// should have them in place before [`MemoryStore::restore_state`].
pub fn state_file_rules(bytes: &[u8]) -> Result<Vec<String>, StateFileError> {
    let frames = frames(bytes)?;
    let (offset, header) = frames[0];
    match postcard::from_bytes::<Frame>(header) {
        Ok(Frame::Header { rules, .. }) => Ok(rules.into_iter().map(|r| r.name).collect()),
        _ => Err(StateFileError::Damaged {
            offset,
            reason: "it does not start with its header frame".into(),
        }),
    }
}

/// The most a count, a log's total or a lease's slots can be: past any
/// quota's (a limit is at most 2^32, a count at most twice that, in debt),
/// and far from where the algorithms' arithmetic could overflow.
const MAX_COUNT: u64 = 1 << 40;

/// How far past the time a file was written a state may name a time: past
/// any window, lease or bucket of a sane rule.
const MAX_AHEAD: Micros = 10 * 366 * 86_400 * 1_000_000;

/// Whether `state` could have been left under `alg` by a store at
/// `written_at`: a window no later than the next, counts and times within
/// bounds no rule reaches. A crafted file fails it, before the
/// algorithms' arithmetic meets its values.
fn plausible(alg: &AnyAlgorithm, state: &AnyState, written_at: Micros) -> bool {
    let period = alg.quota().period_micros().max(1);
    let window_now = match alg {
        AnyAlgorithm::FixedWindow(fw) => match fw.calendar_of() {
            Some(calendar) => calendar.index(written_at),
            None => written_at / period,
        },
        _ => written_at / period,
    };
    let window_ok = |w: u64| w <= window_now.saturating_add(1);
    let latest = written_at.saturating_add(MAX_AHEAD);
    match state {
        AnyState::Fresh => true,
        AnyState::FixedWindow(s) => window_ok(s.window) && s.count <= MAX_COUNT,
        AnyState::SlidingWindow(s) => {
            window_ok(s.window) && s.prev <= MAX_COUNT && s.curr <= MAX_COUNT
        }
        AnyState::Bucket(t) => t.micros <= latest,
        AnyState::SlidingLog(s) => {
            s.total() <= MAX_COUNT && s.entries.iter().all(|e| e.at <= latest)
        }
        AnyState::Leases(s) => {
            s.held() <= MAX_COUNT
                && s.leases().all(|l| l.ends <= latest && l.id <= latest)
                && s.released()
                    .all(|(id, until)| id <= latest && until <= latest)
        }
    }
}

/// Writes frames, each with its length and checksum.
struct Writer<W> {
    out: W,
    buf: Vec<u8>,
    frames: u64,
    bytes: u64,
}

impl<W: Write> Writer<W> {
    /// A file on `out`: its signature, version and header, written at
    /// `written_at` with the keys of `rules`.
    fn start(mut out: W, written_at: Micros, rules: &[crate::store::Rule]) -> io::Result<Self> {
        out.write_all(SIGNATURE)?;
        out.write_all(&STATE_FORMAT.to_le_bytes())?;
        let mut w = Self {
            out,
            buf: Vec::new(),
            frames: 0,
            bytes: (SIGNATURE.len() + 4) as u64,
        };
        let rules = rules
            .iter()
            .map(|r| SavedRule {
                name: r.name().to_string(),
                meaning: r.algorithm().state_meaning(),
            })
            .collect();
        w.frame(&Frame::Header { written_at, rules })?;
        Ok(w)
    }

    fn frame(&mut self, frame: &Frame) -> io::Result<()> {
        let buf = std::mem::take(&mut self.buf);
        let mut buf = postcard::to_extend(frame, buf).map_err(io::Error::other)?;
        let len = u32::try_from(buf.len())
            .map_err(|_| io::Error::other("a frame past 4 GiB (a sliding log too long to save)"))?;
        self.out.write_all(&len.to_le_bytes())?;
        self.out.write_all(&crc32fast::hash(&buf).to_le_bytes())?;
        self.out.write_all(&buf)?;
        self.frames += 1;
        self.bytes += 8 + u64::from(len);
        buf.clear();
        self.buf = buf;
        Ok(())
    }
}

/// The frames of `bytes` (a whole state file), each with where it starts,
/// their lengths and checksums checked, and the last one's count.
fn frames(bytes: &[u8]) -> Result<Vec<(u64, &[u8])>, StateFileError> {
    if bytes.len() < SIGNATURE.len() || &bytes[..SIGNATURE.len()] != SIGNATURE {
        return Err(StateFileError::Foreign);
    }
    let mut at = SIGNATURE.len();
    let word = |at: usize| -> Option<u32> {
        let b = bytes.get(at..at + 4)?;
        Some(u32::from_le_bytes(b.try_into().ok()?))
    };
    let damaged = |at: usize, reason: &str| StateFileError::Damaged {
        offset: at as u64,
        reason: reason.to_string(),
    };
    let version = word(at).ok_or_else(|| damaged(at, "cut short in its version"))?;
    if version != STATE_FORMAT {
        return Err(StateFileError::Version { found: version });
    }
    at += 4;
    let mut out = Vec::new();
    while at < bytes.len() {
        let (Some(len), Some(crc)) = (word(at), word(at + 4)) else {
            return Err(damaged(at, "cut short in a frame's head"));
        };
        let start = at + 8;
        let payload = usize::try_from(len)
            .ok()
            .and_then(|len| bytes.get(start..start.checked_add(len)?))
            .ok_or_else(|| damaged(at, "cut short: a frame longer than what follows"))?;
        if crc32fast::hash(payload) != crc {
            return Err(damaged(at, "a frame's checksum does not match"));
        }
        out.push((at as u64, payload));
        at = start + payload.len();
    }
    let Some(&(offset, last)) = out.last() else {
        return Err(damaged(at, "cut short: no frame"));
    };
    match postcard::from_bytes::<Frame>(last) {
        Ok(Frame::End { frames }) if frames.checked_add(1) == Some(out.len() as u64) => Ok(out),
        Ok(Frame::End { .. }) => Err(StateFileError::Damaged {
            offset,
            reason: "the last frame's count does not match the frames before it".into(),
        }),
        _ => Err(StateFileError::Damaged {
            offset: bytes.len() as u64,
            reason: "cut short: it does not end with its last frame".into(),
        }),
    }
}

/// Some keys of one rule, as a frame held them: where it starts, the
/// rule's index in the file's header, and each key with its state.
type KeysFrame = (u64, usize, Vec<(CompactString, AnyState)>);

/// A state file, read and checked whole.
struct Contents {
    written_at: Micros,
    rules: Vec<SavedRule>,
    /// The keys of each of the file's rules, by its index in `rules`.
    keys: Vec<KeysFrame>,
    /// Those in force when it was read.
    overrides: Vec<(String, Target, OverrideEntry)>,
    tiers: Vec<(String, TierEntry)>,
    lists: Vec<(Listed, ListEntry)>,
    holds: Vec<SavedHold>,
}

/// Reads a whole state file's `bytes` at `now`: every error there is,
/// before anything is applied.
fn read(bytes: &[u8], now: Micros) -> Result<Contents, StateFileError> {
    let damaged = |offset: u64, reason: String| StateFileError::Damaged { offset, reason };
    let frames = frames(bytes)?;
    let last = frames.last().map_or(0, |f| f.0);
    let mut decoded = frames.into_iter().map(|(offset, payload)| {
        postcard::from_bytes::<Frame>(payload)
            .map(|f| (offset, f))
            .map_err(|e| damaged(offset, format!("a frame does not decode: {e}")))
    });
    let (offset, first) = decoded.next().expect("at least the last frame")?;
    let Frame::Header { written_at, rules } = first else {
        return Err(damaged(
            offset,
            "it does not start with its header frame".into(),
        ));
    };
    let mut file = Contents {
        written_at,
        rules,
        keys: Vec::new(),
        overrides: Vec::new(),
        tiers: Vec::new(),
        lists: Vec::new(),
        holds: Vec::new(),
    };
    for item in decoded {
        let (offset, frame) = item?;
        match frame {
            Frame::Header { .. } => return Err(damaged(offset, "a second header frame".into())),
            Frame::Keys { rule, keys } => {
                let index = usize::try_from(rule).unwrap_or(usize::MAX);
                if index >= file.rules.len() {
                    return Err(damaged(
                        offset,
                        format!("keys of rule {rule}, not in the header"),
                    ));
                }
                let keys = keys
                    .into_iter()
                    .map(|(key, saved)| Ok((key, saved.into_state()?)))
                    .collect::<Result<Vec<_>, &str>>()
                    .map_err(|reason| damaged(offset, reason.to_string()))?;
                file.keys.push((offset, index, keys));
            }
            Frame::Overrides(saved) => {
                for o in saved {
                    let mut applied = Override::limit(o.limit);
                    if let Some(burst) = o.burst {
                        applied = applied.with_burst(burst);
                    }
                    if let Some(delay) = o.delay {
                        applied = applied.with_delay(delay);
                    }
                    if let Some(until) = o.until {
                        applied = applied.until(until);
                    }
                    let target = match o.prefix {
                        true if o.target.is_empty() => {
                            return Err(damaged(offset, "an empty prefix".into()));
                        }
                        true => Target::Prefix(o.target),
                        false => Target::Key(o.target),
                    };
                    if applied.in_force_at(now) {
                        let entry = OverrideEntry {
                            applied,
                            spec: o.spec.into(),
                        };
                        file.overrides.push((o.rule, target, entry));
                    }
                }
            }
            Frame::Tiers(saved) => {
                for (key, t) in saved {
                    let entry = TierEntry {
                        tier: t.tier.into(),
                        until: t.until,
                        spec: t.spec.into(),
                    };
                    if entry.in_force_at(now) {
                        file.tiers.push((key, entry));
                    }
                }
            }
            Frame::Lists(saved) => {
                for l in saved {
                    let listed = match l.listed {
                        SavedListed::Ip { addr, len } => Listed::network(addr, len)
                            .ok_or_else(|| damaged(offset, format!("a network {addr}/{len}")))?,
                        SavedListed::ApiKey(k) => Listed::ApiKey(k.into()),
                        SavedListed::Key(k) => Listed::Key(k.into()),
                    };
                    let entry = ListEntry {
                        allow: l.allow,
                        rule: l.rule.map(Arc::from),
                        status: match l.status {
                            403 | 429 => l.status,
                            other => {
                                return Err(damaged(offset, format!("a block of status {other}")));
                            }
                        },
                        until: l.until,
                        spec: l.spec.into(),
                    };
                    if entry.in_force_at(now) {
                        file.lists.push((listed, entry));
                    }
                }
            }
            Frame::Holds(saved) => file.holds.extend(saved),
            Frame::End { .. } if offset != last => {
                return Err(damaged(offset, "an end frame before the last".into()));
            }
            Frame::End { .. } => {}
        }
    }
    Ok(file)
}

impl<C: Clock> MemoryStore<C> {
    /// Writes the store's state to `out` (see the [format](self)): every
    /// key's count, each rule's keys with what their state means, and the
    /// overrides, tiers and list entries in force. Each shard is read
    /// under its lock, one at a time, while checks go on: a key is saved
    /// as it was when its shard was read.
    ///
    /// ```
    /// use std::num::NonZeroU32;
    /// use spillway::algorithm::FixedWindow;
    /// use spillway::clock::FakeClock;
    /// use spillway::store::{Check, MemoryOptions, MemoryStore, Rule, RuleId};
    /// use spillway::Quota;
    ///
    /// let rules = || vec![Rule::new("api", FixedWindow::new(Quota::per_hour(NonZeroU32::new(10).unwrap())))];
    /// let clock = FakeClock::new(0);
    /// let store = MemoryStore::with_clock(rules(), MemoryOptions::default(), clock.clone());
    /// store.check_now(&[Check { rule: RuleId(0), key: "acme", cost: 4 }]).unwrap();
    /// let mut file = Vec::new();
    /// store.save_state(&mut file).unwrap();
    ///
    /// // Another process, later in the same hour.
    /// clock.advance(std::time::Duration::from_secs(60));
    /// let restarted = MemoryStore::with_clock(rules(), MemoryOptions::default(), clock);
    /// assert_eq!(restarted.restore_state(&file).unwrap().keys, 1);
    /// let peek = restarted.check_now(&[Check { rule: RuleId(0), key: "acme", cost: 0 }]).unwrap();
    /// assert_eq!(peek.decisions[0].remaining, 6);
    /// ```
    pub fn save_state(&self, out: impl Write) -> Result<Saved, StateFileError> {
        let now = self.clock.now();
        let mut w = Writer::start(out, now, &self.rules)?;
        let mut keys = 0u64;
        for (i, (rule, table)) in self.rules.iter().zip(&self.tables).enumerate() {
            let rule_index = u32::try_from(i).map_err(io::Error::other)?;
            for shard in 0..table.shard_count() {
                // Copied under the lock, encoded after it.
                let states = table.lock(shard).live_states(rule.algorithm(), now);
                for chunk in states.chunks(KEYS_PER_FRAME) {
                    let saved: Vec<_> = chunk
                        .iter()
                        .filter_map(|(k, s)| Some((k.clone(), SavedState::of(s)?)))
                        .collect();
                    keys += saved.len() as u64;
                    w.frame(&Frame::Keys {
                        rule: rule_index,
                        keys: saved,
                    })?;
                }
            }
        }
        let mut entries = 0u64;
        let mut overrides = Vec::new();
        for rule in self.overrides.rules() {
            for (target, e) in self.overrides.list(&rule, now) {
                let o = e.applied;
                overrides.push(SavedOverride {
                    rule: rule.clone(),
                    prefix: matches!(target, Target::Prefix(_)),
                    target: CompactString::from(target.text()),
                    limit: o.limit_of(),
                    burst: o.burst(),
                    delay: o.delay(),
                    until: o.ends_at(),
                    spec: e.spec.to_string(),
                });
            }
        }
        entries += overrides.len() as u64;
        w.frame(&Frame::Overrides(overrides))?;
        let tiers: Vec<_> = self
            .tiers
            .list(now)
            .into_iter()
            .map(|(key, e)| {
                let tier = SavedTier {
                    tier: e.tier.to_string(),
                    until: e.until,
                    spec: e.spec.to_string(),
                };
                (key, tier)
            })
            .collect();
        entries += tiers.len() as u64;
        w.frame(&Frame::Tiers(tiers))?;
        let lists: Vec<_> = self
            .lists
            .list(now)
            .into_iter()
            .map(|(listed, e)| SavedListing {
                listed: match listed {
                    Listed::Ip { addr, len } => SavedListed::Ip { addr, len },
                    Listed::ApiKey(k) => SavedListed::ApiKey(k.into()),
                    Listed::Key(k) => SavedListed::Key(k.into()),
                },
                allow: e.allow,
                rule: e.rule.map(|r| r.to_string()),
                status: e.status,
                until: e.until,
                spec: e.spec.to_string(),
            })
            .collect();
        entries += lists.len() as u64;
        w.frame(&Frame::Lists(lists))?;
        let holds: Vec<_> = self
            .holds
            .lock()
            .open_holds()
            .into_iter()
            .map(|((rule, key), meaning, until, charged)| SavedHold {
                rule: rule.to_string(),
                meaning,
                key,
                until,
                cost: charged.cost,
                at: charged.at,
                reset_after: charged.reset_after,
            })
            .collect();
        w.frame(&Frame::Holds(holds))?;
        let frames = w.frames;
        w.frame(&Frame::End { frames })?;
        w.out.flush()?;
        Ok(Saved {
            keys,
            entries,
            bytes: w.bytes,
        })
    }

    /// Reads back a state file's bytes (see the [format](self)), written
    /// by [`save_state`](Self::save_state) of this store or another with
    /// the same rules, typically at the start of a process.
    ///
    /// Each rule's keys go back to the rule of the same name whose keys'
    /// states mean the same (as a configuration reload keeps them); those
    /// of a rule gone or changed are left out and counted in
    /// [`Restored::rules_left`]. A key is taken back as a check that
    /// charges nothing would keep it: not if it is idle by now, and only
    /// as room allows. The overrides, tiers and list entries in force
    /// replace the store's.
    ///
    /// The whole file is checked (signature, version, every frame's length
    /// and checksum, its last frame) before anything changes: an error
    /// leaves the store as it was.
    pub fn restore_state(&self, bytes: &[u8]) -> Result<Restored, StateFileError> {
        let now = self.clock.now();
        let file = read(bytes, now)?;
        // Where each of the file's rules goes in this store, if anywhere.
        let places: Vec<Option<usize>> = file
            .rules
            .iter()
            .map(|saved| {
                self.rules.iter().position(|r| {
                    *r.name() == *saved.name && r.algorithm().state_meaning() == saved.meaning
                })
            })
            .collect();
        // Every state within what its rule could have left by the time
        // the file was written, before anything changes.
        for (offset, from, keys) in &file.keys {
            let Some(to) = places[*from] else {
                continue;
            };
            let rule = &self.rules[to];
            if let Some((key, _)) = keys
                .iter()
                .find(|(_, s)| !plausible(rule.algorithm(), s, file.written_at))
            {
                return Err(StateFileError::Damaged {
                    offset: *offset,
                    reason: format!(
                        "key `{key}` of rule `{}` has a state its rule could not have left",
                        rule.name()
                    ),
                });
            }
        }
        let mut left = vec![0u64; file.rules.len()];
        let mut restored = Restored {
            written_at: file.written_at,
            keys: 0,
            keys_left: 0,
            rules_left: Vec::new(),
            entries: (file.overrides.len() + file.tiers.len() + file.lists.len()) as u64,
            reservations: 0,
        };
        // Counted by what the tables hold after: a key taken back may make
        // room by evicting one taken back before it, and a key written
        // twice is held once.
        let held_before: u64 = self.tables.iter().map(|t| t.len() as u64).sum();
        let mut offered = 0u64;
        for (_, from, keys) in file.keys {
            let Some(to) = places[from] else {
                left[from] += keys.len() as u64;
                continue;
            };
            offered += keys.len() as u64;
            let (table, alg) = (&self.tables[to], self.rules[to].algorithm());
            for (key, state) in keys {
                let hash = table.hash(key.as_str());
                let shard = table.shard_of(hash);
                table
                    .lock(shard)
                    .restore(alg, key.as_str(), hash, state, now);
            }
        }
        let held_after: u64 = self.tables.iter().map(|t| t.len() as u64).sum();
        restored.keys = held_after.saturating_sub(held_before);
        restored.keys_left = offered.saturating_sub(restored.keys);
        self.overrides.replace(file.overrides);
        self.tiers.replace(file.tiers);
        self.lists.replace(file.lists);
        restored.reservations = self.hold_again(file.holds, now);
        restored.rules_left = file
            .rules
            .into_iter()
            .zip(left)
            .filter(|&(_, n)| n > 0)
            .map(|(r, n)| (r.name, n))
            .collect();
        Ok(restored)
    }

    /// Holds `holds` open again (after the keys and overrides are back),
    /// each under its rule's quota for its key now; gives back at once
    /// those past their time. How many are held or given back.
    fn hold_again(&self, holds: Vec<SavedHold>, now: Micros) -> u64 {
        // Settle ids are fingerprinted under a key drawn by each store: one
        // that nobody sends names every reservation held again. A settle
        // of one by its old id finds it gone, and charges its cost as of
        // the charge (as after a give back); the reservation is given back
        // at its time all the same.
        let id = self.holds.fingerprint("\0held again from a state file");
        let mut out = Vec::new();
        let mut book = self.holds.lock();
        let mut held = 0;
        for h in holds {
            let Some(i) = self
                .rules
                .iter()
                .position(|r| *r.name() == *h.rule && r.algorithm().state_meaning() == h.meaning)
            else {
                continue;
            };
            let rule = &self.rules[i];
            if super::releases(rule).is_none() {
                continue;
            }
            let hash = self.tables[i].hash(h.key.as_str());
            let over = self.override_of(i, &h.key, hash, now);
            let algorithm = super::Applied::of(over, rule.algorithm(), h.cost, now).algorithm;
            let charged = crate::algorithm::Charged {
                cost: h.cost,
                at: h.at,
                reset_after: h.reset_after,
                held: true,
            };
            let name = (rule.name_arc(), h.key);
            book.open(
                name,
                id,
                (self.tables[i].clone(), algorithm),
                charged,
                h.until,
                &mut out,
            );
            held += 1;
        }
        book.due(now, &mut out);
        self.release(&out, now);
        drop(book);
        held
    }

    /// Writes the store's state ([`save_state`](Self::save_state)) to
    /// `path`, atomically: to a new file beside it (`.NAME.RANDOM.tmp`,
    /// created afresh, never one that exists or a link, and readable by
    /// its owner only: keys are API keys and addresses), synced to disk,
    /// then renamed over `path`, and the directory synced. A crash at any
    /// point leaves either the old file or the new one, whole.
    pub fn save_state_file(&self, path: &Path) -> Result<Saved, StateFileError> {
        let dir = match path.parent() {
            Some(d) if !d.as_os_str().is_empty() => d,
            _ => Path::new("."),
        };
        let name = path
            .file_name()
            .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "the path names no file"))?;
        // A name nobody can guess ahead and plant a link at; and the file
        // is created, never opened if it exists.
        let random = std::hash::BuildHasher::hash_one(
            &std::collections::hash_map::RandomState::new(),
            (std::process::id(), std::time::SystemTime::now()),
        );
        let mut temp_name = std::ffi::OsString::from(".");
        temp_name.push(name);
        temp_name.push(format!(".{random:016x}.tmp"));
        let temp = dir.join(temp_name);
        let written = (|| {
            let mut options = OpenOptions::new();
            options.write(true).create_new(true);
            #[cfg(unix)]
            std::os::unix::fs::OpenOptionsExt::mode(&mut options, 0o600);
            let file = options.open(&temp)?;
            let mut out = BufWriter::with_capacity(1 << 16, file);
            let saved = self.save_state(&mut out)?;
            let file = out.into_inner().map_err(|e| e.into_error())?;
            file.sync_all()?;
            fs::rename(&temp, path)?;
            #[cfg(unix)]
            File::open(dir)?.sync_all()?;
            Ok(saved)
        })();
        if written.is_err() {
            let _ = fs::remove_file(&temp);
        }
        written
    }

    /// Reads back the state file at `path` ([`restore_state`](Self::restore_state));
    /// `None` when there is no file there yet (a first start). The
    /// temporary files of writes that were killed midway
    /// ([`save_state_file`](Self::save_state_file)) are removed: call it
    /// before this process writes, and with no other process writing there.
    pub fn restore_state_file(&self, path: &Path) -> Result<Option<Restored>, StateFileError> {
        match read_state_file(path)? {
            Some(bytes) => self.restore_state(&bytes).map(Some),
            None => Ok(None),
        }
    }
}

/// The bytes of the state file at `path`, `None` when there is none yet,
/// having removed the temporary files of writes killed midway beside it
/// (see [`MemoryStore::restore_state_file`], which is this and
/// [`MemoryStore::restore_state`]).
pub fn read_state_file(path: &Path) -> Result<Option<Vec<u8>>, StateFileError> {
    remove_temporaries(path);
    match fs::read(path) {
        Ok(bytes) => Ok(Some(bytes)),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e.into()),
    }
}

/// Removes the temporary files that writes of `path` killed midway left
/// beside it (`.NAME.*.tmp`): they hold keys, and would pile up.
fn remove_temporaries(path: &Path) {
    let (Some(dir), Some(name)) = (path.parent(), path.file_name()) else {
        return;
    };
    let dir = if dir.as_os_str().is_empty() {
        Path::new(".")
    } else {
        dir
    };
    let Ok(entries) = fs::read_dir(dir) else {
        return;
    };
    let prefix = format!(".{}.", name.to_string_lossy());
    for entry in entries.flatten() {
        let file = entry.file_name();
        let file = file.to_string_lossy();
        if file.starts_with(&prefix) && file.ends_with(".tmp") {
            let _ = fs::remove_file(entry.path());
        }
    }
}

#[cfg(test)]
mod tests {
    use std::num::NonZeroU32;
    use std::time::Duration;

    use super::*;
    use crate::Quota;
    use crate::algorithm::{Concurrency, FixedWindow, SlidingLog, SlidingWindow};
    use crate::clock::FakeClock;
    use crate::store::{MemoryOptions, Rule, RuleId};

    const NOW: Micros = 1_800_000_000_000_000;

    fn rules() -> Vec<Rule> {
        let quota = Quota::new(NonZeroU32::new(10).unwrap(), Duration::from_secs(60)).unwrap();
        vec![
            Rule::new("window", FixedWindow::new(quota)),
            Rule::new("sliding", SlidingWindow::new(quota)),
            Rule::new("log", SlidingLog::new(quota)),
            Rule::new("leases", Concurrency::new(quota)),
        ]
    }

    fn store() -> MemoryStore<FakeClock> {
        MemoryStore::with_clock(rules(), MemoryOptions::default(), FakeClock::new(NOW))
    }

    /// A whole file of `frames` (a header of the four rules first, an end
    /// last), every checksum right.
    fn file_of(frames: Vec<Frame>) -> Vec<u8> {
        let mut w = Writer::start(Vec::new(), NOW, &rules()).unwrap();
        for f in frames {
            w.frame(&f).unwrap();
        }
        let frames = w.frames;
        w.frame(&Frame::End { frames }).unwrap();
        w.out
    }

    fn key(rule: u32, state: SavedState) -> Frame {
        Frame::Keys {
            rule,
            keys: vec![("k".into(), state)],
        }
    }

    #[test]
    fn crafted_states_with_right_checksums_are_refused_before_anything_changes() {
        let window = NOW / 60_000_000;
        let far = u64::MAX;
        let crafted = [
            key(
                0,
                SavedState::FixedWindow {
                    window: far,
                    count: 1,
                },
            ),
            key(
                0,
                SavedState::FixedWindow {
                    window: window + 1_000,
                    count: 1,
                },
            ),
            key(0, SavedState::FixedWindow { window, count: far }),
            key(
                1,
                SavedState::SlidingWindow {
                    window: far,
                    prev: 0,
                    curr: 1,
                },
            ),
            key(
                1,
                SavedState::SlidingWindow {
                    window,
                    prev: far,
                    curr: 1,
                },
            ),
            key(
                2,
                SavedState::SlidingLog(vec![(NOW, far / 2), (NOW, far / 2 + 1)]),
            ),
            key(2, SavedState::SlidingLog(vec![(NOW, far)])),
            key(2, SavedState::SlidingLog(vec![(far, 1)])),
            key(2, SavedState::SlidingLog(vec![(NOW, 1), (NOW - 1, 1)])),
            key(
                3,
                SavedState::Leases {
                    leases: vec![(NOW, NOW + 1, far)],
                    released: vec![],
                },
            ),
            key(
                3,
                SavedState::Leases {
                    leases: vec![(NOW, far, 1)],
                    released: vec![],
                },
            ),
            key(
                3,
                SavedState::Leases {
                    leases: vec![],
                    released: vec![(NOW, far)],
                },
            ),
            key(
                3,
                SavedState::Leases {
                    leases: vec![(1, far / 2, far / 2), (2, far / 2, far / 2)],
                    released: vec![],
                },
            ),
            key(9, SavedState::FixedWindow { window, count: 1 }),
            Frame::Lists(vec![SavedListing {
                listed: SavedListed::Ip {
                    addr: "192.0.2.0".parse().unwrap(),
                    len: 33,
                },
                allow: false,
                rule: None,
                status: 403,
                until: None,
                spec: String::new(),
            }]),
            Frame::Lists(vec![SavedListing {
                listed: SavedListed::ApiKey("k".into()),
                allow: false,
                rule: None,
                status: 500,
                until: None,
                spec: String::new(),
            }]),
            Frame::End { frames: 1 },
            Frame::Overrides(vec![SavedOverride {
                rule: "window".into(),
                prefix: true,
                target: "".into(),
                limit: 1,
                burst: None,
                delay: None,
                until: None,
                spec: String::new(),
            }]),
        ];
        for frame in crafted {
            let shown = format!("{frame:?}");
            let bytes = file_of(vec![
                key(0, SavedState::FixedWindow { window, count: 3 }),
                frame,
            ]);
            let store = store();
            let e = store.restore_state(&bytes).unwrap_err();
            assert!(matches!(e, StateFileError::Damaged { .. }), "{shown}: {e}");
            assert_eq!(store.len(RuleId(0)), 0, "{shown}: changed before refusing");
            assert!(store.overrides().is_empty());
        }
        // The count of the last frame cannot overflow either.
        let mut bytes = file_of(vec![]);
        let old_end = postcard::to_allocvec(&Frame::End { frames: 1 }).unwrap();
        bytes.truncate(bytes.len() - 8 - old_end.len());
        let end = postcard::to_allocvec(&Frame::End { frames: u64::MAX }).unwrap();
        bytes.extend_from_slice(&(end.len() as u32).to_le_bytes());
        bytes.extend_from_slice(&crc32fast::hash(&end).to_le_bytes());
        bytes.extend_from_slice(&end);
        assert!(matches!(
            store().restore_state(&bytes),
            Err(StateFileError::Damaged { .. })
        ));
    }

    #[test]
    fn the_states_a_store_leaves_are_plausible_and_come_back() {
        let window = NOW / 60_000_000;
        let bytes = file_of(vec![
            key(0, SavedState::FixedWindow { window, count: 20 }),
            key(
                1,
                SavedState::SlidingWindow {
                    window,
                    prev: 10,
                    curr: 20,
                },
            ),
            key(2, SavedState::SlidingLog(vec![(NOW - 1, 1), (NOW, 2)])),
            key(
                3,
                SavedState::Leases {
                    leases: vec![(NOW + 5, NOW + 5, 2)],
                    released: vec![(NOW + 1, NOW + 1_000)],
                },
            ),
        ]);
        let store = store();
        let restored = store.restore_state(&bytes).unwrap();
        assert_eq!((restored.keys, restored.keys_left), (4, 0));
        // A key written twice is held once.
        let twice = file_of(vec![
            key(0, SavedState::FixedWindow { window, count: 2 }),
            key(0, SavedState::FixedWindow { window, count: 3 }),
        ]);
        let store = self::store();
        let restored = store.restore_state(&twice).unwrap();
        assert_eq!((restored.keys, restored.keys_left), (1, 1));
    }
}
