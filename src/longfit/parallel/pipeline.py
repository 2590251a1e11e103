"""Pipeline parallelism: the decoder cut into parallel.pp stages, run by torch.distributed.pipelining's schedules.

Derivation (why the pipelined step is the one-process step). The model is f = head . L_{n-1} . ... . L_0 . embed.
Stage s of S holds layers [a_s, a_{s+1}) (`stage_layers`: parallel.pp_layers, or an even cut), the first stage also the
embeddings, the last the final norm, lm_head and the chunked loss. A pp rank holds one stage, or under the interleaved
and V schedules several (`rank_stages`: r, r + pp, ... or r and 2 pp - 1 - r), all in one model of the parts it holds
(`PipelineStageLoss`), each stage a `VirtualStage` that torch's PipelineStage runs and FSDP2 shards as a root of its
own (torchtitan's model chunks). A stage runs the transformers body itself, with only its layers in it: the first
from input_ids, the others from the previous stage's hidden states given as `inputs_embeds` (which the proven families,
`ParallelDims.check_pipeline`, hand to their first layer unchanged), each computing the rotary embeddings from the
micro-batch's position_ids as the whole body would. Composed, the stages compute f exactly.

The step's objective is unchanged: sum over micro-batches m and tokens t of loss_{m,t} / T, T the step's valid
label tokens over every rank (`global_valid_tokens`, the same on every stage: each reads the same rows). The last
stage's output for micro-batch m is its summed token loss; the schedule's loss function divides it by T, so each
micro-batch's backward is that of its share of the global mean, as the one-process loop's `(micro_loss / T).backward()`
(scale_grads=False: torch would otherwise divide by the micro-batch count too). The backward of a stage's output
receives d(objective)/d(hidden) from the next stage, so every parameter's gradient, accumulated over the micro-batches,
is the one-process gradient; FSDP2 then reduces it over the stage's dp_shard x cp ranks as without pp.

Zero bubble (`interleaved_zb`, `zbv`, `dualpipev`). torch splits each stage's backward into the input gradient and,
later, the weight gradient, which it finds from the stage's parameters as the forward used them: the layers (and their
experts units under ep, parallel/fsdp.py) must stay gathered from forward to backward
(parallel.reshard_after_forward=false, `ParallelDims.check_pipeline`), and the chunked loss's
backward runs twice from the same incoming gradient (memory/chunked_loss.py returns the same gradients again). The
sums are those of 1F1B: every parameter's gradient over the micro-batches, in another order.

Micro-batches. The schedule splits the step's inputs into chunks along dim 0; packed rows carry more than a tensor
that splits that way (cu_seqlens of each micro-batch's own documents, the host-side document layout), so the stage
module holds the step's micro-batches (`PipelineStageLoss.micro_batches`) and the schedule hands each stage only a
micro-batch index (a keyword argument, which torch gives every stage): position_ids, cu_seqlens and documents travel
with the micro-batch on every stage, cp shards included. Only hidden states cross stages.

Parameter names. A stage keeps its decoder layers under their names in the whole model (`StageLayers`: layer 5 of
the model is `layers.5` on whichever stage holds it), so the seeded initialisation, the checkpoint's weight slices and
DCP's checkpoints address every parameter as one process does. DCP therefore reshards a checkpoint onto another pp
degree (each rank reads the names its stage holds), and the export gathers the stages' full state dicts on rank 0
(`gather_stage_states`).

Router loss (memory/router_loss.py). Given the step's routing counts (C, N) over every layer, micro-batch and rank,
the load-balancing term E / N^2 x sum_e C_e S_e is linear in S, a sum over the layers' router calls: it splits over the
stages, each adding E / N^2 x sum_e C_e S_e^(stage). The counts need every stage's routing before any backward, so a
step first runs the micro-batches forward through the stages without gradient (`Pipeline.count_routes`: blocking
sends of the hidden states, the counts all-reduced over the stages and the ranks holding other tokens), as the
one-process step counts before its first backward. The last stage adds its term to the loss it outputs; an earlier
stage has no loss output, so its term rides on its hidden states (`_RouterTerm`: identity forward, and in backward the
term's gradient with the objective's scale, 1 / T times FSDP2's N). Every stage's term value joins the logged loss.

Tensor parallelism (parallel/tp.py) applies to each stage's parts as to a whole model. With sequence parallelism the
residual stream between decoder layers is each tp rank's tokens, (B, L / (cp tp), H), a plain tensor that the next
layer's norm reads as its Shard(1) DTensor; a stage's output is that tensor and the next stage's first layer reads it
the same way. So tp rank t of stage s sends its shard to tp rank t of stage s + 1: pp is the mesh's outermost axis, so
the ranks of a pp group share their (dp_shard, cp, tp) coordinate and the pp group pairs them up. Exact (the bytes
a layer would hand the next, no arithmetic) and the cheapest choice: 1/tp of the activation per rank, no collective;
a replicated stage output would all-gather it over tp before the send and throw away (tp - 1)/tp of it after.

Expert parallelism (parallel/expert.py) applies to each stage's MoE layers as to a whole model, over the stage's
expert mesh (`ParallelDims.build_mesh`: the ep groups and the ranks FSDP2 shards a stage's experts over are ranks of
that stage). Its all-to-alls are collectives of the stage's ep group, issued in each micro-batch's forward, its
backward and any recomputation, so every rank of the group must run the same micro-batches through the same layers
in the same order. They do: the ranks of a stage share its pp coordinate, so they build the same schedule (its
actions depend on the pp rank and the micro-batch count alone, and every rank of a step has as many micro-batches),
`count_routes` and the eval run the micro-batches in index order on every rank, and only hidden states cross stages.
Each rank's tokens reach the experts through the counts exchanged first, so ranks with different rows stay exact.

Image rows (#54). The vision side (`longfit.models.media.MediaEncoder`: tower and projector) is part of the first
stage, as the embeddings are: the first stage's forward of a micro-batch runs the tower on that micro-batch's images
(dealt over the stage's cp ranks, parallel/media.py), puts their embeddings in their placeholders' place in the input
embeddings and runs its layers on them (`CausalLMLoss.media_inputs`, the one-process path); its backward of that
micro-batch ends in the tower where it trains. The tower's weights are sharded with the first stage's root, its
checkpointed blocks' inputs stored per micro-batch in flight as the stage's layers' are, and the export and the
checkpoints find them under the one-process names on the ranks of the first stage. What crosses stages is unchanged:
the hidden states. So the later stages' layers must read nothing else a family's image rows change: a family whose
images set every layer's positions (Qwen3.5's M-RoPE), attention layout (Gemma 3's image spans) or per-layer inputs
(Gemma 4's) is refused (`refuse_image_rules`); the families whose decoders pipeline stages take
(`ParallelDims.check_pipeline`) give their image rows text positions and causal attention (Mistral 3).

Communication: one activation (B, L / (cp tp), H) per micro-batch forward, its gradient backward, between
neighbouring stages over `ParallelMesh.pp_group` (torch's batched P2P); the loss, summed on the last stage, and the
squared gradient norm are all-reduced over that group once per step.
"""

from __future__ import annotations

import contextlib
import operator
from typing import TYPE_CHECKING

import torch
from torch import nn

from longfit.config import ConfigError
from longfit.memory.apply import offloaders
from longfit.memory.loss import CausalLMLoss
from longfit.memory.router_loss import collect_router_prob_sums
from longfit.models.attention import batch_documents, remember_documents
from longfit.models.document_mixers import refuse_pipeline
from longfit.models.structure import decoder, decoder_and_head, decoder_layers, unwrap_peft
from longfit.parallel.dims import PIPELINE_SCHEDULES, stage_layers

if TYPE_CHECKING:
    from longfit.config import Config
    from longfit.data.packing import PackedBatch
    from longfit.parallel.dims import ParallelMesh


def rank_stages(pp_rank: int, pp: int, per_rank: int, placement: str) -> list[int]:
    """The pipeline stages rank `pp_rank` holds, in order (`PIPELINE_SCHEDULES`' placements, torchtitan's): "single"
    and "loop" rank r holds stages r, r + pp, ...; "v" rank r holds stages r and 2 pp - 1 - r."""
    if placement == "v":
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + k * pp for k in range(per_rank)]


def holds_first_stage(pp_rank: int, dims, schedule: str) -> bool:
    """Whether pp rank `pp_rank` of `dims` (ParallelDims) under parallel.pp_schedule=`schedule` holds the first stage,
    and with it an image-text checkpoint's vision side (`cut_stage`): the trainer builds that side there alone."""
    return 0 in rank_stages(pp_rank, dims.pp, dims.pp_stages_per_rank, PIPELINE_SCHEDULES[schedule][1])


def micro_batches_in_flight(schedule: str, pp: int, stage: int, grad_accum: int) -> int:
    """Micro-batches whose forward stage `stage` (the pp rank's stage under "single" placements) has run and whose
    backward it has not, at most, over a step of `grad_accum`: under 1F1B min(pp - stage, grad_accum) (its warm-up
    forwards, then one backward for each forward); under GPipe, and 1F1B with fewer micro-batches than stages (which
    `Pipeline` runs as GPipe), all of them. A rank holding several stages (interleaved and V schedules) counts every
    micro-batch of the step for each of its layers: the most they keep (they interleave the stages' micro-batches to
    hold fewer; zero bubble keeps the inputs of deferred weight gradients, within the same count)."""
    if schedule == "1f1b" and grad_accum >= pp:
        return min(pp - stage, grad_accum)
    return grad_accum


def stage_rank(stage: int, pp: int, placement: str) -> int:
    """The pp rank that holds `stage` (the inverse of `rank_stages`)."""
    if placement == "v" and stage >= pp:
        return 2 * pp - 1 - stage
    return stage % pp


def refuse_image_rules(config, pp: int) -> None:
    """Refuse image rows of the wrapper `config` under parallel.pp where its family's images change what every decoder
    layer reads (module docstring): stages after the first receive the hidden states alone."""
    from longfit.models.media import decoder_rules, encoder_type, media_family

    rules = decoder_rules(encoder_type(media_family(config)))
    if rules:
        raise ConfigError(f"parallel.pp={pp}: the {config.model_type} checkpoint's image rows give every decoder layer "
                          f"{' and '.join(rules)}, which pipeline stages after the first do not receive; set "
                          f"parallel.pp=1 (parallel.cp and parallel.tp split image rows)")


class StageLayers(nn.ModuleList):
    """The decoder layers of one pp rank under their names in the whole model ("5" for layer 5).

    Positions (`layers[i]`, `layers[i] = wrapped`, as the memory techniques index them) count this rank's layers.
    Iteration and slicing (transformers' `self.layers[: num_hidden_layers]`) yield them in order: all of them, or while
    a stage runs (`active`, set by `PipelineStageLoss.forward`) that stage's alone."""

    active: range | None = None

    def _get_abs_string_index(self, idx) -> str:
        return list(self._modules)[operator.index(idx)]

    def __iter__(self):
        if self.active is None:
            return iter(self._modules.values())
        return (self._modules[str(index)] for index in self.active)

    def __getitem__(self, idx):
        if isinstance(idx, slice):
            return list(self)[idx]
        return super().__getitem__(idx)


def _replace_child(root: nn.Module, child: nn.Module, replacement: nn.Module | None) -> None:
    for module in root.modules():
        for name, candidate in module.named_children():
            if candidate is child:
                setattr(module, name, replacement)
                return
    raise ValueError(f"{type(child).__name__} is not a module of {type(root).__name__}")


class _RouterTerm(torch.autograd.Function):
    """Identity on a stage's hidden states in forward; in backward, also the gradient `scale` of the stage's router
    term (module docstring). A copy, not a view: the zero-bubble schedules detach a stage's outputs in place."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, term: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale, ctx.term_shape = scale, term.shape
        return hidden.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, grad.new_full(ctx.term_shape, ctx.scale, dtype=torch.float32), None


class VirtualStage(nn.Module):
    """One pipeline stage of a pp rank, what torch's PipelineStage runs and FSDP2's root for its part: its decoder
    layers (FSDP2 units of their own), and the embeddings (and an image-text checkpoint's vision side) on the first
    stage, the final norm and lm_head on the last.
    The modules are the rank's (`PipelineStageLoss.model`, where their names are the whole model's); the stage holds
    them again under names of its own, which no state dict reads."""

    def __init__(self, run, index: int, modules: dict[str, nn.Module]):
        super().__init__()
        self.run, self.index = run, index
        for name, module in modules.items():
            self.add_module(name, module)

    def forward(self, inputs: torch.Tensor, micro_batch: torch.Tensor, counting: bool = False) -> torch.Tensor:
        return self.run(inputs, micro_batch, self.index, counting)


class PipelineStageLoss(CausalLMLoss):
    """The pipeline stages of one pp rank over one model that holds only their parts: per stage, hidden states in
    (input_ids on the first stage), hidden states out (the summed token loss on the last stage, fp32, shape (1,))."""

    def __init__(self, model: nn.Module, layers: dict[int, range], stages: int, chunked_loss: bool = False,
                 loss_chunk: int = 0, media_encoder: nn.Module | None = None):
        super().__init__(model, chunked_loss=chunked_loss, loss_chunk=loss_chunk, media_encoder=media_encoder)
        self.layers, self.stages = layers, stages  # this rank's stages -> their decoder layers; stages in all
        self.micro_batches: list["PackedBatch"] = []
        self.gradient_scale = 1.0  # FSDP2's N on the ranks holding other tokens (parallel/fsdp.py), set by parallelize
        self.step_tokens = self.step_counts = None  # the step's T and router counts (C, N) while it runs
        self.router_terms: list[torch.Tensor] = []  # the router terms (x T) of this rank's stages before the last
        self.offloaders: list | None = None  # the activation offloaders of its checkpointed layers
        causal_lm, body = unwrap_peft(model), decoder(model)
        kept = decoder_layers(model)
        last = stages - 1
        parts = {"embed_tokens": causal_lm.get_input_embeddings(), "norm": body.norm,
                 "lm_head": causal_lm.get_output_embeddings(), "media_encoder": media_encoder}
        first = ["embed_tokens"] + (["media_encoder"] if media_encoder is not None else [])
        # A plain list: the stages hold the rank's modules again, which must not join its state dict.
        self.virtual_stages = [
            VirtualStage(self.forward, stage, {
                **{f"layer_{index}": kept._modules[str(index)] for index in span},
                **{name: parts[name] for name in (first if stage == 0 else [])
                   + (["norm", "lm_head"] if stage == last else [])},
            }) for stage, span in layers.items()
        ]

    @property
    def holds_last(self) -> bool:
        return self.stages - 1 in self.layers

    def forward(self, inputs: torch.Tensor, micro_batch: torch.Tensor, stage: int,
                counting: bool = False) -> torch.Tensor:
        """inputs: input_ids (B, L) on the first stage (with the micro-batch's images, if any), else the previous
        stage's hidden states (B, L, H);
        micro_batch: the index (1,) of the step's micro-batch whose layout (positions, documents, labels) they have;
        stage: which of this rank's stages runs. `counting`: only the hidden states and this stage's router counts
        (C, N) (`count_routes`), from every stage."""
        batch = self.micro_batches[int(micro_batch)]
        if self.offloaders is None:  # the memory techniques are applied after the cut (`parallelize`)
            self.offloaders = offloaders(self)
        for offloader in self.offloaders:
            offloader.start_pass()  # this stage's layers (and tower), for this micro-batch: their own prefetch chain
        body, lm_head = decoder_and_head(self.model)
        documents = batch_documents(batch.cu_seqlens, batch.documents, batch.input_ids.shape[0])
        remember_documents(batch.position_ids, documents)
        if stage > 0:
            embedded = {"inputs_embeds": inputs, "position_ids": batch.position_ids}
        elif self.media_encoder is not None:  # the micro-batch's images in their placeholders' place
            embedded = self.media_inputs(body, inputs, batch.position_ids, batch.media)
        else:
            embedded = {"input_ids": inputs, "position_ids": batch.position_ids}
        routed = self.router_loss is not None
        layers, norm, last = decoder_layers(self.model), body.norm, stage == self.stages - 1
        layers.active = self.layers[stage]
        if not last:  # a rank holding the last stage and others: the final norm (sharded with the last) only there
            body.norm = nn.Identity()
        try:
            with collect_router_prob_sums(self.router_loss) if routed else contextlib.nullcontext() as tiled_prob_sums:
                output = body(**embedded, cu_seq_lens_q=batch.cu_seqlens,
                              longfit_documents=documents, use_cache=False,
                              **({"output_router_logits": True} if routed else {}))
        finally:
            layers.active, body.norm = None, norm
        hidden = output.last_hidden_state  # (B, L, H)
        if counting:
            self.step_counts = self.step_counts + self.router_loss.counts(output.router_logits)
            return hidden
        term = None
        if routed and self.step_tokens is not None:  # training (no router term in the eval loss, as CausalLMLoss)
            term = self.router_loss.local_term(output.router_logits, None, self.step_counts, tiled_prob_sums)
            term = self.step_tokens.to(term) * self.router_loss.coef * term
            if not last:  # the last stage's term is in the loss it outputs
                self.router_terms.append(term.detach())
        if not last:
            return hidden if term is None else _RouterTerm.apply(hidden, term, self.gradient_scale / float(self.step_tokens))
        loss = self.token_loss(hidden, lm_head, batch.labels)
        if term is not None:
            loss = loss + term
        return loss.float().reshape(1)  # (1,): the schedule concatenates them


def cut_stage(loss_module: CausalLMLoss, stages: list[int], total: int, sizes=()) -> PipelineStageLoss:
    """Keep only the parts of `loss_module`'s model (built on the meta device: nothing is allocated) that pipeline
    stages `stages` of `total` hold (`sizes`: parallel.pp_layers, the decoder layers of each stage; empty: an even
    cut), and its vision side where they hold the first, and return the rank's objective over them."""
    model = loss_module.model
    refuse_pipeline(model)
    causal_lm, body = unwrap_peft(model), decoder(model)
    layers = decoder_layers(model)
    cut = stage_layers(len(layers), total, sizes)
    held = {stage: cut[stage] for stage in stages}
    kept = StageLayers()
    for index in sorted(index for span in held.values() for index in span):
        kept.add_module(str(index), layers[index])
    _replace_child(causal_lm, layers, kept)
    if 0 not in held:
        _replace_child(causal_lm, causal_lm.get_input_embeddings(), None)
    if total - 1 not in held:
        body.norm = nn.Identity()
        _replace_child(causal_lm, causal_lm.get_output_embeddings(), None)
    media_encoder = loss_module.media_encoder if 0 in held else None
    return PipelineStageLoss(model, held, total, loss_module.chunked_loss, loss_module.loss_chunk, media_encoder)


class Pipeline:
    """This rank's stages and the schedule that runs a step's micro-batches through all stages."""

    def __init__(self, stage_module: PipelineStageLoss, cfg: "Config", mesh: "ParallelMesh", device: torch.device,
                 dtype: torch.dtype):
        from torch.distributed.pipelining import PipelineStage

        dims = mesh.dims
        # this rank's tokens of each row: its cp shard, of which tensor parallelism's residual stream holds 1/tp
        rows, tokens = cfg.train.micro_batch, cfg.seq_len // dims.cp // dims.tp
        hidden_size = unwrap_peft(stage_module.model).config.get_text_config().hidden_size
        # requires_grad: the received hidden states are leaves whose gradient goes back to the previous stage
        hidden = torch.empty(rows, tokens, hidden_size, dtype=dtype, device="meta", requires_grad=True)
        input_ids = torch.empty(rows, tokens, dtype=torch.long, device="meta")
        loss = torch.empty(1, dtype=torch.float32, device="meta")
        last = stage_module.stages - 1
        self.stages = [
            PipelineStage(view, view.index, stage_module.stages, device, input_args=input_ids if view.index == 0 else hidden,
                          output_args=loss if view.index == last else hidden, group=mesh.pp_group)
            for view in stage_module.virtual_stages
        ]
        self.module, self.group, self.kind = stage_module, mesh.pp_group, cfg.parallel.pp_schedule
        self.placement, self.pp = PIPELINE_SCHEDULES[self.kind][1], dims.pp
        self.device, self.hidden, self.token_group = device, hidden, mesh.world_group
        self.schedules: dict[int, object] = {}
        self.valid = self.loss_sum = None

    def _schedule(self, micro_batches: int):
        from torch.distributed.pipelining import schedules

        if micro_batches not in self.schedules:
            kind = PIPELINE_SCHEDULES[self.kind][0]
            # Fewer micro-batches than stages (train.grad_accum < pp, or the last step of train.epochs) cannot fill a
            # 1F1B pipeline (torch refuses it): GPipe runs them, the same sums, and as 1F1B would, all in flight at
            # once. The interleaved schedules run rounds of pp micro-batches, max(1, n // pp) of them, which must
            # divide n: where they do not, looped BFS (GPipe over the same stages) runs the step.
            if self.placement == "single" and micro_batches < self.pp:
                kind = "ScheduleGPipe"
            elif self.placement == "loop" and micro_batches % max(1, micro_batches // self.pp):
                kind = "ScheduleLoopedBFS"
            elif kind == "ScheduleDualPipeV" and micro_batches < 2 * self.pp:  # the last step of train.epochs
                kind = "ScheduleZBVZeroBubble"  # DualPipeV needs one per stage; ZBV runs the same V, the same sums
            schedule_class = getattr(schedules, kind)
            stages = self.stages[0] if self.placement == "single" else self.stages
            self.schedules[micro_batches] = schedule_class(stages, micro_batches, loss_fn=self._share, scale_grads=False)
        return self.schedules[micro_batches]

    def _share(self, summed_loss: torch.Tensor, _index: torch.Tensor) -> torch.Tensor:
        """A micro-batch's share of the step's mean loss (module docstring), its summed loss kept for the log."""
        self.loss_sum += summed_loss.detach().sum()  # the router term of the last stage's layers included
        return summed_loss.sum() / self.valid

    @torch.no_grad()
    def _forward_only(self, micro_batches: list["PackedBatch"], counting: bool = False) -> list[torch.Tensor]:
        """Each micro-batch forward through the stages without gradient, the hidden states sent from rank to rank
        (blocking point-to-point) or kept where the next stage is on this rank; the last stage's outputs (the summed
        losses; hidden states when `counting`), on the rank holding it."""
        import torch.distributed as dist
        from torch.distributed.distributed_c10d import get_global_rank

        module, outputs = self.module, []
        module.micro_batches = micro_batches
        views = {view.index: view for view in module.virtual_stages}
        owner = {stage: get_global_rank(self.group, stage_rank(stage, self.pp, self.placement))
                 for stage in range(module.stages)}
        for index, batch in enumerate(micro_batches):
            carried = batch.input_ids
            for stage, view in views.items():
                if stage > 0 and stage - 1 not in views:
                    carried = torch.empty((batch.input_ids.shape[0], *self.hidden.shape[1:]), dtype=self.hidden.dtype,
                                          device=self.device)
                    dist.recv(carried, src=owner[stage - 1], group=self.group)
                carried = view(carried, torch.tensor([index]), counting=counting)
                if stage == module.stages - 1:
                    outputs.append(carried)
                elif stage + 1 not in views:
                    dist.send(carried.contiguous(), dst=owner[stage + 1], group=self.group)
        return outputs

    def count_routes(self, micro_batches: list["PackedBatch"]) -> torch.Tensor:
        """The step's router counts (C, N) over every stage's layers, micro-batch and rank (module docstring)."""
        import torch.distributed as dist

        module = self.module
        module.step_counts = torch.zeros(module.router_loss.experts + 1, device=self.device)
        self._forward_only(micro_batches, counting=True)
        dist.all_reduce(module.step_counts, group=self.group)
        if self.token_group is not None:
            dist.all_reduce(module.step_counts, group=self.token_group)
        return module.step_counts

    def step(self, micro_batches: list["PackedBatch"], valid: torch.Tensor) -> torch.Tensor:
        """Forward and backward of the step's micro-batches (this rank's cp shards) through every stage: gradients
        accumulate on each stage's parameters. Returns the micro-batches' summed token loss, on every stage."""
        import torch.distributed as dist

        module = self.module
        module.micro_batches, module.step_tokens = micro_batches, valid
        if module.router_loss is not None:
            self.count_routes(micro_batches)
        self.valid, self.loss_sum = valid, torch.zeros((), device=self.device)
        index = torch.arange(len(micro_batches))
        inputs = (torch.cat([b.input_ids for b in micro_batches]),) if 0 in module.layers else ()
        target = index if module.holds_last else None
        self._schedule(len(micro_batches)).step(*inputs, micro_batch=index, target=target)
        self.loss_sum += sum(module.router_terms, torch.zeros((), device=self.device))
        module.micro_batches, module.router_terms, module.step_tokens, module.step_counts = [], [], None, None
        dist.all_reduce(self.loss_sum, group=self.group)
        return self.loss_sum

    def batch_loss(self, batch: "PackedBatch") -> torch.Tensor:
        """The summed token loss of `batch` (this rank's cp shard) without gradient, on every stage: what
        `memory.loss.batch_loss_sum` is on one stage, for the held-out eval (`eval.loss.evaluate_loss`)."""
        import torch.distributed as dist

        outputs = self._forward_only([batch])
        loss = outputs[0].sum() if outputs else torch.zeros((), device=self.device)
        self.module.micro_batches = []
        dist.all_reduce(loss, group=self.group)  # only the last stage's is not zero
        return loss


def gather_stage_states(state: dict, group) -> dict:
    """The whole model's state dict on the group's first rank (each stage's `state` merged), {} on the others.
    Collective over `group` (`ParallelMesh.pp_group`); None: `state` itself."""
    if group is None:
        return state
    import torch.distributed as dist

    states = [None] * dist.get_world_size(group) if dist.get_rank(group) == 0 else None
    dist.gather_object(state, states, group_dst=0, group=group)
    return {key: value for part in states for key, value in part.items()} if states else {}
