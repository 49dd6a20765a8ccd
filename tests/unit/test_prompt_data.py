"""Prompt data: file formats, mixtures, templates, row validation, the resumable stream, tokenization."""

import collections
import json

import pytest

from hpc_rlhf.config.schema import DataConfig
from hpc_rlhf.data.prompts import Prompt, PromptDataset, PromptStream, tokenize_prompts
from hpc_rlhf.data.sources import DataError, SkippedRows, load_source, mixture_plan, proportional_counts

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> {% endif %}"
)
WORDS = ["hello", "world", "Question:", "Answer:", "what", "is", "1", "2", "+", "<|user|>", "<|assistant|>",
         "<|system|>", "be", "brief"] + [f"w{i}" for i in range(40)]


def make_tokenizer(chat_template=CHAT_TEMPLATE, post="<s> $A"):
    """A word-level tokenizer whose add_special_tokens prepends BOS (and optionally appends EOS)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["<pad>", "<s>", "</s>", "<unk>"] + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(single=post, special_tokens=[("<s>", 1), ("</s>", 2)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   unk_token="<unk>")
    fast.chat_template = chat_template
    return fast


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


ROWS = [{"input": f"question {i}", "label": i, "extra": "x" * i} for i in range(7)]


def write_format(tmp_path, fmt, rows=ROWS, name="data"):
    if fmt == "jsonl":
        return write_jsonl(tmp_path / f"{name}.jsonl", rows)
    if fmt == "json":
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(rows))
        return str(path)
    if fmt == "json_lines_in_json":
        path = tmp_path / f"{name}.json"
        path.write_text("\n".join(json.dumps(r) for r in rows))
        return str(path)
    if fmt == "parquet":
        import pandas as pd

        path = tmp_path / f"{name}.parquet"
        pd.DataFrame(rows).to_parquet(path)
        return str(path)
    if fmt == "save_to_disk":
        import datasets

        path = tmp_path / f"{name}_ds"
        datasets.Dataset.from_list(rows).save_to_disk(str(path))
        return str(path)
    if fmt == "dataset_dict":
        import datasets

        path = tmp_path / f"{name}_dd"
        datasets.DatasetDict({"test": datasets.Dataset.from_list(rows[:2]),
                              "train": datasets.Dataset.from_list(rows)}).save_to_disk(str(path))
        return str(path)
    raise AssertionError(fmt)


# -- formats ------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["jsonl", "json", "json_lines_in_json", "parquet", "save_to_disk", "dataset_dict"])
def test_every_format_loads_the_same_rows(tmp_path, fmt):
    path = write_format(tmp_path, fmt)
    ds = PromptDataset([path], input_key="input", label_key="label")
    assert [(p.text, p.label, p.index) for p in ds] == [(r["input"], r["label"], i) for i, r in enumerate(ROWS)]
    assert all(p.source == path for p in ds)
    assert ds.num_skipped == 0


def test_missing_and_unsupported_paths_fail_naming_them(tmp_path):
    with pytest.raises(DataError, match="nope.jsonl: no such file"):
        PromptDataset([str(tmp_path / "nope.jsonl")])
    csv = tmp_path / "data.csv"
    csv.write_text("input\nhi\n")
    with pytest.raises(DataError, match="data.csv: unsupported format"):
        PromptDataset([str(csv)])
    not_a_dataset = tmp_path / "folder"
    not_a_dataset.mkdir()
    with pytest.raises(DataError, match="save_to_disk"):
        PromptDataset([str(not_a_dataset)])


def test_invalid_json_line_names_file_and_line(tmp_path):
    path = tmp_path / "broken.jsonl"
    path.write_text('{"input": "a"}\n\n{"input": "b"\n')
    with pytest.raises(DataError, match=r"broken.jsonl: line 3: invalid JSON"):
        PromptDataset([str(path)])


# -- mixtures -----------------------------------------------------------------------------------
def test_proportional_counts_are_exact_and_sum_to_total():
    assert proportional_counts(200, [0.8, 0.2]) == [160, 40]
    assert proportional_counts(10, [1, 1, 1]) == [4, 3, 3]
    assert sum(proportional_counts(997, [0.13, 0.57, 0.3])) == 997
    with pytest.raises(DataError):
        proportional_counts(10, [0.0, 0.0])


def _two_sources(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", [{"input": f"a{i}"} for i in range(100)])
    b = write_jsonl(tmp_path / "b.jsonl", [{"input": f"b{i}"} for i in range(50)])
    return a, b


def test_mixture_counts_follow_probabilities(tmp_path):
    a, b = _two_sources(tmp_path)
    ds = PromptDataset([a, b], probs=[0.8, 0.2], max_samples=200, seed=3)
    assert len(ds) == 200
    assert ds.source_counts() == {a: 160, b: 40}
    # a is over-sampled: every row appears once before any appears twice
    per_row = collections.Counter(p.index for p in ds if p.source == a)
    assert set(per_row) == set(range(100)) and max(per_row.values()) == 2
    # b is under-sampled: distinct rows, not simply the first 40
    b_rows = [p.index for p in ds if p.source == b]
    assert len(set(b_rows)) == 40 and sorted(b_rows) != list(range(40))
    # interleaved, not concatenated
    first_half = [p.source for p in ds[:100]]
    assert first_half.count(b) > 5
    # default total: all usable rows (150), split 120/30
    assert PromptDataset([a, b], probs=[0.8, 0.2]).source_counts() == {a: 120, b: 30}


def test_mixture_is_deterministic_by_seed(tmp_path):
    a, b = _two_sources(tmp_path)
    first = [(p.source, p.index) for p in PromptDataset([a, b], probs=[0.5, 0.5], seed=1)]
    again = [(p.source, p.index) for p in PromptDataset([a, b], probs=[0.5, 0.5], seed=1)]
    other = [(p.source, p.index) for p in PromptDataset([a, b], probs=[0.5, 0.5], seed=2)]
    assert first == again
    assert first != other
    assert mixture_plan([3, 3], [1, 0], 3, seed=0) and all(s == 0 for s, _ in mixture_plan([3, 3], [1, 0], 3, 0))


def test_without_probs_max_samples_takes_the_first_rows_in_order(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", [{"input": f"a{i}"} for i in range(3)])
    # a bad row beyond the limit is never read
    b = write_jsonl(tmp_path / "b.jsonl", [{"input": "b0"}, {"input": "b1"}, {"nokey": 1}])
    ds = PromptDataset([a, b], max_samples=5)
    assert [p.text for p in ds] == ["a0", "a1", "a2", "b0", "b1"]
    assert [p.text for p in PromptDataset([a, b], max_samples=2)] == ["a0", "a1"]


def test_load_source_drops_none_rows_and_keeps_the_first_skip_reasons(tmp_path):
    path = write_jsonl(tmp_path / "a.jsonl", [{"x": 1}, {"x": None}, {"y": 1}, {"y": 2}, {"x": 2}, {"x": 3}])

    def make(row, path, index):
        if "x" not in row:
            raise DataError(f"row {index + 1}: no x")
        return row["x"]

    skipped = SkippedRows(max_reasons=1)
    examples, num_dropped = load_source(path, make, limit=2, skip_bad_rows=True, skipped=skipped)
    assert examples == [1, 2] and num_dropped == 1  # stops at the limit: row 6 is not read
    assert skipped.by_source == {path: 2} and skipped.total == 2 and skipped.reasons == ["row 3: no x"]
    with pytest.raises(DataError, match="row 3: no x"):
        load_source(path, make, skip_bad_rows=False, skipped=SkippedRows(max_reasons=1))


def test_from_config_uses_every_data_key(tmp_path):
    a, b = _two_sources(tmp_path)
    cfg = DataConfig(prompt_data=[a, b], prompt_data_probs=[0.5, 0.5], input_template="Q: {}", max_samples=10)
    ds = PromptDataset.from_config(cfg, seed=7)
    assert len(ds) == 10 and ds.source_counts() == {a: 5, b: 5}
    assert all(p.text.startswith("Q: ") for p in ds)


# -- templates ----------------------------------------------------------------------------------
def test_input_template_is_applied(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"q": "1 + 2 {x}"}])
    ds = PromptDataset([path], input_key="q", input_template="Question: {}\nAnswer:")
    assert ds[0].text == "Question: 1 + 2 {x}\nAnswer:"


@pytest.mark.parametrize("template", ["no placeholder", "{} and {}", "{name}", "{"])
def test_bad_input_template_fails_before_reading(tmp_path, template):
    path = write_jsonl(tmp_path / "d.jsonl", [{"input": "x"}])
    with pytest.raises(DataError, match="data.input_template"):
        PromptDataset([path], input_template=template)


def test_chat_template_wraps_strings_and_takes_message_lists(tmp_path):
    tok = make_tokenizer()
    rows = [
        {"input": "hello world"},
        {"input": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "what is 1 + 2"}]},
    ]
    path = write_jsonl(tmp_path / "chat.jsonl", rows)
    ds = PromptDataset([path], apply_chat_template=True, tokenizer=tok)
    assert ds[0].text == "<s><|user|> hello world <|assistant|> "
    assert ds[1].text == "<s><|system|> be brief <|user|> what is 1 + 2 <|assistant|> "
    templated = PromptDataset([path], apply_chat_template=True, tokenizer=tok, input_template="Question: {}")
    assert templated[0].text == "<s><|user|> Question: hello world <|assistant|> "
    assert templated[1].text == "<s><|system|> be brief <|user|> Question: what is 1 + 2 <|assistant|> "


def test_chat_template_needs_a_template_and_lists_need_chat_mode(tmp_path):
    path = write_jsonl(tmp_path / "chat.jsonl", [{"input": [{"role": "user", "content": "hi"}]}])
    with pytest.raises(DataError, match="chat_template"):
        PromptDataset([path], apply_chat_template=True, tokenizer=make_tokenizer(chat_template=None))
    with pytest.raises(DataError, match=r"chat.jsonl: line 1: key 'input': expected a string, got list"):
        PromptDataset([path])


# -- bad rows -----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "bad_row, key, reason",
    [
        ({"prompt": "x", "label": 1}, "input", "missing"),
        ({"input": 5, "label": 1}, "input", "expected a string, got int"),
        ({"input": "  ", "label": 1}, "input", "empty prompt"),
        ({"input": "x"}, "label", "label is missing"),
        ({"input": "x", "label": None}, "label", "label is null"),
    ],
)
def test_bad_row_error_names_file_row_and_key(tmp_path, bad_row, key, reason):
    rows = [{"input": "ok", "label": 0}, {"input": "ok", "label": 1}, bad_row, {"input": "ok", "label": 3}]
    path = write_jsonl(tmp_path / "rows.jsonl", rows)
    with pytest.raises(DataError, match=reason) as info:
        PromptDataset([path], label_key="label")
    assert f"{path}: line 3: key '{key}'" in str(info.value)
    assert (info.value.path, info.value.row, info.value.key) == (path, 2, key)


def test_skip_mode_skips_invalid_json_lines_with_a_count(tmp_path):
    path = tmp_path / "mixed.jsonl"
    path.write_text('{"input": "a"}\n{"input": "b"\n\n{"input": "c"}\nnot json\n{"x": 1}\n')
    ds = PromptDataset([str(path)], skip_bad_rows=True)
    assert [p.text for p in ds] == ["a", "c"]
    assert ds.num_skipped == 3 and ds.skipped_by_source == {str(path): 3}
    assert [r.split(": ", 2)[1] for r in ds.skip_reasons] == ["line 2", "line 5", "line 6"]


def test_row_numbers_are_one_based_and_jsonl_errors_give_the_line(tmp_path):
    path = tmp_path / "gaps.jsonl"
    path.write_text('{"input": "a"}\n\n\n{"prompt": "b"}\n')  # blank lines: row 2 is on line 4
    with pytest.raises(DataError, match=r"gaps.jsonl: line 4: key 'input': missing") as info:
        PromptDataset([str(path)])
    assert (info.value.row, info.value.line) == (1, 4)


def test_non_object_row_and_bad_chat_message(tmp_path):
    path = write_jsonl(tmp_path / "rows.jsonl", [{"input": "ok"}, ["not", "a", "dict"]])
    with pytest.raises(DataError, match="line 2: expected an object, got list"):
        PromptDataset([path])
    path = write_jsonl(tmp_path / "msgs.jsonl", [{"input": [{"content": "no role"}]}])
    with pytest.raises(DataError, match="line 1: key 'input': message 0 must be an object with 'role'"):
        PromptDataset([path], apply_chat_template=True, tokenizer=make_tokenizer())


def test_parquet_null_label_is_a_bad_row(tmp_path):
    rows = [{"input": "a", "label": 1}, {"input": "b", "label": None}]
    path = write_format(tmp_path, "parquet", rows)
    with pytest.raises(DataError, match=r"row 2: key 'label': label is null"):
        PromptDataset([path], label_key="label")


def test_skip_mode_skips_and_counts(tmp_path):
    rows = [{"input": "a", "label": 1}, {"input": 3, "label": 2}, {"input": "c"}, {"input": "d", "label": 4},
            {"x": 1}, {"input": "f", "label": 6}]
    path = write_jsonl(tmp_path / "rows.jsonl", rows)
    ds = PromptDataset([path], label_key="label", skip_bad_rows=True)
    assert [(p.text, p.index) for p in ds] == [("a", 0), ("d", 3), ("f", 5)]
    assert ds.num_skipped == 3 and ds.skipped_by_source == {path: 3}
    assert "line 2" in ds.skip_reasons[0]
    all_bad = write_jsonl(tmp_path / "bad.jsonl", [{"x": 1}, {"x": 2}])
    with pytest.raises(DataError, match="no usable prompts.*skipped 2"):
        PromptDataset([all_bad], skip_bad_rows=True)


# -- stream -------------------------------------------------------------------------------------
def _dataset(n):
    return [Prompt(text=f"p{i}", label=i, source="mem", index=i) for i in range(n)]


def _texts(batch):
    return [p.text for p in batch]


def test_stream_covers_each_episode_and_stops():
    stream = PromptStream(_dataset(10), batch_size=3, seed=0, num_episodes=2)
    assert stream.num_batches == 6
    batches = [_texts(b) for b in stream]
    assert len(batches) == 6 and all(len(b) == 3 for b in batches)
    ep0, ep1 = sum(batches[:3], []), sum(batches[3:], [])
    assert len(set(ep0)) == 9 and len(set(ep1)) == 9  # one dropped per episode (drop_last)
    assert ep0 != ep1  # reshuffled per episode
    with pytest.raises(StopIteration):
        stream.next_batch()
    assert stream.batches_consumed == 6
    # same seed -> same order; different seed -> different order
    assert [_texts(b) for b in PromptStream(_dataset(10), 3, seed=0, num_episodes=2)] == batches
    assert [_texts(b) for b in PromptStream(_dataset(10), 3, seed=1, num_episodes=2)] != batches


def test_stream_keep_last_partial_batch():
    stream = PromptStream(_dataset(10), batch_size=4, seed=0, num_episodes=1, drop_last=False)
    assert stream.num_batches == 3
    assert [len(b) for b in stream] == [4, 4, 2]


@pytest.mark.parametrize("k", [0, 1, 2, 3, 4, 7, 9])
def test_stream_resume_continues_with_the_exact_next_batch(k):
    data = _dataset(11)
    full = [_texts(b) for b in PromptStream(data, batch_size=3, seed=5, num_episodes=3)]
    assert len(full) == 9
    first = PromptStream(data, batch_size=3, seed=5, num_episodes=3)
    consumed = [_texts(first.next_batch()) for _ in range(k)]
    state = json.loads(json.dumps(first.state_dict()))  # checkpoints are serialised
    resumed = PromptStream(data, batch_size=3, seed=999, num_episodes=3)  # the checkpoint's seed wins
    resumed.load_state_dict(state)
    rest = [_texts(b) for b in resumed]
    assert consumed + rest == full
    assert resumed.batches_consumed == 9


def test_stream_resume_rejects_changed_data_and_small_datasets():
    stream = PromptStream(_dataset(8), batch_size=2)
    stream.next_batch()
    with pytest.raises(DataError, match="had 8 prompts, now 9"):
        PromptStream(_dataset(9), batch_size=2).load_state_dict(stream.state_dict())
    with pytest.raises(DataError, match="cannot fill one batch"):
        PromptStream(_dataset(2), batch_size=3)


# -- tokenization -------------------------------------------------------------------------------
def test_tokenize_adds_bos_once_and_never_eos():
    tok = make_tokenizer(post="<s> $A </s>")
    bos, eos = tok.bos_token_id, tok.eos_token_id
    plain, chat = tokenize_prompts(tok, ["hello world", "<s><|user|> hello world <|assistant|> "], 100)
    assert plain == [bos, tok.convert_tokens_to_ids("hello"), tok.convert_tokens_to_ids("world")]
    assert chat[0] == bos and chat.count(bos) == 1
    assert eos not in plain and eos not in chat
    # a tokenizer that adds nothing keeps the text's own tokens only
    bare = make_tokenizer(post="$A")
    assert tokenize_prompts(bare, ["hello world"], 100) == [[tok.convert_tokens_to_ids("hello"),
                                                             tok.convert_tokens_to_ids("world")]]


def test_tokenize_truncates_from_the_left_keeping_bos():
    tok = make_tokenizer()
    words = [f"w{i}" for i in range(20)]
    (ids,) = tokenize_prompts(tok, [" ".join(words)], prompt_max_len=6)
    assert len(ids) == 6
    assert ids[0] == tok.bos_token_id
    assert tok.convert_ids_to_tokens(ids[1:]) == words[-5:]
    short = tokenize_prompts(tok, ["hello"], prompt_max_len=6)
    assert short == [[tok.bos_token_id, tok.convert_tokens_to_ids("hello")]]
