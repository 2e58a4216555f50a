"""SFT data (data_prepare.prepare_sft, data.Conversations): one conversation per row rendered
with the chat template, loss on assistant tokens only. The trained-on tokens decode to exactly
the assistant turns; bad templates and overlong rows are one line at prepare time; the ce
update does not depend on the split; a short run's loss falls and a peer recovery replays it
bitwise; on one GPU the Megatron engine trains SFT rows (marker `gpu`)."""
import ast
import json
import re
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch

from ftrain.config import ConfigError, load_config, resolve
from ftrain.data.dataset import open_data

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SEQ_LEN = 96  # every fixture conversation fits (the longest is 93 tokens)


def conversations(n: int = 200) -> list[list[dict]]:
    """`n` conversations about standard-library modules (real text, no download): "what does
    module X do?" answered with the first line of its docstring; every third has a system
    message, every fourth a second turn."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for p in sorted(root.rglob("*.py")):
        if {"site-packages", "test", "tests", "idlelib"} & set(p.relative_to(root).parts):
            continue
        doc = ast.get_docstring(ast.parse(p.read_text(encoding="utf-8", errors="replace")))
        line = doc.strip().splitlines()[0].strip() if doc else ""
        if not 10 < len(line) < 60:
            continue
        i = len(out)
        chat = [{"role": "system", "content": "Be brief."}] if i % 3 == 0 else []
        chat += [{"role": "user", "content": f"What is {p.stem}?"}, {"role": "assistant", "content": line}]
        if i % 4 == 0:
            chat += [{"role": "user", "content": "File?"}, {"role": "assistant", "content": f"{p.stem}.py"}]
        out.append(chat)
        if len(out) == n:
            break
    return out


@pytest.fixture(scope="module")
def sft_corpus(stdlib_corpus, tmp_path_factory):
    """(tokenizer dir, chat template file, chats.jsonl, conversations, dataset prefix): the
    fixture tokenizer (it has no chat template of its own) with a ChatML template file."""
    from ftrain.data.prepare import prepare_sft

    tok, _ = stdlib_corpus
    out = tmp_path_factory.mktemp("sft")
    (out / "chatml.jinja").write_text(CHATML)
    chats = conversations()
    (out / "chats.jsonl").write_text("".join(json.dumps({"messages": c}) + "\n" for c in chats))
    prefix = prepare_sft([str(out / "chats.jsonl")], tok, str(out / "chats"), max_len=SEQ_LEN,
                         chat_template=str(out / "chatml.jinja"))
    return tok, str(out / "chatml.jinja"), str(out / "chats.jsonl"), chats, prefix


def sft_cfg(sft_corpus, *overrides, tmp_path="runs/test_sft"):
    tok, _, _, _, prefix = sft_corpus
    return resolve(load_config("config.yaml", [
        "cluster.num_workers=2", "cluster.num_spares=0", "checkpoint.interval=0",
        f"run_dir={tmp_path}", f"checkpoint.uri={tmp_path}/ckpt", "model.vocab_size=2048",
        f"train.seq_len={SEQ_LEN}", f"model.max_seq_len={SEQ_LEN}", "train.objective=ce", "data.kind=sft",
        f"data.path={prefix}", f"data.tokenizer={tok}", *overrides]), num_gpus=0)


@pytest.fixture(scope="module")
def sft(sft_corpus):
    return open_data(sft_cfg(sft_corpus))


def test_the_loss_mask_decodes_to_exactly_the_assistant_turns(sft_corpus):
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    from transformers import AutoTokenizer

    from ftrain.data.dataset import LOSS_MASK_SUFFIX

    tok_dir, _, _, chats, prefix = sft_corpus
    tok = AutoTokenizer.from_pretrained(tok_dir)
    ids, masks = IndexedDataset(prefix), IndexedDataset(prefix + LOSS_MASK_SUFFIX)
    assert len(ids) == len(masks) == len(chats) == 200
    for i, chat in enumerate(chats):
        t, m = ids[i], masks[i].astype(bool)
        assert tok.decode(t[m].tolist()) == "".join(c["content"] + "<|im_end|>\n" for c in chat
                                                   if c["role"] == "assistant"), i
        assert t.tolist() == tok.apply_chat_template(chat, chat_template=CHATML)["input_ids"]  # the same tokens


def test_sft_batches_are_the_masks_padded_and_the_same_rows_at_any_dp(sft):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    from ftrain.data.dataset import LOSS_MASK_SUFFIX

    masks = IndexedDataset(sft.names[0] + LOSS_MASK_SUFFIX)
    for step in (1, 2, len(sft.windows[0]) // sft.gbs + 1):  # the last crosses the first epoch's end
        batch = sft.batch(step)
        batch.validate(2048)
        for row, (_, _, _, w) in enumerate(sft.addresses(step)):
            n = len(masks[w])
            assert batch.attention_mask[row].tolist() == [1] * n + [0] * (SEQ_LEN - n)
            assert batch.loss_mask[row, 1:n].tolist() == masks[w][1:].tolist()
            assert batch.loss_mask[row, 0] == 0 and not batch.loss_mask[row, n:].any()
            assert (batch.input_ids[row, n:] == sft.tokenizer.pad_token_id).all()
        for dp in (2, 4):
            parts = [sft.batch(step, dp, d) for d in range(dp)]
            for name in ("input_ids", "attention_mask", "loss_mask"):
                together = torch.stack([getattr(p, name) for p in parts], 1).reshape(batch.input_ids.shape)
                assert torch.equal(together, getattr(batch, name)), (step, dp, name)


def test_the_ce_update_on_sft_rows_does_not_depend_on_dp_or_the_micro_batch_split(sft):
    import dataclasses

    from ftrain.objectives.ppo import ce_objective, global_loss_weights

    batch = sft.batch(3)
    m = len(batch) // 2  # two mini-batches per step
    batch = dataclasses.replace(batch, loss_weights=global_loss_weights(batch.loss_mask, "token-mean", m))
    log_probs = -torch.rand(batch.loss_mask.shape, generator=torch.Generator().manual_seed(5))
    for k in range(2):
        mini, lp = batch.slice(k * m, (k + 1) * m), log_probs[k * m:(k + 1) * m]
        expected = -(lp * mini.loss_mask).sum() / mini.loss_mask.sum()  # the token-mean over the mini-batch
        for dp, micro in ((1, m), (2, 2), (4, 1), (8, 1)):
            total = sum(ce_objective(lp[d::dp][j * micro:(j + 1) * micro], part)[0]
                        for d in range(dp) for j, part in enumerate(mini.strided(d, dp).chunk(m // dp // micro)))
            assert total.item() == pytest.approx(expected.item(), rel=1e-6), (k, dp, micro)


def _prepare(*args):
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return subprocess.run([sys.executable, os.path.join(root, "main.py"), "data", "prepare", *args],
                          cwd=root, capture_output=True, text=True)


@pytest.mark.parametrize("case", ["overlong", "no_template"])
def test_bad_sft_input_is_one_line_and_exit_2(sft_corpus, tmp_path, case):
    from ftrain.data.dataset import load_tokenizer
    from ftrain.data.prepare import ChatTemplate

    tok, template, chats, convs, _ = sft_corpus
    if case == "overlong":
        n = len(ChatTemplate(load_tokenizer(tok), tok, CHATML).encode(convs[0], "row 1")[0])
        args, expected = ["--chat-template", template, "--max-len", "20"], (
            f"error: --max-len: conversation 1 of {chats} is {n} tokens, more than --max-len 20; raise --max-len "
            "(and train.seq_len) or pass --truncation right (keep its start) or left (keep its end)")
    else:
        args, expected = [], (f"error: --tokenizer: {tok} has no chat template; pass --chat-template FILE (a Jinja "
                              "chat template, e.g. the model's chat_template.jinja)")
    proc = _prepare("--input", chats, "--tokenizer", tok, "--output-prefix", str(tmp_path / "out"),
                    "--messages-key", "messages", *args)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1] == expected and "Traceback" not in proc.stderr, proc.stderr[-2000:]


def test_truncation_keeps_the_start_or_the_end_on_purpose(sft_corpus, tmp_path):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    from ftrain.data.dataset import LOSS_MASK_SUFFIX
    from ftrain.data.prepare import prepare_sft

    tok, template, chats, _, full = sft_corpus
    whole, whole_mask = IndexedDataset(full), IndexedDataset(full + LOSS_MASK_SUFFIX)
    for how in ("right", "left"):
        out = prepare_sft([chats], tok, str(tmp_path / how), max_len=48, truncation=how, chat_template=template)
        cut, cut_mask = IndexedDataset(out), IndexedDataset(out + LOSS_MASK_SUFFIX)
        for i in range(len(whole)):
            keep = slice(None, 48) if how == "right" else slice(-48, None)
            assert cut[i].tolist() == whole[i][keep].tolist() and cut_mask[i].tolist() == whole_mask[i][keep].tolist()


@pytest.mark.parametrize("template, expected", [
    # rewrites earlier assistant turns (as templates that strip <think> blocks do)
    ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['role'] == 'assistant' and not loop.last %}"
     "{{ m['content'][:3] }}{% else %}{{ m['content'] }}{% endif %}<|im_end|>\n{% endfor %}"
     "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
     r"is not prefix-stable: conversation 1 of \S+ renders its first 2 messages differently once later ones follow"),
    # never shows what the assistant said
    (CHATML.replace("{{ m['content'] }}", "{{ m['content'] if m['role'] != 'assistant' else '...' }}"),
     r"cannot locate assistant message 2 of conversation 1 of \S+ in the chat template"),
])
def test_a_chat_template_whose_assistant_turns_cannot_be_located_is_one_line(sft_corpus, tmp_path, template,
                                                                            expected):
    from ftrain.data.prepare import prepare_sft

    tok, _, _, _, _ = sft_corpus
    (tmp_path / "t.jinja").write_text(template)
    chat = [{"role": "user", "content": "Hi?"}, {"role": "assistant", "content": "Hello there."},
            {"role": "user", "content": "And?"}, {"role": "assistant", "content": "Nothing more."}]
    (tmp_path / "c.jsonl").write_text(json.dumps({"messages": chat}) + "\n")
    with pytest.raises(ConfigError, match=r"^--chat-template: .*; pass --chat-template FILE$") as e:
        prepare_sft([str(tmp_path / "c.jsonl")], tok, str(tmp_path / "out"), chat_template=str(tmp_path / "t.jinja"))
    assert re.search(expected, str(e.value)), str(e.value)


def test_train_checks_sft_files_before_any_actor(sft_corpus, tmp_path):
    import shutil

    from ftrain.data.dataset import LOSS_MASK_SUFFIX

    prefix = sft_corpus[4]
    copy = str(tmp_path / "copy_messages_document")
    for ext in (".bin", ".idx"):
        shutil.copy(prefix + ext, copy + ext)
    with pytest.raises(ConfigError, match=r"^data.path: .*copy_messages_document has no SFT loss masks "
                                          r"\(copy_messages_document_loss_mask.bin/.idx\); make SFT data with"):
        open_data(sft_cfg(sft_corpus, f"data.path={copy}"))
    for ext in (".bin", ".idx"):
        shutil.copy(prefix + LOSS_MASK_SUFFIX + ext, copy + LOSS_MASK_SUFFIX + ext)
    with pytest.raises(ConfigError, match=r"^data.path: conversation [\d,]+ of .* is \d+ tokens, more than "
                                          r"train.seq_len=16; raise train.seq_len or prepare again with --max-len 16"):
        open_data(sft_cfg(sft_corpus, f"data.path={copy}", "train.seq_len=16"))
    with pytest.raises(ConfigError, match="^data.eod_mask_loss: is for packed text"):
        sft_cfg(sft_corpus, "data.eod_mask_loss=true")


def test_sft_loss_falls(ray_session, sft_corpus, tmp_path):
    from conftest import reference_run

    losses, _ = reference_run(sft_cfg(sft_corpus, "train.steps=8", "train.lr=0.01", tmp_path=tmp_path), 8)
    assert abs(losses[1] - np.log(2048)) < 0.3, losses[1]  # uniform over the vocabulary at the start
    assert losses[8] < losses[1] - 1.5, losses


@pytest.mark.slow
def test_sft_with_a_rank_killed_inside_the_allreduce_matches_the_run_without_failure_bitwise(
        ray_session, sft_corpus, sft, tmp_path):
    from checkpoint import CheckpointManager
    from ftrain.control.actor_group import ActorGroup
    from ftrain.trainer import Trainer
    from megatron_actor import MegatronActor

    from conftest import reference_run

    sets = ("train.steps=8", "train.lr=0.01")
    ref_losses, ref_states = reference_run(sft_cfg(sft_corpus, *sets, tmp_path=tmp_path / "ref"), 8)
    cfg = sft_cfg(sft_corpus, *sets, "cluster.num_spares=1",
                  "chaos.events=[{step: 5, rank: 1, kind: kill, point: inside_allreduce}]", tmp_path=tmp_path)
    group = ActorGroup(MegatronActor, cfg)
    try:
        trainer = Trainer(cfg, group, CheckpointManager.from_config(cfg.checkpoint), data=sft)
        trainer.train(8)
        assert group.state_digests() == ref_states
    finally:
        group.shutdown()
    assert [(tl.restore_source, tl.steps_lost) for tl in trainer.recoveries] == [("peer", 0)]
    assert trainer.losses == ref_losses
    assert trainer.data_digests == {s: sft.batch(s).digest() for s in range(1, 9)}


def _megatron_sft(rank, world, store, tok, prefix, steps) -> dict:
    """One rank of the Megatron engine (the GPU tests' small GPT, 4 layers of hidden 128, no
    distributed optimizer, with the fixture tokenizer's 2,048-token vocabulary) fed SFT rows as the trainer feeds them at
    dp=1 (the global batch, token-mean `loss_weights`; two optimizer updates per step, where
    PPO would run a behaviour pass). Step 1 three times from the initial state (`rollback(0)`):
    as it is, with its padding replaced by other tokens (loss mask 0 there, after every scored
    token: the same loss when the mask is honoured) and with the loss mask on every
    conversation token (another loss); then `steps` steps. Returns {"probes": {name: loss},
    "losses": [...], "behaviour_passes": count}."""
    import dataclasses

    import torch.distributed as dist

    from ftrain.distributed.parallel_dims import ParallelDims
    from ftrain.engines.megatron_engine import MegatronEngine
    from ftrain.objectives.ppo import step_loss_weights

    cfg = resolve(load_config(None, [
        "model.distributed_optimizer=false", "model.num_layers=4", "model.hidden_size=128", "model.num_heads=4",
        "model.ffn_hidden_size=256",
        "model.vocab_size=2048", f"model.max_seq_len={SEQ_LEN}", f"train.seq_len={SEQ_LEN}", "cluster.num_workers=1",
        "train.global_batch_size=16", "train.mini_batch_size=8", "train.micro_batch_size=4", "train.lr=0.01",
        f"train.steps={steps}", "train.objective=ce", "data.kind=sft", f"data.path={prefix}", f"data.tokenizer={tok}"]),
        num_gpus=int(torch.cuda.is_available()))  # bf16 on the GPU; runs on the CPU too (gloo, float32)
    data = open_data(cfg)
    engine = MegatronEngine(cfg)
    engine.connect(dist.PrefixStore("gen1", store), ParallelDims.from_config(cfg), rank)
    passes, behaviour = [], engine._behaviour_log_probs
    engine._behaviour_log_probs = lambda *a, **k: (passes.append(1), behaviour(*a, **k))[1]

    def step(batch, s: int) -> float:
        engine.snapshot()
        batch = dataclasses.replace(batch, loss_weights=step_loss_weights(batch.loss_mask, cfg.train, "token-mean", 1))
        return engine.train_step(batch, s)["loss"]

    first = data.batch(1)
    pad = first.attention_mask == 0
    other = torch.randint(0, 2048, first.input_ids.shape, generator=torch.Generator().manual_seed(0))
    everywhere = first.attention_mask.float()
    everywhere[:, 0] = 0
    probes = {}
    for name, batch in {"as_is": first,
                        "padding_changed": dataclasses.replace(first, input_ids=torch.where(pad, other, first.input_ids)),
                        "mask_everywhere": dataclasses.replace(first, loss_mask=everywhere)}.items():
        probes[name] = step(batch, 1)
        assert engine.rollback(0)
    losses = [step(data.batch(s), s) for s in range(1, steps + 1)]
    return {"probes": probes, "losses": losses, "behaviour_passes": len(passes)}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_megatron_sft_on_one_gpu_honours_the_masks_and_the_loss_falls(sft_corpus):
    """The Megatron engine on one GPU trains the SFT corpus: the first loss is about ln(vocab)
    (uniform at the start, averaged over assistant tokens only), the loss falls by more than 1
    in 10 steps, tokens outside the loss mask (the padding) change nothing, the mask on every
    token changes the loss, and no behaviour pass runs (`ce`)."""
    from ranks import spawn_ranks

    tok, _, _, _, prefix = sft_corpus
    (res,) = spawn_ranks(_megatron_sft, 1, tok, prefix, 10, timeout_s=600)
    probes, losses = res["probes"], res["losses"]
    assert abs(probes["as_is"] - np.log(2048)) < 0.3, res
    assert probes["padding_changed"] == pytest.approx(probes["as_is"], rel=1e-4), res
    assert abs(probes["mask_everywhere"] - probes["as_is"]) > 1e-2, res
    assert losses[0] == pytest.approx(probes["as_is"], rel=1e-3) and losses[-1] < losses[0] - 1.0, res
    assert res["behaviour_passes"] == 0, res
