"""Images and videos in evaluation (#54): the eval loss of image rows, and the image retrieval eval.

- `longfit eval --data` and the trainer's periodic eval (data.eval_path, data.eval_fraction) read chat rows with image
  parts by the training reader and run them through the wrapper's vision side: the eval loss of image rows equals the
  wrapper's own forward loss (transformers' eager wrapper, each conversation alone with its images), in fp32 and
  within the bf16 bound under autocast, on one process and (slow) under cp=2 on gloo;
- bad image rows in the eval data are one `longfit: error:` line;
- the synthetic image retrieval eval (`eval.retrieval_media`) renders pages with Pillow, one holding the key, and
  scores the answer as the text retrieval does.

The tiny Qwen3.5 wrapper and the rows are tests/test_media.py's.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from test_media import (  # noqa: E402,F401
    ONE, ROWS, TEXT_ONLY, TWO, image_batch, longfit_model, qwen_images, wrapper_step, write_rows)
from test_media_video import qwen_video  # noqa: E402,F401

from longfit.check.steps import BF16_FACTOR, BF16_LOSS_FLOOR  # noqa: E402
from longfit.cli import main  # noqa: E402


def eval_json(capsys, argv: list[str]) -> dict:
    assert main(["eval", *argv, "--device", "cpu", "--json", "-"]) == 0
    out = capsys.readouterr().out
    return json.loads(out[out.index("{"):])


@pytest.fixture(scope="module")
def packed_rows(tmp_path_factory) -> Path:
    conversations, _, _ = ROWS["packed"]
    return write_rows(tmp_path_factory.mktemp("eval-image-rows"), conversations)


def test_longfit_eval_loss_of_image_rows_equals_the_wrapper(qwen_images, packed_rows, capsys, one_thread) -> None:
    _, seq_len, micro_batch = ROWS["packed"]
    got = eval_json(capsys, ["--model", str(qwen_images), "--data", str(packed_rows), "--seq-len", str(seq_len),
                             "--rows", str(micro_batch)])
    batch = image_batch(qwen_images, packed_rows, seq_len, micro_batch)  # the same first rows, as training packs them
    assert batch.media.images == 4 and got["rows"] == micro_batch and got["tokens"] == batch.num_label_tokens
    want = float(wrapper_step(qwen_images, batch).loss)
    assert got["loss"] == pytest.approx(want, rel=2e-6, abs=1e-6)


def test_eval_loss_of_image_rows_is_within_the_bf16_bound(qwen_images, packed_rows, one_thread) -> None:
    """Under bf16 autocast (train.dtype=bf16's regime), within BF16_FACTOR x transformers' own bf16 error."""
    from longfit.data.packing import EvalData
    from longfit.eval.loss import evaluate_loss
    from longfit.models.loading import load_tokenizer
    from longfit.models.media import media_reader
    from longfit.config import load_config

    _, seq_len, micro_batch = ROWS["packed"]
    cfg = load_config(None, [f"model={qwen_images}", f"data.eval_path={packed_rows}", f"seq_len={seq_len}"])
    data = EvalData(cfg, load_tokenizer(str(qwen_images)), media_reader(str(qwen_images)))
    got = evaluate_loss(longfit_model(qwen_images, "frozen"), data.loader(1), micro_batch, torch.device("cpu"),
                        autocast=torch.bfloat16, show_progress=False).loss
    batch = image_batch(qwen_images, packed_rows, seq_len, micro_batch)
    truth = float(wrapper_step(qwen_images, batch).loss)
    references = [float(wrapper_step(qwen_images, batch, a, autocast=True).loss) for a in ("eager", "sdpa")]
    noise = max(abs(r - truth) / abs(truth) for r in references)
    assert abs(got - truth) / abs(truth) <= BF16_FACTOR * noise + BF16_LOSS_FLOOR, (got, references, truth)


@pytest.mark.parametrize("problem, message", [
    ("missing", r"image .*nowhere\.png does not exist; fix the path"),
    ("no reader", r"this chat has image or video parts, which this run cannot read"),
])
def test_bad_image_rows_in_the_eval_data_are_one_line(qwen_images, tmp_path, capsys, problem, message) -> None:
    chat = [dict(TWO[0], content=[TWO[0]["content"][0], {"type": "image", "path": "nowhere.png"}]), TWO[1]]
    rows = write_rows(tmp_path, [chat] if problem == "missing" else [ONE])
    model = str(qwen_images) if problem == "missing" else "llama-tiny"
    assert main(["eval", "--model", model, "--data", str(rows), "--seq-len", "64", "--device", "cpu"]) == 2
    (err,) = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert err.startswith("longfit: error: ") and re.search(message, err), err


def train_argv(checkpoint: Path, rows: Path, evals: Path, out: Path) -> list[str]:
    """One step at lr 1e-12 (below the weights' fp32 rounding: unchanged), then the eval of the image rows `evals`."""
    return [f"model={checkpoint}", f"data.path={rows}", f"data.eval_path={evals}", "data.eval_rows=2",
            f"output_dir={out}", f"seq_len={ROWS['packed'][1]}", "train.device=cpu", "train.steps=1", "train.lr=1e-12",
            "train.warmup_steps=0", "train.weight_decay=0", "eval.retrieval=false", "train.export=false"]


def logged_eval_loss(out: Path) -> float:
    (loss,) = [json.loads(line)["eval_loss"] for line in (out / "metrics.jsonl").read_text().splitlines()
               if '"eval_loss"' in line]
    return loss


@pytest.mark.slow  # a one-process run and a --nproc 2 cp=2 run, each with its preflight check: ~2 min on 2 busy cores
@pytest.mark.timeout(1200)
def test_the_trainers_eval_of_image_rows_equals_the_wrapper_on_one_process_and_under_cp(
        qwen_images, packed_rows, tmp_path) -> None:
    """Training data of text chats only: the eval data's images alone make the run build the vision side."""
    import subprocess

    text_rows = write_rows(tmp_path / "text", [TEXT_ONLY] * 8)
    _, seq_len, micro_batch = ROWS["packed"]
    batch = image_batch(qwen_images, packed_rows, seq_len, micro_batch)
    want = float(wrapper_step(qwen_images, batch).loss)
    assert main(["train", *train_argv(qwen_images, text_rows, packed_rows, tmp_path / "one")]) == 0
    assert logged_eval_loss(tmp_path / "one") == pytest.approx(want, rel=1e-5)
    done = subprocess.run([sys.executable, "-m", "longfit", "train", "--nproc", "2", "parallel.cp=2",
                           *train_argv(qwen_images, text_rows, packed_rows, tmp_path / "cp2")],
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert logged_eval_loss(tmp_path / "cp2") == pytest.approx(want, rel=1e-5)


# -- the image and video retrieval eval (eval.retrieval_media) ---------------------------------------------------------

def retrieval_cfg(checkpoint: Path, seq_len: int, *settings: str):
    from longfit.config import load_config

    return load_config(None, [f"model={checkpoint}", f"seq_len={seq_len}", "eval.retrieval_media=images",
                              "eval.pages=3", "eval.samples=1", *settings])


def test_image_retrieval_scores_the_answers_as_the_wrapper_predicts_them(qwen_images, tmp_path, one_thread) -> None:
    """The score's log-likelihood is minus the wrapper's own loss on the examples' answers; an example is correct
    exactly when the wrapper's greedy prediction is every answer token: with the answers replaced by the wrapper's
    predictions every example is correct, and with one token of one answer changed that example alone is not."""
    from transformers import AutoModelForImageTextToText

    from longfit.eval.media_retrieval import answer_hits, write_examples
    from longfit.eval.scores import DEPTHS, media_retrieval_score
    from longfit.memory.loss import batch_loss_sum
    from longfit.models.structure import decoder_and_head

    cfg = retrieval_cfg(qwen_images, 512)
    score = media_retrieval_score(str(qwen_images), cfg, torch.device("cpu"))
    assert (score.examples, len(score.cells), score.pages) == (len(DEPTHS), len(DEPTHS), 3)
    rows = write_examples(tmp_path, "images", 3, 1, cfg.train.seed)  # the same examples, in one row of 512 tokens
    batch = image_batch(qwen_images, rows, 512)
    assert batch.media.images == 3 * len(DEPTHS) and len(batch.documents.rows[0]) == len(DEPTHS) + 1  # and padding
    assert score.log_likelihood == pytest.approx(-float(wrapper_step(qwen_images, batch).loss), rel=1e-5)

    wrapper = AutoModelForImageTextToText.from_pretrained(qwen_images, dtype=torch.float32, attn_implementation="eager")
    predicted = batch.labels.clone()
    with torch.no_grad():
        rows = [0, *batch.media.grid_thw.prod(dim=1).cumsum(0).tolist()]  # each page's patches in pixel_values
        for start, end, first, count in conversations(batch):
            images = dict(pixel_values=batch.media.pixel_values[rows[first] : rows[first + count]],
                          image_grid_thw=batch.media.grid_thw[first : first + count],
                          mm_token_type_ids=batch.media.token_types[:, start:end])
            logits = wrapper(input_ids=batch.input_ids[:, start:end], **images).logits[0]  # (L, V)
            at = batch.labels[0, start:end] != -100
            predicted[0, start:end][at] = logits[at].argmax(-1)
    loss_module = longfit_model(qwen_images, "frozen")
    body, _ = decoder_and_head(loss_module.model)
    hidden = []
    hook = body.register_forward_hook(lambda module, args, output: hidden.append(output.last_hidden_state))
    with torch.no_grad():
        batch.media.positions = loss_module.media_encoder.rope_positions(batch.input_ids, batch.position_ids,
                                                                         batch.media)
        batch_loss_sum(loss_module, batch)
    hook.remove()
    spans = batch.documents.rows[0]
    assert answer_hits(hidden[0][0], loss_module.model, predicted[0], spans) == [True] * len(DEPTHS)
    start, end = spans[2]
    last = int((predicted[0, start:end] != -100).nonzero()[-1]) + start
    predicted[0, last] = (predicted[0, last] + 1) % 384
    assert answer_hits(hidden[0][0], loss_module.model, predicted[0], spans) == [True, True, False, True, True]


def conversations(batch):
    """(start, end, first image, images) of each conversation of the batch's one row."""
    first = 0
    for start, end in batch.documents.rows[0]:
        count = batch.media.items_in(0, start, end)
        if count:
            yield start, end, first, count
        first += count


def test_an_example_longer_than_seq_len_is_one_line(qwen_images) -> None:
    from longfit.config import ConfigError
    from longfit.eval.scores import media_retrieval_score

    with pytest.raises(ConfigError, match=r"eval.retrieval_media=images: an example of eval.pages=3 takes \d+ tokens, "
                                          r"more than seq_len=40: lower eval.pages or raise seq_len"):
        media_retrieval_score(str(qwen_images), retrieval_cfg(qwen_images, 40), torch.device("cpu"))


def test_the_media_retrieval_settings_are_checked_by_the_config(qwen_images) -> None:
    from longfit.config import ConfigError

    with pytest.raises(ConfigError, match="eval.retrieval_media=images scores the exported causal LM"):
        retrieval_cfg(qwen_images, 64, "train.export=false")
    with pytest.raises(ConfigError, match="eval.pages=0: use at least 1 page"):
        retrieval_cfg(qwen_images, 64, "eval.pages=0")


def test_longfit_eval_scores_video_retrieval_per_place_of_the_key(qwen_video, capsys, one_thread) -> None:
    """`longfit eval --media video`: clips of --pages frames (a folder of frames a clip), read by the checkpoint's
    video processor; a score per place of the key's frame, and the answers' log-likelihood."""
    from longfit.eval.scores import DEPTHS

    got = eval_json(capsys, ["--model", str(qwen_video), "--media", "video", "--pages", "4", "--samples", "1",
                             "--seq-len", "512"])
    assert [cell["depth"] for cell in got["cells"]] == list(DEPTHS)
    assert [cell["length"] for cell in got["cells"]] == [4] * len(DEPTHS)
    assert 0 <= got["mean_accuracy"] <= 1 and got["log_likelihood"] < 0


def test_longfit_eval_media_refuses_a_causal_lm_in_one_line(capsys) -> None:
    assert main(["eval", "--model", "llama-tiny", "--media", "images", "--device", "cpu"]) == 2
    (err,) = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert err.startswith("longfit: error: ") and "llama-tiny" in err, err


@pytest.mark.slow  # a 2-step run with its preflight check and two retrieval evals: ~60 s on 2 busy cores
@pytest.mark.timeout(900)
def test_longfit_train_scores_image_retrieval_before_and_after(qwen_images, packed_rows, tmp_path) -> None:
    """eval.retrieval_media=images: the initial model's score is media_retrieval_score's of the checkpoint, the final
    one that of the export, and the trackers' metrics carry both."""
    from longfit.config import load_config
    from longfit.eval.scores import media_retrieval_score
    from longfit.train.loop import train

    cfg = load_config(None, [f"model={qwen_images}", f"data.path={packed_rows}", f"output_dir={tmp_path / 'out'}",
                             "seq_len=512", "train.device=cpu", "train.steps=2", "train.warmup_steps=0",
                             "train.lr=1e-2", "eval.retrieval=false", "eval.retrieval_media=images", "eval.pages=2",
                             "eval.samples=1"])
    summary = train(cfg)
    before, after = summary.media_retrieval_before, summary.media_retrieval_after
    assert before.examples == after.examples == 5 and before.log_likelihood != after.log_likelihood
    initial = media_retrieval_score(str(qwen_images), cfg, torch.device("cpu"))
    assert before.log_likelihood == pytest.approx(initial.log_likelihood, rel=1e-6)
    assert after.log_likelihood == pytest.approx(
        media_retrieval_score(str(summary.export_dir), cfg, torch.device("cpu")).log_likelihood, rel=1e-6)
