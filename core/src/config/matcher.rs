//! A `match` as written, validated: pools and hold classes match requests the same way
//! (`pools::matches`), so they are named, read and compared the same way.

use super::model::{err, ConfigError, Match};
use super::values::{HeaderName, StatName, Text};
use super::wire::MatchDto;

/// The name and `match` of the pool or hold class at `at`: a name is required, and not the
/// implicit one's (`implicit`: its name, and the requests it takes, those that match none).
pub(super) fn named(
    name: Option<StatName>,
    m: Option<MatchDto>,
    at: &str,
    (implicit, unmatched): (&str, &str),
) -> Result<(String, Match), ConfigError> {
    let Some(StatName(name)) = name else {
        return Err(err(&format!("{at}.name"), "is required".into()));
    };
    if name == implicit {
        return Err(err(
            &format!("{at}.name"),
            format!("{implicit:?} is reserved for {unmatched}"),
        ));
    }
    let matcher = m.map_or(Ok(Match::default()), |m| match_from(m, at))?;
    Ok((name, matcher))
}

/// The `match` of `at` (a pool or a hold class).
fn match_from(m: MatchDto, at: &str) -> Result<Match, ConfigError> {
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
