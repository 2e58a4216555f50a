"""The data module (data.py): the sample address is DP-invariant and prefix-stable, windows
equal megatron-core's own GPTDataset windows, blends follow their weights; the ce objective
trains on real text (the loss falls) and a peer recovery replays it bitwise."""
import os
import types

import numpy as np
import pytest
import ray

from ftrain.config import load_config, resolve
from ftrain.data.dataset import Data, Windows, open_data


def data_cfg(corpus, *overrides, tmp_path="runs/test_data"):
    tok, prefix = corpus
    return resolve(load_config("config.yaml", [
        "cluster.num_workers=2", "cluster.num_spares=0", "checkpoint.interval=0",
        f"run_dir={tmp_path}", f"checkpoint.uri={tmp_path}/ckpt", "model.vocab_size=2048",
        "train.objective=ce", "data.kind=indexed", f"data.path={prefix}", f"data.tokenizer={tok}",
        *overrides]), num_gpus=0)


@pytest.fixture(scope="module")
def data(stdlib_corpus):
    return open_data(data_cfg(stdlib_corpus))


@pytest.fixture(scope="module")
def blend(stdlib_corpus):
    _, prefix = stdlib_corpus
    return open_data(data_cfg(stdlib_corpus, "data.path=null", f"data.blend=0.7 {prefix} 0.3 {prefix}",
                              "data.seed=7"))


@pytest.mark.parametrize("which", ["data", "blend"])
def test_replicas_interleave_to_the_global_batch_at_any_dp(which, request):
    d = request.getfixturevalue(which)
    epoch_end = len(d.windows[0]) // d.gbs + 1  # a step that crosses the first epoch's end
    for step in (1, 2, epoch_end):
        full = d.rows(step)
        for dp in (1, 2, 4, 8):
            parts = [d.rows(step, dp, r) for r in range(dp)]
            together = np.empty_like(full)
            for r, part in enumerate(parts):
                together[r::dp] = part
            assert (together == full).all(), (step, dp)


def test_the_order_does_not_depend_on_train_steps_or_the_blend_index_size(stdlib_corpus, blend):
    _, prefix = stdlib_corpus
    short = open_data(data_cfg(stdlib_corpus, "train.steps=1"))
    long = open_data(data_cfg(stdlib_corpus, "train.steps=100000"))
    assert all((short.rows(s) == long.rows(s)).all() for s in (1, 5, 900))
    # the blending index grows by doubling when a far step is asked first; its prefix is kept
    fresh = open_data(data_cfg(stdlib_corpus, "data.path=null", f"data.blend=0.7 {prefix} 0.3 {prefix}",
                               "data.seed=7"))
    far = fresh.addresses(100_000)
    assert len(fresh._blend[0]) > Data._BLEND_MIN
    assert [fresh.addresses(s) for s in (1, 2, 3)] == [blend.addresses(s) for s in (1, 2, 3)]
    assert far == blend.addresses(100_000)


def test_each_window_once_per_epoch(data):
    n = len(data.windows[0])
    seen = [w for s in range(1, n // data.gbs + 1) for _, _, e, w in data.addresses(s) if e == 0]
    assert len(seen) == len(set(seen)) == n // data.gbs * data.gbs


def test_blend_counts_follow_the_weights(blend):
    counts = np.zeros(2)
    for step in range(1, 201):
        for _, k, _, _ in blend.addresses(step):
            counts[k] += 1
        n = step * blend.gbs
        assert (np.abs(counts - blend.weights * n) <= 1).all(), (step, counts)


def test_windows_equal_megatron_gpt_dataset_windows(stdlib_corpus, data):
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    from megatron.core.datasets.utils import Split

    _, prefix = stdlib_corpus
    ours: Windows = data.windows[0]
    low, seq = IndexedDataset(prefix), ours.seq_len
    cfg = GPTDatasetConfig(random_seed=data.seed, sequence_length=seq - 1, blend=([prefix], None),
                           split="100,0,0", reset_position_ids=False, reset_attention_mask=False,
                           eod_mask_loss=False, path_to_cache=None, mid_level_dataset_surplus=0.005,
                           tokenizer=types.SimpleNamespace(eod=data.eod_id, pad=0, vocab_size=2048,
                                                           unique_identifiers={"class": "fixture"}))
    theirs = GPTDataset(low, prefix, np.arange(len(low.sequence_lengths), dtype=np.int32), len(ours),
                        Split.train, cfg)
    assert len(theirs) == len(ours) and (ours.low.sequence_lengths == low.sequence_lengths).all()
    assert (theirs.document_index == ours.document_index).all()
    assert (theirs.sample_index == ours.sample_index).all()
    position = np.argsort(theirs.shuffle_index)  # where GPTDataset serves window w
    for w in range(0, len(ours), 97):
        sample = theirs[int(position[w])]
        text = np.concatenate([sample["tokens"].numpy(), sample["labels"].numpy()[-1:]])
        assert (text == ours.window(w)).all(), w


def test_eod_mask_loss_masks_the_token_after_each_eod(stdlib_corpus, data):
    masked = open_data(data_cfg(stdlib_corpus, "data.eod_mask_loss=true"))
    for step in range(1, 40):
        a, b = data.batch(step), masked.batch(step)
        assert (a.input_ids == b.input_ids).all()
        after_eod = b.input_ids[:, :-1] == data.eod_id
        assert (b.loss_mask[:, 1:] == (~after_eod).float()).all() and (b.loss_mask[:, 0] == 0).all()
        if after_eod.any():
            return
    pytest.fail("no EOD in the first 40 steps")


def test_ce_loss_falls_on_real_text(ray_session, stdlib_corpus, tmp_path):
    from conftest import reference_run

    losses, _ = reference_run(data_cfg(stdlib_corpus, "train.steps=12", "train.lr=0.01",
                                       tmp_path=tmp_path), 12)
    assert abs(losses[1] - np.log(2048)) < 0.3, losses[1]  # uniform over the vocabulary at the start
    assert losses[12] < losses[1] - 1.5, losses


@pytest.fixture(scope="module")
def ce_reference(ray_session, stdlib_corpus, tmp_path_factory):
    """(losses, final state digests, checkpoint dir) of 4 `ce` steps at dp=2 without failure,
    checkpoints at steps 2 and 4."""
    from conftest import reference_run

    path = tmp_path_factory.mktemp("ce_reference")
    losses, states = reference_run(data_cfg(stdlib_corpus, "checkpoint.interval=2", tmp_path=path), 4)
    return losses, states, path / "ckpt"


def test_ce_peer_recovery_matches_the_run_without_failure_bitwise(ce_reference, stdlib_corpus, tmp_path, data):
    from checkpoint import CheckpointManager
    from ftrain.control.actor_group import ActorGroup
    from ftrain.trainer import Trainer
    from megatron_actor import MegatronActor

    cfg = data_cfg(stdlib_corpus, "cluster.num_spares=1", "checkpoint.interval=2", "fault_tolerance.refill_spares=false",
                   tmp_path=tmp_path)
    ref_losses, ref_states, _ = ce_reference
    group = ActorGroup(MegatronActor, cfg)
    try:
        trainer = Trainer(cfg, group, CheckpointManager.from_config(cfg.checkpoint), data=data)
        trainer.train(2)
        ray.kill(group.workers[1].handle, no_restart=True)
        trainer.train(4)
        states = group.state_digests()
    finally:
        group.shutdown()
    (tl,) = trainer.recoveries
    assert (tl.restore_source, tl.steps_lost) == ("peer", 0)
    assert trainer.losses == ref_losses
    assert states == ref_states
    assert trainer.data_digests == {s: data.batch(s).digest() for s in range(1, 5)}
    from ftrain.data.dataset import data_fingerprint
    assert [m.extra["data"] for m in trainer.ckpt.committed_manifests()] == [data_fingerprint(cfg)] * 2


def _cli(*args, cwd=None):
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return subprocess.run([sys.executable, os.path.join(root, "main.py"), *args], cwd=cwd or root,
                          capture_output=True, text=True)


def _damaged(prefix, tmp_path, which: str) -> str:
    """A copy of dataset `prefix` under tmp_path with `which` done to it."""
    import shutil

    out = str(tmp_path / "copy_text_document")
    for ext in (".bin", ".idx"):
        shutil.copy(prefix + ext, out + ext)
    if which == "truncated_bin":
        with open(out + ".bin", "r+b") as f:
            f.truncate(1000)
    elif which == "truncated_idx":
        with open(out + ".idx", "r+b") as f:
            f.truncate(100)
    elif which == "corrupt_idx":
        with open(out + ".idx", "r+b") as f:
            f.write(b"garbageg!")
    elif which == "missing_bin":
        os.remove(out + ".bin")
    return out


@pytest.mark.parametrize("case, sets, expected", [
    ("missing_bin", [], "no Megatron dataset there (looked for copy_text_document.bin and copy_text_document.idx; "
                        "found: copy_text_document.idx)"),
    ("extension", [], "give the prefix without .bin/.idx"),
    ("truncated_bin", [], ".bin has 1,000 bytes but its index points to"),
    ("truncated_idx", [], "(truncated, multimodal, or still being copied?)"),
    ("corrupt_idx", [], "is not a Megatron index (header b'garbageg!'"),
    ("vocab", ["model.vocab_size=1000", "data.tokenizer=null"], "but the model has 1,000 (model.vocab_size)"),
    ("tokenizer", ["model.vocab_size=1000"], "tokens, more than model.vocab_size=1,000"),
    ("too_small", ["train.global_batch_size=16384", "train.mini_batch_size=16384", "train.seq_len=64"],
     "fewer than one global batch (train.global_batch_size=16384)"),
])
def test_bad_data_stops_train_with_one_line_before_ray(stdlib_corpus, tmp_path, capsys, case, sets, expected):
    """`main.py train` on each bad input: one line, exit 2, no Ray started. One case runs as a
    subprocess (the CLI's exit status and stderr); the others call `main.main` in this process
    (the same code path, without a Python start and torch import each)."""
    import ray

    import main

    tok, prefix = stdlib_corpus
    path = prefix + ".bin" if case == "extension" else \
        _damaged(prefix, tmp_path, case) if case in ("missing_bin", "truncated_bin", "truncated_idx", "corrupt_idx") \
        else prefix
    args = ["train", "--set", "train.objective=ce", "--set", "data.kind=indexed", "--set", f"data.path={path}",
            "--set", f"data.tokenizer={tok}", "--set", "model.vocab_size=2048", "--set", f"run_dir={tmp_path}/run",
            "--set", f"checkpoint.uri={tmp_path}/ckpt", *[a for s in sets for a in ("--set", s)]]
    if case == "missing_bin":
        proc = _cli(*args)
        code, stderr = proc.returncode, proc.stderr
    else:
        started = ray.is_initialized()
        code, stderr = main.main(args), capsys.readouterr().err
        assert ray.is_initialized() == started, "Ray was started"
    errors = [line for line in stderr.splitlines() if line.startswith("config error:")]
    assert code == 2, stderr[-2000:]
    assert len(errors) == 1 and expected in errors[0], stderr[-2000:]
    assert "Traceback" not in stderr and "Ray" not in stderr, stderr[-2000:]


@pytest.mark.parametrize("case", ["truncated_bin", "truncated_idx", "corrupt_idx"])
def test_a_rank_opening_damaged_files_gets_the_drivers_error(stdlib_corpus, tmp_path, case):
    """The ranks' reader (`IndexedFile`) and the driver's check (`index_header`) parse the .idx
    in one place: files damaged after the driver's check fail the rank's open with the same
    ConfigError line, not a short read or garbage rows."""
    from ftrain.config import ConfigError
    from ftrain.data.dataset import IndexedFile, index_header

    path = _damaged(stdlib_corpus[1], tmp_path, case)
    with pytest.raises(ConfigError) as driver:
        index_header(path)
    with pytest.raises(ConfigError) as rank:
        IndexedFile(path)
    assert str(rank.value) == str(driver.value)


def test_prepare_names_a_missing_column(stdlib_corpus, tmp_path):
    tok, _ = stdlib_corpus
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"content": "hello", "url": "x"}\n')
    proc = _cli("data", "prepare", "--input", str(rows), "--tokenizer", tok, "--output-prefix", str(tmp_path / "out"))
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        f"error: --json-keys: 'text' is not a column of {rows} (row 1 has: content, url); pass --json-keys COLUMN")
    assert "Traceback" not in proc.stderr


def test_prepare_reads_s3_urls_and_names_an_input_it_cannot_read(stdlib_corpus, s3_server, tmp_path, monkeypatch,
                                                                 capsys):
    """`main.py data prepare --input s3://...` through the loopback S3 server (credentials and
    endpoint from the AWS_* environment, as a user's): the .bin/.idx bytes equal those prepared
    from the same local .jsonl.gz. A missing object and an unreachable endpoint: exit 2 with
    one line naming --input, the URL and the cause (AWS_MAX_ATTEMPTS=1: botocore's retries of
    a refused connection take ~15 s otherwise)."""
    import gzip
    import uuid

    import fsspec
    import s3fs

    from ftrain.data import prepare as data_prepare
    from ftrain.testbeds.local_storage import free_port

    tok, _ = stdlib_corpus
    local = tmp_path / "rows.jsonl.gz"
    local.write_bytes(gzip.compress("".join(f'{{"text": "row {i}: a document read from object storage."}}\n'
                                            for i in range(50)).encode()))
    url = s3_server.uri(f"prepare-{uuid.uuid4().hex[:8]}/rows.jsonl.gz")
    fsspec.filesystem("s3", **s3_server.storage_options).put_file(str(local), url)
    env = {"AWS_ENDPOINT_URL": s3_server.endpoint_url, "AWS_ACCESS_KEY_ID": "testing",
           "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1", "AWS_MAX_ATTEMPTS": "1"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    s3fs.S3FileSystem.clear_instance_cache()  # a cached client keeps the endpoint it was made with

    def prepare(source: str, out: str) -> tuple[int, str]:
        code = data_prepare.main(["prepare", "--input", source, "--tokenizer", tok, "--output-prefix", str(tmp_path / out)])
        return code, capsys.readouterr().err

    assert prepare(url, "s3") == (0, "")
    assert prepare(str(local), "local") == (0, "")
    for suffix in (".bin", ".idx"):
        assert (tmp_path / f"s3_text_document{suffix}").read_bytes() == \
            (tmp_path / f"local_text_document{suffix}").read_bytes()
    missing = url.replace("rows.jsonl.gz", "absent.jsonl.gz")
    code, err = prepare(missing, "missing")
    assert code == 2 and err.startswith(f"error: --input: cannot read {missing}: FileNotFoundError") and \
        err.count("\n") == 1, err
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")  # nothing listens there
    s3fs.S3FileSystem.clear_instance_cache()
    code, err = prepare(url, "unreachable")
    assert code == 2 and err.startswith(f"error: --input: cannot read {url}: EndpointConnectionError") and \
        err.count("\n") == 1, err
    s3fs.S3FileSystem.clear_instance_cache()  # monkeypatch restores the environment, not the cache


def test_prepare_then_inspect_prints_the_digest_train_logs(stdlib_corpus, tmp_path, data):
    tok, _ = stdlib_corpus
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(f'{{"text": "document {i}: the quick brown fox jumps over the lazy dog."}}\n'
                            for i in range(200)))
    proc = _cli("data", "prepare", "--input", str(rows), "--tokenizer", tok, "--output-prefix", str(tmp_path / "out"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == f"{tmp_path}/out_text_document"
    prefix, _ = stdlib_corpus[1], None
    proc = _cli("data", "inspect", "--step", "3", "--set", "train.objective=ce", "--set", "data.kind=indexed",
                "--set", f"data.path={prefix}", "--set", f"data.tokenizer={tok}", "--set", "model.vocab_size=2048",
                "--set", "cluster.num_workers=2")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"data_digest={data.batch(3).digest()}" in proc.stdout
    assert "Ray" not in proc.stderr


def test_resume_on_other_data_files_stops_with_one_line(stdlib_corpus, tmp_path):
    import shutil

    from ftrain.config import ConfigError
    from ftrain.data.dataset import data_fingerprint
    from ftrain.state.manifest import Manifest, model_signature
    from ftrain.state.run_identity import RunIdentity, plan_start

    copy = str(tmp_path / "copy_text_document")
    for ext in (".bin", ".idx"):
        shutil.copy(stdlib_corpus[1] + ext, copy + ext)
    cfg = data_cfg(stdlib_corpus, f"data.path={copy}", tmp_path=tmp_path)
    manifest = Manifest(2, {"world_size": 2, "tp": 1, "pp": 1, "cp": 1, "dp": 2, "engine": "torch"}, [],
                        {"run": RunIdentity.new(cfg).to_dict(), "model": model_signature(cfg),
                         "data": data_fingerprint(cfg)}, 0.0)
    assert plan_start(cfg, [manifest], []).resume_step == 2
    with open(copy + ".bin", "ab") as f:  # the same prefix, rewritten with more tokens
        f.write(b"\0\0")
    with pytest.raises(ConfigError, match=r"^data: checkpoint step 2 was trained on data [0-9a-f]{16}, "
                                          r"this run's data is [0-9a-f]{16} \(the files"):
        plan_start(cfg, [manifest], [])


def test_mock_data_is_megatron_mock_text_in_the_same_address():
    cfg = resolve(load_config("config.yaml", ["cluster.num_workers=2", "train.objective=ce", "data.kind=mock"]),
                  num_gpus=0)
    mock = open_data(cfg)
    batch = mock.batch(3)
    batch.validate(cfg.model.vocab_size)
    ids, eod, vocab = batch.input_ids, cfg.model.vocab_size - 1, cfg.model.vocab_size
    nxt, cur = ids[:, 1:], ids[:, :-1]
    # megatron's mock documents are 1, 2, 3, ... (mod vocab) then EOD; a new one starts at 1
    assert ((nxt == (cur + 1) % vocab) | (nxt == eod) | ((cur == eod) & (nxt == 1))).all()
    assert (np.stack([mock.rows(3, 2, d) for d in range(2)], 1).reshape(ids.shape) == ids.numpy()).all()


def test_a_ce_checkpoint_resumes_at_another_dp_on_the_same_rows(ce_reference, stdlib_corpus, tmp_path, data):
    from checkpoint import CheckpointManager
    from ftrain.control.actor_group import ActorGroup
    from ftrain.trainer import Trainer
    from megatron_actor import MegatronActor

    ref_losses, _, ckpt = ce_reference
    manifests = [m for m in CheckpointManager(str(ckpt)).committed_manifests() if m.step == 2]
    assert manifests, f"the reference wrote no checkpoint of step 2 under {ckpt}"
    cfg = data_cfg(stdlib_corpus, "cluster.num_workers=1", f"checkpoint.uri={ckpt}", tmp_path=tmp_path)
    group = ActorGroup(MegatronActor, cfg)
    try:
        trainer = Trainer(cfg, group, CheckpointManager.from_config(cfg.checkpoint), data=data)
        trainer.committed_step = min(r["step"] for r in group.call("load_checkpoint", manifests[0]))
        trainer.train(4)
    finally:
        group.shutdown()
    assert trainer.data_digests == {s: data.batch(s).digest() for s in (3, 4)}  # the same rows at dp=1
    assert {s: trainer.losses[s] for s in (3, 4)} == pytest.approx({s: ref_losses[s] for s in (3, 4)}, rel=1e-5)


def test_prepare_reads_jsonl_gz_and_parquet_as_jsonl_and_writes_what_megatron_reads(stdlib_corpus, tmp_path):
    import gzip

    import pyarrow as pa
    import pyarrow.parquet as pq
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    from transformers import AutoTokenizer

    from ftrain.data.prepare import prepare

    tok, _ = stdlib_corpus
    lines = "".join(f'{{"text": "row {i}: def f(x): return x + {i}"}}\n' for i in range(50))
    (tmp_path / "a.jsonl").write_text(lines)
    with gzip.open(tmp_path / "b.jsonl.gz", "wt") as f:
        f.write(lines)
    pq.write_table(pa.table({"text": [f"row {i}: def f(x): return x + {i}" for i in range(50)]}), tmp_path / "c.parquet")
    a = prepare([str(tmp_path / "a.jsonl")], tok, str(tmp_path / "a"))
    b = prepare([str(tmp_path / "b.jsonl.gz")], tok, str(tmp_path / "b"))
    c = prepare([str(tmp_path / "c.parquet")], tok, str(tmp_path / "c"))
    for ext in (".bin", ".idx"):
        assert open(a + ext, "rb").read() == open(b + ext, "rb").read() == open(c + ext, "rb").read()
    ds, t = IndexedDataset(a), AutoTokenizer.from_pretrained(tok)
    assert len(ds) == 50 and t.decode(ds[7].tolist()) == "row 7: def f(x): return x + 7<|endoftext|>"


def test_any_blend_any_step_any_dp_interleaves_to_the_global_batch(data):
    from hypothesis import given, settings
    from hypothesis import strategies as st

    windows = data.windows[0]

    @settings(max_examples=30, deadline=None, derandomize=True)
    @given(weights=st.lists(st.floats(0.05, 1.0), min_size=1, max_size=4), step=st.integers(1, 50_000),
           dp=st.sampled_from([1, 2, 4, 8]), seed=st.integers(0, 2**31))
    def check(weights, step, dp, seed):
        blend = Data([(w, windows) for w in weights], seed, 16)
        full = blend.addresses(step)
        parts = [blend.addresses(step, dp, d) for d in range(dp)]
        assert [parts[j % dp][j // dp] for j in range(16)] == full
        assert Data([(w, windows) for w in weights], seed, 16).addresses(step) == full  # pure

    check()


def test_a_dp_shrink_with_ce_trains_the_same_rows(ce_reference, stdlib_corpus, tmp_path, data):
    from checkpoint import CheckpointManager
    from ftrain.control.actor_group import ActorGroup
    from ftrain.trainer import Trainer
    from megatron_actor import MegatronActor

    ref_losses, _, _ = ce_reference
    cfg = data_cfg(stdlib_corpus, "fault_tolerance.min_dp=1", "fault_tolerance.refill_spares=false",
                   "chaos.events=[{step: 3, rank: 1, kind: kill, point: step_start}]", tmp_path=tmp_path)
    group = ActorGroup(MegatronActor, cfg)
    try:
        trainer = Trainer(cfg, group, CheckpointManager.from_config(cfg.checkpoint), data=data)
        trainer.train(4)
        dp = group.dims.dp
    finally:
        group.shutdown()
    assert dp == 1 and trainer.recoveries[0].restore_source == "peer"
    assert trainer.data_digests == {s: data.batch(s).digest() for s in range(1, 5)}
    assert [trainer.losses[s] for s in (1, 2)] == [ref_losses[s] for s in (1, 2)]
    assert [trainer.losses[s] for s in (3, 4)] == pytest.approx([ref_losses[s] for s in (3, 4)], rel=1e-5)


def test_megatron_core_without_its_compiled_helpers_is_one_line(stdlib_corpus, monkeypatch):
    import sys

    from ftrain.config import ConfigError

    monkeypatch.setitem(sys.modules, "megatron.core.datasets.helpers_cpp", None)  # as a build without g++
    with pytest.raises(ConfigError, match=r"^data.path: megatron-core has no C\+\+ dataset helpers"):
        open_data(data_cfg(stdlib_corpus))


def test_the_pretrain_cpu_preset_opens_on_the_stdlib_corpus(stdlib_corpus):
    tok, prefix = stdlib_corpus
    cfg = resolve(load_config("configs/pretrain_cpu.yaml", [f"data.path={prefix}", f"data.tokenizer={tok}"]),
                  num_gpus=0)
    preset = open_data(cfg)
    assert preset.batch(1).input_ids.shape == (cfg.train.global_batch_size, cfg.train.seq_len)
    assert len(preset.tokenizer) == cfg.model.vocab_size == 2048


def test_data_prepare_without_a_tokenizer_says_so_in_one_line_in_the_commands_words(tmp_path):
    """`main.py data prepare --tokenizer DIR` where DIR is no tokenizer: exit 2 and one line on
    stderr naming `--tokenizer` (the flag typed, not the config key), nothing before it (no
    Megatron-Core import warnings)."""
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"text": "hello"}\n')
    proc = _cli("data", "prepare", "--input", str(rows), "--tokenizer", str(tmp_path / "none"),
                "--output-prefix", str(tmp_path / "out"))
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr
    assert proc.stderr.splitlines() == [f"error: --tokenizer: '{tmp_path / 'none'}' is not a local directory "
                                        "(tokenizer.json, tokenizer_config.json); nothing is downloaded at run time"]
