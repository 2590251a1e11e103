import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from longfit.config import Config, ConfigError, config_reference, load_config


def test_defaults_and_required_key_names():
    keys = {key for key, _, _ in config_reference()}
    for required in ["model", "seq_len", "output_dir", "data.path", "train.steps", "train.lr",
                     "train.micro_batch", "train.grad_accum", "lora.enabled",
                     "parallel.cp", "parallel.dp_shard", "parallel.cp_method"]:
        assert required in keys


def test_every_field_is_documented():
    for key, _, doc in config_reference():
        assert doc.strip(), f"{key} has no docstring"


def test_yaml_then_dotted_overrides(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("seq_len: 4096\ntrain:\n  steps: 7\n  lr: 1.0e-4\nlora:\n  enabled: true\n")
    cfg = load_config(path, ["train.steps=9", "train.weight_decay=1e-2", "lora.target_modules=[q_proj,v_proj]", "memory.tiled_mlp=false"])
    assert cfg.seq_len == 4096 and cfg.train.steps == 9 and cfg.train.lr == 1e-4
    assert cfg.train.weight_decay == 0.01
    assert cfg.lora.enabled and cfg.lora.target_modules == ["q_proj", "v_proj"]
    assert cfg.memory.tiled_mlp is False and cfg.memory.offload_activations == "auto"


def test_round_trip_through_saved_yaml(tmp_path):
    cfg = load_config(None, ["seq_len=1024", "parallel.cp=2"])
    path = tmp_path / "saved.yaml"
    path.write_text(cfg.to_yaml())
    assert load_config(path) == cfg


@pytest.mark.parametrize(
    "override, message",
    [
        ("trian.steps=3", r"unknown config key 'trian'\. Did you mean train\.steps\?"),
        ("train.stepz=3", r"unknown config key 'train.stepz'\. Did you mean train\.steps\?"),
        ("train.stpes=3", r"unknown config key 'train.stpes'\. Did you mean train\.steps\?"),
        ("memroy.tiled_mlp=true", r"Did you mean memory\.tiled_mlp\?"),
        ("seqlen=4096", r"unknown config key 'seqlen'\. Did you mean seq_len\?"),
        ("train.zzz=1", r"unknown config key 'train.zzz'\. See"),
        ("train.steps=many", "train.steps: expected an integer"),
        ("seq_len=1", "seq_len=1: need at least 2"),
        ("parallel.cp_method=tree", "parallel.cp_method: 'tree' is not one of"),
        ("train.grad_accum=0", "train.grad_accum=0: must be >= 1"),
        ("memory.tiled_mlp=maybe", "memory.tiled_mlp"),
        ("lora.quantize_base=true", "lora.enabled=true"),
        ("memory.checkpoint_fraction=1.5", "memory.checkpoint_fraction=1.5: must be in"),
        ("seq_len", "key.sub=value"),
    ],
)
def test_bad_values_name_the_key(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])


def test_missing_and_malformed_config_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    listing = tmp_path / "list.yaml"
    listing.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(listing)


def test_help_is_instant_and_imports_no_torch():
    code = "import sys; from longfit.cli import main\ntry:\n main(['train','--help'])\nexcept SystemExit: pass\nprint('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "train.micro_batch" in out.stdout
    assert out.stdout.strip().splitlines()[-1] == "False"


def test_config_is_a_plain_dataclass_tree():
    cfg = Config()
    assert dataclasses.asdict(cfg)["train"]["steps"] == cfg.train.steps


@pytest.mark.parametrize("override, meant", [("save_every=5", "train.save_every"), ("train.cp=2", "parallel.cp"),
                                             ("log_evry=2", "train.log_every"), ("lora.seq_len=64", "seq_len")])
def test_a_key_without_its_section_names_the_section(override, meant):
    with pytest.raises(ConfigError, match=rf"unknown config key '{override.split('=')[0]}'\. Did you mean {meant}\?"):
        load_config(None, [override])


def test_a_top_level_key_in_a_file_names_its_section(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("seq_len: 256\nsave_every: 5\n")
    with pytest.raises(ConfigError, match=r"unknown config key 'save_every'\. Did you mean train\.save_every\?"):
        load_config(path)


def test_a_yaml_error_names_the_file_line_and_column(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("seq_len: 256\ntrain: {steps: 3\n")
    with pytest.raises(ConfigError) as caught:
        load_config(bad)
    message = str(caught.value)
    assert message.startswith(f"{bad}, line 3, column 1: not valid YAML (") and "<unicode string>" not in message
    assert "\n" not in message


def test_relative_paths_in_a_file_resolve_against_the_file_and_overrides_against_the_cwd(tmp_path, monkeypatch):
    folder = tmp_path / "configs"
    folder.mkdir()
    (folder / "model-dir").mkdir()
    path = folder / "run.yaml"
    path.write_text("model: model-dir\noutput_dir: ../runs/a\ndata:\n  path: data/train.jsonl\n"
                    "memory:\n  offload_dir: ~/scratch\n")
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    cfg = load_config(path)
    assert cfg.model == str(folder / "model-dir") and cfg.output_dir == str(tmp_path / "runs" / "a")
    assert cfg.data.path == str(folder / "data" / "train.jsonl")
    assert cfg.memory.offload_dir == str(Path("~/scratch").expanduser())
    cfg = load_config(Path("..") / "configs" / "run.yaml", ["data.path=mine.jsonl", "model=./other"])
    assert cfg.data.path == str(elsewhere / "mine.jsonl") and cfg.model == str(elsewhere / "other")
    assert cfg.output_dir == str(tmp_path / "runs" / "a")  # still the file's
    assert load_config(None).output_dir == str(elsewhere / "runs" / "default")


@pytest.mark.parametrize("model", ["llama-tiny", "smollm2-135m", "org/some-model"])
def test_a_model_name_stays_a_name(tmp_path, model):
    path = tmp_path / "run.yaml"
    path.write_text(f"model: {model}\n")
    assert load_config(path).model == load_config(None, [f"model={model}"]).model == model


def test_the_example_config_writes_under_the_repository_runs(monkeypatch, tmp_path):
    repo = Path(__file__).parents[1]
    for cwd in (repo, tmp_path):
        monkeypatch.chdir(cwd)
        cfg = load_config(repo / "examples" / "smollm2_retrieval.yaml")
        assert cfg.output_dir == str(repo / "runs" / "smollm2-retrieval") and cfg.model == "smollm2-135m"


def test_an_empty_path_in_a_file_stays_unset(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text('data:\n  path: ""\n')
    assert load_config(path).data.path == ""  # the synthetic task, not the file's directory
