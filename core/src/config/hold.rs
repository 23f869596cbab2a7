//! The rules of the `hold` section: its numbers, the fair key, and the classes of held
//! requests (named as stats name them, matched as pools match, each reachable by some request).

use super::defaults;
use super::matcher::{covers, named};
use super::model::{err, ConfigError, Hold, HoldClass};
use super::values::{Bounded, KeySpec};
use super::wire::{HoldClassDto, HoldDto};
use crate::request::STEERING_HEADER;

/// The hold the section asks for, over `hold` (the defaults).
pub(super) fn hold_from(dto: HoldDto, hold: &mut Hold) -> Result<(), ConfigError> {
    if let Some(v) = dto.max_ms {
        hold.max_ms = v.0;
    }
    if let Some(v) = dto.max_held {
        hold.max_held = v.0;
    }
    if let Some(v) = dto.margin_ms {
        hold.margin_ms = v.0;
    }
    if let Some(Bounded(headers)) = dto.deadline_headers {
        hold.deadline_headers = headers.into_iter().map(|h| h.0).collect();
    }
    hold.fair_key = dto.fair_key.map(|KeySpec(k)| k);
    let mut classes = Vec::new();
    for (i, item) in dto
        .classes
        .map_or_else(Vec::new, |b| b.0)
        .into_iter()
        .enumerate()
    {
        let at = format!("hold.classes[{i}]");
        let class = class_from(item, &at)?;
        reachable(&class, &classes, &at)?;
        classes.push(class);
    }
    classes.push(defaults::unmatched_class());
    hold.classes = classes;
    Ok(())
}

fn class_from(dto: HoldClassDto, at: &str) -> Result<HoldClass, ConfigError> {
    let implicit = (defaults::DEFAULT_CLASS, "held requests that match no class");
    let (name, matcher) = named(dto.name, dto.r#match, at, implicit)?;
    if matcher
        .header
        .as_ref()
        .is_some_and(|(n, _)| n == STEERING_HEADER)
    {
        return Err(err(
            &format!("{at}.match.header.name"),
            format!("{STEERING_HEADER} is the filter's own (a client's is removed): it matches no request"),
        ));
    }
    Ok(HoldClass {
        name,
        matcher,
        weight: dto.weight.map_or(defaults::CLASS_WEIGHT, |v| v.0),
        max_ms: dto.max_ms.map(|v| v.0),
        max_held: dto.max_held.map(|v| v.0),
    })
}

/// A class is refused when its name is taken or some request could reach it: an earlier
/// class that matches every request it matches (an empty match, a shorter path prefix, the
/// same authority or header) takes them all first.
fn reachable(class: &HoldClass, before: &[HoldClass], at: &str) -> Result<(), ConfigError> {
    for (j, earlier) in before.iter().enumerate() {
        if earlier.name == class.name {
            return Err(err(
                &format!("{at}.name"),
                format!("duplicate class name {:?}", class.name),
            ));
        }
        if covers(&earlier.matcher, &class.matcher) {
            return Err(err(
                &format!("{at}.match"),
                format!(
                    "matches no request: hold.classes[{j}] ({:?}) comes first and matches every \
                     request this one matches",
                    earlier.name
                ),
            ));
        }
    }
    Ok(())
}
