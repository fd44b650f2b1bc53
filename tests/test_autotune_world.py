"""The online tuner when the Horovod world changes under it: ``hvd.join`` and an elastic re-form.

Both run on 2 real gloo ranks with Horovod's variables (``HOROVOD_AUTOTUNE=1``, 2-step trials).

- Uneven data with ``hvd.join()`` every epoch while tuning: the ranks that keep stepping stop
  ticking the tuner, every rank restarts its clock at the join's end, so no measured step spans
  the join (rank 1 sleeps 0.4 s in each step the other rank sits out) and every rank takes the
  same decisions; the parameters equal the same job with the chosen setting fixed from the start
  (fp32, 2 ranks: bitwise).
- A world re-formed mid-tuning (the Horovod runtime following a new world, as
  `fleetlike.elastic.run` makes it, with rank 1 holding a fresh tuner as a rank that joins the
  job does): every rank keeps the setting rank 0 was running and tuning stops, saying why; the
  job goes on with equal buckets and ends with the parameters of the same job run with that
  setting fixed.
"""

from __future__ import annotations

import json
import time

import torch

from fleetlike.testing import run_ranks
from test_autotune import horovod_script
from fleetlike.tune import REFORMED, Setting

ENV = {"HOROVOD_AUTOTUNE": "1", "HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE": "2", "HOROVOD_AUTOTUNE_WARMUP_SAMPLES": "1",
       "FLEETLIKE_STRATEGY": json.dumps({"auto_tune_configs": {"seconds_per_trial": 0, "race_blocks": 1}})}
EPOCHS, COMMON = 8, 5  # rank r takes COMMON + 2 r steps per epoch
GAP = 0.4  # seconds per step rank 1 takes alone


def _fixed_env(setting: Setting) -> dict:
    return {"FLEETLIKE_STRATEGY": json.dumps({"fuse_grad_size_in_MB": setting.bucket_mb,
                                              "nccl_comm_num": setting.comm_num})}


def _join_job(role, env):
    with horovod_script(role, env) as (hvd, model, opt, step):
        for epoch in range(EPOCHS):
            for i in range(COMMON + 2 * hvd.rank()):
                step(epoch * 100 + i)
                if i >= COMMON and opt.tuner is not None:
                    time.sleep(GAP)  # the other rank has joined: a gap no measured step may span
            hvd.join()
        t = opt.tuner
        return {"params": [p.detach().clone() for p in model.parameters()],
                "chosen": t.current if t else None, "done": t.done if t else None,
                "trials": [(x.setting, x.step_times) for x in t.trials] if t else None}


def test_join_while_tuning_pauses_the_clock_on_every_rank():
    a, b = run_ranks(_join_job, 2, ENV, timeout=180)
    assert a["done"] and b["done"] and a["chosen"] == b["chosen"]
    assert a["trials"] == b["trials"] and len(a["trials"]) >= 3
    assert max(t for _, times in a["trials"] for t in times) < GAP  # no join inside a measured step
    fixed = run_ranks(_join_job, 2, _fixed_env(a["chosen"]), timeout=180)
    for rank, (tuned, same) in enumerate(zip((a, b), fixed)):  # each rank (a joined rank does not step)
        for i, (got, want) in enumerate(zip(tuned["params"], same["params"])):
            assert torch.equal(got, want), (f"rank {rank} parameter {i}: max diff {(got - want).abs().max().item()}; "
                                            f"chosen {a['chosen'].label()}; trials {a['trials']}")


BEFORE, AFTER = 12, 10


def _reform_job(role, env, reform):
    from fleetlike.horovod import runtime as hvd_runtime

    with horovod_script(role, env) as (hvd, model, opt, step):
        for i in range(BEFORE):
            step(i)
        out = {}
        if reform:
            out["before"] = opt.tuner.current
            out["done_before"] = opt.tuner.done
            if hvd.rank() == 1:  # a rank that joins the job: a fresh tuner at the start setting
                opt.user_defined_strategy = opt.tuner.start.applied_to(opt.user_defined_strategy)
                opt.tuner = opt._new_tuner(opt._rt)
            hvd_runtime._follow_world()  # what fleetlike.elastic.run does once the world re-formed
        for i in range(BEFORE, BEFORE + AFTER):
            step(i)
        t = opt.tuner
        out.update(params=[p.detach().clone() for p in model.parameters()], buckets=len(opt.reducer.buckets),
                   chosen=t.current if t else None, stopped=t.stopped if t else None,
                   setting=Setting.of(opt.user_defined_strategy), applied=[str(e) for e in opt.applied_strategy()])
        return out


def test_a_world_reformed_while_tuning_keeps_the_agreed_setting_on_every_rank():
    a, b = run_ranks(_reform_job, 2, ENV, True, timeout=180)
    assert not a["done_before"]  # the re-form came mid-search
    kept = a["before"]
    assert a["chosen"] == b["chosen"] == a["setting"] == b["setting"] == kept
    assert a["stopped"] == b["stopped"] == REFORMED and a["buckets"] == b["buckets"]
    assert any(line.startswith(f"auto_tune: applied (stopped with {kept.label()}") for line in b["applied"])
    f, _ = run_ranks(_reform_job, 2, _fixed_env(kept), False, timeout=180)
    for got, want, other in zip(a["params"], f["params"], b["params"]):
        assert torch.equal(got, want) and torch.equal(got, other)
