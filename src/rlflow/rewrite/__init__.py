"""The rewrite floor: rules as data (source pattern -> target pattern), the generator and verifier that make them,
and the matcher/applier that finds and applies them on graphs. Imports only from rlflow.graph."""

from rlflow.rewrite.rule import PatternNode, Rule, instantiate, load_rules, rule_from_json, rules_document

__all__ = ["PatternNode", "Rule", "instantiate", "load_rules", "rule_from_json", "rules_document"]
