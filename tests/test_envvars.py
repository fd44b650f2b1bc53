"""The environment contract is one table (`fleetlike.config.envvars`), and the code keeps to it.

Every ``FLEETLIKE_*`` name the package's source mentions is a row of the table; what the
launcher, its elastic agent and the ``-np/-H`` form really write (their functions called here,
not their source read) is in the table under that writer; the DDP knobs are the table's knobs;
``fleetlike.auto``'s unknown-variable check accepts exactly the table. No process starts.
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest

import fleetlike
from fleetlike.config import envvars
from fleetlike.config.knobs import knob_options
from fleetlike.ddp import knobs
from fleetlike.launch import LaunchConfig, worker_env
from fleetlike.launch.elastic_agent import _restart_env, elastic_env
from fleetlike.launch.hostrun import mpiexec_command
from fleetlike.launch.hosts import parse_hosts

ROOT = Path(fleetlike.__file__).resolve().parent
NAME = re.compile(r"\bFLEETLIKE_[A-Z0-9_]*[A-Z0-9]\b")


def test_every_fleetlike_name_in_the_source_is_in_the_table() -> None:
    seen: dict[str, str] = {}
    for path in sorted(ROOT.rglob("*.py")):
        for match in NAME.finditer(path.read_text(encoding="utf-8")):
            seen.setdefault(match.group(0), str(path.relative_to(ROOT.parent)))
    missing = {name: where for name, where in seen.items() if name not in envvars.BY_NAME}
    assert missing == {}, f"add these to fleetlike/config/envvars.py (name, writer, reader, meaning): {missing}"
    # and the table holds no name nothing mentions (a stale row)
    unused = envvars.fleetlike_names() - set(seen) - {v.name for v in envvars.ENV_VARS if v.writer == "tests"}
    assert unused == set()


def test_a_name_is_spelled_as_a_constant_in_the_table_only() -> None:
    """Modules take a variable's name from `envvars` (``X = envvars.NAME``), never spell it
    again: a second spelling drifts from the table's without any test noticing."""
    constant = re.compile(r"^\s*[A-Za-z_][A-Za-z_0-9]*\s*(?::[^=]+)?=\s*[\"']FLEETLIKE_", re.MULTILINE)
    again = [str(path.relative_to(ROOT.parent)) for path in sorted(ROOT.rglob("*.py"))
             if path.name != "envvars.py" and constant.search(path.read_text(encoding="utf-8"))]
    assert again == [], f"take these names from fleetlike.config.envvars: {again}"


def test_the_table_is_well_formed() -> None:
    assert len(envvars.BY_NAME) == len(envvars.ENV_VARS)
    for v in envvars.ENV_VARS:
        assert v.name and v.writer and v.reader and v.meaning, v
    assert set(envvars.__all__) >= {"ENV_VARS", "EnvVar", "BY_NAME"}
    text = envvars.table()
    assert all(v.name in text for v in envvars.ENV_VARS)


def _written(env: dict[str, str], base: dict[str, str]) -> set[str]:
    return {k for k, v in env.items() if base.get(k) != v}


def test_what_the_launcher_writes_is_in_the_table_under_its_name() -> None:
    base = {"PATH": "/bin"}
    config = LaunchConfig("train.py", cluster_node_ips=("127.0.0.1", "127.0.0.2"), node_ip="127.0.0.2",
                          started_port=7100, nproc_per_node=2, job_id="j1", accelerate_ddp=True, accelerate_horovod=True,
                          malloc_tuning=True)
    written = _written(worker_env(config, 1, base=base), base)
    only_sometimes = {envvars.AGENT_STORE, envvars.CUDA_VISIBLE_DEVICES}  # --started_port=auto; GPU runs
    assert written == set(envvars.by_writer("launch.env")) - only_sometimes

    elastic = LaunchConfig("t.py", min_nodes=1, max_nodes=2, rdzv_endpoint="127.0.0.1:1", nproc_per_node=2)
    agent = {**elastic_env(elastic), **_restart_env(elastic, 3)}
    # the progress folder is added by the restart loop, beside these
    assert set(agent) | {envvars.PROGRESS_DIR} == set(envvars.by_writer("launch.elastic_agent"))

    job = parse_hosts(["-np", "4", "-H", "10.77.0.1:2,10.77.0.2:2", "--mpi", "--", "python", __file__],
                      local=lambda h: h == "10.77.0.1", resolves=lambda h: True, mpiexec=lambda: "/x/mpiexec")
    argv = mpiexec_command(job, "/tmp/rsh")
    named = {argv[i + 1] for i, word in enumerate(argv) if word in ("-genv", "-env")}
    assert named == set(envvars.by_writer("launch.hostrun"))
    assert named <= set(envvars.BY_NAME)


def test_the_knobs_are_the_tables_knobs() -> None:
    assert tuple(k.name for k in knobs.KNOBS) == envvars.KNOB_NAMES
    assert knobs.KNOWN_ELSEWHERE == envvars.fleetlike_names() - set(envvars.KNOB_NAMES)
    # every name of the table is accepted; a near miss of one stops the job, naming it
    assert knobs.applied_knobs({name: "1" for name in knobs.KNOWN_ELSEWHERE}) == {}
    with pytest.raises(knobs.KnobError, match="FLEETLIKE_ALLREDUCE_DTYP=.*not a fleetlike setting; did you mean "
                                              "FLEETLIKE_ALLREDUCE_DTYPE"):
        knobs.applied_knobs({"FLEETLIKE_ALLREDUCE_DTYP": "fp16"})


def test_other_names_of_the_families_are_warned_about_once_and_ignored() -> None:
    """A script's own ``FLEETLIKE_CUSTOM`` or a vendor variable with no row is no typo of a knob:
    it warns once per process and sets nothing, beside a knob that still acts."""
    env = {"FLEETLIKE_CUSTOM_TOKEN": "x", "PERSEUS_SOMETHING_ELSE": "1", "FLEETLIKE_ALLREDUCE_STREAMS": "2"}
    with pytest.warns(UserWarning) as seen:
        assert knobs.applied_knobs(env) == {"FLEETLIKE_ALLREDUCE_STREAMS": "2"}
    named = sorted(str(w.message).split()[0] for w in seen)
    assert named == ["FLEETLIKE_CUSTOM_TOKEN", "PERSEUS_SOMETHING_ELSE"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert knob_options(env) == {"nccl_comm_num": 2}


def test_both_launcher_forms_declare_the_shared_flags_once() -> None:
    """The one-node form and the -np/-H form take the shared flags from one table: same names,
    same defaults; the parsers declare no other flag twice."""
    from fleetlike.launch.flags import SHARED_FLAGS, build_parser
    from fleetlike.launch.hosts import _parser

    forms = {"node": build_parser(), "hosts": _parser()}
    declared = {form: {tuple(a.option_strings): a for a in p._actions if a.option_strings} for form, p in forms.items()}
    for name, flag in SHARED_FLAGS.items():
        for form, actions in declared.items():
            action = actions[flag.names]
            assert action.default == flag.default and action.help == flag.help[form], (name, form)
    common = set(declared["node"]) & set(declared["hosts"]) - {("-h", "--help")}
    assert common == {f.names for f in SHARED_FLAGS.values()}


def test_one_table_says_which_options_each_face_applies() -> None:
    """The DDP hook refuses, by `config.rules.FACE_OPTIONS`, exactly the switches it cannot run
    (each alone, named in the error with the fix); the Horovod row is the Horovod optimizer's."""
    from fleetlike.config import DistributedStrategy
    from fleetlike.config.rules import FACE_OPTIONS
    from fleetlike.ddp import FleetHookState

    features = ["localsgd", "adaptive_localsgd", "amp", "recompute", "gradient_merge", "use_hierarchical_allreduce",
                "fuse_all_reduce_ops", "fp16_allreduce", "gossip", "sharding", "sync_batch_norm",
                "find_unused_parameters", "check_nan_inf", "slow_rank_check", "auto_tune"]
    assert FACE_OPTIONS["ddp"].honours <= set(features) and FACE_OPTIONS["horovod"].honours <= set(features)
    refused = []
    for name in features:
        s = DistributedStrategy()
        setattr(s, name, True)
        try:
            FleetHookState(s).close()
        except ValueError as exc:
            assert f"strategy.{name}=True" in str(exc) and "Fix: " in str(exc), exc
            refused.append(name)
    assert sorted(refused) == sorted(set(features) - FACE_OPTIONS["ddp"].honours)
    assert set(refused) == {"localsgd", "adaptive_localsgd", "sharding", "amp", "recompute", "sync_batch_norm"}
