"""RL prompt sets in veRL's layout (`prompt_set.py`, `rl.Rollouts`): the chat template applied
once at load, parquet = jsonl = s3://, pad / stop / EOS ids from the tokenizer, the prompt mask
from the prompt lengths, the prompt order from the training data's address, and each bad prompt
file as one line, exit 2, before any actor starts (CLI subprocess)."""
import json
import os
import subprocess
import sys

import pytest
import torch

from ftrain.config import ConfigError, load_config, resolve
from ftrain.data.prompt_set import open_prompt_set, special_ids, write_arithmetic_prompts
from ftrain.rl.rollouts import Rollouts, sample

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def chat_tokenizer(stdlib_corpus, tmp_path_factory):
    """The fixture tokenizer with a ChatML template (im_start / im_end are its special tokens)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(stdlib_corpus[0])
    tok.chat_template = TEMPLATE
    out = tmp_path_factory.mktemp("chat_tok")
    tok.save_pretrained(out)
    return str(out)


def prompts_cfg(path, tokenizer, *overrides, tmp="runs/test_prompt_set"):
    return resolve(load_config(None, [
        "cluster.num_workers=2", "rl.enabled=true", "data.kind=prompts", f"data.path={path}",
        f"data.tokenizer={tokenizer}", "model.vocab_size=2048", "model.max_seq_len=48", "train.seq_len=48",
        "rl.max_new_tokens=4", "train.global_batch_size=16", "train.mini_batch_size=16",
        "train.micro_batch_size=8", "rl.group_size=4", f"run_dir={tmp}", *overrides]), num_gpus=0)


def test_chat_prompts_rendered_once_with_the_template_and_answers_from_the_nested_column(chat_tokenizer, tmp_path):
    from transformers import AutoTokenizer

    path = write_arithmetic_prompts(str(tmp_path / "p.parquet"), rows=20, seed=3)
    ps = open_prompt_set(prompts_cfg(path, chat_tokenizer))
    tok = AutoTokenizer.from_pretrained(chat_tokenizer)
    rows = [json.loads(line) for line in open(write_arithmetic_prompts(str(tmp_path / "p.jsonl"), rows=20, seed=3))]
    assert len(ps) == 20 and ps.data_sources == ["arithmetic"] * 20
    assert ps.ground_truths == [r["reward_model"]["ground_truth"] for r in rows]
    assert ps.extra_infos[5] == {"index": 5}
    text = tok.decode(ps.tokens[5])
    assert text == f"<|im_start|>user\n{rows[5]['prompt'][0]['content']}<|im_end|>\n<|im_start|>assistant\n"
    assert open_prompt_set(prompts_cfg(str(tmp_path / "p.jsonl"), chat_tokenizer)).tokens == ps.tokens


def test_a_prompt_set_on_s3_reads_as_the_local_file(chat_tokenizer, tmp_path, s3_server, monkeypatch):
    import fsspec

    local = write_arithmetic_prompts(str(tmp_path / "p.parquet"), rows=8)
    url = s3_server.uri("prompts/p.parquet")
    with fsspec.open(url, "wb", **s3_server.storage_options) as f, open(local, "rb") as src:
        f.write(src.read())
    for k, v in {"AWS_ENDPOINT_URL": s3_server.endpoint_url, "AWS_ACCESS_KEY_ID": "testing",
                 "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(k, v)
    assert open_prompt_set(prompts_cfg(url, chat_tokenizer)).tokens == \
        open_prompt_set(prompts_cfg(local, chat_tokenizer)).tokens


def test_pad_stop_and_eos_come_from_the_tokenizer(stdlib_corpus, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(stdlib_corpus[0])
    assert special_ids(tok, None) == (tok.convert_tokens_to_ids("<|pad|>"), (tok.convert_tokens_to_ids("<|endoftext|>"),))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 3]}))
    assert special_ids(tok, str(tmp_path)) == (0, (1, 3))       # the model's generation_config adds turn ends
    tok.pad_token = None
    assert special_ids(tok, None) == (1, (1,))                   # no pad token: pad with EOS
    path = write_arithmetic_prompts(str(tmp_path / "p.parquet"), rows=8, chat=False)
    task = Rollouts(prompts_cfg(path, stdlib_corpus[0])).task
    assert (task.pad_id, task.stop_ids) == (0, (1,))


def test_sampling_stops_at_any_stop_id():
    def logits(ids, mask):   # always the token after the last one: 5 -> 6 -> 7 ...
        out = torch.full((*ids.shape, 12), -1e4)
        out.scatter_(2, ((ids + 1) % 12)[..., None], 1e4)
        return out

    ids = torch.tensor([[4, 0, 0, 0, 0, 0], [2, 0, 0, 0, 0, 0]])
    out = sample(logits, ids, (torch.arange(6) < 1).long().repeat(2, 1), [1, 2], 5, (6, 4), pad_id=0)
    assert out["input_ids"].tolist() == [[4, 5, 6, 0, 0, 0], [2, 3, 4, 0, 0, 0]]
    assert out["loss_mask"].sum(-1).tolist() == [2, 2]


def test_the_prompt_mask_comes_from_the_lengths_not_the_pad_id(stdlib_corpus, tmp_path):
    """A tokenizer whose pad is its EOS, and prompts that contain that id: the mask still covers
    each whole prompt (`ids != pad` would cut it)."""
    rows = [{"prompt": f"<|endoftext|>{i} + 1 =<|endoftext|>", "reward_model": {"ground_truth": str(i + 1)}}
            for i in range(4)]
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ro = Rollouts(prompts_cfg(str(path), stdlib_corpus[0]))
    ro.task.pad_id = ro.task.stop_ids[0]
    prompts = ro.prompts(1)
    batch = ro.prompt_batch(prompts)
    lengths = torch.tensor([len(p.tokens) for p in prompts]).repeat_interleave(4)
    assert (batch.input_ids[:, 0] == ro.task.pad_id).all()               # the pad id inside every prompt
    assert torch.equal(batch.attention_mask.sum(-1), lengths)
    assert torch.equal(batch.attention_mask, (torch.arange(48) < lengths[:, None]).long())


def test_the_prompt_order_is_the_data_address_each_row_once_per_epoch(stdlib_corpus, tmp_path):
    path = write_arithmetic_prompts(str(tmp_path / "p.parquet"), rows=12, chat=False)
    a, b = Rollouts(prompts_cfg(path, stdlib_corpus[0])), Rollouts(prompts_cfg(path, stdlib_corpus[0]))
    index = {tuple(t): i for i, t in enumerate(a.task.prompt_set.tokens)}
    assert len(index) >= 10
    epoch = [p.extra_info["index"] for s in (1, 2, 3) for p in a.prompts(s)]   # 4 prompts per step
    assert sorted(epoch) == list(range(12))
    assert [p.tokens for p in a.prompts(5)] == [p.tokens for p in b.prompts(5)]
    assert [p.extra_info["index"] for p in a.prompts(2)] == [w for _, _, _, w in a.order.addresses(2)]
    other = Rollouts(prompts_cfg(path, stdlib_corpus[0], "data.seed=7"))
    assert [p.extra_info["index"] for p in other.prompts(1)] != [p.extra_info["index"] for p in a.prompts(1)]


def test_overlong_prompts_and_missing_tokenizer_are_config_errors(stdlib_corpus, tmp_path):
    path = write_arithmetic_prompts(str(tmp_path / "p.parquet"), rows=4, chat=False)
    with pytest.raises(ConfigError, match=r"^train.seq_len: the prompt of row 0 of .* leaves 6 for a prompt"):
        Rollouts(prompts_cfg(path, stdlib_corpus[0], "train.seq_len=10"))
    with pytest.raises(ConfigError, match="^data.kind: prompts are RL prompts"):
        prompts_cfg(path, stdlib_corpus[0], "rl.enabled=false")


def _bad_file(tmp_path, case: str) -> str:
    rows = [{"prompt": [{"role": "user", "content": "1 + 1?"}], "reward_model": {"ground_truth": "2"}}] * 3
    if case == "missing_column":
        rows = [{"question": "1 + 1?", "reward_model": {"ground_truth": "2"}}] * 3
    elif case == "missing_answer":
        rows = [{"prompt": "1 + 1?", "reward_model": {"style": "rule"}}] * 3
    elif case == "wrong_type":
        rows = [{"prompt": 7, "reward_model": {"ground_truth": "2"}}] * 3
    elif case == "no_file":
        return str(tmp_path / "absent.parquet")
    elif case == "suffix":
        return str(tmp_path / "prompts.csv")
    elif case == "not_json":
        (tmp_path / "p.jsonl").write_text('{"prompt": "x"}\nnot json\n')
        return str(tmp_path / "p.jsonl")
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "p.parquet")
    return str(tmp_path / "p.parquet")


BAD = [
    ("missing_answer", "data.answer_key: 'reward_model.ground_truth' is not a column of"),
    ("no_template", "has no chat template, so the chat-list prompts of data.path cannot be rendered"),
    ("no_file", "data.path: cannot read"),
    ("suffix", "data.path: "),
    ("not_json", "line 2 is not JSON"),
]


@pytest.mark.parametrize("case, expected", BAD)
def test_each_bad_prompt_file_is_one_config_error_line(stdlib_corpus, tmp_path, case, expected):
    with pytest.raises(ConfigError) as e:
        Rollouts(prompts_cfg(_bad_file(tmp_path, case), stdlib_corpus[0]))
    assert expected in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("case, expected", [
    ("missing_column", "data.prompt_key: 'prompt' is not a column of"),
    ("wrong_type", "data.prompt_key: 'prompt' of row 0 of"),
])
def test_a_bad_prompt_file_stops_train_with_one_line_before_ray(stdlib_corpus, tmp_path, case, expected):
    path = _bad_file(tmp_path, case)
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "main.py"), "train", "--set", "rl.enabled=true",
                           "--set", "data.kind=prompts", "--set", f"data.path={path}",
                           "--set", f"data.tokenizer={stdlib_corpus[0]}", "--set", "model.vocab_size=2048",
                           "--set", "train.seq_len=64", "--set", "model.max_seq_len=64",
                           "--set", f"run_dir={tmp_path}/run", "--set", f"checkpoint.uri={tmp_path}/ckpt"],
                          cwd=ROOT, capture_output=True, text=True)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("config error:")]
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert len(errors) == 1 and expected in errors[0], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and "Ray" not in proc.stderr, proc.stderr[-2000:]
