"""One path through the code: nothing in src/ is reachable only from tests, no stage module imports another, and
the package has no import cycle."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SRC = REPO / "src" / "rlflow"

#: names vulture cannot see used: called from the Snakemake rule files (workflow/rules/*.smk), hooks that
#: dvclive, torch, gymnasium and Python itself call (a module's lazy ``__getattr__``), attributes that
#: configure a library object, and the Python API's functions that only users call (rlflow.optimize,
#: rlflow.estimate_cost, reached through rlflow's ``__getattr__``; docs/api.md)
USED_ELSEWHERE = """
wildcard_patterns check_models benchmark snakemake_shell param_values _init_dvc _init_studio post_data_to_studio forward
action_space observation_space log_severity_level intra_op_num_threads writeable producer_name
_dvc_file _dvc_studio_config __getattr__ dvc_address dvc_defines optimize estimate_cost
""".split()


def test_no_function_in_src_is_reachable_only_from_tests(tmp_path):
    """vulture (a dead-code finder) over src/ and benchmarks/ only: a function, method, class or property that
    nothing but the tests calls is reported here."""
    whitelist = tmp_path / "whitelist.py"
    whitelist.write_text("".join(f"_.{name}\n" for name in USED_ELSEWHERE))
    r = subprocess.run([sys.executable, "-m", "vulture", str(SRC), str(REPO / "benchmarks"), str(whitelist),
                        "--min-confidence", "60"], capture_output=True, text=True)
    unused = [line for line in r.stdout.splitlines()
              if any(k in line for k in ("unused function", "unused method", "unused class", "unused property"))]
    assert unused == [], "\n".join(unused)


def _imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return out


def test_no_stage_module_imports_another_stage():
    stages = {p.stem for p in (SRC / "stages").glob("*.py")} - {"__init__", "common", "search_common", "agent_common",
                                                            "passes_common"}
    for p in (SRC / "stages").glob("*.py"):
        others = {f"rlflow.stages.{s}" for s in stages if s != p.stem}
        assert not _imports(p) & others, (p.name, _imports(p) & others)
