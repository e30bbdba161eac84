"""The project skeleton and the first pipeline stage: config + schema, stage registry, Snakemake, DVC, and
`rlflow export-model`, down to a tiny end-to-end Snakemake run."""

from __future__ import annotations

import copy
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from rlflow.config import deep_merge, get, load_config, load_schema
from rlflow.errors import RLFlowError
from rlflow.pipeline import dvc as dvcgen
from rlflow.pipeline import registry

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "config.yaml"
TINY = REPO / "tests" / "configs" / "tiny.yaml"
BIN = Path(sys.executable).parent
# Tools from the running interpreter's environment; an activated environment (or make's PATH) comes first.
ENV = {**os.environ, "PATH": f"{os.environ.get('PATH', '')}{os.pathsep}{BIN}", "DVC_NO_ANALYTICS": "1"}


def tool(name: str) -> str:
    path = shutil.which(name, path=ENV["PATH"])
    if path is None:
        pytest.skip(f"{name} is not installed")
    return path


def sh(*args: str | Path, cwd: Path = REPO, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([str(a) for a in args], cwd=cwd, env=ENV, capture_output=True, text=True, timeout=timeout)


def job_counts(snakemake_output: str) -> dict[str, int]:
    """The 'Job stats' table of a snakemake run, as {rule: count} (without the total)."""
    m = re.search(r"^job\s+count\n-+\s+-+\n(.*?)^total\s+\d+", snakemake_output, re.M | re.S)
    assert m, snakemake_output
    return {rule: int(n) for rule, n in (line.split() for line in m.group(1).strip().splitlines())}


# -- (a) dvc.yaml is generated from the registry -----------------------------------------------------------
def test_committed_dvc_yaml_is_the_generated_one():
    committed = (REPO / "dvc.yaml").read_text()
    assert committed == dvcgen.render(), "dvc.yaml is stale: run `python -m rlflow.pipeline.dvc`"
    for pipeline, name in registry.PIPELINE_FILES.items():
        assert (REPO / name).read_text() == dvcgen.render(pipeline), f"{name} is stale"


def test_dvc_check_flags_any_difference(tmp_path):
    out = tmp_path / "dvc.yaml"
    assert dvcgen.main(["--root", str(tmp_path)]) == 0
    assert dvcgen.main(["--check", "--root", str(tmp_path)]) == 0
    out.write_text(dvcgen.render().replace("export.opset", "export.opsett"))
    assert dvcgen.main(["--check", "--root", str(tmp_path)]) == 1


def test_dvc_stage_declares_exactly_the_config_keys_and_files_of_the_registry():
    doc = yaml.safe_load((REPO / "dvc.yaml").read_text())
    st_ = registry.stage("export_model")
    do = doc["stages"]["export_model"]["do"]
    assert doc["stages"]["export_model"]["foreach"] == "${models}"
    assert do["params"] == [{"config.yaml": ["seed", "export.opset", "export.exporter", "zoo.${item}"]}]
    assert do["deps"][0] == "src/rlflow/stages/export_model.py" and _covered("src/rlflow/graph/zoo/bert.py", do["deps"])
    assert do["deps"] == [*st_.code_paths(), registry.OWN_MODELS_DIR]  # own models' files: that folder
    assert do["outs"] == ["results/${item}/model.onnx"]
    assert do["cmd"] == "rlflow export-model --config config.yaml --model ${item} --out results/${item}/model.onnx"
    cfg = yaml.safe_load(CONFIG.read_text())
    for model in registry.model_names():  # every declared key exists in config.yaml for every model
        for key in st_.config_keys(model=model).values():
            node = cfg
            for part in key.split("."):
                node = node[part]


def test_dvc_parses_the_pipeline():
    r = sh(tool("dvc"), "repro", "--dry", "--force")
    assert r.returncode == 0, r.stderr
    assert "Running stage 'export_model@bert'" in r.stdout
    assert "rlflow export-model --config config.yaml --model bert --out results/bert/model.onnx" in r.stdout


def test_every_stage_has_the_dvc_address_dvc_lists():
    """Snakemake's onsuccess `dvc commit` names each job's DVC stage by Stage.dvc_address; DVC run from the
    repository root knows a stage of multi/dvc.yaml or xla/dvc.yaml only with that file in front (a bare name
    made `snakemake multi`'s record fail)."""
    from rlflow.pipeline import registry

    r = sh(tool("dvc"), "stage", "list", "--all", "--name-only")
    assert r.returncode == 0, r.stderr
    listed = set(r.stdout.split())
    present = {n.split(":")[-1].split("@")[0] for n in listed}  # a sweep over an empty list has no stage
    assert {"train_multi_model", "report_multi", "export_hlo", "generate_rules", "export_model"} <= present
    for stage in registry.STAGES.values():
        if stage.name not in present:
            continue
        if not stage.wildcards:
            assert stage.dvc_address({}) in listed, stage.name
        else:
            head = stage.dvc_address({w: "X" for w in stage.wildcards}).split("@")[0] + "@"
            assert any(n.startswith(head) for n in listed), stage.name
    assert registry.stage("report_multi").dvc_address({}) == "multi/dvc.yaml:report_multi"
    assert registry.stage("collect_rollouts").dvc_address({"model": "bert", "shard": 0}) == "collect_rollouts@bert-0"


def test_dvc_defines_exactly_the_jobs_dvc_lists():
    """Snakemake's onsuccess records only the jobs DVC has a stage for (Stage.dvc_defines): each value of
    config.yaml's lists, and one outside them (`snakemake results/vit/model.onnx` with `models: [bert]` made the
    whole record fail with "no DVC stage named export_model@vit")."""
    import itertools

    from rlflow.pipeline import registry

    r = sh(tool("dvc"), "stage", "list", "--all", "--name-only")
    assert r.returncode == 0, r.stderr
    listed = set(r.stdout.split())
    config = registry.default_config()
    seen = {True: 0, False: 0}
    for stage in registry.STAGES.values():
        lists = [[*registry.get(config, registry.WILDCARD_CONFIG[w]), "not-in-config"] for w in stage.wildcards]
        for values in itertools.product(*lists):
            wildcards = dict(zip(stage.wildcards, map(str, values)))  # Snakemake's wildcards are strings
            defined = stage.dvc_defines(wildcards, config)
            assert defined == (stage.dvc_address(wildcards) in listed), (stage.name, wildcards)
            seen[defined] += 1
    assert seen[True] and seen[False], seen


# -- (b) config and schema ---------------------------------------------------------------------------------
def test_default_config_is_valid_and_complete():
    raw = yaml.safe_load(CONFIG.read_text())
    cfg = load_config(CONFIG)
    assert cfg == raw  # valid, and the schema adds no key the file does not spell out
    assert load_config(None) == raw  # the schema defaults are the same values


@pytest.mark.parametrize("extra", sorted((REPO / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_merges_over_the_default_and_validates(extra):
    """configs/*.yaml are what the README tells users to run (--configfile): each must pass the schema."""
    cfg = load_config([CONFIG, extra])
    assert cfg != load_config(CONFIG)  # it changes something


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("device=gpu", "device"),
        ("export.opset=12", "export.opset"),
        ("export.opset=26", "export.opset"),
        ("export.exporter=jit", "export.exporter"),
        ("colour=1", "colour"),
        ("models=[no/pe]", "models.0"),
        ("zoo.mine={onnx: /tmp/mine.onnx}", "zoo.mine.onnx"),
        ("models=[]", "models"),
        ("zoo.bert.layers=0", "zoo.bert.layers"),
        ("zoo.bert.depth=3", "zoo.bert.depth"),
        ("zoo.nope={}", "zoo.nope"),
    ],
)
def test_invalid_config_is_a_one_line_error_naming_the_key(override, key):
    with pytest.raises(RLFlowError) as e:
        load_config(CONFIG, [override])
    msg = str(e.value)
    assert "\n" not in msg and f"'{key}'" in msg, msg


def test_a_model_neither_in_the_zoo_nor_own_is_a_one_line_error():
    from rlflow.config import check_models

    check_models(load_config(CONFIG, ["models=[bert, mine]", "zoo.mine={onnx: models/mine.onnx}"]))
    with pytest.raises(RLFlowError) as e:
        check_models(load_config(CONFIG, ["models=[bert, nope]"]))
    assert "\n" not in str(e.value) and "'nope' is neither a zoo model" in str(e.value)


def test_invalid_config_file_names_the_file_and_key(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("seed: 0\nunknown_key: 1\n")
    with pytest.raises(RLFlowError, match=r"bad\.yaml.*'unknown_key'"):
        load_config([CONFIG, bad])
    bad.write_text("seed: [\n")
    with pytest.raises(RLFlowError, match=r"bad\.yaml: not valid YAML"):
        load_config([CONFIG, bad])


def test_tiny_config_merges_over_the_default():
    cfg = load_config([CONFIG, TINY])
    base = load_config(CONFIG)
    assert cfg["zoo"]["bert"]["layers"] == 2 and cfg["zoo"]["taso-bert"]["hidden"] == 32
    assert (cfg["seed"], cfg["models"]) == (base["seed"], base["models"])
    assert cfg["export"] == {**base["export"], "exporter": "torchscript"}  # tiny.yaml: the quick exporter
    assert cfg["run"] == {"warmup": 1, "repeats": 3}
    # overrides apply after the files; a partial mapping in a later file keeps the other keys
    cfg = load_config([CONFIG, TINY], ["zoo.bert.layers=3", 'export={"opset": 17}'])
    assert cfg["zoo"]["bert"]["layers"] == 3 and cfg["zoo"]["bert"]["hidden"] == 32
    assert cfg["export"] == {"opset": 17, "exporter": "dynamo"}  # replaced, then the default filled in


def test_config_sizes_are_the_zoo_sizes():
    from rlflow.graph import zoo

    assert registry.model_names() == tuple(zoo.MODEL_NAMES)
    assert load_config(CONFIG)["zoo"] == zoo.DEFAULT_SIZES
    assert load_config([CONFIG, TINY])["zoo"] == zoo.TINY_SIZES
    schema_zoo = load_schema()["properties"]["zoo"]["properties"]
    assert {m: list(s["properties"]) for m, s in schema_zoo.items()} == {
        m: list(s) for m, s in zoo.DEFAULT_SIZES.items()
    }


def test_the_schema_is_parsed_once_and_each_caller_gets_its_own_copy(monkeypatch):
    """Every command builds its parser from the schema (model names, pass variants: dozens of reads); it is parsed
    once per process, and a caller that changes its copy changes no one else's."""
    import yaml

    first = load_schema()
    first["$defs"]["zoo_model"]["enum"].append("not-a-model")
    monkeypatch.setattr(yaml, "load", lambda *a, **k: pytest.fail("the schema was parsed again"))
    monkeypatch.setattr(yaml, "safe_load", lambda *a, **k: pytest.fail("the schema was parsed again"))
    again = load_schema()
    assert "not-a-model" not in again["$defs"]["zoo_model"]["enum"]
    assert registry.model_names() == tuple(again["$defs"]["zoo_model"]["enum"])


def test_schema_has_one_file_two_paths():
    link = REPO / "workflow" / "schemas" / "config.schema.yaml"
    assert link.is_symlink() and not os.path.isabs(os.readlink(link))
    assert link.resolve() == (REPO / "src" / "rlflow" / "config.schema.yaml").resolve()


def test_every_schema_key_is_described():
    def walk(schema, path):
        assert schema.get("description"), f"no description for {path or 'the config'}"
        for key, sub in schema.get("properties", {}).items():
            walk(sub, f"{path}.{key}" if path else key)

    walk(load_schema(), "")


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=5) | st.floats(allow_nan=False),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(min_size=1, max_size=3), inner, max_size=3),
    max_leaves=8,
)
configs = st.dictionaries(st.sampled_from("abc"), json_values, max_size=3)


@settings(max_examples=200, deadline=None)
@given(configs, configs)
def test_deep_merge_is_snakemakes_configfile_merge(base, override):
    from snakemake.utils import update_config

    expected = copy.deepcopy(base)
    update_config(expected, copy.deepcopy(override))
    before = copy.deepcopy(base)
    assert deep_merge(base, override) == expected
    assert base == before  # not modified


@settings(max_examples=200, deadline=None)
@given(json_values)
def test_set_values_round_trip_through_the_shell(value):
    """A rule param reaches the stage as `--set KEY=<value quoted by snakemake's :q>` and is parsed back."""
    argv = shlex.split(f"--set zoo.bert={shlex.quote(registry.cli_value(value))}")
    assert yaml.safe_load(argv[1].partition("=")[2]) == value


def _typed(value):
    """``value`` with every scalar paired with its type: 1, 1.0 and True compare equal, these do not."""
    if isinstance(value, dict):
        return {k: _typed(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_typed(v) for v in value]
    return (type(value), value)


def test_set_values_keep_their_types_whatever_was_encoded_before():
    """cli_value remembers its answers (Snakemake asks for thousands per run); values that compare equal but
    differ in type (1, 1.0, True) or order get their own encodings, in any order of asking."""
    values = [1, 1.0, True, "1", [1], [1.0], [True], {"a": 1}, {"a": 1.0}, {"a": True}, {"a": 1, "b": 2},
              {"b": 2, "a": 1}, float("inf"), 1e16, None]
    for order in (values, values[::-1]):
        registry._CLI_VALUES.clear()
        for v in order:
            assert _typed(yaml.safe_load(registry.cli_value(v))) == _typed(v), v
    assert registry.cli_value({"b": 2, "a": 1}) == '{"b":2,"a":1}'  # a mapping's order is kept


# -- the registry: one hop from rule to code ---------------------------------------------------------------
def test_registry_names_lead_to_code_rule_and_cli():
    from rlflow.cli import COMMAND_MODULES, build_parser

    commands = build_parser()._subparsers._group_actions[0].choices
    r = sh(tool("snakemake"), "--list-rules")
    assert r.returncode == 0, r.stderr
    rules = set(r.stdout.split())
    for name, stage in registry.STAGES.items():
        assert (REPO / stage.module_path).is_file()
        assert stage.module in COMMAND_MODULES
        assert stage.command.split()[1] in commands
        assert name in rules, f"no Snakemake rule {name}"
    assert rules - set(registry.STAGES) == {"all", "multi", "xla"}  # the targets; every other rule is a stage


#: a stage a newcomer adds: its registry entry and its module, nothing else
NEW_STAGE_ENTRY = """
STAGES["count_ops"] = _check(Stage(
    name="count_ops",
    doc="Count the ops of a model's ONNX graph.",
    inputs={"onnx": "results/{model}/model.onnx"},
    outputs={"counts": "results/{model}/op_counts.json"},
    params={"seed": "seed"},
    args=(("--model", "{model}"), ("--onnx", "{input.onnx}"), ("--out", "{output.counts}")),
))
"""
NEW_STAGE_MODULE = '''"""Count the ops of a model's ONNX graph (pipeline stage ``count_ops``)."""
import json

from rlflow.graph import load_onnx

HELP = "count the ops of a model's ONNX graph (pipeline stage count_ops)"
SET_EXAMPLE = "seed=1"


def run(args):
    g = load_onnx(args.onnx)
    with open(args.out, "w") as f:
        json.dump({"model": args.model, "ops": g.op_counts()}, f)
    return 0
'''


def test_a_new_stage_is_its_registry_entry_and_its_module(tmp_path, tiny_zoo):
    """In a copy of the pipeline, a stage added as a registry entry and a module only (no rule file, no CLI
    list, no dvc.yaml edit) is a Snakemake rule with the right command, a dvc.yaml stage, and a working
    `rlflow` subcommand."""
    copy = tmp_path / "repo"
    copy.mkdir()
    for name in ("Snakefile", "config.yaml", "workflow", "profiles", "src"):
        src = REPO / name
        (shutil.copytree(src, copy / name, ignore=shutil.ignore_patterns("__pycache__"))
         if src.is_dir() else shutil.copy(src, copy / name))
    with open(copy / "src/rlflow/pipeline/registry.py", "a") as f:
        f.write(NEW_STAGE_ENTRY)
    (copy / "src/rlflow/stages/count_ops.py").write_text(NEW_STAGE_MODULE)
    env = {**ENV, "PYTHONPATH": str(copy / "src")}

    def run(*args, cwd=copy):
        return subprocess.run([str(a) for a in args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)

    r = run(tool("snakemake"), "-n", "-p", "--cores", "1", "results/bert/op_counts.json")
    assert r.returncode == 0, r.stderr
    assert job_counts(r.stdout) == {"count_ops": 1, "export_model": 1}
    assert ("rlflow count-ops --model bert --onnx results/bert/model.onnx --out results/bert/op_counts.json "
            "--set seed=0") in r.stdout
    r = run(sys.executable, "-m", "rlflow.pipeline.dvc")
    assert r.returncode == 0, r.stderr
    dvc = yaml.safe_load((copy / "dvc.yaml").read_text())["stages"]["count_ops"]
    assert dvc["foreach"] == "${models}" and "results/${item}/op_counts.json" in dvc["do"]["outs"]
    out = tmp_path / "counts.json"
    r = run(sys.executable, "-m", "rlflow.cli", "count-ops", "--config", "config.yaml", "--model", "bert",
            "--onnx", tiny_zoo["bert"], "--out", out)
    assert r.returncode == 0, r.stderr
    assert json.loads(out.read_text())["ops"]["MatMul"] > 0


def test_every_registry_command_line_parses_and_reaches_its_flags():
    """The command line DVC runs for each stage parses with the real CLI parser, and every flag it passes lands
    in the namespace (the file flags are made from the registry; the stage module adds only its own options)."""
    from rlflow.cli import build_parser

    parser = build_parser()
    for name, stage in registry.STAGES.items():
        argv = shlex.split(stage.dvc_cmd().replace("${item}", "bert").replace("${item.model}", "bert"))[1:]
        argv = [re.sub(r"\$\{item\.\w+\}", "1", a) for a in argv]
        args = parser.parse_args(argv + ["--set", "seed=0"])
        assert args.config == ["config.yaml"] and args.overrides[-1] == "seed=0", name
        active = stage.active_inputs()
        for flag, value in stage.args:
            ref = re.fullmatch(r"\{input\.(\w+)\}", value)
            if ref and ref.group(1) not in active:  # switched off in config.yaml: not passed
                assert flag not in argv, (name, flag)
                continue
            assert getattr(args, flag.lstrip("-").replace("-", "_")) is not None, (name, flag)


def test_a_stage_command_without_a_required_file_flag_is_a_usage_error(capsys):
    from rlflow.cli import main

    with pytest.raises(SystemExit) as e:
        main(["train-encoder", "--model", "bert", "--onnx", "m.onnx", "--rules", "r.json"])
    assert e.value.code == 2
    assert "--rollouts" in capsys.readouterr().err


# -- (c, f) Snakemake --------------------------------------------------------------------------------------
def test_snakemake_dry_run_is_exactly_the_export_job():
    r = sh(tool("snakemake"), "-n", "-F", "-p", "results/bert/model.onnx")
    assert r.returncode == 0, r.stdout + r.stderr
    assert job_counts(r.stdout) == {"export_model": 1}
    sizes = load_config(CONFIG)["zoo"]["bert"]
    assert f"--set zoo.bert='{registry.cli_value(sizes)}'" in r.stdout
    assert "--set export.opset=18 --set export.exporter=dynamo" in r.stdout



def test_search_eqsat_rl_is_a_rule_and_a_dvc_stage_like_search_eqsat():
    """eqsat-rl's stage: search_eqsat's inputs, config keys (and eqsat.rl_leaves), command pattern, log and
    benchmark files, writing results/<model>/eqsat_rl/; its Snakemake rule and its dvc.yaml stage say the same, and
    evaluate reads its graph and trace (--eqsat-rl, --eqsat-rl-trace)."""
    eq, rl = registry.stage("search_eqsat"), registry.stage("search_eqsat_rl")
    assert rl.inputs == eq.inputs and rl.params == {**eq.params, "rl_leaves": "eqsat.rl_leaves"}
    assert rl.outputs == {"onnx": "results/{model}/eqsat_rl/model.onnx", "trace": "results/{model}/eqsat_rl/trace.json"}
    assert rl.args == eq.args and rl.command == "rlflow search-eqsat-rl" and rl.module == "rlflow.stages.search_eqsat_rl"
    assert (rl.log, rl.benchmark) == ("results/logs/search_eqsat_rl/{model}.log",
                                      "results/benchmarks/search_eqsat_rl/{model}.tsv")
    assert registry.METHODS["eqsat_rl"] == "eqsat_rl"
    # dvc.yaml
    stages = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]
    do = stages["search_eqsat_rl"]["do"]
    assert stages["search_eqsat_rl"]["foreach"] == "${models}"
    assert do["cmd"] == rl.dvc_cmd()
    assert do["deps"] == [*rl.code_paths(), *rl.input_paths(**rl.dvc_values()).values()]
    assert _covered("src/rlflow/search/eqsat_rl.py", do["deps"])
    assert do["params"] == [{"config.yaml": list(rl.params.values())}]
    assert do["outs"] == ["results/${item}/eqsat_rl/model.onnx", "results/${item}/eqsat_rl/trace.json"]
    ev = stages["evaluate"]["do"]
    assert "--eqsat-rl results/${item}/eqsat_rl/model.onnx" in ev["cmd"]
    assert "--eqsat-rl-trace results/${item}/eqsat_rl/trace.json" in ev["cmd"]
    assert "results/${item}/eqsat_rl/trace.json" in ev["deps"]
    # Snakemake: the rule's job under the tiny config, and evaluate asks for its files
    r = sh(tool("snakemake"), "-n", "-F", "-p", "results/bert/eqsat_rl/trace.json", "--configfile", TINY)
    assert r.returncode == 0, r.stdout + r.stderr
    assert job_counts(r.stdout)["search_eqsat_rl"] == 1
    job = next(line for line in r.stdout.splitlines() if "rlflow search-eqsat-rl " in line)
    assert "--out results/bert/eqsat_rl/model.onnx --trace results/bert/eqsat_rl/trace.json" in job
    assert "--set eqsat.node_limit=5000" in job and "--set eqsat.rl_leaves=2" in job
    assert "> results/logs/search_eqsat_rl/bert.log 2>&1" in job
    assert "benchmark: results/benchmarks/search_eqsat_rl/bert.tsv" in r.stdout
    r = sh(tool("snakemake"), "-n", "-F", "results/bert/evaluation.csv", "--configfile", TINY)
    assert r.returncode == 0, r.stdout + r.stderr
    assert job_counts(r.stdout)["search_eqsat_rl"] == 1


def test_snakemake_starts_the_longest_chain_first():
    """The costs -> rollouts -> encoder -> world model -> controller chain has priority 1 (registry), the others 0, so
    on a small machine (`make run`: --cores all) the searches wait for a core the chain leaves idle; the machine
    track's cost cache (all cores) has 2: it runs first, so that its searches can fill that core."""
    r = sh(tool("snakemake"), "-n", "-F", "--cores", "2", "results/bert/report.html")
    assert r.returncode == 0, r.stdout + r.stderr
    jobs = re.findall(r"^(?:local)?rule (\w+):\n(.*?)(?=\n\n|\Z)", r.stdout, re.M | re.S)
    got = {name: int(m.group(1)) if (m := re.search(r"^\s+priority: (\d+)$", body, re.M)) else 0
           for name, body in jobs}
    want = {name: registry.stage(name).priority for name in got if name in registry.STAGES}
    assert {k for k, v in want.items() if v == 1} == {"measure_costs", "collect_rollouts", "merge_rollouts",
                                                      "train_encoder", "train_world_model", "train_controller"}
    assert {k for k, v in want.items() if v > 1} == {"measure_costs_machine"}
    assert {k: got[k] for k in want} == want


def test_snakemake_passes_the_merged_tiny_config_to_the_job():
    r = sh(tool("snakemake"), "results/vit/model.onnx", "-n", "-F", "-p", "--configfile", TINY, "--config", "seed=7")
    assert r.returncode == 0, r.stdout + r.stderr
    tiny = load_config([CONFIG, TINY])["zoo"]["vit"]
    assert f"--set zoo.vit='{registry.cli_value(tiny)}'" in r.stdout
    assert "--set seed=7 " in r.stdout


def test_snakemake_rejects_an_invalid_config_before_any_job():
    r = sh(tool("snakemake"), "-n", "--config", "device=gpu")
    assert r.returncode != 0
    assert "invalid config key 'device'" in r.stdout + r.stderr
    assert "Job stats" not in r.stdout


def test_snakemake_lint_has_no_findings():
    r = sh(tool("snakemake"), "--lint")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Congratulations, your workflow is in a good condition!" in r.stdout + r.stderr


# -- code dependencies: the import closure of each stage's module ---------------------------------------------
def _imported_rlflow_modules(module: str) -> set[str]:
    """The rlflow modules ``module`` imports, transitively, found by the standard library's ModuleFinder
    (which reads every import in the byte code, inside functions too): a second implementation to check
    rlflow.pipeline.imports against. Modules outside rlflow are not followed."""
    import modulefinder

    class RlflowOnly(modulefinder.ModuleFinder):
        def import_hook(self, name, caller=None, fromlist=None, level=-1):
            if level in (-1, 0) and not (name == "rlflow" or name.startswith("rlflow.")):
                return None
            return super().import_hook(name, caller, fromlist, level)

    finder = RlflowOnly(path=[str(REPO / "src")])
    finder.run_script(str(REPO / "src" / Path(*module.split("."))) + ".py")
    return {m for m in finder.modules if m.startswith("rlflow")}


def _covered(path: str, deps: list[str]) -> bool:
    return any(path == d or path.startswith(d.rstrip("/") + "/") for d in deps)


@pytest.mark.parametrize("name", sorted(registry.STAGES))
def test_every_module_a_stage_imports_is_a_code_dependency_of_its_rule_and_dvc_stage(name):
    stage = registry.STAGES[name]
    stages = yaml.safe_load((REPO / registry.PIPELINE_FILES[stage.pipeline]).read_text())["stages"]
    if stage.enabled_by and not get(registry.default_config(), stage.enabled_by):  # off in config.yaml
        assert name not in stages
        dvc_deps = None
    else:
        doc = stages[name]
        dvc_deps = (doc.get("do") or doc)["deps"]
    snakemake_inputs = set(stage.code_files())  # what workflow/rules/common.smk gives the rule as `code`
    imported = _imported_rlflow_modules(stage.module)
    assert len(imported) > 5, imported
    for module in imported:
        base = REPO / "src" / Path(*module.split("."))
        path = base.with_suffix(".py") if base.with_suffix(".py").is_file() else base / "__init__.py"
        rel = str(path.relative_to(REPO))
        assert rel in snakemake_inputs, f"{name}: {rel} is not a code input of its Snakemake rule"
        assert dvc_deps is None or _covered(rel, dvc_deps), f"{name}: {rel} is not a dvc.yaml dependency"


def test_import_closure_follows_lazy_imports_and_from_imports(tmp_path):
    from rlflow.pipeline.imports import as_folders, closure, direct_imports

    src = tmp_path / "src"
    pkg = src / "rlflow"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("X = 1\n")
    (pkg / "sub" / "leaf.py").write_text("import os\n")
    (pkg / "sub" / "other.py").write_text("")
    (pkg / "lazy.py").write_text("def f():\n    from rlflow.sub import leaf, X\n    return leaf\n")
    (pkg / "top.py").write_text("import json\nfrom . import lazy\n")
    (pkg / "nested.py").write_text(  # imports inside every kind of block a statement can stand in
        "class C:\n    def m(self):\n        with open('x'):\n            if True:\n                import rlflow.a\n"
        "try:\n    pass\nexcept ImportError:\n    import rlflow.b\nelse:\n    import rlflow.c\n"
        "finally:\n    import rlflow.d\n"
        "for i in []:\n    pass\nelse:\n    import rlflow.e\n"
        "match 1:\n    case 1:\n        import rlflow.f\n"
        "async def g():\n    async with x:\n        while True:\n            import rlflow.g\n")
    for name in "abcdefg":
        (pkg / f"{name}.py").write_text("")
    assert direct_imports("rlflow.nested", src) == {f"rlflow.{n}" for n in "abcdefg"}
    assert direct_imports("rlflow.lazy", src) == {"rlflow.sub", "rlflow.sub.leaf"}
    assert closure("rlflow.top", src) == ["rlflow", "rlflow.lazy", "rlflow.sub", "rlflow.sub.leaf", "rlflow.top"]
    files = ["src/rlflow/sub/__init__.py", "src/rlflow/sub/leaf.py", "src/rlflow/lazy.py"]
    assert as_folders(files, tmp_path) == ["src/rlflow/lazy.py", "src/rlflow/sub/__init__.py", "src/rlflow/sub/leaf.py"]
    assert as_folders(files + ["src/rlflow/sub/other.py"], tmp_path) == ["src/rlflow/lazy.py", "src/rlflow/sub"]


# -- (d) tiny end to end -----------------------------------------------------------------------------------
def copy_workflow(dest: Path) -> None:
    """The files a pipeline run needs: Snakefile, config, rules, schema link, profiles, tiny config, code, the
    own models' folder."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in ("Snakefile", "config.yaml"):
        shutil.copy2(REPO / name, dest / name)
    for name in ("workflow", "src", "envs", "models"):
        shutil.copytree(REPO / name, dest / name, symlinks=True, ignore=ignore, dirs_exist_ok=True)
    os.symlink(os.readlink(REPO / "profiles"), dest / "profiles")
    (dest / "tests" / "configs").mkdir(parents=True)
    shutil.copy2(TINY, dest / "tests" / "configs" / "tiny.yaml")


def dvc_repo_rule_all(root: Path, cfg: dict) -> str:
    """Make ``root`` a pipeline repository the way a user has one (the workflow, this repo's dvc.yaml and DVC
    config, ``cfg`` as its config.yaml, a git repository: DVC needs one), run `snakemake` (rule all) there and
    return its output."""
    copy_workflow(root)
    for name in ("dvc.yaml", ".gitignore"):  # .gitignore: results/ is git-ignored, so DVC adds no .gitignore there
        shutil.copy2(REPO / name, root / name)
    shutil.copytree(REPO / ".dvc", root / ".dvc", ignore=shutil.ignore_patterns("cache", "tmp", "config.local"))
    (root / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    assert sh("git", "init", "-q", cwd=root).returncode == 0
    r = sh(tool("snakemake"), "--cores", "2", cwd=root, timeout=1500)
    assert r.returncode == 0, r.stdout[-5000:] + r.stderr[-5000:]
    return r.stdout + r.stderr


def test_snakemake_builds_a_tiny_bert_end_to_end(tmp_path):
    import onnx

    copy_workflow(tmp_path)
    snakemake = tool("snakemake")
    # targets first: --configfile and --config take every following word
    r = sh(snakemake, "results/bert/model.onnx", "--cores", "2", "--configfile", "tests/configs/tiny.yaml",
           cwd=tmp_path, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    out = tmp_path / "results" / "bert" / "model.onnx"
    model = onnx.load(str(out))
    onnx.checker.check_model(model, full_check=True)
    tiny = load_config([CONFIG, TINY])["zoo"]["bert"]
    dims = [d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim]
    assert dims == [tiny["batch"], tiny["seq"]]
    assert {tuple(i.dims) for i in model.graph.initializer} >= {(tiny["vocab"], tiny["hidden"])}
    assert "wrote results/bert/model.onnx" in (tmp_path / "results/logs/export_model/bert.log").read_text()
    assert (tmp_path / "results/benchmarks/export_model/bert.tsv").is_file()
    assert not [p for p in out.parent.iterdir() if p.name != "model.onnx"]  # no temporary file left behind

    # up to date with the same config; the params trigger reruns it when the sizes change
    r = sh(snakemake, "results/bert/model.onnx", "-n", "--configfile", "tests/configs/tiny.yaml", cwd=tmp_path)
    assert "Nothing to be done" in r.stdout + r.stderr, r.stdout
    r = sh(snakemake, "results/bert/model.onnx", "-n", "--configfile", "tests/configs/tiny.yaml",
           "--config", "seed=1", cwd=tmp_path)
    assert job_counts(r.stdout) == {"export_model": 1}
    assert "Params have changed" in r.stdout


# -- (e) the stage's command line --------------------------------------------------------------------------
def rlflow(*args: str | Path, cwd: Path = REPO) -> subprocess.CompletedProcess:
    exe = shutil.which("rlflow", path=ENV["PATH"])
    cmd = [exe] if exe else [sys.executable, "-m", "rlflow.cli"]
    return sh(*cmd, *args, cwd=cwd)


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--model", "nope"], "unknown model 'nope'"),
        (["--model", "bert", "--set", "export.opset=12"], "'export.opset'"),
        (["--model", "bert", "--config", "missing.yaml"], "missing.yaml: config file not found"),
        (["nope"], "unknown model 'nope'"),
        (["vit", "--model", "bert"], "two different models given"),
        ([], "which model?"),
    ],
)
def test_export_model_bad_input_is_one_line_exit_2_and_no_output(tmp_path, args, needle):
    out = tmp_path / "sub" / "model.onnx"
    r = rlflow("export-model", "--config", CONFIG, *args, "--out", out)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("rlflow: error:") and needle in lines[0], r.stderr
    assert not (tmp_path / "sub").exists()


def test_export_model_takes_the_name_positionally(tmp_path):
    out = tmp_path / "tb.onnx"
    r = rlflow("export-model", "taso-bert", "--config", CONFIG, "--config", "tests/configs/tiny.yaml", "--out", out)
    assert r.returncode == 0, r.stderr
    import onnx

    m = onnx.load(str(out))
    assert [d.dim_value for d in m.graph.input[0].type.tensor_type.shape.dim] == [8, 32]  # the tiny sizes


def test_export_model_help_names_the_config_keys():
    r = rlflow("export-model", "--help")
    assert r.returncode == 0
    for word in ("seed, export.opset, export.exporter", "--config", "--set", "--model", "--out", "taso-bert"):
        assert word in r.stdout


@pytest.mark.parametrize("extra", sorted((REPO / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_sweeps_train_only_what_the_main_run_does_not(extra):
    """A sweep value equal to the main run's (its controller's temperature, its reward) would train the main
    controller again under another name and leave the value it was meant to compare untrained."""
    cfg = load_config([CONFIG, extra])
    assert get(cfg, "env.reward.name") not in get(cfg, "sweeps.rewards")
    assert get(cfg, "controller.temperature") not in get(cfg, "sweeps.temperatures")


def test_the_slurm_profile_names_pipeline_rules_and_runs_without_cores():
    """workflow/profiles/slurm sets resources by rule name: each is a stage of the registry (a renamed stage would
    silently fall back to the defaults). It sets no `cores`, so the Snakefile must parse without --cores, as under
    a cluster executor (`make test-cluster` runs the profile on a real SLURM cluster)."""
    profile = yaml.safe_load((REPO / "workflow" / "profiles" / "slurm" / "config.yaml").read_text())
    assert set(profile["set-resources"]) <= set(registry.STAGES), set(profile["set-resources"]) - set(registry.STAGES)
    assert "cores" not in profile
    from snakemake.api import SnakemakeApi
    from snakemake.settings.types import ConfigSettings, ResourceSettings

    with SnakemakeApi() as api:
        wf = api.workflow(snakefile=REPO / "Snakefile", workdir=REPO, resource_settings=ResourceSettings(),
                          config_settings=ConfigSettings(configfiles=[TINY]))
        assert "measure_costs" in {r.name for r in wf._workflow.rules}  # parsed, threads included
