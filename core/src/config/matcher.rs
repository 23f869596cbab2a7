//! A `match` as written, validated: pools and hold classes match requests the same way
//! (`pools::matches`), so they are read and compared the same way.

use super::model::{err, ConfigError, Match};
use super::values::{HeaderName, Text};
use super::wire::MatchDto;

/// The `match` of `at` (a pool or a hold class).
pub(super) fn match_from(m: MatchDto, at: &str) -> Result<Match, ConfigError> {
    let mut matcher = Match {
        path_prefix: m.path_prefix.map(|v| v.0),
        authority: m.authority.map(|v| v.0),
        header: None,
    };
    if let Some(h) = m.header {
        let hat = format!("{at}.match.header");
        let Some(HeaderName(name)) = h.name else {
            return Err(err(&format!("{hat}.name"), "is required".into()));
        };
        let Some(Text(value)) = h.value else {
            return Err(err(&format!("{hat}.value"), "is required".into()));
        };
        matcher.header = Some((name, value));
    }
    Ok(matcher)
}

/// Whether every request `b` matches, `a` matches too: each condition of `a` is absent, or
/// implied by `b`'s (a path prefix of `b`'s, the same authority, the same header).
pub(super) fn covers(a: &Match, b: &Match) -> bool {
    let path = match (&a.path_prefix, &b.path_prefix) {
        (None, _) => true,
        (Some(pa), Some(pb)) => pb.starts_with(pa.as_str()),
        (Some(_), None) => false,
    };
    let authority = a.authority.is_none() || a.authority == b.authority;
    let header = a.header.is_none() || a.header == b.header;
    path && authority && header
}
