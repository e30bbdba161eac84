"""Numeric verification of a rule: both sides run with the ops' torch reference semantics in float64 on random
data, at several different shapes.

:func:`verify` instantiates the source pattern (:func:`rlflow.rewrite.rule.instantiate`) at a shape binding,
then the target; where the source fits:

- the target failing shape inference, or giving an output of another type, is a *rejected* binding (the
  matcher refuses such a match, so the rule is never applied there): it neither passes nor fails;
- otherwise both run on the same random float64 data (twice) and every mapped output must agree to a relative
  tolerance of 1e-9 (1e-6 where the target makes a float32 constant float32 cannot hold exactly, such as a
  1/9 pooling kernel); one disagreement fails the rule.

Shapes: the explicit examples, if given (builtin rules bring theirs; each must fit and agree), else the rule's
recorded shapes, else the generator's symbolic shapes for its variable names; from those *bases* new bindings
are drawn with every dimension at most ``max_dim`` and each variable at its base rank: the distinct sizes of a
base are mapped to random sizes (so equal sizes stay equal), and in every other draw each dimension is also
redrawn on its own with probability 0.3 (so sizes that only happened to be equal are pulled apart, and size-1
broadcasting is tried). The record lists the bindings, so the variables' ranks are part of what was verified
(``ranks``); with ``rank_draws=True`` every third draw also gives some variables one dimension more or less,
for rules meant to hold at any rank (``x@w0 + x@w1 -> x@(w0 + w1)`` does not: with a 1-D ``w0`` the two sides
broadcast differently).
A rule passes with ``trials`` distinct passing bindings (examples included) and no failing one.

A generated rule was found on one set of symbolic shapes; this is what checks it at others. A rule that only
held because sizes coincided there fails (average pooling commutes with a convolution only for 1x1 kernels, and
with an Add only when it does not broadcast: the generator finds both, the verifier drops them); a binding
where the target's shape expressions give other types is rejected, exactly as the matcher rejects that match.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Mapping, Sequence  # not typing's: isinstance is 10x slower
from typing import Any

import numpy as np

from rlflow.errors import RLFlowError
from rlflow.graph.ir import Graph, TensorType
from rlflow.graph.ops import OPS
from rlflow.rewrite.rule import MIN_GENERAL_RANK, VARIABLE_KINDS, Rule, instantiate

METHOD = "random-float64"
#: a verification record's max_rel_diff below this is float64 rounding, written 0.0: its value (about 1e-16 where
#: the two sides round differently) changes with the CPU's vector kernels from one machine or process to the next,
#: and the shipped rule set must be byte for byte what any machine generates
ROUNDING_FLOOR = 1e-12
RTOL = 1e-9

Example = Mapping[str, Any]     # {"vars": {name: shape}, "params": {name: value}}


# ================================================================================================ running
def run_float64(graph: Graph, feeds: Mapping[str, np.ndarray]) -> list[np.ndarray]:
    """Run ``graph`` with the ops' torch reference semantics in float64 (inputs and float constants cast)."""
    import torch

    env: dict[str, Any] = {}
    for k, c in graph.constants.items():
        a = np.array(c.array)
        env[k] = torch.from_numpy(a.astype(np.float64) if a.dtype.kind == "f" else a)
    for k, v in feeds.items():
        env[k] = torch.from_numpy(np.asarray(v, dtype=np.float64))
    with torch.inference_mode():
        for n in graph.nodes:
            outs = OPS[n.op].compute([env[v] for v in n.inputs if v], n.attrs)
            for v, o in zip(n.outputs, outs):
                env[v] = o
    return [env[v].numpy() for v in graph.outputs]


def _positive_vars(rule: Rule) -> set[str]:
    """Variables that random data must keep positive (the ops' ``positive_inputs``: a BatchNormalization's
    variance, a Sqrt's input, a divisor, a Pow's base)."""
    pos = set()
    for n in rule.src:
        for i in OPS[n.op].positive_inputs if n.op in OPS else ():
            if i < len(n.inputs) and not n.inputs[i].startswith("%"):
                pos.add(n.inputs[i])
    return pos


def rel_diff(a: Sequence[np.ndarray], b: Sequence[np.ndarray]) -> float:
    """The largest difference between corresponding outputs relative to their scale (inf if shapes differ,
    NaN only where both are NaN)."""
    worst = 0.0
    for x, y in zip(a, b):
        if x.shape != y.shape:
            return math.inf
        nan_x, nan_y = np.isnan(x), np.isnan(y)
        if (nan_x != nan_y).any():
            return math.inf
        x, y = np.where(nan_x, 0.0, x), np.where(nan_y, 0.0, y)
        if x.size == 0:
            continue
        scale = max(1.0, float(np.max(np.abs(x))), float(np.max(np.abs(y))))
        worst = max(worst, float(np.max(np.abs(x - y))) / scale)
    return worst


def check_binding(rule: Rule, shapes: Mapping[str, Sequence[int]], params: Mapping[str, Any],
                  rng: np.random.Generator, rounds: int = 2) -> str | float:
    """Run both sides at one binding: ``"no-match"`` (the source does not fit), ``"rejected"`` (the target
    does not fit or changes an output type), else the worst relative difference over ``rounds`` random draws."""
    types = {v: TensorType(tuple(int(d) for d in s)) for v, s in shapes.items()}
    try:
        src = instantiate(rule, "src", types, params)
    except (RLFlowError, KeyError, IndexError, TypeError, ValueError):
        return "no-match"
    try:
        dst = instantiate(rule, "dst", types, params)
    except (RLFlowError, KeyError, IndexError, TypeError, ValueError):
        return "rejected"
    if [src.types[v] for v in src.outputs] != [dst.types[v] for v in dst.outputs]:
        return "rejected"
    pos = _positive_vars(rule)
    worst = 0.0
    for _ in range(rounds):
        feeds = {}
        for v in rule.variables:
            a = rng.standard_normal(types[v].shape)
            feeds[v] = np.abs(a) + 0.5 if v in pos else a
        worst = max(worst, rel_diff(run_float64(src, feeds), run_float64(dst, feeds)))
    return worst


# ================================================================================================ shapes
def _remap(base: Mapping[str, Sequence[int]], rng: np.random.Generator, max_dim: int,
           perturb: float, ranks: bool = False, ones: float = 0.0) -> dict[str, tuple[int, ...]]:
    """A binding drawn from ``base``: its distinct sizes mapped to random sizes in 1..max_dim; each dimension
    redrawn on its own with probability ``perturb``, or set to 1 with probability ``ones`` (broadcasting: the
    matcher binds any shapes for which the target's types come out equal); with ``ranks``, each variable's rank
    also changed by one with probability 1/3 (a leading dimension added or dropped)."""
    sizes = sorted({int(d) for s in base.values() for d in s})
    new = {d: int(rng.integers(1, max_dim + 1)) for d in sizes}
    out = {}
    for v, s in base.items():
        dims = tuple(1 if ones and rng.random() < ones else
                     int(rng.integers(1, max_dim + 1)) if perturb and rng.random() < perturb else new[int(d)]
                     for d in s)
        if ranks:
            u = rng.random()
            if u < 1 / 6:
                dims = (int(rng.integers(1, max_dim + 1)),) + dims
            elif u < 1 / 3 and dims:
                dims = dims[1:]
        out[v] = dims
    return out


def _split_equal_sizes(base: Mapping[str, Sequence[int]], rng: np.random.Generator, max_dim: int):
    """Bindings from ``base`` in which one or two of the positions (variable, axis) that share a size get
    another size (1, and one other random size)."""
    groups: dict[int, list[tuple[str, int]]] = {}
    for v, s in base.items():
        for i, d in enumerate(s):
            groups.setdefault(int(d), []).append((v, i))
    for size, pos in groups.items():
        if len(pos) < 2:
            continue
        subsets = [(p,) for p in pos] + [(p, q) for a, p in enumerate(pos) for q in pos[a + 1:]]
        others = [1] + [int(x) for x in rng.choice([d for d in range(2, max(3, max_dim + 1)) if d != size] or [size],
                                                   size=1)]
        for subset in subsets:
            for new in others:
                if new == size:
                    continue
                shapes = {v: list(int(d) for d in s) for v, s in base.items()}
                for v, i in subset:
                    shapes[v][i] = new
                yield {v: tuple(s) for v, s in shapes.items()}


def _one_axis_broadcasts(base: Mapping[str, Sequence[int]], rng: np.random.Generator, max_dim: int):
    """Bindings from ``base`` with one dimension of one variable set to 1: the single-axis broadcasts a matcher
    may bind wherever the target's types still come out equal. Taken from the base's own sizes (which fit the
    patterns, e.g. odd kernels for "same" padding) and from a random mapping of them to sizes >= 2."""
    sizes = {int(d): int(rng.integers(2, max(2, max_dim) + 1)) for s in base.values() for d in s}
    for plain in ({v: tuple(int(d) for d in s) for v, s in base.items()},
                  {v: tuple(sizes[int(d)] for d in s) for v, s in base.items()}):
        for v, s in plain.items():
            for i in range(len(s)):
                yield {**plain, v: s[:i] + (1,) + s[i + 1:]}


def _guess_ranks(rule: Rule) -> dict[str, int]:
    """Ranks of the variables from how the source uses them (a fallback when no shapes are known)."""
    ranks: dict[str, int] = {}
    for _ in range(3):
        for n in rule.src:
            usual = OPS[n.op].input_ranks(n.attrs) if n.op in OPS else ()
            for i, r in enumerate(n.inputs):
                if r.startswith("%"):
                    continue
                want = usual[i] if i < len(usual) else None
                if want is None:
                    others = [ranks[o] for o in n.inputs if not o.startswith("%") and o in ranks and o != r]
                    want = others[0] if others else None
                if want is not None:
                    ranks.setdefault(r, want)
    return {v: ranks.get(v, 2) for v in rule.variables}


def default_bases(rule: Rule) -> list[dict]:
    """Bases to draw bindings from when the caller gives no examples: the shapes recorded in the rule's
    ``verified`` field, else the generator's symbolic shapes (variables named like ``x0``, ``k1``), else a
    guess (every dimension 3, ranks from the ops that read each variable)."""
    rec = rule.verified or {}
    for key in ("examples", "shapes"):
        got = rec.get(key)
        if isinstance(got, list) and got:
            out = []
            for e in got:
                if isinstance(e, Mapping) and "vars" in e:
                    out.append({"vars": dict(e["vars"]), "params": dict(e.get("params", {}))})
                elif isinstance(e, Mapping):
                    out.append({"vars": dict(e), "params": {}})
            if out and all(set(rule.variables) <= set(e["vars"]) for e in out):
                return out
    if all(v.rstrip("0123456789") in VARIABLE_KINDS and v[1:].isdigit() for v in rule.variables):
        return [{"vars": {v: list(VARIABLE_KINDS[v[0]][0]) for v in rule.variables}, "params": {}}]
    ranks = _guess_ranks(rule)
    return [{"vars": {v: [3] * r for v, r in ranks.items()}, "params": {}}]


# ================================================================================================ verify
@contextlib.contextmanager
def single_thread():
    """Run torch on one thread inside the block: the tensors here are tiny, and a multi-threaded torch on a
    busy machine spends its time in thread barriers (measured: 25x slower with another job on the 2 cores)."""
    import torch

    n = torch.get_num_threads()
    if n != 1:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        if n != 1:
            torch.set_num_threads(n)


def verify(rule: Rule, trials: int = 5, max_dim: int = 4, seed: int = 0,
           examples: Sequence[Example] | None = None, attempts: int | None = None,
           rtol: float = RTOL, rank_draws: bool = False) -> dict | None:
    """Check ``rule`` numerically (see the module docstring). Returns the record for the rule's ``verified``
    field (method, trials, max_dims, seed, shapes, max_rel_diff), or None if it fails: some binding
    disagrees, an explicit example does not fit or is rejected, or fewer than ``trials`` distinct bindings pass
    within ``attempts`` draws (default ``40 * trials``)."""
    with single_thread():
        return _verify(rule, trials, max_dim, seed, examples, attempts, rtol, rank_draws)


def _verify(rule: Rule, trials: int, max_dim: int, seed: int, examples: Sequence[Example] | None,
            attempts: int | None, rtol: float, rank_draws: bool) -> dict | None:
    rtol = max(rtol, constant_tolerance(rule))
    rng = np.random.default_rng([seed, _stable_id(rule.id)])
    passed: list[dict] = []
    seen: set[tuple] = set()
    worst = 0.0
    if examples:
        for ex in examples:
            shapes = {v: tuple(int(d) for d in s) for v, s in ex["vars"].items()}
            params = _params(ex.get("params", {}))
            got = check_binding(rule, shapes, params, rng)
            if isinstance(got, str) or not got <= rtol:
                return None
            worst = max(worst, got)
            seen.add(_key(shapes, params))
            passed.append({"vars": {v: list(s) for v, s in shapes.items()}, **({"params": dict(ex["params"])}
                                                                               if ex.get("params") else {})})
        bases = [{"vars": dict(e["vars"]), "params": dict(e.get("params", {}))} for e in examples]
    else:
        bases = default_bases(rule)

    def agrees(shapes: dict, base: dict) -> bool:
        """Check one drawn binding: False if the two sides disagree on it; True if they agree (it is recorded)
        or if it is no binding of this rule (the shapes do not fit, or were drawn before)."""
        nonlocal worst
        params = _params(base.get("params", {}))
        k = _key(shapes, params)
        if k in seen:
            return True
        seen.add(k)
        got = check_binding(rule, shapes, params, rng)
        if isinstance(got, str):
            return True
        if not got <= rtol:
            return False
        worst = max(worst, got)
        passed.append({"vars": {v: list(s) for v, s in shapes.items()},
                       **({"params": dict(base["params"])} if base.get("params") else {})})
        return True

    # Plain, perturbed and broadcasting draws in turn, until 4 x `trials` bindings passed: a rule true only for
    # equal shapes (e.g. pooling distributed over a broadcasting Add) cannot slip through on plain draws alone.
    attempts = attempts if attempts is not None else 40 * trials
    for n in range(attempts):
        if len(passed) >= 4 * trials:
            break
        base = bases[n % len(bases)]
        kind = n % 3
        shapes = _remap(base["vars"], rng, max_dim, 0.3 if kind == 1 else 0.0, ranks=rank_draws and n % 4 == 3,
                        ones=0.3 if kind == 2 else 0.0)
        if not agrees(shapes, base):
            return None
    for base in bases:
        # hidden equalities: dimensions that share a size in the base may be equal only by accident of the
        # symbolic shapes; give one or two of them another size. A rule that needs the equality (two
        # concatenations split at the same point, say) fails on such a binding wherever it still type-checks.
        # Then systematic broadcasting: each variable with one dimension set to 1.
        for shapes in [*_split_equal_sizes(base["vars"], rng, max_dim), *_one_axis_broadcasts(base["vars"], rng,
                                                                                              max_dim)]:
            if not agrees(shapes, base):
                return None
    if len(passed) < trials:
        return None
    checked = len(passed)
    rank = max((len(s) for p in passed for s in p["vars"].values()), default=0)
    max_dims = [max((s[i] for p in passed for s in p["vars"].values() if len(s) > i), default=0)
                for i in range(rank)]
    ranks = {v: sorted({len(p["vars"][v]) for p in passed if v in p["vars"]}) for v in rule.variables}
    passed = passed[:max(trials, 8)]  # the record keeps a sample of the bindings
    return {"method": METHOD, "trials": checked, "max_dims": max_dims, "seed": seed, "rtol": rtol,
            "max_rel_diff": 0.0 if worst < ROUNDING_FLOOR else float(f"{worst:.3g}"),
            "ranks": {v: r[0] if len(r) == 1 else r for v, r in ranks.items()}, "shapes": passed}


#: the ranks :func:`verify_rank_general` binds a rule's activations to (all at one rank, one at a time, mixed): the
#: generator's activation ranks; a rank-general variable then binds any rank from the first up
#: (:data:`rlflow.rewrite.rule.MIN_GENERAL_RANK`)
RANKS_TRIED = tuple(range(MIN_GENERAL_RANK, 5))
#: uniform ranks (besides the one the rule was found at) at which a rank-general rule must fit and pass
MIN_OTHER_RANKS = 2


def _at_rank(shape: Sequence[int], rank: int) -> tuple[int, ...]:
    """``shape`` with leading dimensions dropped or added to make it ``rank``-D. Added axes get sizes by their
    position counted from the right (11 for the third axis from the right, 12 for the fourth...), so values
    given the same rank have the same new sizes and broadcast together the numpy way."""
    shape = tuple(int(d) for d in shape)
    if rank <= len(shape):
        return shape[len(shape) - rank:]
    return tuple(10 + j for j in range(rank - 1, len(shape) - 1, -1)) + shape


def verify_rank_general(rule: Rule, max_dim: int = 4, seed: int = 0, draws: int = 4) -> dict | None:
    """Is ``rule`` (verified at its variables' recorded ranks) sound with its activations (the variables not in
    ``constraints.const``) at other ranks? Its weights keep their ranks. The activations are put at each rank of
    :data:`RANKS_TRIED` together, then one at a time at each other rank (the rest at their own), then at ranks
    drawn for each on its own (the matchers bind each variable on its own: ``x0 * x1`` with a 3-D ``x0`` and a
    2-D ``x1`` broadcasts), each with ``draws`` size bindings drawn as :func:`verify` draws them (plain, perturbed,
    size-1 broadcasts, both); every binding the source fits must agree (a rejected binding, the target's types
    differing, is refused by the matchers too). Returns ``{"tried": [...], "passed": [...], "bindings": n}`` (the uniform ranks tried and those where
    bindings fitted and agreed; the number of agreeing bindings) when no binding disagrees and the rule passed at
    :data:`MIN_OTHER_RANKS` or more ranks besides its own; else None (the rule stays at its recorded ranks)."""
    with single_thread():
        acts = [v for v in rule.variables if v not in rule.const_vars]
        if not acts:
            return None
        base = default_bases(rule)[0]
        rng = np.random.default_rng([seed, _stable_id(rule.id), 7])
        own = {len(base["vars"][v]) for v in acts}
        at_own = {v: len(base["vars"][v]) for v in acts}
        assignments = [{v: r for v in acts} for r in RANKS_TRIED if {r} != own]          # all at one rank
        assignments += [{**at_own, v: r} for v in acts if len(acts) > 1                   # one at another rank
                        for r in RANKS_TRIED if r != at_own[v]]
        assignments += [{v: int(rng.choice(RANKS_TRIED)) for v in acts} for _ in range(2)]  # mixed
        params = _params(base.get("params", {}))
        passed_at: set[int] = set()
        bindings = 0
        seen: set[tuple] = set()
        for ranks in assignments:
            at = {v: _at_rank(s, ranks[v]) if v in ranks else tuple(s) for v, s in base["vars"].items()}
            for n in range(draws):     # plain sizes, sizes perturbed, some set to 1 (broadcasting), both
                shapes = _remap(at, rng, max_dim, 0.3 * (n % 2), ones=0.2 * (n // 2 % 2))
                if _key(shapes, params) in seen:
                    continue
                seen.add(_key(shapes, params))
                got = check_binding(rule, shapes, params, rng, rounds=1)
                if isinstance(got, str):
                    continue
                if not got <= max(RTOL, constant_tolerance(rule)):
                    return None
                bindings += 1
                if len(set(ranks.values())) == 1:
                    passed_at.add(next(iter(ranks.values())))
        if len(passed_at - own) < MIN_OTHER_RANKS:
            return None
        tried = sorted({r for a in assignments for r in a.values() if len(set(a.values())) == 1} | own)
        return {"tried": tried, "passed": sorted(passed_at | own), "bindings": bindings}


def constant_tolerance(rule: Rule) -> float:
    """1e-6 (float32 rounding) when the target makes a constant that float32 cannot hold exactly (e.g. a 1/9
    pooling kernel: target ``Constant`` nodes are float32, as the graphs rules apply to), else 0."""
    for n in rule.dst:
        v = n.attrs.get("value") if n.op == "Constant" else None
        if isinstance(v, float) and float(np.float32(v)) != v:
            return 1e-6
    return 0.0


def _params(p: Mapping[str, Any]) -> dict:
    """Parameters as a matched graph binds them: lists as tuples, floats at float32 precision."""
    def conv(v):
        if isinstance(v, (list, tuple)):
            return tuple(conv(x) for x in v)
        return float(np.float32(v)) if isinstance(v, float) else v
    return {k: conv(v) for k, v in p.items()}


def _key(shapes: Mapping[str, Sequence[int]], params: Mapping[str, Any]) -> tuple:
    return tuple(sorted((v, tuple(s)) for v, s in shapes.items())), repr(sorted(params.items()))


def _stable_id(text: str) -> int:
    """A per-rule seed component that is the same in every process (unlike ``hash``)."""
    import zlib

    return zlib.crc32(text.encode())
