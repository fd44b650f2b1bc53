"""Every `DistributedStrategy` option, declared once: Paddle 2.x name, type, default, tuning note.

This table is the single source of truth: validation, ``to_dict``/``from_dict``, the printed
table, ``describe`` and the generated documentation all read it. Adding an option means adding
one `Field` (or a key to a `Section`) here, nothing else; a test checks that every registered
option round-trips. The values an option may take are `fleetlike.config.choices`' enums, the
checks across a section's keys are `fleetlike.config.section_checks`', and the options' other
names are `fleetlike.config.aliases`'.

Order matters only for display: each feature switch is followed by its settings, in the order of
API.md section 3. It is *not* the order in which passes are applied; the pass layer owns that.
"""

from __future__ import annotations

from fleetlike.config.choices import (
    REDUCE_METHOD,
    AmpPolicy,
    Fp16AllreduceMode,
    HalfDtype,
    HierarchicalAlgorithm,
    Mode,
    OuterOptimizer,
    PipelineBalance,
    PipelineP2P,
    PipelineSchedule,
    SyncBatchNormScope,
    SyncDtype,
)
from fleetlike.config.epl_keys import DeviceIds
from fleetlike.config.fields import Bool, Checkpoints, Choice, Field, Float, Int, Section, StrList
from fleetlike.config.section_checks import amp_lists_disjoint, hybrid_check, localsgd_check, outer_check

__all__ = ["ENTRIES"]


_MS = "the step (counted from 1) from which it starts; before it every step is synchronous"


def _outer_fields(extra: str = "") -> tuple[Field, ...]:
    """The DiLoCo keys shared by ``localsgd_configs`` and ``adaptive_localsgd_configs``."""
    return (
        Field("outer_optimizer", Choice(OuterOptimizer), OuterOptimizer.AVERAGE, note=(
            "'average' (Paddle's local SGD) takes the averaged parameters as they are; 'nesterov' "
            "(DiLoCo) treats the averaged change since the last sync as a pseudo-gradient for a "
            "Nesterov-momentum outer step, which lets k grow to hundreds of steps at the same "
            "loss; 'sgd' is the plain outer step (momentum optional)" + extra)),
        Field("outer_lr", Float(gt=0), 0.7, note=(
            "outer learning rate (DiLoCo's 0.7 with nesterov); 'sgd' with outer_lr=1 and no "
            "momentum equals 'average'; ignored by 'average'")),
        Field("outer_momentum", Float(lt=1), 0.9, note=(
            "outer momentum (DiLoCo's 0.9); nesterov needs it > 0")),
        Field("sync_dtype", Choice(SyncDtype), SyncDtype.FLOAT32, note=(
            "wire dtype of the averaged change (DiLoCo's pseudo-gradient): bfloat16 / float16 "
            "halve the bytes; the outer step itself stays in the parameters' dtype")),
    )


ENTRIES: tuple[Field | Section, ...] = (
    Field("localsgd", Bool(), False, feature=True, note=(
        "average parameters every k_steps instead of allreducing gradients every step; pays off "
        "when slow ranks or a slow network dominate")),
    Section("localsgd_configs", requires="localsgd", note="local SGD schedule",
            check=localsgd_check, fields=(
        Field("k_steps", Int(min=1, max=1 << 31), 1, note=(
            "local steps between parameter averages: larger = less communication and lower "
            "accuracy; Fleet's experience is 2 or 4 with 'average', DiLoCo's is 50-500 with "
            "'nesterov'")),
        Field("begin_step", Int(min=1), 1, note=(
            f"{_MS}; warm up until parameters settle, e.g. the first learning-rate decay")),
        *_outer_fields(),
        Field("fragments", Int(min=1), 1, note=(
            "Streaming DiLoCo: split the model into this many fragments, each synced every "
            "k_steps at staggered steps (k_steps/fragments apart), so each sync sends 1/fragments "
            "of the model; must divide k_steps")),
        Field("overlap", Int(min=0), 0, note=(
            "Streaming DiLoCo's tau: a fragment's allreduce starts this many inner steps before "
            "it is applied and runs while they compute (0 = blocking); must be below "
            "k_steps/fragments")),
        Field("overlap_alpha", Float(), 0.5, note=(
            "with overlap: new parameters = outer result + alpha * (what the overlapped local "
            "steps added); Streaming DiLoCo's mixing factor (torchft's fragment_update_alpha), "
            "0 discards the overlapped local progress")),
    )),
    Field("adaptive_localsgd", Bool(), False, feature=True, note=(
        "local SGD whose k grows as loss and learning rate fall; needs an optimizer with one "
        "global learning rate (SGD, Momentum; not Adam)")),
    Section("adaptive_localsgd_configs", requires="adaptive_localsgd",
            note="adaptive local SGD schedule", check=outer_check, fields=(
        Field("init_k_steps", Int(min=1), 1, note="initial k; 1 (fully synchronous) is safe"),
        Field("begin_step", Int(min=1), 1, note=_MS),
        *_outer_fields(),
    )),
    Field("amp", Bool(), False, feature=True, note=(
        "automatic mixed precision with loss scaling; large speedups on tensor-core GPUs, "
        "prefer bfloat16 on CPU and on A100/H100")),
    Section("amp_configs", requires="amp", check=amp_lists_disjoint,
            note="mixed precision and loss scaling", fields=(
        Field("init_loss_scaling", Float(gt=0), 32768.0, note=(
            "initial loss scale (2**15, Paddle's default); lower it if the first steps are all "
            "skipped for overflow")),
        Field("incr_every_n_steps", Int(min=1), 1000, note=(
            "grow the scale after this many consecutive finite steps")),
        Field("decr_every_n_nan_or_inf", Int(min=1), 2, note=(
            "shrink the scale after this many steps with inf/NaN gradients")),
        Field("incr_ratio", Float(gt=1), 2.0, note="factor by which the scale grows"),
        Field("decr_ratio", Float(gt=0, lt=1), 0.8, note="factor by which the scale shrinks"),
        Field("use_dynamic_loss_scaling", Bool(), True, note=(
            "False keeps init_loss_scaling fixed (a static scale); bfloat16 rarely needs any")),
        Field("custom_white_list", StrList("op names"), (), note=(
            "ops forced to run in low precision")),
        Field("custom_black_list", StrList("op names"), (), note=(
            "ops kept in float32; an op may not be in both lists")),
        Field("dtype", Choice(HalfDtype), HalfDtype.FLOAT16, note=(
            "float16 on V100/T4-class GPUs; bfloat16 on A100/H100 and CPU (float32 range, no "
            "overflow)")),
        Field("policy", Choice(AmpPolicy), AmpPolicy.ALWAYS, note=(
            "TI-ACC's adaptive mixed precision, time counted in optimizer steps: 'time' = AMP "
            "only from policy_start_time to policy_end_time; 'time_lr' = the same, but off for "
            "policy_hold_time steps after each learning-rate change; 'loss' = in windows of "
            "policy_interval_hold_time steps every policy_interval_time steps, off while the loss "
            "falls faster than policy_loss_fast or slower than policy_loss_slow (relative per "
            "step). The loss scale survives the off stretches")),
        Field("policy_start_time", Int(min=0), 10, note="first step of the AMP window ('time', 'time_lr')"),
        Field("policy_end_time", Int(min=0), 0, note="last step of the AMP window; 0 = no end"),
        Field("policy_hold_time", Int(min=0), 100, note="'time_lr': steps AMP stays off after an lr change"),
        Field("policy_interval_time", Int(min=1), 1000, note="'loss': a check window starts every this many steps"),
        Field("policy_interval_hold_time", Int(min=0), 100, note="'loss': length of each check window"),
        Field("policy_loss_fast", Float(), 0.5, note=(
            "'loss': a relative loss decrease per step above this is abnormal (AMP off)")),
        Field("policy_loss_slow", Float(), 0.0, note=(
            "'loss': a relative loss decrease per step below this (0: the loss rose) is abnormal")),
        Field("debug_log", Bool(), False, note=(
            "EPL's amp.debug_log: one stderr line per optimizer step with the loss scale and "
            "whether the step was skipped for inf/NaN gradients")),
    )),
    Field("recompute", Bool(), False, feature=True, note=(
        "trade compute for memory: checkpointed submodules re-run their forward during backward; "
        "gradients are unchanged")),
    Section("recompute_configs", requires="recompute", note="what to recompute", fields=(
        Field("checkpoints", Checkpoints(), (), note=(
            "submodule names as model.named_modules() gives them (e.g. one per transformer "
            "block), or 'auto' for the repeated blocks: the children of the largest "
            "ModuleList/Sequential of at least two modules of one class")),
        Field("check_gradients", Bool(), False, note=(
            "EPL's gradient_checkpoint.check_gradients: at each checkpointed submodule's first "
            "training forward, compare its recomputed gradients (inputs and parameters) with a "
            "plain backward of the same forward and raise naming the submodule on a difference; "
            "costs one extra forward and two backwards of each submodule, once")),
    )),
    Field("gradient_merge", Bool(), False, feature=True, note=(
        "accumulate gradients over k_steps batches, then communicate and update once: a k times "
        "larger batch with 1/k of the communication")),
    Section("gradient_merge_configs", requires="gradient_merge", note="gradient accumulation",
            fields=(
        Field("k_steps", Int(min=1, max=1 << 31), 1, note=(
            "batches per update; adapt the learning rate to the k times larger batch")),
        Field("avg", Bool(), True, note=(
            "True averages the k gradients (one batch's scale), False sums them")),
    )),
    Field("use_hierarchical_allreduce", Bool(), False, feature=True, note=(
        "two-level allreduce (inside nodes, across nodes, inside again); pays off with several "
        "GPUs per node and a slower network between nodes; no effect on one node")),
    Field("hierarchical_allreduce_inter_nranks", Int(min=0), 0,
          requires="use_hierarchical_allreduce", note=(
              "ranks per inner group; 0 or 1 (Paddle's default) = the ranks of one node, the "
              "usual choice; > 1 groups that many consecutive ranks")),
    Section("hierarchical_allreduce_configs", requires="use_hierarchical_allreduce",
            note="hierarchical allreduce algorithm", fields=(
        Field("algorithm", Choice(HierarchicalAlgorithm), HierarchicalAlgorithm.REDUCE_SCATTER,
              note=(
                  "reduce_scatter keeps every intra-node link busy and is usually faster; "
                  "reduce_broadcast funnels each node through one rank")),
    )),
    Field("nccl_comm_num", Int(min=1, max=16), 1, note=(
        "parallel communicators (rings) over which gradient buckets are spread: 1 on one node, "
        "2 across nodes, as Fleet suggests; more only with spare bandwidth and GPU memory")),
    Field("fuse_all_reduce_ops", Bool(), True, feature=True, note=(
        "pack gradients into buckets so one collective moves many tensors; keep it on")),
    Field("fuse_grad_size_in_MB", Float(gt=0, lt=1 << 30, keep_int=True), 32, requires="fuse_all_reduce_ops",
          note=(
              "bucket size in MB: 32 suits most models; smaller buckets start communicating "
              "earlier in backward, larger ones amortise latency on slow links")),
    Field("fuse_grad_max_buckets", Int(min=0), 0, requires="fuse_all_reduce_ops", note=(
        "EPL's communication.max_splits: at most this many gradient buckets per model (the "
        "bucket size grows to the gradients' bytes / this when fuse_grad_size_in_MB would make "
        "more); 0 = no limit")),
    Field("fp16_allreduce", Bool(), False, feature=True, note=(
        "gradients travel as 16-bit floats, halving traffic (pre-divided by the world size, then "
        "scaled by grad_scale, before the cast); mostly useless when amp already makes "
        "half-precision gradients")),
    Section("fp16_allreduce_configs", requires="fp16_allreduce", note="gradient compression",
            fields=(
        Field("dtype", Choice(HalfDtype), HalfDtype.FLOAT16, note=(
            "bfloat16 cannot overflow in transit but keeps fewer mantissa bits")),
        Field("mode", Choice(Fp16AllreduceMode), Fp16AllreduceMode.ALL, note=(
            "'all' compresses every hop; 'mixed' keeps full precision inside a node and "
            "compresses only across nodes: use it when 'all' costs accuracy")),
        Field("grad_scale", Float(gt=0), 1.0, note=(
            "extra factor applied before the cast and undone after; lower it if gradients "
            "overflow in transit, raise it if small ones underflow to zero")),
    )),
    Field("auto_tune", Bool(), False, feature=True, note=(
        "try gradient-communication settings during the first steps (allreduce mode, bucket size, "
        "communicators, 16-bit wire where allowed), measure each one's steps/s on every rank and "
        "keep the fastest; an option the user set (even to its default: explicit_options()) is never tuned; "
        "the FLEETLIKE_AUTOTUNE / HOROVOD_AUTOTUNE variables turn it on too")),
    Section("auto_tune_configs", requires="auto_tune", note="online tuning of gradient communication",
            fields=(
        Field("warmup_steps", Int(min=0), 1, note=(
            "steps after each switch that are not measured (the first step of a setting pays for "
            "its new buffers and communicators)")),
        Field("steps_per_trial", Int(min=1), 5, note=(
            "measured steps per candidate: the median of the slowest rank's step times is its score; "
            "more steps beat more noise and cost more tuning")),
        Field("seconds_per_trial", Float(ge=0), 0.5, note=(
            "and at least this long (steps counted from the first trial's speed, the same on every "
            "rank); 0 = steps_per_trial steps only")),
        Field("min_gain", Float(ge=0), 0.02, note=(
            "a candidate replaces the best so far only when faster by this fraction (noise guard)")),
        Field("race_blocks", Int(min=1), 3, note=(
            "where a candidate and the best so far differ within their measured noise (a confidence "
            "interval from the per-step spread), both are timed again in alternating trials, up to "
            "this many each, until the lead is resolved; then the medians decide; 1 = no re-runs")),
        Field("race_gain", Float(ge=0), 0.05, note=(
            "a candidate is re-run only while its gain could still reach this fraction (the upper end "
            "of its interval): a smaller gain is not worth more trials")),
        Field("confidence", Float(gt=0, lt=1), 0.95, note=(
            "the confidence of the interval on a candidate's gain (higher: fewer wrong choices, more re-runs)")),
        Field("allow_16bit_wire", Bool(), False, note=(
            "let the tuner try float16 and bfloat16 gradients on the wire (changes the numerics); "
            "off: the wire dtype is never tuned")),
        Field("fixed", StrList("tuned knob names"), (), note=(
            "knobs never tuned even when not set: allreduce_mode, bucket_mb, comm_num, "
            "wire_dtype (a knob whose option the user set is never tuned anyway)")),
    )),
    Field("gossip", Bool(), False, feature=True, note=(
        "gossip (down-sampling) compression, AIACC's PERSEUS_DOWNSAMPLE_N_ELEMENTS: each step "
        "averages one of every n gradient elements (a rotating offset) and keeps the rest as a "
        "residual added to the next step's gradient (error feedback), so traffic drops to 1/n and "
        "nothing is lost; each element's update is delayed by up to n-1 steps. For large batches "
        "on slow networks")),
    Section("gossip_configs", requires="gossip", note="gossip compression", fields=(
        Field("downsample_n_elements", Int(min=2), 4, note=(
            "send one of every n elements per step: 2, 4 or 8 keep ImageNet accuracy in AIACC's "
            "experience; larger n delays each element's update longer")),
    )),
    Field("sharding", Bool(), False, feature=True, note=(
        "ZeRO: each rank keeps the optimizer state of its partition of the parameters (stage 1), "
        "also only its shard of the gradients (stage 2) and of the parameters (stage 3); "
        "gradients are reduce-scattered and parameters all-gathered; with Adam stage 1 frees "
        "up to 2(N-1)/N of the parameter memory per rank for the same traffic as data parallel")),
    Section("sharding_configs", requires="sharding", note="optimizer-state sharding", fields=(
        Field("sharding_degree", Int(min=0), 8, note=(
            "ranks sharing one copy of the optimizer state; must be the world size (Paddle "
            "checks sharding_degree x dp_degree == world); 0 = the world size, whatever it is")),
        Field("segment_broadcast_MB", Float(gt=0, keep_int=True), 32.0, note=(
            "MB of parameter all-gathers in flight after the update (the parameters travel in "
            "the gradient buckets, fuse_grad_size_in_MB): larger overlaps more buckets")),
        Field("gradients_reduce_method", REDUCE_METHOD, "mean", requires="", note=(
            "'mean' averages the gradients over the ranks (data parallel's meaning), 'sum' adds "
            "them (scale the learning rate down by the world size); acts in data parallel and "
            "sharding, refused with local SGD")),
        Field("clip_norm", Float(ge=0), 0.0, requires="", note=(
            "clip the gradients by their global L2 norm (torch.nn.utils.clip_grad_norm_'s "
            "max_norm) before the update; 0 = no clipping; acts in data parallel and sharding, "
            "refused with local SGD")),
        Field("clip_after_allreduce", Bool(), False, requires="", note=(
            "True clips the reduced gradient by its global norm (equals data parallel then "
            "clip_grad_norm_); False (EPL's default) clips each rank's own gradient before "
            "communication, which delays the allreduce / reduce-scatter to the end of backward "
            "(in data parallel the threshold follows AMP's loss scale and gradient merge's k)")),
        Field("overlap_update", Bool(), True, note=(
            "step the owned partition chunk by chunk and broadcast each chunk as soon as it is "
            "updated, so the parameter gather overlaps the update (torch.optim's per-parameter "
            "optimizers without step hooks; others update whole, then gather); False: update, "
            "then gather")),
        Field("stage", Int(min=1, max=3), 1, note=(
            "ZeRO stage (Paddle's sharding_configs.stage): 1 shards the optimizer state "
            "(4 + 4 + 8/N bytes per fp32 Adam parameter per rank); 2 also the gradients "
            "(4 + 12/N); 3 also the parameters, gathered per block for its forward and backward "
            "and freed after (16/N + the largest block). 2 and 3 run on torch's FSDP2")),
        Field("optimize_offload", Bool(), False, note=(
            "Paddle's optimize_offload: the optimizer state and update in host memory (stages 2 "
            "and 3 on a GPU); on a CPU job it changes nothing and says so")),
        Field("offload_params", Bool(), False, note=(
            "also keep the parameter shards in host memory, copied to the device per block "
            "(EPL's offload.level 'v0'; stage 3 on a GPU; needs optimize_offload)")),
    )),
    Field("num_apply_group", Int(min=1), 1, note=(
        "EPL's optimizer.num_apply_group: the update applied in this many groups of "
        "parameters, one optimizer call each, so its temporary buffers are about 1/N of the "
        "model (torch.optim's per-parameter optimizers; any sharding stage or none)")),
    Field("pipeline", Bool(), False, feature=True, note=(
        "split the model into hybrid_configs.pp_degree stages on as many ranks and stream "
        "micro-batches through them (Paddle's PipelineParallel, EPL's pipeline): for a model "
        "whose parameters and optimizer state do not fit one device; train with "
        "model.train_batch((x, y), opt)")),
    Section("pipeline_configs", requires="pipeline", note="pipeline schedule", fields=(
        Field("accumulate_steps", Int(min=1), 1, note=(
            "micro-batches per optimizer step (EPL's pipeline.num_micro_batch): the bubble is "
            "(p-1)/(m+p-1) of a step, so use at least 4x the stages")),
        Field("micro_batch_size", Int(min=0), 0, note=(
            "rows per micro-batch; 0 = the batch's rows / accumulate_steps. When set, every "
            "batch must hold micro_batch_size x accumulate_steps rows (Paddle's check)")),
        Field("schedule_mode", Choice(PipelineSchedule), PipelineSchedule.ONE_F_ONE_B, note=(
            "'1F1B' keeps at most pp_degree micro-batches' activations per stage; 'FThenB' "
            "(GPipe) runs every forward first and holds accumulate_steps of them")),
        Field("split_points", StrList("module names"), (), note=(
            "names (model.named_modules()) of the modules that begin stages 2..p, in forward "
            "order; empty = balance the model's blocks (pipeline_configs.balance)")),
        Field("balance", Choice(PipelineBalance), PipelineBalance.PARAMS, note=(
            "without split points: 'params' gives each stage an equal share of the parameters; "
            "'time' an equal share of the blocks' forward + backward time, measured on rank 0 on "
            "fleet.distributed_model's example_input (one micro-batch) and broadcast")),
        Field("p2p", Choice(PipelineP2P), PipelineP2P.AUTO, note=(
            "'auto': stages on one machine hand over activations and gradients through shared "
            "memory (a ring per direction), stages on different machines over gloo; 'gloo': "
            "every handoff over gloo (the handoff then costs a round of gloo's threads and "
            "loopback TCP, which at 2 stages under 1F1B lands on the step once per micro-batch)")),
        Field("freeze_heap", Bool(), True, note=(
            "after the first train_batch, collect once and freeze the objects then alive out of "
            "the garbage collector (gc.freeze, once per process): a full collection walks every "
            "object torch and the model made, milliseconds a neighbour stage waits out. False "
            "leaves the collector as it is (a job that must collect cycles among those objects)")),
    )),
    Section("hybrid_configs", note="how the ranks divide: dp_degree x pp_degree = world size",
            check=hybrid_check, fields=(
        Field("dp_degree", Int(min=-1), -1, note=(
            "pipelines training side by side on different data (data parallel across "
            "pipelines); -1 = world size / pp_degree")),
        Field("pp_degree", Int(min=1), 1, note=(
            "pipeline stages (ranks per pipeline); > 1 needs pipeline = True")),
        Field("mp_degree", Int(min=1), 1, note=(
            "tensor (model) parallelism: not offered, only 1 is accepted")),
    )),
    Field("tensor_parallel", Bool(), False, feature=True, note=(
        "Paddle's tensor (model) parallelism: not offered (no layer is split across ranks); "
        "True is refused when the strategy is used. Use pipeline stages or sharding")),
    Field("sync_batch_norm", Bool(), False, feature=True, note=(
        "BatchNorm statistics over the global batch; helps small per-GPU batches (detection) "
        "at the cost of one allreduce per layer")),
    Section("sync_batch_norm_configs", requires="sync_batch_norm", note="BatchNorm sync scope",
            fields=(
        Field("scope", Choice(SyncBatchNormScope), SyncBatchNormScope.GLOBAL, note=(
            "'global' over all ranks; 'local' within each node, cheaper on slow networks")),
    )),
    Field("find_unused_parameters", Bool(), False, feature=True, note=(
        "True only if some parameters get no gradient in a step (conditional branches); costs "
        "a graph traversal per step")),
    Field("check_nan_inf", Bool(), False, feature=True, note=(
        "check gradients for NaN/Inf before communication and raise naming the parameter; "
        "a debugging aid costing one reduction per bucket")),
    Field("slow_rank_check", Bool(), False, feature=True, note=(
        "time every rank's step and report ranks that are persistently slower")),
    Section("slow_rank_check_configs", requires="slow_rank_check", note="slow-rank detection",
            fields=(
        Field("every_n_steps", Int(min=1), 100, note="steps between two checks"),
        Field("factor", Float(gt=1), 1.5, note=(
            "a rank is slow when its step time exceeds the median by this factor")),
    )),
    Field("visible_devices", DeviceIds(), (), note=(
        "EPL's cluster.run_visible_devices: the GPU ids this job's ranks may use, rank with local "
        "rank i on the i-th (as FLAGS_selected_gpus); fleet.init refuses more local ranks than ids "
        "and a process without CUDA; empty = fleetlike's own choice")),
    Section("io_configs", note="input sharding (EPL's io.* keys)", fields=(
        Field("slicing", Bool(), True, note=(
            "shard the input over the ranks: get_data_loader's default sampler and files_shard / "
            "FileShardDataset give each rank its part; False: every rank reads all of it (EPL's "
            "default is False, fleetlike's loader has always sharded)")),
        Field("unbalanced_io_slicing", Bool(), True, note=(
            "files that do not divide over the ranks: some ranks get one file more (EPL's default "
            "is False); False with drop_last_files False refuses such a list, naming the counts")),
        Field("drop_last_files", Bool(), False, note=(
            "cut the file list evenly and drop the files left over (every rank the same count)")),
    )),
    Field("mode", Choice(Mode), Mode.COLLECTIVE, inert=(
        "Fleet 1.x chose between ParallelExecutor (nccl2) and Executor (collective); fleetlike "
        "has one executor, so the value is only recorded"), note=(
        "Fleet 1.x execution mode; recorded for compatibility, no effect")),
    Section("execution_strategy", from_object=True, inert=(
        "executor threads and scope dropping are Paddle executor internals with no PyTorch "
        "counterpart; the values are only recorded"), note=(
        "Paddle's ExecutionStrategy (an object with these attributes, or a dict); recorded "
        "only"), fields=(
        Field("num_threads", Int(min=0), 1, note="Paddle executor threads (0 = automatic)"),
        Field("num_iteration_per_drop_scope", Int(min=1), 10, note=(
            "Paddle: iterations between scope cleanups")),
    )),
)
