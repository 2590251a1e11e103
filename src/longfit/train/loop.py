"""The training loop: one loop for full fine-tuning and LoRA, for one process or many (torchrun).

Per optimizer step every rank reads `grad_accum` micro-batches, shards them along the sequence for
context parallelism, and backpropagates (sum of its token losses) / (valid label tokens over all
ranks and micro-batches), so the accumulated gradient is exactly that of the global mean loss.

Before anything expensive the run is checked (the plan, the model directory, output_dir and its free
space, the start of the data), then output_dir is locked, staging directories of a crashed save are
removed, the newest intact checkpoint is chosen and the config compared with the one it was trained
with (`longfit.train.resume`). The learning rate of step s is train.lr x `lr_lambda(cfg)(s)`, set
before every update, so a resumed run (whatever it was allowed to change) needs no scheduler state.

A step whose loss or gradient norm is not finite is skipped: its gradients are dropped and the optimizer
does not step, but it counts as a step (its data is consumed, the schedule moves on). `train.max_bad_steps`
such steps in a row stop the run with an error, and a checkpoint is never written
from weights that are not finite. A step whose rows hold no token with a target (over all ranks and
micro-batches: rows of user turns only, or padding) is not a fault: it has nothing to learn from, so it
runs no forward pass and makes no update (an AdamW step on zero gradients would still move the weights),
is announced once, counted, and neither counts towards nor resets `train.max_bad_steps`. SIGINT / SIGTERM
stop the run after the current step with a checkpoint (`longfit.train.signals`).
"""

from __future__ import annotations

import math
import time
from contextlib import ExitStack
from dataclasses import asdict, dataclass, fields, replace
from typing import TYPE_CHECKING
from itertools import islice
from pathlib import Path

import torch

from longfit.config import Config, ConfigError
from longfit.data.packing import PackingStats
from longfit.eval.loss import EvalLoss
from longfit.eval.media_retrieval import MediaRetrievalScore
from longfit.eval.scores import RetrievalScore

if TYPE_CHECKING:
    from longfit.train.console import StartupClock

NO_TARGET = "no_target"
NOT_FINITE = "not_finite"


class NonFiniteError(ConfigError):
    """Training that produced no finite loss or gradient for train.max_bad_steps steps in a row."""


@dataclass
class TrainSummary:
    output_dir: Path
    steps: int
    first_loss: float
    last_loss: float
    peak_mem_bytes: int
    export_dir: Path | None
    resumed_from: int
    is_main: bool
    stopped_by: int = 0  # the signal that stopped the run early, 0 if none
    checkpoint: Path | None = None  # the last checkpoint this run wrote
    skipped_steps: int = 0  # steps without an update because the loss or gradient norm was not finite
    no_target_steps: int = 0  # steps without an update because no row had a target (not a fault)
    retrieval_before: RetrievalScore | None = None  # eval.retrieval of the initial model (rank 0)
    retrieval_after: RetrievalScore | None = None  # eval.retrieval of the exported model (rank 0)
    last_eval: EvalLoss | None = None  # the eval loss after this run's last evaluation (train.eval_every; of
    # preference pairs, longfit.eval.preference.PairEval)
    media_retrieval_before: MediaRetrievalScore | None = None  # eval.retrieval_media of the initial model (rank 0)
    media_retrieval_after: MediaRetrievalScore | None = None  # eval.retrieval_media of the exported model (rank 0)


def lr_lambda(cfg: Config):
    """Linear warmup to train.lr, then cosine decay to train.min_lr_ratio * train.lr."""
    warmup, total, floor = cfg.train.warmup_steps, cfg.train.steps, cfg.train.min_lr_ratio

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        progress = (step - warmup) / max(1, total - warmup)
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return factor


def count_data(cfg: Config, dp_size: int):
    """(cfg with the run's length, what one epoch of the data holds), counted by packing the data once on rank 0.

    With train.epochs the whole first epoch is counted and decides train.steps: ceil(epochs x rows per epoch / rows
    per step). Otherwise train.steps decides, and the count stops after COUNT_TOKENS tokens, so a large dataset is not
    read up front only to be described.
    """
    from longfit.config import TrainSection
    from longfit.data.packing import COUNT_TOKENS, count_epoch
    from longfit.models.loading import load_tokenizer
    from longfit.models.media import image_reader

    tokenizer = load_tokenizer(cfg.model)
    media = image_reader(cfg.model)
    rows_per_step = cfg.train.micro_batch * cfg.train.grad_accum * dp_size
    if cfg.train.objective != "causal_lm":  # preference pairs: read whole before the first step anyway
        from longfit.data.preferences import count_pair_epoch

        count = count_pair_epoch(cfg, tokenizer)
    elif not cfg.train.epochs:
        return cfg, count_epoch(cfg, tokenizer, COUNT_TOKENS, media)
    else:
        count = count_epoch(cfg, tokenizer, media=media)
    if not cfg.train.epochs:
        return cfg, count
    steps = math.ceil(cfg.train.epochs * count.rows / rows_per_step)
    if cfg.train.steps not in (0, TrainSection.steps, steps):
        raise ConfigError(f"train.steps={cfg.train.steps} and train.epochs={cfg.train.epochs} disagree: "
                          f"{cfg.train.epochs} epochs of {count.rows:,} rows are {steps} steps of {rows_per_step} rows; "
                          f"set only one of them (train.steps=0 lets train.epochs decide)")
    return replace(cfg, train=replace(cfg.train, steps=steps)), count


def check_fresh_start(output_dir: Path) -> str | None:
    """For a run with no checkpoint to resume: refuse a directory holding a finished run or only damaged
    checkpoints; return a note when it holds the start of a run stopped before its first checkpoint."""
    from longfit.train.checkpoint import CheckpointError, damaged_dirs

    damaged = damaged_dirs(output_dir)
    if damaged:
        raise CheckpointError(
            f"{output_dir} holds no intact checkpoint, only damaged ones ({', '.join(p.name for p in damaged)}); "
            f"delete them to train this run again from step 0, or choose a new output_dir"
        )
    if (output_dir / "final").exists():
        raise ConfigError(
            f"output_dir={output_dir} already holds a finished run (final) and no checkpoint to resume from; "
            f"choose a new output_dir or delete the old one"
        )
    if any((output_dir / name).exists() for name in ("metrics.jsonl", "config.yaml")):
        return f"{output_dir} holds a run that stopped before its first checkpoint: training again from step 0"
    return None


def train(
    cfg: Config,
    force: bool = False,
    stop_after_steps: int | None = None,
    allow_changes: frozenset[str] = frozenset(),
    log=print,
    startup: "StartupClock | None" = None,
) -> TrainSummary:
    """Train per `cfg`, resuming from the newest intact checkpoint in `cfg.output_dir`.

    `stop_after_steps` ends this invocation early, with a checkpoint, after that many steps (for
    time-limited jobs); running again continues where it stopped. `allow_changes` are config keys that
    may differ from the checkpoint's config (`longfit train --allow-changes`). `force` trains even if
    the planner predicts that the run does not fit the device memory or the disk. `startup`: the clock of
    `longfit train`'s phases so far; this run marks its own and prints them after its first step.
    """
    from longfit.launch import elastic_restart, init_distributed
    from longfit.memory.optim import configure_cuda_allocator
    from longfit.models.dropout import dropout_note, dropout_values
    from longfit.models.loading import resolve_model_config
    from longfit.models.rope import window_note
    from longfit.models.source import check_model_dir
    from longfit.plan import preflight
    from longfit.train.checkpoint import rank_zero_decides, step_dirs
    from longfit.train.console import StartupClock, quiet_other_ranks
    from longfit.train.lock import RunLock
    from longfit.train.trackers import require_trackers
    from longfit.train.output_dir import check_free_space, check_output_dir, plan_disk
    from longfit.train.signals import StopOnSignal

    configure_cuda_allocator()  # before anything initialises CUDA, which init_distributed does on a GPU
    rank, world, device = init_distributed(cfg.train.device, cpu_collectives=cfg.parallel.cpu_offload)
    is_main = rank == 0
    say = log if is_main else (lambda *_: None)
    quiet_other_ranks(rank)
    restart = elastic_restart()
    if restart:
        say("torchrun restarted the workers after one failed (restart {} of {}): continuing from the newest intact "
            "checkpoint".format(*restart))
    require_trackers(cfg.train.report_to)
    startup = startup or StartupClock(from_process_start=False)
    startup.mark("process group")
    plan = preflight(cfg, world, device, check_fit=not force)
    startup.mark("plan")
    output_dir = Path(cfg.output_dir)
    rank_zero_decides(lambda: check_model_dir(cfg.model))
    # the run's RoPE resolved (its errors) before anything is built
    rope_note = rank_zero_decides(lambda: window_note(cfg, resolve_model_config(cfg.model, cfg)))
    dropout_off = dropout_note(dropout_values(resolve_model_config(cfg.model))) if cfg.train.disable_dropout else None
    cfg, epoch_count = rank_zero_decides(lambda: count_data(cfg, plan.setup.dims.dp_size))

    def check_disk() -> None:
        check_output_dir(output_dir)
        newest = step_dirs(output_dir)
        start = int(newest[0].name.split("_")[1]) if newest else 0
        end = cfg.train.steps if stop_after_steps is None else min(cfg.train.steps, start + stop_after_steps)
        if not force:
            check_free_space(output_dir, plan_disk(plan.setup, cfg, start, end, len(newest)))

    rank_zero_decides(check_disk)
    placements = [stage.placement for stage in plan.stages] or [plan.placement]  # under pp: per pp rank
    run = _Run(cfg, plan.setup, rank, device, stop_after_steps, allow_changes, say, placements)
    run.prepare_data()
    startup.mark("data")
    lock = RunLock(output_dir, say)  # taken by rank 0 alone: the other ranks of the job trust it
    with ExitStack() as stack:
        stack.callback(lock.release)
        rank_zero_decides(lock.acquire)
        stop = stack.enter_context(StopOnSignal(announce=is_main, on_exit=lock.release))
        stack.push(run.wait_on_exit)
        stack.enter_context(run.trackers)
        run.inspect_output_dir()
        run.build()
        run.summarise(plan, epoch_count)  # every check has passed: the first thing this run prints
        for note in (rope_note, dropout_off):
            if note:
                say(note)
        run.restore()
        startup.mark("model")
        if run.load_reference():
            startup.mark("reference")
        run.score_initial_model()
        if run.retrieval:
            startup.mark("retrieval before")
        return run.loop(stop, startup)


class _Run:
    """One invocation of `train`, in the order of its phases; each phase leaves its results on `self`."""

    def __init__(self, cfg: Config, setup, rank: int, device, stop_after_steps, allow_changes, say, placements=(None,)):
        from longfit.train.checkpoint import CheckpointWriter
        from longfit.train.trackers import Trackers

        self.cfg, self.dims, self.rank, self.device = cfg, setup.dims, rank, device
        self.loss_chunk = setup.loss_chunk  # the plan's, from the memory free before anything was built
        # the plan's: where the offload store keeps each checkpointed layer input, of each pp rank's stages
        self.placements = placements
        self.tiled_layers = setup.tiled_layers
        self.stop_after_steps, self.allow_changes, self.say = stop_after_steps, allow_changes, say
        self.output_dir = Path(cfg.output_dir)
        self.saved: Path | None = None  # the last checkpoint this invocation completed
        self.writer = CheckpointWriter()
        self.trackers = Trackers()  # started by rank 0 once every check has passed (`summarise`)

    def prepare_data(self) -> None:
        """Tokenizer, mesh and data loader: the data's start is checked before output_dir is touched."""
        from longfit.data.packing import build_dataloader, eval_data
        from longfit.models.loading import load_tokenizer
        from longfit.models.media import image_reader

        torch.manual_seed(self.cfg.train.seed)
        self.tokenizer = load_tokenizer(self.cfg.model)
        self.mesh = self.dims.build_mesh(self.device.type)
        rank_share = dict(dp_rank=self.mesh.dp_rank, dp_size=self.dims.dp_size, epochs=self.cfg.train.epochs or None)
        if self.cfg.train.objective != "causal_lm":
            from longfit.data.preferences import build_pair_loader, eval_pairs

            self.loader = build_pair_loader(self.cfg, self.tokenizer, **rank_share)
            self.eval_data = eval_pairs(self.cfg, self.tokenizer)  # held-out pairs (longfit.eval.preference)
            return
        media = image_reader(self.cfg.model)
        self.loader = build_dataloader(self.cfg, self.tokenizer, **rank_share, media=media)
        self.eval_data = eval_data(self.cfg, self.tokenizer, media)  # its image rows read as training's (#54)
        if self.has_media() and self.dims.pp > 1:  # the vision side runs on the first stage (parallel/pipeline.py)
            from longfit.models.model_config import read_config
            from longfit.parallel.pipeline import refuse_image_rules

            refuse_image_rules(read_config(self.cfg.model).config, self.dims.pp)

    def has_media(self) -> bool:
        """Whether the training or the eval data holds images or videos: the run then builds the vision side."""
        return bool(getattr(self.loader.source, "images", 0) or getattr(self.eval_data, "images", 0))

    def inspect_output_dir(self) -> None:
        """Under the lock, before building: remove staging left by a crash, choose the checkpoint to resume
        and check the config against it, or check that a fresh start may use this directory."""
        from longfit.train.checkpoint import (
            on_every_rank,
            rank_zero_decides,
            remove_staging,
        )

        for path in rank_zero_decides(lambda: remove_staging(self.output_dir)):
            self.say(f"removed {path}: left by a save or export that did not finish")
        self.resume_from, self.damaged, self.changes = self.choose_checkpoint(frozenset())
        self.fresh_note = None
        if self.resume_from is None:
            if self.damaged:
                raise on_every_rank(self._no_intact_checkpoint(self.damaged))
            self.fresh_note = rank_zero_decides(lambda: check_fresh_start(self.output_dir))

    def choose_checkpoint(self, exclude: frozenset[Path]) -> tuple[Path | None, list, list]:
        """(the newest intact checkpoint not in `exclude` or None, the damaged newer ones with why, the config
        changes to apply when resuming from it)."""
        from longfit.train.checkpoint import find_resumable, rank_zero_decides, written_by_ranks
        from longfit.train.resume import check_resume_changes

        path, damaged = find_resumable(self.output_dir, exclude)
        if path is None:
            return None, damaged, []
        changes = rank_zero_decides(lambda: check_resume_changes(
            (path / "config.yaml").read_text(), self.cfg, self.allow_changes, path.name, written_by_ranks(path),
            self.dims.world_size))
        return path, damaged, changes

    def build(self) -> None:
        from longfit.memory.loss import CausalLMLoss
        from longfit.memory.optim import build_optimizer
        from longfit.memory.router_loss import check_router_loss
        from longfit.models.build import build_model
        from longfit.models.loading import compute_dtype
        from longfit.parallel.parallelize import autocast_dtype, parallelize

        cfg = self.cfg
        dtype = compute_dtype(cfg.train.dtype, self.device)
        model = build_model(cfg, dtype, self.device, self.dims.fsdp_enabled)
        check_router_loss(model, self.tiled_layers)  # on the meta device: nothing allocated yet
        if cfg.train.objective == "causal_lm":
            loss_module = CausalLMLoss(model, chunked_loss=cfg.memory.chunked_loss, loss_chunk=self.loss_chunk or 0,
                                       media_encoder=self.media_encoder(), indexer_loss=cfg.train.indexer_loss)
        else:
            from longfit.memory.preference import PreferenceLoss

            loss_module = PreferenceLoss.from_config(model, cfg, self.loss_chunk or 0)
            loss_module.pair_group = self.mesh.cp_group  # where each answer's partial log-probabilities complete
        self.loss_module = parallelize(
            loss_module, self.dims, cfg, self.mesh, param_dtype=dtype, device=self.device,
            checkpoint_placement=self.placements[self.mesh.pp_rank],
        )
        # train.router_loss=micro_batch: each forward's counts, over the cp ranks of its rows (memory/router_loss.py)
        self.router_loss = getattr(self.loss_module, "router_loss", None)
        if self.router_loss is not None and cfg.train.router_loss == "micro_batch":
            self.loss_module.router_group = self.mesh.cp_group
        self.autocast = autocast_dtype(self.dims, dtype)
        self.pipeline = None
        if self.dims.pp > 1:
            from longfit.parallel.pipeline import Pipeline

            self.pipeline = Pipeline(self.loss_module, cfg, self.mesh, self.device, dtype)
        self.say(attention_line(model, self.device, dtype, self.dims.cp_method if self.dims.cp > 1 else None,
                                cfg.train.objective != "causal_lm"))
        trainable = [p for p in self.loss_module.parameters() if p.requires_grad]
        self.optimizer = build_optimizer(trainable, lr=cfg.train.lr, weight_decay=cfg.train.weight_decay, kind=cfg.memory.optimizer)

    def media_encoder(self):
        """The checkpoint's vision side (#54) when the data holds images, with what `train.vision` trains, on the ranks
        of the first pipeline stage (every rank without parallel.pp); else None."""
        from longfit.models.media import build_media_encoder, trainable_parts
        from longfit.parallel.pipeline import holds_first_stage

        if not self.has_media() or not holds_first_stage(self.mesh.pp_rank, self.dims, self.cfg.parallel.pp_schedule):
            return None
        encoder = build_media_encoder(self.cfg.model, self.device)
        trainable_parts(encoder, self.cfg.train.vision, self.cfg.lora, self.cfg.train.seed)
        return encoder

    def summarise(self, plan, epoch_count) -> None:
        from longfit.eval.scores import retrieval_size
        from longfit.train.checkpoint import rank_zero_decides
        from longfit.train.console import run_summary

        from longfit.parallel.comm import all_reduce_sum

        parameters = {id(p): p for p in self.loss_module.parameters()}.values()
        counts = torch.tensor([sum(p.numel() for p in parameters), sum(p.numel() for p in parameters if p.requires_grad)],
                              device=self.device)
        total, trainable = all_reduce_sum(counts, self.mesh.pp_group).tolist()  # a pipeline stage holds its part
        self.retrieval = retrieval_size(self.cfg)
        summary = run_summary(self.cfg, plan, total, trainable, self.device, self.retrieval, epoch_count)
        self.say(summary)
        facts = {"plan/peak_bytes": plan.peak_bytes, "parameters": total, "trainable_parameters": trainable}
        rank_zero_decides(lambda: self.trackers.start(self.cfg, summary, facts))

    def score_initial_model(self) -> None:
        """eval.retrieval before training, by rank 0 on the model as the trainer initialises it."""
        from longfit.eval.scores import retrieval_score

        self.retrieval_before = None
        if self.retrieval and self.rank == 0:
            self.retrieval_before = retrieval_score(self.cfg.model, self.cfg, self.device)
            self.say(f"retrieval before training: {self.retrieval_before.accuracy:.2f} at {self.retrieval_before.length} "
                     f"tokens ({self.retrieval_before.examples} examples)")
            self.trackers.log({"retrieval/before": self.retrieval_before.accuracy}, self.start_step)
        self.media_retrieval_before = self.score_media("before training", self.cfg.model, self.start_step)

    def score_media(self, when: str, model: str, step: int) -> MediaRetrievalScore | None:
        """eval.retrieval_media's score of `model` (#54), by rank 0: said, and logged to the trackers."""
        from longfit.eval.scores import media_retrieval_score

        kind = self.cfg.eval.retrieval_media
        if kind == "none" or self.rank != 0:
            return None
        score = media_retrieval_score(model, self.cfg, self.device)
        self.say(f"{kind} retrieval {when}: {score.line()}")
        self.trackers.log({f"retrieval_{kind}/{when.split()[0]}": score.accuracy,
                           f"retrieval_{kind}/{when.split()[0]}_log_likelihood": score.log_likelihood}, step)
        return score

    def load_reference(self) -> bool:
        """A full fine-tune's reference log-probabilities (dpo, ipo): computed by the initial weights before the first
        step, or read back (longfit.train.reference). Whether the run has them."""
        from longfit.train.reference import needs_stored_reference, stored_reference

        self.eval_reference = None
        if not needs_stored_reference(self.cfg):
            return False
        pair_sets = {"train": self.loader.pairs, **({"eval": self.eval_data} if self.eval_data else {})}
        tables = stored_reference(self.loss_module, pair_sets, self.cfg, self.mesh, self.device, self.autocast,
                                  self.loader.pad_id, self.resume_from is not None, self.say, self.rank == 0)
        self.loss_module.stored_reference, self.eval_reference = tables["train"], tables.get("eval")
        return True

    def restore(self) -> None:
        """Load the chosen checkpoint, falling back to older ones past weights that are not finite; move the
        damaged ones aside. Sets `start_step`."""
        from longfit.train.checkpoint import (
            load_checkpoint,
            move_aside,
            on_every_rank,
            parameters_finite,
            rank_zero_decides,
            set_rng_state,
        )

        say, damaged = self.say, self.damaged
        while self.resume_from is not None:
            state = load_checkpoint(self.resume_from, self.loss_module, self.optimizer, self.rank)
            if parameters_finite(self.loss_module):
                break
            damaged.append((self.resume_from, "its weights are not finite (NaN or inf)"))
            self.resume_from, older_damaged, self.changes = self.choose_checkpoint(frozenset(p for p, _ in damaged))
            damaged += older_damaged
            if self.resume_from is None:
                raise on_every_rank(self._no_intact_checkpoint(damaged))
        for path, why in damaged:
            moved = rank_zero_decides(lambda path=path: move_aside(path))
            say(f"warning: checkpoint {path.name} is damaged ({why}); moved it to {moved.name} and resumed from an older one")
        # The config's, also over a checkpoint's (an allowed change); the learning rate is set every step.
        for group in self.optimizer.param_groups:
            group["weight_decay"] = self.cfg.train.weight_decay
        self.start_step = 0
        if self.resume_from is None:
            if self.fresh_note:
                say(self.fresh_note)
            return
        self.start_step = state["step"]
        if "data.path" in {c.key for c in self.changes}:
            say(f"data.path changed (--allow-changes): reading {self.cfg.data.path} from its start")
        else:
            self.loader.load_state_dict(state["data"])
            if self.mesh.dp_rank:  # the checkpoint counts the whole run's data (`save`): the first dp rank carries it on
                self.loader.stats = PackingStats()
        set_rng_state(state["rng"])
        say(f"resuming from {self.resume_from} (step {self.start_step})")
        for change in self.changes:
            if change.key != "output_dir":
                say(f"  changed {change}" + (" (--allow-changes)" if change.key in self.allow_changes else ""))

    def finish_saving(self) -> None:
        """Wait for the checkpoint being written (raising why it failed); `self.saved` is then the last one."""
        self.saved = self.writer.wait() or self.saved

    def wait_on_exit(self, exc_type, exc, traceback) -> bool:
        """On leaving the run: the checkpoint being written completes first. Leaving on an error, a failure of
        that checkpoint is not raised over the error (the staging directory it leaves is removed at the next start)."""
        from longfit.train.checkpoint import CheckpointError

        try:
            self.finish_saving()
        except CheckpointError:
            if exc_type is None:
                raise
        return False

    def save(self, step: int) -> None:
        """Start writing checkpoint `step`; the disk writes overlap the next steps (`finish_saving` waits)."""
        from longfit.train.checkpoint import (
            on_every_rank,
            parameters_finite,
            rng_state,
        )

        self.finish_saving()
        if not parameters_finite(self.loss_module):
            raise on_every_rank(NonFiniteError(
                f"the weights are not finite after step {step}; no checkpoint was written, the last one is "
                f"{self.saved or self.resume_from or 'none'}. Lower train.lr (resume with --allow-changes train.lr)"
            ))
        # The data position is one for all ranks; its counts, summed over the dp ranks, resume on any number of them.
        data = {**self.loader.state_dict(), "stats": asdict(self.data_stats())}
        trainer_state = {"step": step, "data": data, "rng": rng_state()}
        self.writer.start(self.output_dir, step, self.loss_module, self.optimizer, trainer_state,
                          self.cfg.to_yaml(), self.cfg.train.keep_checkpoints)

    def step(self, step: int, factor) -> tuple[float, float, float, str | None, str | None]:
        """One optimizer step: (loss, gradient norm, learning rate, NOT_FINITE / NO_TARGET / None, what was not
        finite). Without a target the loss and gradient norm are NaN: there is none."""
        from longfit.memory.loss import batch_loss_sum, step_router_counts
        from longfit.parallel.batch import cp_layout, global_valid_tokens, shard_batch
        from longfit.parallel.comm import all_reduce_sum

        cfg, mesh, device = self.cfg, self.mesh, self.device
        layout = cp_layout(cfg.parallel.cp_method)
        # With train.epochs the data ends within the last step, which then holds fewer micro-batches (or, when a
        # shuffled later epoch packs into fewer rows than the first, none: a step without a target).
        micro_batches = [
            shard_batch(self.positioned(batch), mesh.cp_rank, self.dims.cp, layout).to(device)
            for batch in islice(self.loader, cfg.train.grad_accum)
        ]
        if self.metrics is None:
            # Only now, with the model built and the first data read, does this run write into output_dir.
            self.metrics = self._start_run_files()
        if not micro_batches:
            return math.nan, math.nan, cfg.train.lr * factor(step), NO_TARGET, None
        preference = cfg.train.objective != "causal_lm"
        if preference:  # the step's mean is over its pairs (memory/preference.py)
            from longfit.memory.preference import pair_loss_sum, pair_metric_means, step_pairs

            pairs = step_pairs(micro_batches, mesh.dp_group)
            valid = torch.tensor(pairs.pairs, device=device)
        else:
            valid = global_valid_tokens([b.labels for b in micro_batches], mesh.world_group)
        lr = cfg.train.lr * factor(step)
        # One host read before the forward (the GPU holds only the last update then), so that a step with nothing to
        # learn from costs no forward: with data.long_chats=split most rows of a long question can be such steps. The
        # count is global, the same on every rank: all of them skip together, and no collective is left waiting.
        if valid.item() == 0:
            return math.nan, math.nan, lr, NO_TARGET, None
        if self.pipeline is not None:  # the same objective, each micro-batch through every stage (parallel/pipeline.py)
            loss_sum = self.pipeline.step(micro_batches, valid)
        else:
            router_counts = None
            if cfg.train.router_loss == "step":
                with torch.autocast(device.type, dtype=self.autocast, enabled=self.autocast is not None):
                    router_counts = step_router_counts(self.loss_module, micro_batches)
            elif self.router_loss is not None:
                share = len(micro_batches) * self.dims.dp_size  # the step's micro-batches on every data-parallel rank
                self.loss_module.router_loss = self.router_loss.micro_batch_share(share)
            loss_sum, metric_sums = torch.zeros((), device=device), {}
            for batch in micro_batches:
                with torch.autocast(device.type, dtype=self.autocast, enabled=self.autocast is not None):
                    if preference:
                        micro_loss, sums = pair_loss_sum(self.loss_module, batch, pairs, router_counts)
                        metric_sums = {name: metric_sums.get(name, 0) + value for name, value in sums.items()}
                    else:
                        micro_loss = batch_loss_sum(self.loss_module, batch, valid, router_counts)
                (micro_loss / valid).backward()
                loss_sum += micro_loss.detach().float()
            if preference:  # TRL's metrics of the step, means over its pairs
                self.step_metrics = pair_metric_means(metric_sums, mesh.dp_group, pairs)
        grad_norm = clip_and_measure(self.loss_module, cfg.train.max_grad_norm, mesh.pp_group)
        loss = (all_reduce_sum(loss_sum, mesh.world_group) / valid).item()
        skipped = why = None
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            skipped, why = NOT_FINITE, f"loss {loss}, gradient norm {grad_norm}"
        else:
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss, grad_norm, lr, skipped, why

    def positioned(self, batch):
        """`batch` with its family's positions computed on the whole rows, before any context-parallel split (#54)."""
        from longfit.memory.loss import positioned

        return positioned(self.loss_module, batch)

    def loop(self, stop, startup: "StartupClock") -> TrainSummary:
        from longfit.eval.scores import retrieval_score
        from longfit.memory.apply import release_offload_stores
        from longfit.parallel.comm import all_reduce_max
        from longfit.train.checkpoint import on_every_rank, rank_zero_decides
        from longfit.train.console import data_outcome, progress_bar, progress_text
        from longfit.train.export import export_is_current, export_model
        from longfit.train.metrics import peak_memory_bytes

        cfg, device, start_step = self.cfg, self.device, self.start_step
        end_step = cfg.train.steps if self.stop_after_steps is None else min(cfg.train.steps, start_step + self.stop_after_steps)
        factor = lr_lambda(cfg)

        def stop_requested() -> int:
            flag = torch.tensor(float(stop.signum), device=device)
            flag = all_reduce_max(all_reduce_max(flag, self.mesh.world_group), self.mesh.pp_group)  # every stage stops
            return int(flag.item())

        self.metrics = None
        self.last_eval = None
        losses: list[float] = []
        bad: list[tuple[int, str]] = []  # the steps skipped as not finite since the last good one: (step, why)
        skipped_steps = no_target_steps = 0
        stopped_by = stop_requested()  # a signal while the model was built: no step at all
        done = start_step
        bar = progress_bar(cfg, start_step, enabled=self.rank == 0)
        self.loss_module.train()
        try:
            for step in range(start_step, end_step) if not stopped_by else ():
                started = time.perf_counter()
                epoch = self.loader.epoch
                self.step_metrics = {}
                loss, grad_norm, lr, skipped, why = self.step(step, factor)
                elapsed = time.perf_counter() - started
                done = step + 1
                tokens = cfg.train.grad_accum * cfg.train.micro_batch * cfg.seq_len * self.dims.dp_size
                if skipped == NO_TARGET:  # it ran no forward: no throughput to report (null), not a made-up one
                    tokens = math.nan
                row = {
                    "step": done, "loss": loss, "lr": lr, "grad_norm": grad_norm, "tokens_per_s": tokens / elapsed,
                    "peak_mem_bytes": peak_memory_bytes(device), "step_time_s": elapsed, "skipped": skipped is not None,
                }
                row.update(self.step_metrics)
                if skipped:
                    row["skip_reason"] = skipped
                if skipped == NO_TARGET:
                    if not no_target_steps:
                        self.say(f"\nnote: step {done} has no token with a target (its rows hold no assistant turn: "
                                 f"see data.long_chats), so it makes no update; such steps are not faults, do not count "
                                 f"towards train.max_bad_steps and are counted at the end")
                    no_target_steps += 1
                elif skipped:
                    skipped_steps += 1
                    bad.append((done, why))
                    self.say(f"\nwarning: step {done} skipped ({why}): no update")
                else:
                    losses.append(loss)
                    bad = []
                if skipped or done % cfg.train.log_every == 0 or done == cfg.train.steps:
                    self.metrics.log(row)
                if self.loader.epoch != epoch:
                    self.say(f"\nnote: step {done} read the data to its end and began it again: epoch {self.loader.epoch + 1}"
                             + (f" of {cfg.train.epochs}" if cfg.train.epochs else
                                f" (train.steps={cfg.train.steps} asks for more rows than the data holds)"))
                bar.set_postfix_str(progress_text(loss, lr, row["tokens_per_s"], skipped == NO_TARGET))
                bar.update(1)
                if step == start_step:
                    startup.mark("first step")
                    self.say("\n" + startup.line())
                if self.eval_data and (done == cfg.train.steps or cfg.train.eval_every and done % cfg.train.eval_every == 0):
                    self.last_eval = self.evaluate(done)
                if len(bad) >= cfg.train.max_bad_steps:
                    bar.close()
                    self.finish_saving()
                    raise on_every_rank(self._bad_steps_error(bad, self.saved or self.resume_from))
                stopped_by = stop_requested()
                if stopped_by:
                    break
                if cfg.train.save_every and done % cfg.train.save_every == 0 and done < end_step:
                    self.save(done)
        finally:
            # The steps are over, or failed: the offload stores' host arena (pinned on a GPU) and disk file go
            # back before the final checkpoint, the export and the retrieval eval need host memory.
            release_offload_stores(self.loss_module)
        bar.close()
        stats = self.data_stats()  # a collective: on every rank
        if stats.rows:
            self.say(data_outcome(self.cfg, stats, no_target_steps))
        self.finish_saving()
        if done > start_step and (self.saved is None or self.saved.name != f"step_{done:08d}"):
            self.save(done)
            self.finish_saving()
        export_dir = None
        finished = done == cfg.train.steps and not stopped_by
        final = self.output_dir / "final"
        # A finished run asked again with other export keys (lora.merge_on_export) exports again.
        if cfg.train.export and finished and (done > start_step or not rank_zero_decides(lambda: export_is_current(cfg, final))):
            export_dir = export_model(cfg, self.loss_module.model, self.tokenizer, final, self.rank, self.mesh.pp_group,
                                      media_encoder=getattr(self.loss_module, "media_encoder", None))
        retrieval_after = None
        if self.retrieval and export_dir is not None:  # rank 0's
            retrieval_after = retrieval_score(str(export_dir), cfg, device)
            self.trackers.log({"retrieval/after": retrieval_after.accuracy}, done)
        media_after = None if export_dir is None else self.score_media("after training", str(export_dir), done)
        peak = all_reduce_max(torch.tensor(float(peak_memory_bytes(device)), device=device), self.mesh.world_group)
        return TrainSummary(
            output_dir=self.output_dir,
            steps=done,
            first_loss=losses[0] if losses else float("nan"),
            last_loss=losses[-1] if losses else float("nan"),
            peak_mem_bytes=int(peak.item()),
            export_dir=export_dir,
            resumed_from=start_step,
            is_main=self.rank == 0,
            stopped_by=stopped_by,
            checkpoint=self.saved,
            skipped_steps=skipped_steps,
            no_target_steps=no_target_steps,
            retrieval_before=self.retrieval_before,
            retrieval_after=retrieval_after,
            last_eval=self.last_eval,
            media_retrieval_before=self.media_retrieval_before,
            media_retrieval_after=media_after,
        )

    def evaluate(self, step: int) -> EvalLoss:
        """The eval loss and perplexity after `step`, every rank taking part: to metrics.jsonl, the trackers and the console."""
        from longfit.eval.loss import eval_row_count, evaluate_loss
        from longfit.train.console import counted

        started = time.perf_counter()
        if self.cfg.train.objective != "causal_lm":
            return self.evaluate_pairs(step, started)
        loader = self.eval_data.loader(self.cfg.train.micro_batch, self.mesh.dp_rank, self.dims.dp_size)
        result = evaluate_loss(self.loss_module, loader, eval_row_count(self.cfg, self.dims.dp_size), self.device,
                               self.autocast, self.mesh, show_progress=self.rank == 0,
                               known_rows=self.eval_data.count.rows if self.eval_data.count.complete else None,
                               batch_loss=None if self.pipeline is None else self.pipeline.batch_loss)
        elapsed = time.perf_counter() - started
        self.metrics.log({"step": step, **result.metrics(), "eval_time_s": elapsed})
        self.say(f"\neval after step {step}: loss {result.loss:.4f}, perplexity {result.perplexity:.2f} "
                 f"({counted(result.rows, 'row')}, {counted(result.tokens, 'target token')}, {elapsed:.1f} s)")
        return result

    def evaluate_pairs(self, step: int, started: float):
        """The held-out pairs' loss and TRL's reward metrics after `step` (longfit.eval.preference)."""
        from longfit.data.preferences import PairLoader
        from longfit.eval.loss import eval_row_count
        from longfit.eval.preference import evaluate_pairs

        loader = PairLoader(self.eval_data, "held-out pairs", self.cfg.seq_len, self.cfg.train.micro_batch,
                            self.loader.pad_id, dp_rank=self.mesh.dp_rank, dp_size=self.dims.dp_size, epochs=1)
        result = evaluate_pairs(self.loss_module, loader, eval_row_count(self.cfg, self.dims.dp_size), self.device,
                                self.autocast, self.mesh, self.eval_reference)
        elapsed = time.perf_counter() - started
        self.metrics.log({"step": step, **result.metrics(), "eval_time_s": elapsed})
        self.say(f"\neval after step {step}: loss {result.loss:.4f}, reward accuracy "
                 f"{result.means['rewards/accuracies']:.3f}, margin {result.means['rewards/margins']:.4f} "
                 f"({result.pairs:,} held-out pairs, {elapsed:.1f} s)")
        return result

    def _no_intact_checkpoint(self, damaged: list) -> ConfigError:
        from longfit.train.checkpoint import CheckpointError

        reasons = "; ".join(f"{p.name}: {why}" for p, why in damaged)
        return CheckpointError(
            f"no intact checkpoint in {self.output_dir / 'checkpoints'} ({reasons}). Move or delete the damaged "
            f"checkpoints to train this run again from step 0, or choose a new output_dir"
        )

    def data_stats(self):
        """The loader's packing counts over the whole run (they resume with it), summed over the dp ranks."""
        from longfit.parallel.comm import all_reduce_sum

        stats = self.loader.stats
        names = [f.name for f in fields(stats)]
        counts = torch.tensor([asdict(stats)[name] for name in names], dtype=torch.int64, device=self.device)
        counts = all_reduce_sum(counts, self.mesh.dp_group).tolist()
        return PackingStats(**{name: int(count) for name, count in zip(names, counts)})

    def _bad_steps_error(self, bad: list[tuple[int, str]], last: Path | None) -> NonFiniteError:
        fix = ("Lower train.lr (resume with --allow-changes train.lr), check the data these steps read, or raise "
               "train.max_bad_steps.")
        return NonFiniteError(
            f"steps {bad[0][0]}-{bad[-1][0]} were skipped, {len(bad)} in a row (train.max_bad_steps="
            f"{self.cfg.train.max_bad_steps}; the last: {bad[-1][1]}), so the run stopped. No checkpoint was written "
            f"from them; the last checkpoint is {last or 'none'}. {fix}"
        )

    def _start_run_files(self):
        """config.yaml with its history, and metrics.jsonl cut back to the step this run starts from."""
        from longfit.train.metrics import MetricsLogger
        from longfit.train.resume import change_event, config_file_text, history_entries

        output_dir, is_main, start_step = self.output_dir, self.rank == 0, self.start_step
        if is_main:
            config_file = output_dir / "config.yaml"
            previous = config_file.read_text() if config_file.exists() else None
            entries = history_entries(self.changes, start_step, self.allow_changes)
            config_file.write_text(config_file_text(self.cfg, previous, entries))
        metrics = MetricsLogger(output_dir, is_main, self.trackers)
        dropped = metrics.truncate_after(start_step)
        if dropped:
            self.say(f"dropped {dropped} line(s) of metrics.jsonl written after step {start_step} (or torn by a crash)")
        event = change_event(self.changes, start_step, self.allow_changes)
        if event:
            metrics.log(event)
        return metrics


def attention_line(
    model: torch.nn.Module, device: torch.device, dtype: torch.dtype, cp_method: str | None, pairs: bool = False
) -> str:
    """The log line naming the attention kernel of this run (rows of one document, and packed rows if different;
    `pairs`: rows of preference pairs, whose answers share their prompt: models/blockwise.py's blocks)."""
    from longfit.models.attention import attention_kernel_name, attention_sink_layers
    from longfit.models.structure import unwrap_peft

    from longfit.models.linear_attention import LINEAR_ATTENTION, linear_kernel_name

    text = unwrap_peft(model).config.get_text_config()
    sinks = attention_sink_layers(model)
    dense, packed = (attention_kernel_name(text, device, dtype, packed, cp_method, sinks) for packed in (False, True))
    line = f"attention kernel: {dense}" + ("" if packed == dense else f" (rows of several documents: {packed})")
    if pairs:
        line = f"attention kernel: {f'{cp_method} over ' if cp_method else ''}blockwise (answers sharing a prompt)"
    if LINEAR_ATTENTION in (getattr(text, "layer_types", None) or ()):
        split = ", head-split over the cp ranks" if cp_method else ""
        line += f"; linear-attention layers: {linear_kernel_name(device, dtype)}{split}"
    return line


def clip_and_measure(module: torch.nn.Module, max_norm: float, stage_group=None) -> float:
    """Global gradient norm (over all shards), clipping to `max_norm` when it is > 0.

    Under expert parallelism the experts' gradients are DTensors on another mesh than the rest, which one foreach
    norm cannot mix: the norm of each mesh's gradients is taken apart and combined (the 2-norm of the norms). Under
    pipeline parallelism `module` is one stage: the stages' norms combine likewise over `stage_group`."""
    from longfit.parallel.comm import all_reduce_sum

    params = [p for p in module.parameters() if p.grad is not None]
    by_mesh: dict[object, list[torch.Tensor]] = {}
    for param in params:
        by_mesh.setdefault(getattr(param, "device_mesh", None), []).append(param)
    norms = []
    for group in by_mesh.values():
        norm = torch.nn.utils.get_total_norm([p.grad for p in group], foreach=True)
        norms.append(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
    total = torch.linalg.vector_norm(torch.stack([n.float() for n in norms]))
    if stage_group is not None:
        total = all_reduce_sum(total * total, stage_group).sqrt()
    if max_norm > 0:
        for group in by_mesh.values():
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, total, foreach=True)
    return float(total)
