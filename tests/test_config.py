"""Config loading, overrides and validation: each bad value names its field; the reference
docs/configuration.md and config.yaml cover every field."""
import dataclasses
import typing

import pytest
import yaml

from ftrain import config
from ftrain.config import Config, ConfigError, load_config, resolve
from ftrain.distributed.parallel_dims import ParallelDims


def test_default_file_loads_and_matches_dataclass_defaults():
    cfg = load_config("config.yaml")
    assert cfg.to_dict() == Config().to_dict()
    assert ParallelDims.from_config(cfg).dp == 4


def test_overrides_are_typed():
    cfg = load_config("config.yaml", ["train.steps=7", "train.lr=1e-4", "parallel.tp=1",
                                      "checkpoint.uri=s3://b/p", "cluster.num_spares=0"])
    assert (cfg.train.steps, cfg.train.lr, cfg.checkpoint.uri, cfg.cluster.num_spares) == (7, 1e-4, "s3://b/p", 0)


@pytest.mark.parametrize("override, field", [
    ("train.steps=0", "train.steps"),
    ("train.steps=ten", "train.steps"),
    ("train.stepz=3", "train.stepz"),
    ("parallel.tp=3", "cluster.num_workers"),
    ("cluster.num_workers=0", "cluster.num_workers"),
    ("cluster.gpus_per_actor=1.5", "cluster.gpus_per_actor"),
    ("train.global_batch_size=12", "train.global_batch_size"),
    ("train.mini_batch_size=2", "train.mini_batch_size"),
    ("train.micro_batch_size=3", "train.micro_batch_size"),
    ("train.seq_len=100", "train.seq_len"),
    ("model.hidden_size=66", "model.hidden_size"),
    ("model.engine=jax", "model.engine"),
    ("model.hf_path=/no/such/dir", "model.hf_path"),
    ("ppo.clip_ratio_c=1.0", "ppo.clip_ratio_c"),
    ("ppo.eps_clip_low=1.5", "ppo.eps_clip_low"),
    ("ppo.loss_agg_mode=sum", "ppo.loss_agg_mode"),
    ("checkpoint.keep_last=0", "checkpoint.keep_last"),
    ("fault_tolerance.restore=magic", "fault_tolerance.restore"),
    ("fault_tolerance.step_timeout_s=-1", "fault_tolerance.step_timeout_s"),
    ("fault_tolerance.memory_snapshot_interval=-1", "fault_tolerance.memory_snapshot_interval"),
    ("fault_tolerance.restore=memory", "fault_tolerance.restore"),  # needs memory snapshots on
])
def test_invalid_value_names_field(override, field):
    with pytest.raises(ConfigError) as e:
        load_config("config.yaml", [override])
    assert str(e.value).startswith(field), str(e.value)


def test_choice_fields_list_their_values():
    with pytest.raises(ConfigError, match=r"^cluster.device: 'tpu' is not one of \['auto', 'cpu', 'cuda'\]$"):
        load_config("config.yaml", ["cluster.device=tpu"])


def test_bad_rl_task_stops_main_before_ray(capsys):
    import main

    assert main.main(["train", "--dry-run", "--set", "rl.enabled=true", "--set", "rl.task=nope"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith("config error: rl.task: unknown task 'nope'")


def test_torch_engine_is_data_parallel_only():
    with pytest.raises(ConfigError, match="^model.engine"):
        load_config("config.yaml", ["model.engine=torch", "parallel.tp=2"])


def test_bad_override_syntax_and_missing_file():
    with pytest.raises(ConfigError, match="section.key=value"):
        load_config("config.yaml", ["train.steps"])
    with pytest.raises(ConfigError, match="file not found"):
        load_config("nope.yaml")


def test_resolve_auto_on_cpu_and_gpu():
    cpu = resolve(load_config("config.yaml"), num_gpus=0)
    assert (cpu.cluster.device, cpu.model.engine, cpu.model.dtype) == ("cpu", "torch", "float32")
    gpu = resolve(load_config("config.yaml"), num_gpus=2)
    assert (gpu.cluster.device, gpu.model.engine, gpu.model.dtype) == ("cuda", "megatron", "bfloat16")
    with pytest.raises(ConfigError, match="^model.engine"):
        resolve(load_config("config.yaml", ["model.engine=megatron"]), num_gpus=0)
    with pytest.raises(ConfigError, match="^cluster.device"):
        resolve(load_config("config.yaml", ["cluster.device=cuda"]), num_gpus=0)


@pytest.mark.parametrize("gpus, sets, expected", [
    (8, [], 1.0), (4, [], 0.5), (3, [], 1 / 3), (0, [], 1.0),          # 4 workers + 4 spares
    (4, ["cluster.gpus_per_actor=1"], 1.0),                             # explicit value kept
    (1, ["cluster.gpus_per_node=8", "cluster.num_nodes=2", "cluster.num_workers=8", "parallel.tp=2",
         "cluster.ray_address=auto"], 1.0),                             # 16 GPUs in the config
    (1, ["cluster.gpus_per_node=2", "cluster.num_nodes=2", "cluster.num_workers=4"], 0.5)])
def test_gpus_per_actor_auto_fits_actors_on_the_gpus(gpus, sets, expected):
    """auto: one GPU per actor, or 1/k of one when the GPUs (gpus_per_node x num_nodes, else a
    local Ray's) are fewer than workers + spares; on CPU 1.0 (unused)."""
    assert resolve(load_config("config.yaml", sets), num_gpus=gpus).cluster.gpus_per_actor == pytest.approx(expected)


def test_preflight_refuses_two_ranks_on_one_gpu():
    from ftrain.control.actor_group import preflight

    cfg = resolve(load_config("config.yaml", ["checkpoint.uri=/tmp/ft-preflight-test"]), num_gpus=2)
    assert cfg.cluster.gpus_per_actor == 0.25  # 8 actors on 2 GPUs
    with pytest.raises(ConfigError, match="^cluster.num_workers: 4 ranks on 2 GPUs would put two ranks"):
        preflight(cfg, {"CPU": 8.0, "GPU": 2.0})


def sections():
    """(dotted prefix, dataclass) of Config and each of its sections."""
    hints = typing.get_type_hints(Config)
    return [("", Config)] + [(f.name + ".", hints[f.name]) for f in dataclasses.fields(Config)
                             if dataclasses.is_dataclass(hints[f.name])]


def test_every_field_has_a_docstring():
    for prefix, cls in sections():
        hints = typing.get_type_hints(cls)
        undocumented = [prefix + f.name for f in dataclasses.fields(cls)
                        if not dataclasses.is_dataclass(hints[f.name]) and f.name not in config.field_docs(cls)]
        assert not undocumented, f"write a docstring under each field of ftrain/config.py: {undocumented}"


def test_reference_doc_is_current():
    assert config.REFERENCE.read_text() == config.reference(), \
        "docs/configuration.md is out of date; regenerate it with `python -m ftrain.config`"


def test_config_yaml_sets_every_field_to_its_default_with_a_comment():
    """config.yaml is the defaults, written out: every field, no unknown key, each key commented
    (beside it, or on the comment lines right above it)."""
    text = config.REFERENCE.parent.parent.joinpath("config.yaml").read_text()
    data, defaults = yaml.safe_load(text), Config().to_dict()
    assert data.keys() == defaults.keys()
    for key, value in defaults.items():
        assert data[key] == value, f"config.yaml {key}: set it to the defaults of ftrain/config.py"
    section, above, uncommented = "", False, []
    for line in text.splitlines():
        body, hash_, _ = line.partition("#")
        if not body.strip():
            above = bool(hash_)
            continue
        key, _, value = body.strip().partition(":")
        if not line.startswith(" ") and not value.strip():
            section = key + "."
        elif not (hash_ or above):
            uncommented.append((section if line.startswith(" ") else "") + key)
        above = False
    assert not uncommented, f"comment these keys of config.yaml: {uncommented}"


def test_async_save_defaults_on_where_the_copy_runs_beside_training():
    """`checkpoint.async_save: auto` (the default) resolves to true on GPU, false on CPU; an
    explicit value is kept."""
    cfg = load_config("config.yaml")
    assert resolve(cfg, num_gpus=1).checkpoint.async_save is True
    assert resolve(cfg, num_gpus=0).checkpoint.async_save is False
    assert resolve(load_config("config.yaml", ["checkpoint.async_save=false"]), num_gpus=1).checkpoint.async_save is False
