"""The rewrite floor: rules as data (source pattern -> target pattern), the generator and verifier that make them,
and the matcher/applier that finds and applies them on graphs. Imports only from rlflow.graph.

    rules = load_rules("results/rules/rules.json")
    matches = find_matches(graph, rules[0])          # deterministic order
    new_graph = apply(graph, matches[0])             # graph itself is unchanged
    index = MatchIndex(graph, rules)                 # all rules; index.apply(k, j) updates incrementally
"""

from rlflow.rewrite.matcher import Match, MatchIndex, apply, find_matches
from rlflow.rewrite.rule import PatternNode, Rule, instantiate, load_rules, rule_from_json, rules_document

__all__ = ["Match", "MatchIndex", "PatternNode", "Rule", "apply", "find_matches", "instantiate", "load_rules",
           "rule_from_json", "rules_document"]
