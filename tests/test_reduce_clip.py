"""EPL's ``communication.gradients_reduce_method`` and ``communication.clip_after_allreduce`` in
plain data parallel (with gradient merge and AMP) and under sharding (its clip before the
reduce-scatter with AMP and gradient merge), program and eager style, on 2 gloo ranks,
against a single process that computes each rank's gradient itself and combines them by hand:

    after:  clip(reduce_r g_r, c)        before:  reduce_r clip(g_r, c)

with ``reduce`` the mean or the sum and ``clip(g, c) = g * min(1, c / (||g|| + 1e-6))`` over the
whole gradient (``torch.nn.utils.clip_grad_norm_``'s rule)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from dp_common import batch, make_model, max_diff, params
import fleetlike.epl as epl
from fleetlike import DistributedStrategy, Executor, fleet
from fleetlike.testing import run_ranks

STEPS, LR, CLIP, SCALE = 4, 0.1, 0.3, 128.0


def _loss(model, feed):
    return F.cross_entropy(model(feed["x"]).float(), feed["y"])


#: label -> (EPL keys plus fleetlike's clip_norm, k micro-steps per update, AMP float16, styles)
CASES = {
    "sum": ({"communication.gradients_reduce_method": "sum"}, 1, False, ("program", "eager")),
    "mean_after": ({"communication.clip_after_allreduce": True, "sharding_configs.clip_norm": CLIP}, 1, False,
                   ("program", "eager")),
    "mean_before": ({"communication.clip_after_allreduce": False, "sharding_configs.clip_norm": CLIP}, 1, False,
                    ("program", "eager")),
    "sum_after": ({"communication.gradients_reduce_method": "sum", "communication.clip_after_allreduce": True,
                   "sharding_configs.clip_norm": CLIP}, 1, False, ("eager",)),
    "sum_before": ({"communication.gradients_reduce_method": "sum", "sharding_configs.clip_norm": CLIP}, 1, False,
                   ("program", "eager")),
    "merge_before": ({"sharding_configs.clip_norm": CLIP, "gradient_merge": True,
                      "gradient_merge_configs": {"k_steps": 2, "avg": True}}, 2, False, ("program", "eager")),
    "merge_after": ({"communication.clip_after_allreduce": True, "sharding_configs.clip_norm": CLIP,
                     "gradient_merge": True, "gradient_merge_configs": {"k_steps": 2, "avg": True}}, 2, False, ("eager",)),
    "amp_before": ({"sharding_configs.clip_norm": CLIP, "amp.level": "O1", "amp.loss_scale": SCALE}, 1, True,
                   ("program", "eager")),
    "stage1_amp_before": ({"sharding": True, "sharding_configs.sharding_degree": 0, "sharding_configs.clip_norm": CLIP, "amp.level": "O1",
                         "amp.loss_scale": SCALE}, 1, True, ("eager",)),
    "stage1_merge_before_sum": ({"sharding": True, "sharding_configs.sharding_degree": 0, "communication.gradients_reduce_method": "sum",
                               "sharding_configs.clip_norm": CLIP, "gradient_merge": True,
                               "gradient_merge_configs": {"k_steps": 2, "avg": True}}, 2, False, ("program",)),
    "amp_after_sum": ({"communication.gradients_reduce_method": "sum", "communication.clip_after_allreduce": True,
                       "sharding_configs.clip_norm": CLIP, "amp.level": "O1", "amp.loss_scale": SCALE}, 1, True,
                      ("eager",)),
}


def _train(role, keys, micro, style):
    """The fleetlike run: ``STEPS`` updates of ``micro`` micro-steps each."""
    model = make_model(100 + role.rank)  # ranks start different: the broadcast fixes it
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    s = epl.Config(keys)
    s.fuse_grad_size_in_MB = 0.001  # several buckets: the clip must see all of them
    if style == "program":
        fleet.distributed_optimizer(opt, s).minimize(_loss, model)
        exe = Executor()
        exe.run(fleet.startup_program)
        for i in range(STEPS * micro):
            exe.run(fleet.main_program, feed=batch(i, role.rank), fetch_list=["loss"])
    else:
        wrapped = fleet.distributed_model(model, strategy=s)
        dopt = fleet.distributed_optimizer(opt, s)
        for i in range(STEPS * micro):
            _loss(wrapped, batch(i, role.rank)).backward()
            dopt.step()
            dopt.zero_grad()
    applied = [str(e) for e in fleet.applied_strategy()]
    return params(model), applied


def _all(role):
    out = {}
    for label, (keys, micro, _, styles) in CASES.items():
        for style in styles:
            with fleet.session(role, timeout=60):  # applied_strategy() is this case's alone
                out[(label, style)] = _train(role, keys, micro, style)
    return out


def _clip(grads, c):
    norm = math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads))
    coef = min(1.0, c / (norm + 1e-6))
    return [g * coef for g in grads], coef


def hand_reference(keys, *, world, model, feed, loss, steps, lr, micro=1, amp=False):
    """One process: each rank's gradient computed alone (``feed(i, rank)`` its i-th micro-batch),
    then reduced and clipped by hand as ``keys`` say, and an SGD step; returns the parameters
    and every clip coefficient."""
    cfg = DistributedStrategy.from_dict(keys).sharding_configs
    total = cfg["gradients_reduce_method"] == "sum"
    c, after = float(cfg["clip_norm"]), bool(cfg["clip_after_allreduce"])
    coefs = []
    for step in range(steps):
        local = []
        for r in range(world):
            acc = [torch.zeros_like(p) for p in model.parameters()]
            for m in range(micro):
                model.zero_grad()
                with torch.autocast("cpu", dtype=torch.float16, enabled=amp):
                    value = loss(model, feed(step * micro + m, r))
                (value * (SCALE if amp else 1.0)).backward()
                acc = [a + p.grad / (SCALE if amp else 1.0) for a, p in zip(acc, model.parameters())]
            local.append([a / micro for a in acc])  # gradient merge's avg
        if c > 0 and not after:
            clipped = [_clip(g, c) for g in local]
            local = [g for g, _ in clipped]
            coefs += [k for _, k in clipped]
        reduced = [sum(gs) / (1 if total else world) for gs in zip(*local)]
        if c > 0 and after:
            reduced, k = _clip(reduced, c)
            coefs.append(k)
        with torch.no_grad():
            for p, g in zip(model.parameters(), reduced):
                p -= lr * g
    return params(model), coefs


def reference(label, world=2):
    keys, micro, amp, _ = CASES[label]
    return hand_reference(keys, world=world, model=make_model(100), feed=batch, loss=_loss, steps=STEPS, lr=LR,
                          micro=micro, amp=amp)


@pytest.mark.timeout(180)
def test_reduce_method_and_clip_placement_equal_the_hand_reference(tmp_path):
    results = run_ranks(_all, 2, timeout=160)
    refs = {label: reference(label) for label in CASES}
    for label, (_, coefs) in refs.items():
        if coefs:  # the clip binds: some steps are scaled down, so its placement matters
            assert min(coefs) < 0.9, (label, coefs)
    for rank, ours in enumerate(results):
        for (label, style), (got, applied) in ours.items():
            tol = 1e-5 if CASES[label][2] else 1e-6
            assert max_diff(got, refs[label][0]) <= tol, (rank, label, style, max_diff(got, refs[label][0]))
            assert max_diff(got, results[0][(label, style)][0]) == 0.0, (rank, label, style)
            assert not any("has no effect" in a and "sharding_configs" in a for a in applied), applied
            keys = CASES[label][0]
            if keys.get("sharding"):  # sharding (stage 1) says it in its own line
                assert any(a.startswith("sharding: applied") and "clipped to global norm" in a for a in applied)
                continue
            if keys.get("communication.gradients_reduce_method") == "sum":
                assert "sharding_configs.gradients_reduce_method: applied (gradients summed over 2 ranks)" in applied
            if "sharding_configs.clip_norm" in keys:
                clip = next(a for a in applied if a.startswith("sharding_configs.clip_after_allreduce: applied"))
                assert ("after the allreduce" if keys.get("communication.clip_after_allreduce") else
                        "before the allreduce") in clip, clip
    # the four combinations are four different updates (each key acts)
    ours = results[0]
    for a, b in [("mean_after", "mean_before"), ("sum_after", "sum_before"), ("mean_before", "sum_before"),
                 ("merge_before", "merge_after")]:
        assert max_diff(ours[(a, "eager")][0], ours[(b, "eager")][0]) > 1e-4, (a, b)


def test_local_sgd_and_the_ddp_and_horovod_faces_refuse_what_they_cannot_apply():
    from fleetlike.config import rules

    for keys, words in [({"communication.gradients_reduce_method": "sum"}, "no gradient sum"),
                        ({"sharding_configs.clip_norm": 1.0}, "no before or after"),
                        ({"communication.clip_after_allreduce": True}, "no before or after")]:
        with pytest.raises(ValueError, match=words):
            rules.check(epl.Config({**keys, "localsgd": True}))
    s = epl.Config({"communication.gradients_reduce_method": "sum", "sharding_configs.clip_norm": 1.0})
    assert s.inactive_settings() == []  # they act in data parallel: not "sharding is False"
    assert "Only with sharding" not in DistributedStrategy.describe("sharding_configs.clip_after_allreduce")
    assert any("sharding_configs.segment_broadcast_MB" == i.name
               for i in epl.Config({"sharding_configs.segment_broadcast_MB": 8}).inactive_settings())
    for face, words in [("ddp", "clip_grad_norm_ after backward"), ("horovod", "op=hvd.Sum")]:
        keys = {"sharding_configs.clip_norm": 1.0} if face == "ddp" else {"communication.gradients_reduce_method": "sum"}
        with pytest.raises(ValueError, match=words):
            rules.refuse_unhonoured(epl.Config(keys), face)
        rules.refuse_unhonoured(epl.Config({"communication.clip_after_allreduce": True}), face)  # what they do
