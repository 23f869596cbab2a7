//! The limits file: Limitador's YAML, a list of
//! `{namespace, max_value, seconds, conditions, variables, name}` (plus the optional `id`),
//! read with the crate's own `Limit` deserializer, so conditions and variables are parsed as
//! CEL exactly as Limitador parses them.

use std::path::Path;

use limitador::limit::Limit;

/// Parses the text of a limits file.
pub fn parse_limits(text: &str) -> Result<Vec<Limit>, String> {
    if text.trim().is_empty() {
        return Ok(Vec::new());
    }
    serde_yaml::from_str::<Vec<Limit>>(text).map_err(|e| e.to_string())
}

/// Reads and parses a limits file.
pub fn load_limits(path: &Path) -> Result<Vec<Limit>, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    parse_limits(&text).map_err(|e| format!("{}: {e}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    const FILE: &str = r#"
- namespace: llm
  max_value: 1000
  seconds: 60
  name: tokens-per-minute
  conditions:
    - "descriptors[0]['kind'] == 'tokens'"
  variables:
    - "descriptors[0]['account']"
- namespace: llm
  max_value: 10
  seconds: 1
  conditions: []
  variables: []
"#;

    #[test]
    fn parses_limitador_yaml() {
        let limits = parse_limits(FILE).unwrap();
        assert_eq!(limits.len(), 2);
        let named = limits.iter().find(|l| l.name().is_some()).unwrap();
        assert_eq!(named.namespace().as_ref(), "llm");
        assert_eq!(named.max_value(), 1000);
        assert_eq!(named.seconds(), 60);
        assert_eq!(named.name(), Some("tokens-per-minute"));
        assert!(named
            .conditions()
            .contains("descriptors[0]['kind'] == 'tokens'"));
        assert!(named.variables().contains("descriptors[0]['account']"));
        let plain = limits.iter().find(|l| l.name().is_none()).unwrap();
        assert_eq!((plain.max_value(), plain.seconds()), (10, 1));
        assert!(plain.conditions().is_empty());
    }

    #[test]
    fn empty_file_is_no_limits() {
        assert!(parse_limits("").unwrap().is_empty());
        assert!(parse_limits("[]").unwrap().is_empty());
    }

    #[test]
    fn rejects_bad_cel_and_bad_shape() {
        let bad_cel = "- {namespace: a, max_value: 1, seconds: 1, conditions: [\"descriptors[0]. ==\"], variables: []}";
        assert!(parse_limits(bad_cel).is_err());
        assert!(parse_limits("namespace: a").is_err());
        let no_seconds = "- {namespace: a, max_value: 1, conditions: [], variables: []}";
        assert!(parse_limits(no_seconds).is_err());
    }
}
