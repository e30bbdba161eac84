"""TASO's pruning of candidate substitutions, on rules in the rule format (:mod:`rlflow.rewrite.rule`).

In order (each step keeps a count, see :func:`prune`):

1. ``trivial``: the source and target are the same graph (the same canonical form: ops, attributes and wiring
   up to the order of the ops and of a commutative op's inputs).
2. ``renaming``: a substitution equal to an earlier one up to renaming its variables (within each class of
   variable: for generated rules, weight or not and rank) is a duplicate; the first one is kept.
3. ``common_subgraph``: an identical op on the same inputs in both graphs (an op of the source whose canonical
   form, computed recursively from the variables, is also an op of the target): the substitution is a smaller
   one applied in a context.
4. ``common_supergraph``: for every mapped output the final ops are equal (op and attribute values) and differ in
   at most one input (compared by value: the same variable, or equal values on the fingerprint data): the
   substitution is a smaller one under a common final op.
5. ``decomposable`` (not in TASO's list; same spirit): a two-output substitution whose outputs share no op on
   either side is two independent one-output substitutions side by side.

Every step compares the inputs of a commutative op (``OpDef.commutative``: Add, Mul) as a multiset: the rewrite
matcher and eqsat's e-matcher bind either operand order, so a rule and its mirror image are one substitution.

After verification, :func:`prune_specialisations` drops a rule another verified rule covers: the other applies
wherever it does with the same result, being more general (variables identified, ``concat(concat(x, y), x)`` when
``concat(concat(x, y), z)`` is there: the matcher may bind two variables to one value; variables constrained to
weights; see the function). :func:`prune_final` prunes the whole rule set, builtin rules included: rules that
only swap operands of commutative ops, a rank-general rule's copies at other ranks, and rules another covers (a builtin rule covers the generated rules that
are itself at one rank).

Canonical forms are strings, so every decision is deterministic (no per-process hash seed).
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Callable, Mapping, Sequence  # not typing's: isinstance is 10x slower
from typing import Any

from rlflow.graph.ops import COMMUTATIVE
from rlflow.rewrite.rule import MIN_GENERAL_RANK, PatternNode, Rule, bound_ranks

STEPS = ("trivial", "renaming", "common_subgraph", "common_supergraph", "decomposable")

#: (source value hashes, target value hashes): reference (``%k.j`` or variable) -> hash on the fingerprint data
Values = tuple[Mapping[str, int], Mapping[str, int]]


def _ref_parts(r: str) -> tuple[int, int] | None:
    if not r.startswith("%"):
        return None
    k, _, j = r[1:].partition(".")
    return int(k), int(j or 0)


def _attr_form(v: Any, ref_form: Callable[[str], str]) -> str:
    if isinstance(v, Mapping):
        (key, arg), = v.items()
        if key == "dim":
            return f"dim({ref_form(arg[0])},{arg[1]})"
        if key in ("kernel", "same_pads", "rank"):
            return f"{key}({ref_form(arg)})"
        return f"{key}(" + ",".join(_attr_form(e, ref_form) for e in arg) + ")"
    if isinstance(v, (list, tuple)):
        return "[" + ",".join(_attr_form(e, ref_form) for e in v) + "]"
    return json.dumps(v)


def side_forms(nodes: Sequence[PatternNode], rename: Mapping[str, str] | None = None) -> list[str]:
    """The canonical form of each node of one side: op, attributes (references inside expressions replaced by
    their forms) and input forms (sorted for commutative ops), recursively down to the variables."""
    rename = rename or {}
    forms: list[str] = []

    def ref_form(r: str) -> str:
        p = _ref_parts(r)
        if p is None:
            return "$" + rename.get(r, r)
        return forms[p[0]] + (f".{p[1]}" if nodes[p[0]].n_outputs > 1 else "")

    for n in nodes:
        ins = [ref_form(r) for r in n.inputs]
        if n.op in COMMUTATIVE:
            ins.sort()
        attrs = ";".join(f"{a}={_attr_form(v, ref_form)}" for a, v in sorted(n.attrs.items()))
        forms.append(f"{n.op}{{{attrs}}}(" + ",".join(ins) + ")")
    return forms


def _output_form(nodes: Sequence[PatternNode], forms: Sequence[str], r: str, rename: Mapping[str, str]) -> str:
    p = _ref_parts(r)
    if p is None:
        return "$" + rename.get(r, r)
    return forms[p[0]] + (f".{p[1]}" if nodes[p[0]].n_outputs > 1 else "")


def pair_form(rule: Rule, rename: Mapping[str, str] | None = None) -> tuple[str, str]:
    """(source form, target form): the mapped outputs, then the sorted op forms of each side. The output pairs
    are listed sorted (by source form, then target form): the order in which a rule lists its mapped outputs
    means nothing, so ``relu(a), relu(b) -> split(relu(concat(a, b)))`` and the same with ``a`` and ``b``
    swapped (and the outputs listed the other way round) are one substitution."""
    rename = rename or {}
    sf, df = side_forms(rule.src, rename), side_forms(rule.dst, rename)
    pairs = sorted((_output_form(rule.src, sf, s, rename), _output_form(rule.dst, df, d, rename))
                   for s, d in rule.outputs)
    s = "|".join(p[0] for p in pairs) + "#" + "&".join(sorted(sf))
    d = "|".join(p[1] for p in pairs) + "#" + "&".join(sorted(df))
    return s, d


def is_trivial(rule: Rule) -> bool:
    s, d = pair_form(rule)
    return s == d


def _default_kind(v: str) -> str:
    """Generated variables are named kind + index (``x0``, ``k1``): rename only within a kind."""
    return v.rstrip("0123456789") or v


def renaming_key(rule: Rule, kind_of: Callable[[str], str] = _default_kind, max_perms: int = 720) -> tuple[str, str]:
    """The smallest pair form over every renaming of the variables within each kind (a canonical key of the
    substitution up to renaming). Beyond ``max_perms`` renamings only the identity is tried.

    Only the renamings that order each kind's variables by :func:`_signatures` are tried (those of variables with
    equal signatures in every order): a signature does not depend on the names, so two rules equal up to renaming
    try the same pair forms and get the same key, and a key is still a pair form of the rule renamed within its
    kinds. Most variables have a signature of their own, so this tries one renaming where all would try n!."""
    by_kind: dict[str, list[str]] = {}
    for v in rule.variables:
        by_kind.setdefault(kind_of(v), []).append(v)
    total = math.prod(math.factorial(len(g)) for g in by_kind.values())
    if total > max_perms:  # (counted before the signatures narrow it, so the same rules fall back as always)
        return pair_form(rule, {v: f"{kind_of(v)}#{v}" for v in rule.variables})
    if total > len(rule.variables):  # else trying every renaming costs no more than the signatures
        sig = _signatures(rule)
        by_kind = {k: sorted(g, key=sig.__getitem__) for k, g in by_kind.items()}
        runs = [(k, [list(r) for _, r in itertools.groupby(g, key=sig.__getitem__)]) for k, g in by_kind.items()]
    else:
        runs = [(k, [g]) for k, g in by_kind.items()]
    blocks = [(k, run) for k, kind_runs in runs for run in kind_runs]
    best = None
    for perms in itertools.product(*(itertools.permutations(run) for _, run in blocks)):
        m, used = {}, dict.fromkeys(by_kind, 0)      # each variable -> a canonical name of its kind
        for (kind, _), p in zip(blocks, perms):
            for v in p:
                m[v] = f"{kind}#{used[kind]}"
                used[kind] += 1
        key = pair_form(rule, m)
        if best is None or key < best:
            best = key
    return best


def _signatures(rule: Rule) -> dict[str, tuple[str, str]]:
    """Each variable's place in the rule, whatever the names: the pair form with it named and every other
    variable anonymous."""
    anon = dict.fromkeys(rule.variables, "?")
    return {v: pair_form(rule, {**anon, v: "!"}) for v in rule.variables}


def has_common_subgraph(rule: Rule) -> bool:
    """Some op of the source is also an op of the target: same op, attributes and (recursively) inputs."""
    return bool(set(side_forms(rule.src)) & set(side_forms(rule.dst)))


def _final_op(nodes: Sequence[PatternNode], r: str) -> PatternNode | None:
    p = _ref_parts(r)
    return None if p is None else nodes[p[0]]


def has_common_supergraph(rule: Rule, values: Values, attr_values: tuple[Sequence[Any], Sequence[Any]]) -> bool:
    """For every mapped output: the producing ops of source and target are the same op with the same attribute
    values and their inputs differ (by value) in at most one position (as multisets for commutative ops).

    ``values``: value hashes of every reference of each side; ``attr_values``: each node's concrete attributes
    (per side, in node order), so expressions are compared by what they evaluate to."""
    sv, dv = values
    for s_ref, d_ref in rule.outputs:
        ps, pd = _final_op(rule.src, s_ref), _final_op(rule.dst, d_ref)
        if ps is None or pd is None or ps.op != pd.op or len(ps.inputs) != len(pd.inputs):
            return False
        ks, kd = _ref_parts(s_ref)[0], _ref_parts(d_ref)[0]
        if attr_values[0][ks] != attr_values[1][kd]:
            return False
        a = [sv[_norm(r)] for r in ps.inputs]
        b = [dv[_norm(r)] for r in pd.inputs]
        if ps.op in COMMUTATIVE:
            rest = list(b)
            for h in a:
                if h in rest:
                    rest.remove(h)
            differ = len(rest)
        else:
            differ = sum(x != y for x, y in zip(a, b))
        if differ > 1:
            return False
    return True


def _norm(r: str) -> str:
    p = _ref_parts(r)
    return r if p is None else f"%{p[0]}.{p[1]}"


def _cone(nodes: Sequence[PatternNode], ref: str) -> set[int]:
    """The ops a value depends on (itself included)."""
    p = _ref_parts(ref)
    if p is None:
        return set()
    out, todo = set(), [p[0]]
    while todo:
        k = todo.pop()
        if k in out:
            continue
        out.add(k)
        todo.extend(q[0] for q in map(_ref_parts, nodes[k].inputs) if q is not None)
    return out


def is_decomposable(rule: Rule) -> bool:
    """A two-output substitution whose outputs share no op on either side: it is two independent one-output
    substitutions side by side (each side computes each output on its own, so each pair of cones is itself a
    valid, smaller substitution)."""
    if len(rule.outputs) < 2:
        return False
    for side, k in ((rule.src, 0), (rule.dst, 1)):
        cones = [_cone(side, pair[k]) for pair in rule.outputs]
        for a, b in itertools.combinations(cones, 2):
            if a & b:
                return False
    return True


def _rename_value(v: Any, m: Mapping[str, str]) -> Any:
    if isinstance(v, Mapping):
        (key, arg), = v.items()
        if key == "dim":
            return {"dim": (m.get(arg[0], arg[0]), arg[1])}
        if key in ("kernel", "same_pads", "rank"):
            return {key: m.get(arg, arg)}
        return {key: tuple(_rename_value(e, m) for e in arg)}
    if isinstance(v, (list, tuple)):
        return tuple(_rename_value(e, m) for e in v)
    return v


def substitute(rule: Rule, m: Mapping[str, str]) -> Rule:
    """``rule`` with variables replaced by ``m`` (several may become one: a specialisation)."""
    def nodes(ns):
        return tuple(PatternNode(n.op, tuple(m.get(r, r) for r in n.inputs),
                                 {a: _rename_value(v, m) for a, v in n.attrs.items()}, n.n_outputs) for n in ns)
    constraints = dict(rule.constraints)
    const = sorted({m.get(v, v) for v in rule.constraints.get("const", ())})
    constraints.pop("const", None)
    if const:
        constraints["const"] = const
    return Rule(rule.id, rule.name, rule.origin, nodes(rule.src), nodes(rule.dst),
                tuple((s, m.get(d, d)) for s, d in rule.outputs), constraints, rule.verified)


def binding_kinds(rule: Rule, const: frozenset[str] | None = None, any_rank: bool | None = None,
                  kind_of: Callable[[str], str] = _default_kind,
                  general: Mapping[str, int] | None = None) -> Callable[[str], str]:
    """What each variable of ``rule`` may bind, as a kind for :func:`renaming_key`: a weight (in ``const``, by
    default ``constraints.const``) or any value, at the rank a generated rule was verified at (``verified.ranks``:
    the matcher binds only those; ``kind_of`` for a rule not verified yet) or at any rank (``any_rank``, by default
    for a builtin rule: written and verified for every rank) or at any rank from k up (``general``: variable -> k;
    by default a generated rule's rank-general variables, ``{"min": k}`` in ``verified.ranks``)."""
    const = rule.const_vars if const is None else const
    any_rank = rule.origin != "generated" if any_rank is None else any_rank
    ranks = rule.verified.get("ranks") or {}
    general = {v: ranks[v]["min"] for v in rule.rank_general_vars} if general is None else general

    def kind(v: str) -> str:
        rank = "*" if any_rank else f"{general[v]}+" if v in general else str(ranks[v]) if v in ranks else kind_of(v)
        return ("const" if v in const else "value") + rank

    return kind


def specialisations(rule: Rule, kind_of: Callable[[str], str] = _default_kind, depth: int = 2) -> set[tuple[str, str]]:
    """Renaming keys (in :func:`binding_kinds`) of the rules made from ``rule`` by identifying two (then, with
    depth 2, three or two pairs of) variables that may bind values of one rank (the one left is a weight if
    either was)."""
    out: set[tuple[str, str]] = set()
    frontier = [rule]
    for _ in range(depth):
        nxt = []
        for r in frontier:
            rank = binding_kinds(r, const=frozenset(), kind_of=kind_of)  # the kinds without the weight constraint
            for u, v in itertools.combinations(r.variables, 2):
                if rank(u) == rank(v):
                    s = substitute(r, {u: v} if v in r.const_vars else {v: u})
                    out.add(renaming_key(s, binding_kinds(s, kind_of=kind_of)))
                    nxt.append(s)
        frontier = nxt
    return out


def prune_specialisations(rules: Sequence[Rule], kind_of: Callable[[str], str] = _default_kind) -> list[int]:
    """Indices (in input order) of the rules no other rule of ``rules`` covers. Rule ``g`` covers rule ``r`` when
    ``g`` matches wherever ``r`` does and rewrites the match the same way, which the matcher guarantees when ``r``
    is ``g`` up to renaming and the operand order of commutative ops (the matcher binds either order) with

    - some variables identified (``concat(concat(x, y), x)`` when ``concat(concat(x, y), z)`` is there: variables
      may bind one value; up to two identifications, see :func:`specialisations`);
    - some variables constrained to weights (``constraints.const``: ``g`` binds weights too);
    - the ``no_broadcast`` constraint (``g`` has it only if ``r`` does);
    - ``g`` a builtin rule (any rank) and ``r`` a generated one (the ranks it was verified at).

    Of rules that cover each other (one substitution twice) the first is kept. ``kind_of`` gives the rank class of
    a variable of a rule not verified yet (no ``verified.ranks``)."""
    own: dict[tuple, int] = {}  # (renaming key, no_broadcast, any rank) -> the first rule with that key
    special: set[tuple] = set()  # the same of the rules' specialisations
    for i, g in enumerate(rules):
        any_rank = g.origin != "generated"
        own.setdefault((renaming_key(g, binding_kinds(g, kind_of=kind_of)), g.no_broadcast, any_rank), i)
        special.update((key, g.no_broadcast, any_rank) for key in specialisations(g, kind_of))
    keep = []
    for i, r in enumerate(rules):
        own_any_rank = r.origin != "generated"
        const = sorted(r.const_vars)
        covered = False
        for n in range(len(const) + 1):
            for freed in itertools.combinations(const, n):
                for any_rank in (True,) if own_any_rank else (False, True):
                    key = renaming_key(r, binding_kinds(r, r.const_vars - set(freed), any_rank, kind_of))
                    for nb in (False, True) if r.no_broadcast else (False,):
                        j = own.get((key, nb, any_rank))
                        # the same key without any relaxation: the same substitution, kept once (the first)
                        same = not freed and any_rank == own_any_rank and nb == r.no_broadcast
                        covered |= (key, nb, any_rank) in special or j is not None and (j < i if same else j != i)
        if not covered:
            keep.append(i)
    return keep


def prune_rank_copies(rules: Sequence[Rule]) -> list[int]:
    """Indices (in input order) of the rules left when each rank-general generated rule (its activations bind any
    rank from 2 up: ``verified.ranks`` records ``{"min": 2}``) replaces its copies at other ranks: a generated rule
    that is a rank-general rule up to renaming, the operand order of commutative ops and its activations' ranks (all
    2 or more; its weights at the same ranks; a ``no_broadcast`` rule is covered by one with or without the
    constraint, a rule without it only by one without). Of two rank-general copies the first is kept."""
    first: dict[tuple, int] = {}
    for i, g in enumerate(rules):
        if g.rank_general_vars:
            first.setdefault((renaming_key(g, binding_kinds(g)), g.no_broadcast), i)
    keep = []
    for i, r in enumerate(rules):
        bound = bound_ranks(r)
        acts = [v for v in r.variables if v not in r.const_vars]
        if r.origin == "generated" and all(v in bound and min(bound[v]) >= MIN_GENERAL_RANK for v in acts):
            key = renaming_key(r, binding_kinds(r, general={v: MIN_GENERAL_RANK for v in acts}))
            by = [first[(key, nb)] for nb in ((False, True) if r.no_broadcast else (False,)) if (key, nb) in first]
            if by and min(by) != i:
                continue
        keep.append(i)
    return keep


def prune_final(rules: Sequence[Rule]) -> tuple[list[int], dict[str, int]]:
    """The pruning of a whole rule set (generated and builtin rules together): the kept indices and the number left
    after each step. ``swap_only`` drops a rule whose source and target are one graph up to the operand order of
    commutative ops (``x + y -> y + x``: the matchers bind either order, so it rewrites nothing); ``rank_general``
    a generated rule that a rank-general rule is at other ranks (:func:`prune_rank_copies`); ``covered`` a
    rule another rule covers (:func:`prune_specialisations`; here: a generated rule that a builtin rule is at
    one rank, or a builtin rule another builtin rule covers)."""
    keep = [i for i, r in enumerate(rules) if not is_trivial(r)]
    counts = {"swap_only": len(keep)}
    keep = [keep[j] for j in prune_rank_copies([rules[i] for i in keep])]
    counts["rank_general"] = len(keep)
    keep = [keep[j] for j in prune_specialisations([rules[i] for i in keep])]
    counts["covered"] = len(keep)
    return keep, counts


def prune(rules: Sequence[Rule], values: Sequence[Values | None] | None = None,
          attr_values: Sequence[tuple[Sequence[Any], Sequence[Any]] | None] | None = None,
          kind_of: Callable[[str], str] = _default_kind,
          progress: Callable[[int], None] | None = None) -> tuple[list[int], dict[str, int]]:
    """Apply the steps of :data:`STEPS` in order. Returns the indices of the kept rules (in input order) and
    the number left after each step (``{"trivial": n1, "renaming": n2, ...}``); the common-supergraph step
    is skipped for rules without ``values``."""
    counts: dict[str, int] = {}
    keep = list(range(len(rules)))
    keep = [i for i in keep if not is_trivial(rules[i])]
    counts["trivial"] = len(keep)
    seen: set[tuple[str, str]] = set()
    out = []
    for n, i in enumerate(keep):
        key = renaming_key(rules[i], kind_of)
        if key not in seen:
            seen.add(key)
            out.append(i)
        if progress and n % 1000 == 999:
            progress(1000)
    keep = out
    counts["renaming"] = len(keep)
    keep = [i for i in keep if not has_common_subgraph(rules[i])]
    counts["common_subgraph"] = len(keep)
    if values is not None and attr_values is not None:
        keep = [i for i in keep if values[i] is None or attr_values[i] is None
                or not has_common_supergraph(rules[i], values[i], attr_values[i])]
    counts["common_supergraph"] = len(keep)
    keep = [i for i in keep if not is_decomposable(rules[i])]
    counts["decomposable"] = len(keep)
    return keep, counts
