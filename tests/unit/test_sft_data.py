"""SFT, preference and KTO data: loss masks, chat turns, formats, mixtures, bad rows, synthetic tasks."""

from __future__ import annotations

import json

import pytest

from hpc_rlhf.config.supervised import SupervisedDataConfig
from hpc_rlhf.data.packing import TokenSample
from hpc_rlhf.data.preference import build_kto_datasets, build_preference_datasets, mismatched_samples
from hpc_rlhf.data.sft import build_sft_datasets
from hpc_rlhf.data.sources import DataError
from hpc_rlhf.data.synthetic_preference import task_rows, write_supervised_task_if_missing
from hpc_rlhf.models.tiny import build_char_tokenizer


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _data(paths, **kw):
    return SupervisedDataConfig(train_data=paths, **kw)


def _trained_text(tok, sample: TokenSample) -> str:
    return tok.decode([i for i, m in zip(sample.input_ids, sample.loss_mask) if m])


def _context_text(tok, sample: TokenSample) -> str:
    return tok.decode([i for i, m in zip(sample.input_ids, sample.loss_mask) if not m])


def test_prompt_response_masks_only_the_response_and_eos(tok, tmp_path):
    path = _write(tmp_path / "d.jsonl", [{"input": "3+4=", "output": "7"}])
    (sample,), _ = build_sft_datasets(_data([path], input_template="Q {}"), tok, 0)
    assert tok.decode(sample.input_ids) == "Q 3+4=7<eos>"
    assert _context_text(tok, sample) == "Q 3+4="
    assert sample.input_ids[-1] == tok.eos_token_id and sample.loss_mask[-1]
    assert sample.num_targets == 2


def test_chat_template_single_and_multi_turn(tok, tmp_path):
    path = _write(tmp_path / "d.jsonl", [{"input": "1+1=", "output": "2"}])
    (single,), _ = build_sft_datasets(_data([path], apply_chat_template=True), tok, 0)
    assert _context_text(tok, single) == "Q: 1+1=\nA: "
    assert _trained_text(tok, single) == "2<eos>\n"

    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},
            {"role": "user", "content": "2+2"}, {"role": "assistant", "content": "4"}]
    path = _write(tmp_path / "chat.jsonl", [{"messages": chat}])
    (multi,), _ = build_sft_datasets(_data([path], messages_key="messages", apply_chat_template=True), tok, 0)
    assert tok.decode(multi.input_ids) == "Q: hi\nA: yo<eos>\nQ: 2+2\nA: 4<eos>\n"
    assert _trained_text(tok, multi) == "yo<eos>\n4<eos>\n"  # both assistant turns, no user text
    assert _context_text(tok, multi) == "Q: hi\nA: Q: 2+2\nA: "


def test_pretrain_mode_trains_every_token_and_truncation(tok, tmp_path):
    path = _write(tmp_path / "d.jsonl", [{"input": "hello world"}])
    (sample,), _ = build_sft_datasets(_data([path], pretrain_mode=True), tok, 0)
    assert all(sample.loss_mask) and tok.decode(sample.input_ids) == "hello world<eos>"
    (short,), _ = build_sft_datasets(_data([path], pretrain_mode=True, max_len=4), tok, 0)
    assert len(short) == 4
    # A prompt that fills max_len leaves nothing to train on: the row is dropped (and the data is empty).
    path = _write(tmp_path / "long.jsonl", [{"input": "1234567", "output": "8"}])
    with pytest.raises(DataError, match="no usable"):
        build_sft_datasets(_data([path], max_len=5), tok, 0)


def test_bad_rows_name_file_row_and_key_or_are_skipped(tok, tmp_path):
    path = _write(tmp_path / "d.jsonl", [{"input": "1+1=", "output": "2"}, {"input": "2+2="}, {"input": 5, "output": "x"}])
    with pytest.raises(DataError, match=r"d\.jsonl: line 2: key 'output': missing") as err:
        build_sft_datasets(_data([path]), tok, 0)
    assert (err.value.row, err.value.key) == (1, "output")
    train, _ = build_sft_datasets(_data([path], skip_bad_rows=True), tok, 0)
    assert len(train) == 1
    with open(path, "a") as f:
        f.write('{"input": "3+3=", "output": \n')  # invalid JSON: skipped and counted like the other bad rows
    train, _ = build_sft_datasets(_data([path], skip_bad_rows=True), tok, 0)
    assert len(train) == 1


def test_formats_and_mixture_counts(tok, tmp_path):
    import datasets

    rows = [{"input": f"{i}+0=", "output": str(i)} for i in range(10)]
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "a.parquet"))
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    (tmp_path / "c.json").write_text(json.dumps(rows))
    paths = [str(tmp_path / "a.parquet"), str(tmp_path / "saved"), str(tmp_path / "c.json")]
    train, _ = build_sft_datasets(_data(paths), tok, 0)
    assert len(train) == 30
    mixed, _ = build_sft_datasets(_data(paths[:2], train_data_probs=[0.7, 0.3], max_samples=20), tok, 0)
    assert len(mixed) == 20


def test_preference_pairs_masks_margin_and_chat_conversations(tok, tmp_path):
    path = _write(tmp_path / "p.jsonl", [{"prompt": "1+2=", "chosen": "3", "rejected": "5", "m": 0.5}])
    data = _data([path], eval_data=[path], margin_key="m")
    (pair,), (eval_pair,) = build_preference_datasets(data, tok, 0)
    assert tok.decode(pair.chosen.input_ids) == "1+2=3<eos>" and _trained_text(tok, pair.rejected) == "5<eos>"
    assert pair.margin == 0.5 and eval_pair == pair

    conv = lambda answer: [{"role": "user", "content": "1+2="}, {"role": "assistant", "content": answer}]  # noqa: E731
    path = _write(tmp_path / "c.jsonl", [{"chosen": conv("3"), "rejected": conv("4")}])
    (pair,), _ = build_preference_datasets(_data([path], prompt_key=None, apply_chat_template=True), tok, 0)
    assert _context_text(tok, pair.chosen) == "Q: 1+2=\nA: " and _trained_text(tok, pair.chosen) == "3<eos>\n"
    bad = _write(tmp_path / "b.jsonl", [{"prompt": "1+2=", "chosen": "3", "rejected": "", "m": 1}])
    with pytest.raises(DataError, match="key 'rejected': empty"):
        build_preference_datasets(_data([bad]), tok, 0)


def test_kto_labels_and_mismatched_pairs(tok, tmp_path):
    rows = [{"prompt": "1+1=", "completion": "2", "label": True}, {"prompt": "2+2=", "completion": "9", "label": 0},
            {"prompt": "3+3=", "completion": "6", "label": "desirable"}]
    train, _ = build_kto_datasets(_data([_write(tmp_path / "k.jsonl", rows)]), tok, 0)
    assert [s.desirable for s in train] == [True, False, True]
    kl = mismatched_samples(train, max_len=32)
    assert [tok.decode(s.input_ids) for s in kl] == ["1+1=9<eos>", "2+2=6<eos>", "3+3=2<eos>"]
    assert [_trained_text(tok, s) for s in kl] == ["9<eos>", "6<eos>", "2<eos>"]
    bad = _write(tmp_path / "bad.jsonl", [{"prompt": "1+1=", "completion": "2", "label": "maybe"}])
    with pytest.raises(DataError, match="key 'label': KTO label"):
        build_kto_datasets(_data([bad]), tok, 0)


def test_synthetic_tasks_are_seeded_and_correct(tmp_path):
    for row in task_rows("sft_arithmetic", 50, 1):
        a, b = row["input"][:-1].split("+")
        assert int(row["output"]) == int(a) + int(b)
    for row in task_rows("preference_arithmetic", 50, 1):
        a, b = row["prompt"][:-1].split("+")
        assert int(row["chosen"]) == int(a) + int(b) != int(row["rejected"])
    kto = task_rows("kto_arithmetic", 50, 1)
    assert sum(r["label"] for r in kto) == 25
    assert all((int(r["completion"]) == sum(map(int, r["prompt"][:-1].split("+")))) == r["label"] for r in kto)
    path = write_supervised_task_if_missing("sft_arithmetic", tmp_path / "x.jsonl", 20, seed=3)
    assert path.read_text() == "".join(json.dumps(r) + "\n" for r in task_rows("sft_arithmetic", 20, 3))
    with pytest.raises(ValueError, match="unknown data.synthetic_task"):
        task_rows("chess", 1, 0)
