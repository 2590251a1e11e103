import copy
import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from longfit.cli import main
from longfit.data.synthetic import retrieval_example
from longfit.data.tokenizer import byte_tokenizer
from longfit.eval.retrieval import answer_is_predicted, evaluate_retrieval, format_table
from longfit.models.loading import load_model
from longfit.models.presets import preset_config


def run_eval(argv: list[str]) -> int:
    return main(["eval", "--device", "cpu", *argv])


def tiny_config():
    config = copy.deepcopy(preset_config("llama-tiny"))
    config.hidden_size, config.intermediate_size, config.num_hidden_layers = 64, 128, 2
    config.num_attention_heads, config.num_key_value_heads = 4, 2
    return config


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(tiny_config()).save_pretrained(path)
    return path


def greedy_continuation(model, prompt: list[int], steps: int) -> list[int]:
    ids = list(prompt)
    for _ in range(steps):
        with torch.no_grad():
            ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def test_exact_match_is_greedy_decoding(model_dir):
    model = load_model(str(model_dir)).eval()
    example = retrieval_example(byte_tokenizer(), 200, 0.5, seed=0)
    answer = greedy_continuation(model, example.prompt_ids, 4)
    assert answer_is_predicted(model, example.prompt_ids, answer, "cpu")
    for wrong in ([answer[0] ^ 1, *answer[1:]], [*answer[:-1], answer[-1] ^ 1]):
        assert not answer_is_predicted(model, example.prompt_ids, wrong, "cpu")


def test_evaluate_retrieval_cells(model_dir):
    model = load_model(str(model_dir)).train()
    results = evaluate_retrieval(model, byte_tokenizer(), [128, 256], [0.0, 1.0], samples=2, seed=1)
    assert [(r.length, r.depth, r.samples) for r in results] == [(128, 0.0, 2), (128, 1.0, 2), (256, 0.0, 2), (256, 1.0, 2)]
    assert all(0.0 <= r.accuracy <= 1.0 for r in results)
    assert model.training  # restored after evaluation
    table = format_table(results).splitlines()
    assert table[0].split() == ["length", "\\", "depth", "0.00", "1.00", "mean"]
    assert [line.split()[0] for line in table[1:]] == ["128", "256", "mean"]


def test_cli_end_to_end_on_an_exported_directory(model_dir, tmp_path, capsys):
    out = tmp_path / "eval.json"
    code = run_eval(["--model", str(model_dir), "--lengths", "128,192", "--depths", "0,0.5,1",
                     "--samples", "2", "--json", str(out), "--device", "cpu"])
    assert code == 0
    printed = capsys.readouterr().out
    assert "teacher-forced exact match" in printed and "length \\ depth" in printed
    report = json.loads(out.read_text())
    assert report["model"] == str(model_dir) and len(report["cells"]) == 6
    assert all(0.0 <= cell["accuracy"] <= 1.0 for cell in report["cells"])
    assert 0.0 <= report["mean_accuracy"] <= 1.0


def test_directory_tokenizer_is_used(model_dir, tmp_path, capsys):
    # The directory's own tokenizer wins over the byte tokenizer; one larger than the vocabulary is refused.
    from tokenizers import AddedToken

    from longfit.eval.command import load_eval_model

    _, fallback = load_eval_model(str(model_dir), torch.float32, "cpu", 0)
    assert len(fallback) == len(byte_tokenizer())
    for extra, fits in ((50, True), (200, False)):
        directory = tmp_path / f"extra{extra}"
        load_model(str(model_dir)).save_pretrained(directory)
        tokenizer = byte_tokenizer()
        tokenizer.add_tokens([AddedToken(f"<extra{i}>", special=True) for i in range(extra)])
        tokenizer.save_pretrained(directory)
        if fits:
            _, loaded = load_eval_model(str(directory), torch.float32, "cpu", 0)
            assert len(loaded) == len(tokenizer) and loaded.convert_tokens_to_ids("<extra7>") == len(fallback) + 7
        else:
            assert run_eval(["--model", str(directory), "--lengths", "128", "--samples", "1"]) == 2
            assert f"the tokenizer has {len(tokenizer)} tokens but the model only 384" in capsys.readouterr().err


def test_peft_adapter_directory(model_dir, tmp_path, capsys):
    from peft import LoraConfig, get_peft_model

    base = AutoModelForCausalLM.from_pretrained(model_dir)
    adapter = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    adapter.save_pretrained(tmp_path / "adapter")
    assert json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["base_model_name_or_path"] == str(model_dir)
    assert run_eval(["--model", str(tmp_path / "adapter"), "--lengths", "128", "--depths", "0.5", "--samples", "1",
                     "--json", "-"]) == 0
    printed = capsys.readouterr().out
    assert json.loads(printed[printed.index("{"):])["cells"][0]["samples"] == 1


@pytest.mark.parametrize("argv", [["--depths", "0,1.5"], ["--lengths", "abc"]])
def test_bad_arguments_exit_2(argv):
    with pytest.raises(SystemExit) as e:
        run_eval(argv)
    assert e.value.code == 2


def test_zero_samples_is_an_error_naming_the_flag(capsys):
    assert run_eval(["--samples", "0"]) == 2
    assert "longfit: error: --samples 0" in capsys.readouterr().err


def test_too_short_length_is_reported(model_dir, capsys):
    assert run_eval(["--model", str(model_dir), "--lengths", "16", "--samples", "1"]) == 2
    assert "needs at least" in capsys.readouterr().err
