"""``python -m fleetlike.plan``: predict each strategy's step time, bytes and memory; pick one.

Plan (on any machine; the cluster is described, not needed)::

    python -m fleetlike.plan --model bench.plan_models:mlp50m --batch_size 16 --cluster 2x2 \\
        --links links.json --memory 2GiB --allow localsgd --save strategy.json

Probe the real cluster first (under the launcher, every rank), which writes ``links.json``::

    python -m fleetlike.launch --cluster_node_ips=10.0.0.1,10.0.0.2 --nproc_per_node=2 \\
        -m fleetlike.plan --probe --links links.json

Without ``--links``, ``--intra``/``--inter`` give each link as ``latency_us,MB/s`` (ring
formulas, `Links.from_rates`). ``--save`` writes the recommended `DistributedStrategy` as JSON
(``DistributedStrategy.load(path)`` or ``FLEETLIKE_STRATEGY=path`` read it as is);
``--json`` the whole table; ``--show`` prints the recommended strategy's ``main_program`` with
the predicted time of each collective.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import torch

from fleetlike.plan.cost import Links
from fleetlike.plan.planner import annotate, format_table, plan
from fleetlike.plan.probe import probe_worker, save
from fleetlike.plan.space import SpaceName, parse_allow
from fleetlike.plan.spec import Cluster, ModelSpec, OptimizerKind, load_builder, parse_cluster

__all__ = ["main", "parse_memory", "parse_micro_batches", "parse_rate"]

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1000, "kib": 1 << 10, "m": 1 << 20, "mb": 10**6, "mib": 1 << 20,
          "g": 1 << 30, "gb": 10**9, "gib": 1 << 30}


def parse_memory(text: str) -> int:
    """``"2GiB"``, ``"1500MB"``, ``"123456"`` -> bytes; ValueError naming the field otherwise."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"--memory {text!r} does not parse: write bytes with a unit, e.g. 2GiB or 1500MB")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def parse_rate(text: str, name: str) -> tuple[float, float]:
    """``"latency_us,MB/s"`` -> (seconds, bytes/s)."""
    parts = str(text).split(",")
    try:
        lat, bw = float(parts[0]), float(parts[1])
        if len(parts) != 2 or lat < 0 or bw <= 0:
            raise ValueError
    except (ValueError, IndexError):
        raise ValueError(f"--{name} {text!r} does not parse: write latency_us,MB/s, e.g. 100,125") from None
    return lat * 1e-6, bw * 1e6


def parse_micro_batches(text: str) -> tuple[int, ...]:
    """``"2,4,8"`` -> (2, 4, 8); a ValueError naming the flag otherwise."""
    try:
        counts = tuple(int(part) for part in str(text).split(",") if part.strip())
    except ValueError:
        counts = ()
    if not counts or min(counts) < 1:
        raise ValueError(f"--micro_batches {text!r} does not parse: write positive counts, e.g. 2,4,8")
    return counts


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m fleetlike.plan", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="model builder module:function, build(batch_size) -> (model, loss_fn, feed)")
    p.add_argument("--batch_size", type=int, default=16, help="batch per rank")
    p.add_argument("--optimizer", default="momentum", help="sgd, momentum, adam, adamw")
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--cluster", default=None, help="nodes x ranks per node, e.g. 2x4")
    p.add_argument("--cluster_node_ips", default=None, help="the launcher's node list (with --nproc_per_node)")
    p.add_argument("--nproc_per_node", type=int, default=None)
    p.add_argument("--links", default=None, help="link figures JSON (written by --probe)")
    p.add_argument("--intra", default=None, help="intra-node link latency_us,MB/s (without --links)")
    p.add_argument("--inter", default=None, help="inter-node link latency_us,MB/s (without --links)")
    p.add_argument("--compute_scale", type=float, default=None,
                   help="compute slowdown on the cluster (default: the probe's, else 1)")
    p.add_argument("--compute_seconds", type=float, default=None,
                   help="the model's loss+backward seconds on a rank of the job while every rank computes "
                        "(gradients kept); each trace's compute is scaled by it over the same work timed "
                        "alongside that trace, instead of by --compute_scale")
    p.add_argument("--amp_compute_seconds", type=float, default=None,
                   help="the same with the loss under the AMP strategies' autocast (bfloat16 in the basic "
                        "space); AMP candidates scale by it (else by --compute_seconds)")
    p.add_argument("--space", default="basic", help="search space: basic or full (fleetlike.plan.space)")
    p.add_argument("--only", default=None, help="comma-separated candidate names to plan ('pipeline': every "
                                                "pipeline shape)")
    p.add_argument("--micro_batches", default="2,4,8",
                   help="micro-batch counts of the pipeline candidates, e.g. 2,4,8 (one row per pp degree and count)")
    p.add_argument("--allow", default=None, help="math-changing strategies that may be recommended: localsgd,gossip,gradient_merge")
    p.add_argument("--memory", "--memory-per-rank", "--memory_per_rank", dest="memory", default=None,
                   help="memory per rank, e.g. 4GiB; larger candidates are marked, and the table says why each "
                        "candidate not recommended was not")
    p.add_argument("--host_link", default=None,
                   help="the host-device link as latency_us,MB/s: prices sharding_stage3_offload (GPU jobs)")
    p.add_argument("--threads", type=int, default=None, help="torch threads while timing compute (as the workers use)")
    p.add_argument("--save", default=None, help="write the recommended DistributedStrategy JSON here")
    p.add_argument("--json", default=None, help="write the whole table as JSON here")
    p.add_argument("--show", action="store_true", help="print the recommended main_program with predicted times")
    p.add_argument("--probe", action="store_true", help="measure the links (run under fleetlike.launch) into --links")
    return p


def links_for(args: argparse.Namespace, cluster: Cluster) -> Links:
    if args.links is not None:
        links = Links.load(args.links)
    elif args.intra is not None and args.inter is not None:
        links = Links.from_rates(intra=parse_rate(args.intra, "intra"), inter=parse_rate(args.inter, "inter"),
                                 cluster=cluster)
    else:
        raise ValueError("no link figures: pass --links FILE (from --probe) or both --intra and --inter as latency_us,MB/s")
    if args.compute_scale is not None:
        if args.compute_scale <= 0:
            raise ValueError(f"--compute_scale {args.compute_scale} must be > 0")
        links.compute_scale = args.compute_scale
    return links


def _probe(args: argparse.Namespace) -> int:
    from fleetlike.fleet import fleet

    if not args.links:
        raise ValueError("--probe writes its figures to --links FILE; give the path")
    fleet.init()
    try:
        links = probe_worker(fleet.context().groups)
        if links is not None:
            save(links, args.links)
            print(f"probe: wrote {args.links} ({links.source})")
    finally:
        fleet.shutdown()
    return 0


def run(args: argparse.Namespace) -> int:
    if args.probe:
        return _probe(args)
    if not args.model:
        raise ValueError("--model module:function is required (a builder returning (model, loss_fn, feed))")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    allow = parse_allow(args.allow)
    cluster = parse_cluster(args.cluster, node_ips=args.cluster_node_ips, nproc_per_node=args.nproc_per_node)
    memory = parse_memory(args.memory) if args.memory else None
    space = SpaceName(args.space) if args.space in [s.value for s in SpaceName] else args.space
    links = links_for(args, cluster)
    if args.batch_size < 1:
        raise ValueError(f"--batch_size {args.batch_size} must be >= 1")
    for flag in ("compute_seconds", "amp_compute_seconds"):
        value = getattr(args, flag)
        if value is not None and not value > 0:
            raise ValueError(f"--{flag} {value} must be a positive number of seconds (the model's "
                             "loss+backward on a rank of the job); leave it out to use --compute_scale")
    spec = ModelSpec(load_builder(args.model), args.batch_size,
                     OptimizerKind.parse(args.optimizer).factory(args.lr), name=args.model,
                     compute_seconds=args.compute_seconds, amp_compute_seconds=args.amp_compute_seconds)
    only = [s.strip() for s in args.only.split(",") if s.strip()] if args.only else None
    host = parse_rate(args.host_link, "host_link") if args.host_link else None
    micro = parse_micro_batches(args.micro_batches)
    result = plan(spec, cluster, links, space=space, allow=allow, memory_limit=memory, only=only, micro_batches=micro,
                  progress=lambda line: print("  " + line, file=sys.stderr, flush=True), host_link=host)
    scales = sorted(r.trace.compute_scale for r in result.rows
                    if r.trace is not None and r.trace.compute_scale is not None)
    compute = (f"compute x{scales[len(scales) // 2]:.2f} (median over traces, from --compute_seconds)" if scales
               else f"compute x{links.compute_scale:.2f}")
    print(f"{args.model}, batch {args.batch_size}/rank, {cluster}; links: {links.source}; {compute}")
    print(format_table(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result.as_dict(), indent=1))
    best = result.recommended
    if best is not None:
        if args.save:
            best.candidate.strategy().save(args.save)
            print(f"recommended {best.name}: saved to {args.save}")
        if args.show and best.derived:
            print(f"{best.name} is derived from {best.derived}'s trace (FSDP2's collectives are not traced): "
                  "no program listing to annotate")
        elif args.show and best.trace is None:
            print(f"{best.name} is predicted from its stages' timed compute (fleetlike.plan.pipeline): "
                  "no program listing to annotate")
        elif args.show:
            print(annotate(best.trace.program, best.trace, links))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return run(args)
    except ValueError as exc:
        print(f"fleetlike.plan: error: {exc}", file=sys.stderr)
        return 2
