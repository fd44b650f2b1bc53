"""The online tuner (strategy.auto_tune, FLEETLIKE_AUTOTUNE, HOROVOD_AUTOTUNE) and Horovod's variables.

The search itself runs on one process with a made-up clock (which setting is fast is then
known); real gloo ranks check what only ranks show: every rank switches to the same setting
even when one rank's clock says otherwise, and a tuned job ends with exactly the parameters of
the same job run with the chosen setting from its first step (fp32 over 2 ranks: a bucket's sum
of two values is the same whatever the bucket layout or communicator, so the equality is
bitwise), in Fleet's eager and program styles and in a Horovod script driven by HOROVOD_*.
"""

from __future__ import annotations

import contextlib
import csv
import math
import random
import json
import os

import pytest
import torch

from dp_common import batch, loss_fn, make_model, make_opt
from fleetlike import DistributedStrategy, Executor, fleet
from fleetlike.comm.single import SingleCommunicator
from fleetlike.horovod import env as hvd_env
from fleetlike.testing import run_ranks
from fleetlike.tune import LOG_COLUMNS, Knob, OnlineTuner, Setting, fixed_knobs, knob_values, requested

STEPS = 30
#: short trials counted in steps (seconds_per_trial=0): the tests check agreement and equality, not
#: speed; one trial per candidate (race_blocks=1: 2-step trials resolve nothing, so every comparison
#: would race to its budget); the races across real ranks: the skewed-clock test
TUNE = {"auto_tune": True, "auto_tune_configs": {"steps_per_trial": 2, "warmup_steps": 1, "seconds_per_trial": 0,
                                                 "race_blocks": 1}}
RACE = {"auto_tune": True, "auto_tune_configs": {"steps_per_trial": 2, "warmup_steps": 1, "seconds_per_trial": 0}}
#: sizes of dp_common's model's gradients (bytes, parameter order)
SIZES = [16 * 24 * 4, 24 * 4, 24 * 3 * 4, 3 * 4]


# ------------------------------------------------------------------ the search, one process

class _FakeClock:
    """Each step takes ``cost(setting)`` seconds of the tuner's current setting."""

    def __init__(self, cost):
        self.t, self.cost, self.tuner = 0.0, cost, None

    def __call__(self) -> float:
        return self.t

    def step(self) -> None:
        self.t += self.cost(self.tuner.current)
        self.tuner.step_done()


def _tuner(cost, strategy=None, **kw):
    applied = []
    clock = _FakeClock(cost)
    s = strategy or DistributedStrategy(**TUNE)
    t = OnlineTuner(SingleCommunicator(), s, param_bytes=kw.pop("param_bytes", SIZES),
                    two_level_ok=kw.pop("two_level_ok", False),
                    apply=applied.append, clock=clock, **kw)
    clock.tuner = t
    return t, clock, applied


def test_search_finds_the_fastest_setting_and_logs_it(tmp_path):
    # fastest with the smallest buckets: the coordinate search must walk there, then stop
    log = tmp_path / "autotune.csv"
    t, clock, applied = _tuner(lambda s: 0.01 + s.bucket_mb, log_path=log)
    for _ in range(60):
        clock.step()
    assert t.done
    smallest = min(v for v in t.values[Knob.BUCKET_MB])
    assert t.best.setting.bucket_mb == smallest and t.current == t.best.setting
    assert applied[-1] == t.best.setting
    # every bucket size (a winner confirmed against the start timed again right after it), then 2
    # communicators at the best one (it has several buckets), then the joint phase's one new pair:
    # the runner-up bucket size with 2 communicators
    start, first, *rest = t.values[Knob.BUCKET_MB]
    assert [tr.setting.bucket_mb for tr in t.trials] == [start, first, start, *rest, smallest, *rest]
    assert [(tr.setting.comm_num, tr.phase) for tr in t.trials][-2:] == [(2, "one_knob"), (2, "joint")]
    # the first step, the warm-up trial, then per trial 1 unmeasured + 2 measured steps
    assert t.tuning_steps == 1 + (1 + len(t.trials)) * 3
    rows = list(csv.DictReader(open(log)))
    assert list(rows[0]) == list(LOG_COLUMNS) and list(LOG_COLUMNS[:5]) == [
        "hierarchical_allreduce", "hierarchical_allgather", "cycle_time_ms", "tensor_fusion_threshold", "score"]
    assert len(rows) == len(t.trials) + 1 and rows[-1]["best"] == "1" and first == smallest
    assert float(rows[-1]["tensor_fusion_threshold"]) == smallest
    assert float(rows[-1]["steps_per_s"]) == pytest.approx(1 / (0.01 + smallest), rel=1e-3)
    assert "chose flat" in t.summary() and "fixed knobs: wire_dtype" in t.summary()


def test_the_joint_phase_finds_a_pair_neither_knob_finds_alone(tmp_path):
    # 16 MB buckets alone and 2 communicators alone are each 1 % faster than the start (32 MB x1):
    # below min_gain (2 %), so the one-knob passes keep the start; together they are 10 % faster.
    # 64 MB alone is 1.5 % faster, but it is one bucket: two communicators there are redundant, so
    # the runner-up bucket size of the joint phase is 16 MB
    sizes = [4 << 20] * 12  # 48 MB of gradients: two buckets at 32 MB, three at 16, one at 64
    cost = {(32.0, 1): 0.0100, (16.0, 1): 0.0099, (64.0, 1): 0.00985, (32.0, 2): 0.0099, (16.0, 2): 0.0090}
    log = tmp_path / "autotune.csv"
    t, clock, applied = _tuner(lambda s: cost.get((s.bucket_mb, s.comm_num), 0.0105), param_bytes=sizes,
                               log_path=log)
    for _ in range(200):
        clock.step()
    assert t.done
    pair = Setting(t.start.mode, 16.0, 2, "native")
    assert t.best.setting == pair and t.current == pair and applied[-1] == pair
    # only the pair was new in the joint phase (16 x1 and 32 x2 were measured one knob at a time),
    # and its win was confirmed against the incumbent timed again
    joint = [tr.setting for tr in t.trials if tr.phase == "joint"]
    assert joint == [pair, t.start]
    one_knob = [tr.setting for tr in t.trials if tr.phase == "one_knob"]
    assert pair not in one_knob and {(s.bucket_mb, s.comm_num) for s in one_knob} >= {(16.0, 1), (32.0, 2)}
    rows = list(csv.DictReader(open(log)))
    assert [r["phase"] for r in rows[-3:]] == ["joint", "joint", "joint"] and rows[-1]["best"] == "1"
    assert float(rows[-1]["tensor_fusion_threshold"]) == 16.0 and rows[-1]["nccl_comm_num"] == "2"


def test_the_joint_phase_never_moves_a_fixed_knob():
    # the same costs with the communicators fixed by the user: no joint phase, the start's count stays
    s = DistributedStrategy(auto_tune=True, nccl_comm_num=1,
                            auto_tune_configs={"steps_per_trial": 2, "warmup_steps": 1, "seconds_per_trial": 0})
    cost = {(32.0, 1): 0.0100, (16.0, 1): 0.0099, (32.0, 2): 0.0099, (16.0, 2): 0.0090}
    t, clock, _ = _tuner(lambda st: cost.get((st.bucket_mb, st.comm_num), 0.0105), strategy=s,
                         param_bytes=[4 << 20] * 12)
    for _ in range(200):
        clock.step()
    assert t.done and Knob.COMM_NUM not in t.values
    assert {tr.setting.comm_num for tr in t.trials} == {1} and not [tr for tr in t.trials if tr.phase == "joint"]


def test_a_gain_below_min_gain_keeps_the_start():
    t, clock, applied = _tuner(lambda s: 0.0100 if s.bucket_mb == 32 else 0.0099)  # 1 % faster: noise
    for _ in range(60):
        clock.step()
    assert t.done and t.best.setting == t.start and applied[-1] == t.start


def test_a_lead_within_the_noise_is_raced_and_a_clear_loss_costs_one_trial(tmp_path):
    # each step's time is its setting's time x lognormal noise (sd 8%, seeded): 16 MB buckets are
    # 8% faster than the start (32 MB), within what two 5-step trials resolve; 0.25 and 64 MB are
    # 3x slower, the other sizes as fast as the start.
    # The tuner re-runs 16 MB and the start in alternating trials until the lead is resolved (or
    # the budget, 3 each), keeps 16 MB, and gives the clear loser one trial, as before racing
    rng = random.Random(3)
    base = {16.0: 0.0092, 0.25: 0.0300, 64.0: 0.0300}
    s = DistributedStrategy(auto_tune=True, nccl_comm_num=1,
                            auto_tune_configs={"steps_per_trial": 5, "warmup_steps": 1, "seconds_per_trial": 0})
    log = tmp_path / "autotune.csv"
    t, clock, applied = _tuner(lambda st: base.get(st.bucket_mb, 0.0100) * math.exp(rng.gauss(0, 0.08)), strategy=s,
                               param_bytes=[4 << 20] * 12, log_path=log)
    assert {0.25, 16.0, 64.0} <= set(t.values[Knob.BUCKET_MB])
    for _ in range(600):
        clock.step()
    assert t.done and t.best.setting.bucket_mb == 16.0 and applied[-1] == t.best.setting == t.current
    by = {}
    for tr in t.trials:
        by.setdefault(tr.setting.bucket_mb, []).append(tr)
    assert t.extended_races >= 1 and len(by[16.0][0].step_times) > 5  # raced: several trials of 5 steps
    assert by[16.0][0].verdict.startswith("faster")
    for loser in (0.25, 64.0):
        assert [len(tr.step_times) for tr in by[loser]] == [5] and by[loser][0].verdict == "not_faster"
    rows = list(csv.DictReader(open(log)))
    row16 = next(r for r in rows if float(r["tensor_fusion_threshold"]) == 16.0)
    assert int(row16["measured_steps"]) == len(by[16.0][0].step_times) and "+-" in row16["vs_best"]
    assert "re-run where the lead was within the noise" in t.summary()


def test_fixed_knobs_are_never_tuned():
    s = DistributedStrategy(auto_tune=True, fuse_grad_size_in_MB=8,
                            auto_tune_configs={"fixed": ["comm_num"], "seconds_per_trial": 0})
    assert fixed_knobs(s) == {Knob.BUCKET_MB, Knob.COMM_NUM, Knob.WIRE_DTYPE}
    t, clock, _ = _tuner(lambda s: 0.01, strategy=s, two_level_ok=True)
    assert set(t.values) == {Knob.ALLREDUCE_MODE}
    for _ in range(20):
        clock.step()
    assert {tr.setting.bucket_mb for tr in t.trials} == {8} and {tr.setting.comm_num for tr in t.trials} == {1}
    # the wire dtype only where 16-bit is allowed, and never when fp16_allreduce is set
    allow = DistributedStrategy(auto_tune=True, auto_tune_configs={"allow_16bit_wire": True})
    assert knob_values(allow, param_bytes=SIZES, two_level_ok=False, fixed=fixed_knobs(allow))[Knob.WIRE_DTYPE] == [
        "native", "float16", "bfloat16"]
    allow.fp16_allreduce = True
    assert Knob.WIRE_DTYPE in fixed_knobs(allow)
    with pytest.raises(ValueError, match=r"auto_tune_configs.fixed=\['bucket'\].*Fix: use some of"):
        fixed_knobs(DistributedStrategy(auto_tune=True, auto_tune_configs={"fixed": ["bucket"]}))


def test_setting_round_trips_through_the_strategy():
    s = Setting.of(DistributedStrategy())
    other = Setting(s.mode, 4.0, 2, "bfloat16")
    st = other.applied_to(DistributedStrategy(amp=True))
    assert Setting.of(st) == other and st.amp and st.fp16_allreduce_configs["dtype"] == "bfloat16"


def test_the_environment_switches():
    s = DistributedStrategy()
    assert requested(s, {}) is None and requested(s, {"FLEETLIKE_AUTOTUNE": "0"}) is None
    assert requested(s, {"FLEETLIKE_AUTOTUNE": "1"}).auto_tune and not s.auto_tune
    with pytest.raises(ValueError, match="FLEETLIKE_AUTOTUNE='yes please'.*Fix"):
        requested(s, {"FLEETLIKE_AUTOTUNE": "yes please"})


def test_horovod_variables_act_with_horovods_units_or_are_refused():
    env = hvd_env.read({"HOROVOD_FUSION_THRESHOLD": str(8 << 20), "HOROVOD_HIERARCHICAL_ALLREDUCE": "1",
                        "HOROVOD_AUTOTUNE": "1", "HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE": "7",
                        "HOROVOD_AUTOTUNE_WARMUP_SAMPLES": "2", "HOROVOD_CYCLE_TIME": "0"})
    s = env.apply(DistributedStrategy())
    assert s.fuse_grad_size_in_MB == 8 and s.use_hierarchical_allreduce and s.auto_tune
    assert s.auto_tune_configs["steps_per_trial"] == 7 and s.auto_tune_configs["warmup_steps"] == 2
    assert set(env.fixed) == {"bucket_mb", "allreduce_mode"}
    off = hvd_env.read({"HOROVOD_FUSION_THRESHOLD": "0"}).apply(DistributedStrategy())
    assert not off.fuse_all_reduce_ops and off.bucket_cap_bytes() is None
    for name, value in [("HOROVOD_CYCLE_TIME", "5"), ("HOROVOD_HIERARCHICAL_ALLGATHER", "1"),
                        ("HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES", "20"),
                        ("HOROVOD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE", "0.8"), ("HOROVOD_TIMELINE_MARK_CYCLES", "1")]:
        with pytest.raises(ValueError, match=f"{name}='{value}' is not supported"):
            hvd_env.read({name: value})
    with pytest.raises(ValueError, match=r"HOROVOD_FUSION_THRESHOLD='64MB': expected an integer >= 0 bytes"):
        hvd_env.read({"HOROVOD_FUSION_THRESHOLD": "64MB"})


# ------------------------------------------------------------------ real ranks

def _unit():
    return next(u for u in fleet._engines()[-1].units if u.name == "auto_tune")


def _fleet_job(role, style, options, skew_rank=None, steps=STEPS):
    fleet.init(role)
    try:
        model = make_model(100 + role.rank)
        opt = make_opt("adam", model)
        s = DistributedStrategy(**options)
        if style == "program":
            fleet.distributed_optimizer(opt, s).minimize(loss_fn, model)
            exe = Executor()
            exe.run(fleet.startup_program)
            step = lambda i: exe.run(fleet.main_program, feed=batch(i, role.rank), fetch_list=["loss"])  # noqa: E731
        else:
            model = fleet.distributed_model(model, strategy=s)
            dopt = fleet.distributed_optimizer(opt, s)

            def step(i):
                loss_fn(model, batch(i, role.rank)).backward()
                dopt.step()
                dopt.zero_grad()
        step(0)  # the eager style builds its engine at the first forward
        tuner = _unit().tuner if s.auto_tune else None
        if tuner is not None and role.rank == skew_rank:
            # this rank's clock says the starting setting is 20x slower than it is: alone, it
            # would leave it; the ranks must still agree on one choice
            real = tuner.clock
            state = {"fake": real(), "last": real()}

            def skewed():
                now = real()
                state["fake"] += (now - state["last"]) * (20.0 if tuner.current == tuner.start else 1.0)
                state["last"] = now
                return state["fake"]
            tuner.clock = skewed
        for i in range(1, steps):
            step(i)
        out = {"params": [p.detach().clone() for p in model.parameters()],
               "applied": [str(e) for e in fleet.applied_strategy()]}
        if tuner is not None:
            out.update(chosen=tuner.current, done=tuner.done, trials=[(t.setting, t.step_times) for t in tuner.trials],
                       buckets=len(fleet._engines()[-1].ctx.reducer.buckets))
        return out
    finally:
        fleet.shutdown()


def _fixed(setting: Setting) -> dict:
    return setting.applied_to(DistributedStrategy()).to_dict(non_default_only=True)


@pytest.mark.parametrize("style", ["eager", "program"])
def test_tuned_job_equals_the_chosen_setting_fixed_from_the_start(style):
    tuned = run_ranks(_fleet_job, 2, style, TUNE, timeout=120)
    a, b = tuned
    assert a["done"] and a["chosen"] == b["chosen"] and a["trials"] == b["trials"]
    assert len(a["trials"]) >= 2
    assert any("auto_tune: applied (chose " in line for line in a["applied"])
    fixed = run_ranks(_fleet_job, 2, style, _fixed(a["chosen"]), timeout=120)
    for got, want in zip(a["params"], fixed[0]["params"]):
        assert torch.equal(got, want)  # bitwise: fp32, two ranks
    for got, want in zip(a["params"], b["params"]):
        assert torch.equal(got, want)


def test_every_rank_takes_the_same_decision_when_one_rank_measures_differently():
    # with races (the default race_blocks): close candidates re-run in alternating trials, each
    # move taken from the max-reduced times, so the same on every rank
    a, b = run_ranks(_fleet_job, 2, "eager", RACE, skew_rank=1, steps=120, timeout=120)
    assert a["trials"] == b["trials"]  # the max-reduced step times: the same numbers everywhere
    assert a["done"] and b["done"] and a["chosen"] == b["chosen"] and a["buckets"] == b["buckets"]
    assert any(len(times) > 2 for _, times in a["trials"])  # some comparison was re-run
    assert a["chosen"] != a["trials"][0][0]  # rank 1's slow start counted on rank 0 too
    for got, want in zip(a["params"], b["params"]):
        assert torch.equal(got, want)


@contextlib.contextmanager
def horovod_script(role, env):
    """A Horovod script's setup under ``env`` (its launch line): ``(hvd, model, optimizer, step)``,
    ``step(i)`` one training step on batch ``i``; shut down and the variables removed after."""
    os.environ.update(env)
    import fleetlike.horovod as hvd

    hvd.init(role_maker=role)
    try:
        model = make_model(100 + hvd.rank())
        opt = hvd.DistributedOptimizer(make_opt("adam", model), named_parameters=model.named_parameters())
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)

        def step(i):
            opt.zero_grad()
            loss_fn(model, batch(i, hvd.rank())).backward()
            opt.step()
        yield hvd, model, opt, step
    finally:
        hvd.shutdown()
        for k in env:
            os.environ.pop(k, None)


def _horovod_job(role, tmp, env):
    with horovod_script(role, env) as (hvd, model, opt, step):
        for i in range(STEPS):
            step(i)
        tuner = opt.tuner
        return {"params": [p.detach().clone() for p in model.parameters()],
                "applied": [str(e) for e in opt.applied_strategy()],
                "chosen": tuner.current if tuner else None, "done": tuner.done if tuner else None,
                "trials": [t.setting for t in tuner.trials] if tuner else None, "buckets": len(opt.reducer.buckets)}


def test_horovod_script_tunes_from_its_launch_line(tmp_path):
    log, trace = tmp_path / "autotune.csv", tmp_path / "timeline.json"
    env = {"HOROVOD_AUTOTUNE": "1", "HOROVOD_AUTOTUNE_LOG": str(log), "HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE": "2",
           "HOROVOD_AUTOTUNE_WARMUP_SAMPLES": "1", "HOROVOD_TIMELINE": str(trace),
           "FLEETLIKE_STRATEGY": json.dumps({"auto_tune_configs": {"seconds_per_trial": 0, "race_blocks": 1}})}
    a, b = run_ranks(_horovod_job, 2, str(tmp_path), env, timeout=120)
    assert a["done"] and a["chosen"] == b["chosen"]
    assert any(line.startswith("auto_tune: applied (chose ") for line in a["applied"])
    assert "horovod_env: applied (HOROVOD_AUTOTUNE=1)" in a["applied"]
    rows = list(csv.DictReader(open(log)))
    assert list(rows[0])[:5] == ["hierarchical_allreduce", "hierarchical_allgather", "cycle_time_ms",
                                 "tensor_fusion_threshold", "score"]
    assert rows[-1]["best"] == "1" and float(rows[-1]["tensor_fusion_threshold"]) == a["chosen"].bucket_mb
    events = json.load(open(trace))["traceEvents"]
    assert any(e["tid"] == "gradient bucket 0" and e["name"] == "ALLREDUCE" and e["ph"] == "X" for e in events)
    # the same script with the chosen setting fixed from the start, by Horovod's own variable
    fixed_env = {"HOROVOD_FUSION_THRESHOLD": str(int(a["chosen"].bucket_mb * (1 << 20))),
                 "HOROVOD_HIERARCHICAL_ALLREDUCE": "1"}  # acts, and says why one node stays flat
    if a["chosen"].comm_num != 1:
        fixed_env["FLEETLIKE_STRATEGY"] = json.dumps({"nccl_comm_num": a["chosen"].comm_num})
    f0, _ = run_ranks(_horovod_job, 2, str(tmp_path), fixed_env, timeout=120)
    assert f0["buckets"] == a["buckets"]
    assert f"horovod_env: applied (HOROVOD_FUSION_THRESHOLD={fixed_env['HOROVOD_FUSION_THRESHOLD']})" in f0["applied"]
    assert any(line.startswith("use_hierarchical_allreduce: NOT applied (one node") for line in f0["applied"])
    for got, want in zip(a["params"], f0["params"]):
        assert torch.equal(got, want)


def test_a_knob_written_out_at_its_default_is_never_tuned_in_fleet_and_horovod(tmp_path):
    # Fleet: fuse_grad_size_in_MB = 32 (the default) written in the script
    a, b = run_ranks(_fleet_job, 2, "eager", {**TUNE, "fuse_grad_size_in_MB": 32}, timeout=120)
    assert a["done"] and a["chosen"] == b["chosen"] and a["trials"]
    assert {t[0].bucket_mb for t in a["trials"]} == {32.0}
    assert any("bucket_mb (fuse_grad_size_in_MB=32 set explicitly)" in line for line in a["applied"])
    # Horovod: HOROVOD_FUSION_THRESHOLD exported at Horovod's default (64 MiB) beside HOROVOD_AUTOTUNE=1
    env = {"HOROVOD_AUTOTUNE": "1", "HOROVOD_FUSION_THRESHOLD": str(64 << 20), "HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE": "2",
           "HOROVOD_AUTOTUNE_WARMUP_SAMPLES": "1", "FLEETLIKE_STRATEGY": json.dumps({"auto_tune_configs": {"seconds_per_trial": 0, "race_blocks": 1}})}
    h, g = run_ranks(_horovod_job, 2, str(tmp_path), env, timeout=120)
    assert h["done"] and h["chosen"] == g["chosen"] and h["trials"]
    assert {t.bucket_mb for t in h["trials"]} == {64.0}
    assert any(f"bucket_mb (HOROVOD_FUSION_THRESHOLD={64 << 20} set explicitly)" in line for line in h["applied"])


def _ddp_model(seed):
    # over 1 MiB of gradients: DDP's first bucket holds at most 1 MiB, so there are several
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 20000), torch.nn.Tanh(), torch.nn.Linear(20000, 3))


def _ddp_job(role, rendezvous, options):
    from torch.nn.parallel import DistributedDataParallel as DDP

    import fleetlike.auto as auto
    from dp_common import torch_group
    from fleetlike.ddp import register

    env = {"FLEETLIKE_AUTOTUNE": "1", "FLEETLIKE_AUTOTUNE_LOG": f"{rendezvous}.csv",
           "FLEETLIKE_STRATEGY": json.dumps({"auto_tune_configs": TUNE["auto_tune_configs"]})} if options is None else {}
    os.environ.update(env)
    with torch_group(role, rendezvous):
        try:
            if options is None:  # an unchanged DDP script under fleetlike.auto, tuned from the environment
                auto.install(env)  # FLEETLIKE_STRATEGY: short trials
                ddp = DDP(_ddp_model(100 + role.rank), bucket_cap_mb=0.25)
                state = auto.settings().by_param[id(next(ddp.parameters()))]
            else:  # the same job with the chosen setting fixed from the start
                ddp = DDP(_ddp_model(100 + role.rank), bucket_cap_mb=0.25)
                state = register(ddp, DistributedStrategy(**options))
            opt = make_opt("adam", ddp)
            for i in range(STEPS):
                loss_fn(ddp, batch(i, role.rank)).backward()
                opt.step()
                opt.zero_grad()
            tuner = state.tuning.tuner if state.tuning is not None else None
            return {"params": [p.detach().clone() for p in ddp.parameters()],
                    "chosen": tuner.current if tuner else None, "done": tuner.done if tuner else None,
                    "trials": [(t.setting, t.step_times) for t in tuner.trials] if tuner else None}
        finally:
            auto.uninstall()
            for k in env:
                os.environ.pop(k, None)


def test_ddp_through_fleetlike_auto_tunes_its_hook(tmp_path):
    a, b = run_ranks(_ddp_job, 2, str(tmp_path / "rdv"), None, timeout=120)
    assert a["done"] and a["chosen"] == b["chosen"] and a["trials"] == b["trials"]
    assert {t[0].comm_num for t in a["trials"]} == {1, 2}  # DDP's buckets stay: communicators are tuned
    assert {t[0].bucket_mb for t in a["trials"]} == {32.0}
    rows = list(csv.DictReader(open(tmp_path / "rdv.csv")))
    assert rows[-1]["best"] == "1" and int(rows[-1]["nccl_comm_num"]) == a["chosen"].comm_num
    f0, _ = run_ranks(_ddp_job, 2, str(tmp_path / "rdv2"), _fixed(a["chosen"]), timeout=120)
    for got, want in zip(a["params"], f0["params"]):
        assert torch.equal(got, want)


def test_trials_last_seconds_per_trial_at_the_first_trials_speed():
    s = DistributedStrategy(auto_tune=True, auto_tune_configs={"steps_per_trial": 2, "seconds_per_trial": 0.1})
    t, clock, _ = _tuner(lambda st: 0.01, strategy=s)
    for _ in range(4):  # the first step, 1 unmeasured, 2 measured: the warm-up trial ends
        clock.step()
    assert len(t.trials) == 0 and t.per_trial == 10  # 0.1 s of 10 ms steps, for every later trial
    for _ in range(11):
        clock.step()
    assert len(t.trials) == 1 and len(t.trials[0].step_times) == 10 and t.trials[0].setting == t.start


def test_a_pause_keeps_the_gap_out_of_every_trial_and_stop_ends_the_search(tmp_path):
    from fleetlike.tune import REFORMED, agreed_after_reform

    t, clock, _ = _tuner(lambda st: 0.01, log_path=tmp_path / "log.csv")
    world = SingleCommunicator()
    assert agreed_after_reform(t, world) is None  # no step yet: a new world tunes afresh
    for _ in range(6):  # the first step, the warm-up trial's 3, then the start's unmeasured one and 1 measured
        clock.step()
    t.pause()  # hvd.join: steps ran that nobody ticked
    clock.t += 100.0
    for _ in range(5):
        clock.step()
    assert t.trials and max(x for tr in t.trials for x in tr.step_times) < 1.0
    assert not t.done and agreed_after_reform(t, world) == t.current
    t.stop(t.current, REFORMED)
    assert t.done and t.stopped == REFORMED and t.summary().startswith(f"stopped with {t.current.label()}: ")
    steps, trials = t.steps, len(t.trials)
    clock.step()  # no more trials after a stop
    assert t.steps == steps + 1 and len(t.trials) == trials
    rows = list(csv.DictReader(open(tmp_path / "log.csv")))
    assert len(rows) == len(t.trials) and all(r["best"] == "0" for r in rows)  # nothing was chosen


def _per_step(role):
    """After its decision a tuned job runs the fixed job's path: per step, the same collectives
    and bytes on the same kind of buckets, and no call into the tuner."""
    fleet.init(role)
    try:
        def job(options):
            model = make_model(100 + role.rank)
            s = DistributedStrategy(**options)
            model = fleet.distributed_model(model, strategy=s)
            dopt = fleet.distributed_optimizer(make_opt("adam", model), s)

            def step(i):
                loss_fn(model, batch(i, role.rank)).backward()
                dopt.step()
                dopt.zero_grad()
            step(0)
            return step, fleet._engines()[-1]

        tuned, engine = job(TUNE)
        unit = next(u for u in engine.units if u.name == "auto_tune")
        for i in range(1, 200):
            if unit.tuner.done:
                break
            tuned(i)
        calls = {"step_done": 0}
        real = unit.tuner.step_done

        def counted():
            calls["step_done"] += 1
            real()
        unit.tuner.step_done = counted
        fixed, fixed_engine = job(_fixed(unit.tuner.current))
        world = fleet.context().groups.world
        out = {"done": unit.tuner.done}
        for name, step, eng in (("tuned", tuned, engine), ("fixed", fixed, fixed_engine)):
            red = eng.ctx.reducer
            comms = {id(c): c for c in (world, red.collective.world)}
            before = [dict(c.stats.calls) for c in comms.values()], red.collectives_issued, red.bytes_issued
            for i in range(4):
                step(i)
            after = [dict(c.stats.calls) for c in comms.values()], red.collectives_issued, red.bytes_issued
            out[name] = {
                "comm_calls": [{k: v - b.get(k, 0) for k, v in a.items() if v != b.get(k, 0)}
                               for a, b in zip(after[0], before[0])],
                "issued": after[1] - before[1], "bytes": after[2] - before[2],
                "layout": [[tuple(p.shape) for p in b.params] for b in red.buckets],
                "buckets": [(b.numel, b.nbytes, b.dtype) for b in red.buckets],
                "collective": type(red.collective).__name__, "comms": len(getattr(red.collective, "comms", [0])),
                "grads_are_views": all(p.grad is v for b in red.buckets for p, v in zip(b.params, b.views))}
        out["step_done_after_decision"] = calls["step_done"]
        return out
    finally:
        fleet.shutdown()


def test_after_its_decision_a_tuned_job_runs_exactly_the_fixed_jobs_path():
    for got in run_ranks(_per_step, 2, timeout=120):
        assert got["done"]
        assert got["step_done_after_decision"] == 0  # the tuner is out of the step
        tuned, fixed = got["tuned"], got["fixed"]
        assert tuned["issued"] == fixed["issued"] > 0 and tuned["bytes"] == fixed["bytes"]
        assert tuned["comm_calls"] == fixed["comm_calls"]  # no allreduce of step times left
        assert tuned["layout"] == fixed["layout"] and tuned["buckets"] == fixed["buckets"]
        assert (tuned["collective"], tuned["comms"]) == (fixed["collective"], fixed["comms"])
        assert tuned["grads_are_views"] and fixed["grads_are_views"]
